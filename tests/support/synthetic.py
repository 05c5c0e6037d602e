"""Random segments in the wire layout, and segments cut back out of a batch, shared by the store and
broker tests."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from zclaw.wire import EnvSpec
from zclaw.wire.messages import ENV_ARRAYS, SEGMENT_ARRAYS


def random_segment(
    spec: EnvSpec, T: int, N: int, rng: np.random.Generator, version: Any = 0, M: int = 0, options: int = 4
) -> Dict[str, np.ndarray]:
    """Random arrays in the SEGMENT_ARRAYS layout, ``policy_version`` set to ``version``, plus
    M truncation rows."""
    out: Dict[str, np.ndarray] = {}
    for name, (dtype, shape_of) in SEGMENT_ARRAYS.items():
        shape = shape_of(T, N, spec)
        if dtype == "<f4":
            out[name] = rng.standard_normal(shape).astype("<f4")
        elif dtype == "|b1":
            out[name] = rng.random(shape) < 0.3
        elif dtype == "<i4":
            out[name] = rng.integers(0, options, shape).astype("<i4")
        else:
            out[name] = np.broadcast_to(np.asarray(version, dtype="<i8"), shape).copy()
    out["final_obs"] = rng.standard_normal((M,) + spec.obs_shape).astype("<f4")
    rows = np.stack([rng.integers(0, T, M), rng.integers(0, N, M)], axis=1)
    out["final_at"] = rows.astype("<i4").reshape(M, 2)
    return out


def segment_of_batch(arrays: Dict[str, np.ndarray], columns: Sequence[int], b: int) -> Dict[str, np.ndarray]:
    """Segment b of a batch (``arrays`` in batch layout, ``columns`` its env counts), in segment layout:
    its columns of every per-env array, its ``policy_version`` row, its truncation rows back in (t, n)."""
    lo = int(sum(columns[:b]))
    hi = lo + int(columns[b])
    out = {name: np.ascontiguousarray(arrays[name][:, lo:hi]) for name in ENV_ARRAYS}
    out["policy_version"] = arrays["policy_version"][b]
    fa = arrays["final_at"]
    rows = (fa[:, 1] >= lo) & (fa[:, 1] < hi)
    out["final_at"] = np.stack([fa[rows, 0], fa[rows, 1] - lo], axis=1).astype(np.int32).reshape(-1, 2)
    out["final_obs"] = arrays["final_obs"][rows]
    return out


def assert_same_segment(arrays: Dict[str, np.ndarray], columns: Sequence[int], b: int,
                        want: Dict[str, np.ndarray]) -> None:
    """Segment b of a batch is ``want``, bit for bit, every array with its dtype and shape."""
    got = segment_of_batch(arrays, columns, b)
    for name in list(SEGMENT_ARRAYS) + ["final_at", "final_obs"]:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name
