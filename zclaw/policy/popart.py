"""PopArt value normalisation, the learner's other answer to rewards of any scale
(``learner.reward_scale = "popart"``; van Hasselt et al. 2016, "Learning values across many orders of
magnitude"; Hessel et al. 2019, "Multi-task deep reinforcement learning with PopArt").

Rewards stay raw. The critic learns *normalised* values: with f(s) its output (K values, one per option) and
mu, sigma running statistics of the value targets in reward units, the value the learner uses for its
targets and advantages is::

    Q(s, o) = sigma f(s)_o + mu                                  "ART": adaptively rescaling targets

and the value loss compares f with the normalised target, ``1/2 (f(s)_o - (v_s - mu) / sigma)^2``, which is
O(1) whether a task pays in thousandths or in thousands. Whenever the statistics move (mu, sigma ->
mu', sigma') the critic's last linear layer ``f = W h + b`` is rescaled::

    W' = W sigma / sigma',     b' = (sigma b + mu - mu') / sigma'      "POP": preserving outputs precisely

so that ``sigma' f'(s) + mu' = sigma f(s) + mu`` for every s: a statistics update changes the units the
critic learns in, never the values it predicts. One (mu, sigma) serves all K options: every option's Q is
a return in the same reward units, and V(s) = sum_o pi(o|s) Q(s, o) mixes them.

Workers, ``zclaw eval``, export and the student are unaffected: the statistics live in the trainer's state
(checkpointed beside the reward scale's), not in the model, so the weights message has the same arrays as
without PopArt; it carries the critic in normalised units, and no worker or tool reads the critic.

The update order inside one learner update (:meth:`zclaw.learner.trainer.Trainer.prepare`): the V-trace
targets are computed with the old statistics, then :meth:`PopArt.fold` moves the statistics and rescales
the layer, then the value loss trains against ``(v_s - mu') / sigma'``.

Adam's moments of the rescaled layer are left as they are: Adam divides each step by the root of its second
moment, so a gradient scale that drifts by sigma/sigma' (within ~beta of 1 per update once the statistics
have settled) changes its steps little, and its moments forget the old units within ~1/(1 - beta2) steps.
"""
from __future__ import annotations

import math
from typing import Dict, Mapping

import torch
from torch import nn

from .normalizer import Moments


class PopArt:
    """Running statistics (mu, sigma) of the value targets, and the rescaling of ``layer`` (the critic's last
    linear layer) that keeps its unnormalised outputs when they move.

    The statistics are exponential moving averages of each update's batch mean and second moment, with step
    ``beta`` per update (Hessel et al. use 3e-4), debiased as Adam's moments are (Kingma & Ba 2015)::

        m1 <- (1 - beta) m1 + beta mean(v),   m2 <- (1 - beta) m2 + beta mean(v^2),   w <- (1 - beta) w + beta
        mu = m1 / w,   sigma = clip(sqrt(m2 / w - mu^2), 1e-4, 1e6)            (m1 = m2 = w = 0 at start)

    Why a moving average and not the cumulative (Chan-merged) moments that the observation normaliser and
    the reward scale keep: the targets are not stationary, they grow as the policy improves, and cumulative
    moments over millions of samples freeze; a moving average follows them with a horizon of ~1/beta updates.
    Why debiased: from mu = 0, sigma = 1 a plain moving average with beta = 3e-4 would need thousands of
    updates to reach a task whose returns are in the thousands, the very case PopArt is for; debiased, the
    first update's statistics are exactly the first batch's, and later ones weigh the batches seen so far
    about equally until there are ~1/beta of them. One step per update, not per sample: a batch's weight
    does not depend on its size. Before any update mu = 0 and sigma = 1 (the critic reads in reward units).

    sigma is clipped to [1e-4, 1e6] as Hessel et al. clip it: targets that are all equal (no reward yet)
    would otherwise divide by zero. The statistics are float64 Python floats.
    """

    SIGMA_MIN = 1e-4
    SIGMA_MAX = 1e6

    def __init__(self, layer: nn.Linear, beta: float = 3e-4) -> None:
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"PopArt rescales a Linear layer, not {type(layer).__name__}")
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta = {beta!r} is not allowed: expected a number in (0, 1]")
        self.layer = layer
        self.beta = float(beta)
        self.m1 = 0.0  # moving average of the batch means (biased toward 0 by w)
        self.m2 = 0.0  # moving average of the batch second moments
        self.w = 0.0  # the debiasing weight 1 - (1 - beta)^updates

    # -- the statistics -----------------------------------------------------------------------------------
    @property
    def mu(self) -> float:
        return self.m1 / self.w if self.w > 0 else 0.0

    @property
    def sigma(self) -> float:
        if self.w <= 0:
            return 1.0
        var = max(self.m2 / self.w - self.mu ** 2, 0.0)
        return min(max(math.sqrt(var), self.SIGMA_MIN), self.SIGMA_MAX)

    @staticmethod
    @torch.no_grad()
    def measure(targets: torch.Tensor) -> Moments:
        """Count, mean and population variance of the finite entries of ``targets`` (float64): what
        :meth:`fold` takes, and what data-parallel ranks merge first (``Sync.merge``)."""
        v = targets.detach().reshape(-1).to(torch.float64)
        v = v[torch.isfinite(v)]
        if v.numel() == 0:
            return Moments(0.0, 0.0, 0.0)
        return Moments(float(v.numel()), float(v.mean()), float(v.var(unbiased=False)))

    @torch.no_grad()
    def fold(self, batch: Moments) -> None:
        """One update of the statistics from a batch's target moments (no change for an empty batch), and
        the rescaling of the layer that keeps its unnormalised outputs (the module docstring)."""
        if batch.count == 0:
            return
        mu, sigma = self.mu, self.sigma
        mean = float(batch.mean)
        second = float(batch.var) + mean * mean
        keep = 1.0 - self.beta
        self.m1 = keep * self.m1 + self.beta * mean
        self.m2 = keep * self.m2 + self.beta * second
        self.w = keep * self.w + self.beta
        self._preserve(mu, sigma, self.mu, self.sigma)

    @torch.no_grad()
    def _preserve(self, mu: float, sigma: float, mu_new: float, sigma_new: float) -> None:
        """W' = W sigma / sigma', b' = (sigma b + mu - mu') / sigma', computed in float64 and written in
        place (the optimiser keeps the same parameters)."""
        weight, bias = self.layer.weight, self.layer.bias
        weight.copy_((weight.to(torch.float64) * (sigma / sigma_new)).to(weight.dtype))
        if bias is not None:
            bias.copy_(((bias.to(torch.float64) * sigma + (mu - mu_new)) / sigma_new).to(bias.dtype))

    # -- reading the critic ---------------------------------------------------------------------------------
    def unnormalize(self, out: torch.Tensor) -> torch.Tensor:
        """The critic's normalised output in reward units: ``sigma f + mu``."""
        return out * self.sigma + self.mu

    def normalize(self, value: torch.Tensor) -> torch.Tensor:
        """A value in reward units in the critic's units: ``(v - mu) / sigma``."""
        return (value - self.mu) / self.sigma

    # -- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, float]:
        """The statistics (checkpointed beside the model, whose critic layer is already in their units)."""
        return {"m1": self.m1, "m2": self.m2, "w": self.w, "mu": self.mu, "sigma": self.sigma}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        """Restore :meth:`state_dict`. The layer is not touched: a checkpoint's critic weights were saved in
        the units of the statistics saved with them (``mu`` and ``sigma`` are derived, kept for readers)."""
        self.m1, self.m2, self.w = float(state["m1"]), float(state["m2"]), float(state["w"])
