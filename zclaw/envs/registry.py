"""Env backends by prefix: ``make_env("gym:Reacher-v5", 16, seed, device)``.

``--env`` names both the backend and the task, ``<prefix>:<id>``. :data:`BACKENDS` maps each prefix to a
factory and to the command that installs the backend's package, so that a worker started on a machine
without that package fails at once with a message saying what to install, rather than with a bare
``ModuleNotFoundError`` from deep inside an import. Backends import their packages lazily, inside the
factory: Isaac Gym must be imported before torch and runs only on Python 3.8, so no backend may be
imported just because another one is used.

Adding a backend (e.g. ``isaacgym:`` or ``mjwarp:``)::

    def _isaacgym(name, num_envs, seed, device):
        from .isaacgym_backend import IsaacGymBatchedEnv   # raises ImportError if isaacgym is absent
        return IsaacGymBatchedEnv(name, num_envs, seed, device)

    register_backend("isaacgym", _isaacgym, install="install Isaac Gym Preview 4 and IsaacGymEnvs (Python 3.8)")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from ..core import BatchedEnv

#: a backend factory: (id without prefix, num_envs, seed, device) -> BatchedEnv
Factory = Callable[[str, int, int, torch.device], BatchedEnv]


class BackendUnavailable(ImportError):
    """The package an env backend needs is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Backend:
    """One env backend: how to build it and how to install what it needs."""

    prefix: str
    factory: Factory
    install: str
    description: str = ""


#: prefix (without the colon) -> backend
BACKENDS: Dict[str, Backend] = {}


def register_backend(prefix: str, factory: Factory, install: str, description: str = "") -> None:
    """Make ``<prefix>:<id>`` env ids resolve to ``factory``; ``install`` is shown when its package is missing."""
    if not prefix or ":" in prefix:
        raise ValueError(f"backend prefix {prefix!r} must be non-empty and contain no ':'")
    BACKENDS[prefix] = Backend(prefix, factory, install, description)


def split_env_id(env_id: str) -> Tuple[str, str]:
    """``"gym:Reacher-v5"`` -> ``("gym", "Reacher-v5")``; raise ValueError naming the known prefixes."""
    if ":" not in env_id:
        raise ValueError(
            f"env id {env_id!r} has no backend prefix: expected <backend>:<id>, e.g. gym:Reacher-v5; "
            f"known backends: {_known()}"
        )
    prefix, name = env_id.split(":", 1)
    if prefix not in BACKENDS:
        raise ValueError(f"unknown env backend {prefix + ':'!r} in {env_id!r}; known backends: {_known()}")
    if not name:
        raise ValueError(f"env id {env_id!r} names no environment after {prefix + ':'!r}")
    return prefix, name


def _known() -> str:
    return ", ".join(p + ":" for p in sorted(BACKENDS))


def make_env(env_id: str, num_envs: int, seed: int, device: torch.device) -> BatchedEnv:
    """Build ``num_envs`` envs of ``env_id`` (``<backend>:<id>``), env i seeded ``seed + i``, tensors on ``device``.

    Raises ValueError for an unknown prefix (listing the known ones) or an id the backend does not know
    (naming it), and :class:`BackendUnavailable` when the backend's package is missing (saying how to
    install it).
    """
    if num_envs < 1:
        raise ValueError(f"num_envs = {num_envs} must be >= 1")
    prefix, name = split_env_id(env_id)
    backend = BACKENDS[prefix]
    try:
        return backend.factory(name, int(num_envs), int(seed), torch.device(device))
    except BackendUnavailable:
        raise
    except ImportError as exc:
        raise BackendUnavailable(
            f"env backend {prefix + ':'!r} cannot be used: {exc}. Install it with: {backend.install}"
        ) from exc


# ------------------------------------------------------------------------------------------ backends


def _gym(name: str, num_envs: int, seed: int, device: torch.device) -> BatchedEnv:
    from .gym_backend import GymBatchedEnv  # imports gymnasium; an ImportError becomes BackendUnavailable

    return GymBatchedEnv(name, num_envs, seed, device)


register_backend(
    "gym",
    _gym,
    install="pip install 'gymnasium[mujoco]>=1.0'",
    description="gymnasium envs (MuJoCo on CPU), N copies stepped in a loop",
)
