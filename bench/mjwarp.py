"""Benchmark the ``mjwarp:`` backend on one GPU: env alone, acting loop, and end-to-end
training. (Not a test.)

Three rates, measured in the same run with the same number of worlds (default 4096):

* **env**: ``env.step`` with random actions made on the device, nothing else (the simulator's ceiling);
* **act**: ``OptionPolicy.act -> clip -> env.step`` in this process on the same GPU (the worker's ceiling);
* **e2e**: broker, learner (``learner.device = cuda:G``) and one worker (``--gpu G --envs N``) as real
  processes on loopback; env steps/s inserted into the broker and consumed by the learner's updates,
  over a window after the learner has published a few versions.

Printed as steps/s and as ratios to **env** (the baseline of this run). Target for e2e on one H200: >= 200k
env steps/s. Needs ``pip install 'zclaw[mjwarp]'`` and a CUDA torch. Usage::

    python bench/mjwarp.py [--envs 4096] [--gpu 0] [--window 10] [--segment-length 32] [--skip-e2e]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import zmq

from zclaw import config
from zclaw.envs import make_env
from zclaw.launch import StatusClient, free_port, stop_processes
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config
from zclaw.wire import tcp

ENV = "mjwarp:Reach"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def env_rate(env: Any, window: float) -> float:
    N, A = env.num_envs, env.spec.action_shape
    env.reset()
    for _ in range(5):  # kernels compiled, CUDA graphs captured
        env.step(torch.rand((N,) + A, device=env.device) * 2 - 1)
    sync(env.device)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < window:
        for _ in range(50):
            env.step(torch.rand((N,) + A, device=env.device) * 2 - 1)
        steps += 50
        sync(env.device)
        env.pop_episodes()
    return steps * N / (time.perf_counter() - t0)


def act_rate(env: Any, model: OptionPolicy, window: float) -> float:
    N = env.num_envs
    low = torch.tensor(env.spec.action_low, device=env.device)
    high = torch.tensor(env.spec.action_high, device=env.device)
    obs = env.reset()
    prev = torch.zeros(N, dtype=torch.long, device=env.device)
    start = torch.ones(N, dtype=torch.bool, device=env.device)
    steps, t0 = 0, time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - t0 < window:
            for _ in range(50):
                out = model.act(obs, prev, start)
                res = env.step(torch.max(torch.min(out["action"], high), low))
                obs, prev, start = res.obs, out["option"], res.terminated | res.truncated
            steps += 50
            sync(env.device)
            env.pop_episodes()
    return steps * N / (time.perf_counter() - t0)


def e2e_rates(envs: int, gpu: int, window: float, T: int, tmp: Path) -> Dict[str, float]:
    ports = {k: free_port() for k in ("ingest_port", "serve_port", "publish_port", "learner_port")}
    common: List[str] = ["--set", f"worker.segment_length={T}", "--set", f"learner.device=cuda:{gpu}",
                         "--set", "learner.batch_segments=2", "--set", "broker.capacity=16",
                         "--set", "log.status_s=5", "--set", "learner.tensorboard=false"]
    for k, v in ports.items():
        common += ["--set", f"network.{k}={v}"]
    base = [sys.executable, "-m", "zclaw.cli"]
    procs: List[subprocess.Popen] = []
    ctx = zmq.Context()
    broker = StatusClient(ctx, tcp("127.0.0.1", ports["serve_port"]))
    learner = StatusClient(ctx, tcp("127.0.0.1", ports["learner_port"]))

    def start(role: str, *extra: str) -> None:
        log = open(tmp / f"{role}.log", "wb")
        procs.append(subprocess.Popen(base + [role] + common + list(extra), stdout=log,
                                      stderr=subprocess.STDOUT))

    def wait(client: StatusClient, pred: Any, timeout: float) -> Dict[str, Any]:
        reached, rep = client.wait_until(pred, timeout, interval=0.5)
        if not reached:
            raise RuntimeError(f"not reached in {timeout:.0f} s; last report {rep}; logs in {tmp}")
        return rep

    try:
        start("broker")
        start("learner", "--run-dir", str(tmp / "run"))
        start("worker", "--env", ENV, "--envs", str(envs), "--gpu", str(gpu))
        wait(learner, lambda r: (r.get("version") or 0) >= 3, timeout=600)
        b0, l0, t0 = broker.report(), learner.report(), time.monotonic()
        time.sleep(window)
        b1, l1, t1 = broker.report(), learner.report(), time.monotonic()
        assert b0 and b1 and l0 and l1
        dt = t1 - t0
        return {
            "e2e_inserted": (b1["inserted_steps"] - b0["inserted_steps"]) / dt,
            "e2e_trained": (l1["steps_consumed"] - l0["steps_consumed"]) / dt,
            "versions_per_s": (l1["version"] - l0["version"]) / dt,
        }
    finally:
        stop_processes(procs[::-1], 20)
        broker.close()
        learner.close()
        ctx.term()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", type=int, default=4096)
    ap.add_argument("--gpu", type=int, default=0, help="-1: Warp's CPU device (slow; for a dry run)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per measurement")
    ap.add_argument("--segment-length", type=int, default=32)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--json", type=str, default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    device = torch.device("cpu") if args.gpu < 0 else torch.device(f"cuda:{args.gpu}")
    t = time.perf_counter()
    env = make_env(ENV, args.envs, 0, device)
    built = time.perf_counter() - t
    cfg = config.load()
    model = OptionPolicy(policy_config(cfg["policy"], env.spec)).to(device).eval()
    out: Dict[str, Any] = {"envs": args.envs, "device": str(device), "build_s": round(built, 1)}
    out["env"] = env_rate(env, args.window)
    out["act"] = act_rate(env, model, args.window)
    env.close()
    if not args.skip_e2e and args.gpu >= 0:
        with tempfile.TemporaryDirectory() as d:
            out.update(e2e_rates(args.envs, args.gpu, args.window, args.segment_length, Path(d)))
    base = out["env"]
    print(f"mjwarp bench: {ENV}, {args.envs} worlds on {device} (built in {built:.1f} s)")
    for k in ("env", "act", "e2e_inserted", "e2e_trained"):
        if k in out:
            print(f"  {k:13s} {out[k]:>12,.0f} env steps/s   {out[k] / base:6.3f} x env")
    if "e2e_trained" in out:
        verdict = "meets" if out["e2e_trained"] >= 200_000 else "misses"
        print(f"  target e2e >= 200,000 env steps/s: {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
