"""The start-up every role shares (broker, learner, worker), in the order it happens, and how it ends.

``zclaw broker|learner|worker`` (zclaw/cli.py) resolves the config, calls :func:`start_process` (structlog
with role, host and pid in every line; glibc's heap reuse for message buffers), then the role's ``main``,
which runs its body through :func:`run_role`:

1. SIGINT and SIGTERM set the role's stop event (:class:`zclaw.stopping.StopSignals`); the previous handlers
   come back when the body returns, so a role run in-process (tests) leaves no handler behind.
2. The body checks what it needs before it binds a socket or builds an env: its CURVE keys and the loopback
   rule (:func:`security`), its device, its checkpoint. Whatever is wrong raises :class:`CannotStart`, which
   :func:`run_role` logs once, as an error, and turns into exit code 2
   (:data:`~zclaw.stopping.EXIT_CANNOT_START`).
3. The body's return value is the exit code: ``EXIT_OK`` on a clean stop, ``EXIT_FAILED`` when a port cannot
   be bound, ``EXIT_REFUSED`` when a server refused its env spec or protocol (``zclaw train`` does not restart
   it). The codes are defined once, in :mod:`zclaw.stopping`.

Worker-side: this module stays valid Python 3.8 and imports no torch (``zclaw worker`` imports Isaac Gym
before torch, after the config is resolved).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, Optional

from .config import ConfigError
from .security import Security
from .stopping import EXIT_CANNOT_START, StopSignals


#: set by ``zclaw train`` for its roles: the host's monotonic clock when the run began
RUN_CLOCK_ENV = "ZCLAW_RUN_CLOCK"


def run_started() -> float:
    """When the run began on ``time.monotonic()``'s clock (one per host): ``zclaw train``'s start as it told
    its roles (:data:`RUN_CLOCK_ENV`), so that a role it restarts still counts ``run.time`` from the run's
    start; else now (a role started by hand)."""
    now = time.monotonic()
    try:
        started = float(os.environ.get(RUN_CLOCK_ENV, ""))
    except ValueError:
        return now
    return started if 0.0 <= started <= now else now


class CannotStart(Exception):
    """The role cannot start as configured; :func:`run_role` logs ``event`` with ``fields`` as an error and
    returns :data:`~zclaw.stopping.EXIT_CANNOT_START`."""

    def __init__(self, event: str, **fields: Any) -> None:
        super().__init__(event)
        self.event = event
        self.fields = fields


def start_process(role: str, cfg: Dict[str, Dict[str, Any]]) -> Any:
    """Process-wide set-up of a role: structlog (``log.level``, ``log.format``), then heap reuse for message
    buffers; returns the role's logger."""
    from .logs import setup
    from .wire.memory import keep_freed_buffers

    log = setup(role, cfg["log"]["level"], cfg["log"]["format"])
    if not keep_freed_buffers():
        log.debug("malloc thresholds not set (not glibc): large message buffers fault their pages in anew")
    return log


def security(
    cfg: Dict[str, Dict[str, Any]], role: str, log: Any, index: int = 0, bind_host: Optional[str] = None
) -> Security:
    """The CURVE keys of ``role`` (``index``: worker<index>), loaded before any socket exists; with
    ``bind_host`` (a server role), also the rule that nothing binds beyond loopback unprotected. Keys that do
    not load or an unprotected bind raise :class:`CannotStart` ``refusing to start``, naming the key or host
    (:class:`~zclaw.config.ConfigError`'s text)."""
    try:
        sec = Security.from_config(cfg, role, index, log=log)
        if bind_host is not None:
            sec.check_bind(bind_host)
    except ConfigError as exc:
        raise CannotStart("refusing to start", error=str(exc)) from None
    return sec


def run_role(
    log: Any, body: Callable[[threading.Event], int], stop: Optional[threading.Event] = None
) -> int:
    """Run ``body(stop)`` with SIGINT and SIGTERM setting ``stop`` (a fresh event if None); return its exit
    code, or :data:`~zclaw.stopping.EXIT_CANNOT_START` after logging a :class:`CannotStart` it raised."""
    with StopSignals(stop) as signals:
        try:
            return body(signals.stop)
        except CannotStart as exc:
            log.error(exc.event, **exc.fields)
            return EXIT_CANNOT_START
