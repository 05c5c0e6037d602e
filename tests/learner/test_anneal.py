"""learner.lr_anneal: the learning rate falls linearly to 0 over the run's budget (time or steps)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.batches import batch_message, empty_batch, learner_cfg, make_model, spec_of

from zclaw import config, startup
from zclaw.learner.distributed import Sync
from zclaw.learner.server import Learner
from zclaw.learner.trainer import Trainer

SPEC = spec_of(3, 1)


def spent(time_s: float, steps: int, elapsed: float, consumed: int) -> float:
    learner = SimpleNamespace(cfg={"run": {"time": time_s, "steps": steps}},
                              run_started=time.monotonic() - elapsed, steps_consumed=consumed)
    return Learner.budget_spent(learner)  # type: ignore[arg-type]


def test_the_budget_spent_is_the_larger_share_of_time_and_steps_and_0_without_either() -> None:
    assert spent(300.0, 0, 75.0, 10**9) == pytest.approx(0.25, abs=0.01)  # --time alone: steps do not count
    assert spent(0.0, 1000, 999.0, 400) == pytest.approx(0.4)
    assert spent(100.0, 1000, 10.0, 800) == pytest.approx(0.8)  # whichever ends the run first
    assert spent(100.0, 0, 500.0, 0) == 1.0  # past the budget: lr 0, never negative
    assert spent(0.0, 0, 1e6, 10**9) == 0.0


def test_the_run_clock_is_zclaw_trains_start_when_it_told_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner that ``zclaw train`` restarts counts run.time from the run's start, not its own."""
    began = time.monotonic() - 120.0
    monkeypatch.setenv(startup.RUN_CLOCK_ENV, repr(began))
    assert startup.run_started() == began
    for bad in ("soon", repr(time.monotonic() + 1e6), "-5"):  # unreadable, in the future, negative: now
        monkeypatch.setenv(startup.RUN_CLOCK_ENV, bad)
        assert abs(startup.run_started() - time.monotonic()) < 1.0
    monkeypatch.delenv(startup.RUN_CLOCK_ENV)
    assert abs(startup.run_started() - time.monotonic()) < 1.0


def test_anneal_scales_the_main_rate_only_and_the_update_reports_it() -> None:
    torch.manual_seed(0)
    trainer = Trainer(make_model(SPEC, hidden=[16]), learner_cfg(lr=1e-3, student_lr=5e-4), "cpu")
    rng = np.random.default_rng(0)
    a = empty_batch(SPEC, B=2, T=8, N=4)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["reward"][:] = rng.normal(size=a["reward"].shape)
    trainer.anneal(0.25)
    groups = trainer.optimizer.param_groups
    assert groups[0]["lr"] == pytest.approx(2.5e-4) and groups[1]["lr"] == pytest.approx(5e-4)
    assert trainer.update(batch_message(SPEC, a), 0)["lr"] == pytest.approx(2.5e-4)
    before = [p.detach().clone() for p in trainer.main_params]
    trainer.anneal(-0.5)  # clamped: spent budget gives 0, and a rate of 0 leaves the policy as it is
    assert groups[0]["lr"] == 0.0
    trainer.update(batch_message(SPEC, a), 1)
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.main_params))


def test_a_lone_rank_votes_its_own_stop_and_progress() -> None:
    assert Sync().vote(False, 0.3) == (False, 0.3) and Sync().vote(True, 0.0)[0] is True


def test_config_refuses_an_unknown_schedule_naming_the_key_and_the_choices() -> None:
    with pytest.raises(config.ConfigError, match="lr_anneal.*linear"):
        config.load(None, ["learner.lr_anneal=cosine"])
