"""What must be imported before torch, per env backend; this module itself imports nothing heavy.

Isaac Gym's ``gymdeps`` refuses to load once ``torch`` is in ``sys.modules`` ("PyTorch was imported
before isaacgym modules"), and every zclaw role module imports torch. So ``zclaw worker`` calls
:func:`preimport` with the ``--env`` id right after reading its config and before it imports the
worker role. :class:`BackendUnavailable` lives here, not in the registry, for the same reason: the
registry imports torch.
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, Tuple


class BackendUnavailable(ImportError):
    """The package an env backend needs is not installed; the message says how to install it."""


#: backend prefix -> modules imported, in order, before torch
PREIMPORT: Dict[str, Tuple[str, ...]] = {"isaacgym": ("isaacgym",)}

#: backend prefix -> how to get its package (repeated by the registry's errors)
INSTALL: Dict[str, str] = {
    "isaacgym": (
        "install Isaac Gym Preview 4 (python/ of the NVIDIA download: pip install -e .) and IsaacGymEnvs "
        "(pip install -e IsaacGymEnvs) into a Python 3.8 environment, then pip install zclaw there; "
        "see docs/isaacgym.md"
    ),
}


def preimport(env_id: str) -> None:
    """Import what the backend of ``env_id`` needs before torch; a no-op for backends that need nothing.

    Raises :class:`BackendUnavailable` naming the install step when the package is missing, or when
    torch was imported first (the import order cannot be repaired inside a running process).
    """
    prefix = env_id.split(":", 1)[0] if ":" in env_id else ""
    for name in PREIMPORT.get(prefix, ()):
        if name in sys.modules:
            continue
        torch_first = "torch" in sys.modules
        try:
            importlib.import_module(name)
        except ImportError as exc:
            hint = (
                " (torch was imported before it: start the worker with `zclaw worker`, "
                "which imports it first)"
                if torch_first else ""
            )
            raise BackendUnavailable(
                f"env backend {prefix + ':'!r} cannot be used: importing {name} failed: {exc}{hint}. "
                f"Install it with: {INSTALL.get(prefix, 'see docs/backends.md')}"
            ) from exc
