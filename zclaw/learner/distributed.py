"""Data-parallel learner ranks on torch.distributed: N learner processes train one policy together.

Why: one learner process is the ceiling of a run's updates per second. rl_games, RSL-RL and skrl train on
several GPUs or nodes through ``torchrun`` (the launcher Isaac Lab documents); zclaw's learner does the same.
Every rank is a whole learner that asks the broker for its own batches (its own identity, its own requests
in flight); what the ranks agree on makes them one learner on the union of their batches:

* **gradients** are averaged over every rank's minibatch before the optimiser step, each rank's weighted by
  the samples its minibatch holds (:meth:`Sync.gradients`): the mean over their union, so N ranks on N parts
  of a batch step as one learner on the whole batch (exactly so for K = 1; for K > 1 the option-level terms
  are masked means, whose ranks are weighed by minibatch size, not by how many steps each mask holds). Every
  rank starts from rank 0's state (:meth:`Sync.share`), so every rank holds identical parameters;
* **the running statistics**: the observation normaliser's (count, mean, variance) and the reward scale's are
  merged across ranks (each rank's batch moments, Chan et al.'s parallel formula, in rank order, one
  all-gather: :meth:`Sync.batch`) before they are folded in, so every rank normalises alike; PopArt's value
  target moments likewise, once the targets exist (:meth:`Sync.merge`), so every rank moves the same
  statistics and rescales its critic layer alike;
* **each minibatch's advantage normalisation** uses every rank's minibatch together (one all-reduce per
  epoch for all its minibatches: :meth:`Sync.normalizers`);
* **every decision that changes how many collectives come next**: the minibatch count (the fewest samples any
  rank's batch holds bounds it), whether a step is skipped (a loss or gradient not finite on any rank skips it
  on all), whether the KL stop fires (the KL averaged over the ranks), and when to stop (:meth:`Sync.any`,
  a vote before each update). Collectives match by order, so every rank must call the same ones in the
  same order; a rank that cannot (an update that raised half-way) ends the group (``GroupBroken``) rather
  than drift;
* **the version counter** advances once per update on every rank: one sequence. Rank 0 alone binds the
  learner's PUB and ROUTER, publishes weights, answers snapshots and ``zclaw status``, writes checkpoints and
  metrics (zclaw/learner/server.py); the other ranks only train.

Start the ranks with ``torchrun --nproc-per-node N -m zclaw.cli learner ...`` (it sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; ``--nnodes`` and a rendezvous endpoint for
several nodes), or with ``zclaw learner --nproc N``, which starts and watches N ranks on one machine itself
(zclaw/learner/ranks.py). Without ``WORLD_SIZE`` (or with 1) the learner is alone: :class:`Sync` then
returns what it is given and calls no torch.distributed function, so a single learner runs exactly the code
it ran before ranks existed.

Backend: NCCL when ``learner.device`` is CUDA (rank r on ``cuda:LOCAL_RANK``), gloo on CPU. Only gloo is
exercised by the tests (no GPU there); the NCCL path uses the same calls on CUDA buffers, as torch documents.
"""
from __future__ import annotations

import datetime
import functools
import os
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..policy.normalizer import Moments

#: how long a rank waits in a collective for the others. Ranks wait for each other as long as the slowest
#: waits for a batch, so a broker without data for this long ends the group (exit 1; ``--resume`` goes on).
#: A rank that dies is seen at once (gloo: its connections close; the launcher stops the rest).
TIMEOUT_S = 3600.0
#: the variables torchrun sets and a rank reads
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

#: (mean, unbiased std, count) of one set of advantages: :func:`zclaw.policy.losses.normalize`'s ``stats``
Stats = Tuple[float, float, float]


class World(NamedTuple):
    """Where this process stands among the learner ranks (alone: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""  # "gloo" or "nccl" once joined (:func:`join`); "" alone

    @property
    def main(self) -> bool:
        """Rank 0: the one that publishes, serves, checkpoints and reports."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def describe(self) -> Dict[str, Any]:
        """For the status report and the log."""
        return {"rank": self.rank, "size": self.size, "local_rank": self.local_rank, "backend": self.backend}


ALONE = World()


class GroupBroken(RuntimeError):
    """A collective failed: another rank is gone, or the group timed out. The ranks cannot go on in step; the
    learner exits 1 without a final checkpoint (its state may be half an update), ``--resume`` goes on from
    the last one."""


def world_from_env(environ: Optional[Mapping[str, str]] = None) -> World:
    """The rank this process is, from torchrun's variables; :data:`ALONE` without ``WORLD_SIZE`` (or with 1).

    Raises ValueError naming the variable that is missing or out of range."""
    env = os.environ if environ is None else environ

    def number(name: str, default: Optional[int] = None) -> int:
        text = env.get(name)
        if text in (None, ""):
            if default is None:
                raise ValueError(f"{name} is not set (WORLD_SIZE = {env.get('WORLD_SIZE')}: a rank needs "
                                 f"{', '.join(ENV)}; torchrun and `zclaw learner --nproc N` set them)")
            return default
        try:
            return int(str(text))
        except ValueError:
            raise ValueError(f"{name} = {text!r}: expected an integer") from None

    size = number("WORLD_SIZE", 1)
    if size < 1:
        raise ValueError(f"WORLD_SIZE = {size}: expected >= 1")
    if size == 1:
        return ALONE
    rank = number("RANK")
    if not 0 <= rank < size:
        raise ValueError(f"RANK = {rank}: expected 0 <= RANK < WORLD_SIZE = {size}")
    local = number("LOCAL_RANK", rank)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise ValueError(f"{name} is not set (WORLD_SIZE = {size}: the ranks meet at "
                             "MASTER_ADDR:MASTER_PORT)")
    number("MASTER_PORT")
    return World(rank=rank, size=size, local_rank=local)


def join(world: World, device: Any, timeout_s: float = TIMEOUT_S) -> Tuple[World, torch.device]:
    """Join the process group (``env://``) and return ``world`` with its backend and the device this rank
    trains on: NCCL on ``cuda:LOCAL_RANK`` when ``device`` is CUDA, gloo on CPU. Alone: nothing is joined.

    Raises ValueError when ``device`` is CUDA and this host has no GPU for LOCAL_RANK."""
    dev = torch.device(device)
    if not world.parallel:
        return world, dev
    if dev.type == "cuda":
        if not torch.cuda.is_available() or world.local_rank >= torch.cuda.device_count():
            raise ValueError(f"learner.device = {device!r} but this host has no GPU cuda:{world.local_rank} "
                             f"for LOCAL_RANK {world.local_rank}")
        dev = torch.device("cuda", world.local_rank)  # one GPU per rank, whatever index device named
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return world._replace(backend=backend), dev


def start(device: Any) -> "Sync":
    """This learner process's :class:`Sync`: a rank's when torchrun's variables say it is one (the group
    joined; every log line then carries ``rank``), else a lone learner's on ``device``. Raises ValueError when
    the variables or the device do not fit."""
    world, dev = join(world_from_env(), device)
    if world.parallel:
        import structlog

        structlog.contextvars.bind_contextvars(rank=world.rank)
    return Sync(world, dev)


def leave() -> None:
    """Leave the process group, if this process joined one (never raises: the group may be broken)."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # a peer that is gone: nothing left to tidy
        pass


class BatchShare(NamedTuple):
    """What :meth:`Sync.batch` returns: the merged statistics and every rank's batch size."""

    obs: Moments  # the observation rows' moments, every rank's batch together
    returns: Optional[Moments]  # the discounted returns' moments (None without a reward scale)
    samples: Tuple[int, ...]  # every rank's batch size in samples (T * C), by rank


class Sync:
    """What data-parallel ranks agree on, one method per moment of an update (the module docstring says why).

    Alone (``world.size == 1``) every method returns what it is given and calls no torch.distributed
    function. With ranks each method is one collective that every rank calls in the same order; a failed
    collective raises :class:`GroupBroken`. ``seconds`` and ``calls`` count the wall time and the calls of the
    collectives by kind (``batch``, ``targets``, ``normalizers``, ``gradients``, ``any``, ``share``): the
    all-reduce's share of an update (bench/learner_ranks.py, the status report).
    """

    def __init__(self, world: World = ALONE, device: Any = "cpu") -> None:
        self.world = world
        self.device = torch.device(device)
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    @property
    def parallel(self) -> bool:
        return self.world.size > 1

    def _run(self, kind: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except RuntimeError as exc:  # gloo and NCCL report a lost peer or a timeout as RuntimeErrors
            raise GroupBroken(f"learner rank {self.world.rank}/{self.world.size}: the {kind} collective "
                              f"failed (another rank is gone?): {str(exc)[:300]}") from exc
        finally:
            self.seconds[kind] += time.perf_counter() - t0
            self.calls[kind] += 1

    # -- the statistics of a batch (Trainer.prepare) -------------------------------------------------------
    def batch(self, obs: Moments, returns: Optional[Moments], samples: int) -> BatchShare:
        """Every rank's batch moments merged (Chan, in rank order: the same result on every rank) and every
        rank's batch size, from one all-gather."""
        if not self.parallel:
            return BatchShare(obs, returns, (int(samples),))
        mean = torch.as_tensor(obs.mean, dtype=torch.float64).reshape(-1)
        d = mean.numel()
        r = returns if returns is not None else Moments(0.0, 0.0, 0.0)
        local = torch.cat([
            torch.tensor([float(obs.count)], dtype=torch.float64), mean.cpu(),
            torch.as_tensor(obs.var, dtype=torch.float64).reshape(-1).cpu(),
            torch.tensor([float(r.count), float(r.mean), float(r.var), float(samples)], dtype=torch.float64),
        ]).to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world.size)]
        self._run("batch", lambda: dist.all_gather(parts, local))
        shape = tuple(torch.as_tensor(obs.mean).shape)
        merged_obs: Optional[Moments] = None
        merged_ret: Optional[Moments] = None
        sizes = []
        for v in parts:
            v = v.cpu()
            o = Moments(float(v[0]), v[1:1 + d].reshape(shape), v[1 + d:1 + 2 * d].reshape(shape))
            q = Moments(*(float(x) for x in v[1 + 2 * d:4 + 2 * d]))
            merged_obs = o if merged_obs is None else merged_obs.merge(o)
            merged_ret = q if merged_ret is None else merged_ret.merge(q)
            sizes.append(int(v[4 + 2 * d]))
        assert merged_obs is not None
        return BatchShare(merged_obs, merged_ret if returns is not None else None, tuple(sizes))

    def merge(self, moments: Moments, kind: str = "targets") -> Moments:
        """Every rank's (count, mean, var) of one statistic merged (Chan, in rank order: the same result on
        every rank), from one all-gather: with ``reward_scale = "popart"``, the value targets' moments, which
        exist only once the targets are computed, after :meth:`batch`. Alone: ``moments`` itself."""
        if not self.parallel:
            return moments
        local = torch.tensor([float(moments.count), float(moments.mean), float(moments.var)],
                             dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(local) for _ in range(self.world.size)]
        self._run(kind, lambda: dist.all_gather(parts, local))
        return functools.reduce(Moments.merge, (Moments(*(float(x) for x in v.cpu())) for v in parts))

    # -- advantage normalisation (Trainer.update, once per epoch) ------------------------------------------
    def normalizers(
        self, minibatches: Sequence[Sequence[Tuple[torch.Tensor, Optional[torch.Tensor]]]]
    ) -> List[Optional[List[Stats]]]:
        """For each minibatch, the (mean, unbiased std, count) of each of its advantage sets
        (``(values, mask)``; mask None: all) over every rank's minibatch of that index together; alone, None
        for each (each minibatch normalises with its own, as a single learner always did). One all-reduce
        for an epoch."""
        if not self.parallel:
            return [None] * len(minibatches)
        n_terms = max((len(m) for m in minibatches), default=0)
        local = torch.zeros(len(minibatches), n_terms, 3, dtype=torch.float64, device=self.device)
        for i, parts in enumerate(minibatches):
            for j, (values, mask) in enumerate(parts):
                v = (values[mask] if mask is not None else values).detach().to(torch.float64)
                local[i, j, 0] = v.numel()
                local[i, j, 1] = v.sum()
                local[i, j, 2] = (v * v).sum()
        self._run("normalizers", lambda: dist.all_reduce(local))
        out: List[Optional[List[Stats]]] = []
        for i, row in enumerate(local.cpu().tolist()):
            stats = []
            for n, s, ss in row[: len(minibatches[i])]:
                mean = s / n if n > 0 else 0.0
                var = max(0.0, (ss - n * mean * mean) / (n - 1)) if n > 1 else 0.0
                stats.append((mean, var ** 0.5, n))
            out.append(stats)
        return out

    # -- the gradient step (Trainer.update, after backward) -------------------------------------------------
    def gradients(
        self, params: Sequence[torch.nn.Parameter], samples: int, finite: bool, kl: float, clip_frac: float
    ) -> Tuple[bool, float, float]:
        """Average every parameter's gradient over the ranks, each rank's weighted by its minibatch's
        ``samples`` (the mean over their union), in place; return (every rank's loss was finite, the KL and
        the clip fraction over the union). Alone: ``(finite, kl, clip_frac)`` untouched.

        One all-reduce of one flat buffer (the gradients, then the weights, the KL, the clip fraction, a
        not-finite count and, per parameter, whether a rank has its gradient): a parameter no rank's loss
        reached keeps ``grad = None`` (Adam then leaves it alone, as it would alone). A rank whose loss was
        not finite still joins; every rank then skips the step, since all decide on the same reduced
        numbers."""
        if not self.parallel:
            return finite, kl, clip_frac
        grads = [p.grad for p in params]
        n = float(samples)
        pieces = [g.detach().reshape(-1) * n if g is not None else torch.zeros(p.numel(), device=self.device)
                  for p, g in zip(params, grads)]
        tail = torch.tensor([n, n * kl, n * clip_frac, 0.0 if finite else 1.0]
                            + [1.0 if g is not None else 0.0 for g in grads], device=self.device)
        flat = torch.cat([x.to(self.device, torch.float32) for x in pieces] + [tail])
        self._run("gradients", lambda: dist.all_reduce(flat))
        body, tail = flat[: flat.numel() - tail.numel()], flat[flat.numel() - tail.numel():].tolist()
        total = max(tail[0], 1.0)
        body.div_(total)
        offset = 0
        for p, has in zip(params, tail[4:]):
            size = p.numel()
            if has > 0:
                g = body[offset:offset + size].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            offset += size
        return tail[3] == 0, tail[1] / total, tail[2] / total

    # -- control ------------------------------------------------------------------------------------------
    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on one."""
        return self.vote(flag, 0.0)[0]

    def vote(self, stop: bool, progress: float) -> Tuple[bool, float]:
        """The vote before each update: (whether any rank stops, the largest ``progress`` of any rank), the
        same on every rank from one all-reduce. Progress is the share of the run's budget spent, which sets
        the annealed learning rate: ranks must agree on it, or their parameters drift apart."""
        if not self.parallel:
            return bool(stop), float(progress)
        t = torch.tensor([1.0 if stop else 0.0, float(progress)], dtype=torch.float64, device=self.device)
        self._run("vote", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        flag, most = t.tolist()
        return flag > 0, float(most)

    def share(self, payload: Optional[bytes]) -> bytes:
        """Rank 0's ``payload`` on every rank (other ranks pass None): the state every rank starts from."""
        if not self.parallel:
            assert payload is not None
            return payload
        box: List[Any] = [payload if self.world.main else None]
        self._run("share", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def report(self) -> Dict[str, Any]:
        """The status report's ``ranks`` entry: who this is, and the time spent in collectives by kind."""
        return dict(self.world.describe(), collective_s={k: round(v, 3) for k, v in self.seconds.items()},
                    collectives=dict(self.calls))
