"""The option policy network: policy over options, K intra-option Gaussians, K terminations, Q(s, .).

One module holds every head so that the learner trains it and a worker acts with it from the same
weights message. With ``options = 1`` the master and termination heads are inert (log pi_Omega = 0,
the single option never needs to terminate) and the model is a plain Gaussian actor-critic, which is
what makes K = 1 exactly the asynchronous PPO baseline.

Call-and-return execution (Sutton, Precup & Singh 1999), as :meth:`OptionPolicy.act` runs it:
at an episode start pick o ~ pi_Omega(.|s); otherwise keep o_prev unless its termination
beta_{o_prev}(s) fires, evaluated at the *current* state s (the s' of the previous step), and then pick
again. The recorded option log-prob is that of the call-and-return policy
pi_hat(o|s, o_prev) = (1 - beta)[o = o_prev] + beta pi_Omega(o|s) (DAC, Zhang & Whiteson 2019).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import math
import numpy as np
import torch
from torch import nn

from .normalizer import RunningNorm

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

    def to_dict(self) -> Dict[str, Any]:
        return {
            "obs_dim": self.obs_dim, "act_dim": self.act_dim, "hidden": list(self.hidden),
            "activation": self.activation, "options": self.options, "init_log_std": self.init_log_std,
            "normalize_obs": self.normalize_obs, "obs_clip": self.obs_clip,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PolicyConfig":
        d = dict(d)
        d["hidden"] = tuple(d["hidden"])
        return cls(**d)


class OptionPolicy(nn.Module):
    """pi_Omega(o|s), pi_o(a|s) (Gaussian), beta_o(s) (sigmoid) and Q(s, o) for K options."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        K, A, H = cfg.options, cfg.act_dim, list(cfg.hidden)
        self.K, self.A = K, A
        self.obs_norm = RunningNorm((cfg.obs_dim,), clip=cfg.obs_clip, enabled=cfg.normalize_obs)
        self.actor = mlp([cfg.obs_dim] + H + [K * A], cfg.activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((K, A), float(cfg.init_log_std)))
        self.critic = mlp([cfg.obs_dim] + H + [K], cfg.activation, out_gain=1.0)
        self.master = mlp([cfg.obs_dim] + H + [K], cfg.activation, out_gain=0.01)
        self.termination = mlp([cfg.obs_dim] + H + [K], cfg.activation, out_gain=0.01)

    # -- heads on normalised observations ------------------------------------------------------
    def action_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Intra-option means [.., K, A]."""
        return self.actor(x).reshape(x.shape[:-1] + (self.K, self.A))

    def q(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def master_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.master(x)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.termination(x))

    @staticmethod
    def gaussian_logp(a: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        var = torch.exp(2 * log_std)
        return (-((a - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def gaussian_entropy(self, option: torch.Tensor) -> torch.Tensor:
        return (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std[option]).sum(-1)

    def call_and_return_logits(self, x: torch.Tensor, prev_option: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """log pi_hat(.|s, o_prev): stay with o_prev w.p. 1 - beta, else re-pick from pi_Omega."""
        log_master = torch.log_softmax(self.master_logits(x), -1)
        if self.K == 1:
            return torch.zeros_like(log_master)
        beta = self.beta(x).gather(-1, prev_option.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        beta = torch.where(start, torch.ones_like(beta), beta)
        stay = torch.nn.functional.one_hot(prev_option.clamp(min=0), self.K).to(x.dtype)
        probs = (1 - beta).unsqueeze(-1) * stay + beta.unsqueeze(-1) * log_master.exp()
        return torch.log(probs.clamp(min=1e-12))

    # -- acting ------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, prev_option: torch.Tensor, episode_start: torch.Tensor, deterministic: bool = False
    ) -> Dict[str, torch.Tensor]:
        """One call-and-return step for a batch of envs; returns what a segment records."""
        x = self.obs_norm(obs)
        if self.K == 1:
            option = torch.zeros(obs.shape[0], dtype=torch.long, device=obs.device)
            logp_option = torch.zeros(obs.shape[0], device=obs.device)
            option_start = episode_start.clone()
        else:
            logits = self.call_and_return_logits(x, prev_option, episode_start)
            option = logits.argmax(-1) if deterministic else torch.distributions.Categorical(logits=logits).sample()
            logp_option = logits.gather(-1, option.unsqueeze(-1)).squeeze(-1)
            option_start = episode_start | (option != prev_option)
        mean = self.action_mean(x).gather(-2, option.view(-1, 1, 1).expand(-1, 1, self.A)).squeeze(-2)
        log_std = self.log_std[option]
        action = mean if deterministic else mean + torch.randn_like(mean) * log_std.exp()
        return {
            "action": action,
            "logp_action": self.gaussian_logp(action, mean, log_std),
            "option": option,
            "option_start": option_start,
            "logp_option": logp_option,
        }

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
            new[k] = torch.from_numpy(np.array(a, dtype=v.detach().cpu().numpy().dtype))
        self.load_state_dict(new)
