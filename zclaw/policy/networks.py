"""The option policy network: policy over options, K intra-option Gaussians, K terminations, Q(s, .),
and the flat Gaussian student distilled from them (:meth:`OptionPolicy.student_act`, for deployment).

One module holds every head so that the learner trains it and a worker acts with it from the same
weights message. With ``options = 1`` the master and termination heads are inert (log pi_Omega = 0,
the single option never needs to terminate) and the model is a plain Gaussian actor-critic, which is
what makes K = 1 exactly the asynchronous PPO baseline.

The policy over options is epsilon-soft (``PolicyConfig.option_epsilon``; Bacon et al. 2017 pick
options epsilon-greedily, this is the differentiable form)::

    pi_Omega(o|s) = (1 - eps) softmax(z(s))_o + eps / K

so every option is picked with probability at least eps / K whatever the master's logits z say, and no
option is starved of data. It is the one distribution used everywhere: sampling and the recorded
behaviour log-prob here, pi_hat below, the learner's option-level losses and entropies
(:meth:`OptionPolicy.log_master`). eps = 0 is the plain softmax; the deterministic choice is its argmax
either way (the mixture is monotone in the softmax).

With ``PolicyConfig.option_residual`` (K > 1) the intra-option Gaussians share part of their parameters:
``mu_o(s) = s mu(s) + (1 - s) m_o(s)`` and ``log sigma_o = s log sigma + (1 - s) l_o``, the shared head
being a (K+1)-th output of ``actor`` and ``shared_log_std``, ``s = PolicyConfig.option_share`` (0.9 in
the default config; 0.5, the even average, where a header leaves it out). Every step trains the shared
part, so an option the master seldom picks still acts about as well as the others; without it the first
option ahead takes all the data and the rest are abandoned untrained (docs/learning.md, "When one option
takes all the usage"). The larger s, the more of each option's controller learns from every step and the
less an option can differ from the others. ``PolicyConfig.critic_residual`` does the same for the option
values, ``Q(s, o) = s V(s) + (1 - s) q_o(s)`` with the shared value V a (K+1)-th output of ``critic``: where
options do not specialise, K independent outputs each learn Q from the steps of one option only.

Call-and-return execution (Sutton, Precup & Singh 1999), as :meth:`OptionPolicy.act` runs it:
at an episode start pick o ~ pi_Omega(.|s); otherwise keep o_prev unless its termination
beta_{o_prev}(s) fires, evaluated at the *current* state s (the s' of the previous step), and then pick
again. The recorded option log-prob is that of the call-and-return policy
pi_hat(o|s, o_prev) = (1 - beta)[o = o_prev] + beta pi_Omega(o|s) (DAC, Zhang & Whiteson 2019).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import math
import numpy as np
import torch
from torch import nn

from .losses import epsilon_soft_log_probs, epsilon_soft_probs
from .normalizer import RunningNorm
from .stacked import StackedMLPs, sample_index

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def mlp(sizes: Sequence[int], activation: str, out_gain: float = 1.0) -> nn.Sequential:
    """An MLP with orthogonal init (sqrt(2) hidden gain, ``out_gain`` on the last layer), as in PPO."""
    layers: List[nn.Module] = []
    for i in range(len(sizes) - 1):
        lin = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, out_gain if last else math.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers.append(lin)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class PolicyConfig:
    """Architecture: everything needed to rebuild the network from a weights message."""

    obs_dim: int
    act_dim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"
    options: int = 1
    init_log_std: float = -0.5
    normalize_obs: bool = True
    obs_clip: float = 10.0
    # epsilon of the epsilon-soft policy over options (module docstring); 0: plain softmax. Part of the
    # architecture so that workers (sampling, behaviour log-probs) and the learner (losses) always agree.
    option_epsilon: float = 0.0
    # K > 1: intra-option policies as one shared Gaussian plus a residual per option (module docstring)
    option_residual: bool = False
    # with option_residual: the shared head's weight s in mu_o = s mu + (1 - s) m_o (module docstring)
    option_share: float = 0.5
    # with option_residual: Q(s, o) = s V(s) + (1 - s) q_o(s) as well (module docstring)
    critic_residual: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.option_epsilon) < 1.0:
            raise ValueError(f"option_epsilon = {self.option_epsilon!r} is not allowed: "
                             "expected 0 <= eps < 1")
        if not 0.0 < float(self.option_share) < 1.0:
            raise ValueError(f"option_share = {self.option_share!r} is not allowed: expected 0 < s < 1")

    def to_dict(self) -> Dict[str, Any]:
        """The ``policy`` header of a weights message (docs/protocol.md, "The policy map").

        ``option_share`` is written only when it is not 0.5, the value its absence means: a network with
        the even average stays readable by workers from before the key, and one they cannot evaluate
        carries a key they refuse instead of being acted on with the wrong means."""
        d = {
            "obs_dim": self.obs_dim, "act_dim": self.act_dim, "hidden": list(self.hidden),
            "activation": self.activation, "options": self.options, "init_log_std": self.init_log_std,
            "normalize_obs": self.normalize_obs, "obs_clip": self.obs_clip,
            "option_epsilon": self.option_epsilon, "option_residual": self.option_residual,
        }
        if float(self.option_share) != 0.5:
            d["option_share"] = float(self.option_share)
        if self.critic_residual:
            d["critic_residual"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyConfig":
        """The inverse of :meth:`to_dict`; dicts written before ``option_epsilon`` existed (old checkpoints
        and weights headers) mean a plain softmax master, eps = 0; without ``option_residual``, independent
        option heads; without ``option_share``, the even average (s = 0.5) residual options had before it;
        without ``critic_residual``, K independent value outputs."""
        d = dict(d)
        d["hidden"] = tuple(d["hidden"])
        d["option_epsilon"] = float(d.get("option_epsilon", 0.0))
        d["option_residual"] = bool(d.get("option_residual", False))
        d["option_share"] = float(d.get("option_share", 0.5))
        d["critic_residual"] = bool(d.get("critic_residual", False))
        return cls(**d)


class OptionPolicy(nn.Module):
    """pi_Omega(o|s), pi_o(a|s) (Gaussian), beta_o(s) (sigmoid) and Q(s, o) for K options."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        K, A, H = cfg.options, cfg.act_dim, list(cfg.hidden)
        self.K, self.A = K, A
        self.obs_norm = RunningNorm((cfg.obs_dim,), clip=cfg.obs_clip, enabled=cfg.normalize_obs)
        self.residual = K > 1 and bool(cfg.option_residual)
        self.share = float(cfg.option_share)  # the shared head's weight, with residual options
        self.critic_residual = self.residual and bool(cfg.critic_residual)
        # the intra-option means (plus, with residual options, the shared mean as a (K+1)-th head)
        self.actor = mlp([cfg.obs_dim] + H + [(K + self.residual) * A], cfg.activation, out_gain=0.01)
        # per-option log std; with residual options the option's half of the mean with ``shared_log_std``
        self.log_std = nn.Parameter(torch.full((K, A), float(cfg.init_log_std)))
        if self.residual:
            self.shared_log_std = nn.Parameter(torch.full((A,), float(cfg.init_log_std)))
        # Q(s, .), plus, with a residual critic, the shared value V(s) as a (K+1)-th output
        self.critic = mlp([cfg.obs_dim] + H + [K + self.critic_residual], cfg.activation, out_gain=1.0)
        self.master = mlp([cfg.obs_dim] + H + [K], cfg.activation, out_gain=0.01)
        self.termination = mlp([cfg.obs_dim] + H + [K], cfg.activation, out_gain=0.01)
        # the flat student pi_S(a|s): its own body, distilled from the executing option's mean
        self.student = mlp([cfg.obs_dim] + H + [A], cfg.activation, out_gain=0.01)
        self.student_log_std = nn.Parameter(torch.full((A,), float(cfg.init_log_std)))
        # act()'s actor, master and termination as one network (K > 1; built on first use, stacked.py)
        self._acting_heads: Optional[StackedMLPs] = None

    # -- heads on normalised observations ------------------------------------------------------
    def with_shared(self, own: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """``(1 - s) own + s shared``, s = ``option_share``: how residual options mix an option's own part
        with the shared one (means, log stds and, with a residual critic, values)."""
        return (1 - self.share) * own + self.share * shared

    def action_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Intra-option means [.., K, A]: ``mu_o(s)``, or with residual options the weighted average of the
        shared head and the option's own, ``s mu(s) + (1 - s) m_o(s)``.

        An average (weights summing to one), not the sum: Adam moves every parameter by about the
        learning rate whatever its gradient, so a sum of two heads would move an option's mean twice as
        fast as a single head does; the average keeps K > 1 at K = 1's effective step size.
        """
        return self.means_of(self.actor(x))

    def means_of(self, actor_out: torch.Tensor) -> torch.Tensor:
        """:meth:`action_mean` from the actor's raw output [.., (K + residual) * A]."""
        if not self.residual:
            return actor_out.reshape(actor_out.shape[:-1] + (self.K, self.A))
        return self.with_shared(*self.residual_heads(actor_out))

    def actor_features(self, x: torch.Tensor) -> torch.Tensor:
        """The actor's last hidden layer: ``actor(x) == actor_output(actor_features(x))``."""
        return self.actor[:-1](x)

    def actor_output(self, features: torch.Tensor) -> torch.Tensor:
        """The actor's output layer on :meth:`actor_features`: every head's mean, [.., (K + residual) * A]."""
        return self.actor[-1](features)

    def residual_heads(self, actor_out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Residual options: the options' own means m_o [.., K, A] and the shared mean mu [.., 1, A] from
        the actor's raw output."""
        heads = actor_out.reshape(actor_out.shape[:-1] + (self.K + 1, self.A))
        return heads[..., : self.K, :], heads[..., self.K :, :]

    def option_log_std(self) -> torch.Tensor:
        """Intra-option log standard deviations [K, A]: ``log sigma_o``, or ``s log sigma + (1 - s) l_o``."""
        if not self.residual:
            return self.log_std
        return self.with_shared(self.log_std, self.shared_log_std)

    def q(self, x: torch.Tensor) -> torch.Tensor:
        """The option values Q(s, .) [.., K]: the critic's outputs, or with a residual critic the weighted
        average ``s V(s) + (1 - s) q_o(s)`` of the shared value and the option's own output.

        A convex combination, as for the means: PopArt rescales every output of the critic's last layer by
        the same affine map, which an average of its outputs passes through unchanged."""
        out = self.critic(x)
        if not self.critic_residual:
            return out
        return self.with_shared(out[..., : self.K], out[..., self.K :])

    def master_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The master's raw logits z(s); the policy over options is :meth:`log_master`, not their softmax."""
        return self.master(x)

    def log_master(self, x: torch.Tensor) -> torch.Tensor:
        """log pi_Omega(.|s) = log[(1 - eps) softmax(z(s)) + eps / K], the epsilon-soft policy over options
        (exactly ``log_softmax(z)`` for eps = 0)."""
        return epsilon_soft_log_probs(self.master_logits(x), float(self.cfg.option_epsilon))

    def master_probs(self, x: torch.Tensor) -> torch.Tensor:
        """pi_Omega(.|s) itself, the probabilities of :meth:`log_master` (exactly
        ``softmax(z)`` for eps = 0)."""
        return epsilon_soft_probs(self.master_logits(x), float(self.cfg.option_epsilon))

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.termination(x))

    @staticmethod
    def gaussian_logp(a: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        var = torch.exp(2 * log_std)
        return (-((a - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def gaussian_entropy(self, option: torch.Tensor) -> torch.Tensor:
        return (0.5 + 0.5 * math.log(2 * math.pi) + self.option_log_std()[option]).sum(-1)

    def call_and_return_logits(self, x: torch.Tensor, prev_option: torch.Tensor,
                               start: torch.Tensor) -> torch.Tensor:
        """log pi_hat(.|s, o_prev) = log[(1 - beta_{o_prev}(s)) [o = o_prev] + beta_{o_prev}(s)
        pi_Omega(o|s)].

        ``x`` is the state the choice is made in, i.e. the s' reached by the previous step: the
        termination of the option that was running is evaluated there (not at the state it started
        from, the bug of the widely copied option-critic port). At an episode start (``start``)
        beta = 1: always pick afresh. pi_Omega is the epsilon-soft :meth:`log_master`. For K = 1 the
        single option has probability 1 (log = 0).
        """
        log_master = self.log_master(x)
        if self.K == 1:
            return torch.zeros_like(log_master)
        prev = prev_option.clamp(0, self.K - 1)
        beta = self.beta(x).gather(-1, prev.unsqueeze(-1)).squeeze(-1)
        return self.mix_call_and_return(log_master, beta, prev, start)

    def mix_call_and_return(
        self, log_master: torch.Tensor, beta_prev: torch.Tensor, prev: torch.Tensor, start: torch.Tensor
    ) -> torch.Tensor:
        """The formula of :meth:`call_and_return_logits` from heads already evaluated (``prev`` in range;
        ``log_master`` is :meth:`log_master`, the epsilon-soft log pi_Omega)."""
        beta = torch.where(start, torch.ones_like(beta_prev), beta_prev)
        stay = torch.nn.functional.one_hot(prev, self.K).to(log_master.dtype)
        probs = (1 - beta).unsqueeze(-1) * stay + beta.unsqueeze(-1) * log_master.exp()
        return torch.log(probs.clamp(min=1e-12))

    def option_mean(self, x: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        """The mean action [.., A] of the given option (one per row)."""
        return self.mean_of_option(self.action_mean(x), option)

    def mean_of_option(self, means: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s mean [.., A] of option ``option[i]`` from every option's means [.., K, A]."""
        idx = option.reshape(option.shape + (1, 1)).expand(option.shape + (1, self.A))
        return means.gather(-2, idx).squeeze(-2)

    # -- acting ------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, prev_option: torch.Tensor, episode_start: torch.Tensor,
        deterministic: bool = False
    ) -> Dict[str, torch.Tensor]:
        """One call-and-return step for a batch of envs; returns what a segment records.

        The termination b ~ Bernoulli(beta_{o_prev}(s)) is drawn explicitly (deterministic: beta > 1/2),
        then o ~ pi_Omega(.|s) (the epsilon-soft :meth:`log_master`; deterministic: its argmax, which is
        the softmax's) if b fired or the episode starts, else o = o_prev. ``option_start`` is exactly
        "b fired or episode start" (a fresh pick, which may pick o_prev again); the recorded
        ``logp_option`` is the marginal log pi_hat(o|s, o_prev) of the choice, the behaviour log-prob
        that DAC's high-level PPO ratio needs.
        """
        x = self.obs_norm(obs)
        n = obs.shape[0]
        if self.K == 1:
            option = torch.zeros(n, dtype=torch.long, device=obs.device)
            logp_option = torch.zeros(n, device=obs.device)
            option_start = episode_start.clone()
            means = self.action_mean(x)
        else:
            if self._acting_heads is None:
                self._acting_heads = StackedMLPs([self.actor, self.master, self.termination])
            actor_out, master_logits, termination_logits = self._acting_heads(x)  # one pass for the three
            means = self.means_of(actor_out)
            prev = prev_option.clamp(0, self.K - 1)
            log_master = epsilon_soft_log_probs(master_logits, float(self.cfg.option_epsilon))
            beta = torch.sigmoid(termination_logits.gather(-1, prev.unsqueeze(-1)).squeeze(-1))
            if deterministic:
                fired, picked = beta > 0.5, log_master.argmax(-1)
            else:
                fired = torch.rand_like(beta) < beta
                picked = sample_index(log_master.exp())
            option_start = episode_start | fired
            option = torch.where(option_start, picked, prev)
            logits = self.mix_call_and_return(log_master, beta, prev, episode_start)
            logp_option = logits.gather(-1, option.unsqueeze(-1)).squeeze(-1)
        mean = self.mean_of_option(means, option)
        log_std = self.option_log_std()[option]
        action = mean if deterministic else mean + torch.randn_like(mean) * log_std.exp()
        return {
            "action": action,
            "logp_action": self.gaussian_logp(action, mean, log_std),
            "option": option,
            "option_start": option_start,
            "logp_option": logp_option,
        }

    def student_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The student's mean action [.., A] on *normalised* observations."""
        return self.student(x)

    @torch.no_grad()
    def student_act(self, obs: torch.Tensor) -> torch.Tensor:
        """The student's deterministic action (its mean) for RAW observations [N, obs_dim].

        Normalises with the same running statistics as the teacher; clipping to the action bounds is
        the caller's job (as for :meth:`act`).
        """
        return self.student_mean(self.obs_norm(obs))

    # -- weights on the wire -----------------------------------------------------------------------
    def weight_arrays(self) -> Dict[str, np.ndarray]:
        """Every parameter and buffer as a float32/float64 numpy array, keyed by state-dict name."""
        return {k: v.detach().cpu().numpy() for k, v in self.state_dict().items()}

    def load_weight_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load arrays produced by :meth:`weight_arrays`; raises ValueError if names or shapes differ."""
        own = self.state_dict()
        if set(arrays) != set(own):
            raise ValueError(f"weights do not match the network: {sorted(set(arrays) ^ set(own))[:5]}")
        new = {}
        for k, v in own.items():
            a = arrays[k]
            if tuple(a.shape) != tuple(v.shape):
                raise ValueError(f"weights {k}: shape {list(a.shape)}, network has {list(v.shape)}")
            new[k] = torch.from_numpy(np.array(a)).to(dtype=v.dtype)  # dtype from the tensor: no device copy
        self.load_state_dict(new)
