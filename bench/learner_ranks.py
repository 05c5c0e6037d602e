"""Benchmark: two data-parallel learner ranks against one, on the same global batch size.

Synthetic batches in-process (no broker, no network): each rank's batches are built before the clock starts,
so the figures are the learner's update alone, the part ranks divide. Both configurations run in the same
invocation, each as its own process group (torch.multiprocessing, spawn; gloo on CPU, ``--device cuda``:
NCCL, one GPU per rank), each rank on ``--threads`` torch threads:

* **1 rank** updates on batches of ``--segments`` segments (``--envs`` envs x ``--T`` steps each);
* **2 ranks** update on ``--segments / 2`` segments each: the same global batch, the same minibatch count per
  epoch (each rank's minibatch is half of one), so one update of each does the same learning;
* **2 ranks, each on the whole batch**: what ``learner.batch_segments`` per rank gives in a run (every rank
  asks the broker for that many segments), so the global batch doubles; its figure is env steps per second
  against 1 rank's.

Each timed update is what the learner's loop does per batch: the ranks' stop vote, then
``Trainer.update`` (statistics merged, per epoch the advantage statistics, per minibatch the gradients). It
prints the update throughput of both and their ratio, and the collectives' share of a 2-rank update, by kind
(``Sync.seconds``: wall time inside the collectives, waiting for the other rank included), with the gradient
all-reduce's size and mean time: the per-update costs docs/cluster.md's paper model uses.

    python bench/learner_ranks.py [--updates 20] [--warmup 3] [--segments 8] [--envs 16] [--T 64]
                                  [--obs 17] [--act 6] [--hidden 64,64] [--threads 1] [--device cpu]
                                  [--ranks 2]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
import torch.multiprocessing as mp

from zclaw import config
from zclaw.launch import free_port
from zclaw.learner import distributed
from zclaw.learner.trainer import Trainer
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config
from zclaw.wire import EnvSpec, Message, make, parse


def synthetic_batch(spec: EnvSpec, segments: int, envs: int, T: int, rng: np.random.Generator,
                    version: int, seq0: int) -> Message:
    """``segments`` segments of ``envs`` envs x T steps, time-major ``[T, C]`` as the broker sends them."""
    C, D, A = segments * envs, spec.obs_shape[0], spec.action_shape[0]
    arrays = {
        "obs": rng.normal(size=(T + 1, C, D)).astype(np.float32),
        "action": rng.uniform(-1, 1, size=(T, C, A)).astype(np.float32),
        "reward": rng.normal(size=(T, C)).astype(np.float32),
        "terminated": rng.random((T, C)) < 0.01,
        "truncated": np.zeros((T, C), bool),
        "option": np.zeros((T, C), np.int32),
        "option_start": np.zeros((T, C), bool),
        "logp_action": rng.normal(-A, 0.5, size=(T, C)).astype(np.float32),
        "logp_option": np.zeros((T, C), np.float32),
        "policy_version": np.full((segments, T), max(0, version - 1), np.int64),
        "final_obs": np.zeros((0, D), np.float32),
        "final_at": np.zeros((0, 2), np.int32),
        "is_weight": np.ones(segments, np.float32),
    }
    frames = make("batch", arrays, keys=list(range(segments)), columns=[envs] * segments,
                  workers=[f"w{b}" for b in range(segments)], seqs=[seq0] * segments, spec_hash=spec.hash,
                  episodes=[])
    return parse(frames, ("batch",))


def rank_main(rank: int, size: int, port: int, out: str, args: Dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args["threads"])
    sync = distributed.start(args["device"])
    try:
        spec = EnvSpec("bench:Synthetic-v0", (args["obs"],), (args["act"],), (-1.0,) * args["act"],
                       (1.0,) * args["act"])
        pcfg = dict(config.defaults()["policy"], hidden=args["hidden"])
        torch.manual_seed(0)
        model = OptionPolicy(policy_config(pcfg, spec))
        lcfg = dict(config.defaults()["learner"], target_kl=0.0)  # every epoch runs: a fixed amount of work
        trainer = Trainer(model, lcfg, sync.device, action_low=spec.action_low, action_high=spec.action_high,
                          sync=sync)
        segments = args["segments"] // size if args["split"] else args["segments"]
        rng = np.random.default_rng(1000 + rank)
        n = args["warmup"] + args["updates"]
        batches = [synthetic_batch(spec, segments, args["envs"], args["T"], rng, i, i) for i in range(n)]
        times: List[float] = []
        cpu0 = 0.0
        before: Dict[str, float] = {}
        calls: Dict[str, int] = {}
        for i, batch in enumerate(batches):
            if i == args["warmup"]:
                before, calls = dict(sync.seconds), dict(sync.calls)
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            sync.any(False)  # the learner loop's stop vote, once per update
            trainer.update(batch, i)
            if sync.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        timed = times[args["warmup"]:]
        result = {
            "update_s": float(np.median(timed)), "total_s": float(sum(timed)),
            "cpu_s": (time.process_time() - cpu0) / args["updates"],  # this process's CPU per update
            "collective_s": {k: v - before.get(k, 0.0) for k, v in sync.seconds.items()},
            "collective_calls": {k: v - calls.get(k, 0) for k, v in sync.calls.items()},
            "params": sum(p.numel() for p in trainer.params),
        }
    finally:
        distributed.leave()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def run(size: int, args: Dict[str, Any], split: bool = True) -> List[Dict[str, Any]]:
    args = dict(args, split=split)
    with tempfile.TemporaryDirectory() as out:
        if size == 1:
            rank_main(0, 1, 0, out, args)  # alone: WORLD_SIZE=1, no group, no collective
        else:
            mp.start_processes(rank_main, args=(size, free_port(), out, args), nprocs=size, join=True,
                               start_method="spawn")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=20, help="timed updates per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    ap.add_argument("--segments", type=int, default=8, help="global batch, in segments (even)")
    ap.add_argument("--envs", type=int, default=16, help="envs per segment")
    ap.add_argument("--T", type=int, default=64, help="steps per segment")
    ap.add_argument("--obs", type=int, default=17, help="observation size")
    ap.add_argument("--act", type=int, default=6, help="action size")
    ap.add_argument("--hidden", default="64,64", help="hidden layers (policy.hidden)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=2,
                    help="2: both configurations; 1: the 1-rank update alone (a host with one GPU, where two "
                         "NCCL ranks cannot share it)")
    a = ap.parse_args()
    if a.segments < 2 or a.segments % 2:
        ap.error("--segments must be even and >= 2 (two ranks split it)")
    args = dict(vars(a), hidden=[int(h) for h in a.hidden.split(",")])
    lcfg = config.defaults()["learner"]
    steps = a.segments * a.envs * a.T
    print(f"global batch: {a.segments} segments x {a.envs} envs x {a.T} steps = {steps} steps; "
          f"{lcfg['epochs']} epochs x {lcfg['minibatches']} minibatches; obs {a.obs}, act {a.act}, hidden "
          f"{args['hidden']}; {a.threads} thread(s) per rank, {a.device}")
    one = run(1, args)[0]
    u1 = 1.0 / one["update_s"]
    print(f"1 rank : {u1:.2f} updates/s ({one['update_s'] * 1e3:.1f} ms/update, {steps * u1:,.0f} steps/s; "
          f"CPU {one['cpu_s'] * 1e3:.0f} ms/update)")
    if a.ranks == 1:
        return
    two = run(2, args)
    both = run(2, args, split=False)[0]
    lead = two[0]
    u2 = 1.0 / lead["update_s"]
    cpu = ", ".join(f"{r['cpu_s'] * 1e3:.0f}" for r in two)
    print(f"2 ranks: {u2:.2f} updates/s ({lead['update_s'] * 1e3:.1f} ms/update, {steps * u2:,.0f} steps/s; "
          f"CPU per rank {cpu} ms/update)")
    print(f"ratio 2 ranks / 1 rank, update throughput: {u2 / u1:.3f}")
    ub = 1.0 / both["update_s"]
    print(f"2 ranks, each on the whole batch (global batch x2): {ub:.2f} updates/s "
          f"({both['update_s'] * 1e3:.1f} ms/update, {2 * steps * ub:,.0f} steps/s); "
          f"ratio of steps/s to 1 rank: {2 * ub / u1:.3f}")
    share = {k: v / lead["total_s"] for k, v in lead["collective_s"].items()}
    parts = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
    print(f"collectives' share of a 2-rank update: {100 * sum(share.values()):.1f}% ({parts})")
    grads = lead["collective_calls"].get("gradients", 0)
    per_update = grads / a.updates
    mean_ms = 1e3 * lead["collective_s"].get("gradients", 0.0) / max(1, grads)
    print(f"gradient all-reduce: {per_update:.0f} per update, {lead['params']:,} parameters = "
          f"{4 * lead['params']:,} bytes each, {mean_ms:.3f} ms mean (waiting for the other rank included)")


if __name__ == "__main__":
    main()
