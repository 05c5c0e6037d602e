"""Trainer updates on synthetic batches in the wire's batch layout, and checkpoint round trips."""
from __future__ import annotations

import numpy as np
import pytest
from support.batches import bandit_batch, batch_message, empty_batch, learner_cfg, make_model, spec_of
import torch

from zclaw import config
from zclaw.learner import checkpoint as ckpt
from zclaw.learner.trainer import PreparedBatch, Trainer
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config


def mean_action(model: OptionPolicy, rng: np.random.Generator) -> float:
    obs = torch.from_numpy(rng.normal(size=(256, 1)).astype(np.float32))
    z, start = torch.zeros(256, dtype=torch.long), torch.ones(256, dtype=torch.bool)
    out = model.act(obs, z, start, deterministic=True)
    return float(out["action"].mean())


def test_bandit_moves_the_mean_action_toward_the_best_action() -> None:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    spec = spec_of(1, 1)
    model = make_model(spec, hidden=[32])
    trainer = Trainer(model, learner_cfg(lr=3e-3, epochs=4, minibatches=2), "cpu")
    before = mean_action(model, rng)
    assert abs(before) < 0.1  # the actor's output layer starts near 0
    first_value_loss = None
    for version in range(60):
        m = trainer.update(bandit_batch(model, spec, rng), version)
        first_value_loss = m["loss/value"] if first_value_loss is None else first_value_loss
        assert np.isfinite(m["loss/policy"]) and m["lag_mean"] == version  # batches were made at version 0
    after = mean_action(model, rng)
    assert abs(after - 0.5) < 0.15, (before, after)
    assert abs(after - 0.5) < abs(before - 0.5) - 0.25
    assert m["loss/value"] < first_value_loss  # the critic learned the reward level


def test_target_kl_stops_the_epochs_early_and_zero_runs_them_all() -> None:
    spec = spec_of(1, 1)
    steps = {}
    for target in (0.0, 1e-9):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        model = make_model(spec, hidden=[16])
        trainer = Trainer(model, learner_cfg(lr=3e-3, epochs=3, minibatches=4, target_kl=target), "cpu")
        m = trainer.update(bandit_batch(model, spec, rng), 0)
        steps[target] = (m["sgd_steps"], m["kl_stopped"])
    assert steps[0.0] == (12.0, 0.0)  # 3 epochs x 4 minibatches
    # the first step moved the policy past any tiny KL: stop before the second
    assert steps[1e-9] == (1.0, 1.0)


def test_metrics_and_priorities() -> None:
    torch.manual_seed(1)
    spec = spec_of(3, 2)
    model = make_model(spec, hidden=[16])
    # raw rewards: segment 1's advantages are then 10x segment 0's by construction
    trainer = Trainer(model, learner_cfg(epochs=2, minibatches=3, reward_scale="off"), "cpu")
    rng = np.random.default_rng(1)
    a = empty_batch(spec, B=2, T=5, N=3, version=7)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["action"][:] = rng.normal(size=a["action"].shape)
    a["reward"][0] = 0.01
    a["reward"][1] = rng.normal(size=(5, 3)) * 10.0  # segment 1 is much more surprising
    a["policy_version"][1] = [5, 5, 6, 6, 6]
    a["logp_action"][:] = -20.0  # behaviour gave these actions tiny probability: rho = pi/mu >> 1
    m = trainer.update(batch_message(spec, a), version=8)
    for key in ("loss/policy", "loss/value", "loss/entropy", "loss/student", "approx_kl", "clip_frac",
                "rho_mean", "rho_clipped_frac", "lag_mean", "lag_max", "explained_variance"):
        assert isinstance(m[key], float), key
    assert m["lag_max"] == 3.0
    assert m["lag_mean"] == pytest.approx((5 * 1 + 3 + 3 + 2 + 2 + 2) / 10)
    assert m["rho_clipped_frac"] == 1.0 and m["rho_mean"] > 1.0
    assert m["clip_frac"] == 1.0
    assert len(m["priorities"]) == 2 and m["priorities"][1] > 10 * m["priorities"][0]


def test_truncated_steps_bootstrap_from_final_obs_in_the_right_column() -> None:
    torch.manual_seed(2)
    spec = spec_of(2, 1)
    model = make_model(spec, hidden=[8])
    gamma = 0.9
    trainer = Trainer(model, learner_cfg(gamma=gamma, rho_bar=1.0, c_bar=1.0), "cpu")
    rng = np.random.default_rng(2)
    B, T, N = 2, 3, 2
    a = empty_batch(spec, B, T, N)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["reward"][:] = 1.0
    a["truncated"][1, 0, 1] = True  # segment 1, step 0, env 1: time limit -> column 1*N + 1 = 3
    a["terminated"][0, 1, 0] = True  # segment 0, step 1, env 0: terminal -> column 0
    a["final_obs"] = np.array([[3.0, -2.0]], np.float32)
    a["final_at"] = np.array([[1, 0, 1]], np.int32)
    p = trainer.prepare(batch_message(spec, a), version=0, update_norm=False)
    with torch.no_grad():
        v_final = float(model.q(model.obs_norm(torch.tensor([[3.0, -2.0]])))[0, 0])
    assert float(p.rewards[0, 3]) == pytest.approx(1.0 + gamma * v_final, abs=1e-5)
    assert float(p.discounts[0, 3]) == 0.0 and float(p.discounts[1, 0]) == 0.0
    assert float(p.rewards[1, 0]) == 1.0  # terminal: no bootstrap
    # V-trace target at the truncated step is exactly r + gamma V(final_obs) (rho clipped to <= 1 times TD)
    rho = min(1.0, float(torch.exp(p.log_rhos[0, 3])))
    v0 = float(p.values[0, 3])
    assert float(p.vs[0, 3]) == pytest.approx(v0 + rho * (1.0 + gamma * v_final - v0), abs=1e-5)
    assert float(p.vs[1, 0]) == pytest.approx(v0_col(p, 1, 0) + rho_at(p, 1, 0) * (1.0 - v0_col(p, 1, 0)),
                                              abs=1e-5)
    # every other entry is unchanged by the final observation
    mask = torch.ones(T, B * N, dtype=torch.bool)
    mask[0, 3] = False
    assert torch.all(p.rewards[mask] == 1.0)


def v0_col(p: PreparedBatch, t: int, c: int) -> float:
    return float(p.values[t, c])


def rho_at(p: PreparedBatch, t: int, c: int) -> float:
    return min(1.0, float(torch.exp(p.log_rhos[t, c])))


def test_zero_importance_weight_leaves_parameters_unchanged() -> None:
    torch.manual_seed(3)
    spec = spec_of(2, 1)
    model = make_model(spec, hidden=[8])
    trainer = Trainer(model, learner_cfg(lr=1e-2), "cpu")
    a = empty_batch(spec, 2, 4, 2)
    a["obs"][:] = np.random.default_rng(3).normal(size=a["obs"].shape)
    a["reward"][:] = 5.0
    a["is_weight"][:] = 0.0
    params = [p.detach().clone() for p in model.parameters()]
    trainer.update(batch_message(spec, a), 0)
    assert all(torch.equal(p0, p1) for p0, p1 in zip(params, model.parameters()))
    a["is_weight"][:] = 1.0
    trainer.update(batch_message(spec, a), 0)
    assert not all(torch.equal(p0, p1) for p0, p1 in zip(params, model.parameters()))


def test_checkpoint_round_trip_restores_outputs_version_and_rng(tmp_path) -> None:
    torch.manual_seed(4)
    rng = np.random.default_rng(4)
    spec = spec_of(1, 1)
    cfg = config.defaults()
    cfg["policy"]["hidden"] = [16]
    model = OptionPolicy(policy_config(cfg["policy"], spec))
    trainer = Trainer(model, learner_cfg(lr=3e-3), "cpu")
    for v in range(3):
        trainer.update(bandit_batch(model, spec, rng), v)
    batch = bandit_batch(model, spec, rng)
    path = ckpt.save(tmp_path, model, trainer.optimizer, version=3, updates=3, steps_consumed=384, config=cfg,
                     spec=spec.to_dict(), trainer=trainer.state_dict())
    assert path.name == "ckpt-00000003.pt" and (tmp_path / "latest.pt").is_file()
    m_orig = trainer.update(batch, 3)  # continues from the saved RNG state

    state = ckpt.load(tmp_path)
    assert state["version"] == 3 and state["updates"] == 3 and state["steps_consumed"] == 384
    assert state["config"]["policy"]["hidden"] == [16] and state["spec"] == spec.to_dict()
    fresh = OptionPolicy(policy_config(cfg["policy"], spec))
    fresh_trainer = Trainer(fresh, learner_cfg(lr=3e-3), "cpu")
    ckpt.check_compatible(state, spec.to_dict(), fresh.cfg)
    ckpt.restore(state, fresh, fresh_trainer.optimizer, rng=False)
    # identical outputs (including the observation normaliser statistics) ...
    reloaded = OptionPolicy(policy_config(cfg["policy"], spec))
    ckpt.restore(ckpt.load(tmp_path / "latest.pt"), reloaded, rng=False)
    obs = torch.randn(10, 1)
    z, start = torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=torch.bool)
    for k in ("action", "logp_action"):
        torch.testing.assert_close(reloaded.act(obs, z, start, deterministic=True)[k],
                                   fresh.act(obs, z, start, deterministic=True)[k], rtol=0, atol=0)
    # ... and the next update is the same one, bit for bit (optimiser moments and RNG restored)
    ckpt.restore(state, fresh, fresh_trainer.optimizer)  # now with the RNG states, right before the update
    assert fresh_trainer.reward_scaler.state_dict() != trainer.reward_scaler.state_dict()
    fresh_trainer.load_state_dict(state["trainer"])  # the reward scale the saved trainer had reached
    m_fresh = fresh_trainer.update(batch, 3)
    for k in ("loss/policy", "loss/value", "loss/student", "approx_kl"):
        assert m_fresh[k] == m_orig[k], k
    for p0, p1 in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p0, p1)


def test_a_checkpoint_restores_the_moments_but_not_how_the_saver_ran_adam(tmp_path) -> None:
    """A checkpoint written by a learner with another Adam kernel (plain Adam: an older torch, another device)
    gives its moments to this learner, whose own kernel (fused where torch has one) stays."""
    torch.manual_seed(5)
    rng = np.random.default_rng(5)
    spec = spec_of(1, 1)
    model = make_model(spec, hidden=[8])
    trainer = Trainer(model, learner_cfg(), "cpu")
    plain = torch.optim.Adam([{"params": g["params"], "lr": g["lr"]} for g in trainer.optimizer.param_groups],
                             eps=1e-5, foreach=False)
    trainer.optimizer = plain  # the saver's optimiser ran the plain per-tensor loop
    trainer.update(bandit_batch(model, spec, rng), 0)
    ckpt.save(tmp_path, model, plain, version=1, updates=1, steps_consumed=128, config=config.defaults(),
              spec=spec.to_dict(), trainer=trainer.state_dict())
    fresh_trainer = Trainer(make_model(spec, hidden=[8]), learner_cfg(), "cpu")
    own = [(g.get("fused"), g.get("foreach")) for g in fresh_trainer.optimizer.param_groups]
    ckpt.restore(ckpt.load(tmp_path), fresh_trainer.model, fresh_trainer.optimizer, rng=False)
    assert [(g.get("fused"), g.get("foreach")) for g in fresh_trainer.optimizer.param_groups] == own
    assert plain.param_groups[0]["foreach"] is False and own[0] != (None, False)
    for p0, p1 in zip(trainer.model.parameters(), fresh_trainer.model.parameters()):
        s0, s1 = plain.state[p0], fresh_trainer.optimizer.state[p1]
        if s0:
            assert torch.equal(s0["exp_avg"], s1["exp_avg"])
            assert torch.equal(s0["exp_avg_sq"], s1["exp_avg_sq"])
    fresh_trainer.update(bandit_batch(fresh_trainer.model, spec, rng), 1)  # and the next step runs


def test_checkpoint_refuses_another_spec_or_architecture_and_keeps_three(tmp_path) -> None:
    spec = spec_of(2, 1)
    cfg = config.defaults()
    model = OptionPolicy(policy_config(cfg["policy"], spec))
    for v in range(5):
        ckpt.save(tmp_path, model, None, version=v, updates=v, steps_consumed=0, config=cfg,
                  spec=spec.to_dict())
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == [f"ckpt-0000000{v}.pt" for v in (2, 3, 4)]
    assert not list(tmp_path.glob("*.tmp"))
    state = ckpt.load(tmp_path)
    assert state["version"] == 4
    with pytest.raises(ckpt.CheckpointError, match="env spec"):
        ckpt.check_compatible(state, spec_of(3, 1).to_dict(), model.cfg)
    other = dict(cfg["policy"], hidden=[32])
    with pytest.raises(ckpt.CheckpointError, match="architecture"):
        ckpt.check_compatible(state, spec.to_dict(), policy_config(other, spec))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        ckpt.load(tmp_path / "nowhere")
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.load(tmp_path / "broken.pt")


def test_a_blown_up_observation_does_not_poison_the_normaliser() -> None:
    """A segment whose observations are finite but 1e30 (a simulator that blew up) that reaches the
    learner anyway leaves the statistics as the rest of the batch sets them."""
    torch.manual_seed(0)
    spec = spec_of(3, 1)
    rng = np.random.default_rng(0)
    a = empty_batch(spec, B=2, T=8, N=4)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    clean = {k: v.copy() for k, v in a.items()}
    a["obs"][1, 3, 2] = 1e30
    poisoned, reference = (Trainer(make_model(spec, hidden=[8]), learner_cfg(), "cpu", obs_max_abs=1e6)
                           for _ in range(2))
    poisoned.prepare(batch_message(spec, a), 0)
    keep = np.ones((2, 8, 4), bool)
    keep[1, 3, 2] = False
    reference.model.obs_norm.update(torch.as_tensor(clean["obs"][:, :8][keep]))
    assert poisoned.norm_left_out == 1
    for name in ("mean", "var"):
        got = getattr(poisoned.model.obs_norm, name)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, getattr(reference.model.obs_norm, name))
    # what the network is fed stays clipped, the blown-up row included
    x = poisoned.model.obs_norm(torch.as_tensor(a["obs"][1, 3]))
    assert float(x.abs().max()) <= 10.0


@pytest.mark.parametrize("options", [1, 2])
def test_log_std_min_floors_the_sigma_a_bandit_would_shrink(options: int) -> None:
    """The bandit rewards acting exactly at 0.5, so the policy narrows; without a floor its log std
    falls below -1, with ``log_std_min = -1`` every option's stays on or above it (and the floor binds)."""
    spec = spec_of(1, 1)
    lowest = {}
    for floor in (-20.0, -1.0):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        model = make_model(spec, hidden=[16], options=options, init_log_std=-0.8)
        trainer = Trainer(model, learner_cfg(lr=2e-2, epochs=4, minibatches=2, target_kl=0.0,
                                             log_std_min=floor), "cpu")
        for version in range(40):
            trainer.update(bandit_batch(model, spec, rng), version)
        raw = torch.cat([p.detach().flatten() for p in trainer.log_std_params])
        assert float(raw.min()) >= floor
        lowest[floor] = float(model.option_log_std().detach().min())
    assert lowest[-20.0] < -1.0, lowest  # the bandit does shrink sigma past the floor
    assert lowest[-1.0] == pytest.approx(-1.0, abs=1e-6), lowest  # the floor holds, and binds


def test_log_std_min_lifts_weights_the_trainer_did_not_step() -> None:
    """A fresh model whose ``init_log_std`` is under the floor is lifted when the trainer is built, so the
    version-0 weights workers act with obey the floor too; the student's log std (it only imitates) is not."""
    spec = spec_of(1, 2)
    model = make_model(spec, hidden=[16], options=2, init_log_std=-3.0)
    Trainer(model, learner_cfg(log_std_min=-1.5), "cpu")
    assert float(model.log_std.detach().min()) == pytest.approx(-1.5)
    assert float(model.student_log_std.detach().max()) == pytest.approx(-3.0)
