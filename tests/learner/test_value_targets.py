"""V-trace targets and advantages are exact on a chain whose values are known in closed form.

The chain: state s in {0, ..., L}; every step moves s -> s + 1 and pays reward 1; reaching L terminates
the episode; a time limit of H steps truncates it (reset to a random start). So under any policy

    V(s) = sum_{k < L - s} gamma^k = (1 - gamma^(L - s)) / (1 - gamma)

ignoring the time limit, which is what a time-limit bootstrap must give. The batch holds two consecutive
segments of the same envs (segment 1 starts where segment 0 ended), so every kind of boundary appears:
a segment edge, terminations (no bootstrap), truncations (bootstrap from ``final_obs``), and steps that are
both terminated and truncated (terminal: no bootstrap).

Observations are ``[s, z]``: the critic used here returns ``V(s) + z``, so ``z`` is the critic's error at
that row. With an exact critic (z = 0) every target equals V and every advantage is 0, for any lambda.
With errors everywhere except at the bootstrap rows (x_T and ``final_obs``), lambda = 1 and on-policy data,
the targets are full returns to the episode's or segment's end and must still equal V exactly: that checks
the recursion, the discount cuts and the bootstrap positions together.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import pytest
import torch
from torch import nn

from zclaw.learner.trainer import Trainer
from support.batches import batch_message, empty_batch, learner_cfg, make_model, spec_of

L, H, GAMMA = 6, 4, 0.9


def true_value(s: np.ndarray) -> np.ndarray:
    return (1.0 - GAMMA ** (L - s)) / (1.0 - GAMMA)


class ChainCritic(nn.Module):
    """Q(x, .) = V(s) + z for x = [s, z] (one option): the closed-form value plus a chosen error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, z = x[..., 0], x[..., 1]
        v = (1.0 - GAMMA ** (L - s)) / (1.0 - GAMMA)
        return (v + z).unsqueeze(-1)


def chain_batch(rng: np.random.Generator, T: int = 7, N: int = 12,
                noise: float = 0.0) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    """Two consecutive segments of N chain envs; returns the batch arrays and V(s_t) per [B, T, N]."""
    B = 2
    a = empty_batch(spec_of(2, 1), B, T, N)
    s = rng.integers(0, L, size=N)
    age = rng.integers(0, H, size=N)  # steps already taken in the current episode
    v_true = np.zeros((B, T, N))
    finals = []
    for b in range(B):
        for t in range(T):
            a["obs"][b, t, :, 0] = s
            v_true[b, t] = true_value(s)
            nxt, age = s + 1, age + 1
            term, trunc = nxt == L, age == H
            a["reward"][b, t] = 1.0
            a["terminated"][b, t], a["truncated"][b, t] = term, trunc
            for n in np.flatnonzero(trunc):
                finals.append(((b, t, n), nxt[n]))  # what the env returned before the autoreset
            done = term | trunc
            s = np.where(done, rng.integers(0, L, size=N), nxt)
            age = np.where(done, 0, age)
        a["obs"][b, T, :, 0] = s  # the bootstrap row: segment b+1's first state
    a["obs"][:, :T, :, 1] = noise * rng.normal(size=(B, T, N))  # the critic's error (none at x_T)
    a["final_at"] = np.array([f[0] for f in finals], np.int32).reshape(-1, 3)
    a["final_obs"] = np.array([[f[1], 0.0] for f in finals], np.float32).reshape(-1, 2)
    return a, v_true


def chain_trainer(lam: float) -> Trainer:
    model = make_model(spec_of(2, 1), hidden=[8], normalize_obs=False)
    model.critic = ChainCritic()
    # raw rewards, untruncated traces: the closed form is in reward units
    return Trainer(model, learner_cfg(gamma=GAMMA, lam=lam, reward_scale="off"), "cpu")


def on_policy(trainer: Trainer, a: Dict[str, np.ndarray]) -> None:
    """Set the behaviour log-probs to the learner's own, so every importance ratio is exactly 1."""
    B, T, N = a["action"].shape[:3]
    x = torch.as_tensor(a["obs"][:, :T]).reshape(-1, 2)
    act = torch.as_tensor(a["action"]).reshape(-1, 1)
    with torch.no_grad():
        logp, _ = trainer._logp(x, torch.zeros(x.shape[0], dtype=torch.long), act)
    a["logp_action"][:] = logp.reshape(B, T, N).numpy()


def time_major(v: np.ndarray) -> torch.Tensor:
    """[B, T, N] -> [T, B*N], the trainer's layout."""
    B, T, N = v.shape
    return torch.as_tensor(v.transpose(1, 0, 2).reshape(T, B * N), dtype=torch.float32)


def test_the_chain_has_every_kind_of_boundary() -> None:
    a, _ = chain_batch(np.random.default_rng(0))
    term, trunc = a["terminated"], a["truncated"]
    assert (term & ~trunc).any() and (trunc & ~term).any() and (term & trunc).any()
    assert len(a["final_at"]) == int(trunc.sum())


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_an_exact_critic_is_its_own_target_at_every_boundary(lam: float) -> None:
    rng = np.random.default_rng(1)
    trainer = chain_trainer(lam)
    a, v_true = chain_batch(rng)
    a["action"][:] = rng.normal(size=a["action"].shape)  # off-policy: TD errors are 0 whatever rho is
    p = trainer.prepare(batch_message(spec_of(2, 1), a), version=0, update_norm=False)
    torch.testing.assert_close(p.values, time_major(v_true), atol=1e-5, rtol=0)
    torch.testing.assert_close(p.vs, time_major(v_true), atol=1e-5, rtol=0)
    torch.testing.assert_close(p.adv, torch.zeros_like(p.adv), atol=1e-5, rtol=0)


def test_full_returns_equal_the_closed_form_despite_a_wrong_critic_in_between() -> None:
    rng = np.random.default_rng(2)
    trainer = chain_trainer(lam=1.0)
    a, v_true = chain_batch(rng, noise=3.0)
    a["action"][:] = rng.normal(size=a["action"].shape)
    on_policy(trainer, a)
    p = trainer.prepare(batch_message(spec_of(2, 1), a), version=0, update_norm=False)
    assert float(p.log_rhos.abs().max()) == 0.0
    assert float((p.values - time_major(v_true)).abs().max()) > 1.0  # the critic is really wrong
    torch.testing.assert_close(p.vs, time_major(v_true), atol=1e-4, rtol=0)
    # the advantage is the return minus the (wrong) value: exactly minus the critic's error z
    z = time_major(a["obs"][:, :-1, :, 1])
    torch.testing.assert_close(p.adv, -z, atol=1e-4, rtol=0)


def test_a_wrong_bootstrap_would_be_seen() -> None:
    """The same check fails when the truncation is treated as a termination: the test has teeth."""
    rng = np.random.default_rng(3)
    trainer = chain_trainer(lam=1.0)
    a, v_true = chain_batch(rng)
    a["terminated"] |= a["truncated"]
    p = trainer.prepare(batch_message(spec_of(2, 1), a), version=0, update_norm=False)
    assert float((p.vs - time_major(v_true)).abs().max()) > 0.5
