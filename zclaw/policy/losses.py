"""The learner's loss terms, written to be read top to bottom beside the papers (after CleanRL).

Every function is small and pure: torch tensors in, tensors out, no module state. Sequences are
time-major ``[T, B]`` (B columns, each one env of one segment); per-sample losses are returned
unreduced so that the trainer can weight them (prioritized replay importance weights) before it
takes a mean.

Notation (Espeholt et al. 2018, "IMPALA", section 4; Schulman et al. 2017, "PPO"):

* ``pi`` the policy being learned, ``mu`` the behaviour policy a worker acted with (a stale copy:
  asynchronous workers act with older weights, so every batch is slightly off-policy);
* ``rho_t = pi(a_t|x_t) / mu(a_t|x_t)``, given as ``log_rhos`` for numerical range;
* ``gamma_t`` the per-step discount, zero where an episode ended at t, so no trace crosses an episode
  boundary (the trainer folds the time-limit bootstrap into the reward of truncated steps);
* ``V(x_t)`` the critic, ``v_s`` the V-trace target for it.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def episode_boundaries(
    rewards: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    final_values: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-step discounts and rewards that respect episode ends, for :func:`vtrace`::

        done_t      = terminated_t or truncated_t
        gamma_t     = gamma * (1 - done_t)                       no trace, no bootstrap across an episode end
        r'_t        = r_t + gamma * V(final_obs_t)   if truncated_t and not terminated_t   (time limit)
        r'_t        = r_t                            otherwise                               (terminal: V = 0)

    A time-limit truncation is not a terminal state, so its return continues past the limit; the
    autoreset replaced ``x_{t+1}`` by the next episode's first observation, so the bootstrap uses the
    real final observation instead, folded into the reward while the discount is 0 (the trace is cut).
    ``final_values`` [T, B] holds V(final_obs) where a step was truncated (anything elsewhere).
    """
    done = terminated | truncated
    discounts = gamma * (~done).to(rewards.dtype)
    bootstrap_here = truncated & ~terminated
    return torch.where(bootstrap_here, rewards + gamma * final_values, rewards), discounts


@torch.no_grad()
def vtrace(
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    log_rhos: torch.Tensor,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    lam: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets and policy-gradient advantages (IMPALA, eq. 1 and section 4.2).

    With truncated importance weights ``rho_t = min(rho_bar, pi/mu)`` and ``c_t = lam * min(c_bar, pi/mu)``
    (lambda as in the paper's remark on eq. 1: it scales the trace-cutting coefficients)::

        delta_t   = rho_t * (r_t + gamma_t * V(x_{t+1}) - V(x_t))
        v_s - V(x_s) = delta_s + gamma_s * c_s * (v_{s+1} - V(x_{s+1}))          (recursive form of eq. 1)
        A_s       = rho_s * (r_s + gamma_s * (lam * v_{s+1} + (1 - lam) * V(x_{s+1})) - V(x_s))

    ``V(x_T)`` is ``bootstrap`` and ``v_T = V(x_T)``. The bootstrap of the advantage mixes ``v_{s+1}`` and
    ``V(x_{s+1})`` by lambda (as rlax's ``vtrace_td_error_and_advantage`` does), so that on-policy
    (``log_rhos = 0``, ``rho_bar, c_bar >= 1``) ``A_s`` is exactly GAE(gamma, lam) and ``v_s`` the
    lambda-return; with ``lam = 1`` both are the discounted n-step return to the end of the segment.

    Args: ``values``, ``rewards``, ``discounts``, ``log_rhos`` of shape [T, B]; ``bootstrap`` [B].
    Returns: ``(vs, pg_advantages)``, both [T, B], without gradient (they are targets).
    """
    rhos = torch.exp(log_rhos)
    clipped_rhos = torch.clamp(rhos, max=rho_bar)  # rho_t
    cs = lam * torch.clamp(rhos, max=c_bar)  # c_t
    values_tp1 = torch.cat([values[1:], bootstrap.unsqueeze(0)], dim=0)  # V(x_{t+1})
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)

    vs_minus_v = torch.zeros_like(values)
    acc = torch.zeros_like(bootstrap)  # v_{T} - V(x_T) = 0
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v
    pg_advantages = clipped_rhos * (q_returns(vs, values, bootstrap, rewards, discounts, lam) - values)
    return vs, pg_advantages


@torch.no_grad()
def q_returns(
    vs: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    lam: float = 1.0,
) -> torch.Tensor:
    """The one-step-bootstrapped return of taking a_t at x_t, what every advantage below subtracts from::

        q_t = r_t + gamma_t * (lam * v_{t+1} + (1 - lam) * V(x_{t+1}))          (v_T = V(x_T) = bootstrap)

    ``vtrace``'s advantage is ``rho_t * (q_t - V(x_t))``; the option levels use other baselines
    (``Q(s, o)`` for an intra-option policy, ``V(s, o_prev)`` for the call-and-return choice).
    """
    values_tp1 = torch.cat([values[1:], bootstrap.unsqueeze(0)], dim=0)  # V(x_{t+1})
    vs_tp1 = torch.cat([vs[1:], bootstrap.unsqueeze(0)], dim=0)  # v_{t+1}
    return rewards + discounts * (lam * vs_tp1 + (1.0 - lam) * values_tp1)


def truncated_is(log_rho: torch.Tensor, rho_bar: float) -> torch.Tensor:
    """Truncated importance weight ``min(rho_bar, pi / mu)`` (IMPALA's rho_t), from ``log pi - log mu``."""
    return torch.clamp(torch.exp(log_rho), max=rho_bar)


def ppo_clip_loss(
    logp_new: torch.Tensor, logp_behaviour: torch.Tensor, adv: torch.Tensor, clip: float
) -> torch.Tensor:
    """Per-sample clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised::

        r_t(theta) = pi_theta(a_t|s_t) / mu(a_t|s_t)
        L_t        = -min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps) * A_t)

    The ratio is taken w.r.t. the *behaviour* log-probs ``mu`` the worker recorded, not a learner-side
    "old" policy: in asynchronous PPO the data was produced by whatever version the worker held, and
    the clip keeps the update within ``eps`` of that policy (as in APPO / IMPACT).
    """
    ratio = torch.exp(logp_new - logp_behaviour)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * adv
    return -torch.min(surr1, surr2)


# -- the option levels ------------------------------------------------------------------------------
#
# Notation (Sutton, Precup & Singh 1999; Bacon et al. 2017): o_t the option executing at t, o_{t-1} the
# one before; beta_o(s) its termination probability; pi_Omega(o|s) the policy over options;
# Q(s, o) the option-value critic and V(s) = sum_o pi_Omega(o|s) Q(s, o). A choice at t is made in
# x_t, the state the previous step *arrived in* (its s'), and that is where beta_{o_{t-1}} is evaluated.


def option_value(q: torch.Tensor, option_probs: torch.Tensor) -> torch.Tensor:
    """``V(s) = sum_o p(o) Q(s, o)`` for a distribution ``p`` over options (pi_Omega or pi_hat);
    [..., K] -> [...]."""
    return (q * option_probs).sum(-1)


def dac_high_loss(
    log_pi_hat: torch.Tensor, log_mu_hat: torch.Tensor, adv: torch.Tensor, clip: float
) -> torch.Tensor:
    """DAC's high-MDP term (Zhang & Whiteson 2019, "DAC: The Double Actor-Critic Architecture", sec. 4).

    The high MDP's state is (s_t, o_{t-1}), its action o_t, its policy the call-and-return policy::

        pi_hat(o_t | s_t, o_{t-1}) = (1 - beta_{o_{t-1}}(s_t)) [o_t = o_{t-1}]
                                     + beta_{o_{t-1}}(s_t) pi_Omega(o_t|s_t)
        A^H_t = q_t - V^H(s_t, o_{t-1}),     V^H(s, o_prev) = sum_o pi_hat(o|s, o_prev) Q(s, o)
        L^H_t = PPO-clip(pi_hat / mu_hat, A^H_t)

    Both pi_Omega and beta are learned through pi_hat: no separate termination gradient is needed.
    (The low MDP's term is :func:`ppo_clip_loss` on log pi_{o_t}(a_t|s_t) with A^L_t = q_t - Q(s_t, o_t).)
    """
    return ppo_clip_loss(log_pi_hat, log_mu_hat, adv, clip)


def ppoc_master_loss(log_pi_omega: torch.Tensor, adv: torch.Tensor, is_weight: torch.Tensor) -> torch.Tensor:
    """PPOC's policy over options (Klissarov et al. 2017, "Learnings Options End-to-End for Continuous
    Action Tasks"): a softmax master trained by policy gradient on the steps where an option was picked::

        L^Omega_t = - w_t * A^Omega_t * log pi_Omega(o_t|s_t),    A^Omega_t = q_t - V(s_t)

    ``w_t`` is the truncated importance weight of the (stale) option choice, detached. The caller
    masks out the steps where no option was picked.
    """
    return -(is_weight.detach() * adv.detach() * log_pi_omega)


def ppoc_termination_loss(
    beta_prev: torch.Tensor, q_prev: torch.Tensor, v: torch.Tensor, xi: float
) -> torch.Tensor:
    """The option-critic termination gradient (Bacon et al. 2017, theorem 2) with regulariser xi::

        L^beta_t = beta_{o_{t-1}}(s_t) * (Q(s_t, o_{t-1}) - V(s_t) + xi)

    evaluated at s_t, the state the previous step arrived in (s'). Minimising it raises beta where
    continuing o_{t-1} is worse than the average option, and xi > 0 (~0.01) biases toward longer
    options (Harb et al. 2018's deliberation margin). Q and V are targets here (detached).
    """
    return beta_prev * (q_prev - v + xi).detach()


def epsilon_soft_log_probs(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """The epsilon-soft policy over options (Bacon et al. 2017's epsilon-greedy pi_Omega, in soft form)::

        pi^eps(o|s) = (1 - eps) * softmax(z(s))_o + eps / K,      so  pi^eps(o|s) >= eps / K  for every o

    returned as log-probabilities over the last axis (K = ``logits.shape[-1]``), computed stably as
    ``logaddexp(log(1 - eps) + log_softmax(z), log(eps / K))``. ``eps = 0`` is exactly ``log_softmax(z)``.
    """
    logp = torch.log_softmax(logits, -1)
    if eps <= 0.0:
        return logp
    K = logits.shape[-1]
    return torch.logaddexp(logp + math.log1p(-eps), torch.full_like(logp, math.log(eps / K)))


def epsilon_soft_probs(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """The probabilities of :func:`epsilon_soft_log_probs`: ``(1 - eps) softmax(z) + eps / K``, exactly
    ``softmax(z)`` for eps = 0."""
    p = torch.softmax(logits, -1)
    return p if eps <= 0.0 else (1.0 - eps) * p + eps / logits.shape[-1]


def categorical_entropy_logp(logp: torch.Tensor) -> torch.Tensor:
    """``H = -sum_o p(o) log p(o)`` of a distribution given as log-probabilities over the last axis."""
    return -(logp.exp() * logp).sum(-1)


def termination_prior_loss(termination_logits: torch.Tensor, beta_0: float) -> torch.Tensor:
    """A Gaussian prior on every termination logit, centred on the logit of a target rate ``beta_0``::

        L^prior_t = 1/K * sum_o 1/2 * (logit beta_o(s_t) - logit beta_0)^2

    Why: DAC and PPOC learn terminations only from option-value differences, and the first option
    ahead wins for good: it stops terminating (beta -> 0, picks happen only at episode starts) while
    the others learn to hand over at once (beta -> 1), so they never run long enough to improve. The
    prior keeps every termination near ``beta_0`` (mean duration ~ 1 / beta_0) unless the advantage
    says otherwise, and it pulls on the logit, so a saturated sigmoid still feels it.
    """
    z0 = math.log(beta_0) - math.log1p(-beta_0)
    return 0.5 * ((termination_logits - z0) ** 2).mean(-1)


def option_pull_loss(own_mean: torch.Tensor, own_log_std: torch.Tensor, shared_mean: torch.Tensor,
                     shared_log_std: torch.Tensor) -> torch.Tensor:
    """The KL of every option's own Gaussian to the shared one, averaged over the K options::

        L^pull_t = 1/K * sum_o KL( N(m_o(s_t), sigma_o) || N(mu(s_t), sigma) )

    (``own_mean`` [.., K, A], ``own_log_std`` [K, A], ``shared_mean`` [.., 1, A], ``shared_log_std`` [A];
    diagonal Gaussians, the KL summed over action dimensions.)

    Why: with residual options an option's own head learns from its own steps only, about 1/K of them,
    while the shared head learns from all. Where options do not specialise (Ant-v5: a near-uniform
    master picking again every ~20 steps), the own heads drift apart on the noise of their smaller data,
    and (1 - option_share) of every action mean is that noise. The pull shrinks each own head toward the
    better-estimated shared one, so an option departs from it only where its advantage keeps pushing, as
    Distral's task policies do from their distilled centre (Teh et al. 2017). The caller passes the shared
    head detached: the pull never moves the head that every step trains.
    """
    var_own, var_shared = torch.exp(2 * own_log_std), torch.exp(2 * shared_log_std)
    kl = (shared_log_std - own_log_std + (var_own + (own_mean - shared_mean) ** 2) / (2 * var_shared)
          - 0.5).sum(-1)
    return kl.mean(-1)


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``H = -sum_o p(o) log p(o)`` of a softmax over the last axis."""
    return categorical_entropy_logp(torch.log_softmax(logits, -1))


def distillation_loss(student_mean: torch.Tensor, teacher_mean: torch.Tensor) -> torch.Tensor:
    """OPD's student term: ``L^S_t = mean_i (mu_S(s_t)_i - clip(mu_{o_t}(s_t), low, high)_i)^2``.

    The teacher's mean (the executing option's, clipped to the action bounds by the caller) is a
    target: no gradient reaches the options from the student.
    """
    return ((student_mean - teacher_mean.detach()) ** 2).mean(-1)


def option_loss_weights(option: torch.Tensor, K: int, max_weight: float = 10.0) -> torch.Tensor:
    """Per-sample weights that give every option present in the batch the same total weight::

        share_o = n_o / n,     w_t = min(max_weight, 1 / (K_present * share_{o_t}))   renormalised to mean 1

    so a rarely used option is not starved of gradient by the one the data is full of.
    """
    counts = torch.bincount(option.reshape(-1), minlength=K).to(torch.float32)
    present = (counts > 0).sum().clamp(min=1).to(torch.float32)
    share = counts / counts.sum().clamp(min=1)
    w_opt = torch.where(counts > 0, 1.0 / (present * share.clamp(min=1e-12)), torch.zeros_like(share))
    w = torch.clamp(w_opt, max=max_weight)[option]
    return w / w.mean().clamp(min=1e-12)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum(mask * w * x) / max(1, sum(mask))``: a mean over the steps where a term is defined."""
    m = mask.to(x.dtype)
    if weight is not None:
        m = m * weight
    return (x * m).sum() / mask.to(x.dtype).sum().clamp(min=1.0)


def value_loss(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample squared error to the V-trace target: ``L_t = 1/2 * (V(x_t) - v_t)^2``."""
    return 0.5 * (values - targets) ** 2


def entropy(log_std: torch.Tensor) -> torch.Tensor:
    """Entropy of a diagonal Gaussian, summed over the last (action) axis::

        H = sum_i (1/2 + 1/2 * log(2 pi) + log sigma_i)

    It does not depend on the mean, only on ``log_std`` (shape [..., A]).
    """
    return (0.5 + 0.5 * math.log(2.0 * math.pi) + log_std).sum(-1)


def weighted_mean(x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``mean(w * x)``: per-sample losses times importance weights (prioritized replay, Schaul 2016)."""
    return (x * weight).mean() if weight is not None else x.mean()


def normalize(adv: torch.Tensor, eps: float = 1e-8,
              stats: Optional[Tuple[float, float, float]] = None, scale: bool = True) -> torch.Tensor:
    """``(A - mean A) / (std A + eps)``: per-minibatch advantage normalisation, as PPO implementations do
    (``scale`` False: ``A - mean A`` only, ``learner.adv_norm = "center"``).

    ``stats`` = (mean, unbiased std, count) of a set ``adv`` is part of, used instead of ``adv``'s own: with
    data-parallel learner ranks, every rank's minibatch together (zclaw/learner/distributed.py), so N ranks
    normalise as one learner on their union would. A set of fewer than 2 entries is only centred."""
    if stats is not None:
        mean, std, count = stats
        return adv - mean if count < 2 or not scale else (adv - mean) / (std + eps)
    if adv.numel() < 2 or not scale:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + eps)


def masked_normalize(adv: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8,
                     stats: Optional[Tuple[float, float, float]] = None, scale: bool = True) -> torch.Tensor:
    """:func:`normalize` over the entries where ``mask`` holds (statistics from those only, or ``stats``);
    0 elsewhere."""
    out = torch.zeros_like(adv)
    if bool(mask.any()):
        out[mask] = normalize(adv[mask], eps, stats, scale)
    return out


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """``1 - Var[target - pred] / Var[target]``: 1 is a perfect critic, 0 no better than a constant."""
    var = target.var(unbiased=False)
    if not torch.isfinite(var) or var.item() == 0.0:
        return float("nan")
    return float(1.0 - (target - pred).var(unbiased=False) / var)
