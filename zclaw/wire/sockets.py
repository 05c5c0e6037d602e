"""Socket setup shared by every role, the Lazy Pirate request client and rate-limited drop logging.

Every socket is made by :func:`make_socket`, so every one has a receive size cap (``MAXMSGSIZE``),
bounded queues (``SNDHWM``/``RCVHWM``) and ``LINGER`` set: an unbounded queue or a socket that blocks
process exit are the two ZeroMQ defaults that bite distributed trainers.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence

import zmq

from .messages import parse
from .protocol import Frame, Message, WireError

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    hwm: int = 64,
    linger_ms: int = 0,
    conflate: bool = False,
) -> zmq.Socket:
    """A socket with the project's safety settings applied; bind or connect it yourself."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    sock.setsockopt(zmq.LINGER, int(linger_ms))
    if conflate:
        sock.setsockopt(zmq.CONFLATE, 1)  # keep only the newest message; needs single-frame messages
    else:
        sock.setsockopt(zmq.SNDHWM, int(hwm))
        sock.setsockopt(zmq.RCVHWM, int(hwm))
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished peer is dropped, not an error
    return sock


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind to ``host:port`` (port 0 picks a free one); return the bound port."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(tcp(host, port))
    return port


class DropCounter:
    """Counts dropped messages by cause and logs at most once per ``interval_s`` (no log floods)."""

    def __init__(self, log: Any, what: str, interval_s: float = 10.0) -> None:
        self.counts: Counter = Counter()
        self._log = log
        self._what = what
        self._interval = interval_s
        self._last_log = 0.0
        self._since_log: Counter = Counter()

    def drop(self, cause: str, detail: str = "") -> None:
        self.counts[cause] += 1
        self._since_log[cause] += 1
        now = time.monotonic()
        if now - self._last_log >= self._interval:
            self._log.warning(f"dropped {self._what}", causes=dict(self._since_log), last=cause, detail=detail[:200])
            self._since_log.clear()
            self._last_log = now

    def as_dict(self) -> Dict[str, int]:
        return dict(self.counts)


class LazyPirate:
    """ZeroMQ guide's *Lazy Pirate* client: REQ with a poll timeout; on timeout close and reconnect.

    A REQ socket whose peer died stays stuck waiting for a reply forever, so on each timeout the
    socket is thrown away and a fresh one sends the request again, with a growing backoff. With
    ``retries=None`` it retries until ``stop()`` returns True (the learner must outlive a broker
    restart); otherwise :meth:`request` returns None after that many failed tries.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        timeout_ms: int = 2500,
        retries: Optional[int] = 3,
        backoff_max_ms: int = 5000,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        log: Any = None,
        configure: Optional[Callable[[zmq.Socket], None]] = None,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.retries = retries
        self.backoff_max_ms = backoff_max_ms
        self.max_message_bytes = max_message_bytes
        self.log = log
        self.configure = configure
        self.sock: Optional[zmq.Socket] = None
        self.failures = 0  # consecutive timeouts, for callers' reports
        self.drops = Counter()

    def _connect(self) -> zmq.Socket:
        sock = make_socket(self.ctx, zmq.REQ, max_message_bytes=self.max_message_bytes)
        if self.configure is not None:
            self.configure(sock)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def request(
        self,
        frames: Sequence[Frame],
        kinds: Optional[Sequence[str]] = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> Optional[Message]:
        """Send ``frames`` and return the parsed reply, retrying through timeouts (see class doc)."""
        attempt = 0
        while not stop():
            if self.sock is None:
                self.sock = self._connect()
            self.sock.send_multipart(frames, copy=False)
            if self.sock.poll(self.timeout_ms, zmq.POLLIN):
                reply = self.sock.recv_multipart(copy=False)
                self.failures = 0
                try:
                    return parse(reply, kinds)
                except WireError as exc:  # a broken reply: count it and ask again on a fresh socket
                    self.drops[exc.cause] += 1
                    if self.log is not None:
                        self.log.warning("bad reply", endpoint=self.endpoint, error=str(exc))
                    self.close()
                    continue
            self.failures += 1
            attempt += 1
            self.close()
            if self.retries is not None and attempt > self.retries:
                return None
            backoff = min(self.backoff_max_ms, 100 * 2 ** min(attempt, 10)) / 1000.0
            if self.log is not None and (attempt == 1 or attempt % 10 == 0):
                self.log.warning("no reply, reconnecting (Lazy Pirate)", endpoint=self.endpoint, attempt=attempt)
            deadline = time.monotonic() + backoff
            while time.monotonic() < deadline and not stop():
                time.sleep(0.05)
        return None


def recv_all(sock: zmq.Socket, limit: int = 1 << 30) -> List[List[Any]]:
    """Drain every message waiting on ``sock`` without blocking (at most ``limit``)."""
    out = []
    while len(out) < limit:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            break
    return out
