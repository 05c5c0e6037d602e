"""Regenerate the golden wire messages: ``python tests/golden/generate.py``.

Only regenerate when the protocol version changes on purpose: these files pin protocol v2 so that a
worker on an older zclaw (or on Python 3.8), or one written from docs/protocol.md alone, is checked against
today's decoder. Each file is a msgpack array of the message's frames (bytes). ``v1/`` keeps protocol v1's
files as they were: what a peer of the previous version sends, which a v2 role must refuse readably.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import msgpack
import numpy as np

from zclaw.wire import EnvSpec, make, pack
from zclaw.wire.protocol import Parts, encode_refusal

HERE = Path(__file__).resolve().parent
SPEC = EnvSpec("gym:Reacher-v5", (10,), (2,), (-1.0, -1.0), (1.0, 1.0))
T, N = 3, 2


def segment_arrays() -> Dict[str, np.ndarray]:
    """A deterministic 3 x 2 segment whose values are easy to read back."""
    t = np.arange(T, dtype=np.float32)[:, None]
    n = np.arange(N, dtype=np.float32)[None, :]
    obs = (np.arange((T + 1) * N * 10, dtype=np.float32) / 100).reshape(T + 1, N, 10)
    return {
        "obs": obs,
        "action": (np.arange(T * N * 2, dtype=np.float32) / 10 - 0.5).reshape(T, N, 2),
        "reward": -(t + n) / 4,
        "terminated": np.zeros((T, N), bool),
        "truncated": np.array([[0, 0], [0, 1], [0, 0]], bool),
        "option": np.zeros((T, N), np.int32),
        "option_start": np.array([[1, 1], [0, 0], [0, 1]], bool),
        "logp_action": np.full((T, N), -1.25, np.float32),
        "logp_option": np.zeros((T, N), np.float32),
        "policy_version": np.array([7, 7, 8], np.int64),
        "final_obs": np.full((1, 10), 0.5, np.float32),
        "final_at": np.array([[1, 1]], np.int32),
    }


def batch_arrays() -> Dict[str, object]:
    """Two segments of different env counts, as the broker sends them: the 3 x 2 segment and its env 1
    alone (3 x 1), joined along the env axis into 3 columns; ``obs`` in two parts (one frame per segment),
    every other per-env array joined into one frame, ``policy_version`` stacked ``[B, T]``."""
    seg = segment_arrays()
    one = {k: v[:, 1:2] for k, v in seg.items() if k not in ("policy_version", "final_obs", "final_at")}
    batch: Dict[str, object] = {"obs": Parts([seg["obs"], one["obs"]], axis=1)}
    for k in one:
        if k != "obs":
            batch[k] = np.concatenate([seg[k], one[k]], axis=1)
    batch["policy_version"] = np.stack([seg["policy_version"], seg["policy_version"]])
    # (t, c): segment 0's truncation at (1, 1), and the same step of segment 1, column 2
    batch["final_obs"] = np.concatenate([seg["final_obs"], seg["final_obs"]])
    batch["final_at"] = np.array([[1, 1], [1, 2]], np.int32)
    batch["is_weight"] = np.ones(2, np.float32)
    return batch


#: the architectures the policy-map golden files pin (docs/protocol.md, "The policy map"): a flat policy, and
#: K = 3 options with an epsilon-soft master, residual option heads and ELU
POLICIES = {
    "weights_k1": dict(hidden=(8, 8), activation="tanh", options=1, obs_clip=10.0),
    "weights_k3": dict(hidden=(6,), activation="elu", options=3, obs_clip=5.0, option_epsilon=0.2,
                       option_residual=True),
}


def policy_weights(kind: str, **changes: object) -> bytes:
    """The packed ``weights`` message of a real network of :data:`POLICIES` whose every parameter and buffer
    is set from a formula (no random init): what a worker rebuilds its policy from. ``obs_norm.var`` has one
    tiny element, so the normaliser's epsilon shows in what it computes. ``changes``: PolicyConfig fields
    that differ from the golden architecture (for tests of header fields the golden files leave out)."""
    from zclaw.policy.networks import OptionPolicy, PolicyConfig
    from zclaw.policy.weights import weights_message

    model = OptionPolicy(PolicyConfig(obs_dim=10, act_dim=2, **{**POLICIES[kind], **changes}))
    arrays = {}
    for i, (name, value) in enumerate(model.state_dict().items()):
        x = 0.5 * np.sin(np.arange(value.numel()) * 0.7 + i)
        if name == "obs_norm.var":
            x = 0.25 + np.arange(value.numel()) / 4
            x[0] = 1e-9
        elif name == "obs_norm.count":
            x = np.array(1234.0)
        arrays[name] = x.reshape(tuple(value.shape)).astype(value.numpy().dtype)
    model.load_weight_arrays(arrays)
    return weights_message(model, version=8, step=4096, spec_hash=SPEC.hash,
                           learner="learner-host-3-1700000000")


def messages() -> Dict[str, List[bytes]]:
    seg = segment_arrays()
    batch = batch_arrays()
    episodes = [{"return": -3.5, "length": 50, "success": False}]
    weights_arrays = {"actor.0.weight": np.eye(2, 10, dtype=np.float32), "obs_norm.count": np.array(5.0)}
    out = {
        "segment": make("segment", seg, worker="w0-host-1", seq=12, spec_hash=SPEC.hash, episodes=episodes),
        "hello": make("hello", role="worker", identity="w0-host-1", host="host", pid=1, zclaw="0.1.0",
                      spec=SPEC.to_dict(), segment_length=T),
        "sample": make("sample", batch_size=1, version=8, priority_keys=[3], priorities=[0.5]),
        "batch": make("batch", batch, keys=[12, 13], columns=[2, 1], workers=["w0-host-1"] * 2,
                      seqs=[12, 13],
                      episodes=episodes, spec_hash=SPEC.hash),
        "retry": make("retry", reason="min_size", retry_ms=20),
        "error": make("error", reason="unknown_kind"),
        "weights": [pack(make("weights", weights_arrays, version=8, step=4096, spec_hash=SPEC.hash,
                              policy={"options": 1}))],
        "snapshot": make("snapshot", spec_hash=SPEC.hash),
        "welcome": make("welcome", role="broker", identity="broker-host-2", host="host", pid=2, zclaw="0.1.0",
                        spec=SPEC.to_dict(), segment_length=T, max_message_bytes=64 << 20),
        "refused": make("refused", reason="env spec 0123456789abcdef differs from the run's",
                        cause="bad_spec"),
        # what a v2 server answers a v1 peer's hello: readable by v1's decoder
        "refused_v1": encode_refusal("protocol version 1, expected 2; this broker speaks protocol v2",
                                     "bad_version", version=1),
        "status": make("status", role="broker", report={"fill": 3, "drops": {"malformed": 1}}),
        **{kind: [policy_weights(kind)] for kind in POLICIES},
    }
    return {k: [bytes(memoryview(f).cast("B")) for f in v] for k, v in out.items()}


def main() -> None:
    for kind, frames in messages().items():
        (HERE / f"{kind}.msg").write_bytes(msgpack.packb(frames, use_bin_type=True))
        print(f"wrote {kind}.msg ({sum(map(len, frames))} bytes in {len(frames)} frames)")


if __name__ == "__main__":
    main()
