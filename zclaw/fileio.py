"""Atomic file writes: a reader (or a restart after a crash) sees the old file or the new one, never half.

The data goes to a temporary file in the target's directory, is fsynced and then ``os.replace``-d over
the final name (atomic on POSIX within one file system); the directory is fsynced so the rename itself
survives a power cut. A crash mid-write leaves only a ``.<name>.*.tmp`` file, which
:func:`remove_stale_tmp` clears on the next start.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, List


def finite_json(x: Any) -> Any:
    """Replace NaN/inf by None, recursively, so a report is valid JSON (and msgpack) as written."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a temporary file next to ``path``, then atomically move it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(str(path.parent), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some file systems refuse to fsync a directory; the rename is still atomic
        pass


def remove_stale_tmp(path: Path) -> List[Path]:
    """Delete temporary files :func:`atomic_write` left for ``path`` after a crash; return them."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed
