"""The learner's reward scaler on its own: VecNormalize's return statistics, computed from batches."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zclaw.learner.trainer import Trainer
from zclaw.policy.normalizer import RewardScaler
from support.batches import batch_message, empty_batch, learner_cfg, make_model, spec_of


def reference_std(reward: np.ndarray, done: np.ndarray, gamma: float) -> float:
    """SB3 VecNormalize's return statistics over one uninterrupted stream [steps, N], written out:
    ret = ret * gamma + r; fold ret into a running mean/var (mean 0, var 1, count 1e-4 at start);
    ret[done] = 0."""
    ret = np.zeros(reward.shape[1])
    seen = []
    for t in range(reward.shape[0]):
        ret = ret * gamma + reward[t]
        seen.append(ret.copy())
        ret[done[t]] = 0.0
    x = np.concatenate(seen)
    count, mean, var = 1e-4, 0.0, 1.0
    n, b_mean, b_var = x.size, x.mean(), x.var()
    delta = b_mean - mean
    total = count + n
    var = (var * count + b_var * n + delta**2 * count * n / total) / total
    return math.sqrt(var + 1e-8)


def stream(rng: np.random.Generator, steps: int, N: int, scale: float = 1.0):
    reward = scale * (1.0 + rng.normal(size=(steps, N)))
    done = rng.random((steps, N)) < 0.02
    return reward, done


def feed(scaler: RewardScaler, reward: np.ndarray, done: np.ndarray, T: int, worker: str = "w0",
         first_seq: int = 0, per_batch: int = 2) -> None:
    """Cut a stream into consecutive segments of T steps and feed them per_batch segments at a time."""
    segs = [(reward[i:i + T], done[i:i + T]) for i in range(0, reward.shape[0], T)]
    for i in range(0, len(segs), per_batch):
        chunk = segs[i:i + per_batch]
        r = np.concatenate([c[0] for c in chunk], axis=1)  # [T, B*N]: the batch's columns
        d = np.concatenate([c[1] for c in chunk], axis=1)
        scaler.update(r, d, [reward.shape[1]] * len(chunk), [worker] * len(chunk),
                      [first_seq + i + j for j in range(len(chunk))])


def test_consecutive_segments_give_the_statistics_of_the_whole_stream() -> None:
    rng = np.random.default_rng(0)
    reward, done = stream(rng, 640, 4)
    scaler = RewardScaler(gamma=0.99)
    feed(scaler, reward, done, T=64)
    assert scaler.std == pytest.approx(reference_std(reward, done, 0.99), rel=1e-6)


def test_workers_of_different_env_counts_in_one_batch_each_chain_their_own_stream() -> None:
    """Protocol v2: one batch holds a 2-env and a 3-env worker's segments (columns [2, 3], then [3, 2] in the
    next batch); each worker's return carry follows its own columns."""
    rng = np.random.default_rng(3)
    (ra, da), (rb, db) = stream(rng, 640, 2), stream(rng, 640, 3)
    scaler = RewardScaler(gamma=0.99)
    for i, t in enumerate(range(0, 640, 64)):
        parts = [(ra, da, 2, "wa"), (rb, db, 3, "wb")][::1 if i % 2 == 0 else -1]
        scaler.update(np.concatenate([p[0][t:t + 64] for p in parts], axis=1),
                      np.concatenate([p[1][t:t + 64] for p in parts], axis=1),
                      [p[2] for p in parts], [p[3] for p in parts], [i, i])
    both = reference_std(np.concatenate([ra, rb], axis=1), np.concatenate([da, db], axis=1), 0.99)
    assert scaler.std == pytest.approx(both, rel=1e-6)


def test_a_segment_that_does_not_follow_its_workers_last_one_starts_from_zero() -> None:
    reward, done = np.ones((20, 1)), np.zeros((20, 1), bool)
    a, b = RewardScaler(gamma=0.9), RewardScaler(gamma=0.9)
    a.update(reward[:10], done[:10], [1], ["w"], [0])
    b.update(reward[:10], done[:10], [1], ["w"], [0])
    a.update(reward[10:], done[10:], [1], ["w"], [1])  # continues: returns keep growing
    b.update(reward[10:], done[10:], [1], ["w"], [5])  # a gap: starts again from 0
    assert a.mean > b.mean
    assert b.mean == pytest.approx(sum((1 - 0.9 ** (k + 1)) / 0.1 for k in range(10)) / 10, rel=1e-3)


def test_scaled_rewards_do_not_depend_on_the_reward_unit() -> None:
    """What the loss sees is the same whether a task pays in thousandths or in thousands."""
    rng = np.random.default_rng(2)
    reward, done = stream(rng, 1280, 8)
    out = []
    for unit in (1e-3, 1.0, 1e3):
        scaler = RewardScaler(gamma=0.99)
        feed(scaler, unit * reward, done, T=64)
        out.append(scaler.scale(torch.as_tensor(unit * reward[:64])))
    torch.testing.assert_close(out[0], out[1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out[2], out[1], rtol=1e-3, atol=1e-3)


def test_scale_clips_and_ignores_non_finite_returns() -> None:
    scaler = RewardScaler(gamma=0.0, clip=5.0)
    r = np.array([[1.0, -1.0, np.inf, np.nan]])  # [T=1, C=4]
    scaler.update(r, np.zeros_like(r, bool), [4], ["w"], [0])
    assert math.isfinite(scaler.std) and scaler.std == pytest.approx(1.0, rel=1e-3)
    got = scaler.scale(torch.tensor([100.0, -100.0, 0.5]))
    assert got.tolist()[:2] == [5.0, -5.0] and got[2] == pytest.approx(0.5 / scaler.std)


def test_carries_are_bounded() -> None:
    scaler = RewardScaler(gamma=0.9, max_workers=3)
    one = np.ones((4, 2))
    for i in range(10):
        scaler.update(one, np.zeros_like(one, bool), [2], [f"w{i}"], [0])
    assert len(scaler._carry) == 3 and set(scaler._carry) == {"w7", "w8", "w9"}


@pytest.mark.parametrize("bad", [dict(gamma=1.5), dict(gamma=0.9, clip=0.0)])
def test_bad_arguments_are_refused_with_the_value(bad) -> None:
    with pytest.raises(ValueError, match="not allowed"):
        RewardScaler(**bad)


def test_the_trainer_scales_rewards_inside_the_loss_only() -> None:
    """With reward_scale = return the targets are in units of the return's std; off: raw."""
    spec = spec_of(2, 1)
    a = empty_batch(spec, B=2, T=8, N=4)
    rng = np.random.default_rng(3)
    a["obs"][:] = rng.normal(size=a["obs"].shape)
    a["reward"][:] = 100.0 + 50.0 * rng.normal(size=a["reward"].shape)
    msg = batch_message(spec, a)
    torch.manual_seed(0)
    raw = Trainer(make_model(spec, hidden=[8]), learner_cfg(reward_scale="off"), "cpu")
    torch.manual_seed(0)
    scaled = Trainer(make_model(spec, hidden=[8]), learner_cfg(reward_scale="return"), "cpu")
    p_raw = raw.prepare(msg, 0)
    p_scaled = scaled.prepare(msg, 0)
    sigma = scaled.reward_scaler.std
    assert sigma > 100.0
    torch.testing.assert_close(p_scaled.rewards, torch.clamp(p_raw.rewards / sigma, -10, 10))
    assert msg.arrays["reward"].max() > 100.0  # the message itself is untouched
    assert scaled.update(msg, 1)["reward_scale"] == pytest.approx(scaled.reward_scaler.std)
