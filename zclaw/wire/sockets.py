"""Socket setup shared by every role, the Lazy Pirate request client and rate-limited drop logging.

Every socket is made by :func:`make_socket`, so every one has a receive size cap (``MAXMSGSIZE``),
bounded queues (``SNDHWM``/``RCVHWM``) and ``LINGER`` set: an unbounded queue or a socket that blocks
process exit are the two ZeroMQ defaults that bite distributed trainers.

CURVE. ``make_socket(..., curve=CurveServer(...))`` makes an encrypting server socket whose clients must be
on an allowlist: the first such socket of a context starts that context's ZAP authenticator (a
``ThreadAuthenticator`` loading the allowlist directory), and every server socket sets
``ZAP_ENFORCE_DOMAIN`` so that a missing authenticator refuses everyone instead of admitting anyone who
knows the server's public key (libzmq's default). ``curve=CurveClient(...)`` makes a client that encrypts
and presents its own key. A context with an authenticator must be closed with :func:`term_context`
(``ctx.term()`` alone would wait forever on the authenticator's socket).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import zmq

from .messages import parse
from .protocol import Frame, Message, WireError

#: the receive cap of a client socket (weights, batches, replies) when ``network.max_message_mb`` is 0
#: (auto): the broker derives its own ingest cap from the env spec (``zclaw.broker.server``), a client
#: receives what trusted servers send
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20

#: a client logs undecodable replies at most once per this many seconds (they are counted in ``drops``)
BAD_REPLY_LOG_S = 10.0
#: the ZAP domain of every zclaw server socket (the authenticator's allowlist is registered for it)
ZAP_DOMAIN = "zclaw"


def message_cap_bytes(max_message_mb: int) -> int:
    """The receive cap in bytes for ``network.max_message_mb`` (0: auto, :data:`DEFAULT_MAX_MESSAGE_BYTES`
    for a client socket)."""
    return int(max_message_mb) << 20 if int(max_message_mb) > 0 else DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class CurveServer:
    """CURVE keys of a server socket (z85) and the directory of client public certs it admits (ZAP)."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed_dir: str
    log: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CurveClient:
    """CURVE keys a client presents (z85) and the public key of the server it connects to."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


class _ZapLog:
    """The authenticator's ``logging``-style calls, as structlog lines: refusals counted, at most one
    warning per interval (a scanner must not flood the log)."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self.denied = DropCounter(log, "connections refused by the CURVE allowlist (ZAP)")

    def debug(self, msg: str, *args: Any) -> None:
        text = msg % args if args else msg
        if text.startswith("DENIED"):
            self.denied.drop("zap_denied", text)

    info = debug

    def warning(self, msg: str, *args: Any) -> None:
        self._log.warning("zap: " + (msg % args if args else msg))

    def error(self, msg: str, *args: Any) -> None:
        self._log.error("zap: " + (msg % args if args else msg))

    exception = error


#: id(ctx) -> (weak reference to ctx, its authenticator, the allowlist directory it loaded)
_AUTHENTICATORS: Dict[int, Tuple[Any, Any, str]] = {}
_AUTH_LOCK = threading.Lock()


def ensure_authenticator(ctx: zmq.Context, allowed_dir: str, log: Any = None) -> Any:
    """Start ``ctx``'s ZAP authenticator (once per context) admitting the CURVE keys in ``allowed_dir``.

    The allowlist is read now: a cert added later takes effect when the server restarts.
    """
    from zmq.auth.thread import ThreadAuthenticator

    with _AUTH_LOCK:
        entry = _AUTHENTICATORS.get(id(ctx))
        if entry is not None and entry[0]() is ctx:
            if entry[2] != allowed_dir:
                raise ValueError(f"context already admits {entry[2]!r}; cannot also use "
                                 f"allowlist {allowed_dir!r}")
            return entry[1]
        auth = ThreadAuthenticator(ctx, log=_ZapLog(log) if log is not None else None)
        auth.start()
        # configure_curve's domain is matched literally against each socket's ZAP_DOMAIN ("*" only
        # covers sockets without a domain), so register the allowlist under ours
        auth.configure_curve(domain=ZAP_DOMAIN, location=allowed_dir)
        _AUTHENTICATORS[id(ctx)] = (weakref.ref(ctx), auth, allowed_dir)
        return auth


def term_context(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s authenticator if it has one, then ``ctx.term()``; close your own sockets first."""
    with _AUTH_LOCK:
        entry = _AUTHENTICATORS.pop(id(ctx), None)
    if entry is not None and entry[0]() is ctx:
        entry[1].stop()
    ctx.term()


def _apply_curve(ctx: zmq.Context, sock: zmq.Socket, curve: Union[CurveServer, CurveClient]) -> None:
    if isinstance(curve, CurveServer):
        ensure_authenticator(ctx, curve.allowed_dir, curve.log)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no authenticator -> nobody in (fail closed)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    hwm: int = 64,
    linger_ms: int = 0,
    conflate: bool = False,
    curve: Optional[Union[CurveServer, CurveClient]] = None,
) -> zmq.Socket:
    """A socket with the project's safety settings applied; bind or connect it yourself.

    ``curve``: None for plain TCP, :class:`CurveServer` for a socket that binds and admits only
    allowlisted clients, :class:`CurveClient` for one that connects to such a server (see module doc).
    ``max_message_bytes <= 0`` (``network.max_message_mb = 0``, auto) means
    :data:`DEFAULT_MAX_MESSAGE_BYTES`.
    """
    if max_message_bytes <= 0:
        max_message_bytes = DEFAULT_MAX_MESSAGE_BYTES
    sock = ctx.socket(kind)
    if curve is not None:
        try:
            _apply_curve(ctx, sock, curve)
        except BaseException:
            sock.close(linger=0)
            raise
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


#: how long :func:`rebind` keeps reading the socket after the bind, so that the connections the old listener
#: accepted are closed (their peers see it and reconnect) before the caller answers anyone: measured, a peer
#: sees the close ~2 ms after the unbind once the socket's queue from it is read, and not at all (it goes
#: on writing into the dead connection, and those bytes are lost) while that queue holds messages
REBIND_SETTLE_S = 0.01


def rebind(
    sock: zmq.Socket, endpoint: str, max_message_bytes: int, on_message: Callable[[List[zmq.Frame]], None],
    timeout_s: float = 5.0,
) -> int:
    """Bind ``sock`` again on ``endpoint`` (its ``LAST_ENDPOINT``) with a new ``MAXMSGSIZE``; return how many
    messages were handed to ``on_message`` meanwhile.

    Why: libzmq copies a socket's options into its listener at bind, so ``MAXMSGSIZE`` set later holds for
    no connection, old or new; a new listener is the only way to change it. What it costs (measured,
    libzmq 4.3): unbinding closes every connection that listener accepted. Messages already in the socket's
    queues stay readable, but a connection closes only once its queue is read, so this reads them (to
    ``on_message``, in order) until the bind is done and :data:`REBIND_SETTLE_S` more. Peers reconnect by
    themselves (``ZMQ_RECONNECT_IVL``, 100 ms) and what they send meanwhile waits in their own queues;
    only bytes on the wire at that moment (TCP buffers, a message libzmq was decoding, anything a peer
    writes before it sees the close) are lost. Read the socket dry first, and choose a moment when no peer
    has reason to be sending (see ``zclaw.broker.server``).

    libzmq closes the old listener asynchronously, so the bind is retried while the port is still held
    (about a millisecond); ``zmq.ZMQError`` after ``timeout_s``.
    """
    read = 0

    def read_queued() -> None:
        nonlocal read
        while True:
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            read += 1
            on_message(frames)

    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    sock.unbind(endpoint)
    deadline = time.monotonic() + timeout_s
    while True:
        read_queued()  # also processes the socket's commands: the old listener's end among them
        try:
            sock.bind(endpoint)
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.001)
    settle = time.monotonic() + REBIND_SETTLE_S
    while time.monotonic() < settle:
        read_queued()
        time.sleep(0.001)
    read_queued()
    return read


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
            self._log.warning(f"dropped {self._what}", causes=dict(self._since_log), last=cause,
                              detail=detail[:200])
            self._since_log.clear()
            self._last_log = now

    def as_dict(self) -> Dict[str, int]:
        return dict(self.counts)


class LazyPirate:
    """ZeroMQ guide's *Lazy Pirate* client: REQ with a poll timeout; on timeout close and reconnect.

    A REQ socket whose peer died stays stuck waiting for a reply forever, so on each timeout the
    socket is thrown away and a fresh one sends the request again, with a growing backoff. With
    ``retries=None`` it retries until ``stop()`` returns True (the learner must outlive a broker
    restart); otherwise :meth:`request` returns None after that many failed tries. A reply that cannot
    be decoded is a failed try too (counted in ``drops`` by cause, logged at most once per
    :data:`BAD_REPLY_LOG_S`), so ``retries=0`` means one question whatever the server answers.
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
        curve: Optional[CurveClient] = None,
    ) -> None:
        self.ctx = ctx
        self.curve = curve
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.retries = retries
        self.backoff_max_ms = backoff_max_ms
        self.max_message_bytes = max_message_bytes
        self.log = log
        self.configure = configure
        self.sock: Optional[zmq.Socket] = None
        self.failures = 0  # consecutive timeouts, for callers' reports
        self.drops: Counter = Counter()  # replies that could not be decoded, by cause
        self._bad_logged = -BAD_REPLY_LOG_S

    socket_type = zmq.REQ

    def _connect(self) -> zmq.Socket:
        sock = make_socket(self.ctx, self.socket_type, max_message_bytes=self.max_message_bytes,
                           curve=self.curve)
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
                reply = recv_frames(self.sock)
                self.failures = 0
                try:
                    return parse(reply, kinds)
                except WireError as exc:  # a broken reply: counted, and it uses up one try like a timeout
                    self._bad_reply(exc)
            attempt += 1
            if not self._after_timeout(attempt, stop):
                return None
        return None

    def _bad_reply(self, exc: WireError) -> None:
        """Count a reply that cannot be decoded under its cause; log at most once per
        :data:`BAD_REPLY_LOG_S`. The caller then treats it as a failed try (fresh socket, backoff,
        ``retries``): a server whose every answer is undecodable (e.g. a status report grown past the
        decoder's cap) must cost a bounded number of tries, never a tight loop of re-asks."""
        self.drops[exc.cause] += 1
        now = time.monotonic()
        if self.log is not None and now - self._bad_logged >= BAD_REPLY_LOG_S:
            self._bad_logged = now
            self.log.warning("bad reply", endpoint=self.endpoint, error=str(exc)[:200],
                             drops=dict(self.drops))

    def _after_timeout(self, attempt: int, stop: Callable[[], bool]) -> bool:
        """Throw the socket away and back off; False when ``retries`` are used up."""
        self.failures += 1
        self.close()
        if self.retries is not None and attempt > self.retries:
            return False
        backoff = min(self.backoff_max_ms, 100 * 2 ** min(attempt, 10)) / 1000.0
        if self.log is not None and (attempt == 1 or attempt % 10 == 0):
            self.log.warning("no reply, reconnecting (Lazy Pirate)", endpoint=self.endpoint, attempt=attempt)
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline and not stop():
            time.sleep(0.05)
        return True


class CreditPirate(LazyPirate):
    """Lazy Pirate with credit: up to ``credit`` requests in flight on a DEALER, replies in order.

    A REQ socket allows one request at a time, so the peer sits idle while the client works on a
    reply, and the client waits a full round trip for the next. Here the client keeps ``credit``
    requests outstanding (the ZeroMQ guide's credit-based flow control): the learner trains on
    batch i while the broker prepares batch i+1 and ZeroMQ's I/O thread receives it. Reliability is
    Lazy Pirate's: a reply that does not come within ``timeout_ms`` throws the socket away, and the
    requests still outstanding are sent again on a fresh one after the same backoff. Use it for
    requests whose answers are interchangeable (``sample``); a status question goes through a plain
    :class:`LazyPirate`, since its reply would queue behind the batches.
    """

    socket_type = zmq.DEALER

    def __init__(self, ctx: zmq.Context, endpoint: str, *, credit: int = 2, **kwargs: Any) -> None:
        if credit < 1:
            raise ValueError(f"credit = {credit} must be >= 1")
        super().__init__(ctx, endpoint, **kwargs)
        self.credit = int(credit)
        self.in_flight: Deque[Sequence[Frame]] = deque()

    def _send(self, frames: Sequence[Frame]) -> None:
        assert self.sock is not None
        self.sock.send_multipart([b""] + list(frames), copy=False)  # the empty delimiter REQ would add

    def exchange(
        self,
        frames: Sequence[Frame],
        kinds: Optional[Sequence[str]] = None,
        stop: Callable[[], bool] = lambda: False,
    ) -> Optional[Message]:
        """Top up the requests in flight to ``credit`` with ``frames``; return the oldest one's reply.

        None when stopped or when ``retries`` timeouts in a row are used up. A malformed reply is
        counted in ``drops`` and skipped (its request is answered, the stream stays in order).
        """
        attempt = 0
        while not stop():
            if self.sock is None:
                self.sock = self._connect()
                for pending in self.in_flight:  # a fresh socket: what the old one still owed is asked again
                    self._send(pending)
            while len(self.in_flight) < self.credit:
                self._send(frames)
                self.in_flight.append(frames)
            if self.sock.poll(self.timeout_ms, zmq.POLLIN):
                reply = recv_frames(self.sock)
                self.in_flight.popleft()
                self.failures = 0
                attempt = 0
                try:
                    if len(reply) < 2 or len(reply[0]) != 0:
                        raise WireError("malformed", "reply lacks the empty delimiter frame")
                    return parse(reply[1:], kinds)
                except WireError as exc:
                    self._bad_reply(exc)
                    continue
            attempt += 1
            if not self._after_timeout(attempt, stop):
                return None
        return None


def recv_frames(sock: zmq.Socket, flags: int = 0) -> List[zmq.Frame]:
    """One multipart message as ``zmq.Frame`` objects (no copy): ``recv_multipart(flags, copy=False)``
    at half its cost, since each frame says itself whether more follow (pyzmq's version asks the
    socket for ``RCVMORE`` after every frame). ``flags`` (``zmq.NOBLOCK``) apply to the first frame;
    ZeroMQ delivers a multipart message whole, so the rest are there already. Raises ``zmq.Again``
    like ``recv`` when nothing is waiting."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


def recv_all(sock: zmq.Socket, limit: int = 1 << 30) -> List[List[Any]]:
    """Drain every message waiting on ``sock`` without blocking (at most ``limit``)."""
    out = []
    while len(out) < limit:
        try:
            out.append(recv_frames(sock, zmq.NOBLOCK))
        except zmq.Again:
            break
    return out
