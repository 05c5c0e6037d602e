"""``worker.vectorize = "subprocess"``: the ``gym:`` envs of one worker split over P child processes.

For slow envs (Fetch and ShadowHand step at 0.6-1k/s per core, against 12-15k/s for Reacher) the
Python loop of :class:`~zclaw.envs.gym_backend.GymBatchedEnv` leaves every core but one idle. Here
child k runs a ``GymBatchedEnv`` over its contiguous slice of the N envs, seeded so that env i is
still seeded ``seed + i``: the batch behaves exactly as the loop backend with the same seed (same
observations, same flattening, same ``final_obs`` and episode stats), only stepped in parallel.

Each step sends every child its action slice, then collects the results (numpy arrays over a pipe,
a few hundred bytes per env). Children are started with ``spawn``: a fork of a worker would copy its
ZeroMQ context and torch thread pools. A child that dies makes the next call raise
:class:`EnvProcessError` naming it, and the worker exits.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core import StepResult
from ..wire.messages import EnvSpec

#: how long to wait for a child's answer before declaring it dead (the first make can be slow)
ANSWER_S = 120.0


class EnvProcessError(RuntimeError):
    """An env subprocess died or failed; the message names it and its error."""


def _child(conn: Any, name: str, num_envs: int, seed: int) -> None:
    """Child main: build a loop backend on the CPU and serve reset/step/close until told to stop."""
    torch.set_num_threads(1)
    from .gym_backend import GymBatchedEnv

    try:
        env = GymBatchedEnv(name, num_envs, seed, torch.device("cpu"))
    except BaseException as exc:  # report it to the parent instead of dying silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("spec", env.spec.to_dict()))
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "reset":
                conn.send(("ok", env.reset(arg).numpy()))
            elif cmd == "step":
                r = env.step(torch.from_numpy(arg))
                finals = {i: fo.numpy() for i, fo in r.final_obs.items()}
                conn.send(("ok", (r.obs.numpy(), r.reward.numpy(), r.terminated.numpy(), r.truncated.numpy(),
                                  finals, r.episodes)))
            elif cmd == "close":
                break
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        env.close()


def split(num_envs: int, processes: int) -> List[Tuple[int, int]]:
    """Contiguous ``(start, count)`` slices of ``num_envs`` over ``processes`` children, sizes
    differing by <= 1."""
    base, extra = divmod(num_envs, processes)
    out, start = [], 0
    for k in range(processes):
        n = base + (1 if k < extra else 0)
        out.append((start, n))
        start += n
    return out


class SubprocessBatchedEnv:
    """``num_envs`` gym envs in ``processes`` children (0: one per CPU core, at most ``num_envs``)."""

    def __init__(self, name: str, num_envs: int, seed: int, device: torch.device, processes: int = 0) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs = {num_envs} must be >= 1")
        P = processes if processes > 0 else (os.cpu_count() or 1)
        P = max(1, min(P, num_envs))
        self.name, self.num_envs, self.seed = name, int(num_envs), int(seed)
        self.device = torch.device(device)
        self.slices = split(self.num_envs, P)
        ctx = mp.get_context("spawn")
        self._conns: List[Any] = []
        self._procs: List[Any] = []
        try:
            for start, n in self.slices:
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_child, args=(child, name, n, seed + start), daemon=True,
                                name=f"zclaw-env-{start}")
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
            specs = [self._recv(k) for k in range(len(self._procs))]
        except BaseException:
            self.close()
            raise
        d = dict(specs[0])
        self.spec = EnvSpec.from_dict(d)
        self._needs_reset = True

    def _recv(self, k: int) -> Any:
        conn, proc = self._conns[k], self._procs[k]
        if not conn.poll(ANSWER_S):
            raise EnvProcessError(f"env subprocess {k} (pid {proc.pid}) did not answer "
                                  f"within {ANSWER_S:.0f} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise EnvProcessError(f"env subprocess {k} (pid {proc.pid}) died (exit "
                                  f"code {proc.exitcode})") from None
        if kind == "error":
            if "unknown gym env id" in value or "ValueError" in value:
                raise ValueError(f"env subprocess {k}: {value}")
            raise EnvProcessError(f"env subprocess {k} (pid {proc.pid}) failed: {value}")
        return value

    def reset(self, seed: Optional[int] = None) -> torch.Tensor:
        for (start, _), conn in zip(self.slices, self._conns):
            conn.send(("reset", None if seed is None else seed + start))
        obs = np.concatenate([self._recv(k) for k in range(len(self._conns))])
        self._needs_reset = False
        return self._tensor(obs)

    def step(self, action: torch.Tensor) -> StepResult:
        if self._needs_reset:
            raise RuntimeError("SubprocessBatchedEnv.step called before reset()")
        want = (self.num_envs,) + self.spec.action_shape
        if tuple(action.shape) != want:
            raise ValueError(f"action has shape {list(action.shape)}, expected "
                             f"{list(want)} (one row per env)")
        acts = action.detach().to("cpu", torch.float32).numpy()
        for (start, n), conn in zip(self.slices, self._conns):
            conn.send(("step", np.ascontiguousarray(acts[start:start + n])))
        parts = [self._recv(k) for k in range(len(self._conns))]
        final_obs: Dict[int, torch.Tensor] = {}
        episodes: List[Dict[str, Any]] = []
        for (start, _), (_, _, _, _, finals, eps) in zip(self.slices, parts):
            for i, fo in finals.items():
                final_obs[start + int(i)] = self._tensor(fo)
            episodes.extend(eps)
        cat = [np.concatenate([p[j] for p in parts]) for j in range(4)]
        return StepResult(
            obs=self._tensor(cat[0]), reward=self._tensor(cat[1]), terminated=self._tensor(cat[2]),
            truncated=self._tensor(cat[3]), final_obs=final_obs, episodes=episodes,
        )

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(2)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._needs_reset = True

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        return t if self.device.type == "cpu" else t.to(self.device)

    def __repr__(self) -> str:
        return f"SubprocessBatchedEnv({self.name!r}, num_envs={self.num_envs}, processes={len(self.slices)})"
