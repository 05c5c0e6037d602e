"""The learner's running statistics: the observation normaliser, whose statistics travel with the weights,
and the reward scaler, which stays inside the learner's loss.

The learner updates both from the batches it trains on (Chan et al.'s parallel variance update, in
float64); workers never update them, they use the observation statistics published with the weights they
act on, so a segment's observations were normalised with the statistics of the version that produced it.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Dict, Mapping, NamedTuple, Sequence, Tuple

import numpy as np
import torch
from torch import nn


class Moments(NamedTuple):
    """Count, mean and population variance of a set of rows (float64; mean and var tensors for the observation
    normaliser, floats for the reward scale): what Chan et al.'s parallel update merges.

    Why a type of its own: the statistics are folded in two steps, measured on a batch then merged into the
    running ones, so that data-parallel learner ranks (zclaw/learner/distributed.py) can merge every rank's
    batch moments first and all fold the same thing."""

    count: float
    mean: Any
    var: Any

    def merge(self, other: "Moments") -> "Moments":
        """The moments of both sets together (Chan et al. 1979); either may be empty (count 0)."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        delta = other.mean - self.mean
        total = self.count + other.count
        return Moments(total, self.mean + delta * other.count / total,
                       (self.var * self.count + other.var * other.count
                        + delta**2 * self.count * other.count / total) / total)


class RunningNorm(nn.Module):
    """y = clip((x - mean) / sqrt(var + eps), -clip, clip); statistics are buffers, not parameters."""

    def __init__(self, shape: Tuple[int, ...], clip: float = 10.0, enabled: bool = True,
                 eps: float = 1e-8) -> None:
        super().__init__()
        self.clip = float(clip)
        self.enabled = bool(enabled)
        self.eps = eps
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        mean = self.mean.to(x.dtype)
        # the square root in float64, then the cast: a variance past float32's range still gives a finite std
        std = torch.sqrt(self.var + self.eps).to(x.dtype)
        return torch.clamp((x - mean) / std, -self.clip, self.clip)

    @torch.no_grad()
    def update(self, x: torch.Tensor, max_abs: float = math.inf) -> int:
        """Fold a batch ``x[..., *shape]`` into the statistics; return how many rows were left out.

        Rows with a non-finite value or one beyond ``max_abs`` are left out: a simulator that blew up
        (1e30 is finite) would otherwise move the variance by dozens of orders of magnitude for good.
        """
        batch, left_out = self.measure(x, max_abs)
        self.fold(batch)
        return left_out

    @torch.no_grad()
    def measure(self, x: torch.Tensor, max_abs: float = math.inf) -> Tuple[Moments, int]:
        """The moments of a batch's rows that :meth:`update` keeps, and how many it leaves out (count 0
        when disabled or when none is kept)."""
        empty = Moments(0.0, torch.zeros_like(self.mean), torch.zeros_like(self.var))
        if not self.enabled:
            return empty, 0
        x = x.reshape((-1,) + tuple(self.mean.shape)).to(torch.float64)
        rows = x.reshape(x.shape[0], -1)
        keep = torch.isfinite(rows).all(1) & (rows.abs() <= max_abs).all(1)
        left_out = int(x.shape[0] - int(keep.sum()))
        x = x[keep]
        if x.shape[0] == 0:
            return empty, left_out
        return Moments(float(x.shape[0]), x.mean(0), x.var(0, unbiased=False)), left_out

    @torch.no_grad()
    def fold(self, batch: Moments) -> None:
        """Merge a batch's moments (:meth:`measure`, or several ranks' merged) into the statistics, in
        place."""
        n = batch.count
        if not self.enabled or n == 0:
            return
        b_mean = torch.as_tensor(batch.mean, dtype=torch.float64, device=self.mean.device)
        b_var = torch.as_tensor(batch.var, dtype=torch.float64, device=self.var.device)
        delta = b_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + b_var * n + delta**2 * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def stats(self) -> Dict[str, np.ndarray]:
        return {"mean": self.mean.cpu().numpy(), "var": self.var.cpu().numpy(),
                "count": self.count.cpu().numpy()}


class RewardScaler:
    """Divides rewards by the running standard deviation of the discounted return, inside the loss only.

    The scheme of SB3's ``VecNormalize`` and CleanRL's ``NormalizeReward`` (Engstrom et al. 2020, "code-level
    optimisations"), computed by the learner from the batches it trains on, so that every worker's data
    shares one scale and workers keep sending raw rewards::

        G_t   = gamma * G_{t-1} * (1 - done_{t-1}) + r_t          per env column, carried across segments
        sigma = sqrt(Var[G] + eps)                                 running (Chan et al.), float64
        r'_t  = clip(r_t / sigma, -clip, clip)

    Why: PPO's value loss and its advantage scale follow the reward's; with returns in the thousands (bodies
    with long horizons) or in the thousandths (dense arm costs) the same lr and value coefficient cannot
    suit both. Only the scale is taken, never the mean: shifting rewards would change what terminating an
    episode is worth.

    The carry of ``G`` is kept per worker for the segment that came before (``seq - 1``); a segment
    that does not follow its worker's last one (a reused or reordered segment, a restarted worker) starts
    its columns from ``G = 0``, which only makes the estimate of ``Var[G]`` slightly low for a while. At most
    ``max_workers`` carries are kept; the least recently seen is forgotten first.
    """

    def __init__(self, gamma: float, clip: float = 10.0, eps: float = 1e-8, max_workers: int = 4096) -> None:
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma = {gamma!r} is not allowed: expected a number in [0, 1]")
        if clip <= 0:
            raise ValueError(f"clip = {clip!r} is not allowed: expected a number > 0")
        self.gamma, self.clip, self.eps = float(gamma), float(clip), float(eps)
        self.max_workers = int(max_workers)
        self.mean = 0.0
        self.var = 1.0
        self.count = 1e-4
        self._carry: "OrderedDict[str, Tuple[int, np.ndarray]]" = OrderedDict()

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.eps)

    def update(self, reward: np.ndarray, done: np.ndarray, columns: Sequence[int], workers: Sequence[str],
               seqs: Sequence[int]) -> None:
        """Fold a batch of ``reward[T, C]`` (``done[T, C]`` ends an episode after step t) into the
        statistics: segment b holds ``columns[b]`` consecutive columns and comes from ``workers[b]``,
        number ``seqs[b]``."""
        self.fold(self.measure(reward, done, columns, workers, seqs))

    def measure(self, reward: np.ndarray, done: np.ndarray, columns: Sequence[int], workers: Sequence[str],
                seqs: Sequence[int]) -> Moments:
        """The moments of the batch's discounted returns (the finite ones), as :meth:`update` folds them; the
        carries of ``G`` advance here."""
        reward = np.asarray(reward, dtype=np.float64)
        done = np.asarray(done, dtype=bool)
        T = reward.shape[0]
        returns = np.empty(reward.shape)
        starts = np.cumsum([0] + list(columns[:-1]))
        # in (worker, seq) order, so that a worker's consecutive segments in one batch chain too
        for b in sorted(range(len(columns)), key=lambda i: (str(workers[i]), int(seqs[i]))):
            key, seq = str(workers[b]), int(seqs[b])
            lo, N = int(starts[b]), int(columns[b])
            prev = self._carry.get(key)
            g = prev[1] if prev is not None and prev[0] == seq - 1 and prev[1].shape == (N,) else np.zeros(N)
            for t in range(T):
                g = self.gamma * g + reward[t, lo:lo + N]
                returns[t, lo:lo + N] = g
                g = np.where(done[t, lo:lo + N], 0.0, g)
            if prev is None or seq >= prev[0]:  # keep the carry of each worker's newest segment
                self._carry[key] = (seq, g)
                self._carry.move_to_end(key)
        while len(self._carry) > self.max_workers:
            self._carry.popitem(last=False)
        finite = returns[np.isfinite(returns)]
        if finite.size == 0:
            return Moments(0.0, 0.0, 0.0)
        return Moments(float(finite.size), float(finite.mean()), float(finite.var()))

    def fold(self, batch: Moments) -> None:
        """Merge a batch's return moments (:meth:`measure`, or several ranks' merged) into the statistics."""
        n = batch.count
        if n == 0:
            return
        b_mean, b_var = float(batch.mean), float(batch.var)
        delta = b_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + b_var * n + delta**2 * self.count * n / total) / total
        self.count = total

    def scale(self, reward: torch.Tensor) -> torch.Tensor:
        """``clip(r / sigma, -clip, clip)`` with the current statistics."""
        return torch.clamp(reward / self.std, -self.clip, self.clip)

    def state_dict(self) -> Dict[str, float]:
        """The statistics (checkpointed; the carries are not: a resumed learner starts them afresh)."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])
