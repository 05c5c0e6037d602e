"""Loss terms against arithmetic done by hand on tiny tensors (T = 3, B = 1 unless stated)."""
from __future__ import annotations

import math

import pytest
import torch

from zclaw.policy import losses

G = 0.9


def col(*xs: float) -> torch.Tensor:
    """A [T, 1] time-major column."""
    return torch.tensor(xs, dtype=torch.float32).unsqueeze(1)


def close(a: torch.Tensor, expected: list) -> None:
    want = torch.tensor(expected, dtype=torch.float32).reshape(a.shape)
    torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-5)


# values V(x_0..2) = 1, 2, 3; V(x_3) = bootstrap = 4; r = 1 every step; gamma = 0.9; no episode end.
V = col(1.0, 2.0, 3.0)
BOOT = torch.tensor([4.0])
R = col(1.0, 1.0, 1.0)
DISC = col(G, G, G)


def test_vtrace_on_policy_lambda_1_is_the_discounted_return() -> None:
    vs, adv = losses.vtrace(V, BOOT, R, DISC, torch.zeros_like(V), 1.0, 1.0, lam=1.0)
    # v_2 = 1 + .9*4 = 4.6 ; v_1 = 1 + .9*4.6 = 5.14 ; v_0 = 1 + .9*5.14 = 5.626
    close(vs, [5.626, 5.14, 4.6])
    # A_t = r_t + gamma v_{t+1} - V_t: 1 + .9*5.14 - 1 = 4.626 ; 1 + .9*4.6 - 2 = 3.14 ; 1 + .9*4 - 3 = 1.6
    close(adv, [4.626, 3.14, 1.6])


def test_vtrace_on_policy_is_gae_and_lambda_return() -> None:
    torch.manual_seed(0)
    T, B, lam = 6, 3, 0.95
    values, boot, rewards = torch.randn(T, B), torch.randn(B), torch.randn(T, B)
    discounts = G * (torch.rand(T, B) > 0.2).float()  # some episode ends
    vs, adv = losses.vtrace(values, boot, rewards, discounts, torch.zeros(T, B), 1.0, 1.0, lam=lam)
    # GAE (Schulman et al. 2016), written out independently
    gae = torch.zeros(T, B)
    acc = torch.zeros(B)
    nxt = boot
    for t in reversed(range(T)):
        delta = rewards[t] + discounts[t] * nxt - values[t]
        acc = delta + discounts[t] * lam * acc
        gae[t] = acc
        nxt = values[t]
    torch.testing.assert_close(adv, gae, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vs, gae + values, atol=1e-5, rtol=1e-5)


def test_vtrace_large_rhos_truncate_to_on_policy() -> None:
    on = losses.vtrace(V, BOOT, R, DISC, torch.zeros_like(V), 1.0, 1.0, lam=1.0)
    off = losses.vtrace(V, BOOT, R, DISC, torch.full_like(V, 5.0), 1.0, 1.0, lam=1.0)  # pi/mu = e^5 ~ 148
    torch.testing.assert_close(on[0], off[0])
    torch.testing.assert_close(on[1], off[1])


def test_vtrace_rho_bar_scales_the_td_errors() -> None:
    vs, adv = losses.vtrace(V, BOOT, R, DISC, torch.full_like(V, 5.0), rho_bar=0.5, c_bar=1.0, lam=1.0)
    # TD errors: 1 + .9*2 - 1 = 1.8 ; 1 + .9*3 - 2 = 1.7 ; 1 + .9*4 - 3 = 1.6 ; times rho = 0.5: .9, .85, .8
    # v_2 - V_2 = .8 ; v_1 - V_1 = .85 + .9*1*.8 = 1.57 ; v_0 - V_0 = .9 + .9*1.57 = 2.313
    close(vs, [3.313, 3.57, 3.8])
    # A = 0.5 * (r + .9 v_{t+1} - V): .5*(1 + .9*3.57 - 1) = 1.6065 ; .5*(1 + .9*3.8 - 2) = 1.21 ; .5*1.6 = .8
    close(adv, [1.6065, 1.21, 0.8])


def test_vtrace_c_bar_cuts_the_trace() -> None:
    vs, adv = losses.vtrace(V, BOOT, R, DISC, torch.full_like(V, 5.0), rho_bar=1.0, c_bar=0.5, lam=1.0)
    # deltas 1.8, 1.7, 1.6 ; c = .5: v_2 - V_2 = 1.6 ; v_1 - V_1 = 1.7 + .9*.5*1.6 = 2.42 ;
    # v_0 - V_0 = 1.8 + .45*2.42
    close(vs, [1 + 1.8 + 0.45 * 2.42, 4.42, 4.6])
    # A = r + .9 v_{t+1} - V: 1 + .9*4.42 - 1 = 3.978 ; 1 + .9*4.6 - 2 = 3.14 ; 1.6
    close(adv, [3.978, 3.14, 1.6])


def test_vtrace_small_rho_is_not_clipped() -> None:
    # log rho = log 0.5 everywhere, lam = 1: rho = c = 0.5 (below both bars)
    vs, _ = losses.vtrace(V, BOOT, R, DISC, torch.full_like(V, math.log(0.5)), 1.0, 1.0, lam=1.0)
    # deltas .9, .85, .8 ; v_2 - V_2 = .8 ; v_1 - V_1 = .85 + .9*.5*.8 = 1.21 ;
    # v_0 - V_0 = .9 + .45*1.21 = 1.4445
    close(vs, [2.4445, 3.21, 3.8])


def test_truncation_bootstraps_from_final_obs_value_and_cuts_the_trace() -> None:
    # episode hits its time limit at t = 1; V(final_obs) = 10; x_2 is the next episode's first state
    term = torch.zeros(3, 1, dtype=torch.bool)
    trunc = torch.tensor([[False], [True], [False]])
    final_v = col(0.0, 10.0, 0.0)
    rewards, discounts = losses.episode_boundaries(R, term, trunc, G, final_v)
    close(rewards, [1.0, 1.0 + 0.9 * 10.0, 1.0])
    close(discounts, [G, 0.0, G])
    vs, adv = losses.vtrace(V, BOOT, rewards, discounts, torch.zeros_like(V), 1.0, 1.0, lam=1.0)
    # v_2 = 1 + .9*4 = 4.6 (new episode) ; v_1 = 1 + .9*10 = 10 (bootstrap, nothing from v_2) ;
    # v_0 = 1 + .9*10 = 10
    close(vs, [10.0, 10.0, 4.6])
    close(adv, [10.0 - 1.0, 10.0 - 2.0, 4.6 - 3.0])


def test_termination_does_not_bootstrap() -> None:
    term = torch.tensor([[False], [True], [False]])
    trunc = torch.tensor([[False], [True], [False]])  # both set (terminal at the limit): terminal wins
    rewards, discounts = losses.episode_boundaries(R, term, trunc, G, col(0.0, 10.0, 0.0))
    close(rewards, [1.0, 1.0, 1.0])
    close(discounts, [G, 0.0, G])
    vs, _ = losses.vtrace(V, BOOT, rewards, discounts, torch.zeros_like(V), 1.0, 1.0, lam=1.0)
    # v_1 = r_1 = 1 (V(terminal) = 0) ; v_0 = 1 + .9*1 = 1.9
    close(vs, [1.9, 1.0, 4.6])


def test_final_values_elsewhere_are_ignored_even_if_not_finite() -> None:
    trunc = torch.zeros(3, 1, dtype=torch.bool)
    rewards, _ = losses.episode_boundaries(R, trunc, trunc, G, col(float("nan"), 5.0, 1.0))
    close(rewards, [1.0, 1.0, 1.0])


def test_ppo_clip_loss_by_hand() -> None:
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    logp_mu = torch.tensor([-1.0, -2.0, 0.3, 0.0])
    loss = losses.ppo_clip_loss(logp_mu + torch.log(ratio), logp_mu, adv, clip=0.2)
    # -min(r A, clip(r, .8, 1.2) A): -min(1.5, 1.2) ; -min(.5, .8) ; -min(-1.1, -1.1) ; -min(-.5, -.8)
    close(loss, [-1.2, -0.5, 1.1, 0.8])


def test_ppo_clip_gradient_vanishes_outside_the_clip() -> None:
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    losses.ppo_clip_loss(logp, torch.zeros(2), torch.tensor([1.0, 1.0]), clip=0.2).sum().backward()
    # ratio 1.5 > 1.2 with A > 0: clipped, no gradient ; ratio 1.1: d(-r)/dlogp = -r = -1.1
    close(logp.grad, [0.0, -1.1])


def test_value_loss_by_hand() -> None:
    close(losses.value_loss(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 0.0])), [0.5, 2.0])


def test_entropy_by_hand_and_against_torch() -> None:
    log_std = torch.tensor([[0.0, -1.0]])
    # (.5 + .5 log 2pi + 0) + (.5 + .5 log 2pi - 1) = log(2 pi)
    close(losses.entropy(log_std), [math.log(2 * math.pi)])
    ref = torch.distributions.Normal(torch.zeros(2), log_std[0].exp()).entropy().sum()
    torch.testing.assert_close(losses.entropy(log_std)[0], ref)


def test_weighted_mean_and_normalize() -> None:
    close(losses.weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 0.0])).reshape(1), [1.0])
    n = losses.normalize(torch.tensor([1.0, 2.0, 3.0]))
    close(n, [-1.0, 0.0, 1.0])  # std (unbiased) of 1, 2, 3 is 1
    # adv_norm = "center": the mean only, so the advantages keep their units (and their smallness)
    close(losses.normalize(torch.tensor([0.01, 0.02, 0.06]), scale=False), [-0.02, -0.01, 0.03])
    close(losses.normalize(torch.tensor([0.01, 0.02, 0.06]), stats=(0.03, 0.5, 3), scale=False),
          [-0.02, -0.01, 0.03])
    mask = torch.tensor([True, True, False])
    close(losses.masked_normalize(torch.tensor([1.0, 3.0, 9.0]), mask, scale=False), [-1.0, 1.0, 0.0])
    assert losses.explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == pytest.approx(1.0)


# -- option-level terms --------------------------------------------------------------------------------

def test_q_returns_and_truncated_is_by_hand() -> None:
    vs, _ = losses.vtrace(V, BOOT, R, DISC, torch.zeros_like(V), 1.0, 1.0, lam=1.0)
    # lam = 1: q_t = r_t + gamma v_{t+1}: 1 + .9*5.14 ; 1 + .9*4.6 ; 1 + .9*4
    close(losses.q_returns(vs, V, BOOT, R, DISC, lam=1.0), [5.626, 5.14, 4.6])
    # lam = 0: q_t = r_t + gamma V(x_{t+1}) = 1 + .9*2, 1 + .9*3, 1 + .9*4
    close(losses.q_returns(vs, V, BOOT, R, DISC, lam=0.0), [2.8, 3.7, 4.6])
    close(losses.truncated_is(torch.log(torch.tensor([0.5, 1.0, 4.0])), 2.0), [0.5, 1.0, 2.0])


def test_option_value_and_dac_high_loss_by_hand() -> None:
    q = torch.tensor([[1.0, 3.0]])
    close(losses.option_value(q, torch.tensor([[0.25, 0.75]])), [2.5])
    lp_mu = torch.log(torch.tensor([0.5]))
    # pi_hat / mu_hat = 0.75 / 0.5 = 1.5 > 1.2 with A = 2 > 0: clipped, -1.2 * 2
    close(losses.dac_high_loss(torch.log(torch.tensor([0.75])), lp_mu, torch.tensor([2.0]), 0.2), [-2.4])


def test_ppoc_master_and_termination_losses_by_hand() -> None:
    log_pi = torch.log(torch.tensor([0.5, 0.25])).requires_grad_()
    loss = losses.ppoc_master_loss(log_pi, torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.5]))
    close(loss.detach(), [-(2.0 * math.log(0.5)), -(-0.5 * math.log(0.25))])
    loss.sum().backward()
    close(log_pi.grad, [-2.0, 0.5])  # d/dlogpi of -w A logpi = -w A
    beta = torch.tensor([0.2, 0.9], requires_grad=True)
    term = losses.ppoc_termination_loss(beta, torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]), xi=0.01)
    close(term.detach(), [0.2 * (1.0 - 2.0 + 0.01), 0.9 * 0.01])
    term.sum().backward()
    close(beta.grad, [-0.99, 0.01])  # continuing o_prev is worse than average: push beta up (negative grad)


def test_categorical_entropy_distillation_and_masks_by_hand() -> None:
    close(losses.categorical_entropy(torch.zeros(1, 4)), [math.log(4.0)])
    close(losses.categorical_entropy(torch.tensor([[0.0, -1e9]])), [0.0])
    teacher = torch.tensor([[1.0, -1.0]], requires_grad=True)
    student = torch.tensor([[0.0, 0.0]], requires_grad=True)
    d = losses.distillation_loss(student, teacher)
    close(d.detach(), [1.0])  # ((0-1)^2 + (0+1)^2) / 2
    d.sum().backward()
    assert teacher.grad is None  # the teacher is a target
    close(student.grad, [[-1.0, 1.0]])
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([True, True, True, False])
    close(losses.masked_mean(x, mask).reshape(1), [2.0])
    close(losses.masked_mean(x, mask, torch.tensor([2.0, 0.0, 1.0, 1.0])).reshape(1), [5.0 / 3.0])
    close(losses.masked_normalize(x, mask), [-1.0, 0.0, 1.0, 0.0])


def test_termination_prior_by_hand_and_it_pulls_every_termination_toward_beta_0() -> None:
    z = torch.tensor([[0.0, math.log(3.0)], [-5.0, 5.0]], requires_grad=True)  # beta = 1/2, 3/4; ~0, ~1
    z0 = math.log(0.05 / 0.95)
    got = losses.termination_prior_loss(z, 0.05)
    want = [0.5 * ((0.0 - z0) ** 2 + (math.log(3.0) - z0) ** 2) / 2,
            0.5 * ((-5.0 - z0) ** 2 + (5.0 - z0) ** 2) / 2]
    close(got, want)
    got.sum().backward()
    # gradient descent lowers every logit above logit(0.05) and raises the one below, saturated or not
    assert (z.grad[0] > 0).all() and z.grad[1, 0] < 0 and z.grad[1, 1] > 0
    assert float(losses.termination_prior_loss(torch.full((3, 4), z0), 0.05).abs().max()) < 1e-12
