"""Environment backends: ``make_env("<backend>:<id>", num_envs, seed, device)`` gives a BatchedEnv.

The backend is chosen by the prefix of the env id (``gym:`` today; ``isaacgym:`` and ``mjwarp:`` slot into
:data:`zclaw.envs.registry.BACKENDS`). Backend packages are imported only when their prefix is used, so a
worker never needs gymnasium to run Isaac Gym, or the reverse.
"""
from __future__ import annotations

from .registry import BACKENDS, BackendUnavailable, make_env, register_backend, split_env_id

__all__ = ["BACKENDS", "BackendUnavailable", "make_env", "register_backend", "split_env_id"]
