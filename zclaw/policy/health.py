"""Option health: are the options still K distinct, used, temporally extended skills?

Option learning fails quietly in three known ways (DESIGN section 4): options that terminate every
step (mean duration -> 1, the hierarchy degenerates into a flat policy that switches every step),
one option taking nearly all usage (the others are dead weight), and options that become identical
(their action means coincide). :class:`OptionHealth` keeps decayed counts over recent batches and
reports, per option:

* ``usage``            share of steps executed by o;
* ``duration``         steps of o / picks of o (mean number of steps an option runs once picked);
* ``termination_rate`` fraction of the continuing steps after o ran where beta_o fired;
* ``entropy``          Gaussian entropy of pi_o (depends on its log std only);

and, on a fixed probe batch of observations (the first states the learner trained on), the pairwise
mean L2 distance of the options' action means (``distance_min``, ``distance_mean``) and the same
distance as a share of the action range (``spread_min``: the root mean square over action dimensions
of the difference of the two means, clipped to the bounds, over the half-range (high - low) / 2).
The share is the one a warning can use: a raw distance of 0.05 is large for actions in [-0.1, 0.1]
and nothing for [-2, 2]. It is not scaled by the policies' noise: late in training that noise is
small, and two options whose means differ by 1.5 sigma but by 3% of the range still act alike.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from . import losses
from .networks import OptionPolicy

PROBE_SIZE = 256


class OptionHealth:
    """Decayed per-option counters; :meth:`update` per batch, :meth:`summary` when reporting."""

    def __init__(self, K: int, decay: float = 0.9, collapse_duration: float = 1.5,
                 dominant_share: float = 0.95, identical_spread: float = 0.05, warmup_updates: int = 50,
                 action_low: Optional[torch.Tensor] = None,
                 action_high: Optional[torch.Tensor] = None) -> None:
        self.K = int(K)
        self.decay = float(decay)
        self.collapse_duration = float(collapse_duration)
        self.dominant_share = float(dominant_share)
        # options start alike (0.01-gain heads): the "act alike" warning waits for this many updates
        self.identical_spread = float(identical_spread)
        self.warmup_updates = int(warmup_updates)
        self.low = None if action_low is None else torch.as_tensor(action_low, dtype=torch.float32).cpu()
        self.high = None if action_high is None else torch.as_tensor(action_high, dtype=torch.float32).cpu()
        self.updates = 0
        self.steps = torch.zeros(self.K, dtype=torch.float64)
        self.picks = torch.zeros(self.K, dtype=torch.float64)
        self.continuing = torch.zeros(self.K, dtype=torch.float64)
        self.terminated = torch.zeros(self.K, dtype=torch.float64)
        self.probe: Optional[torch.Tensor] = None

    @torch.no_grad()
    def update(
        self, option: torch.Tensor, option_start: torch.Tensor, prev_option: torch.Tensor,
        choice_known: torch.Tensor, episode_start: torch.Tensor, raw_obs: Optional[torch.Tensor] = None,
    ) -> None:
        """Fold one batch in (all [T, B] time-major; ``choice_known`` marks steps whose o_{t-1} is known)."""
        K = self.K
        o = option.reshape(-1).cpu()
        start = option_start.reshape(-1).cpu()
        cont = (choice_known & ~episode_start).reshape(-1).cpu()  # a termination decision was made
        prev = prev_option.reshape(-1).cpu()
        d = self.decay
        self.updates += 1
        self.steps = d * self.steps + torch.bincount(o, minlength=K).double()
        self.picks = d * self.picks + torch.bincount(o[start], minlength=K).double()
        self.continuing = d * self.continuing + torch.bincount(prev[cont], minlength=K).double()
        self.terminated = d * self.terminated + torch.bincount(prev[cont & start], minlength=K).double()
        if self.probe is None and raw_obs is not None:
            flat = raw_obs.reshape(-1, raw_obs.shape[-1])
            self.probe = flat[:: max(1, flat.shape[0] // PROBE_SIZE)][:PROBE_SIZE].detach().cpu().clone()

    @torch.no_grad()
    def summary(self, model: OptionPolicy) -> Dict[str, Any]:
        """Per-option figures, the distance of the option means, and warnings (a list of strings)."""
        K = self.K
        total = float(self.steps.sum())
        usage = (self.steps / max(total, 1e-12)).tolist()
        duration = [float(s / p) if p > 0 else None for s, p in zip(self.steps, self.picks)]
        term = [float(t / c) if c > 0 else None for t, c in zip(self.terminated, self.continuing)]
        entropy = losses.entropy(model.option_log_std().detach().cpu().float()).tolist()
        out: Dict[str, Any] = {
            "K": K, "usage": usage, "duration": duration, "termination_rate": term, "entropy": entropy,
            "duration_mean": float(total / float(self.picks.sum())) if float(self.picks.sum()) > 0 else None,
            "distance_min": None, "distance_mean": None, "spread_min": None, "updates": self.updates,
            "warnings": [],
        }
        if K > 1 and self.probe is not None:
            dev = next(model.parameters()).device
            means = model.action_mean(model.obs_norm(self.probe.to(dev))).float().cpu()  # [P, K, A]
            dist = torch.linalg.norm(means.unsqueeze(2) - means.unsqueeze(1), dim=-1).mean(0)  # [K, K]
            iu = torch.triu_indices(K, K, offset=1)
            pairs = dist[iu[0], iu[1]]
            out["distance_min"] = float(pairs.min())
            out["distance_mean"] = float(pairs.mean())
            out["spread_min"] = self.spread_min(means)
        out["alike_below"] = self.alike_threshold(model)
        out["warnings"] = self.warnings(out)
        return out

    def spread_min(self, means: torch.Tensor) -> float:
        """min over option pairs of mean_probe RMS_a (clip(mu_i) - clip(mu_j))_a / ((high - low)_a / 2).

        Without bounds the half-range is taken as 1 (the env spec's bounds are finite: the wire checks).
        """
        half = torch.ones(means.shape[-1])
        if self.low is not None and self.high is not None:
            means = torch.clamp(means, self.low, self.high)
            half = ((self.high - self.low) / 2).clamp(min=1e-6)  # a fixed dimension: both means clip alike
        rel = means / half  # [P, K, A]
        rms = (rel.unsqueeze(2) - rel.unsqueeze(1)).pow(2).mean(-1).sqrt().mean(0)  # [K, K]
        iu = torch.triu_indices(self.K, self.K, offset=1)
        return float(rms[iu[0], iu[1]].min())

    def alike_threshold(self, model: OptionPolicy) -> float:
        """The spread below which options "act alike": ``identical_spread``, scaled for residual options by
        their own heads' weight against the even share, 2 (1 - s).

        With residual options mu_o = s mu + (1 - s) m_o, two options' means differ by (1 - s) times their
        own heads' difference, so a larger ``policy.option_share`` brings them closer by construction; the
        threshold (calibrated at s = 0.5) shrinks with it, and the warning still asks whether the own heads
        learned different behaviours (Pusher-v5 at s = 0.75: closest pair 4.3 % of the range, own heads as
        far apart as 8.6 % would be at the even share)."""
        if not model.residual:
            return self.identical_spread
        return self.identical_spread * 2.0 * (1.0 - model.share)

    def warnings(self, s: Dict[str, Any]) -> List[str]:
        """The known failure modes, as text a user can act on (nothing for K = 1 or before any data); ``s``
        is the :meth:`summary` being built (its figures and ``alike_below``)."""
        if self.K == 1 or float(self.steps.sum()) <= 0:
            return []
        w: List[str] = []
        dm = s.get("duration_mean")
        if dm is not None and dm < self.collapse_duration:
            w.append(f"options collapse: mean duration {dm:.2f} steps < {self.collapse_duration} "
                     "(they terminate almost every step; raise learner.xi or learner.deliberation_cost)")
        top = max(s["usage"])
        if top > self.dominant_share:
            o = s["usage"].index(top)
            w.append(f"option {o} takes {top:.1%} of the steps (> {self.dominant_share:.0%}): the others are "
                     "unused (try learner.option_weights or broker.option_balanced, a larger "
                     "policy.option_epsilon or learner.master_ent_coef; if the others last ~1 step, they are "
                     "dropped at once: see docs/learning.md)")
        sp = s.get("spread_min")
        below = s["alike_below"]
        if sp is not None and self.updates >= self.warmup_updates and sp < below:
            w.append(f"options act alike: two options' action means differ by {sp:.1%} of the action "
                     f"range (< {below:.1%}) after {self.updates} updates; the hierarchy "
                     "adds little on this task, and K = 1 may serve as well for less compute "
                     "(see docs/learning.md)")
        return w

    @staticmethod
    def scalars(s: Dict[str, Any]) -> Dict[str, float]:
        """Flat ``options/...`` scalars for TensorBoard (None values left out)."""
        out: Dict[str, float] = {}
        for key in ("usage", "duration", "termination_rate", "entropy"):
            for o, v in enumerate(s[key]):
                if v is not None and math.isfinite(v):
                    out[f"options/{key}/{o}"] = float(v)
        for key in ("duration_mean", "distance_min", "distance_mean", "spread_min"):
            if s.get(key) is not None:
                out[f"options/{key}"] = float(s[key])
        return out
