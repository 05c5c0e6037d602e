"""The learner's synthetic batches: real ``batch`` messages (encoded and parsed back, as the learner
receives them) built from arrays the test chooses, for the trainer, options, value-target and reward-scale
tests. Random segments in the wire's segment layout are in :mod:`support.synthetic`.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from zclaw import config
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config
from zclaw.wire import EnvSpec, Message, make, parse
from zclaw.wire.messages import ENV_ARRAYS, batch_dims


def spec_of(obs_dim: int, act_dim: int) -> EnvSpec:
    return EnvSpec("test:Synthetic-v0", (obs_dim,), (act_dim,), (-1.0,) * act_dim, (1.0,) * act_dim)


def batch_layout(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """B segments of N envs each, stacked ``[B, T, N, ...]`` with ``final_at`` rows (b, t, n) (how a test
    writes them), in the wire's batch layout: joined along the env axis into ``[T, B*N, ...]`` columns
    (column ``b*N + n`` is env n of segment b), ``final_at`` rows (t, c)."""
    B, T, N = arrays["action"].shape[:3]
    out = {name: np.ascontiguousarray(np.swapaxes(arrays[name], 0, 1).reshape(
        (arrays[name].shape[1], B * N) + arrays[name].shape[3:])) for name in ENV_ARRAYS}
    fa = np.asarray(arrays["final_at"], np.int32).reshape(-1, 3)
    out["final_at"] = np.stack([fa[:, 1], fa[:, 0] * N + fa[:, 2]], axis=1).astype(np.int32).reshape(-1, 2)
    for name in ("policy_version", "final_obs", "is_weight"):
        out[name] = arrays[name]
    return out


def batch_message(spec: EnvSpec, arrays: Dict[str, np.ndarray], episodes: Optional[list] = None) -> Message:
    """Encode ``arrays`` (stacked segments, see :func:`batch_layout`) as a real ``batch`` message and parse it
    back (what the learner receives)."""
    B, _, N = arrays["action"].shape[:3]
    frames = make("batch", batch_layout(arrays), keys=list(range(B)), columns=[N] * B, workers=["w"] * B,
                  seqs=list(range(B)), episodes=episodes or [], spec_hash=spec.hash)
    msg = parse(frames, ("batch",))
    batch_dims(msg, spec)
    return msg


def empty_batch(spec: EnvSpec, B: int, T: int, N: int, version: int = 0) -> Dict[str, np.ndarray]:
    D, A = spec.obs_shape[0], spec.action_shape[0]
    return {
        "obs": np.zeros((B, T + 1, N, D), np.float32),
        "action": np.zeros((B, T, N, A), np.float32),
        "reward": np.zeros((B, T, N), np.float32),
        "terminated": np.zeros((B, T, N), bool),
        "truncated": np.zeros((B, T, N), bool),
        "option": np.zeros((B, T, N), np.int32),
        "option_start": np.zeros((B, T, N), bool),
        "logp_action": np.zeros((B, T, N), np.float32),
        "logp_option": np.zeros((B, T, N), np.float32),
        "policy_version": np.full((B, T), version, np.int64),
        "final_obs": np.zeros((0, D), np.float32),
        "final_at": np.zeros((0, 3), np.int32),
        "is_weight": np.ones((B,), np.float32),
    }


def learner_cfg(**over) -> dict:
    c = config.defaults()["learner"]
    c.update(over)
    return c


def make_model(spec: EnvSpec, **policy) -> OptionPolicy:
    p = config.defaults()["policy"]
    p.update(policy)
    return OptionPolicy(policy_config(p, spec))


def bandit_batch(model: OptionPolicy, spec: EnvSpec, rng: np.random.Generator, N: int = 128) -> Message:
    """One-step episodes: act with the model, reward = -|a - 0.5|, every step terminal."""
    a = empty_batch(spec, 1, 1, N)
    obs = rng.normal(size=(N, 1)).astype(np.float32)
    a["obs"][0, 0] = obs
    a["obs"][0, 1] = rng.normal(size=(N, 1)).astype(np.float32)
    out = model.act(torch.from_numpy(obs), torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.bool))
    act = out["action"].numpy()
    a["action"][0, 0] = act
    a["logp_action"][0, 0] = out["logp_action"].numpy()
    a["reward"][0, 0] = -np.abs(act[:, 0] - 0.5)
    a["terminated"][:] = True
    return batch_message(spec, a)
