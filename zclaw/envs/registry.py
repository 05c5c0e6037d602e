"""Env backends by prefix: ``make_env("gym:Reacher-v5", 16, seed, device)``.

``--env`` names both the backend and the task, ``<prefix>:<id>``. :data:`BACKENDS` maps each prefix to a
factory and to the command that installs the backend's package, so that a worker started on a machine
without that package fails at once with a message saying what to install, rather than with a bare
``ModuleNotFoundError`` from deep inside an import. Backends import their packages lazily, inside the
factory: Isaac Gym must be imported before torch and runs only on Python 3.8, so no backend may be
imported just because another one is used.

Adding a backend (see the three at the bottom of this module, and ``docs/backends.md``)::

    def _mysim(name, num_envs, seed, device, **options):
        from .mysim_backend import MySimBatchedEnv   # an ImportError here becomes BackendUnavailable
        return MySimBatchedEnv(name, num_envs, seed, device)

    register_backend("mysim", _mysim, install="pip install mysim")

``options`` are worker settings a backend may use (today ``vectorize``, for ``gym:``); a factory
ignores the ones it does not know.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch

from ..core import BatchedEnv
from .preload import INSTALL, BackendUnavailable

#: a backend factory: (id without prefix, num_envs, seed, device, **options) -> BatchedEnv
Factory = Callable[..., BatchedEnv]


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
    """Make ``<prefix>:<id>`` env ids resolve to ``factory``; ``install`` is shown when its
    package is missing."""
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


def make_env(env_id: str, num_envs: int, seed: int, device: torch.device, **options: Any) -> BatchedEnv:
    """Build ``num_envs`` envs of ``env_id`` (``<backend>:<id>``), env i seeded ``seed + i``,
    tensors on ``device``.

    ``options`` go to the backend's factory (e.g. ``vectorize="subprocess"`` for ``gym:``).

    Raises ValueError for an unknown prefix (listing the known ones) or an id the backend does not know
    (naming it), and :class:`BackendUnavailable` when the backend's package is missing (saying how to
    install it).
    """
    if num_envs < 1:
        raise ValueError(f"num_envs = {num_envs} must be >= 1")
    prefix, name = split_env_id(env_id)
    backend = BACKENDS[prefix]
    try:
        return backend.factory(name, int(num_envs), int(seed), torch.device(device), **options)
    except BackendUnavailable:
        raise
    except ImportError as exc:
        raise BackendUnavailable(
            f"env backend {prefix + ':'!r} cannot be used: {exc}. Install it with: {backend.install}"
        ) from exc


# ------------------------------------------------------------------------------------------ backends


def _gym(name: str, num_envs: int, seed: int, device: torch.device, **options: Any) -> BatchedEnv:
    vectorize = options.get("vectorize", "loop")
    if vectorize == "subprocess":
        from .subproc import SubprocessBatchedEnv  # imports gymnasium in the children, and here for the spec

        return SubprocessBatchedEnv(name, num_envs, seed, device,
                                    processes=int(options.get("env_processes", 0)))
    if vectorize != "loop":
        raise ValueError(f"worker.vectorize = {vectorize!r} is not allowed: expected 'loop' or 'subprocess'")
    from .gym_backend import GymBatchedEnv  # imports gymnasium; an ImportError becomes BackendUnavailable

    return GymBatchedEnv(name, num_envs, seed, device)


def _isaacgym(name: str, num_envs: int, seed: int, device: torch.device, **options: Any) -> BatchedEnv:
    from .isaacgym_backend import IsaacGymBatchedEnv  # imports isaacgym, isaacgymenvs inside

    return IsaacGymBatchedEnv(name, num_envs, seed, device)


def _mjwarp(name: str, num_envs: int, seed: int, device: torch.device, **options: Any) -> BatchedEnv:
    from .mjwarp_backend import MjWarpBatchedEnv  # imports mujoco_warp and warp; Python >= 3.11

    return MjWarpBatchedEnv(name, num_envs, seed, device)


register_backend(
    "gym",
    _gym,
    install="pip install 'gymnasium[mujoco]>=1.0' (Fetch and ShadowHand tasks: pip "
            "install 'zclaw[robotics]')",
    description="gymnasium envs (MuJoCo on CPU), N copies stepped in a loop or in subprocesses",
)
register_backend(
    "isaacgym",
    _isaacgym,
    install=INSTALL["isaacgym"],
    description="IsaacGymEnvs VecTask tasks on the GPU (Isaac Gym Preview 4, Python 3.8)",
)
register_backend(
    "mjwarp",
    _mjwarp,
    install="pip install 'zclaw[mjwarp]' (MuJoCo Warp and NVIDIA Warp; Python >= 3.11)",
    description="MuJoCo Warp: thousands of worlds batched on one GPU (or slowly on the CPU)",
)
