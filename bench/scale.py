"""Scale: broker throughput with null-env workers, one broker shard against two, measured in one run.

No simulator: ``--clients`` synthetic workers (bench/load.py's pushers: threads with a PUSH socket each,
spread over up to 4 spawned processes) push pre-built segments of T x N steps as fast as the brokers'
PULL sockets take them, and a learner stand-in in this process takes batches back to back from every
shard (one REQ per shard, the shards' requests in flight together). Two configurations, each a fresh set
of real ``zclaw broker`` processes:

- *1 shard*: one broker, every client pushes to it;
- *2 shards*: ``network.brokers`` lists two, ``zclaw broker --shard 0`` and ``--shard 1``, client i pushes
  to shard ``i mod 2`` (as ``zclaw.fleet.shard_of_worker`` places workers), the sampler takes from both.

Each broker is first told the env spec and T by a worker handshake on its serve socket, so its ingest
rebind (``IngestSocket.follow``) is over before the load starts. After ``--warmup`` seconds of load the
window opens: the brokers' ``inserted_steps`` (status), their CPU time (utime + stime from
``/proc/PID/stat``, every thread), the clients' and this process's CPU time and the host's busy time
(``/proc/stat``) are read at both ends of ``--seconds``. Printed per configuration: ingest (transitions
stored per second), broker CPU-seconds per million transitions stored (both brokers summed with two
shards), the cores each party used; then the ratio ingest 2 shards / 1 shard, from this one run (with
``--rounds`` > 1 the order alternates and the medians are printed).

The ceiling: every process here (brokers, clients, sampler) shares the host's cores. A second shard only
adds ingest where the first broker's loop, not the host, was the bound: on a 2-core host the clients
and the sampler already take a share of the cores a second broker would need, so the ratio measures the
host's headroom, and a broker process's own cost (CPU-s per M transitions) is the figure that carries
over to a host with more cores.

    python bench/scale.py [--seconds 10] [--clients 16] [--envs 16] [--T 64] [--capacity 256] [--rounds 1]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import PROCESSES, Pushers, cpu_s, handshake, status  # noqa: E402
from pipeline import SPEC, free_port, segment_arrays  # noqa: E402

from zclaw.wire import make, parse  # noqa: E402
from zclaw.wire.messages import batch_dims  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def host_busy_s() -> Tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot, over all cores (``/proc/stat``)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals) - idle) / CLK_TCK, sum(vals) / CLK_TCK


def start_brokers(shards: int, capacity: int) -> Tuple[List[subprocess.Popen], List[Tuple[int, int]]]:
    """``shards`` ``zclaw broker`` processes; with two or more, one ``network.brokers`` list and --shard."""
    ports = [(free_port(), free_port()) for _ in range(shards)]
    listed = "[" + ", ".join(f'"127.0.0.1:{i}:{s}"' for i, s in ports) + "]"
    procs = []
    for k, (ingest, serve) in enumerate(ports):
        net = (["--set", f"network.brokers={listed}", "--shard", str(k)] if shards > 1 else
               ["--set", f"network.ingest_port={ingest}", "--set", f"network.serve_port={serve}"])
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "zclaw.cli", "broker", *net, "--set", f"broker.capacity={capacity}",
             "--set", "log.level=warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs, ports


def measure(shards: int, a: argparse.Namespace) -> Dict[str, Any]:
    """One configuration: brokers up, clients pushing, the sampler taking batches; the window's figures."""
    ctx = zmq.Context()
    brokers, ports = start_brokers(shards, a.capacity)
    clients = None
    try:
        for proc, (_, serve) in zip(brokers, ports):
            handshake(ctx, serve, a.T, proc.pid)
        clients = Pushers([f"tcp://127.0.0.1:{i}" for i, _ in ports], a.clients, a.T, a.envs)
        clients.go()
        socks = []
        for _, serve in ports:
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{serve}")
            socks.append(s)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        request = make("sample", batch_size=a.batch, version=0, priority_keys=[], priorities=[])
        sent_at: List[Any] = [None] * shards  # when the request in flight went (None: none in flight)
        next_at = [0.0] * shards
        sampled = [0] * shards
        retries = 0
        t_start = time.perf_counter()
        t_open = t_start + a.warmup
        t_end = t_open + a.seconds
        before: Dict[str, Any] = {}
        while True:
            now = time.perf_counter()
            if not before and now >= t_open:  # the window opens: every counter read once
                before = snapshot(ctx, brokers, ports, clients, sampled)
            if now >= t_end:
                break
            for k, s in enumerate(socks):
                if sent_at[k] is None and now >= next_at[k]:
                    s.send_multipart(request)
                    sent_at[k] = now
                elif sent_at[k] is not None and now - sent_at[k] > 10:
                    raise RuntimeError(f"shard {k} did not answer a sample request within 10 s")
            ready = dict(poller.poll(5))
            for k, s in enumerate(socks):
                if s in ready:
                    msg = parse(s.recv_multipart(copy=False))
                    sent_at[k] = None
                    if msg.kind == "batch":
                        _, T_, C_, _ = batch_dims(msg, SPEC)
                        sampled[k] += T_ * C_
                    else:
                        retries += 1
                        next_at[k] = time.perf_counter() + 0.001
        after = snapshot(ctx, brokers, ports, clients, sampled)
        for s in socks:
            s.close()
    finally:
        if clients is not None:
            clients.stop()
        for p in brokers:
            p.send_signal(signal.SIGTERM)
        for p in brokers:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ctx.destroy(linger=0)
    wall = after["t"] - before["t"]
    stored = [b1 - b0 for b0, b1 in zip(before["stored"], after["stored"])]
    bcpu = [c1 - c0 for c0, c1 in zip(before["broker_cpu"], after["broker_cpu"])]
    evicted = sum(after["evicted"]) - sum(before["evicted"])
    out = {
        "shards": shards, "wall": wall, "stored": stored, "broker_cpu": bcpu,
        "ingest": sum(stored) / wall, "per_shard_ingest": [x / wall for x in stored],
        "cpu_per_m": sum(bcpu) / max(1, sum(stored)) * 1e6,
        "broker_cores": [c / wall for c in bcpu],
        "client_cores": (after["clients"] - before["clients"]) / wall,
        "sampler_cores": (after["self"] - before["self"]) / wall,
        "host_cores": (after["host"][0] - before["host"][0]) / (after["host"][1] - before["host"][1])
        * (os.cpu_count() or 1),
        "sampled": (sum(after["sampled"]) - sum(before["sampled"])) / wall,
        "evicted": evicted, "retries": retries,
        "drops": after["drops"],
    }
    # what the host spent beyond this bench's processes: other people's work on a shared machine
    out["others_cores"] = max(0.0, out["host_cores"] - sum(out["broker_cores"]) - out["client_cores"]
                              - out["sampler_cores"])
    return out


def snapshot(ctx: zmq.Context, brokers: List[subprocess.Popen], ports: List[Tuple[int, int]],
             clients: Pushers, sampled: List[int]) -> Dict[str, Any]:
    reps = [status(ctx, serve) for _, serve in ports]
    drops: Dict[str, int] = {}
    for r in reps:
        for k, v in (r.get("drops") or {}).items():
            drops[k] = drops.get(k, 0) + int(v)
    return {
        "t": time.perf_counter(),
        "stored": [int(r["inserted_steps"]) for r in reps],
        "evicted": [int((r.get("drops") or {}).get("evicted_unused", 0)) for r in reps],
        "drops": drops,
        "broker_cpu": [cpu_s(p.pid) for p in brokers],
        "clients": clients.cpu_s(),
        "self": time.process_time(),
        "host": host_busy_s(),
        "sampled": list(sampled),
    }


def line(r: Dict[str, Any], rnd: int) -> str:
    name = "1 shard " if r["shards"] == 1 else f"{r['shards']} shards"
    out = (f"round {rnd}, {name}: ingest {r['ingest']:>10,.0f} transitions/s stored, broker "
           f"{sum(r['broker_cores']):.2f} cores = {r['cpu_per_m']:.2f} CPU-s per M transitions; clients "
           f"{r['client_cores']:.2f}, sampler {r['sampler_cores']:.2f}, host busy {r['host_cores']:.2f} "
           f"cores (others' {r['others_cores']:.2f}); sampled {r['sampled']:,.0f}/s, evicted unused "
           f"{r['evicted']:,}")
    if r["shards"] > 1:
        out += ("\n    per shard: ingest " + " / ".join(f"{x:,.0f}" for x in r["per_shard_ingest"])
                + " transitions/s, broker cores " + " / ".join(f"{c:.2f}" for c in r["broker_cores"]))
    other = {k: v for k, v in r["drops"].items() if k != "evicted_unused" and v}
    if other:
        out += f"\n    other drops: {other}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per configuration")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of load before the window opens")
    ap.add_argument("--clients", type=int, default=16, help="null-env workers (PUSH clients)")
    ap.add_argument("--envs", type=int, default=16, help="envs per client segment (N)")
    ap.add_argument("--T", type=int, default=64, help="steps per segment")
    ap.add_argument("--capacity", type=int, default=256, help="broker.capacity (segments) of each shard")
    ap.add_argument("--batch", type=int, default=4, help="segments per sample request")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of both configurations (order alternates)")
    a = ap.parse_args()
    if a.clients < 2:
        raise SystemExit("--clients must be >= 2 (two shards need a client each)")
    cores = os.cpu_count() or 1
    seg_bytes = sum(v.nbytes for v in segment_arrays(a.T, a.envs).values())
    print(f"host: {cores} cores; {a.clients} null-env clients in {min(PROCESSES, a.clients)} processes, "
          f"segments T={a.T} x N={a.envs} = {a.T * a.envs} transitions ({seg_bytes / 1e3:.1f} kB); "
          f"capacity {a.capacity} per shard; sampler batches of {a.batch} segments; window {a.seconds:g} s "
          f"after {a.warmup:g} s of load; {a.rounds} round(s)")
    results: Dict[int, List[Dict[str, Any]]] = {1: [], 2: []}
    for rnd in range(a.rounds):
        for shards in ((1, 2) if rnd % 2 == 0 else (2, 1)):
            r = measure(shards, a)
            results[shards].append(r)
            print(line(r, rnd), flush=True)
    keys = ("ingest", "cpu_per_m", "host_cores", "others_cores")
    med = {s: {k: statistics.median(x[k] for x in rs) for k in keys} for s, rs in results.items()}
    ratios = [two["ingest"] / one["ingest"] for one, two in zip(results[1], results[2])]
    print(f"broker CPU-seconds per million transitions: 1 shard {med[1]['cpu_per_m']:.2f}, "
          f"2 shards {med[2]['cpu_per_m']:.2f} (both brokers summed)")
    print(f"ratio ingest 2 shards / 1 shard: {statistics.median(ratios):.3f}"
          + (f" (rounds: {', '.join(f'{x:.3f}' for x in ratios)})" if len(ratios) > 1 else ""))
    print(f"ceiling: 2 shards + {a.clients} clients + sampler on {cores} cores: a ratio near 1 means "
          f"CPU-bound on the host, not on one broker (host busy {med[1]['host_cores']:.2f} of {cores} cores "
          f"with 1 shard, {med[2]['host_cores']:.2f} with 2; other processes' share "
          f"{med[1]['others_cores']:.2f} and {med[2]['others_cores']:.2f})")


if __name__ == "__main__":
    main()
