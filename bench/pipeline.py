"""Benchmark: transport through worker -> broker -> learner against a raw PUSH/PULL of the same payload.

A synthetic producer (no physics: a preallocated segment of T x N steps, re-encoded with a new seq each
time, exactly as a worker's segment) pushes as fast as the socket takes it. Run A: the real `zclaw
broker` process stores the segments and a consume-only learner loop (the learner's own client,
``CreditPirate`` with ``--prefetch`` requests in flight; decode, validate with batch_dims, discard)
pulls batches. Run B: the same producer pushes the same frames to a bare PULL that receives and
decodes them with the same calls the broker's ingest uses (``recv_frames``, ``parse``). Both are
measured in this one invocation; the ratio A / B is the figure (target >= 0.5).

Run A goes once per ``broker.when_full`` mode: ``evict`` (the default; a producer this fast overruns the
consumer, so the broker also spends CPU on segments it then throws away, counted as evicted unused) and
``wait`` (the broker stops reading while its store is full of unsampled segments, so the producer is
held back by ZeroMQ's high-water marks, as run B's producer is by its consumer: the flow-controlled
chain against the flow-controlled single hop). Each round measures raw before and after the pipeline
runs and uses their mean; the medians over rounds are the figures (the machine is shared and noisy).

    python bench/pipeline.py [--seconds 5] [--rounds 3] [--envs 64] [--T 64] [--when-full evict,wait]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Tuple

import numpy as np
import zmq

from zclaw.wire import CreditPirate, EnvSpec, Segment, make, parse, recv_frames
from zclaw.wire.memory import keep_freed_buffers
from zclaw.wire.messages import SEGMENT_ARRAYS, batch_dims

SPEC = EnvSpec("gym:Reacher-v5", (10,), (2,), (-1.0, -1.0), (1.0, 1.0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segment_arrays(T: int, N: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for name, (dtype, shape_of) in SEGMENT_ARRAYS.items():
        shape = shape_of(T, N, SPEC)
        out[name] = (rng.random(shape) if dtype.endswith("f4") else np.zeros(shape)).astype(np.dtype(dtype))
    out["final_obs"] = np.zeros((0, 10), np.float32)
    out["final_at"] = np.zeros((0, 2), np.int32)
    return out


def produce(endpoint: str, T: int, N: int, hello: bool) -> None:
    """Push segments forever (until SIGTERM)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    keep_freed_buffers()  # as a worker process does (inherited when forked; explicit for spawn)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    sock.connect(endpoint)
    if hello:
        sock.send_multipart(make("hello", role="worker", identity="bench", host="h", pid=os.getpid(),
                                 zclaw="0", spec=SPEC.to_dict(), segment_length=T))
    arrays = segment_arrays(T, N)
    seq = 0
    while True:
        sock.send_multipart(Segment("bench", seq, SPEC.hash, arrays, []).frames(), copy=False)
        seq += 1


def run_raw(seconds: float, T: int, N: int) -> float:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    p = mp.Process(target=produce, args=(f"tcp://127.0.0.1:{port}", T, N, False), daemon=True)
    p.start()
    recv_frames(pull)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        parse(recv_frames(pull))
        n += T * N
    rate = n / (time.perf_counter() - t0)
    p.terminate()
    p.join()
    pull.close(0)
    ctx.term()
    return rate


def run_pipeline(seconds: float, T: int, N: int, batch: int, prefetch: int,
                 when_full: str) -> Tuple[float, dict]:
    ingest, serve = free_port(), free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "zclaw.cli", "broker", "--set", f"network.ingest_port={ingest}",
         "--set", f"network.serve_port={serve}", "--set", "broker.capacity=64",
         "--set", f"broker.when_full={when_full}", "--set", "log.level=warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = mp.Process(target=produce, args=(f"tcp://127.0.0.1:{ingest}", T, N, True), daemon=True)
    p.start()
    ctx = zmq.Context()
    req = CreditPirate(ctx, f"tcp://127.0.0.1:{serve}", credit=prefetch, timeout_ms=3000, retries=5)
    request = make("sample", batch_size=batch, version=0, priority_keys=[], priorities=[])
    n, t0, started = 0, None, time.perf_counter()
    while True:
        msg = req.exchange(request)
        if msg is None:
            raise SystemExit("broker did not answer")
        if msg.kind == "batch":
            B, T_, C_, _ = batch_dims(msg, SPEC)
            if t0 is None:
                t0 = time.perf_counter()
            else:
                n += T_ * C_
        else:
            time.sleep(0.001)
        if t0 is not None and time.perf_counter() - t0 >= seconds:
            break
        if time.perf_counter() - started > seconds + 30:
            raise SystemExit("no batches from the broker")
    rate = n / (time.perf_counter() - t0)
    report = broker_report(req)
    p.terminate()
    p.join()
    broker.send_signal(signal.SIGTERM)
    broker.wait(10)
    req.close()
    ctx.term()
    return rate, report


def broker_report(req: CreditPirate) -> dict:
    """The broker's status report (answers to sample requests still in flight are skipped)."""
    for _ in range(16):
        msg = req.exchange(make("status"))
        if msg is not None and msg.kind == "status":
            return msg["report"]
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per path and round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of raw, pipeline per mode, raw; medians reported")
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16,
                    help="segments per batch request (learner.batch_segments)")
    ap.add_argument("--prefetch", type=int, default=2, help="requests in flight (learner.prefetch)")
    ap.add_argument("--when-full", default="evict,wait",
                    help="comma list of broker.when_full modes to run: evict (drop unsampled segments when "
                         "the store is full) and/or wait (stop reading until the learner "
                         "samples: flow control)")
    a = ap.parse_args()
    # this process is the consumer of both runs: the learner's process setting, for the raw run too
    keep_freed_buffers()
    modes = a.when_full.split(",")
    if not modes or any(m not in ("evict", "wait") for m in modes):
        raise SystemExit(f"--when-full {a.when_full!r}: expected a comma list of evict, wait")
    nbytes = sum(v.nbytes for v in segment_arrays(a.T, a.envs).values())
    print(f"segment: T={a.T} x N={a.envs} = {a.T * a.envs} transitions, {nbytes / 1e6:.2f} MB; "
          f"batch {a.batch} segments, {a.prefetch} request(s) in flight; {a.rounds} round(s) "
          f"of {a.seconds:.0f} s")
    print(f"{'round':<6}{'path':<44}{'transitions/s':>16}{'ratio':>8}  broker: inserted / "
          "sampled / evicted unused")
    ratios: dict = {m: [] for m in modes}
    for r in range(a.rounds):
        raw_before = run_raw(a.seconds, a.T, a.envs)
        piped = {m: run_pipeline(a.seconds, a.T, a.envs, a.batch, a.prefetch, m) for m in modes}
        raw = (raw_before + run_raw(a.seconds, a.T, a.envs)) / 2  # the mean of a raw run either side
        print(f"{r:<6}{'raw PUSH/PULL (receive + decode)':<44}{raw:>16,.0f}")
        for m, (rate, rep) in piped.items():
            ratios[m].append(rate / raw)
            print(f"{r:<6}{'worker -> broker -> learner, when_full=' + m:<44}"
                  f"{rate:>16,.0f}{rate / raw:>8.3f}  "
                  f"{rep.get('inserted_segments')} / {rep.get('sampled_segments')} / "
                  f"{rep.get('drops', {}).get('evicted_unused', 0)}")
    for m in modes:
        vals = sorted(ratios[m])
        print(f"ratio pipeline / raw, broker.when_full = {m}: median {statistics.median(vals):.3f} "
              f"(range {vals[0]:.3f} to {vals[-1]:.3f})  (target >= 0.5)")


if __name__ == "__main__":
    main()
