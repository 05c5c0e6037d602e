"""The worker's fast path for K > 1: the actor, master and termination MLPs run as one stacked network
(zclaw/policy/stacked.py) and options are drawn by the exponential race. Both must act exactly as the
modules the learner trains, and follow every change of their weights."""
from __future__ import annotations

import copy

import pytest
import torch
from support.batches import make_model, spec_of
from torch import nn

from zclaw.policy.networks import OptionPolicy, mlp
from zclaw.policy.stacked import StackedMLPs, sample_index


def separate_and_stacked(model: OptionPolicy, x: torch.Tensor):
    nets = [model.actor, model.master, model.termination]
    with torch.no_grad():
        return [n(x) for n in nets], StackedMLPs(nets)(x)


@pytest.mark.parametrize("hidden, activation", [([64, 64], "tanh"), ([], "tanh"), ([32, 16, 8], "relu"),
                                                ([16], "elu")])
def test_stacked_mlps_compute_what_each_mlp_computes(hidden, activation) -> None:
    torch.manual_seed(0)
    model = make_model(spec_of(7, 3), hidden=hidden, activation=activation, options=4)
    for p in model.parameters():  # away from the near-zero output init, so a mixed-up block would show
        nn.init.normal_(p.data)
    x = torch.randn(16, 7)
    want, got = separate_and_stacked(model, x)
    assert [g.shape for g in got] == [w.shape for w in want] == [(16, 15), (16, 4), (16, 4)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_stacked_mlps_refuse_nets_of_unlike_hidden_shape() -> None:
    with pytest.raises(ValueError, match="one hidden shape"):
        StackedMLPs([mlp([4, 8, 2], "tanh"), mlp([4, 16, 2], "tanh")])
    with pytest.raises(ValueError, match="one activation"):
        StackedMLPs([mlp([4, 8, 2], "tanh"), mlp([4, 8, 2], "relu")])


def acts_as_its_modules(model: OptionPolicy, obs: torch.Tensor, prev: torch.Tensor,
                        start: torch.Tensor) -> None:
    """act() (stacked heads) against the per-module formulas the learner uses: the deterministic action is
    the chosen option's mean, the recorded log-probs are pi_hat's and the Gaussian's."""
    out = model.act(obs, prev, start, deterministic=True)
    with torch.no_grad():
        x = model.obs_norm(obs)
        want_option = torch.where(start | (model.beta(x).gather(-1, prev[:, None])[:, 0] > 0.5),
                                  model.log_master(x).argmax(-1), prev)
        want_logp = model.call_and_return_logits(x, prev, start).gather(-1, want_option[:, None])[:, 0]
        want_mean = model.option_mean(x, want_option)
    assert torch.equal(out["option"], want_option)
    torch.testing.assert_close(out["logp_option"], want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["action"], want_mean, rtol=1e-5, atol=1e-5)


def test_act_follows_every_change_of_the_weights() -> None:
    """The stacked copy is rebuilt after an optimiser step, a weights message and a deep copy's own step."""
    torch.manual_seed(1)
    spec = spec_of(5, 2)
    model = make_model(spec, options=4)
    obs, prev = torch.randn(64, 5), torch.randint(0, 4, (64,))
    start = torch.rand(64) < 0.3
    for p in model.parameters():
        nn.init.normal_(p.data, std=0.5)
    acts_as_its_modules(model, obs, prev, start)
    before = model.act(obs, prev, start, deterministic=True)["action"]

    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the learner's way: in-place parameter updates
    x = model.obs_norm(obs)
    loss = model.actor(x).pow(2).sum() - model.master(x)[:, 1].sum() + model.termination(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    moved = model.act(obs, prev, start, deterministic=True)["action"]
    assert not torch.allclose(moved, before)
    acts_as_its_modules(model, obs, prev, start)

    other = make_model(spec, options=4)  # a worker's way: a weights message loaded in place
    for p in other.parameters():
        nn.init.normal_(p.data, std=0.5)
    model.load_weight_arrays(other.weight_arrays())
    acts_as_its_modules(model, obs, prev, start)
    torch.testing.assert_close(model.act(obs, prev, start, deterministic=True)["action"],
                               other.act(obs, prev, start, deterministic=True)["action"])

    twin = copy.deepcopy(model)  # a copy acts on its own weights, and the original on its own
    with torch.no_grad():
        twin.actor[-1].bias.add_(1.0)
    acts_as_its_modules(twin, obs, prev, start)
    acts_as_its_modules(model, obs, prev, start)
    assert not torch.allclose(twin.act(obs, prev, start, deterministic=True)["action"],
                              model.act(obs, prev, start, deterministic=True)["action"])


def test_sample_index_draws_each_index_with_its_probability() -> None:
    torch.manual_seed(2)
    n = 200_000
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = sample_index(probs.expand(n, 4).clone())
    freq = torch.bincount(draws, minlength=4).double() / n
    sd = (probs.double() * (1 - probs.double()) / n).sqrt()  # binomial sd, <= 0.0012
    assert bool(((freq - probs.double()).abs() <= 5 * sd + 1e-12).all()), freq
    assert int((draws == 3).sum()) == 0, "a zero probability is never drawn"
    # rows need not be normalised, and each row has its own distribution
    rows = torch.tensor([[2.0, 0.0], [0.0, 7.0]]).repeat(1000, 1)
    assert torch.equal(sample_index(rows), torch.tensor([0, 1]).repeat(1000))
