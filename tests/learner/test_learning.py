"""A real training signal: short runs on MuJoCo tasks beat the policy they started from.

In one process (the pipeline's processes and sockets are covered by tests/system/test_e2e.py): a batched
gym env, the option policy acting call-and-return, segments in wire layout through a real ``batch``
message, and the Trainer, for a fixed number of updates (a loaded machine trains as far, only slower).
The comparison is with the return of the same policy before training, measured in this run, not with
a fixed number.

* an option learner (K = 2, DAC) on Reacher-v5 (50-step episodes; the initial policy scores about -43);
* the default config, untouched, on InvertedPendulum-v5, a task no config here was tuned for: the CI-sized
  part of ``bench/suite.py``'s question, does the default learn on a task it has never seen.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from support.batches import batch_message

from zclaw import config
from zclaw.envs import make_env
from zclaw.learner.trainer import Trainer
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config

pytestmark = pytest.mark.slow

T, N = 64, 16
UPDATES = 25  # of the default config: 25 x 4 segments x 64 steps x 16 envs = 102k env steps


def collect(env, model: OptionPolicy, state: dict, version: int) -> Tuple[Dict[str, np.ndarray], List[float]]:
    """One T x N segment in wire layout, acting call-and-return; returns the arrays and finished returns."""
    spec = env.spec
    D, A = spec.obs_shape[0], spec.action_shape[0]
    low, high = torch.tensor(spec.action_low), torch.tensor(spec.action_high)
    a = {
        "obs": np.zeros((T + 1, N, D), np.float32), "action": np.zeros((T, N, A), np.float32),
        "reward": np.zeros((T, N), np.float32), "terminated": np.zeros((T, N), bool),
        "truncated": np.zeros((T, N), bool), "option": np.zeros((T, N), np.int32),
        "option_start": np.zeros((T, N), bool), "logp_action": np.zeros((T, N), np.float32),
        "logp_option": np.zeros((T, N), np.float32), "policy_version": np.full((T,), version, np.int64),
    }
    finals, returns = [], []
    obs = state["obs"]
    for t in range(T):
        out = model.act(obs, state["prev"], state["start"])
        res = env.step(torch.max(torch.min(out["action"], high), low))
        a["obs"][t] = obs.numpy()
        a["action"][t] = out["action"].numpy()
        a["reward"][t] = res.reward.numpy()
        a["terminated"][t] = res.terminated.numpy()
        a["truncated"][t] = res.truncated.numpy()
        for k in ("option", "option_start", "logp_action", "logp_option"):
            a[k][t] = out[k].numpy()
        for n, fo in res.final_obs.items():
            finals.append((0, t, int(n), fo.numpy()))
        returns += [float(ep["return"]) for ep in res.episodes]
        state["start"] = res.terminated | res.truncated
        state["prev"] = out["option"]
        obs = res.obs
    a["obs"][T] = obs.numpy()
    state["obs"] = obs
    a["final_obs"] = np.array([f[3] for f in finals], np.float32).reshape(-1, D)
    a["final_at"] = np.array([f[:3] for f in finals], np.int32).reshape(-1, 3)
    return a, returns


def as_batch(spec, segments: List[Dict[str, np.ndarray]]):
    arrays = {k: np.stack([s[k] for s in segments])
              for k in segments[0] if k not in ("final_obs", "final_at")}
    fo, fa = [], []
    for b, s in enumerate(segments):
        fo.append(s["final_obs"])
        fa.append(np.concatenate([np.full((len(s["final_at"]), 1), b, np.int32), s["final_at"][:, 1:]], 1))
    arrays["final_obs"] = np.concatenate(fo).astype(np.float32)
    arrays["final_at"] = np.concatenate(fa).astype(np.int32)
    arrays["is_weight"] = np.ones(len(segments), np.float32)
    return batch_message(spec, arrays)


def mean_return(env, model: OptionPolicy, state: dict, episodes: int) -> float:
    got: List[float] = []
    while len(got) < episodes:
        _, r = collect(env, model, state, 0)
        got += r
    return float(np.mean(got))


@pytest.mark.parametrize("options,mode", [(2, "dac")])
def test_short_reacher_run_improves_on_the_random_policy(options: int, mode: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    env = make_env("gym:Reacher-v5", N, seed=0, device=torch.device("cpu"))
    cfg = config.defaults()
    cfg["policy"]["options"] = options
    model = OptionPolicy(policy_config(cfg["policy"], env.spec))
    lc = dict(cfg["learner"], lr=1e-3, minibatches=8, mode=mode)
    trainer = Trainer(model, lc, "cpu", action_low=env.spec.action_low, action_high=env.spec.action_high)
    state = {"obs": env.reset(seed=0), "prev": torch.zeros(N, dtype=torch.long),
             "start": torch.ones(N, dtype=torch.bool)}
    before = mean_return(env, model, state, 64)
    version = 0
    train_returns: List[float] = []
    while version < 60:  # a fixed number of updates, not a time budget: a loaded machine trains as far
        segs = []
        for _ in range(2):
            a, r = collect(env, model, state, version)
            segs.append(a)
            train_returns += r
        m = trainer.update(as_batch(env.spec, segs), version)
        version += 1
        assert np.isfinite(m["loss/total"])
    after = mean_return(env, model, state, 64)
    env.close()
    # a real improvement: well past the noise of 64 episodes (their std of the mean is ~1)
    assert after > before + 8.0, (before, after, version)
    health = trainer.health_summary()
    assert sum(health["usage"]) == pytest.approx(1.0)


def test_the_default_config_learns_a_task_nobody_tuned_it_for() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = config.load(str(Path(__file__).resolve().parents[2] / "configs" / "default.toml"))
    assert (T, N) == (cfg["worker"]["segment_length"], cfg["worker"]["envs"])  # the default worker's shape
    env = make_env("gym:InvertedPendulum-v5", N, seed=0, device=torch.device("cpu"))
    model = OptionPolicy(policy_config(cfg["policy"], env.spec))
    trainer = Trainer(model, cfg["learner"], "cpu", action_low=env.spec.action_low,
                      action_high=env.spec.action_high)
    state = {"obs": env.reset(seed=0), "prev": torch.zeros(N, dtype=torch.long),
             "start": torch.ones(N, dtype=torch.bool)}
    before = mean_return(env, model, state, 64)
    for version in range(UPDATES):
        segs = [collect(env, model, state, version)[0] for _ in range(cfg["learner"]["batch_segments"])]
        m = trainer.update(as_batch(env.spec, segs), version)
        assert np.isfinite(m["loss/total"])
    after = mean_return(env, model, state, 64)
    env.close()
    # the pendulum pays 1 per step upright (at most 1000); a random policy keeps it up for ~5-10 steps
    assert after > 4 * before and after > before + 30, (before, after)
