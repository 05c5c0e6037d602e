"""Environment backends: ``make_env("<backend>:<id>", num_envs, seed, device)`` gives a BatchedEnv.

The backend is chosen by the prefix of the env id (``gym:``, ``isaacgym:``, ``mjwarp:``; see
:data:`zclaw.envs.registry.BACKENDS` and ``docs/backends.md``). Backend packages are imported only when
their prefix is used, so a worker never needs gymnasium to run Isaac Gym, or the reverse.

The names below are loaded lazily (PEP 562): importing :mod:`zclaw.envs.preload` must not import
torch, because Isaac Gym has to be imported before it.
"""
from __future__ import annotations

from typing import Any

from .preload import BackendUnavailable, preimport

__all__ = ["BACKENDS", "BackendUnavailable", "make_env", "preimport", "register_backend", "split_env_id"]

_LAZY = ("BACKENDS", "make_env", "register_backend", "split_env_id")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'zclaw.envs' has no attribute {name!r}")
