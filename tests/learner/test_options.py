"""The option learner: K = 1 is exactly PPO, terminations at s', truncated importance weights,
call-and-return acting, DAC / PPOC terms, the student, per-option weights and lag, option health."""
from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import torch

from zclaw import config
from zclaw.learner import checkpoint as ckpt
from zclaw.learner.trainer import PreparedBatch, Trainer
from zclaw.policy import losses
from zclaw.policy.health import OptionHealth
from zclaw.policy.networks import OptionPolicy, PolicyConfig
from zclaw.policy.weights import model_from_weights, weights_message
from zclaw.wire import unpack, parse

from support.batches import bandit_batch, batch_message, empty_batch, learner_cfg, make_model, spec_of


def random_batch(spec, rng, B=2, T=6, N=3, K=1, version=0) -> Dict[str, np.ndarray]:
    a = empty_batch(spec, B, T, N, version)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["action"][:] = rng.normal(size=a["action"].shape) * 0.5
    a["reward"][:] = rng.normal(size=a["reward"].shape)
    a["terminated"][:, 3, 0] = True
    a["option"][:] = rng.integers(0, K, size=a["option"].shape)
    a["option_start"][:] = rng.random(size=a["option_start"].shape) < 0.3
    a["option_start"][:, 4, 0] = True  # the step after the episode end picks
    a["logp_action"][:] = -1.5 + rng.normal(size=a["logp_action"].shape) * 0.1
    a["logp_option"][:] = np.log(1.0 / K) if K > 1 else 0.0
    return a


# -- K = 1 is the existing asynchronous PPO learner ---------------------------------------------------

def reference_ppo_update(model: OptionPolicy, opt: torch.optim.Optimizer, p: PreparedBatch,
                         c: dict) -> Dict[str, float]:
    """The flat asynchronous-PPO update as the learner did it before options existed (V-trace
    advantages, PPO-clip, value loss, Gaussian entropy), written out independently of the Trainer."""
    T = p.values.shape[0]
    S = p.values.numel()
    x = p.x[:T].reshape(S, -1)
    act = p.action.reshape(S, -1)
    mu = p.logp_mu.reshape(S)
    adv_all = p.adv.reshape(S)
    vs = p.vs.reshape(S)
    w = p.weight.reshape(S)
    out = {"policy": 0.0, "value": 0.0}
    n = 0
    for _ in range(c["epochs"]):
        perm = torch.randperm(S)
        for idx in torch.chunk(perm, c["minibatches"]):
            mean = model.actor(x[idx])  # K = 1: the actor's output is option 0's mean
            log_std = model.log_std[0].expand_as(mean)
            logp = torch.distributions.Normal(mean, log_std.exp()).log_prob(act[idx]).sum(-1)
            a = adv_all[idx]
            a = (a - a.mean()) / (a.std() + 1e-8)
            ratio = torch.exp(logp - mu[idx])
            pg = (-torch.min(ratio * a, ratio.clamp(1 - c["clip"], 1 + c["clip"]) * a) * w[idx]).mean()
            v = model.critic(x[idx])[:, 0]
            vl = (0.5 * (v - vs[idx]) ** 2 * w[idx]).mean()
            ent = ((0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum(-1) * w[idx]).mean()
            loss = pg + c["vf_coef"] * vl - c["ent_coef"] * ent
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.grad is not None],
                                           c["max_grad_norm"])
            opt.step()
            out["policy"] += float(pg.detach())
            out["value"] += float(vl.detach())
            n += 1
    return {k: v / n for k, v in out.items()}


@pytest.mark.parametrize("mode, eps", [("dac", 0.0), ("ppoc", 0.0), ("dac", 0.3), ("ppoc", 0.3)])
def test_k1_is_exactly_flat_ppo_same_losses_and_parameters(mode: str, eps: float) -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    spec = spec_of(3, 2)
    model = make_model(spec, hidden=[16], options=1)
    # an epsilon-soft master (forced into the architecture; policy_config drops it for K = 1) changes nothing
    if eps:
        model = OptionPolicy(replace(model.cfg, option_epsilon=eps))
    ref = copy.deepcopy(model)
    # target_kl off: the equivalence is of the losses and the step, not of the early-stopping rule
    # reward_scale off: the reference below predates it (tests/learner/test_reward_scale.py covers the scaler)
    c = learner_cfg(epochs=2, minibatches=3, ent_coef=0.01, mode=mode, target_kl=0.0, master_ent_coef=0.1,
                    reward_scale="off",
                    termination_coef=1.0, deliberation_cost=0.5, option_weights=True)
    trainer = Trainer(model, c, "cpu")
    a = random_batch(spec, rng, K=1, version=3)
    msg = batch_message(spec, a)
    ref.obs_norm.update(torch.as_tensor(a["obs"][:, :-1]).reshape(-1, 3))  # what prepare() does first
    with torch.no_grad():  # the targets from the reference network (no option terms anywhere)
        p_ref = Trainer(copy.deepcopy(ref), c, "cpu").prepare(msg, 4, update_norm=False)
    # the option-level advantages vanish and the intra-option advantage is V-trace's
    vs, pg_adv = losses.vtrace(p_ref.values, p_ref.bootstrap, p_ref.rewards, p_ref.discounts,
                               p_ref.log_rhos, 1.0, 1.0, lam=c["lam"])
    torch.testing.assert_close(p_ref.adv, pg_adv)
    assert float(p_ref.log_rho_option.abs().max()) == 0.0

    main = [q for n, q in ref.named_parameters() if not n.startswith("student")]
    opt = torch.optim.Adam(main, lr=c["lr"], eps=1e-5)
    torch.manual_seed(7)
    m = trainer.update(msg, 4)
    torch.manual_seed(7)
    r = reference_ppo_update(ref, opt, p_ref, c)
    assert m["loss/policy"] == pytest.approx(r["policy"], abs=1e-6)
    assert m["loss/value"] == pytest.approx(r["value"], abs=1e-6)
    assert m["loss/master"] == 0.0 and m["loss/termination"] == 0.0
    for (name, p0), p1 in zip(model.named_parameters(), ref.parameters()):
        if not name.startswith("student"):
            torch.testing.assert_close(p0, p1, atol=1e-6, rtol=1e-5, msg=name)


# -- call-and-return: the policy pi_hat, and acting with it ------------------------------------------

def two_option_model(spec, beta_bias=(0.0, 0.0), master_bias=(0.0, 0.0), obs_term_weight: float = 0.0,
                     epsilon: float = 0.0) -> OptionPolicy:
    """K = 2 with hand-set heads: beta_o(s) = sigmoid(bias_o + weight * s_0), pi_Omega = softmax(bias)
    (mixed with the uniform distribution by ``epsilon``, 0 here unless asked)."""
    model = make_model(spec, hidden=[8], options=2, normalize_obs=False, option_epsilon=epsilon)
    with torch.no_grad():
        for head, bias in ((model.termination, beta_bias), (model.master, master_bias)):
            for layer in head:
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.zero_()
                    layer.bias.zero_()
            head[-1].bias.copy_(torch.tensor(bias))
        if obs_term_weight:
            # route s_0 through the hidden tanh layer: h_0 = tanh(s_0), out_o += weight * h_0
            model.termination[0].weight[0, 0] = 1.0
            model.termination[-1].weight[:, 0] = obs_term_weight
    return model


def test_call_and_return_probabilities_by_hand() -> None:
    spec = spec_of(2, 1)
    # beta = sigmoid(0) = 1/2 for both options, pi_Omega = softmax(log 3, 0) = (3/4, 1/4)
    model = two_option_model(spec, master_bias=(math.log(3.0), 0.0))
    x = torch.zeros(3, 2)
    prev = torch.tensor([0, 1, 1])
    start = torch.tensor([False, False, True])
    p = model.call_and_return_logits(x, prev, start).exp()
    # stay with 0: 1/2 + 1/2 * 3/4 = 7/8 ; switch to 1: 1/2 * 1/4 = 1/8
    # prev 1: to 0: 1/2 * 3/4 = 3/8 ; stay: 1/2 + 1/2 * 1/4 = 5/8 ; episode start: pi_Omega itself
    torch.testing.assert_close(p, torch.tensor([[7 / 8, 1 / 8], [3 / 8, 5 / 8], [3 / 4, 1 / 4]]))


def test_act_keeps_the_option_until_its_termination_fires_and_always_picks_at_episode_start() -> None:
    torch.manual_seed(0)
    spec = spec_of(2, 1)
    n = 512
    obs = torch.randn(n, 2)
    # option 0 never terminates, option 1 always does; the master always picks option 0
    model = two_option_model(spec, beta_bias=(-30.0, 30.0), master_bias=(30.0, -30.0))
    prev = torch.tensor([0, 1] * (n // 2))
    out = model.act(obs, prev, torch.zeros(n, dtype=torch.bool))
    assert torch.equal(out["option"], torch.zeros(n, dtype=torch.long))  # 0 kept, 1 terminated -> picks 0
    assert torch.equal(out["option_start"], prev == 1)
    torch.testing.assert_close(out["logp_option"], torch.zeros(n), atol=1e-6, rtol=0)  # log pi_hat = log 1
    # at an episode start the master picks, even though option 1 "would never" be kept and 0 never ends
    model2 = two_option_model(spec, beta_bias=(-30.0, -30.0), master_bias=(-30.0, 30.0))
    out2 = model2.act(obs, torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool))
    assert torch.equal(out2["option"], torch.ones(n, dtype=torch.long)) and bool(out2["option_start"].all())
    out3 = model2.act(obs, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool))
    assert (torch.equal(out3["option"], torch.zeros(n, dtype=torch.long))
            and not bool(out3["option_start"].any()))
    # beta = 1/2: about half of the steps pick afresh; the recorded log-prob is pi_hat's
    model4 = two_option_model(spec, master_bias=(0.0, 0.0))
    out4 = model4.act(obs, prev, torch.zeros(n, dtype=torch.bool))
    assert 0.4 < float(out4["option_start"].float().mean()) < 0.6
    assert not bool((out4["option"] != prev)[~out4["option_start"]].any())  # no switch without a pick
    want = model4.call_and_return_logits(obs, prev, torch.zeros(n, dtype=torch.bool)).gather(
        -1, out4["option"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out4["logp_option"], want)


def test_termination_is_evaluated_at_the_next_state() -> None:
    """Step t's choice uses beta_{o_{t-1}}(x_t), x_t being the s' of step t-1, never beta(x_{t-1})."""
    torch.manual_seed(1)
    spec = spec_of(2, 1)
    model = two_option_model(spec, master_bias=(0.5, -0.5), obs_term_weight=4.0)
    for mode in ("dac", "ppoc"):
        trainer = Trainer(model, learner_cfg(mode=mode), "cpu")
        T, N = 4, 1
        a = empty_batch(spec, 1, T, N)
        a["obs"][0, :, 0, 0] = [-2.0, 2.0, -2.0, 2.0, 0.0]  # beta differs strongly between x_t and x_{t-1}
        a["option"][0, :, 0] = [0, 0, 1, 1]
        a["option_start"][0, :, 0] = [False, False, True, False]
        p = trainer.prepare(batch_message(spec, a), 0, update_norm=False)
        x = p.x[:, 0]
        prev = torch.tensor([0, 0, 0, 1])
        with torch.no_grad():
            at_next = model.call_and_return_logits(x[:T], prev, torch.zeros(T, dtype=torch.bool))
            at_prev = model.call_and_return_logits(torch.cat([x[:1], x[: T - 1]]), prev,
                                                   torch.zeros(T, dtype=torch.bool))
        o = torch.tensor([0, 0, 1, 1])
        want = at_next.gather(-1, o.unsqueeze(-1)).squeeze(-1)
        wrong = at_prev.gather(-1, o.unsqueeze(-1)).squeeze(-1)
        got = p.log_rho_option[:, 0]  # behaviour log-prob was 0, so this is log pi_hat
        torch.testing.assert_close(got, want)
        assert float((got[1:] - wrong[1:]).abs().max()) > 0.5
        assert torch.equal(p.prev_option[:, 0], prev) and bool(p.known.all())
        if mode == "ppoc":
            with torch.no_grad():
                q = model.q(x[:T])
                v = (q * torch.softmax(model.master_logits(x[:T]), -1)).sum(-1)
            torch.testing.assert_close(p.q_prev[:, 0], q.gather(-1, prev.unsqueeze(-1)).squeeze(-1))
            torch.testing.assert_close(p.v[:, 0], v)


def test_option_context_at_the_segment_edge() -> None:
    option = torch.tensor([[2, 1], [2, 1], [0, 1]])
    start = torch.tensor([[False, True], [False, False], [True, False]])
    done = torch.tensor([[False, False], [True, False], [False, False]])
    prev, ep_start, known = Trainer.option_context(option, start, done)
    assert prev.tolist() == [[2, 1], [2, 1], [2, 1]]
    assert ep_start.tolist() == [[False, True], [False, False], [True, False]]
    assert known.tolist() == [[True, False], [True, True], [True, True]]  # t = 0 picked: unknown context


# -- staleness: truncated importance weights of both levels ---------------------------------------------

@pytest.mark.parametrize("rho_bar", [0.5, 1.0, 3.0])
def test_importance_weights_are_truncated_as_configured(rho_bar: float) -> None:
    torch.manual_seed(2)
    rng = np.random.default_rng(2)
    spec = spec_of(3, 1)
    model = make_model(spec, hidden=[8], options=2)
    trainer = Trainer(model, learner_cfg(rho_bar=rho_bar, c_bar=rho_bar), "cpu")
    a = random_batch(spec, rng, K=2)
    a["logp_action"][:, :3] = -30.0  # the behaviour thought these actions unlikely: rho = pi/mu huge
    a["logp_option"][:, :3] = -5.0
    p = trainer.prepare(batch_message(spec, a), 0, update_norm=False)
    with torch.no_grad():
        logp_pi, _ = trainer._logp(p.x[:-1], p.option, p.action)
    rho_a = torch.exp(logp_pi - p.logp_mu)
    want = torch.clamp(rho_a, max=rho_bar) * (p.q_ret - p.values)
    torch.testing.assert_close(p.adv, want)
    assert bool((rho_a[:3] > rho_bar).all())  # the huge ones were truncated ...
    torch.testing.assert_close(p.adv[:3], rho_bar * (p.q_ret - p.values)[:3])
    # ... and the high-level (DAC) advantage uses the joint ratio of both levels, truncated the same way
    rho_j = torch.clamp(torch.exp(p.log_rhos), max=rho_bar)
    with torch.no_grad():
        pi_hat = model.call_and_return_logits(p.x[:-1], p.prev_option, p.ep_start).exp()
        v_hi = (model.q(p.x[:-1]) * pi_hat).sum(-1)
    torch.testing.assert_close(p.adv_high, rho_j * (p.q_ret - v_hi))
    m = trainer.update(batch_message(spec, a), 0)
    assert m["rho_clipped_frac"] >= 3 / 6 - 1e-6


# -- the epsilon-soft policy over options: (1 - eps) softmax(z) + eps / K, one distribution everywhere ------

def four_option_model(spec, epsilon: float, master_bias=(30.0, -30.0, -30.0, -30.0),
                      beta_bias=0.0) -> OptionPolicy:
    """K = 4 with hand-set heads: z(s) = master_bias, beta_o(s) = sigmoid(beta_bias) for every option."""
    model = make_model(spec, hidden=[8], options=4, normalize_obs=False, option_epsilon=epsilon)
    with torch.no_grad():
        for head, bias in ((model.termination, (beta_bias,) * 4), (model.master, master_bias)):
            for layer in head:
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.zero_()
                    layer.bias.zero_()
            head[-1].bias.copy_(torch.tensor(bias))
    return model


@pytest.mark.parametrize("eps", [0.01, 0.2, 0.5, 0.9])
def test_epsilon_soft_probabilities_sum_to_one_and_respect_the_floor(eps: float) -> None:
    torch.manual_seed(4)
    K = 4
    logits = torch.cat([torch.randn(64, K) * 3,
                        torch.tensor([[60.0, -60.0, -60.0, -60.0], [0.0, 0.0, 0.0, 0.0]])])
    logp = losses.epsilon_soft_log_probs(logits, eps)
    p = logp.exp()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(logits)))
    assert float(p.min()) >= eps / K * (1 - 1e-5)
    torch.testing.assert_close(p, (1 - eps) * torch.softmax(logits, -1) + eps / K)  # the formula itself
    assert torch.isfinite(logp).all()
    # the one-hot master still leaves eps / K to each other option, and its argmax is the softmax's
    torch.testing.assert_close(p[-2], torch.tensor([1 - eps + eps / K, eps / K, eps / K, eps / K]))
    assert torch.equal(logp.argmax(-1), logits.argmax(-1))
    # the entropy of the mixture is that of the explicit distribution
    torch.testing.assert_close(losses.categorical_entropy_logp(logp), -(p * p.log()).sum(-1))
    torch.testing.assert_close(losses.epsilon_soft_probs(logits, eps), p)
    # eps = 0 is exactly the softmax, bit for bit
    assert torch.equal(losses.epsilon_soft_log_probs(logits, 0.0), torch.log_softmax(logits, -1))
    assert torch.equal(losses.epsilon_soft_probs(logits, 0.0), torch.softmax(logits, -1))


def test_act_records_the_epsilon_soft_call_and_return_log_prob() -> None:
    torch.manual_seed(5)
    spec = spec_of(2, 1)
    n, eps, K = 4096, 0.2, 4
    model = four_option_model(spec, eps, master_bias=(2.0, 0.0, -1.0, -30.0))  # beta = 1/2 everywhere
    obs = torch.randn(n, 2)
    prev = torch.arange(n) % K
    start = torch.arange(n) % 3 == 0
    out = model.act(obs, prev, start)
    # by hand: pi_Omega = (1 - eps) softmax(z) + eps / K;
    # pi_hat = (1 - beta)[o = prev] + beta pi_Omega, with beta = 1 at episode starts
    pi_omega = (1 - eps) * torch.softmax(torch.tensor([2.0, 0.0, -1.0, -30.0]), -1) + eps / K
    beta = torch.where(start, torch.ones(n), torch.full((n,), 0.5))
    want = (1 - beta) * (out["option"] == prev).float() + beta * pi_omega[out["option"]]
    torch.testing.assert_close(out["logp_option"], want.log())
    # the learner's call-and-return policy is the same distribution
    lp = model.call_and_return_logits(obs, prev, start).gather(-1, out["option"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out["logp_option"], lp)
    # option 3 (logit -30) is still picked, through the eps / K floor alone
    assert bool((out["option_start"] & (out["option"] == 3) & (prev != 3)).any())


def test_epsilon_soft_master_feeds_every_option_even_when_the_logits_favour_one() -> None:
    torch.manual_seed(6)
    spec = spec_of(2, 1)
    n, K = 20000, 4
    obs = torch.randn(n, 2)
    prev = torch.zeros(n, dtype=torch.long)
    starts = torch.ones(n, dtype=torch.bool)
    for eps in (0.2, 0.5):
        out = four_option_model(spec, eps).act(obs, prev, starts)  # z = (30, -30, -30, -30): all on option 0
        share = torch.bincount(out["option"], minlength=K).float() / n
        floor = eps / K
        for o in (1, 2, 3):  # binomial sd ~ 0.0015 at n = 20000: these bounds are > 5 sd away
            assert floor - 0.01 < float(share[o]) < floor + 0.01, (eps, share)
        assert abs(float(share[0]) - (1 - eps + floor)) < 0.015
    # eps = 0 (the old softmax master) starves them completely
    out0 = four_option_model(spec, 0.0).act(obs, prev, starts)
    assert torch.equal(out0["option"], torch.zeros(n, dtype=torch.long))
    # the deterministic (evaluation) choice stays the argmax, whatever eps
    det = four_option_model(spec, 0.5).act(obs, prev, starts, deterministic=True)
    assert torch.equal(det["option"], torch.zeros(n, dtype=torch.long))


def reference_act_eps0(model: OptionPolicy, obs, prev_option, episode_start) -> Dict[str, torch.Tensor]:
    """The option choice of ``act`` as written before the epsilon-soft master (softmax pi_Omega)."""
    x = model.obs_norm(obs)
    prev = prev_option.clamp(0, model.K - 1)
    log_master = torch.log_softmax(model.master_logits(x), -1)
    beta = model.beta(x).gather(-1, prev.unsqueeze(-1)).squeeze(-1)
    fired = torch.rand_like(beta) < beta
    picked = torch.distributions.Categorical(logits=log_master).sample()
    option_start = episode_start | fired
    option = torch.where(option_start, picked, prev)
    b = torch.where(episode_start, torch.ones_like(beta), beta)
    probs = (1 - b).unsqueeze(-1) * torch.nn.functional.one_hot(prev, model.K).to(log_master.dtype) \
        + b.unsqueeze(-1) * log_master.exp()
    logp_option = torch.log(probs.clamp(min=1e-12)).gather(-1, option.unsqueeze(-1)).squeeze(-1)
    return {"option": option, "option_start": option_start, "logp_option": logp_option}


@pytest.mark.parametrize("mode", ["dac", "ppoc"])
def test_epsilon_zero_reproduces_the_softmax_master_exactly(mode: str) -> None:
    torch.manual_seed(7)
    rng = np.random.default_rng(7)
    spec = spec_of(3, 2)
    model = make_model(spec, hidden=[16], options=3, option_epsilon=0.0)
    assert model.cfg.option_epsilon == 0.0
    obs, prev = torch.randn(256, 3), torch.randint(0, 3, (256,))
    start = torch.rand(256) < 0.2
    with torch.no_grad():
        assert torch.equal(model.log_master(obs), torch.log_softmax(model.master_logits(obs), -1))
        torch.manual_seed(8)
        got = model.act(obs, prev, start)
        torch.manual_seed(8)
        want = reference_act_eps0(model, obs, prev, start)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the learner's option-level terms: entropy and PPOC's log pi_Omega are the softmax's
    trainer = Trainer(model, learner_cfg(mode=mode), "cpu")
    p = trainer.prepare(batch_message(spec, random_batch(spec, rng, K=3)), 0, update_norm=False)
    T = p.values.shape[0]
    mb = trainer.samples(p)
    with torch.no_grad():
        terms = trainer._option_terms(mb)
        want_ent = losses.categorical_entropy(model.master_logits(mb.x)).mean()
    assert float(terms["loss/master_entropy"]) == float(want_ent)
    if mode == "ppoc":
        with torch.no_grad():
            v = (model.q(p.x[:T]) * torch.softmax(model.master_logits(p.x[:T]), -1)).sum(-1)
        assert torch.equal(p.v, v)


def test_learner_trains_the_distribution_the_workers_sample_from() -> None:
    """On-policy data from act() with eps > 0 has option-level ratio 1 in the learner, and PPOC's V(s) and the
    master entropy are those of the epsilon-soft pi_Omega."""
    torch.manual_seed(9)
    spec = spec_of(3, 1)
    K, T, N, eps = 3, 8, 16, 0.3
    model = make_model(spec, hidden=[16], options=K, option_epsilon=eps)
    with torch.no_grad():  # a master far from uniform, terminations around 1/2
        model.master[-1].bias.copy_(torch.tensor([3.0, 0.0, -3.0]))
    a = empty_batch(spec, 1, T, N)
    a["obs"][:] = np.random.default_rng(9).normal(size=a["obs"].shape)
    prev, start = torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.bool)
    for t in range(T):
        out = model.act(torch.from_numpy(a["obs"][0, t]), prev, start)
        for k in ("option", "option_start", "logp_option", "logp_action", "action"):
            a[k][0, t] = out[k].numpy()
        prev, start = out["option"], torch.zeros(N, dtype=torch.bool)
    for mode in ("dac", "ppoc"):
        trainer = Trainer(model, learner_cfg(mode=mode), "cpu")
        p = trainer.prepare(batch_message(spec, a), 0, update_norm=False)
        assert bool(p.known[1:].all())
        torch.testing.assert_close(p.log_rho_option, torch.zeros(T, N), atol=1e-5, rtol=0)
        with torch.no_grad():
            x = p.x[:T]
            pi_eps = (1 - eps) * torch.softmax(model.master_logits(x), -1) + eps / K
            if mode == "ppoc":
                torch.testing.assert_close(p.v, (model.q(x) * pi_eps).sum(-1))
            terms = trainer._option_terms(trainer.samples(p))
            pe = pi_eps.reshape(-1, K)
            torch.testing.assert_close(terms["loss/master_entropy"], -(pe * pe.log()).sum(-1).mean())


def test_option_epsilon_travels_with_the_policy_config() -> None:
    spec = spec_of(3, 2)
    cfg = make_model(spec, hidden=[8], options=4, option_epsilon=0.25).cfg
    assert cfg.option_epsilon == 0.25 and cfg.to_dict()["option_epsilon"] == 0.25
    assert PolicyConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k != "option_epsilon"}  # written before the key existed
    assert PolicyConfig.from_dict(old) == replace(cfg, option_epsilon=0.0)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="option_epsilon"):
            PolicyConfig.from_dict(dict(old, option_epsilon=bad))
    # weights messages carry it to the workers
    model = OptionPolicy(cfg)
    assert model_from_weights(parse(unpack(weights_message(model, 1, 0, spec.hash)), ("weights",))).cfg == cfg
    # K = 1: the master is inert and eps is not part of the architecture
    assert make_model(spec, hidden=[8], options=1, option_epsilon=0.25).cfg.option_epsilon == 0.0
    # checkpoints written before the key: a flat run resumes, a K = 4 run with eps > 0 is told what differs
    flat = make_model(spec, hidden=[8], options=1).cfg
    state = {"spec": spec.to_dict(),
             "policy": {k: v for k, v in flat.to_dict().items() if k != "option_epsilon"}}
    ckpt.check_compatible(state, spec.to_dict(), flat)
    state4 = {"spec": spec.to_dict(), "policy": old}
    ckpt.check_compatible(state4, spec.to_dict(), replace(cfg, option_epsilon=0.0))
    with pytest.raises(ckpt.CheckpointError, match="option_epsilon"):
        ckpt.check_compatible(state4, spec.to_dict(), cfg)


# -- DAC and PPOC train their option levels; the student follows the teacher -------------------------

@pytest.mark.parametrize("mode", ["dac", "ppoc"])
def test_option_level_terms_are_finite_and_move_master_and_termination(mode: str) -> None:
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    spec = spec_of(3, 2)
    model = make_model(spec, hidden=[16], options=3)
    trainer = Trainer(model, learner_cfg(mode=mode, option_weights=True), "cpu")
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    m = trainer.update(batch_message(spec, random_batch(spec, rng, K=3)), 0)
    for k in ("loss/policy", "loss/value", "loss/entropy", "loss/master", "loss/termination",
              "loss/master_entropy", "loss/student", "loss/total"):
        assert math.isfinite(m[k]), k
    assert m["loss/master_entropy"] > 0
    moved = {n for n, q in model.named_parameters() if not torch.equal(before[n], q)}
    assert any(n.startswith("master.") for n in moved) and any(n.startswith("termination.") for n in moved)
    assert any(n.startswith("student.") for n in moved)
    assert all(f"lag/option/{o}" in m for o in range(3))


@pytest.mark.parametrize("mode", ["dac", "ppoc"])
def test_the_termination_prior_pulls_terminations_toward_its_rate(mode: str) -> None:
    """With only the prior switched on (no option-level policy terms), updates move every termination
    probability toward learner.termination_prior; with its coefficient 0 the prior term has no effect."""
    spec = spec_of(3, 2)
    drift = {}
    for coef in (0.0, 2.0):
        torch.manual_seed(5)
        rng = np.random.default_rng(5)
        model = make_model(spec, hidden=[16], options=3)
        c = learner_cfg(mode=mode, master_coef=0.0, termination_coef=0.0, master_ent_coef=0.0, target_kl=0.0,
                        termination_prior=0.05, termination_prior_coef=coef, lr=1e-2, epochs=4)
        trainer = Trainer(model, c, "cpu")
        batch = random_batch(spec, rng, K=3)
        x = model.obs_norm(torch.as_tensor(batch["obs"].reshape(-1, 3)))
        before = float(model.beta(x).mean())  # ~0.5 at init
        for _ in range(3):
            m = trainer.update(batch_message(spec, batch), 0)
        assert math.isfinite(m["loss/termination_prior"])
        drift[coef] = before - float(
            model.beta(model.obs_norm(torch.as_tensor(batch["obs"].reshape(-1, 3)))).mean()
        )
    # nothing else trains the termination head here (the normaliser moves x a bit)
    assert abs(drift[0.0]) < 0.01
    assert drift[2.0] > 0.1  # from ~0.5 toward 0.05


def test_per_option_lag_by_hand() -> None:
    spec = spec_of(2, 1)
    model = make_model(spec, hidden=[8], options=2)
    trainer = Trainer(model, learner_cfg(), "cpu")
    a = empty_batch(spec, 2, 2, 1)
    a["policy_version"][:] = [[8, 9], [5, 5]]  # learner at 10: lags [[2, 1], [5, 5]]
    a["option"][:, :, 0] = [[0, 1], [1, 1]]
    a["option_start"][:, 0, 0] = True
    m = trainer.update(batch_message(spec, a), 10)
    assert m["lag/option/0"] == pytest.approx(2.0)
    assert m["lag/option/1"] == pytest.approx((1 + 5 + 5) / 3)


def test_student_is_distilled_toward_the_clipped_teacher_and_travels_with_the_weights() -> None:
    torch.manual_seed(4)
    rng = np.random.default_rng(4)
    spec = spec_of(1, 1)
    model = make_model(spec, hidden=[32])
    trainer = Trainer(model, learner_cfg(lr=3e-3, student_lr=3e-3, epochs=4, minibatches=2), "cpu",
                      action_low=spec.action_low, action_high=spec.action_high)
    initial = copy.deepcopy(model)
    for v in range(60):
        m = trainer.update(bandit_batch(model, spec, rng), v)
    obs = torch.from_numpy(rng.normal(size=(64, 1)).astype(np.float32))
    teacher = model.act(obs, torch.zeros(64, dtype=torch.long), torch.ones(64, dtype=torch.bool),
                        deterministic=True)
    target = teacher["action"].clamp(-1, 1)
    gap_before = float((initial.student_act(obs) - target).abs().mean())
    gap_after = float((model.student_act(obs) - target).abs().mean())
    # the teacher moved; the student followed
    assert gap_before > 0.3 and gap_after < 0.1, (gap_before, gap_after)
    assert 0 < m["loss/student"] < 0.02
    # the weights message carries the student: a worker-side copy gives the same student actions
    copy_ = model_from_weights(parse(unpack(weights_message(model, 1, 0, spec.hash))))
    torch.testing.assert_close(copy_.student_act(obs), model.student_act(obs), rtol=0, atol=0)


def test_student_lr_zero_leaves_the_student_alone() -> None:
    torch.manual_seed(5)
    spec = spec_of(1, 1)
    model = make_model(spec, hidden=[8])
    trainer = Trainer(model, learner_cfg(student_lr=0.0), "cpu")
    before = [q.detach().clone() for q in model.student.parameters()]
    m = trainer.update(bandit_batch(model, spec, np.random.default_rng(5)), 0)
    assert m["loss/student"] == 0.0
    assert all(torch.equal(b, q) for b, q in zip(before, model.student.parameters()))


# -- option health ----------------------------------------------------------------------------------

def test_health_figures_by_hand_and_warnings() -> None:
    spec = spec_of(2, 1)
    model = make_model(spec, hidden=[8], options=2)
    h = OptionHealth(2, decay=1.0, collapse_duration=1.5, dominant_share=0.95)
    # one column, 6 steps: 0 0 0 1 1 0 ; picks at t = 0 (unknown context), 3, 5; no episode end
    option = torch.tensor([0, 0, 0, 1, 1, 0]).unsqueeze(1)
    start = torch.tensor([True, False, False, True, False, True]).unsqueeze(1)
    done = torch.zeros(6, 1, dtype=torch.bool)
    prev, ep_start, known = Trainer.option_context(option, start, done)
    h.update(option, start, prev, known, ep_start, torch.randn(7, 1, 2))
    s = h.summary(model)
    assert s["usage"] == pytest.approx([4 / 6, 2 / 6])
    assert s["duration"] == pytest.approx([4 / 2, 2 / 1])
    # decisions at t = 1..5 with prev 0, 0, 0, 1, 1: option 0 fired once in 3 (t = 3),
    # option 1 once in 2 (t = 5)
    assert s["termination_rate"] == pytest.approx([1 / 3, 1 / 2])
    assert s["distance_min"] is not None and s["distance_min"] >= 0
    assert s["warnings"] == []
    flap = OptionHealth(2, decay=1.0)
    o = torch.tensor([0, 1, 0, 1, 0, 1, 0, 0]).unsqueeze(1)
    st = torch.ones(8, 1, dtype=torch.bool)
    pv, es, kn = Trainer.option_context(o, st, torch.zeros(8, 1, dtype=torch.bool))
    flap.update(o, st, pv, kn, es)
    assert any("collapse" in w for w in flap.summary(model)["warnings"])
    one = OptionHealth(2, decay=1.0)
    o = torch.zeros(40, 1, dtype=torch.long)
    st = torch.zeros(40, 1, dtype=torch.bool)
    st[0] = True
    pv, es, kn = Trainer.option_context(o, st, torch.zeros(40, 1, dtype=torch.bool))
    one.update(o, st, pv, kn, es)
    w = one.summary(model)["warnings"]
    assert any("option 0 takes 100.0%" in x for x in w)
    assert OptionHealth.scalars(s)["options/usage/0"] == pytest.approx(4 / 6)


def test_health_spread_is_a_share_of_the_action_range_and_warns_only_after_warmup() -> None:
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0])  # half-ranges 2 and 0.5
    h = OptionHealth(3, action_low=low, action_high=high, identical_spread=0.05, warmup_updates=2)
    # two probe states; option 2 lies beyond the bounds in dim 0 and is clipped to 2 before comparing
    means = torch.tensor([[[0.0, 0.5], [0.2, 0.5], [5.0, 0.5]],
                          [[0.0, 0.5], [0.2, 0.55], [5.0, 0.5]]])
    # pair (0, 1): state 0 RMS(0.1, 0) = 0.0707, state 1 RMS(0.1, 0.1) = 0.1; mean 0.0854
    # pair (1, 2): RMS(0.9, 0) = 0.636 and RMS(0.9, 0.1) = 0.640; pair (0, 2): RMS(1, 0) = 0.707 and 0.707
    want = (math.sqrt(0.01 / 2) + math.sqrt(0.02 / 2)) / 2
    assert h.spread_min(means) == pytest.approx(want, rel=1e-5)
    # without bounds the half-range is 1 and nothing is clipped: pair (0, 1) is then the closest
    unbounded = (math.sqrt(0.04 / 2) + math.sqrt((0.04 + 0.0025) / 2)) / 2
    assert OptionHealth(3).spread_min(means) == pytest.approx(unbounded, rel=1e-5)

    spec = spec_of(2, 1)
    model = make_model(spec, hidden=[8], options=2)
    with torch.no_grad():  # every option's mean is 0 on every state: the options act exactly alike
        for p in model.actor[-1].parameters():
            p.zero_()
    alike = OptionHealth(2, warmup_updates=3, action_low=torch.tensor([-1.0]),
                         action_high=torch.tensor([1.0]))
    o = torch.tensor([0, 0, 1, 1]).unsqueeze(1)
    st = torch.tensor([True, False, True, False]).unsqueeze(1)
    pv, es, kn = Trainer.option_context(o, st, torch.zeros(4, 1, dtype=torch.bool))
    for n in range(1, 4):
        alike.update(o, st, pv, kn, es, torch.randn(5, 1, 2))
        s = alike.summary(model)
        assert s["spread_min"] == 0.0 and s["updates"] == n
        assert any("act alike" in w for w in s["warnings"]) == (n >= 3), (n, s["warnings"])
    assert OptionHealth.scalars(s)["options/spread_min"] == 0.0
    off = OptionHealth(2, identical_spread=0.0, warmup_updates=0)
    off.update(o, st, pv, kn, es, torch.randn(5, 1, 2))
    assert not any("act alike" in w for w in off.summary(model)["warnings"])


def test_the_act_alike_threshold_follows_the_option_share() -> None:
    """Residual options differ by (1 - s) times their own heads' difference: the "act alike" threshold
    (calibrated at s = 0.5) scales by 2 (1 - s), so a larger share does not make distinct own heads look
    alike, and heads that are alike still warn."""
    spec = spec_of(2, 1)
    o = torch.tensor([0, 0, 1, 1]).unsqueeze(1)
    st = torch.tensor([True, False, True, False]).unsqueeze(1)
    pv, es, kn = Trainer.option_context(o, st, torch.zeros(4, 1, dtype=torch.bool))
    seen = {}
    for share, own in ((0.75, 0.06), (0.75, 0.04), (0.5, 0.06), (0.5, 0.04)):
        model = make_model(spec, hidden=[8], options=2, option_share=share)
        with torch.no_grad():  # own heads +-own, the shared head 0, on every state
            model.actor[-1].weight.zero_()
            model.actor[-1].bias.copy_(torch.tensor([own, -own, 0.0]))
        h = OptionHealth(2, warmup_updates=0, action_low=torch.tensor([-1.0]),
                         action_high=torch.tensor([1.0]))
        h.update(o, st, pv, kn, es, torch.randn(5, 1, 2))
        s = h.summary(model)
        assert s["spread_min"] == pytest.approx(2 * own * (1 - share), rel=1e-5)
        assert s["alike_below"] == pytest.approx(0.05 * 2 * (1 - share))
        seen[(share, own)] = any("act alike" in w for w in s["warnings"])
    # own heads 0.12 apart: distinct at both shares (at 0.75 the means are only 3 % apart, under the 5 %)
    assert seen == {(0.75, 0.06): False, (0.75, 0.04): True, (0.5, 0.06): False, (0.5, 0.04): True}
    flat = make_model(spec, hidden=[8], options=2, option_residual=False)
    assert OptionHealth(2).alike_threshold(flat) == 0.05  # independent heads: the threshold as configured


def step_on_option_0(head: Callable[[], torch.Tensor], target: torch.Tensor,
                     opt: torch.optim.Optimizer) -> Tuple[float, float]:
    """One optimiser step on a squared error of option 0's output only (``head()``: [N, K, ...]); how far
    options 0 and 1 moved (max |change|)."""
    before = head().detach().clone()
    loss = ((head()[:, 0] - target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    after = head().detach()
    return float((after[:, 0] - before[:, 0]).abs().max()), float((after[:, 1] - before[:, 1]).abs().max())


def test_residual_options_share_a_policy_that_every_step_trains() -> None:
    """option_residual: mu_o = s mu + (1 - s) m_o and log sigma_o = s log sigma + (1 - s) l_o (s: the
    default option_share); a step trained only on option 0's samples moves option 1's mean too (through the
    shared head), unlike independent heads."""
    torch.manual_seed(0)
    spec = spec_of(3, 2)
    x = torch.randn(64, 3)
    moved = {}
    for residual in (True, False):
        model = make_model(spec, hidden=[16], options=4, option_residual=residual)
        assert model.cfg.option_residual is residual and model.residual is residual
        out = model.actor(x)
        if residual:
            heads, s = out.reshape(64, 5, 2), model.share
            torch.testing.assert_close(model.action_mean(x), (1 - s) * heads[:, :4] + s * heads[:, 4:])
            torch.testing.assert_close(model.option_log_std(),
                                       (1 - s) * model.log_std + s * model.shared_log_std)
            torch.testing.assert_close(model.option_log_std(), torch.full((4, 2), model.cfg.init_log_std))
        else:
            torch.testing.assert_close(model.action_mean(x), out.reshape(64, 4, 2))
        trained, moved[residual] = step_on_option_0(lambda: model.action_mean(x), torch.ones(64, 2),
                                                    torch.optim.SGD(model.parameters(), lr=0.1))
        assert trained > 1e-3  # the trained option moved
    assert moved[True] > 1e-3  # option 1 learned from option 0's samples
    # (independent heads share only the body, and its change barely moves a 0.01-gain head)
    assert moved[True] > 10 * moved[False]
    cfg = make_model(spec, hidden=[8], options=4).cfg
    assert cfg.option_residual is True  # the config default for K > 1
    old = {k: v for k, v in cfg.to_dict().items() if k != "option_residual"}  # written before the key existed
    assert PolicyConfig.from_dict(old).option_residual is False
    assert make_model(spec, hidden=[8], options=1, option_residual=True).cfg.option_residual is False  # K = 1


def test_a_residual_critic_shares_a_value_that_every_step_trains() -> None:
    """critic_residual: Q(s, o) = s V(s) + (1 - s) q_o(s), V the critic's (K+1)-th output; a value step on
    option 0's samples only moves Q(s, 1) too (through V), about s / (1 - s) times as far as independent
    outputs let it move; the header writes the key only when it is true (absence: K value outputs)."""
    torch.manual_seed(0)
    spec = spec_of(3, 2)
    x = torch.randn(64, 3)
    moved = {}
    for shared in (True, False):
        model = make_model(spec, hidden=[16], options=4, critic_residual=shared)
        assert model.critic_residual is shared and model.cfg.critic_residual is shared
        out = model.critic(x)
        assert out.shape == (64, 4 + shared)
        s = model.share
        expect = (1 - s) * out[:, :4] + s * out[:, 4:] if shared else out
        torch.testing.assert_close(model.q(x), expect)
        trained, moved[shared] = step_on_option_0(lambda: model.q(x), torch.full((64,), 5.0),
                                                  torch.optim.Adam(model.critic.parameters(), lr=1e-2))
        assert trained > 1e-3
    assert moved[True] > 2 * moved[False]  # option 1's value learned from option 0's samples
    assert make_model(spec, hidden=[8], options=4).cfg.critic_residual is True  # the config default, K > 1
    cfg = make_model(spec, hidden=[8], options=4, critic_residual=True).cfg
    assert cfg.to_dict()["critic_residual"] is True and PolicyConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k != "critic_residual"}  # written before the key existed
    assert PolicyConfig.from_dict(old).critic_residual is False
    independent = make_model(spec, hidden=[8], options=4, critic_residual=False).cfg
    assert "critic_residual" not in independent.to_dict()
    for flat in (dict(options=1), dict(options=3, option_residual=False)):  # no shared head: nothing to share
        model = make_model(spec, hidden=[8], critic_residual=True, **flat)
        assert model.cfg.critic_residual is False and model.critic[-1].out_features == model.K


def test_option_share_weighs_the_shared_head_and_travels_with_the_weights() -> None:
    """option_share s: mu_o = (1 - s) m_o + s mu and log sigma_o likewise; the even average (0.5) is what the
    header's absence means, any other s is written, and a share outside (0, 1) names the key."""
    torch.manual_seed(0)
    spec = spec_of(3, 2)
    x = torch.randn(16, 3)
    model = make_model(spec, hidden=[8], options=3, option_share=0.75)
    with torch.no_grad():
        model.shared_log_std.fill_(-1.0)
        model.log_std.copy_(torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]))
    heads = model.actor(x).reshape(16, 4, 2)
    torch.testing.assert_close(model.action_mean(x), 0.25 * heads[:, :3] + 0.75 * heads[:, 3:])
    torch.testing.assert_close(model.option_log_std(), 0.25 * model.log_std - 0.75)
    d = model.cfg.to_dict()
    assert d["option_share"] == 0.75 and PolicyConfig.from_dict(d) == model.cfg
    even = make_model(spec, hidden=[8], options=3, option_share=0.5).cfg
    assert even.option_share == 0.5 and "option_share" not in even.to_dict()
    default = make_model(spec, hidden=[8], options=3).cfg  # the config default (not 0.5): in the header
    share = config.defaults()["policy"]["option_share"]
    assert share != 0.5 and default.option_share == share and default.to_dict()["option_share"] == share
    assert PolicyConfig.from_dict(even.to_dict()) == even
    for flat in (dict(options=1), dict(options=3, option_residual=False)):  # no shared head: s means nothing
        assert make_model(spec, hidden=[8], option_share=0.75, **flat).cfg.option_share == 0.5
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="option_share"):
            PolicyConfig(obs_dim=3, act_dim=2, options=3, option_residual=True, option_share=bad)


def test_the_option_pull_is_each_own_gaussians_kl_to_the_shared_one() -> None:
    torch.manual_seed(3)
    own_mean, shared_mean = torch.randn(32, 4, 2), torch.randn(32, 1, 2)
    own_log_std, shared_log_std = torch.randn(4, 2) * 0.3 - 1.0, torch.tensor([-0.5, -1.5])
    want = torch.distributions.kl_divergence(
        torch.distributions.Normal(own_mean, own_log_std.exp()),
        torch.distributions.Normal(shared_mean.expand(32, 4, 2), shared_log_std.exp())).sum(-1).mean(-1)
    got = losses.option_pull_loss(own_mean, own_log_std, shared_mean, shared_log_std)
    torch.testing.assert_close(got, want)
    same = losses.option_pull_loss(shared_mean.expand(32, 4, 2), shared_log_std.expand(4, 2), shared_mean,
                                   shared_log_std)
    torch.testing.assert_close(same, torch.zeros(32))  # options equal to the shared head: no pull


def test_the_option_pull_moves_only_the_options_own_heads_toward_the_shared_one() -> None:
    """learner.option_pull_coef: its gradient reaches the options' own output rows and log stds, never the
    shared head, the shared log std or the actor body; trained with it, the own heads close in on the
    shared one where without it they do not."""
    spec = spec_of(1, 1)
    rng = np.random.default_rng(4)

    def fresh() -> OptionPolicy:
        torch.manual_seed(4)
        model = make_model(spec, hidden=[16], options=4)
        with torch.no_grad():  # own heads far from the shared one
            model.actor[-1].weight.normal_(0.0, 0.5)
            model.actor[-1].bias.normal_(0.0, 0.5)
            model.log_std.add_(torch.randn(4, 1) * 0.3)
        return model

    def pull(model: OptionPolicy, x: torch.Tensor) -> float:
        own, shared = model.residual_heads(model.actor(x))
        return float(losses.option_pull_loss(own, model.log_std, shared, model.shared_log_std).mean())

    model = fresh()
    trainer = Trainer(model, learner_cfg(option_pull_coef=1.0), "cpu")
    p = trainer.prepare(bandit_batch(model, spec, rng), 0, update_norm=False)
    mb = trainer.samples(p)
    terms = trainer._option_terms(mb, model.actor_features(mb.x))
    model.zero_grad()
    terms["loss/option_pull"].backward()
    A = model.A
    grad = model.actor[-1].weight.grad
    assert float(grad[: 4 * A].abs().sum()) > 0 and float(model.log_std.grad.abs().sum()) > 0
    assert float(grad[4 * A:].abs().sum()) == 0.0, "the shared head is the target, not pulled"
    assert model.shared_log_std.grad is None or float(model.shared_log_std.grad.abs().sum()) == 0.0
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.actor[:-1].parameters())

    x = torch.randn(256, 1)
    after = {}
    for coef in (0.0, 1.0):
        model = fresh()
        before = pull(model, x)
        trainer = Trainer(model, learner_cfg(option_pull_coef=coef, target_kl=0.0), "cpu")
        batch_rng = np.random.default_rng(5)
        for _ in range(10):
            m = trainer.update(bandit_batch(model, spec, batch_rng), 0)
        assert math.isfinite(m["loss/option_pull"])
        after[coef] = pull(model, x)
    assert after[1.0] < 0.5 * before and after[1.0] < 0.5 * after[0.0], (before, after)
