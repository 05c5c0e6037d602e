"""Benchmark: what the resource view (``zclaw.telemetry.ResourceMeter``) costs a role, as % of one core.

Target: under 1% of one core for every role. Two measurements in one run:

* **per sample**: ``--n`` real samples back to back (psutil ``cpu_percent`` / ``memory_info`` /
  ``num_threads`` on one kept ``psutil.Process``, and NVML with ``--gpu N``), median of ``--rounds``,
  against the interval at which the roles really sample: ``RESOURCE_INTERVAL_S`` for the broker and the
  learner (the meter's own cache: more frequent reports get the last sample) and the worker's hello
  heartbeat (``HEARTBEAT_S``). Cost = time per sample / interval.
* **paced**: for ``--seconds``, a meter with the roles' settings is asked for its report ``--rate`` times a
  second, as the learner does once per update and the broker once per status request; the CPU time spent
  inside those calls over the wall time, which counts the cached answers as well as the real samples. A
  call that follows a sleep runs on cold caches (~10x a hot one), so this is the pessimistic figure; the
  same loop around an empty call, run just before, is printed as the baseline (the timer's own cost).

Both figures are per-process CPU time (``time.process_time``) where it matters: this is what the meter
takes from the role, whatever else runs on the machine.

    python bench/resources.py [--n 2000] [--rounds 5] [--seconds 5] [--rate 200] [--gpu -1]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

from zclaw.telemetry import RESOURCE_INTERVAL_S, ResourceMeter
from zclaw.worker.worker import HEARTBEAT_S


def per_sample_s(n: int, gpu: Optional[int]) -> float:
    """CPU seconds of one real sample (every call samples: no cache, no short-window skip)."""
    meter = ResourceMeter(gpu=gpu, min_interval_s=0.0, cpu_window_s=0.0)
    t0 = time.process_time()
    for _ in range(n):
        meter.sample()
    return (time.process_time() - t0) / n


def cached_s(n: int, gpu: Optional[int]) -> float:
    """CPU seconds of one report between two samples (the learner's per-update call)."""
    meter = ResourceMeter(gpu=gpu, min_interval_s=3600.0)
    meter.report()
    t0 = time.process_time()
    for _ in range(n):
        meter.report()
    return (time.process_time() - t0) / n


def paced(seconds: float, rate: float, gpu: Optional[int], empty: bool = False) -> tuple:
    """(CPU seconds inside the meter / wall seconds, real samples taken) at ``rate`` reports per second;
    ``empty``: the same loop around a call that does nothing (the baseline)."""
    meter = ResourceMeter(gpu=gpu)
    call = (lambda: None) if empty else meter.report
    inside = 0.0
    period = 1.0 / rate
    start = time.monotonic()
    next_at = start
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        if now < next_at:
            time.sleep(next_at - now)
            continue
        next_at += period
        t0 = time.process_time()
        call()
        inside += time.process_time() - t0
    return inside / (time.monotonic() - start), meter.samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="samples per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the paced run")
    ap.add_argument("--rate", type=float, default=200.0, help="reports per second in the paced run")
    ap.add_argument("--gpu", type=int, default=-1, help="CUDA index to read through NVML (-1: none)")
    args = ap.parse_args()
    gpu = args.gpu if args.gpu >= 0 else None

    what = ResourceMeter(gpu=gpu, min_interval_s=0.0).sample().gpu
    sample = statistics.median(per_sample_s(args.n, gpu) for _ in range(args.rounds))
    cached = statistics.median(cached_s(args.n, gpu) for _ in range(args.rounds))
    print(f"gpu figure: {what}")
    print(f"one sample: {sample * 1e6:.1f} us of CPU (median of {args.rounds} rounds of {args.n})")
    print(f"one cached report (between samples): {cached * 1e6:.2f} us of CPU")
    costs = {}
    for role, interval in (("broker / learner", RESOURCE_INTERVAL_S),
                           ("worker (hello heartbeat)", HEARTBEAT_S)):
        costs[role] = 100.0 * sample / interval
        print(f"{role}: one sample per {interval:g} s: {costs[role]:.4f}% of one core")
    base, _ = paced(args.seconds, args.rate, gpu, empty=True)
    share, samples = paced(args.seconds, args.rate, gpu)
    costs["paced"] = 100.0 * share
    print(f"paced: {args.rate:g} reports/s for {args.seconds:g} s ({samples} samples): "
          f"{costs['paced']:.4f}% of one core inside the meter (an empty call: {100.0 * base:.4f}%)")
    worst = max(costs.values())
    print(f"cost of the resource view: {worst:.4f}% of one core (worst of the above; target < 1%: "
          f"{'met' if worst < 1.0 else 'MISSED'})")


if __name__ == "__main__":
    main()
