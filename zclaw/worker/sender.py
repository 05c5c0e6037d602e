"""A bounded, ordered, lossless send queue over a PUSH socket: the worker's backpressure.

ZeroMQ's PUSH blocks when its peer is slow or gone, and a blocking ``send`` would freeze the worker with
no way to log, heartbeat or stop. So every send is ``NOBLOCK`` on a socket with a small ``SNDHWM`` and
``IMMEDIATE`` (nothing is queued inside ZeroMQ for a broker that is not connected). A segment the socket
does not take (``zmq.Again``) waits in a local deque of at most ``capacity`` segments (cfg
``worker.send_queue``), in order. When that deque is full the worker *blocks* in :meth:`Sender.send`,
retrying with a growing backoff (1 ms doubling to 50 ms) and logging ``backpressure`` with how long it has
waited (at most once per ``log_interval_s``), until the broker takes a segment or the worker is told to
stop. Nothing is dropped silently: at exit :meth:`Sender.close` reports how many segments were left unsent.

Memory is bounded by ``capacity`` segments here plus ``SNDHWM`` messages and the kernel's TCP buffers.

Heartbeat ``hello`` messages are not segments: only the newest unsent one is kept (a newer hello makes an
older one pointless), and it goes out *before* queued segments, so that a broker that has just (re)started
learns the env spec before the segments it would otherwise drop as ``no_spec``. A socket monitor notices
every (re)connection and re-sends the hello first.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..wire.protocol import Frame

BACKOFF_MIN_S = 0.001
BACKOFF_MAX_S = 0.05


class Sender:
    """Bounded FIFO of segments in front of a PUSH socket; see the module docstring for the rules.

    Counters: ``queued`` (segments waiting here now), ``sent`` (segments the socket accepted),
    ``blocked_s`` (seconds the worker spent blocked on a full queue), ``hellos_sent``,
    ``max_queued`` (high-water mark of the queue, never above ``capacity``).
    """

    def __init__(
        self,
        sock: zmq.Socket,
        capacity: int,
        log: Any,
        *,
        hello: Optional[Callable[[], Sequence[Frame]]] = None,
        log_interval_s: float = 5.0,
        monitor: bool = True,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"send queue capacity = {capacity} must be >= 1")
        self.sock = sock
        self.capacity = int(capacity)
        self.log = log
        self.log_interval_s = float(log_interval_s)
        self._hello_fn = hello
        self._queue: Deque[Sequence[Frame]] = collections.deque()
        self._hello: Optional[Sequence[Frame]] = None
        self.sent = 0
        self.hellos_sent = 0
        self.blocked_s = 0.0
        self.blocked_events = 0
        self.max_queued = 0
        self._last_bp_log = 0.0
        self._bp_since_log = 0.0
        self._monitor: Optional[zmq.Socket] = (sock.get_monitor_socket(zmq.EVENT_CONNECTED) if monitor
                                               else None)

    # ------------------------------------------------------------------------------------ counters
    @property
    def queued(self) -> int:
        return len(self._queue)

    def counters(self) -> Dict[str, Any]:
        """Figures for the status line: queue depth, totals, seconds blocked by backpressure."""
        return {
            "queued": self.queued,
            "capacity": self.capacity,
            "sent": self.sent,
            "blocked_s": round(self.blocked_s, 3),
            "max_queued": self.max_queued,
        }

    # ------------------------------------------------------------------------------------- sending
    def hello(self, frames: Optional[Sequence[Frame]] = None) -> None:
        """Queue a heartbeat ``hello`` (replacing any unsent one) and try to send it now,
        ahead of segments."""
        if frames is None:
            if self._hello_fn is None:
                return
            frames = self._hello_fn()
        self._hello = frames
        self.pump()

    def send(
        self,
        frames: Sequence[Frame],
        stop: Callable[[], bool] = lambda: False,
        idle: Optional[Callable[[], None]] = None,
    ) -> bool:
        """Queue one segment, blocking while the queue is full (backpressure) unless ``stop()`` turns true.

        ``idle`` runs between retries while blocked (the worker keeps its heartbeat and status line going).
        Returns True when the segment is queued or sent. When ``stop()`` ends a block the segment is still
        queued (beyond capacity, for :meth:`flush` to try) and False is returned, so the caller stops.
        """
        self.pump()
        if len(self._queue) >= self.capacity:
            self._block(stop, idle)
        self._queue.append(frames)
        self.max_queued = max(self.max_queued, min(len(self._queue), self.capacity))
        self.pump()
        return len(self._queue) <= self.capacity

    def _block(self, stop: Callable[[], bool], idle: Optional[Callable[[], None]]) -> None:
        start = time.monotonic()
        backoff = BACKOFF_MIN_S
        self.blocked_events += 1
        last = start
        while len(self._queue) >= self.capacity and not stop():
            time.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)
            self.pump()
            now = time.monotonic()
            self.blocked_s += now - last
            self._bp_since_log += now - last
            last = now
            if now - self._last_bp_log >= self.log_interval_s:
                self._log_backpressure(now - start, still_blocked=True)
            if idle is not None:
                idle()
        now = time.monotonic()
        self.blocked_s += now - last
        self._bp_since_log += now - last
        if now - self._last_bp_log >= self.log_interval_s:
            self._log_backpressure(now - start, still_blocked=False)

    def _log_backpressure(self, waited_s: float, still_blocked: bool) -> None:
        self.log.warning(
            "backpressure",
            waited_s=round(waited_s, 3),
            blocked_since_last_log_s=round(self._bp_since_log, 3),
            blocked_total_s=round(self.blocked_s, 3),
            queued=len(self._queue),
            capacity=self.capacity,
            still_blocked=still_blocked,
        )
        self._last_bp_log = time.monotonic()
        self._bp_since_log = 0.0

    def pump(self) -> int:
        """Send what the socket takes without blocking: the pending hello first, then segments in order."""
        self._check_monitor()
        if self._hello is not None:
            if not self._try(self._hello):
                return 0
            self._hello = None
            self.hellos_sent += 1
        n = 0
        while self._queue:
            if not self._try(self._queue[0]):
                break
            self._queue.popleft()
            self.sent += 1
            n += 1
        return n

    def _try(self, frames: Sequence[Frame]) -> bool:
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def _check_monitor(self) -> None:
        """On every (re)connection to the broker, send a hello before anything else."""
        if self._monitor is None:
            return
        connected = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event.get("event") == zmq.EVENT_CONNECTED:
                connected = True
        if connected and self._hello_fn is not None:
            self._hello = self._hello_fn()

    def flush(self, timeout_s: float) -> int:
        """Try to send every queued segment for up to ``timeout_s``; return how many are still unsent."""
        deadline = time.monotonic() + timeout_s
        backoff = BACKOFF_MIN_S
        while True:
            self.pump()
            if not self._queue or time.monotonic() >= deadline:
                break
            time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(BACKOFF_MAX_S, backoff * 2)
        return len(self._queue)

    def close(self) -> List[Sequence[Frame]]:
        """Stop monitoring; return (and forget) the segments that were never sent, for the
        caller to report."""
        left = list(self._queue)
        self._queue.clear()
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        return left
