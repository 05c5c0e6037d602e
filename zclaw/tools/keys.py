"""``zclaw keys generate DIR`` / ``zclaw keys add DIR NAME...``: CURVE key pairs in the
layout every role reads.

One key pair per name (``zmq.auth.create_certificates``: ``<name>.key`` holds the public key,
``<name>.key_secret`` the public and the secret key), sorted into::

    DIR/servers/broker.key, learner.key     the servers' public certs: copy to every host
    DIR/allowed/<client>.key                the clients' public certs: the allowlist; broker and learner hosts
    DIR/private/<name>.key_secret           secrets, mode 600 in a mode-700 directory: each host gets
                                            only its own

The clients are ``learner`` (it connects to the broker), ``tools`` (status and the launcher),
``worker0`` ... ``worker<N-1>`` (worker ``--index i`` uses ``worker<i>``) and any extra ``--client`` names.
The broker is a server only, so it is not on the allowlist. Existing keys are never overwritten without
``force``: a replaced key locks out every host that still holds the old one.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

from ..security import (ALLOWED_DIR, PRIVATE_DIR, SERVER_NAMES, SERVERS_DIR, TOOLS_NAME, public_path,
                        secret_path)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeysError(ValueError):
    """Keys that would be overwritten, or a name that is not allowed; the message says which."""


def default_names(workers: int, clients: Sequence[str] = ()) -> List[str]:
    names = list(SERVER_NAMES) + [TOOLS_NAME] + [f"worker{i}" for i in range(workers)] + list(clients)
    return list(dict.fromkeys(names))  # keep order, drop repeats


def _paths(keys_dir: Path, name: str) -> List[Path]:
    out = [secret_path(str(keys_dir), name)]
    if name in SERVER_NAMES:
        out.append(public_path(str(keys_dir), name, server=True))
    if name != "broker":
        out.append(public_path(str(keys_dir), name, server=False))
    return out


def generate(keys_dir: Path, names: Sequence[str], force: bool = False) -> Dict[str, List[Path]]:
    """Write a key pair for each of ``names`` into ``keys_dir``; return the files written per name.

    Refuses (:class:`KeysError`, nothing written) when any of them exists, unless ``force``.
    """
    import zmq.auth

    keys_dir = Path(keys_dir)
    for name in names:
        if not _NAME.match(name):
            raise KeysError(f"key name {name!r} is not allowed: expected letters, digits, '_', '.', '-' "
                            "(at most 64, not starting with a punctuation mark)")
    existing = [n for n in names if any(p.exists() for p in _paths(keys_dir, n))]
    if existing and not force:
        raise KeysError(f"keys exist in {keys_dir} and would be overwritten (pass --force to replace them; "
                        "hosts holding the old keys are then locked out): " + ", ".join(existing))
    for sub, mode in ((SERVERS_DIR, 0o755), (ALLOWED_DIR, 0o755), (PRIVATE_DIR, 0o700)):
        (keys_dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(keys_dir / sub, mode)
    written: Dict[str, List[Path]] = {}
    with tempfile.TemporaryDirectory(dir=keys_dir / PRIVATE_DIR) as tmp:
        os.chmod(tmp, 0o700)
        for name in names:
            public, secret = zmq.auth.create_certificates(tmp, name)
            os.chmod(secret, 0o600)
            targets = _paths(keys_dir, name)
            shutil.move(secret, targets[0])  # same file system: a rename, the mode is kept
            os.chmod(targets[0], 0o600)
            for target in targets[1:]:
                shutil.copyfile(public, target)
                os.chmod(target, 0o644)
            written[name] = targets
    return written


def describe(keys_dir: Path, written: Dict[str, List[Path]]) -> str:
    """What was written and where each file goes, for the command's output."""
    lines = [f"CURVE keys in {keys_dir}:"]
    for name, paths in written.items():
        lines.append(f"  {name:<12} " + "  ".join(str(p.relative_to(keys_dir)) for p in paths))
    lines += [
        "Copy servers/ to every host, allowed/ to the broker and learner hosts, and to "
        "each host only its own",
        "private/<name>.key_secret; then set [security] keys_dir (see docs/multihost.md).",
    ]
    return "\n".join(lines)
