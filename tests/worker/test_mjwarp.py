"""The ``mjwarp:`` backend on Warp's CPU device: slow (the first step compiles MuJoCo Warp's kernels, about a
minute when ~/.cache/warp is cold), so marked ``slow``; skipped where ``zclaw[mjwarp]`` is not installed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp", reason="pip install 'zclaw[mjwarp]' (MuJoCo Warp; not in the CI install)")

from zclaw.envs import make_env  # noqa: E402
from zclaw.worker.worker import SegmentBuffer  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.slow
def test_mjwarp_reach_steps_truncates_resets_and_fills_a_segment() -> None:
    N, T = 6, 64
    env = make_env("mjwarp:Reach", N, 3, CPU)
    try:
        spec = env.spec
        assert spec.env_id == "mjwarp:Reach" and spec.obs_shape == (15,) and spec.action_shape == (3,)
        assert spec.action_low == (-1.0,) * 3 and spec.action_high == (1.0,) * 3
        obs = env.reset()
        assert obs.shape == (N, 15) and obs.dtype == torch.float32
        # zero-copy: the env's qpos view is the simulator's memory, and the obs reflects it
        q0 = env.qpos.clone()
        buf = SegmentBuffer(T, N, spec, env.device)
        rewards = []
        for seg in range(2):  # 128 steps: the 100-step time limit falls in the second segment
            for t in range(T):
                buf.obs[t] = obs
                a = torch.full((N, 3), 0.8)
                res = env.step(a)
                buf.reward[t], buf.truncated[t], buf.terminated[t] = res.reward, res.truncated, res.terminated
                if not isinstance(res.final_obs, dict):
                    buf.record_finals(t, res.final_obs, res.obs)
                if seg == 0 and t == 0:
                    assert not torch.equal(env.qpos, q0)  # the motors moved the arm
                    np.testing.assert_allclose(res.obs[:, 0:3].numpy(), torch.cos(env.qpos).numpy(),
                                               rtol=1e-5)
                obs = res.obs
            buf.obs[T] = obs
            buf.episodes.extend(env.pop_episodes())
            arrays, episodes = buf.take()
            rewards.append(arrays["reward"])
        assert np.isfinite(arrays["reward"]).all() and (arrays["reward"] < 0).all()
        trunc = arrays["truncated"]
        assert trunc.sum() == N and trunc[100 - T - 1].all() and not arrays["terminated"].any()
        t_end = 100 - T - 1
        assert arrays["final_at"].tolist() == [[t_end, n] for n in range(N)]
        final = arrays["final_obs"]
        assert final.shape == (N, 15)
        assert not np.allclose(final, arrays["obs"][t_end + 1])  # the reset obs replaced the final one
        assert len(episodes) == N and all(ep["length"] == 100 and isinstance(ep["success"], bool)
                                          for ep in episodes)
        per_step = np.concatenate(rewards).astype(np.float64)  # [2T, N]
        np.testing.assert_allclose([ep["return"] for ep in episodes], per_step[:100].sum(0), rtol=1e-5)
    finally:
        env.close()


def test_unknown_mjwarp_task_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown mjwarp task 'Lift9'.*Reach"):
        make_env("mjwarp:Lift9", 2, 0, CPU)
