"""Data-parallel learner ranks as real processes, for the tests of zclaw/learner/distributed.py.

:func:`run_ranks` spawns ``size`` processes (torch.multiprocessing, ``spawn``); each joins a gloo group on a
free loopback port exactly as a learner rank does (:func:`zclaw.learner.distributed.world_from_env` and
``join`` from the variables torchrun sets) and calls ``fn(sync, *args)``; what each returns comes back, by
rank, through a file. A rank that raises fails the call with its traceback; the whole group is killed at
``timeout``, so a hung collective fails the test instead of hanging it.

:func:`random_batch` and :func:`split_batch` build real ``batch`` messages (v2 layout: ``[T, C]`` columns,
``columns`` env counts per segment) and cut one into the part a rank would have been served.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.multiprocessing as mp

from zclaw.learner import distributed
from zclaw.launch import free_port
from zclaw.wire import EnvSpec, Message, make, parse
from zclaw.wire.messages import ENV_ARRAYS, batch_dims

__all__ = ["run_ranks", "random_batch", "split_batch"]


def _rank_main(rank: int, fn: Callable[..., Any], size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world, device = distributed.join(distributed.world_from_env(), "cpu", timeout_s=60)
    try:
        result = fn(distributed.Sync(world, device), *args)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))  # saved before the group is torn down
    finally:
        distributed.leave()
    # No interpreter finalisation: there the threads of rank 0's TCP store and of gloo can be destroyed still
    # joinable, and C++ aborts the process ("terminate called without an active exception", SIGABRT after a
    # rank had finished; seen once in CI), which would fail a rank whose work is done and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 180.0) -> List[Any]:
    """``fn(sync, *args)`` on ``size`` gloo ranks in their own processes; their results by rank. ``fn`` must
    be importable by name (a module-level function of a test module or of this package)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank_main, args=(fn, size, port, out, args), nprocs=size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the {size} ranks did not finish within {timeout} s (a hung "
                                         "collective?)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(size)]


def random_batch(spec: EnvSpec, columns: Sequence[int], T: int, rng: np.random.Generator, K: int = 1,
                 version: int = 0, workers: Optional[Sequence[str]] = None, seq0: int = 0) -> Message:
    """A batch of ``len(columns)`` segments (segment b: ``columns[b]`` envs) of T steps, random but
    well-formed: observations off-centre (the normaliser has work), some terminations and time-limit
    truncations (with their ``final_obs``), importance weights around 1; segment b comes from
    ``workers[b]`` (default: a worker of its own, so no reward-scale carry chains two segments)."""
    B, C = len(columns), int(sum(columns))
    D, A = spec.obs_shape[0], spec.action_shape[0]
    arrays: Dict[str, np.ndarray] = {
        "obs": (rng.normal(size=(T + 1, C, D)) * 2.0 + 1.5).astype(np.float32),
        "action": rng.uniform(-1, 1, size=(T, C, A)).astype(np.float32),
        "reward": rng.normal(0.3, 1.0, size=(T, C)).astype(np.float32),
        "terminated": rng.random((T, C)) < 0.05,
        "truncated": np.zeros((T, C), bool),
        "option": rng.integers(0, K, size=(T, C)).astype(np.int32),
        "option_start": rng.random((T, C)) < (0.3 if K > 1 else 0.0),
        "logp_action": rng.normal(-1.5, 0.3, size=(T, C)).astype(np.float32),
        "logp_option": np.full((T, C), -np.log(K), np.float32),
        "policy_version": np.full((B, T), max(0, version - 1), np.int64),
        "is_weight": rng.uniform(0.5, 1.5, size=B).astype(np.float32),
    }
    cut = (rng.random((T, C)) < 0.03) & ~arrays["terminated"]
    arrays["truncated"] = cut
    at = np.argwhere(cut).astype(np.int32).reshape(-1, 2)  # (t, c) rows
    arrays["final_at"] = at
    arrays["final_obs"] = (rng.normal(size=(len(at), D)) * 2.0 + 1.5).astype(np.float32)
    names = list(workers) if workers is not None else [f"w{b}" for b in range(B)]
    frames = make("batch", arrays, keys=list(range(B)), columns=[int(n) for n in columns], workers=names,
                  seqs=[seq0 + b for b in range(B)], spec_hash=spec.hash,
                  episodes=[{"return": -5.0, "length": 50}])
    msg = parse(frames, ("batch",))
    batch_dims(msg, spec)
    return msg


def split_batch(msg: Message, spec: EnvSpec, segments: Sequence[int]) -> Message:
    """The batch of ``msg``'s segments ``segments`` (consecutive, in order): its columns, its rows of
    ``final_obs``/``final_at`` (column indexes shifted), its header entries."""
    segs = list(segments)
    assert segs == list(range(segs[0], segs[-1] + 1)), "consecutive segments only"
    columns = list(msg["columns"])
    lo = int(sum(columns[: segs[0]]))
    hi = lo + int(sum(columns[b] for b in segs))
    a = msg.arrays
    arrays = {name: np.ascontiguousarray(a[name][:, lo:hi]) for name in ENV_ARRAYS}
    arrays["policy_version"] = np.ascontiguousarray(a["policy_version"][segs])
    arrays["is_weight"] = np.ascontiguousarray(a["is_weight"][segs])
    fa = np.asarray(a["final_at"])
    rows = (fa[:, 1] >= lo) & (fa[:, 1] < hi)
    arrays["final_at"] = np.ascontiguousarray((fa[rows] - np.array([0, lo], np.int32)).astype(np.int32))
    arrays["final_obs"] = np.ascontiguousarray(a["final_obs"][rows])
    pick = lambda name: [msg[name][b] for b in segs]  # noqa: E731
    frames = make("batch", arrays, keys=pick("keys"), columns=pick("columns"), workers=pick("workers"),
                  seqs=pick("seqs"), spec_hash=msg["spec_hash"], episodes=list(msg["episodes"]))
    part = parse(frames, ("batch",))
    batch_dims(part, spec)
    return part
