"""Regenerate the golden wire messages: ``python tests/golden/generate.py``.

Only regenerate when the protocol version changes on purpose: these files pin protocol v1 so that a
worker on an older zclaw (or on Python 3.8) is checked against today's decoder. Each file is a msgpack
array of the message's frames (bytes).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import msgpack
import numpy as np

from zclaw.wire import EnvSpec, make, pack

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


def messages() -> Dict[str, List[bytes]]:
    seg = segment_arrays()
    # as the broker sends it: two segments, each per-step array in one part (frame) per segment
    batch: Dict[str, object] = {k: [v, v] for k, v in seg.items() if k not in ("final_obs", "final_at")}
    batch["final_obs"] = np.concatenate([seg["final_obs"], seg["final_obs"]])
    batch["final_at"] = np.array([[0, 1, 1], [1, 1, 1]], np.int32)
    batch["is_weight"] = np.ones(2, np.float32)
    episodes = [{"return": -3.5, "length": 50, "success": False}]
    weights_arrays = {"actor.0.weight": np.eye(2, 10, dtype=np.float32), "obs_norm.count": np.array(5.0)}
    out = {
        "segment": make("segment", seg, worker="w0-host-1", seq=12, spec_hash=SPEC.hash, episodes=episodes),
        "hello": make("hello", role="worker", identity="w0-host-1", host="host", pid=1, zclaw="0.1.0",
                      spec=SPEC.to_dict()),
        "sample": make("sample", batch_size=1, version=8, priority_keys=[3], priorities=[0.5]),
        "batch": make("batch", batch, keys=[12, 13], workers=["w0-host-1"] * 2, seqs=[12, 13],
                      episodes=episodes, spec_hash=SPEC.hash),
        "retry": make("retry", reason="min_size", retry_ms=20),
        "error": make("error", reason="unknown_kind"),
        "weights": [pack(make("weights", weights_arrays, version=8, step=4096, spec_hash=SPEC.hash,
                              policy={"options": 1}))],
        "snapshot": make("snapshot", spec_hash=SPEC.hash),
        "welcome": make("welcome", role="broker", identity="broker-host-2", host="host", pid=2, zclaw="0.1.0",
                        spec=SPEC.to_dict()),
        "refused": make("refused", reason="env spec 0123456789abcdef differs from the run's",
                        cause="bad_spec"),
        "status": make("status", role="broker", report={"fill": 3, "drops": {"malformed": 1}}),
    }
    return {k: [bytes(memoryview(f).cast("B")) for f in v] for k, v in out.items()}


def main() -> None:
    for kind, frames in messages().items():
        (HERE / f"{kind}.msg").write_bytes(msgpack.packb(frames, use_bin_type=True))
        print(f"wrote {kind}.msg ({sum(map(len, frames))} bytes in {len(frames)} frames)")


if __name__ == "__main__":
    main()
