"""Load: 32 synthetic workers push segments as fast as a real broker takes them; a learner samples meanwhile.

Each worker is a thread with its own PUSH socket (pyzmq releases the GIL in sends; the 32 threads are
spread over 4 processes so the learner-side loop does not share a GIL with them) pushing pre-built
segments of T x N steps with a NOBLOCK send, so it runs at whatever rate the broker's PULL admits. A
learner-side loop on a REQ socket asks for batches back to back and times every request (send to reply,
decode and layout check included). The broker's RSS is read from /proc every 0.2 s. Printed: push and
insert rates, how much the ring overwrote unused (``evicted_unused``: the overflow is counted, not
hidden), the broker's peak RSS against the bound it must stay under, and p50/p99 batch latency.

    python bench/load.py [--seconds 10] [--workers 32] [--capacity 256] [--T 16] [--envs 4]

``tests/system/test_load.py`` runs :func:`run` briefly and checks the accounting and the memory bound.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Union

import numpy as np
import structlog
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import SPEC, free_port, segment_arrays  # noqa: E402

from zclaw.wire import Segment, make, parse  # noqa: E402
from zclaw.wire.messages import batch_dims  # noqa: E402
from zclaw.worker.session import BrokerSession, Refused  # noqa: E402


#: processes the pushers are spread over (threads inside each)
PROCESSES = 4


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15 of proc(5)


def memory_bound_mib(
    capacity: int, workers: int, segment_bytes: int, hwm: int = 64, base_mib: float = 120
) -> float:
    """What the broker may use: interpreter and libraries, the store, and a full receive queue per worker."""
    return base_mib + (capacity + workers * hwm) * segment_bytes / 2**20


def _pusher(
    ctx: zmq.Context, endpoint: str, idx: int, T: int, N: int, stop: Any, sent: Any, ready: Any, go: Any
) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)
    # what was sent is delivered before the socket goes, however long a loaded broker takes to drain it
    # (a finite linger dropped the last queued segments under a full test suite on 2 cores); a broker that
    # died leaves the process to Pushers.stop's join timeout
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(endpoint)
    sock.send_multipart(make("hello", role="worker", identity=f"load{idx}", host="bench", pid=os.getpid(),
                             zclaw="0", spec=SPEC.to_dict(), segment_length=None))
    with ready.get_lock():
        ready.value += 1
    while not go.is_set() and not stop.is_set():  # the load starts together, on the run's clock
        go.wait(0.05)
    arrays = segment_arrays(T, N)
    seq = 0
    while not stop.is_set():
        frames = Segment(f"load{idx}", seq, SPEC.hash, arrays, []).frames()
        while not stop.is_set():
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                seq += 1
                break
            except zmq.Again:
                sock.poll(5, zmq.POLLOUT)
    sent[idx] = seq
    sock.close()


def _group(
    endpoints: List[str], ids: List[int], T: int, N: int, stop: Any, sent: Any, ready: Any, go: Any
) -> None:
    """One process of pushers (threads): the learner's process keeps its GIL to itself. Pusher i feeds
    ``endpoints[i mod len]`` (several broker shards: bench/scale.py)."""
    ctx = zmq.Context()
    threads = [threading.Thread(target=_pusher, args=(ctx, endpoints[i % len(endpoints)], i, T, N, stop, sent,
                                                      ready, go)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ctx.term()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def handshake(ctx: zmq.Context, serve: int, T: int, broker_pid: int, timeout_s: float = 60.0) -> None:
    """A worker's handshake on the serve socket (spec and T), the worker's own :class:`BrokerSession`, as a
    real worker does before its first segment: the broker adopts the spec and binds ingest again before
    it answers, so no segment is on the wire during that rebind (streamed behind an ingest hello instead,
    32 pushers lost 17k of 44k segments on a loaded machine: the rebind closes connections with bytes in
    flight)."""
    session = BrokerSession(
        ctx, f"tcp://127.0.0.1:{serve}",
        lambda: make("hello", role="worker", identity="load-handshake", host="bench", pid=os.getpid(),
                     zclaw="0", spec=SPEC.to_dict(), segment_length=T),
        structlog.get_logger("bench"), spec_hash=SPEC.hash, timeout_ms=1000)
    deadline = time.monotonic() + timeout_s
    try:
        welcome = session.handshake(lambda: time.monotonic() > deadline or not running(broker_pid))
    except Refused as exc:
        raise RuntimeError(str(exc)) from exc
    finally:
        session.close()
    if welcome is None:
        raise RuntimeError(f"broker (pid {broker_pid}) exited or did not welcome the handshake within "
                           f"{timeout_s:.0f} s")


def status(ctx: zmq.Context, port: int) -> Dict[str, Any]:
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send_multipart(make("status"))
        if not s.poll(10000):
            raise RuntimeError("broker did not answer status")
        return parse(s.recv_multipart())["report"]
    finally:
        s.close()


class Pushers:
    """``workers`` pushers in PROCESSES spawned processes; a context manager that reaps them on exit.

    They connect and say hello first, then wait for :meth:`go`, so the load starts on the run's clock
    (spawned processes take seconds to start on a loaded machine; those seconds are not load)."""

    def __init__(self, ingest: Union[int, List[str]], workers: int, T: int, N: int) -> None:
        """``ingest``: the broker's ingest port, or several shards' endpoints (pusher i feeds i mod S)."""
        mpc = mp.get_context("spawn")
        self.workers = workers
        self._stop, self._go = mpc.Event(), mpc.Event()
        self._sent, self._ready = mpc.Array("q", workers), mpc.Value("i", 0)
        endpoints = [f"tcp://127.0.0.1:{ingest}"] if isinstance(ingest, int) else list(ingest)
        groups = [list(range(g, workers, PROCESSES)) for g in range(min(PROCESSES, workers))]
        self._procs = [mpc.Process(target=_group, daemon=True, args=(
            endpoints, ids, T, N, self._stop, self._sent, self._ready, self._go)) for ids in groups]
        for p in self._procs:
            p.start()

    def go(self, timeout_s: float = 120) -> None:
        """Wait until every pusher has said hello, then release them all."""
        deadline = time.monotonic() + timeout_s
        while self._ready.value < self.workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self._ready.value} of {self.workers} pushers connected within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.05)
        self._go.set()

    def cpu_s(self) -> float:
        """CPU seconds the pusher processes have used so far."""
        return sum(cpu_s(p.pid) for p in self._procs if p.is_alive())

    def stop(self) -> int:
        """Stop and reap every pusher; return the segments they sent in all."""
        self._stop.set()
        for p in self._procs:
            p.join(60)
            if p.is_alive():
                p.terminate()
        return sum(self._sent[:])

    def __enter__(self) -> "Pushers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()  # also when the run fails: no pusher outlives it


def run(ingest_port: int, serve_port: int, broker_pid: int, seconds: float, workers: int = 32, T: int = 16,
        N: int = 4, batch: int = 4) -> Dict[str, Any]:
    """Drive a running broker with ``workers`` pushers and one sampling learner for ``seconds`` (the clock
    starts once every pusher has connected)."""
    ctx = zmq.Context()
    try:
        handshake(ctx, serve_port, T, broker_pid)
        with Pushers(ingest_port, workers, T, N) as pushers:
            pushers.go()
            return _sample_under_load(ctx, serve_port, broker_pid, seconds, batch, pushers, T, N)
    finally:
        ctx.destroy(linger=0)


def _sample_under_load(ctx: zmq.Context, serve_port: int, broker_pid: int, seconds: float, batch: int,
                       pushers: Pushers, T: int, N: int) -> Dict[str, Any]:
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{serve_port}")
    latencies: List[float] = []
    retries = 0
    rss: List[float] = [rss_mib(broker_pid)]
    t0 = time.perf_counter()
    next_rss = t0
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        req.send_multipart(make("sample", batch_size=batch, version=0))
        if not req.poll(10000):
            raise RuntimeError("broker did not answer a sample request within 10 s")
        msg = parse(req.recv_multipart(copy=False))
        if msg.kind == "batch":
            batch_dims(msg, SPEC)
            latencies.append(time.perf_counter() - t)
        else:
            retries += 1
            time.sleep(0.001)
        if t >= next_rss:
            rss.append(rss_mib(broker_pid))
            next_rss = t + 0.2
    wall = time.perf_counter() - t0
    total = pushers.stop()
    deadline = time.monotonic() + 60
    rep = status(ctx, serve_port)
    while rep["inserted_segments"] < total and time.monotonic() < deadline:  # nothing is lost on PUSH/PULL:
        # the broker drains what is still queued
        time.sleep(0.1)
        rep = status(ctx, serve_port)
    rss.append(rss_mib(broker_pid))
    req.close()
    seg_bytes = sum(v.nbytes for v in segment_arrays(T, N).values())
    workers = pushers.workers
    lat = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    return {
        "workers": workers, "wall_s": wall, "sent": total, "sent_per_s": total / wall,
        "inserted": rep["inserted_segments"], "sampled": rep["sampled_segments"], "fill": rep["fill"],
        "capacity": rep["capacity"], "drops": rep["drops"], "batches": len(latencies), "retries": retries,
        "rss_max_mib": max(rss), "rss_start_mib": rss[0], "segment_bytes": seg_bytes,
        "rss_bound_mib": memory_bound_mib(rep["capacity"], workers, seg_bytes),
        "latency_p50_ms": float(np.percentile(lat, 50)), "latency_p99_ms": float(np.percentile(lat, 99)),
        "latency_max_ms": float(lat.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=256)
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--envs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    ingest, serve = free_port(), free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "zclaw.cli", "broker", "--set", f"network.ingest_port={ingest}",
         "--set", f"network.serve_port={serve}", "--set", f"broker.capacity={a.capacity}",
         "--set", "log.level=warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        r = run(ingest, serve, broker.pid, a.seconds, a.workers, a.T, a.envs, a.batch)
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(30)
    evicted = r["drops"].get("evicted_unused", 0)
    print(f"{r['workers']} synthetic workers, segments of T={a.T} x N={a.envs} "
          f"({r['segment_bytes'] / 1e3:.1f} kB), "
          f"store capacity {r['capacity']}, {r['wall_s']:.1f} s")
    print(f"pushed      {r['sent']:>9,} segments  ({r['sent_per_s']:,.0f}/s)")
    print(f"inserted    {r['inserted']:>9,}   sampled {r['sampled']:,}   in store {r['fill']}")
    print(f"overflow    {evicted:>9,} evicted unused (counted; inserted = sampled + in store + evicted: "
          f"{r['inserted'] == r['sampled'] + r['fill'] + evicted})")
    print(f"broker RSS  {r['rss_start_mib']:.0f} -> max {r['rss_max_mib']:.0f} MiB  "
          f"(bound {r['rss_bound_mib']:.0f} MiB)")
    print(f"batches     {r['batches']:,} of {a.batch}  latency p50 {r['latency_p50_ms']:.2f} ms  "
          f"p99 {r['latency_p99_ms']:.2f} ms  max {r['latency_max_ms']:.1f} ms")


if __name__ == "__main__":
    main()
