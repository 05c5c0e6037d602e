"""One asynchronous update per batch: V-trace targets from both levels' behaviour log-probs, then
PPO-clip on the intra-option policies, the option-level rule (DAC or PPOC), and the student.

The broker hands the learner B segments of T steps x N_b envs, each produced by whatever policy version
the worker held (``policy_version[B, T]``), joined along the env axis into C = sum(N_b) columns (one
env's T steps each; workers may differ in N). :meth:`Trainer.update`:

1. takes the batch time-major as it arrives, ``[T, C]`` (segment b holds ``columns[b]`` consecutive
   columns), and
   reconstructs each step's option context: the previous option o_{t-1} and whether x_t starts an
   episode (both known inside a segment; at t = 0 only when no option was picked there, otherwise the
   step is left out of the option-level terms, see :meth:`Trainer.option_context`);
2. folds the batch's observations into the running normaliser, then normalises (the weights published
   after this update carry the new statistics, so workers and learner agree), and with
   ``reward_scale = "return"`` divides the rewards by the running std of the discounted return
   (:class:`~zclaw.policy.normalizer.RewardScaler`; inside the loss only);
3. computes once, without gradient, the critic's values ``Q(x_t, o_t)``, the importance ratios of both
   levels (``log rho = log pi_o(a|s) - log mu_o(a|s) + log pi_hat(o|s, o_prev) - log mu_hat``), the
   V-trace targets (:func:`zclaw.policy.losses.vtrace`) and the advantages of each level, with episode
   boundaries cut and time-limit truncations bootstrapped from the value of ``final_obs``; with
   ``reward_scale = "popart"`` the critic's output is normalised (Q = sigma f + mu, rewards raw), and once
   the targets are computed their statistics move and the critic's last layer is rescaled so that its
   values stay as they were (:class:`~zclaw.policy.popart.PopArt`); the value loss then trains f against
   ``(v_s - mu) / sigma`` with the new statistics;
4. runs ``epochs`` passes of ``minibatches`` random minibatches of::

       loss = L^L (PPO-clip, intra-option)  +  vf_coef L^V  -  ent_coef H(pi_o)
            + master_coef L^H (dac: PPO-clip on pi_hat | ppoc: master PG on option starts)
            + termination_coef L^beta (ppoc only)  -  master_ent_coef H(pi_Omega)

   each per-sample term weighted by the segment's importance weight (1 outside prioritized mode)
   and, with ``option_weights``, by the per-option weight; the student learns from
   :func:`~zclaw.policy.losses.distillation_loss` on the same minibatch, in its own Adam parameter
   group (fixed ``student_lr``, own moments; the gradient clip covers the main parameters only).

With ``options = 1`` every option-level term is absent (pi_hat = 1, log-probs 0) and this is exactly
asynchronous PPO: the same losses, gradients and optimiser steps (``tests/learner/test_options.py``).

Data-parallel learner ranks (:mod:`zclaw.learner.distributed`) run this same update, each on its own batch;
the trainer's :class:`~zclaw.learner.distributed.Sync` makes them one learner on the union of their batches:
the running statistics are merged in :meth:`Trainer.prepare`, each epoch's advantage statistics and each
step's gradients (and KL, and whether it is finite) in :meth:`Trainer.update`. Alone it does nothing.

Metric names (TensorBoard ``learner/<name>``; stable, other tools read them): ``loss/policy``,
``loss/value``, ``loss/entropy``, ``loss/master``, ``loss/termination``, ``loss/termination_prior``,
``loss/option_pull``, ``loss/master_entropy``,
``loss/student``, ``loss/total``, ``approx_kl``, ``clip_frac``, ``rho_mean``, ``rho_clipped_frac``,
``rho_option_mean``, ``lag_mean``, ``lag_max``, ``lag/option/<o>``, ``explained_variance``,
``reward_scale``, ``popart_mu``, ``popart_sigma``, ``norm_left_out``, ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import config as zconfig
from ..policy import losses
from ..policy.health import OptionHealth
from ..policy.networks import OptionPolicy
from ..policy.normalizer import RewardScaler
from ..policy.popart import PopArt
from ..wire import Message
from .distributed import Sync

LOSS_KEYS = ("loss/policy", "loss/value", "loss/entropy", "loss/master", "loss/termination",
             "loss/termination_prior", "loss/option_pull", "loss/master_entropy", "loss/student",
             "loss/total", "approx_kl", "clip_frac", "grad_norm")


@dataclass(frozen=True)
class TrainConfig:
    """The ``[learner]`` keys the update reads, typed and read once (``zclaw/config.py`` documents each;
    its defaults are the only defaults: :meth:`from_section` fills a missing key from the schema)."""

    gamma: float
    lam: float
    lr: float
    epochs: int
    minibatches: int
    clip: float
    rho_bar: float
    c_bar: float
    vf_coef: float
    ent_coef: float
    log_std_min: float
    max_grad_norm: float
    target_kl: float
    adv_norm: str
    reward_scale: str
    reward_clip: float
    popart_beta: float
    mode: str
    master_coef: float
    master_ent_coef: float
    termination_coef: float
    termination_prior: float
    termination_prior_coef: float
    option_pull_coef: float
    xi: float
    deliberation_cost: float
    option_weights: bool
    option_max_weight: float
    student_lr: float
    health_collapse_duration: float
    health_dominant_share: float
    health_identical_spread: float
    health_warmup_updates: int

    @property
    def scale_advantages(self) -> bool:
        """``adv_norm = "std"``: advantages divided by their std as well as centred."""
        return self.adv_norm == "std"

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> "TrainConfig":
        """From a ``[learner]`` mapping (a resolved config's, or a partial one in tests), validated by the
        schema: a bad value raises :class:`zclaw.config.ConfigError` naming the key."""
        schema = zconfig.SCHEMA["learner"]
        values = {}
        for f in fields(cls):
            key = schema[f.name]
            values[f.name] = key.check(f"learner.{f.name}", section.get(f.name, key.default))
        return cls(**values)


class PreparedBatch(NamedTuple):
    """One batch laid out time-major, ``[T, C]`` with C = sum(N_b) columns (segment b's N_b envs are
    consecutive columns), with its targets computed once without gradient (:meth:`Trainer.prepare`)."""

    x: torch.Tensor  # [T+1, C, D] normalised observations (row T: the bootstrap state x_T)
    action: torch.Tensor  # [T, C, A] a_t as the worker sent it
    option: torch.Tensor  # [T, C] o_t, the option executing at t
    prev_option: torch.Tensor  # [T, C] o_{t-1} (Trainer.option_context)
    ep_start: torch.Tensor  # [T, C] x_t starts an episode
    known: torch.Tensor  # [T, C] the option choice at t is known (false at a segment's first pick)
    option_start: torch.Tensor  # [T, C] an option was picked at t
    logp_mu: torch.Tensor  # [T, C] log mu_o(a_t|x_t): the behaviour log-prob of the action
    logp_mu_option: torch.Tensor  # [T, C] log mu_hat(o_t|x_t, o_{t-1}): behaviour log-prob of the choice
    weight: torch.Tensor  # [T, C] the segment's importance weight (prioritized replay; 1 otherwise)
    values: torch.Tensor  # [T, C] Q(x_t, o_t) (K = 1: V(x_t)), in reward units (popart: sigma f + mu)
    bootstrap: torch.Tensor  # [C] U(x_T, o_{T-1}), the value the last step bootstraps from
    final_values: torch.Tensor  # [T, C] U(final_obs, o_t) where a time limit cut the episode, else 0
    rewards: torch.Tensor  # [T, C] scaled rewards (popart: raw), time-limit bootstrap folded in
    discounts: torch.Tensor  # [T, C] gamma_t: 0 where an episode ended at t
    log_rhos: torch.Tensor  # [T, C] log pi/mu of the step, both levels
    log_rho_option: torch.Tensor  # [T, C] log pi_hat/mu_hat of the option choice (0 for K = 1)
    vs: torch.Tensor  # [T, C] V-trace targets of the critic, in the units of the rewards (never PopArt's)
    q_ret: torch.Tensor  # [T, C] q_t = r_t + gamma_t (lam v_{t+1} + (1 - lam) V(x_{t+1}))
    adv: torch.Tensor  # [T, C] intra-option advantage rho^a (q_t - Q(x_t, o_t))
    adv_high: torch.Tensor  # [T, C] DAC: rho (q_t - V^H(x_t, o_{t-1})); zeros otherwise
    adv_master: torch.Tensor  # [T, C] PPOC: rho (q_t - V(x_t)); zeros otherwise
    q_prev: torch.Tensor  # [T, C] PPOC: Q(x_t, o_{t-1}), the termination's input; zeros otherwise
    v: torch.Tensor  # [T, C] PPOC: V(x_t); zeros otherwise
    lag: np.ndarray  # [T, C] the learner's version minus the version that produced each step
    priorities: torch.Tensor  # [B] mean |adv| of each segment, the next request's priorities
    rank_samples: Tuple[int, ...]  # every learner rank's batch size in samples (alone: this batch's T * C)


class Samples(NamedTuple):
    """The per-sample fields a minibatch draws from: a :class:`PreparedBatch` flattened to ``[S, ...]``."""

    x: torch.Tensor
    action: torch.Tensor
    option: torch.Tensor
    prev_option: torch.Tensor
    ep_start: torch.Tensor
    known: torch.Tensor
    option_start: torch.Tensor
    logp_mu: torch.Tensor
    logp_mu_option: torch.Tensor
    log_rho_option: torch.Tensor
    adv: torch.Tensor
    vs: torch.Tensor  # the value loss's target in the critic's own units (popart: (v_s - mu) / sigma)
    adv_high: torch.Tensor
    adv_master: torch.Tensor
    q_prev: torch.Tensor  # PPOC's termination input, with v: in units of sigma under popart
    v: torch.Tensor
    w: torch.Tensor  # importance weight of the sample's segment
    w_low: torch.Tensor  # w times the per-option weight of the intra-option terms (option_weights)

    def take(self, idx: torch.Tensor) -> "Samples":
        """The minibatch of the samples at ``idx``."""
        return Samples(*(f[idx] for f in self))


def fused_adam(groups: List[Dict[str, Any]], **kw: Any) -> torch.optim.Optimizer:
    """Adam with ``fused=True`` where this torch has it for the parameters' device, the plain one elsewhere.

    Why: a learner's MLP step is dispatch-bound. The plain Adam runs several small ops per parameter tensor
    (on a CPU, one tensor at a time); the fused one is one kernel per step: on a GPU (docs/benchmarks.md,
    "On one GPU") and, since torch 2.4, on a CPU, where it took 10 % off a K = 4 update at Ant-v5 sizes
    (274 -> 243 ms) and so leaves more of the machine to the workers. Same update rule and state dict."""
    try:
        return torch.optim.Adam(groups, fused=True, **kw)
    except (RuntimeError, TypeError, ValueError):  # an older torch, or a device without the fused kernel
        return torch.optim.Adam(groups, **kw)


class Trainer:
    """Owns the optimiser of an :class:`OptionPolicy` (main and student parameter groups) and turns
    batches into updates."""

    def __init__(
        self, model: OptionPolicy, learner_cfg: Union[TrainConfig, Mapping[str, Any]], device: Any = "cpu",
        action_low: Optional[Sequence[float]] = None, action_high: Optional[Sequence[float]] = None,
        obs_max_abs: float = float("inf"), sync: Optional[Sync] = None,
    ) -> None:
        c = learner_cfg if isinstance(learner_cfg, TrainConfig) else TrainConfig.from_section(learner_cfg)
        #: what data-parallel learner ranks agree on (zclaw/learner/distributed.py); alone, nothing
        self.sync = sync if sync is not None else Sync(device=device)
        self.cfg = c
        self.device = torch.device(device)
        self.model = model.to(self.device)
        student = set(id(p) for p in self.student_parameters())
        self.main_params = [p for p in self.model.parameters() if id(p) not in student]
        # one Adam, two parameter groups: the student's group has its own fixed learning rate and (as
        # Adam's state is per parameter) its own moments, so it is an optimiser of its own that a
        # checkpoint saves and restores together with the main one
        self.optimizer = fused_adam(
            [{"params": self.main_params, "lr": c.lr},
             {"params": self.student_parameters(), "lr": c.student_lr}], eps=1e-5)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        #: what log_std_min floors: the option policies' log stds (not the student's, which only imitates)
        self.log_std_params = [self.model.log_std] + ([self.model.shared_log_std] if self.model.residual
                                                      else [])
        self.low = (torch.as_tensor(action_low, dtype=torch.float32, device=self.device)
                    if action_low is not None else None)
        self.high = (torch.as_tensor(action_high, dtype=torch.float32, device=self.device)
                     if action_high is not None else None)
        self.health = OptionHealth(model.K, collapse_duration=c.health_collapse_duration,
                                   dominant_share=c.health_dominant_share,
                                   identical_spread=c.health_identical_spread,
                                   warmup_updates=c.health_warmup_updates,
                                   action_low=self.low, action_high=self.high)
        self.reward_scaler = (RewardScaler(c.gamma, clip=c.reward_clip) if c.reward_scale == "return"
                              else None)
        #: reward_scale = "popart": the statistics of the value targets and the critic's output layer they
        #: rescale (the critic is an MLP, its last module the Linear layer that outputs K values)
        self.popart = (PopArt(self.model.critic[-1], beta=c.popart_beta) if c.reward_scale == "popart"
                       else None)
        #: observation rows beyond this (or not finite) are left out of the normaliser's statistics
        self.obs_max_abs = float(obs_max_abs)
        self.skipped_steps = 0  # optimiser steps skipped because the loss or gradient was not finite
        self.norm_left_out = 0  # observation rows the normaliser left out (out of range)
        self.floor_log_std()

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps of the trainer beside the model and the optimiser."""
        return {"reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler else None,
                "popart": self.popart.state_dict() if self.popart else None}

    def load_state_dict(self, state: Optional[Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict` (None or a missing entry, from an older checkpoint: fresh
        statistics). Load the model first: PopArt's statistics are the units of the critic's saved last
        layer, and restoring them leaves the layer as it is."""
        scaler = (state or {}).get("reward_scaler")
        if self.reward_scaler is not None and scaler:
            self.reward_scaler.load_state_dict(scaler)
        popart = (state or {}).get("popart")
        if self.popart is not None and popart:
            self.popart.load_state_dict(popart)

    def student_parameters(self) -> list:
        return list(self.model.student.parameters()) + [self.model.student_log_std]

    # -- layout ---------------------------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(arr), device=self.device).to(dtype)

    @staticmethod
    def option_context(
        option: torch.Tensor, option_start: torch.Tensor, done: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each step's (o_{t-1}, episode start at x_t, choice known), all [T, C], from one segment's rows.

        For t >= 1: o_{t-1} = option[t-1] and x_t starts an episode iff step t-1 ended one. For t = 0
        the segment does not say what came before: if no option was picked there (``option_start[0]``
        false) the option simply continued, so o_{-1} = o_0 and it is no episode start; otherwise the
        choice at t = 0 is unknown (``choice_known`` false) and the option-level terms skip it.
        """
        prev = torch.cat([option[:1], option[:-1]], 0)
        ep_start = torch.cat([option_start[:1], done[:-1]], 0)
        known = torch.ones_like(option_start)
        known[0] = ~option_start[0]
        return prev, ep_start, known

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        """Q(s, .) in reward units: the critic's output, read as ``sigma f + mu`` under popart."""
        q = self.model.q(x)
        return self.popart.unnormalize(q) if self.popart is not None else q

    def _values(self, x: torch.Tensor, option: torch.Tensor, own_units: bool = False) -> torch.Tensor:
        """The critic's value of the option in effect: Q(s, o) (for K = 1, option 0's Q, i.e. V(s)), in reward
        units; ``own_units``: the critic's output itself, as the value loss trains it (popart: normalised)."""
        q = self.model.q(x) if own_units else self._q(x)
        return q.gather(-1, option.unsqueeze(-1)).squeeze(-1)

    def _arrival_values(self, x: torch.Tensor, prev: torch.Tensor, ep_start: torch.Tensor) -> torch.Tensor:
        """U(x, o_prev) = sum_o pi_hat(o|x, o_prev) Q(x, o): the value of arriving in x
        with o_prev running."""
        if self.model.K == 1:
            return self._values(x, prev)
        pi_hat = self.model.call_and_return_logits(x, prev, ep_start).exp()
        return losses.option_value(self._q(x), pi_hat)

    def _logp(
        self, x: torch.Tensor, option: torch.Tensor, action: torch.Tensor,
        actor_out: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """log pi_o(a|s) of the executing option, and that option's log std (for the entropy); ``actor_out``:
        the actor's output for ``x`` where the caller has it already."""
        model = self.model
        heads = model.actor(x) if actor_out is None else actor_out
        mean = model.mean_of_option(model.means_of(heads), option)
        log_std = model.option_log_std()[option]
        return model.gaussian_logp(action, mean, log_std), log_std

    def _logp_option(self, x: torch.Tensor, prev: torch.Tensor, ep_start: torch.Tensor,
                     option: torch.Tensor) -> torch.Tensor:
        """log pi_hat(o_t | x_t, o_{t-1}) (0 for K = 1)."""
        logits = self.model.call_and_return_logits(x, prev, ep_start)
        return logits.gather(-1, option.unsqueeze(-1)).squeeze(-1)

    # -- targets ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, batch: Message, version: int, update_norm: bool = True) -> PreparedBatch:
        """Lay the batch out time-major and compute, once and without gradient, targets and advantages
        (the fields of :class:`PreparedBatch`).

        ``update_norm`` folds the batch into the running statistics (observations, and the reward scale)
        first, and PopArt's value statistics once the targets are known; tests that compare against a hand
        computation turn it off.
        """
        c = self.cfg
        a = batch.arrays
        T, C = a["action"].shape[:2]
        columns = [int(n) for n in batch["columns"]]  # segment b's env count: its consecutive columns
        B = len(columns)
        model = self.model
        K = model.K
        D = model.cfg.obs_dim

        raw = self._tensor(a["obs"]).reshape(T + 1, C, D)
        # the observation and reward-scale statistics first (every rank's batch with ranks): every step once
        # (row T is the next segment's row 0)
        rank_samples = self._fold_statistics(raw[:T], batch, columns) if update_norm else (T * C,)
        x = model.obs_norm(raw)
        action = self._tensor(a["action"]).reshape(T, C, model.A)
        reward = self._tensor(a["reward"])
        terminated = self._tensor(a["terminated"], torch.bool)
        truncated = self._tensor(a["truncated"], torch.bool)
        option = self._tensor(a["option"], torch.long).clamp(0, K - 1)
        option_start = self._tensor(a["option_start"], torch.bool)
        logp_mu = self._tensor(a["logp_action"])
        logp_mu_option = self._tensor(a["logp_option"])
        segment = torch.repeat_interleave(torch.arange(B, device=self.device),
                                          torch.as_tensor(columns, device=self.device))  # [C] -> b
        weight = self._tensor(a["is_weight"])[segment].unsqueeze(0).expand(T, C)
        # [T, C]: each column's steps lag as its segment's
        lag = np.repeat((int(version) - a["policy_version"].astype(np.int64)).T, columns, axis=1)
        done = terminated | truncated
        prev, ep_start, known = self.option_context(option, option_start, done)
        self.health.update(option, option_start, prev, known, ep_start, raw[:T])

        # deliberation cost (Harb et al. 2018): a price on every switch that is not an episode start
        if K > 1 and c.deliberation_cost > 0:
            reward = reward - c.deliberation_cost * (option_start & known & ~ep_start).to(reward.dtype)
        # reward scale (RewardScaler, its statistics folded above): inside the loss only; what workers report
        # stays raw (popart leaves rewards raw and normalises the critic's values instead)
        if self.reward_scaler is not None:
            reward = self.reward_scaler.scale(reward)

        values = self._values(x[:T], option)  # Q(x_t, o_t)
        # x_T is reached with o_{T-1} running: bootstrap from U(x_T, o_{T-1}) (for K = 1, V(x_T))
        bootstrap = self._arrival_values(x[T], option[T - 1], done[T - 1])
        logp_pi, _ = self._logp(x[:T], option, action)
        log_rho_action = logp_pi - logp_mu
        if K > 1:
            log_rho_option = torch.where(known,
                                         self._logp_option(x[:T], prev, ep_start, option) - logp_mu_option,
                                         torch.zeros_like(logp_mu_option))
        else:
            log_rho_option = torch.zeros_like(log_rho_action)
        log_rhos = log_rho_action + log_rho_option

        # value of final_obs at the truncated steps (carried sparsely as final_at rows (t, c)): the
        # episode would have gone on with o_t running, so U(final_obs, o_t)
        final_values = torch.zeros_like(reward)
        fa = np.asarray(a["final_at"], dtype=np.int64)
        if fa.shape[0]:
            ft, col = (torch.as_tensor(fa[:, i], device=self.device) for i in range(2))
            fx = model.obs_norm(self._tensor(a["final_obs"]).reshape(-1, D))
            final_values[ft, col] = self._arrival_values(fx, option[ft, col],
                                                         torch.zeros_like(col, dtype=torch.bool))
        rewards, discounts = losses.episode_boundaries(reward, terminated, truncated, c.gamma, final_values)

        # One V-trace chain over both levels (log_rhos holds the action's and the choice's ratio), and every
        # level's advantage is q_t minus its own baseline. The DAC reference implementation instead runs
        # one GAE per MDP (high and low, each with its own value); one chain needs one critic Q(s, o)
        # and one backward pass per batch, and for K = 1 it is exactly V-trace PPO (docs/learning.md).
        vs, _ = losses.vtrace(values, bootstrap, rewards, discounts, log_rhos,
                              rho_bar=c.rho_bar, c_bar=c.c_bar, lam=c.lam)
        q_ret = losses.q_returns(vs, values, bootstrap, rewards, discounts, c.lam)
        # low MDP: the option o_t is given, only the action's ratio weighs its advantage
        adv = losses.truncated_is(log_rho_action, c.rho_bar) * (q_ret - values)
        zeros = torch.zeros_like(values)
        adv_high = adv_master = q_prev = v = zeros
        if K > 1:
            q_all = self._q(x[:T])
            rho_joint = losses.truncated_is(log_rhos, c.rho_bar)
            if c.mode == "dac":
                pi_hat = model.call_and_return_logits(x[:T], prev, ep_start).exp()
                adv_high = rho_joint * (q_ret - losses.option_value(q_all, pi_hat))  # q - V^H(s, o_prev)
            else:
                v = losses.option_value(q_all, model.master_probs(x[:T]))  # V(s), pi_Omega epsilon-soft
                adv_master = rho_joint * (q_ret - v)
                q_prev = q_all.gather(-1, prev.unsqueeze(-1)).squeeze(-1)  # Q(s', o_prev)
        # PopArt, in this order: the targets above used the old statistics; now the statistics move (every
        # rank's targets merged) and the critic's last layer is rescaled so that every value computed above
        # is still what the critic says; samples() then gives the value loss (v_s - mu') / sigma'
        if self.popart is not None and update_norm:
            self.popart.fold(self.sync.merge(self.popart.measure(vs)))
        # mean |adv| of each segment's T x N_b steps (popart: in units of sigma, as the other modes' are O(1))
        scale = self.popart.sigma if self.popart is not None else 1.0
        priorities = (torch.zeros(B, device=self.device).index_add_(0, segment, adv.abs().sum(0))
                      / (T * scale * torch.as_tensor(columns, device=self.device, dtype=adv.dtype)))
        return PreparedBatch(
            x=x, action=action, option=option, prev_option=prev, ep_start=ep_start, known=known,
            option_start=option_start, logp_mu=logp_mu, logp_mu_option=logp_mu_option, weight=weight,
            values=values, bootstrap=bootstrap, final_values=final_values, rewards=rewards,
            discounts=discounts, log_rhos=log_rhos, log_rho_option=log_rho_option, vs=vs, q_ret=q_ret,
            adv=adv, adv_high=adv_high, adv_master=adv_master, q_prev=q_prev, v=v, lag=lag,
            priorities=priorities, rank_samples=rank_samples,
        )

    def _fold_statistics(self, raw: torch.Tensor, batch: Message, columns: List[int]) -> Tuple[int, ...]:
        """Fold the batch's observations ``raw[T, C, D]`` (rows out of range left out) and, with
        ``reward_scale = "return"``, its discounted returns into the running statistics; return every rank's
        batch size in samples.

        With data-parallel ranks every rank's batch moments are merged first (:meth:`Sync.batch`, one
        all-gather), so every rank folds the same statistics: those one learner on all their batches would."""
        a = batch.arrays
        obs, left_out = self.model.obs_norm.measure(raw, max_abs=self.obs_max_abs)
        returns = (self.reward_scaler.measure(a["reward"], a["terminated"] | a["truncated"], columns,
                                              batch["workers"], batch["seqs"])
                   if self.reward_scaler is not None else None)
        share = self.sync.batch(obs, returns, int(raw.shape[0] * raw.shape[1]))
        self.model.obs_norm.fold(share.obs)
        if self.reward_scaler is not None and share.returns is not None:
            self.reward_scaler.fold(share.returns)
        self.norm_left_out += left_out
        return share.samples

    def samples(self, p: PreparedBatch) -> Samples:
        """Flatten a prepared batch's per-step fields to ``[S, ...]`` (S = T*C), the minibatch pool."""
        T = p.values.shape[0]
        S = p.values.numel()

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape((S,) + tuple(t.shape[2:]))

        w = flat(p.weight)
        w_low = w
        if self.model.K > 1 and self.cfg.option_weights:
            w_low = w * losses.option_loss_weights(flat(p.option), self.model.K, self.cfg.option_max_weight)
        vs, q_prev, v = p.vs, p.q_prev, p.v
        if self.popart is not None:
            # the value loss in the critic's units, with the statistics prepare() has just moved
            vs = self.popart.normalize(vs)
            if self.model.K > 1 and self.cfg.mode == "ppoc":
                # the termination's input Q - V in units of sigma, as "return" has it in the return's std
                q_prev, v = self.popart.normalize(q_prev), self.popart.normalize(v)
        return Samples(
            x=p.x[:T].reshape(S, self.model.cfg.obs_dim), action=flat(p.action), option=flat(p.option),
            prev_option=flat(p.prev_option), ep_start=flat(p.ep_start), known=flat(p.known),
            option_start=flat(p.option_start), logp_mu=flat(p.logp_mu), logp_mu_option=flat(p.logp_mu_option),
            log_rho_option=flat(p.log_rho_option), adv=flat(p.adv), vs=flat(vs), adv_high=flat(p.adv_high),
            adv_master=flat(p.adv_master), q_prev=flat(q_prev), v=flat(v), w=w, w_low=w_low,
        )

    # -- the update -----------------------------------------------------------------------------------
    def update(self, batch: Message, version: int) -> Dict[str, Any]:
        """Train on one batch (already validated with ``batch_dims``); return metrics and priorities.

        ``version`` is the learner's version *before* this update; the lag of a step is
        ``version - policy_version``. The returned dict has float metrics plus ``priorities``, one
        mean |advantage| per segment, for the next sample request (prioritized mode).
        """
        c = self.cfg
        p = self.prepare(batch, version)
        pool = self.samples(p)
        S = pool.adv.shape[0]
        # exactly this many minibatches per epoch, on every rank alike (ranks step together)
        n_mb = max(1, min(c.minibatches, min(p.rank_samples)))
        sums: Dict[str, float] = {k: 0.0 for k in LOSS_KEYS}
        count = 0
        kl_stop = 1.5 * c.target_kl  # SB3's rule: stop once a minibatch is this far from the behaviour
        stopped = False
        self.model.train()
        for _ in range(c.epochs):
            if stopped:
                break
            minibatches = [pool.take(idx) for idx in torch.tensor_split(torch.randperm(S, device=self.device),
                                                                        n_mb)]
            # each minibatch's advantage statistics over every rank's minibatch (alone: None, its own)
            norms = self.sync.normalizers([self._advantage_sets(mb) for mb in minibatches])
            for mb, norm in zip(minibatches, norms):
                loss, terms, kl_t, clip_t = self.loss(mb, norm)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                terms["loss/student"] = self._student_loss(mb)  # its gradient reaches the student only
                terms["loss/total"] = loss.detach()
                # alone, the gradient is clipped before the read below, so that one read from the device
                # serves every decision of the step (a GPU learner pays for each read with an idle pipeline);
                # ranks clip the all-reduced gradient, after their own read. Clipping a gradient that the KL
                # stop then drops changes nothing: it is zeroed before the next backward.
                gn_t = None if self.sync.parallel else self._clip_gradients()
                host = self._read(terms, kl_t, clip_t, gn_t)
                finite = math.isfinite(host["loss/total"]) and math.isfinite(host["loss/student"])
                # ranks: gradients, KL and clip fraction over every rank's minibatch; all finite?
                finite, kl, clip_frac = self.sync.gradients(self.params, int(mb.adv.shape[0]), finite,
                                                            host["approx_kl"], host["clip_frac"])
                if kl_stop > 0 and count > 0 and kl > kl_stop:
                    stopped = True
                    break
                gn = host["grad_norm"] if gn_t is not None else float(self._clip_gradients())
                if not (finite and math.isfinite(gn)):
                    self.skipped_steps += 1  # one poisoned minibatch must not destroy the weights
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                self.optimizer.step()
                self.floor_log_std()

                host.update(approx_kl=kl, clip_frac=clip_frac, grad_norm=gn)
                for k in sums:
                    sums[k] += host.get(k, 0.0)  # K = 1 has no option terms
                count += 1

        metrics: Dict[str, Any] = {k: (v / count if count else float("nan")) for k, v in sums.items()}
        metrics["sgd_steps"] = float(count)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["kl_stopped"] = float(stopped)
        metrics.update(self._batch_metrics(p))
        metrics["steps_all"] = float(sum(p.rank_samples))  # every rank's batch together (alone: steps)
        metrics["priorities"] = [float(v) for v in p.priorities.cpu()]
        return metrics

    def anneal(self, remaining: float) -> None:
        """Set the main learning rate to ``remaining`` x ``lr`` (``learner.lr_anneal``; remaining in [0, 1],
        the budget not yet spent). The student's rate stays: distillation follows whatever the policy is."""
        self.optimizer.param_groups[0]["lr"] = self.cfg.lr * min(max(float(remaining), 0.0), 1.0)

    def floor_log_std(self) -> None:
        """Project the intra-option log stds (and the shared one) back above ``log_std_min``: a projected
        gradient step, so the weights the workers act with never hold a sigma below the floor. Also called
        on weights the trainer did not step (a fresh model whose ``init_log_std`` is below the floor, a
        checkpoint written under a lower floor), so version 0 and a resumed version obey it too."""
        with torch.no_grad():
            for p in self.log_std_params:
                p.clamp_(min=self.cfg.log_std_min)

    def _clip_gradients(self) -> torch.Tensor:
        """Clip the main parameters' gradient to ``max_grad_norm``; its norm before clipping (on the
        device: no read)."""
        return torch.nn.utils.clip_grad_norm_(self.main_params, self.cfg.max_grad_norm)

    @staticmethod
    def _read(terms: Mapping[str, torch.Tensor], kl: torch.Tensor, clip_frac: torch.Tensor,
              grad_norm: Optional[torch.Tensor]) -> Dict[str, float]:
        """A minibatch's scalars, from the device in one read: the loss terms, ``approx_kl``, ``clip_frac``
        and, when given, ``grad_norm``."""
        names = list(terms) + ["approx_kl", "clip_frac"] + (["grad_norm"] if grad_norm is not None else [])
        values = [terms[k].detach().reshape(()) for k in terms] + [kl, clip_frac]
        if grad_norm is not None:
            values.append(grad_norm.detach().to(kl.device))
        return dict(zip(names, torch.stack([v.float() for v in values]).tolist()))

    def _advantage_sets(self, mb: Samples) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The advantages :meth:`loss` normalises per minibatch, each with the mask of the entries its
        statistics come from (None: all): the intra-option advantage; for K > 1 DAC's high-MDP advantage
        over the known choices, or PPOC's master advantage over the option picks."""
        sets: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = [(mb.adv, None)]
        if self.model.K > 1:
            sets.append((mb.adv_high, mb.known) if self.cfg.mode == "dac"
                        else (mb.adv_master, mb.option_start & mb.known))
        return sets

    def loss(
        self, mb: Samples, norm: Optional[Sequence[Tuple[float, float, float]]] = None
    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """One minibatch's loss, top to bottom as in the papers; returns (loss, its terms, KL, clip fraction),
        every one a tensor on the device (:meth:`update` reads them all at once).

        PPO (Schulman et al. 2017, eq. 9) on the intra-option policy of the executing option, its ratio
        taken to the behaviour policy mu the worker acted with (asynchronous PPO)::

            L = L^CLIP(pi_o) + vf_coef L^V - ent_coef H(pi_o)                       the low MDP
              + master_coef L^H - master_ent_coef H(pi_Omega)                        K > 1: DAC's high MDP
              (ppoc: + master_coef L^Omega + termination_coef L^beta instead of L^H)
              + termination_prior_coef L^prior                                      K > 1
              + option_pull_coef L^pull                                             K > 1, residual options

        Advantages are normalised per minibatch (``adv_norm``; ``norm``: the statistics of
        :meth:`_advantage_sets` over every rank's minibatch, with data-parallel ranks); every per-sample term
        is weighted by the segment's importance weight w (the intra-option terms by ``w_low``, which adds the
        per-option weight when ``option_weights`` is on).
        """
        c = self.cfg
        adv = losses.normalize(mb.adv, stats=norm[0] if norm else None, scale=c.scale_advantages)
        features = self.model.actor_features(mb.x)  # once: the policy loss and the options' pull share them
        logp_new, log_std = self._logp(mb.x, mb.option, mb.action, self.model.actor_output(features))
        with torch.no_grad():  # distance from the behaviour policy: the KL stop and the metrics
            log_ratio = logp_new - mb.logp_mu
            ratio = log_ratio.exp()
            kl = ((ratio - 1) - log_ratio).mean()  # k3 estimator, >= 0
            clip_frac = ((ratio - 1).abs() > c.clip).float().mean()
        v_new = self._values(mb.x, mb.option, own_units=True)  # popart: normalised, as mb.vs is
        pg = losses.weighted_mean(losses.ppo_clip_loss(logp_new, mb.logp_mu, adv, c.clip), mb.w_low)
        vl = losses.weighted_mean(losses.value_loss(v_new, mb.vs), mb.w_low)
        ent = losses.weighted_mean(losses.entropy(log_std), mb.w_low)
        loss = pg + c.vf_coef * vl - c.ent_coef * ent
        terms = {"loss/policy": pg, "loss/value": vl, "loss/entropy": ent}
        if self.model.K > 1:
            terms.update(self._option_terms(mb, features, norm[1] if norm else None))
            loss = (loss + c.master_coef * terms["loss/master"]
                    + c.termination_coef * terms["loss/termination"]
                    + c.termination_prior_coef * terms["loss/termination_prior"]
                    - c.master_ent_coef * terms["loss/master_entropy"])
            if self.model.residual and c.option_pull_coef > 0:
                loss = loss + c.option_pull_coef * terms["loss/option_pull"]
        return loss, terms, kl, clip_frac

    def _option_terms(
        self, mb: Samples, features: Optional[torch.Tensor] = None,
        norm: Optional[Tuple[float, float, float]] = None
    ) -> Dict[str, torch.Tensor]:
        """The option-level losses of one minibatch (K > 1): DAC's or PPOC's, the master entropy (all of the
        epsilon-soft pi_Omega the workers sample from, :meth:`OptionPolicy.log_master`), the termination
        prior and, with residual options, the options' pull toward the shared head (``features``: the
        actor's last hidden layer for ``mb.x``, where the caller has it already)."""
        c, model = self.cfg, self.model
        x, w, known = mb.x, mb.w, mb.known
        # each head once per minibatch: the master and the termination logits serve every term below
        log_master = model.log_master(x)
        term_logits = model.termination(x)
        prev = mb.prev_option.clamp(0, model.K - 1)
        # beta_{o_{t-1}}(x_t)
        beta_prev = torch.sigmoid(term_logits).gather(-1, prev.unsqueeze(-1)).squeeze(-1)
        prior = losses.termination_prior_loss(term_logits, c.termination_prior)
        out = {"loss/master_entropy": losses.weighted_mean(losses.categorical_entropy_logp(log_master), w),
               "loss/termination_prior": losses.weighted_mean(prior, w)}
        if model.residual:  # reported whatever its coefficient: how far the options' own heads have gone
            # on fixed features: the pull moves the options' own output rows, not the body every head shares
            if features is None:
                features = model.actor_features(x)
            own, shared = model.residual_heads(model.actor_output(features.detach()))
            pull = losses.option_pull_loss(own, model.log_std, shared.detach(), model.shared_log_std.detach())
            out["loss/option_pull"] = losses.weighted_mean(pull, w)
        if c.mode == "dac":
            log_pi_hat = model.mix_call_and_return(log_master, beta_prev, prev, mb.ep_start).gather(
                -1, mb.option.unsqueeze(-1)).squeeze(-1)
            adv_h = losses.masked_normalize(mb.adv_high, known, stats=norm, scale=c.scale_advantages)
            hl = losses.dac_high_loss(log_pi_hat, mb.logp_mu_option, adv_h, c.clip)
            out["loss/master"] = losses.masked_mean(hl, known, w)
            out["loss/termination"] = torch.zeros((), device=x.device)
        else:
            picked = mb.option_start & known
            log_pi_omega = log_master.gather(-1, mb.option.unsqueeze(-1)).squeeze(-1)
            adv_m = losses.masked_normalize(mb.adv_master, picked, stats=norm, scale=c.scale_advantages)
            w_is = losses.truncated_is(mb.log_rho_option, c.rho_bar)
            out["loss/master"] = losses.masked_mean(losses.ppoc_master_loss(log_pi_omega, adv_m, w_is),
                                                    picked, w)
            decision = known & ~mb.ep_start  # beta_{o_{t-1}} was consulted at x_t (= s' of step t-1)
            out["loss/termination"] = losses.masked_mean(
                losses.ppoc_termination_loss(beta_prev, mb.q_prev, mb.v, c.xi), decision, w)
        return out

    def _student_loss(self, mb: Samples) -> torch.Tensor:
        """The distillation loss on these states, back-propagated into the student's parameters only:
        its mean moves toward the executing option's clipped mean (a target, no gradient)."""
        model = self.model
        if self.cfg.student_lr <= 0:
            return torch.zeros((), device=mb.x.device)
        with torch.no_grad():
            target = model.option_mean(mb.x, mb.option)
            if self.low is not None and self.high is not None:
                target = torch.max(torch.min(target, self.high), self.low)
        sl = losses.weighted_mean(losses.distillation_loss(model.student_mean(mb.x), target), mb.w)
        sl.backward()
        return sl.detach()

    def _batch_metrics(self, p: PreparedBatch) -> Dict[str, float]:
        rhos = torch.exp(p.log_rhos)
        lag = p.lag
        m: Dict[str, float] = dict(
            rho_mean=float(rhos.mean()),
            rho_clipped_frac=float((rhos > self.cfg.rho_bar).float().mean()),
            rho_option_mean=float(torch.exp(p.log_rho_option).mean()),
            lag_mean=float(lag.mean()) if lag.size else 0.0,
            lag_max=float(lag.max()) if lag.size else 0.0,
            explained_variance=losses.explained_variance(p.values, p.vs),
            value_mean=float(p.values.mean()),
            adv_mean=float(p.adv.mean()),
            skipped_steps=float(self.skipped_steps),
            steps=float(p.values.numel()),
            norm_left_out=float(self.norm_left_out),
        )
        if self.reward_scaler is not None:
            m["reward_scale"] = self.reward_scaler.std  # rewards are divided by this inside the loss
        if self.popart is not None:  # the critic's values are sigma f + mu
            m["popart_mu"] = self.popart.mu
            m["popart_sigma"] = self.popart.sigma
        if self.model.K > 1 and lag.size:
            # per-option lag: every step's lag [T, C], grouped by option
            step_lag = torch.as_tensor(lag, dtype=torch.float32)
            opt = p.option.cpu()
            for o in range(self.model.K):
                sel = opt == o
                if bool(sel.any()):
                    m[f"lag/option/{o}"] = float(step_lag[sel].mean())
        return m

    def health_summary(self) -> Dict[str, Any]:
        """Option health figures (see :mod:`zclaw.policy.health`) for reports and logs."""
        return self.health.summary(self.model)
