"""The start-up every role's main shares (zclaw/startup.py) and the stop signals under it
(zclaw/stopping.py), in process: a signal sets the stop event, a second one runs ``on_repeat``, handlers come
back, a role that cannot start logs why once and exits 2. The same codes from real role processes:
tests/tools/test_cli.py, tests/shared/test_security.py, tests/learner/test_learner.py,
tests/wire/test_handshake.py (3), tests/system/test_supervise.py (train)."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, List

import pytest

from zclaw import config as config_mod
from zclaw import startup
from zclaw.stopping import EXIT_CANNOT_START, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, StopSignals


class _Log:
    def __init__(self) -> None:
        self.lines: List[Any] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.lines.append((level, event, kw))


def test_exit_codes_are_the_documented_ones() -> None:
    assert (EXIT_OK, EXIT_FAILED, EXIT_CANNOT_START, EXIT_REFUSED) == (0, 1, 2, 3)


def test_a_signal_sets_stop_a_second_runs_on_repeat_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    repeats: List[int] = []
    with StopSignals(on_repeat=lambda: repeats.append(1)) as signals:
        assert not signals.stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread before kill returns
        assert signals.stop.is_set() and signals.count == 1 and signals.name == "SIGTERM" and not repeats
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.count == 2 and signals.name == "SIGINT" and repeats == [1]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_off_the_main_thread_nothing_is_installed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: List[Any] = []

    def body() -> None:
        with StopSignals() as signals:
            seen.append(signal.getsignal(signal.SIGTERM))
            signals.stop.set()  # how a caller stops a role run in a thread

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == [before]


def test_run_role_returns_the_bodys_code_and_turns_cannot_start_into_2_logged_once() -> None:
    log = _Log()
    stop = threading.Event()
    assert startup.run_role(log, lambda s: EXIT_REFUSED if s is stop else -1, stop) == EXIT_REFUSED

    def cannot(s: threading.Event) -> int:
        raise startup.CannotStart("cannot build the environments", env="gym:Nope-v0", error="no such env")

    before = signal.getsignal(signal.SIGTERM)
    assert startup.run_role(log, cannot) == EXIT_CANNOT_START
    assert log.lines == [("error", "cannot build the environments", {"env": "gym:Nope-v0",
                                                                     "error": "no such env"})]
    assert signal.getsignal(signal.SIGTERM) is before


def test_security_refuses_an_unprotected_bind_beyond_loopback_and_missing_keys(tmp_path) -> None:
    cfg = config_mod.load()
    assert startup.security(cfg, "broker", _Log(), bind_host="127.0.0.1").enabled is False
    with pytest.raises(startup.CannotStart) as exc:
        startup.security(cfg, "broker", _Log(), bind_host="0.0.0.0")
    assert exc.value.event == "refusing to start" and "--insecure" in exc.value.fields["error"]
    keys = config_mod.load(values={"security.keys_dir": str(tmp_path / "nowhere")})
    with pytest.raises(startup.CannotStart, match="refusing to start") as exc:
        startup.security(keys, "worker", _Log(), index=3)
    assert "security." in exc.value.fields["error"]
