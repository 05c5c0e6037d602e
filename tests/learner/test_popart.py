"""PopArt value normalisation on its own (zclaw/policy/popart.py) and in the trainer
(``learner.reward_scale = "popart"``): outputs preserved across statistics updates, the statistics' update
rule in closed form, training on targets 1000x the usual scale, the checkpoint round trip, the config key."""
from __future__ import annotations

import math
from typing import List

import numpy as np
import pytest
import torch
from support.batches import batch_message, empty_batch, learner_cfg, make_model, spec_of

from zclaw import config
from zclaw.learner import checkpoint as ckpt
from zclaw.learner.trainer import Trainer
from zclaw.policy.normalizer import Moments
from zclaw.policy.popart import PopArt
from zclaw.wire import Message

SPEC = spec_of(3, 1)


def big_batch(seed: int = 0, scale: float = 1000.0, B: int = 2, T: int = 16, N: int = 8) -> Message:
    """Rewards of ``scale`` (1 +- 0.5) per step, episodes ending with probability 0.1: V-trace targets
    around 5 x scale."""
    rng = np.random.default_rng(seed)
    a = empty_batch(SPEC, B=B, T=T, N=N)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["action"][:] = 0.3 * rng.normal(size=a["action"].shape)
    a["logp_action"][:] = -1.0
    a["reward"][:] = scale * (1.0 + 0.5 * rng.normal(size=a["reward"].shape))
    a["terminated"][:] = rng.random(a["terminated"].shape) < 0.1
    return batch_message(SPEC, a)


def popart_trainer(seed: int = 0, **over) -> Trainer:
    torch.manual_seed(seed)
    return Trainer(make_model(SPEC, hidden=[16], **over.pop("policy", {})),
                   learner_cfg(reward_scale="popart", **over), "cpu")


# ---------------------------------------------------------------------------------------- preserving outputs
@pytest.mark.parametrize("K,critic_residual", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_statistics_update_leaves_the_critics_values_as_they_were(K: int, critic_residual: bool,
                                                                    dtype: torch.dtype) -> None:
    """(A residual critic's Q averages its outputs: the same affine map on each leaves the average right.)"""
    torch.manual_seed(K)
    model = make_model(SPEC, hidden=[16, 16], options=K, critic_residual=critic_residual).to(dtype)
    assert model.critic_residual is critic_residual
    popart = PopArt(model.critic[-1], beta=0.3)
    x = torch.randn(64, 3, dtype=dtype)
    popart.fold(Moments(100.0, 5.0, 4.0))  # away from mu = 0, sigma = 1 first
    for batch in (Moments(50.0, -20.0, 900.0), Moments(10.0, 300.0, 1e-2), Moments(7.0, 0.0, 1e4)):
        mu, sigma = popart.mu, popart.sigma
        out = model.q(x).detach()
        before = popart.unnormalize(out)
        popart.fold(batch)
        assert (popart.mu, popart.sigma) != (mu, sigma)
        assert not torch.allclose(model.q(x), out)  # the layer was rescaled ...
        after = popart.unnormalize(model.q(x).detach())
        assert after.shape == (64, K)
        # ... and the values in reward units are what they were: to 1e-6 in float64; in float32 to a few
        # of its ulps (1.2e-7 relative) of the largest term of sigma' f' + mu'
        f = model.q(x).detach()
        largest = max(float(before.abs().max()), abs(popart.mu), popart.sigma * float(f.abs().max()))
        tol = 1e-6 if dtype == torch.float64 else 8 * 1.2e-7 * largest
        torch.testing.assert_close(after, before, rtol=0, atol=tol)


def test_the_other_heads_are_not_touched() -> None:
    """Only the critic's last layer moves: acting (workers, evaluation) and the student (export) are
    unchanged."""
    model = make_model(SPEC, hidden=[16], options=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    PopArt(model.critic[-1]).fold(Moments(10.0, 7.0, 25.0))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    last = len(model.critic) - 1
    assert changed == {f"critic.{last}.weight", f"critic.{last}.bias"}


# ----------------------------------------------------------------------------------------- the statistics
def closed_form(batches: List[np.ndarray], beta: float):
    """The debiased moving averages written out: mu_k = sum_j beta (1-beta)^(k-j) mean_j / (1 - (1-beta)^k),
    and likewise nu_k with the batches' mean squares; sigma_k = sqrt(nu_k - mu_k^2)."""
    k = len(batches)
    weights = [beta * (1 - beta) ** (k - 1 - j) for j in range(k)]
    total = 1 - (1 - beta) ** k
    mu = sum(w * b.mean() for w, b in zip(weights, batches)) / total
    nu = sum(w * (b ** 2).mean() for w, b in zip(weights, batches)) / total
    return mu, math.sqrt(nu - mu ** 2)


def test_the_statistics_are_the_debiased_moving_averages_of_the_batches() -> None:
    rng = np.random.default_rng(0)
    layer = torch.nn.Linear(4, 1)
    popart = PopArt(layer, beta=0.25)
    assert (popart.mu, popart.sigma) == (0.0, 1.0)  # before any update the critic reads in reward units
    # the first batch's statistics exactly: no pull toward mu = 0, sigma = 1
    first = rng.normal(3000.0, 800.0, size=(16, 8))
    popart.fold(popart.measure(torch.as_tensor(first, dtype=torch.float32)))
    first32 = first.astype(np.float32).astype(np.float64)
    assert popart.mu == pytest.approx(first32.mean(), rel=1e-12)
    assert popart.sigma == pytest.approx(first32.std(), rel=1e-9)
    seen = [first32]
    for i in range(6):  # a drifting sequence: the later batches weigh more
        b = rng.normal(3000.0 + 500.0 * i, 800.0 + 100.0 * i, size=(16, 8))
        seen.append(b)
        popart.fold(popart.measure(torch.as_tensor(b)))
        mu, sigma = closed_form(seen, 0.25)
        assert popart.mu == pytest.approx(mu, rel=1e-9) and popart.sigma == pytest.approx(sigma, rel=1e-9)
    assert popart.mu > float(np.mean([s.mean() for s in seen]))  # recent batches count more


def test_non_finite_targets_are_left_out_equal_ones_floor_sigma_and_an_empty_batch_changes_nothing() -> None:
    popart = PopArt(torch.nn.Linear(2, 1), beta=0.5)
    m = popart.measure(torch.tensor([1.0, 3.0, float("nan"), float("inf")]))
    assert (m.count, m.mean, m.var) == (2.0, 2.0, 1.0)
    popart.fold(popart.measure(torch.full((8,), 5.0)))  # no reward yet: all targets alike
    assert popart.mu == 5.0 and popart.sigma == PopArt.SIGMA_MIN
    state = popart.state_dict()
    popart.fold(popart.measure(torch.tensor([float("nan")])))
    assert popart.state_dict() == state


@pytest.mark.parametrize("bad", [dict(beta=0.0), dict(beta=1.5)])
def test_bad_arguments_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        PopArt(torch.nn.Linear(2, 1), **bad)


# ------------------------------------------------------------------------------------------------ the trainer
def test_the_trainer_reads_the_critic_as_sigma_f_plus_mu_and_trains_f_on_normalised_targets() -> None:
    """Targets with the old statistics, then the statistics move and the layer is rescaled, then the value
    loss targets (v_s - mu') / sigma'; rewards stay raw (no reward scale, no clip)."""
    msg = big_batch()
    trainer = popart_trainer()
    torch.manual_seed(0)
    off = Trainer(make_model(SPEC, hidden=[16]), learner_cfg(reward_scale="off"), "cpu")
    x = torch.randn(32, 3)
    values_before = trainer._q(x)
    p = trainer.prepare(msg, 0)
    p_off = off.prepare(msg, 0)
    pa = trainer.popart
    assert trainer.reward_scaler is None and pa.sigma > 100.0 and pa.mu > 1000.0
    torch.testing.assert_close(p.rewards, p_off.rewards, rtol=0, atol=0)  # raw, unclipped
    assert float(p.rewards.max()) > 1000.0
    torch.testing.assert_close(p.vs, p_off.vs)  # same critic values, read through PopArt: same targets
    # the rescale kept the critic's values; the targets are what it now learns, in its own units
    torch.testing.assert_close(trainer._q(x), values_before, rtol=0, atol=1e-3)
    torch.testing.assert_close(trainer._q(x), pa.unnormalize(trainer.model.q(x)))
    pool = trainer.samples(p)
    torch.testing.assert_close(pool.vs, ((p.vs - pa.mu) / pa.sigma).reshape(-1))
    assert float(pool.vs.abs().mean()) < 5.0 < float(p.vs.abs().mean())
    # update_norm off (hand computations): the statistics stay
    state = pa.state_dict()
    trainer.prepare(msg, 0, update_norm=False)
    assert pa.state_dict() == state


def test_popart_learns_values_1000x_the_usual_scale_with_a_value_loss_of_order_one() -> None:
    """The point of PopArt: with rewards in the thousands the normalised value loss is O(1) and the critic's
    values move toward the targets at the pace they would at scale 1; off, the loss is O(1e6-1e7) and Adam's
    bounded steps leave the values where they were."""
    msg = big_batch()
    cfg = dict(lr=1e-2, epochs=4, minibatches=4)
    result = {}
    for mode in ("popart", "off"):
        torch.manual_seed(0)
        trainer = Trainer(make_model(SPEC, hidden=[16]), learner_cfg(reward_scale=mode, **cfg), "cpu")
        losses, errors = [], []
        for version in range(20):
            m = trainer.update(msg, version)
            assert all(math.isfinite(m[k]) for k in ("loss/policy", "loss/value", "loss/total")), (mode, m)
            losses.append(m["loss/value"])
            p = trainer.prepare(msg, version, update_norm=False)
            errors.append(float((p.values - p.vs).abs().mean() / p.vs.abs().mean()))  # relative, reward units
        result[mode] = (losses, errors, m, trainer)
    losses, errors, m, trainer = result["popart"]
    assert max(losses) < 10.0, losses
    assert errors[-1] < 0.6 * errors[0], errors
    assert (m["popart_mu"], m["popart_sigma"]) == (trainer.popart.mu, trainer.popart.sigma)
    assert isinstance(m["popart_mu"], float) and m["popart_sigma"] > 100.0 and "reward_scale" not in m
    off_losses, off_errors, off_m, _ = result["off"]
    assert min(off_losses) > 1e5, off_losses
    assert off_errors[-1] > 0.95 * off_errors[0], off_errors
    assert "popart_mu" not in off_m


@pytest.mark.parametrize("mode", ["dac", "ppoc"])
def test_popart_with_options_trains_with_finite_losses(mode: str) -> None:
    trainer = popart_trainer(mode=mode, policy=dict(options=3))
    a = empty_batch(SPEC, B=2, T=8, N=4)
    rng = np.random.default_rng(1)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["reward"][:] = 500.0 * rng.normal(size=a["reward"].shape)
    a["option"][:] = rng.integers(0, 3, size=a["option"].shape)
    a["option_start"][:] = rng.random(a["option_start"].shape) < 0.3
    a["logp_option"][:] = math.log(1 / 3)
    for version in range(3):
        m = trainer.update(batch_message(SPEC, a), version)
        for k in ("loss/value", "loss/master", "loss/termination", "loss/total"):
            assert math.isfinite(m[k]), (mode, k, m[k])
    assert m["loss/value"] < 10.0 and m["popart_sigma"] > 10.0


# ------------------------------------------------------------------------------------------------ checkpoint
def test_the_statistics_survive_a_checkpoint_round_trip(tmp_path) -> None:
    cfg = config.defaults()
    cfg["policy"]["hidden"] = [16]
    trainer = popart_trainer()
    for version in range(3):
        trainer.update(big_batch(seed=version), version)
    path = ckpt.save(tmp_path, trainer.model, trainer.optimizer, version=3, updates=3, steps_consumed=0,
                     config=cfg, spec=SPEC.to_dict(), trainer=trainer.state_dict())
    state = ckpt.load(path)
    assert state["trainer"]["popart"]["sigma"] == trainer.popart.sigma

    fresh = popart_trainer(seed=1)
    ckpt.restore(state, fresh.model, fresh.optimizer, rng=False)
    x = torch.randn(32, 3)
    assert not torch.allclose(fresh._q(x), trainer._q(x))  # the layer alone is in PopArt's units ...
    fresh.load_state_dict(state["trainer"])  # ... the statistics make them values again (--resume)
    assert (fresh.popart.mu, fresh.popart.sigma) == (trainer.popart.mu, trainer.popart.sigma)
    assert fresh.popart.state_dict() == trainer.popart.state_dict()
    torch.testing.assert_close(fresh._q(x), trainer._q(x), rtol=0, atol=0)
    # an older checkpoint (no popart entry) or another mode's: fresh statistics, nothing raises
    older = popart_trainer()
    older.load_state_dict({"reward_scaler": None})
    assert (older.popart.mu, older.popart.sigma) == (0.0, 1.0)
    other = Trainer(make_model(SPEC, hidden=[16]), learner_cfg(reward_scale="return"), "cpu")
    other.load_state_dict(state["trainer"])
    assert other.popart is None and other.state_dict()["popart"] is None


def test_the_model_and_its_weights_message_carry_nothing_of_popart() -> None:
    """Workers, evaluation and export read the model's state dict: PopArt adds no entry to it (its statistics
    live in the trainer's state), and the critic it rescales is a head none of them reads."""
    popart, off = popart_trainer(), Trainer(make_model(SPEC, hidden=[16]), learner_cfg(), "cpu")
    assert set(popart.model.state_dict()) == set(off.model.state_dict())


# ------------------------------------------------------------------------------------------------ config
def test_config_accepts_popart_and_refuses_other_kinds_naming_the_key_and_the_choices() -> None:
    assert config.load(None, ["learner.reward_scale=popart"])["learner"]["reward_scale"] == "popart"
    assert config.defaults()["learner"]["reward_scale"] == "return"  # the ablation chose it (docs/learning)
    with pytest.raises(config.ConfigError) as info:
        config.load(None, ["learner.reward_scale=bad"])
    text = str(info.value)
    assert "learner.reward_scale" in text and all(repr(k) in text for k in ("off", "return", "popart"))
    with pytest.raises(config.ConfigError, match="learner.popart_beta"):
        config.load(None, ["learner.popart_beta=0"])
