"""Benchmark: what does the worker's machinery cost over a bare acting loop? (Not a test.)

Two ways of stepping the same 16 envs (``Reacher-v5`` unless ``--env``) with the same network
(``OptionPolicy.act``, CPU, one torch thread), measured in the same run and alternated so that machine
noise hits both alike:

* **worker**: the real ``zclaw worker`` process, against a stand-in broker (a real PULL socket drained and
  validated by a thread, and a ROUTER that welcomes the worker's handshake) and a stand-in learner (real
  PUB + ROUTER answering the snapshot request). Its rate is measured from segment arrivals at the PULL
  socket (steps between the first and the last segment of a window over the time between them). Between
  its windows the process is paused with SIGSTOP.
* **bare**: ``act -> clip -> env.step`` in this process, with no recording, no segments, no sockets.

Target: worker / bare >= 0.85. Usage::

    python bench/collect.py [--env gym:Reacher-v5] [--envs 16] [--rounds 5] [--window 2] [--options 1]
        [--segment-length 64]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import List, Tuple

import torch
import zmq

from zclaw import __version__, config
from zclaw.envs import make_env
from zclaw.launch import stop_processes
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config, weights_message
from zclaw.wire import bind, make, make_socket, parse, segment_dims

ENV = "gym:Reacher-v5"  # the default; --env picks another


class StandIns:
    """A broker's PULL (drained, validated, arrival times kept) and ROUTER (answers the worker's ``hello``
    handshake and heartbeats with ``welcome``), and a learner's PUB + ROUTER, in threads."""

    def __init__(self, ctx: zmq.Context, spec, weights: bytes) -> None:
        self.spec = spec
        self.weights = weights
        self.pull = make_socket(ctx, zmq.PULL)
        self.ingest = bind(self.pull, "127.0.0.1", 0)
        self.pub = make_socket(ctx, zmq.PUB)
        self.publish_port = bind(self.pub, "127.0.0.1", 0)
        self.router = make_socket(ctx, zmq.ROUTER)
        self.learner_port = bind(self.router, "127.0.0.1", 0)
        self.serve = make_socket(ctx, zmq.ROUTER)
        self.serve_port = bind(self.serve, "127.0.0.1", 0)
        self.arrivals: List[Tuple[float, int]] = []  # (monotonic time, steps) per segment
        self.bad = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._drain, daemon=True),
                        threading.Thread(target=self._learner, daemon=True),
                        threading.Thread(target=self._broker_serve, daemon=True)]
        for t in self.threads:
            t.start()

    def _drain(self) -> None:
        while not self.stop.is_set():
            if not self.pull.poll(50):
                continue
            frames = self.pull.recv_multipart(copy=False)
            now = time.monotonic()
            msg = parse(frames)
            if msg.kind != "segment":
                continue
            try:
                T, N, _ = segment_dims(msg, self.spec)
            except Exception:
                self.bad += 1
                continue
            self.arrivals.append((now, T * N))

    def _learner(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(50):
                ident, empty, *frames = self.router.recv_multipart()
                if parse(frames).kind == "snapshot":
                    self.router.send_multipart([ident, empty, self.weights])

    def _broker_serve(self) -> None:
        welcome = make("welcome", role="broker", identity="bench-broker", host="bench", pid=os.getpid(),
                       zclaw=__version__, spec=self.spec.to_dict(), segment_length=None,  # the worker's T
                       max_message_bytes=1 << 30)
        while not self.stop.is_set():
            if self.serve.poll(50):
                ident, empty, *frames = self.serve.recv_multipart()
                if parse(frames).kind == "hello":
                    self.serve.send_multipart([ident, empty, *welcome])

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        for s in (self.pull, self.pub, self.router, self.serve):
            s.close(0)


def worker_rate(stand: StandIns, proc: subprocess.Popen, window: float) -> float:
    """Resume the worker for ``window`` s; steps/s between the first and last segment that arrived."""
    start_index = len(stand.arrivals)
    proc.send_signal(signal.SIGCONT)
    time.sleep(window)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(0.1)  # segments in flight arrive; they were made inside the window
    got = stand.arrivals[start_index:]
    if len(got) < 3:
        raise RuntimeError(f"only {len(got)} segments arrived in a {window} s window")
    steps = sum(s for _, s in got[1:])
    return steps / (got[-1][0] - got[0][0])


def bare_rate(env, model: OptionPolicy, window: float) -> float:
    """``act -> clip -> step`` for ``window`` s; steps/s."""
    spec = env.spec
    low = torch.tensor(spec.action_low).reshape(spec.action_shape)
    high = torch.tensor(spec.action_high).reshape(spec.action_shape)
    N = env.num_envs
    obs = env.reset()
    prev = torch.zeros(N, dtype=torch.long)
    start_flags = torch.ones(N, dtype=torch.bool)
    steps = 0
    t0 = time.perf_counter()
    deadline = t0 + window
    while True:
        for _ in range(64):
            out = model.act(obs, prev, start_flags)
            res = env.step(torch.max(torch.min(out["action"], high), low))
            obs, prev, start_flags = res.obs, out["option"], res.terminated | res.truncated
        steps += 64 * N
        now = time.perf_counter()
        if now >= deadline:
            return steps / (now - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window", type=float, default=2.0, help="seconds per measurement")
    ap.add_argument("--options", type=int, default=1, help="policy.options K")
    ap.add_argument("--segment-length", type=int, default=64)
    ap.add_argument("--env", default=ENV, help=f"env id (default {ENV})")
    args = ap.parse_args()
    env_id = args.env

    torch.set_num_threads(1)
    cfg = config.load(None, [f"policy.options={args.options}"])
    env = make_env(env_id, args.envs, 12345, torch.device("cpu"))
    spec = env.spec
    model = OptionPolicy(policy_config(cfg["policy"], spec))
    model.eval()
    ctx = zmq.Context()
    stand = StandIns(ctx, spec, weights_message(model, 0, 0, spec.hash))
    cmd = [
        sys.executable, "-m", "zclaw.cli", "worker", "--env", env_id, "--envs", str(args.envs),
        "--set", f"worker.segment_length={args.segment_length}", "--set", "worker.threads=1",
        "--set", f"policy.options={args.options}", "--set", "log.status_s=3600", "--set", "log.level=warning",
        "--set", f"network.ingest_port={stand.ingest}", "--set", f"network.publish_port={stand.publish_port}",
        "--set", f"network.learner_port={stand.learner_port}",
        "--set", f"network.serve_port={stand.serve_port}",
    ]
    proc = subprocess.Popen(cmd)
    worker_rates: List[float] = []
    bare_rates: List[float] = []
    try:
        deadline = time.monotonic() + 60
        while len(stand.arrivals) < 5:  # started, acting, warmed up
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start sending segments")
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        bare_rate(env, model, 1.0)  # warm-up of the bare loop
        for r in range(args.rounds):
            worker_rates.append(worker_rate(stand, proc, args.window))
            bare_rates.append(bare_rate(env, model, args.window))
            print(f"round {r + 1}: worker {worker_rates[-1]:9.0f} steps/s   bare {bare_rates[-1]:9.0f} "
                  f"steps/s   ratio {worker_rates[-1] / bare_rates[-1]:.3f}", flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # it may be paused between rounds
        stop_processes([proc], 10)
        stand.close()
        ctx.term()
        env.close()
    w, b = statistics.median(worker_rates), statistics.median(bare_rates)
    ratio = statistics.median(x / y for x, y in zip(worker_rates, bare_rates))  # paired: noise hits both
    print()
    print(f"{env_id}, {args.envs} envs, T={args.segment_length}, K={args.options}, {args.rounds} rounds x "
          f"{args.window:g} s, median")
    print(f"{'loop':<34}{'env steps/s':>14}")
    print(f"{'bare (act + step, no sockets)':<34}{b:>14.0f}")
    print(f"{'zclaw worker (process, PUSH/SUB)':<34}{w:>14.0f}")
    print(f"{'ratio worker / bare (per round)':<34}{ratio:>14.3f}   (target >= 0.85: "
          f"{'ok' if ratio >= 0.85 else 'MISSED'})")
    print(f"invalid segments: {stand.bad}, worker exit code: {proc.returncode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
