"""Env backends: the prefix registry's errors, and the gym backend's reset/truncation/flattening/seeding."""
from __future__ import annotations

import collections
import sys
from typing import Any, Dict, Optional, Tuple

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from zclaw.envs import BACKENDS, BackendUnavailable, make_env, register_backend
from zclaw.envs.gym_backend import GymBatchedEnv

CPU = torch.device("cpu")

# ----------------------------------------------------------------------- a tiny env with a Dict space


class DictObsEnv(gym.Env):
    """Dict observations (keys deliberately declared out of order), a Discrete entry, a nested Dict;
    terminates after 3 steps reporting ``is_success``; observation values encode the step count."""

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            collections.OrderedDict(
                [
                    ("b", spaces.Box(-10, 10, (2,), np.float64)),
                    ("a", spaces.Box(-10, 10, (3,), np.float32)),
                    ("c", spaces.Discrete(3)),
                    ("nested", spaces.Dict(collections.OrderedDict([("z", spaces.Box(-10, 10, (1,))),
                                                                    ("y", spaces.Box(-10, 10, (2, 1)))]))),
                ]
            )
        )
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.t = 0

    def _obs(self) -> Dict[str, Any]:
        t = float(self.t)
        return collections.OrderedDict(
            [
                ("b", np.array([4.0, 5.0]) + t),
                ("a", np.array([1.0, 2.0, 3.0], np.float32) + t),
                ("c", self.t % 3),
                ("nested", {"z": np.array([9.0], np.float32), "y": np.array([[7.0], [8.0]], np.float32)}),
            ]
        )

    def reset(self, *, seed: Optional[int] = None,
              options: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> Tuple[Dict[str, Any], float, bool, bool, Dict[str, Any]]:
        self.t += 1
        done = self.t >= 3
        return self._obs(), float(self.t), done, False, ({"is_success": True} if done else {})


gym.register("ZclawDictObs-v0", entry_point=DictObsEnv, max_episode_steps=100)


def flat_expected(t: int) -> np.ndarray:
    # sorted keys: a(3), b(2), c(one-hot 3), nested{y(2), z(1)}
    onehot = np.eye(3)[t % 3]
    return np.concatenate([[1 + t, 2 + t, 3 + t], [4 + t, 5 + t], onehot, [7, 8], [9]]).astype(np.float32)


# --------------------------------------------------------------------------------------- registry


def test_unknown_prefix_lists_known_backends() -> None:
    with pytest.raises(ValueError) as err:
        make_env("nosuch:Thing-v0", 1, 0, CPU)
    assert "'nosuch:'" in str(err.value) and "gym:" in str(err.value)
    with pytest.raises(ValueError, match="no backend prefix.*gym:"):
        make_env("Reacher-v5", 1, 0, CPU)


def test_unknown_gym_id_is_named() -> None:
    with pytest.raises(ValueError, match="NoSuchArm-v3"):
        make_env("gym:NoSuchArm-v3", 1, 0, CPU)


def test_missing_backend_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # gymnasium "not installed": the import inside the gym factory fails
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    monkeypatch.delitem(sys.modules, "zclaw.envs.gym_backend", raising=False)
    with pytest.raises(BackendUnavailable, match=r"pip install 'gymnasium\[mujoco\]"):
        make_env("gym:Reacher-v5", 1, 0, CPU)


def test_registered_backend_is_used_and_its_import_error_reported() -> None:
    def factory(name: str, n: int, seed: int, device: torch.device) -> Any:
        import zclaw_no_such_backend_pkg  # noqa: F401

    register_backend("fakesim", factory, install="pip install fakesim")
    try:
        with pytest.raises(BackendUnavailable, match="pip install fakesim"):
            make_env("fakesim:Arm", 2, 0, CPU)
        with pytest.raises(ValueError, match="fakesim:"):  # now listed among the known prefixes
            make_env("other:Arm", 2, 0, CPU)
    finally:
        del BACKENDS["fakesim"]


# ------------------------------------------------------------------------------------- gym backend


def test_reacher_truncates_at_50_with_final_obs_and_episode_stats() -> None:
    N = 3
    env = make_env("gym:Reacher-v5", N, 123, CPU)
    try:
        assert isinstance(env, GymBatchedEnv)
        spec = env.spec
        assert spec.env_id == "gym:Reacher-v5" and spec.obs_shape == (10,) and spec.action_shape == (2,)
        assert spec.action_low == (-1.0, -1.0) and spec.action_high == (1.0, 1.0)
        obs = env.reset()
        assert obs.dtype == torch.float32 and obs.shape == (N, 10) and obs.device == CPU
        rng = np.random.default_rng(0)
        rewards = np.zeros(N)
        for t in range(50):
            action = torch.as_tensor(rng.uniform(-1, 1, (N, 2)), dtype=torch.float32)
            res = env.step(action)
            assert res.reward.dtype == torch.float32 and res.reward.shape == (N,)
            assert res.terminated.dtype == torch.bool and res.truncated.dtype == torch.bool
            rewards += res.reward.double().numpy()
            if t < 49:
                assert not res.truncated.any() and not res.terminated.any()
                assert res.final_obs == {} and res.episodes == []
                last_obs = res.obs
        assert res.truncated.all() and not res.terminated.any()
        assert sorted(res.final_obs) == list(range(N))
        for i in range(N):
            final = res.final_obs[i]
            assert final.shape == (10,) and final.dtype == torch.float32
            assert not torch.equal(final, res.obs[i])  # obs is the reset obs, final_obs the real last one
            assert not torch.equal(final, last_obs[i])  # and it is the obs after step 50, not before
        assert len(res.episodes) == N
        for ep, ret in zip(res.episodes, rewards):
            assert ep["length"] == 50 and "success" not in ep  # Reacher reports no success
            assert ep["return"] == pytest.approx(ret, rel=1e-5, abs=1e-4)
        res = env.step(torch.zeros(N, 2))  # the next episode counts from 1 again
        assert not res.truncated.any() and res.episodes == []
    finally:
        env.close()


def test_dict_observations_are_flattened_in_sorted_key_order() -> None:
    env = make_env("gym:ZclawDictObs-v0", 2, 0, CPU)
    try:
        assert env.spec.obs_shape == (11,)
        obs = env.reset()
        np.testing.assert_array_equal(obs.numpy(), np.stack([flat_expected(0)] * 2))
        res = env.step(torch.zeros(2, 1))
        np.testing.assert_array_equal(res.obs.numpy()[0], flat_expected(1))
        env.step(torch.zeros(2, 1))
        res = env.step(torch.zeros(2, 1))  # step 3 terminates: success reported, no final_obs
        assert res.terminated.all() and not res.truncated.any() and res.final_obs == {}
        assert res.episodes == [{"return": 6.0, "length": 3, "success": True}] * 2
        np.testing.assert_array_equal(res.obs.numpy()[1], flat_expected(0))  # auto-reset obs
    finally:
        env.close()


def test_seeding_is_deterministic_and_env_i_uses_seed_plus_i() -> None:
    def rollout(seed: int, n: int = 3, steps: int = 60) -> np.ndarray:
        env = make_env("gym:Reacher-v5", n, seed, CPU)
        try:
            out = [env.reset().numpy()]
            for t in range(steps):
                a = torch.full((n, 2), 0.5 if t % 2 else -0.5)
                out.append(env.step(a).obs.numpy())  # includes auto-reset obs (no reseeding there)
            return np.stack(out)
        finally:
            env.close()

    a, b = rollout(7), rollout(7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[:, 0], a[:, 1])  # envs in a batch differ
    c = rollout(8)
    np.testing.assert_array_equal(a[:, 1], c[:, 0])  # env 1 of seed 7 is env 0 of seed 8
    assert not np.array_equal(a[:, 0], c[:, 0])


def test_step_before_reset_and_bad_actions_are_refused() -> None:
    env = make_env("gym:Reacher-v5", 2, 0, CPU)
    try:
        with pytest.raises(RuntimeError, match="before reset"):
            env.step(torch.zeros(2, 2))
        env.reset()
        with pytest.raises(ValueError):
            env.step(torch.zeros(3, 2))
    finally:
        env.close()


# --------------------------------------------------------------------------- the three prefixes


def test_every_backend_prefix_is_listed_in_the_unknown_prefix_error() -> None:
    with pytest.raises(ValueError) as err:
        make_env("isaaclab:Thing", 1, 0, CPU)
    for prefix in ("gym:", "isaacgym:", "mjwarp:"):
        assert prefix in str(err.value)


def test_missing_isaacgym_and_mjwarp_say_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "isaacgym", None)  # "not installed"
    monkeypatch.delitem(sys.modules, "zclaw.envs.isaacgym_backend", raising=False)
    with pytest.raises(BackendUnavailable,
                       match=r"isaacgym:.*Isaac Gym Preview 4.*Python 3\.8.*docs/isaacgym\.md"):
        make_env("isaacgym:Ant", 1, 0, CPU)
    monkeypatch.setitem(sys.modules, "mujoco_warp", None)
    monkeypatch.delitem(sys.modules, "zclaw.envs.mjwarp_backend", raising=False)
    with pytest.raises(BackendUnavailable, match=r"mjwarp:.*pip install 'zclaw\[mjwarp\]'"):
        make_env("mjwarp:Reach", 1, 0, CPU)


def test_preimport_is_torch_free_and_a_noop_for_other_backends() -> None:
    import subprocess

    code = ("import sys; from zclaw.envs import preimport; preimport('gym:Reacher-v5'); "
            "assert 'torch' not in sys.modules, 'zclaw.envs.preload must not import torch'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
