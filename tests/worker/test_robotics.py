"""gymnasium-robotics under ``gym:``: Fetch and ShadowHand with this MuJoCo (the enum patch), the dict
observation rule, is_success in episode stats, subprocess vectorisation equal to the loop, and both task
families stepping through a real worker into a real broker (with a real learner serving weights)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("gymnasium_robotics", reason="pip install 'zclaw[robotics]' (in the test extra)")

from zclaw.envs import make_env  # noqa: E402
from zclaw.envs import robotics  # noqa: E402

CPU = torch.device("cpu")
FETCH, HAND = "FetchReachDense-v4", "HandReach-v3"


def test_fetch_and_hand_build_with_this_mujoco() -> None:
    """Without zclaw's patch, gymnasium-robotics fails in make on mujoco >= 3.12; with it
    both families build."""
    if robotics.comparison_broken():
        code = ("import gymnasium as gym, gymnasium_robotics; gym.register_envs(gymnasium_robotics); "
                f"gym.make({FETCH!r})")
        p = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode != 0 and "AssertionError" in p.stderr  # the bug the patch exists for
    for name, obs_dim, act_dim in ((FETCH, 16, 4), (HAND, 93, 20)):
        env = make_env("gym:" + name, 1, 0, CPU)
        try:
            assert env.spec.obs_shape == (obs_dim,) and env.spec.action_shape == (act_dim,)
            assert env.reset().shape == (1, obs_dim)
        finally:
            env.close()


def test_fetch_dict_obs_follow_the_sorted_key_rule_and_success_reaches_episode_stats() -> None:
    env = make_env("gym:" + FETCH, 2, 5, CPU)
    raw = gym.make(FETCH)
    try:
        obs = env.reset()
        o, _ = raw.reset(seed=5)  # env 0 is seeded seed + 0
        want = np.concatenate([o["achieved_goal"], o["desired_goal"], o["observation"]]).astype(np.float32)
        np.testing.assert_allclose(obs[0].numpy(), want, rtol=1e-6)
        for t in range(50):
            # env 0 drives its gripper to the goal (a proportional controller), env 1 idles
            a = np.zeros((2, 4), np.float32)
            a[0, :3] = np.clip((obs[0, 3:6] - obs[0, 0:3]).numpy() * 10, -1, 1)
            res = env.step(torch.from_numpy(a))
            obs = res.obs
        assert res.truncated.all() and sorted(res.final_obs) == [0, 1]
        assert [ep["length"] for ep in res.episodes] == [50, 50]
        assert [ep["success"] for ep in res.episodes] == [True, False]
    finally:
        env.close()
        raw.close()


def test_subprocess_vectorize_equals_the_loop_for_the_same_seed() -> None:
    N, steps = 3, 55  # across the 50-step time limit
    rng = np.random.default_rng(1)
    actions = [torch.as_tensor(rng.uniform(-1, 1, (N, 4)), dtype=torch.float32) for _ in range(steps)]
    runs = []
    for vec in ("loop", "subprocess"):
        env = make_env("gym:" + FETCH, N, 11, CPU, vectorize=vec, env_processes=2)
        try:
            if vec == "subprocess":
                assert [n for _, n in env.slices] == [2, 1]  # type: ignore[attr-defined]
            out = [env.reset().numpy()]
            finals, episodes = [], []
            for a in actions:
                r = env.step(a)
                out += [r.obs.numpy(), r.reward.numpy(), r.truncated.numpy()]
                finals.append({i: f.numpy() for i, f in r.final_obs.items()})
                episodes.append(r.episodes)
            runs.append((out, finals, episodes))
        finally:
            env.close()
    (a_out, a_fin, a_eps), (b_out, b_fin, b_eps) = runs
    for x, y in zip(a_out, b_out):
        np.testing.assert_array_equal(x, y)
    assert a_eps == b_eps and any(a_eps)
    for fa, fb in zip(a_fin, b_fin):
        assert sorted(fa) == sorted(fb)
        for i in fa:
            np.testing.assert_array_equal(fa[i], fb[i])


def test_bad_vectorize_value_is_refused() -> None:
    with pytest.raises(ValueError, match="worker.vectorize.*'loop' or 'subprocess'"):
        make_env("gym:" + FETCH, 1, 0, CPU, vectorize="threads")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,extra",
    [(FETCH, ["--set", "worker.vectorize=subprocess", "--set", "worker.env_processes=2"]), (HAND, [])],
    ids=["fetch-subprocess", "hand-loop"],
)
def test_env_steps_through_a_worker_into_the_broker(name: str, extra: list, tmp_path: Path) -> None:
    from support.procs import Roles

    roles = Roles(tmp_path)
    try:
        roles.start("broker")
        roles.start("learner", "--run-dir", str(tmp_path / "run"))
        roles.start("worker", "--env", "gym:" + name, "--index", "0", *extra, name="worker0")
        rep = roles.wait(
            roles.broker, lambda r: r.get("episodes", 0) >= 4 and r.get("success_rate_100") is not None,
            timeout=180
        )
        assert rep["spec"]["env_id"] == "gym:" + name
        assert 0.0 <= rep["success_rate_100"] <= 1.0
        assert rep["inserted_steps"] >= 4 * 50
    finally:
        roles.close()
