"""One asynchronous-PPO update per batch: V-trace targets from the behaviour log-probs, then PPO-clip.

The broker hands the learner B segments of T steps x N envs, each produced by whatever policy version
the worker held (``policy_version[B, T]``). :meth:`Trainer.update`:

1. lays the batch out time-major, ``[T, B*N]`` (column ``b*N + n`` is env n of segment b);
2. folds the batch's observations into the running normaliser, then normalises (the weights published
   after this update carry the new statistics, so workers and learner agree);
3. computes once, without gradient, the current critic's values, ``log_rho = log pi - log mu`` and the
   V-trace targets and advantages (:func:`zclaw.policy.losses.vtrace`), with episode boundaries cut and
   time-limit truncations bootstrapped from ``V(final_obs)``;
4. runs ``epochs`` passes of ``minibatches`` random minibatches of PPO-clip + value loss - entropy bonus,
   each per-sample term weighted by the segment's importance weight (1 outside prioritized mode).

With ``options = 1`` this is exactly asynchronous PPO. With K > 1 the intra-option policy of the option
in effect is trained the same way against ``Q(s, o_t)``; the master and termination heads are not
trained here yet.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import numpy as np
import torch

from ..policy import losses
from ..policy.networks import OptionPolicy
from ..wire import Message


class Trainer:
    """Owns the optimiser of an :class:`OptionPolicy` and turns batches into updates."""

    def __init__(self, model: OptionPolicy, learner_cfg: Mapping[str, Any], device: Any = "cpu") -> None:
        self.cfg = dict(learner_cfg)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=float(self.cfg["lr"]), eps=1e-5)
        self.skipped_steps = 0  # optimiser steps skipped because the loss or gradient was not finite

    # -- layout ---------------------------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(arr), device=self.device).to(dtype)

    @staticmethod
    def _time_major(x: torch.Tensor) -> torch.Tensor:
        """[B, T, N, ...] -> [T, B*N, ...]."""
        B, T, N = x.shape[:3]
        return x.transpose(0, 1).reshape((T, B * N) + tuple(x.shape[3:]))

    def _values(self, x: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        """The critic's value of the option in effect: Q(s, o) (for K = 1, option 0's Q, i.e. V(s))."""
        q = self.model.q(x)
        return q.gather(-1, option.unsqueeze(-1)).squeeze(-1)

    def _logp(
        self, x: torch.Tensor, option: torch.Tensor, action: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """log pi_o(a|s) of the executing option, and that option's log std (for the entropy)."""
        mean_all = self.model.action_mean(x)  # [..., K, A]
        idx = option.reshape(option.shape + (1, 1)).expand(option.shape + (1, self.model.A))
        mean = mean_all.gather(-2, idx).squeeze(-2)
        log_std = self.model.log_std[option]
        return self.model.gaussian_logp(action, mean, log_std), log_std

    # -- targets ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, batch: Message, version: int, update_norm: bool = True) -> Dict[str, Any]:
        """Lay the batch out time-major and compute, once and without gradient, the V-trace targets.

        Returns time-major tensors ``[T, B*N, ...]`` (column ``b*N + n``): ``x`` (normalised obs, T+1
        rows), ``action``, ``option``, ``logp_mu``, ``weight``, ``values``, ``rewards`` and ``discounts``
        (after :func:`~zclaw.policy.losses.episode_boundaries`), ``log_rhos``, ``vs``, ``adv``; plus
        ``lag`` (numpy, per step and segment) and ``priorities`` [B] (mean |advantage| per segment).
        """
        c = self.cfg
        a = batch.arrays
        B, T, N = a["action"].shape[:3]
        gamma = float(c["gamma"])
        model = self.model
        D = model.cfg.obs_dim

        obs = self._tensor(a["obs"]).reshape(B, T + 1, N, D)
        if update_norm:
            model.obs_norm.update(obs[:, :T])  # every step once (row T is the next segment's row 0)
        x = model.obs_norm(self._time_major(obs))  # [T+1, BN, D]
        action = self._time_major(self._tensor(a["action"]).reshape(B, T, N, model.A))
        reward = self._time_major(self._tensor(a["reward"]))
        terminated = self._time_major(self._tensor(a["terminated"], torch.bool))
        truncated = self._time_major(self._tensor(a["truncated"], torch.bool))
        option = self._time_major(self._tensor(a["option"], torch.long)).clamp(0, model.K - 1)
        logp_mu = self._time_major(self._tensor(a["logp_action"]))
        weight = self._tensor(a["is_weight"]).repeat_interleave(N).unsqueeze(0).expand(T, B * N)
        lag = int(version) - a["policy_version"].astype(np.int64)  # [B, T]

        values = self._values(x[:T], option)  # V(x_t) = Q(x_t, o_t)
        # the option in effect continues into x_T unless it terminates: Q(x_T, o_{T-1}) bootstraps
        bootstrap = self._values(x[T], option[T - 1])
        logp_pi, _ = self._logp(x[:T], option, action)
        log_rhos = logp_pi - logp_mu

        # V(final_obs) at the truncated steps, which carry it sparsely as final_at rows (b, t, n)
        final_values = torch.zeros_like(reward)
        fa = np.asarray(a["final_at"], dtype=np.int64)
        if fa.shape[0]:
            fb, ft, fn = (torch.as_tensor(fa[:, i], device=self.device) for i in range(3))
            col = fb * N + fn
            fx = model.obs_norm(self._tensor(a["final_obs"]).reshape(-1, D))
            final_values[ft, col] = self._values(fx, option[ft, col])
        rewards, discounts = losses.episode_boundaries(reward, terminated, truncated, gamma, final_values)

        vs, adv = losses.vtrace(
            values, bootstrap, rewards, discounts, log_rhos,
            rho_bar=float(c["rho_bar"]), c_bar=float(c["c_bar"]), lam=float(c["lam"]),
        )
        return {
            "x": x, "action": action, "option": option, "logp_mu": logp_mu, "weight": weight,
            "values": values, "bootstrap": bootstrap, "final_values": final_values, "rewards": rewards,
            "discounts": discounts, "log_rhos": log_rhos, "vs": vs, "adv": adv, "lag": lag,
            "priorities": adv.abs().reshape(T, B, N).mean(dim=(0, 2)),
        }

    # -- the update -----------------------------------------------------------------------------------
    def update(self, batch: Message, version: int) -> Dict[str, Any]:
        """Train on one batch (already validated with ``batch_dims``); return metrics and priorities.

        ``version`` is the learner's version *before* this update; the lag of a step is
        ``version - policy_version``. The returned dict has float metrics plus ``priorities``, one
        mean |advantage| per segment, for the next sample request (prioritized mode).
        """
        c = self.cfg
        model = self.model
        p = self.prepare(batch, version)
        T = p["values"].shape[0]
        S = p["values"].numel()
        flat = {
            "x": p["x"][:T].reshape(S, model.cfg.obs_dim),
            "action": p["action"].reshape(S, model.A),
            "option": p["option"].reshape(S),
            "logp_mu": p["logp_mu"].reshape(S),
            "adv": p["adv"].reshape(S),
            "vs": p["vs"].reshape(S),
            "w": p["weight"].reshape(S),
        }
        n_mb = max(1, min(int(c["minibatches"]), S))
        clip = float(c["clip"])
        sums: Dict[str, float] = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0,
                                  "clip_frac": 0.0, "loss": 0.0, "grad_norm": 0.0}
        count = 0
        model.train()
        for _ in range(int(c["epochs"])):
            perm = torch.randperm(S, device=self.device)
            for idx in torch.chunk(perm, n_mb):
                mb = {k: v[idx] for k, v in flat.items()}
                adv = losses.normalize(mb["adv"])
                logp_new, log_std = self._logp(mb["x"], mb["option"], mb["action"])
                v_new = self._values(mb["x"], mb["option"])
                pg = losses.weighted_mean(losses.ppo_clip_loss(logp_new, mb["logp_mu"], adv, clip), mb["w"])
                vl = losses.weighted_mean(losses.value_loss(v_new, mb["vs"]), mb["w"])
                ent = losses.weighted_mean(losses.entropy(log_std), mb["w"])
                loss = pg + float(c["vf_coef"]) * vl - float(c["ent_coef"]) * ent

                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(model.parameters(), float(c["max_grad_norm"]))
                if not (torch.isfinite(loss) and torch.isfinite(gn)):
                    self.skipped_steps += 1  # one poisoned minibatch must not destroy the weights
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                self.optimizer.step()

                with torch.no_grad():
                    log_ratio = logp_new - mb["logp_mu"]
                    ratio = log_ratio.exp()
                    sums["approx_kl"] += float(((ratio - 1) - log_ratio).mean())  # k3 estimator, >= 0
                    sums["clip_frac"] += float(((ratio - 1).abs() > clip).float().mean())
                sums["policy_loss"] += float(pg.detach())
                sums["value_loss"] += float(vl.detach())
                sums["entropy"] += float(ent.detach())
                sums["loss"] += float(loss.detach())
                sums["grad_norm"] += float(gn)
                count += 1

        rhos = torch.exp(p["log_rhos"])
        lag = p["lag"]
        metrics: Dict[str, Any] = {k: (v / count if count else float("nan")) for k, v in sums.items()}
        metrics.update(
            rho_mean=float(rhos.mean()),
            rho_clipped_frac=float((rhos > float(c["rho_bar"])).float().mean()),
            lag_mean=float(lag.mean()) if lag.size else 0.0,
            lag_max=float(lag.max()) if lag.size else 0.0,
            explained_variance=losses.explained_variance(p["values"], p["vs"]),
            value_mean=float(p["values"].mean()),
            adv_mean=float(p["adv"].mean()),
            skipped_steps=float(self.skipped_steps),
            steps=float(S),
        )
        metrics["priorities"] = [float(v) for v in p["priorities"].cpu()]
        return metrics
