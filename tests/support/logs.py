"""The roles' log lines, read back as the dicts they were: every test that checks what a role logged.

A role logs one JSON object per line when its output is not a terminal or ``log.format`` is json
(zclaw/logs.py): ``event`` is the message, and ``role``, ``host``, ``pid``, ``version``, ``timestamp`` and
``level`` come with every line. Anything else in a log (a traceback, a library's warning) is skipped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List

from .waiting import wait_until

Event = Dict[str, Any]


def parse_lines(text: str) -> List[Event]:
    """The JSON objects among the lines of ``text``, in order."""
    out: List[Event] = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def log_lines(path: Path) -> List[Event]:
    """The JSON lines of the log file at ``path`` (none while it does not exist yet)."""
    try:
        return parse_lines(path.read_text(errors="replace"))
    except FileNotFoundError:
        return []


def events(path: Path, name: str) -> List[Event]:
    """The lines of the log at ``path`` whose ``event`` is ``name``."""
    return [e for e in log_lines(path) if e.get("event") == name]


def wait_event(
    path: Path, name: str, timeout: float = 60, where: Callable[[Event], bool] = lambda e: True,
    interval: float = 0.1,
) -> Event:
    """The first event ``name`` in the log at ``path`` for which ``where`` holds, waiting up to ``timeout`` s
    (the log's tail shows in the failure)."""

    def first() -> Any:
        found = [e for e in events(path, name) if where(e)]
        return found[0] if found else None

    return wait_until(first, timeout, f"{name!r} in {path.name}", interval, output=path)
