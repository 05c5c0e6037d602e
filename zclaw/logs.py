"""structlog setup shared by every process: role, host, pid and policy version in every line.

A readable console renderer on a TTY, JSON lines otherwise (files, pipes, ``zclaw train`` children).
The policy version is a context variable: a role calls :func:`set_version` when its version changes.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any, Optional

import structlog

from . import __version__

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def setup(role: str, level: str = "info", fmt: str = "auto", stream: Any = None) -> Any:
    """Configure structlog for this process and return a logger bound to ``role``."""
    stream = stream or sys.stderr
    use_console = fmt == "console" or (fmt == "auto" and hasattr(stream, "isatty") and stream.isatty())
    renderer = (structlog.dev.ConsoleRenderer(colors=True) if use_console
                else structlog.processors.JSONRenderer())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # one write per line (the message and its newline together): processes sharing one log file, such
        # as data-parallel learner ranks under one launcher, then never splice two lines into one
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        role=role, host=socket.gethostname(), pid=os.getpid(), zclaw=__version__, version=None
    )
    return structlog.get_logger()


def set_version(version: Optional[int]) -> None:
    """Bind the current policy version into every later log line of this process."""
    structlog.contextvars.bind_contextvars(version=version)


def get(**bind: Any) -> Any:
    return structlog.get_logger().bind(**bind) if bind else structlog.get_logger()
