"""gymnasium-robotics (Fetch, ShadowHand) under the ``gym:`` backend, with any MuJoCo version.

Two things stand between ``gym:FetchReachDense-v4`` and ``gym.make``:

* gymnasium 1.x registers the robotics ids only once ``gymnasium_robotics`` is imported, so an id the
  registry does not know triggers that import (:func:`ensure_registered`);
* with mujoco >= 3.12 every Fetch and ShadowHand env fails in ``make`` with a bare ``AssertionError``:
  ``gymnasium_robotics.utils.mujoco_utils`` checks ``joint_type in (mjtJoint.mjJNT_HINGE,
  mjtJoint.mjJNT_SLIDE)`` where ``joint_type`` is a numpy integer from ``model.jnt_type``, and since
  mujoco 3.12 an enum member no longer compares equal to a numpy integer inside ``in`` (``==`` still
  works). :func:`patch_enum_comparison` gives that module a view of ``mujoco`` whose ``mjtJoint``
  members are plain ints, which compare right with numpy integers; nothing else changes.

Why a patch rather than pinning ``mujoco<3.12``: MuJoCo Warp (the ``mjwarp:`` backend) needs
mujoco >= 3.13, and the fix is one comparison. The patch is applied only when the comparison is
broken, so with an older mujoco (or a fixed gymnasium-robotics) it does nothing.
"""
from __future__ import annotations

import types
import warnings
from typing import Any

_PATCHED = False


class _IntJointEnums(types.ModuleType):
    """``mujoco`` as seen by gymnasium-robotics' helpers: ``mjtJoint`` members as ints, the rest untouched."""

    def __init__(self, real: Any) -> None:
        super().__init__(real.__name__)
        self._real = real
        self.mjtJoint = types.SimpleNamespace(
            **{name: int(getattr(real.mjtJoint, name))
               for name in dir(real.mjtJoint) if name.startswith("mjJNT_")}
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def comparison_broken() -> bool:
    """True when a numpy joint type is not found ``in`` a tuple of mujoco enum members (mujoco >= 3.12)."""
    import mujoco
    import numpy as np

    hinge = mujoco.mjtJoint.mjJNT_HINGE
    return np.int32(int(hinge)) not in (hinge,)


def patch_enum_comparison() -> bool:
    """Make gymnasium-robotics' joint helpers work with this mujoco; True if a patch was
    needed. Idempotent."""
    global _PATCHED
    if _PATCHED:
        return True
    from gymnasium_robotics.utils import mujoco_utils

    if not comparison_broken() or isinstance(mujoco_utils.mujoco, _IntJointEnums):
        return False
    mujoco_utils.mujoco = _IntJointEnums(mujoco_utils.mujoco)
    _PATCHED = True
    return True


def ensure_registered(name: str) -> bool:
    """If gymnasium does not know ``name``, import gymnasium-robotics (it registers its ids); True if it did.

    Returns False when gymnasium-robotics is not installed; the caller's ``gym.make`` then reports the
    unknown id.
    """
    import gymnasium as gym

    if name in gym.registry:
        return False
    try:
        with warnings.catch_warnings():  # its import warns about Adroit reward versions, irrelevant here
            warnings.filterwarnings("ignore", message=".*Adroit.*")
            import gymnasium_robotics
    except ImportError:
        return False
    gym.register_envs(gymnasium_robotics)
    return True


def prepare(name: str) -> None:
    """Everything ``gym.make(name)`` needs for a gymnasium-robotics id; a no-op for other ids."""
    import gymnasium as gym

    ensure_registered(name)
    spec = gym.registry.get(name)
    entry = getattr(spec, "entry_point", "") if spec is not None else ""
    if isinstance(entry, str) and entry.startswith("gymnasium_robotics"):
        patch_enum_comparison()
