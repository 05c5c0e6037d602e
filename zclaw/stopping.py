"""Clean stops for every role: SIGINT and SIGTERM set an event that the role's loops poll."""
from __future__ import annotations

import signal
import threading
from typing import Any, Dict

#: exit code of a role a server refused (another env spec or protocol version): restarting cannot help
EXIT_REFUSED = 3


def install_stop_signals(stop: threading.Event) -> Dict[int, Any]:
    """SIGINT and SIGTERM set ``stop``; return the previous handlers so the caller can restore them.

    Handlers can only be installed from the main thread; a role run in another thread (tests, benches)
    is stopped by its caller setting ``stop``.
    """
    old: Dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return old
    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    return old
