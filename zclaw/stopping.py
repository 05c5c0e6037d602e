"""Clean stops for every role and for ``zclaw train``, and the exit codes they end with.

SIGINT and SIGTERM set a :class:`threading.Event` that the process's loops poll (:class:`StopSignals`); no
handler does more than that (and count), so a signal never interrupts a send, a checkpoint or a snapshot
half-way. The roles install it through :func:`zclaw.startup.run_role`; the launcher installs it itself, with
``on_repeat`` killing what is left when a second signal comes.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable, Dict, Optional

#: a clean stop (SIGINT, SIGTERM, the end of the run)
EXIT_OK = 0
#: a failure while running (a port that cannot be bound, a role ``zclaw train`` gave up on)
EXIT_FAILED = 1
#: the role cannot start as configured (keys, bind host, device, envs, checkpoint): fix that, then retry
EXIT_CANNOT_START = 2
#: exit code of a role a server refused (another env spec or protocol version): restarting cannot help
EXIT_REFUSED = 3


class StopSignals:
    """While installed (``with StopSignals(stop) as signals:``, or :meth:`install` ... :meth:`restore`),
    SIGINT and SIGTERM set ``stop``.

    ``count`` is how many came and ``name`` the latest one's name (``"SIGTERM"``): ``zclaw train`` says why it
    stopped with it. From the second signal on, ``on_repeat`` runs too (the launcher kills what is left at
    once). Leaving the ``with`` (or :meth:`restore`) puts the previous handlers back.

    Handlers can only be installed from the main thread; elsewhere (a role run in a thread by tests or
    benches) nothing is installed, and the caller stops the role by setting ``stop``.
    """

    def __init__(
        self, stop: Optional[threading.Event] = None, on_repeat: Optional[Callable[[], None]] = None
    ) -> None:
        self.stop = stop if stop is not None else threading.Event()
        self.on_repeat = on_repeat
        self.count = 0
        self.name = ""
        self._previous: Dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.name = signal.Signals(signum).name
        self.stop.set()
        if self.count > 1 and self.on_repeat is not None:
            self.on_repeat()

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()
