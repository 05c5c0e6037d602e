"""Mixed shapes: a Reacher run fed by workers of 8, 16 and 64 envs against a same-shape run of the same size.

Each run is ``zclaw train`` done by hand, so that every worker has its own ``--envs``: the run directory and
its ``config.toml`` (free loopback ports) come from ``zclaw.launch.prepare`` as ``zclaw train`` writes them
(``configs/reacher.toml``, ``learner.tensorboard = false``, ``run.seed`` = the seed), then ``zclaw broker``,
``zclaw learner`` and ``zclaw worker --index i --envs N`` start on it. Two runs per seed, ``--seconds``
each from launch (order alternating over seeds):

- *mixed*: workers of ``--shapes`` envs (default 8, 16, 64: 88 envs);
- *same*: as many workers, each of ``--same-envs`` envs (default the mixed total over the worker count,
  rounded: 3 x 29 = 87 envs against 88; the line printed says which).

What reaches the learner is counted on the way: the learner talks to the broker through a relay in this
process (a ROUTER for the learner, one DEALER to the broker per learner socket, so the broker sees each
learner socket as its own client) that forwards every frame unchanged and adds up, per worker, the env
steps (columns x T) of every batch it carries. At the end the broker's status gives each worker's ``envs``
and ``steps`` (what it stored of that worker), its drops and refusals, and the run's return.

Printed per run: env steps, updates, the mean return of the last 100 episodes (the broker's, over every
worker's episodes, as ``summary.json``; the learner's from its last ``metrics.jsonl`` line beside it),
``bad_shape`` drops and refusals (must be 0) and the other drops; per worker: its share of the envs, of
the steps it sent (stored by the broker) and of the steps the learner was given. Then per shape the final
returns over the seeds. Exit status 1 if a role failed or any ``bad_shape`` was counted.

Figures on a shared 2-core host are noisy: the workers, learner and broker of one run share 2 cores (and
with other people's work), so the env-step rate, and with it the return at a fixed wall time, moves by
several percent between identical runs; the shares within one run are the robust figures. Both runs size
their batches in env columns (``--columns``, ``learner.batch_columns``, default 64): counted in segments, a
mixed run's batch of 4 segments would hold 4 x 8 to 4 x 64 columns and its learner would make more, smaller
updates than the same-shape run's (``--columns 0`` shows that; compare ``updates``).

With ``--keep DIR`` the run directories stay, each with ``batches.jsonl``: every batch's store keys,
workers and columns, in the order served (keys are the broker's insertion order; a gap is a segment
evicted or dropped stale). ``--set broker.eviction=oldest`` runs both with a plain ring instead of the
default fair eviction, the comparison in docs/benchmarks.md.

    python bench/mixed.py [--seconds 120] [--seeds 1] [--shapes 8,16,64] [--same-envs N] [--columns 64]
                          [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import zmq

from zclaw import config as config_mod
from zclaw.launch import StatusClient, _set_pdeathsig, prepare, stop_processes
from zclaw.wire import parse, tcp

ROOT = Path(__file__).resolve().parents[1]
ZCLAW = [sys.executable, "-m", "zclaw.cli"]


class Tap(threading.Thread):
    """Relays the learner's requests to the broker's serve socket and counts, per worker identity, the env
    steps of the batches it hands back (see the module doc)."""

    def __init__(self, ctx: zmq.Context, broker: str) -> None:
        super().__init__(name="tap", daemon=True)
        self.ctx, self.broker = ctx, broker
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.trained: Counter = Counter()  # worker identity -> env steps given to the learner
        self.batches = 0
        #: every batch's (keys, workers, columns), in the order served: the store's order, kept with --keep
        self.trace: List[Dict[str, Any]] = []
        self.errors = 0
        self.lock = threading.Lock()
        self.stop_event = threading.Event()

    def run(self) -> None:
        backs: Dict[bytes, zmq.Socket] = {}
        owner: Dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stop_event.is_set():
            for sock in dict(poller.poll(100)):
                if sock is self.front:
                    frames = self.front.recv_multipart(copy=False)
                    cid = frames[0].bytes
                    back = backs.get(cid)
                    if back is None:  # a new learner socket (a Lazy Pirate reconnects with a fresh one)
                        back = backs[cid] = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.broker)
                        owner[back] = cid
                        poller.register(back, zmq.POLLIN)
                    back.send_multipart(frames[1:], copy=False)
                else:
                    frames = sock.recv_multipart(copy=False)
                    self._count(frames)
                    self.front.send_multipart([owner[sock]] + frames, copy=False)
        for back in backs.values():
            back.close()
        self.front.close()

    def _count(self, frames: List[Any]) -> None:
        try:
            body = frames[1:] if len(frames[0]) == 0 else frames  # after the empty delimiter
            msg = parse(body)
            if msg.kind != "batch":
                return
            T = int(msg.arrays["reward"].shape[0])
            with self.lock:
                self.batches += 1
                self.trace.append({"keys": list(msg["keys"]), "workers": list(msg["workers"]),
                                   "columns": list(msg["columns"])})
                for worker, cols in zip(msg["workers"], msg["columns"]):
                    self.trained[str(worker)] += int(cols) * T
        except Exception:  # counting must never stop the relay
            self.errors += 1

    def counts(self) -> Dict[str, int]:
        with self.lock:
            return dict(self.trained)

    def close(self) -> None:
        self.stop_event.set()
        self.join(5)


def worker_index(identity: str) -> Optional[int]:
    """``w<index>-<host>-<pid>`` -> index (zclaw.worker.worker.worker_identity)."""
    head = identity.split("-", 1)[0]
    return int(head[1:]) if head.startswith("w") and head[1:].isdigit() else None


def last_metrics(run_dir: Path) -> Dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:  # a line being written as we read: the one before it
        return json.loads(lines[-2]) if len(lines) > 1 else {}


def one_run(label: str, shapes: List[int], seed: int, a: argparse.Namespace, root: Path) -> Dict[str, Any]:
    """One run of ``len(shapes)`` workers, worker i with ``shapes[i]`` envs, for ``a.seconds`` from launch."""
    run_dir = root / f"{label}-seed{seed}"
    cfg = config_mod.load(str(a.config), [f"run.seed={seed}", "learner.tensorboard=false",
                                          f"run.workers={len(shapes)}", f"learner.batch_columns={a.columns}",
                                          *a.overrides])
    config_path = prepare(cfg, run_dir)
    net = cfg["network"]
    common = ["--config", str(config_path)]
    logs = run_dir / "logs"
    ctx = zmq.Context()
    tap = Tap(ctx, tcp("127.0.0.1", int(net["serve_port"])))
    tap.start()
    procs: Dict[str, subprocess.Popen] = {}
    files = []

    def start(name: str, argv: List[str]) -> None:
        f = open(logs / f"{name}.log", "wb")
        files.append(f)
        procs[name] = subprocess.Popen(ZCLAW + argv, stdout=f, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, preexec_fn=_set_pdeathsig)

    broker = StatusClient(ctx, tcp("127.0.0.1", int(net["serve_port"])), timeout_ms=5000)
    learner = StatusClient(ctx, tcp("127.0.0.1", int(net["learner_port"])), timeout_ms=5000)
    t0 = time.monotonic()
    failed: Dict[str, int] = {}
    try:
        start("broker", ["broker", *common, "--run-dir", str(run_dir), "--fresh"])
        start("learner", ["learner", *common, "--run-dir", str(run_dir),
                          "--set", f"network.serve_port={tap.port}"])  # through the tap
        for i, n in enumerate(shapes):
            start(f"worker{i}", ["worker", *common, "--index", str(i), "--envs", str(n)])
        while time.monotonic() - t0 < a.seconds:
            for name, p in procs.items():
                if p.poll() is not None and name not in failed:
                    failed[name] = p.returncode
            if failed:
                break
            time.sleep(0.5)
        wall = time.monotonic() - t0
        b = broker.report() or {}
        L = learner.report() or {}
        trained = tap.counts()
        batches = tap.batches
        metrics = last_metrics(run_dir)
    finally:
        workers = [p for n, p in procs.items() if n.startswith("worker")]
        codes = dict(zip([n for n in procs if n.startswith("worker")], stop_processes(workers, 20)))
        for name in ("learner", "broker"):
            if name in procs:
                codes[name] = stop_processes([procs[name]], 60)[0]
        tap.close()
        broker.close()
        learner.close()
        ctx.destroy(linger=0)
        for f in files:
            f.close()
    if a.keep:
        with open(run_dir / "batches.jsonl", "w") as f:
            f.writelines(json.dumps(b) + "\n" for b in tap.trace)
    starting = []  # SIGTERM's default action: the role was still importing (a short run on a busy host)
    for name, rc in codes.items():
        if rc == -signal.SIGTERM and name not in failed:
            starting.append(name)
        elif rc not in (0, None) and name not in failed:
            failed[name] = rc
    return {"label": label, "seed": seed, "shapes": shapes, "wall": wall, "broker": b, "learner": L,
            "starting": starting,
            "trained": trained, "batches": batches, "tap_errors": tap.errors, "metrics": metrics,
            "failed": failed, "run_dir": run_dir}


def fmt(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def report_run(r: Dict[str, Any]) -> int:
    """Print one run's lines; return its bad_shape count (drops and refusals); ``r["gap"]``: the largest
    difference, over its workers, between a worker's share of the trained steps and of the sent ones."""
    b, L = r["broker"], r["learner"]
    drops = {k: int(v) for k, v in (b.get("drops") or {}).items() if v}
    refused = {k: int(v) for k, v in (b.get("refused") or {}).items() if v}
    bad = drops.pop("bad_shape", 0) + refused.get("bad_shape", 0)
    envs_total = sum(r["shapes"])
    shape = "+".join(str(n) for n in r["shapes"]) if len(set(r["shapes"])) > 1 else \
        f"{len(r['shapes'])} x {r['shapes'][0]}"
    steps = b.get("inserted_steps")
    print(f"{r['label']:<5} seed {r['seed']}: {shape} = {envs_total} envs, {r['wall']:.0f} s; env steps "
          f"{fmt(steps, ',')}, updates {fmt(L.get('updates'), ',')}; return_mean_100 broker "
          f"{fmt(b.get('return_mean_100'))}, learner {fmt(r['metrics'].get('return_mean_100'))}; bad_shape "
          f"{bad}; other drops {drops or 0}; refused {refused or 0}"
          + (f"; FAILED roles {r['failed']}" if r["failed"] else "")
          + (f"; still starting when stopped: {', '.join(r['starting'])}" if r["starting"] else ""))
    workers = b.get("workers") or {}
    sent_total = sum(int(w.get("steps") or 0) for k, w in workers.items() if worker_index(k) is not None)
    trained_total = sum(r["trained"].values())
    rows = sorted((worker_index(k), k, w) for k, w in workers.items() if worker_index(k) is not None)
    r["gap"] = None
    for idx, ident, w in rows:
        envs = w.get("envs") or (r["shapes"][idx] if idx < len(r["shapes"]) else 0)
        sent, trained = int(w.get("steps") or 0), r["trained"].get(ident, 0)
        sent_share, trained_share = sent / max(1, sent_total), trained / max(1, trained_total)
        if trained_total:
            r["gap"] = max(r["gap"] or 0.0, abs(trained_share - sent_share))
        print(f"  worker{idx} envs {envs:>3} ({envs / envs_total:6.1%} of envs): sent {sent_share:6.1%} of "
              f"env steps, trained {trained_share:6.1%} of the learner's ({trained:,} of {trained_total:,})")
    for name in r["failed"]:  # why, from its log's last lines
        log = r["run_dir"] / "logs" / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
        print(f"  {name} log: " + " | ".join(x.strip()[:300] for x in tail))
    if r["tap_errors"]:
        print(f"  tap: {r['tap_errors']} replies it could not read (relayed all the same)")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="each run, from launch")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, a mixed and a same-shape run each")
    ap.add_argument("--shapes", default="8,16,64", help="envs of each worker of the mixed run")
    ap.add_argument("--same-envs", type=int, default=None,
                    help="envs of each worker of the same-shape run (default: the mixed total over the "
                         "worker count, rounded)")
    ap.add_argument("--columns", type=int, default=64,
                    help="learner.batch_columns of both runs: env columns per batch (0: batch_segments)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "reacher.toml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="more config overrides for every role (repeatable)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep the run directories under DIR")
    a = ap.parse_args()
    mixed = [int(x) for x in a.shapes.split(",") if x.strip()]
    if len(mixed) < 2 or min(mixed) < 1:
        raise SystemExit("--shapes needs two or more env counts >= 1")
    same_n = a.same_envs or max(1, round(sum(mixed) / len(mixed)))
    same = [same_n] * len(mixed)
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="zclaw-mixed-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"mixed: {'+'.join(map(str, mixed))} = {sum(mixed)} envs; same shape: {len(same)} x {same_n} = "
          f"{sum(same)} envs; {a.seconds:g} s per run from launch, {a.seeds} seed(s); config "
          f"{Path(a.config).name}; batches of "
          + (f"{a.columns} columns" if a.columns else "learner.batch_segments segments"), flush=True)
    runs: List[Dict[str, Any]] = []
    bad_total, failed = 0, False
    try:
        for seed in range(a.seeds):
            order = [("mixed", mixed), ("same", same)]
            for label, shapes in (order if seed % 2 == 0 else order[::-1]):
                r = one_run(label, shapes, seed, a, root)
                runs.append(r)
                bad_total += report_run(r)
                failed = failed or bool(r["failed"])
                sys.stdout.flush()
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"bad_shape drops and refusals, all runs: {bad_total} (must be 0)")
    finals = {label: [r["broker"].get("return_mean_100") for r in runs if r["label"] == label]
              for label in ("mixed", "same")}
    got = {k: [v for v in vs if v is not None] for k, vs in finals.items()}
    per_seed = "; ".join(f"{k} " + ", ".join(fmt(v, ".2f") for v in vs) for k, vs in finals.items())
    med = {k: statistics.median(v) if v else None for k, v in got.items()}
    diff = f" (diff {med['mixed'] - med['same']:+.3f})" if None not in med.values() else ""
    print(f"final return_mean_100 (broker), median over {a.seeds} seed(s): mixed {fmt(med['mixed'])} vs "
          f"same shape {fmt(med['same'])}{diff}; per seed: {per_seed}")
    gaps = {k: [r["gap"] for r in runs if r["label"] == k and r["gap"] is not None]
            for k in ("mixed", "same")}
    print("largest gap between a worker's share of the trained steps and of the sent ones: "
          + ", ".join(f"{k} {max(v) * 100:.1f} points" if v else f"{k} n/a" for k, v in gaps.items()))
    if bad_total or failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
