"""The one polling loop with a deadline that every test uses to wait for something.

Tests that drive real processes and sockets cannot know when a thing will have happened, only how long is
too long: each waits for a condition by polling it, and fails (an ``AssertionError`` that says what it
waited for, with the log that explains why) at its own timeout, or at once when the process it waits on has
exited. Waiting on a role's *status report* has its own helper, ``zclaw.launch.StatusClient.wait_until``
(what ``Roles.wait`` and ``Train.wait`` in :mod:`support.procs` use).
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar, Union

V = TypeVar("V")
#: what a failed wait shows: a log file (its last :data:`TAIL_CHARS`) or a function returning text
Output = Union[Path, Callable[[], str], None]
TAIL_CHARS = 3000


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    """The last ``chars`` characters of the file at ``path`` ('' while it does not exist)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def shown(output: Output) -> str:
    if output is None:
        return ""
    text = tail(output) if isinstance(output, Path) else output()
    return f":\n{text}" if text else ""


def wait_until(
    check: Callable[[], V], timeout: float, what: str = "the condition", interval: float = 0.05,
    proc: Optional[subprocess.Popen] = None, output: Output = None,
) -> V:
    """Call ``check`` every ``interval`` s until it returns something truthy, and return that.

    Fails the test with an ``AssertionError`` naming ``what`` (and showing ``output``) once ``timeout`` s
    have passed, or as soon as ``proc`` (the process being waited on, if any) has exited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}"
                                 f"{shown(output)}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{shown(output)}")
        time.sleep(interval)
