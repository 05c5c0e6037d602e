"""Random segments in the wire layout, shared by the store and broker tests."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np

from zclaw.wire import EnvSpec
from zclaw.wire.messages import SEGMENT_ARRAYS


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
