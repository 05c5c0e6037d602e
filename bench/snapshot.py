"""Benchmark: broker ingest while a store snapshot is being written, against the same
broker between snapshots.

One broker per ``broker.snapshot_mode`` (thread, fork), each under the same load: a synthetic producer
pushing segments as fast as the broker takes them (``bench/pipeline.py``'s producer). The store is filled
to capacity first, so every snapshot writes the whole store; snapshots then come every ``--interval``
seconds. The broker's ``inserted_segments`` counter is read every 50 ms; an interval counts as *during* a
snapshot when one was in progress at both of its ends, and as *between* when none was at either end. Both
rates come from the same run, interleaved at sub-second scale, so background load on the machine hits them
alike (a separate run without snapshots, also printed, is not: it ran at another moment). Target: the rate
during a snapshot / the rate between snapshots >= 0.5.

    python bench/snapshot.py [--seconds 8] [--capacity 1024] [--interval 1.0] [--envs 16] [--T 64]
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import zmq

from pipeline import free_port, produce, segment_arrays  # noqa: E402 (bench/ is on sys.path when run)
from zclaw.wire import LazyPirate, make


def status(req: LazyPirate) -> Dict[str, Any]:
    msg = req.request(make("status"), kinds=("status",))
    if msg is None:
        raise SystemExit("broker did not answer status")
    return msg["report"]


def run(
    seconds: float, capacity: int, T: int, N: int, snapshot_s: float, run_dir: Path, mode: str = "thread"
) -> Dict[str, float]:
    ingest, serve = free_port(), free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "zclaw.cli", "broker", "--run-dir", str(run_dir),
         "--set", f"network.ingest_port={ingest}", "--set", f"network.serve_port={serve}",
         "--set", f"broker.capacity={capacity}", "--set", f"broker.snapshot_s={snapshot_s}",
         "--set", f"broker.snapshot_mode={mode}",
         "--set", "log.level=warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = mp.Process(target=produce, args=(f"tcp://127.0.0.1:{ingest}", T, N, True), daemon=True)
    p.start()
    ctx = zmq.Context()
    req = LazyPirate(ctx, f"tcp://127.0.0.1:{serve}", timeout_ms=3000, retries=5)
    try:
        deadline = time.monotonic() + 120
        while status(req)["fill"] < capacity:  # fill first: a snapshot then writes the whole store
            if time.monotonic() > deadline:
                raise SystemExit("store did not fill in 120 s")
            time.sleep(0.1)
        prev = status(req)
        t_prev = time.perf_counter()
        t0, n0 = t_prev, prev["inserted_segments"]
        acc = {"during": [0, 0.0], "between": [0, 0.0]}
        written0 = (prev["snapshot"] or {}).get("written", 0)
        while time.perf_counter() - t0 < seconds:
            time.sleep(0.05)
            cur = status(req)
            t = time.perf_counter()
            ends = ((prev["snapshot"] or {}).get("in_progress"), (cur["snapshot"] or {}).get("in_progress"))
            kind = "during" if all(ends) else "between" if not any(ends) else None
            if kind is not None:
                acc[kind][0] += cur["inserted_segments"] - prev["inserted_segments"]
                acc[kind][1] += t - t_prev
            prev, t_prev = cur, t
        snap = cur["snapshot"] or {}
        rate = {k: n / dt if dt > 0 else float("nan") for k, (n, dt) in acc.items()}
        return {
            "rate": (cur["inserted_segments"] - n0) / (t_prev - t0),
            "rate_during": rate["during"], "rate_between": rate["between"],
            "busy": acc["during"][1] / (t_prev - t0),
            "snapshots": snap.get("written", 0) - written0,
            "write_s": snap.get("last_seconds") or float("nan"),
        }
    finally:
        p.terminate()
        p.join()
        broker.send_signal(signal.SIGTERM)
        broker.wait(60)
        req.close()
        ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--T", type=int, default=64)
    a = ap.parse_args()
    nbytes = sum(v.nbytes for v in segment_arrays(a.T, a.envs).values())
    with tempfile.TemporaryDirectory() as tmp:
        base = run(a.seconds / 2, a.capacity, a.T, a.envs, 0.0, Path(tmp) / "off")
        runs = {m: run(a.seconds, a.capacity, a.T, a.envs, a.interval, Path(tmp) / m, m)
                for m in ("thread", "fork")}
        size = (Path(tmp) / "thread" / "snapshots" / "store.npz").stat().st_size
    print(f"store: {a.capacity} segments x {nbytes / 1e3:.0f} kB = {a.capacity * nbytes / 1e6:.0f} MB; "
          f"snapshot file {size / 1e6:.0f} MB; a snapshot every {a.interval} s")
    print(f"{'broker':<40}{'during':>10}{'between':>10}{'overall':>10}  segments/s")
    print(f"{'no snapshots (another moment)':<40}{'':>10}{'':>10}{base['rate']:>10,.0f}")
    for mode, r in runs.items():
        print(f"{'snapshot_mode = ' + mode:<40}{r['rate_during']:>10,.0f}{r['rate_between']:>10,.0f}"
              f"{r['rate']:>10,.0f}  ({r['snapshots']} snapshots, last {r['write_s']:.2f} s, "
              f"in progress {100 * r['busy']:.0f}% of the time)")
    for mode, r in runs.items():
        if math.isnan(r["rate_during"]) or not r["rate_between"] > 0:
            print(f"ratio during / between snapshots, {mode}: n/a (no 50 ms interval fell wholly inside or "
                  f"outside a snapshot; give a larger --capacity or more --seconds)")
        else:
            print(f"ratio during / between snapshots, {mode}: {r['rate_during'] / r['rate_between']:.3f}  "
                  f"(target >= 0.5)")


if __name__ == "__main__":
    main()
