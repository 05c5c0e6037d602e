"""The broker process: PULL segments from workers into the store, serve batches and status (ROUTER).

The loop, in one thread::

    bind ingest PULL (workers' PUSH: hello + segment) and serve ROUTER (learner's / tools' REQ)
    until SIGINT/SIGTERM sets the stop event:
        poll both sockets, 100 ms timeout (so a signal is seen within 100 ms)
        serve ready  -> answer every waiting request: sample -> batch | retry, status -> status,
                        anything else -> error (a REQ client must get *some* reply, or it is stuck)
        ingest ready -> take up to INGEST_BURST messages: size check, parse, validate, keep in the
                        store; then back to the poll, so requests are never starved by a flood
        every log.status_s -> one status log line
    close both sockets (linger 0) and exit 0

Requests are answered in the loop itself, never by blocking: when no batch can be served yet the
reply is ``retry`` with a reason (``min_size``, ``rate_limited``, ``not_enough_data``) and
``retry_ms``, and the learner asks again (that is what keeps one slow side from freezing the other).

Every message that is not fully understood is dropped and counted by cause (its
:class:`~zclaw.wire.protocol.WireError` cause, or ``oversize``, ``no_spec``, ``bad_spec``); counting
happens before anything reaches the store, which takes a segment only after it passed every check,
so hostile input can neither crash the broker nor change stored data.

Oversize messages. ``ZMQ_MAXMSGSIZE`` makes libzmq *disconnect* a peer that sends a larger frame;
the message never reaches us, so it could not be counted. The sockets therefore get
``MAXMSGSIZE = 2 x network.max_message_mb + 64 KiB`` as a hard backstop (memory stays bounded), and
the broker itself drops and counts as ``oversize`` any message whose frames total more than
``network.max_message_mb``. Between the two caps a peer is counted and stays connected; above the
socket cap (per frame, as libzmq checks it) it is disconnected by libzmq, uncounted. With
``max_message_mb = 0`` (auto) the per-message cap follows the env spec once it is known
(:func:`auto_cap_bytes`), and so does the ingest socket's: see :class:`IngestSocket` (libzmq copies the
option into its listener at bind, so the socket is bound again when the spec is adopted). The serve
socket carries requests only, so its cap is the wire's :data:`~zclaw.wire.limits.REQUEST_SOCKET_BYTES`
(256 KiB) whatever the segment cap: a 2 MiB hello there is refused at its size prefix, unread.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import zmq

from .. import __version__
from ..telemetry import EpisodeWindow, RateMeter, ResourceMeter, resources_from_wire
from ..tokens import TokenBucket
from ..wire.limits import (INGEST_HEADER_BYTES, MAX_BATCH_COLUMNS, MAX_BATCH_SEGMENTS, MAX_REPORT_WORKERS,
                           MAX_REQUEST_HEADER_BYTES, MAX_SEGMENT_STEPS, REQUEST_SOCKET_BYTES, header_length)
from ..wire.messages import EnvSpec, make, max_segment_bytes, parse
from ..wire.protocol import (MAX_HEADER_BYTES, PROTOCOL_VERSION, Frame, Message, WireError, encode_refusal,
                             peer_version)
from .. import startup
from ..stopping import EXIT_FAILED, EXIT_OK
from ..wire.sockets import (DEFAULT_MAX_MESSAGE_BYTES, DropCounter, bind, make_socket, rebind, recv_frames,
                            term_context)
from .ratelimit import SampleToInsertRatio
from . import snapshot
from .store import LAG_BUCKETS, Store

POLL_MS = 100
#: ingest messages handled between two looks at the serve socket
INGEST_BURST = 64
#: slack on top of twice the configured cap for the socket-level MAXMSGSIZE backstop
SOCKET_CAP_SLACK = 64 << 10
#: distinct worker identities tracked (identities come off the wire: bound the table)
MAX_WORKERS = 1024
#: ``network.max_message_mb = 0`` (auto): the ingest cap is at least this (hellos, requests, status) ...
AUTO_MIN_BYTES = 1 << 20
#: ... and this many times the largest legal segment of worker.segment_length steps x AUTO_MIN_ENVS envs
#: (or worker.envs, if larger) once the env spec is known: workers of a fleet step different numbers of
#: envs (a GPU box thousands, a CPU box 16), and a worker must not lose its data because its env count
#: differs from the broker's config (see docs/operations.md)
AUTO_HEADROOM = 2
AUTO_MIN_ENVS = 4096
#: a handler that raised is logged (with its traceback) at most once per this many seconds
ERROR_LOG_S = 10.0
#: "worker joined" lines per ERROR_LOG_S (identities come off the wire: a flood of new ones is counted)
JOIN_LOGS_PER_INTERVAL = 10


def auto_cap_bytes(spec: EnvSpec, envs: int, segment_length: int) -> int:
    """The broker's ingest cap for ``network.max_message_mb = 0``: see :data:`AUTO_HEADROOM`."""
    envs = max(int(envs), AUTO_MIN_ENVS)
    return max(AUTO_MIN_BYTES, AUTO_HEADROOM * max_segment_bytes(spec, int(segment_length), envs))


def socket_cap_bytes(max_bytes: int) -> int:
    """The ingest socket's ``MAXMSGSIZE`` for a per-message cap of ``max_bytes`` (see the module doc)."""
    return 2 * int(max_bytes) + SOCKET_CAP_SLACK


#: before :class:`IngestSocket` binds again it reads what is arriving until nothing came for this long ...
TIGHTEN_QUIET_S = 0.02
#: ... or for this long at most (a peer streaming without pause cannot hold the loop)
TIGHTEN_DRAIN_S = 0.25


class IngestSocket:
    """The ingest PULL socket, whose ``MAXMSGSIZE`` follows the broker's per-message cap, and the messages
    read ahead of the loop (:attr:`pending`).

    Why it is bound again. libzmq copies ``MAXMSGSIZE`` into the listener at bind, and a fresh broker with
    ``network.max_message_mb = 0`` (auto) binds before it knows the env spec, so with 2 x 256 MiB: six
    400 MB messages were then read whole and only afterwards counted ``oversize``, ~0.4 cores of copying
    that a 2-core run paid for with 0.43-0.66x of its updates (bench/hostile.py). When the spec is adopted,
    :meth:`follow` binds again with ``2 x auto cap + 64 KiB`` (Reacher: ~122 MB), and libzmq refuses
    anything larger at its size prefix.

    Why then and why this way. Binding again closes the connections the old listener accepted (libzmq
    has no other way to change the option), and bytes on the wire at that moment are lost
    (:func:`zclaw.wire.sockets.rebind`). The spec is adopted on the first worker ``hello`` (or restored
    from a snapshot, before the first bind: then nothing is bound twice), which is the one moment no
    segment can be lost: a segment before the spec is dropped as ``no_spec`` anyway, and a worker sends
    segments only after the ``welcome`` to its handshake, which goes out after the new bind (the serve
    branch of the loop calls :meth:`follow` before it sends the reply). A peer that says ``hello`` on
    ingest and streams segments behind it without waiting (as test stand-ins do) is covered only in part:
    the socket is first read until it has been quiet for :data:`TIGHTEN_QUIET_S` (at most
    :data:`TIGHTEN_DRAIN_S`), and what is still queued after the unbind is read as well, but what is on
    the wire as the old connections go is lost: a peer that pauses and then writes at that moment, or
    peers that stream for longer than the drain (32 synthetic pushers on a loaded 2-core machine lost 17k
    of 44k segments). Clients that stream must handshake on the serve socket first, as workers and
    ``bench/load.py`` do. Workers reconnect by themselves within ~100 ms (ZeroMQ), and
    what they send meanwhile waits in their queues. Binding ingest only once the spec is known was the
    alternative: it would leave a broker fed by ingest hellos alone (tools, old workers) with no spec
    ever, and a snapshot-less restart without ingest until a worker's handshake.

    Messages read while the loop could not take them (``broker.when_full = "wait"`` with a full store)
    wait in :attr:`pending`, in order, ahead of the socket: bounded by what the socket's queues held.
    """

    def __init__(self, sock: zmq.Socket, cap: int) -> None:
        self.sock = sock
        self.cap = int(cap)  # the MAXMSGSIZE the current listener has
        self.endpoint: Optional[str] = None  # set once bound
        self.pending: "deque[List[Frame]]" = deque()
        self.rebinds = 0
        self.lost: Optional[str] = None  # why ingest could not be bound again (then the broker stops)

    def bound(self) -> None:
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def next(self) -> Optional[List[Frame]]:
        """The next message: a pending one first, then the socket's (None: nothing waiting)."""
        if self.pending:
            return self.pending.popleft()
        try:
            return recv_frames(self.sock, zmq.NOBLOCK)
        except zmq.Again:
            return None

    def follow(self, broker: "Broker") -> bool:
        """Bind again if the broker's cap moved since the last bind (see the class doc); True if it did."""
        want = socket_cap_bytes(broker.max_bytes)
        if want == self.cap or self.endpoint is None:
            return False

        def take(frames: List[Frame]) -> None:
            if not self.pending and broker.accepting():
                broker.on_ingest(frames)
            else:
                self.pending.append(frames)

        t0 = time.monotonic()
        quiet = t0 + TIGHTEN_QUIET_S
        deadline = t0 + TIGHTEN_DRAIN_S
        while True:  # read dry, until nothing came for TIGHTEN_QUIET_S
            end = min(quiet, deadline)
            now = time.monotonic()
            if now >= end:
                break
            if not self.sock.poll(max(1, int((end - now) * 1000)), zmq.POLLIN):
                continue
            try:
                frames = recv_frames(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                continue
            take(frames)
            quiet = time.monotonic() + TIGHTEN_QUIET_S
        try:
            late = rebind(self.sock, self.endpoint, want, take)
        except zmq.ZMQError as exc:  # the port was taken in the millisecond it was free: stop, exit 1
            self.lost = f"cannot bind ingest again on {self.endpoint}: {exc}"
            broker.log.error("cannot bind ingest again; stopping", endpoint=self.endpoint, error=str(exc))
            return False
        self.cap = want
        self.rebinds += 1
        broker.log.info("ingest bound again with the cap of the adopted env spec", socket_cap_bytes=want,
                        max_message_bytes=broker.max_bytes, read_before_bind_ms=round(
                            (time.monotonic() - t0) * 1000, 1), read_during_bind=late,
                        pending=len(self.pending))
        return True


class LoopClock:
    """When a service loop (ingest, serve) last handled a message, and how many: the status report's
    ``loops``, so that a loop that stopped answering shows up as a growing ``last_s_ago``."""

    def __init__(self) -> None:
        self.last: Optional[float] = None
        self.handled = 0

    def tick(self, now: float) -> None:
        self.last = now
        self.handled += 1

    def report(self, now: float) -> Dict[str, Any]:
        return {"last_s_ago": None if self.last is None else round(now - self.last, 3),
                "handled": self.handled}


class WorkerInfo:
    """What the broker knows about one worker, from its hellos and segments."""

    def __init__(self, now: float) -> None:
        self.host: Optional[str] = None
        self.pid: Optional[int] = None
        self.last_seen = now
        self.segments = 0
        self.steps = 0
        self.envs: Optional[int] = None  # env count N of its last segment (workers differ: protocol v2)
        self.version: Optional[int] = None
        self.version_t = now  # when ``version`` last changed: how long the worker has acted on those weights
        self.rate = RateMeter(now=now)
        #: segments of this worker dropped for values beyond worker.max_abs_obs / max_abs_reward
        self.out_of_range = 0
        #: the worker process's CPU, memory, threads and GPU, from its last hello (checked and rebuilt by
        #: telemetry.resources_from_wire: a fixed small shape whatever it sent), or None
        self.resources: Optional[Dict[str, Any]] = None

    def report(self, now: float) -> Dict[str, Any]:
        return {
            "envs": self.envs,
            "out_of_range": self.out_of_range,
            "resources": self.resources,
            "host": self.host,
            "pid": self.pid,
            "last_seen_s": round(now - self.last_seen, 3),
            "segments": self.segments,
            "steps": self.steps,
            "rate": self.rate.rate(now),
            "version": self.version,
            "version_age_s": round(now - self.version_t, 3),
        }


class Broker:
    """The broker's state and message handlers; :func:`main` owns the sockets and the loop."""

    def __init__(self, cfg: Dict[str, Dict[str, Any]], log: Any) -> None:
        self.cfg = cfg
        self.log = log
        b = cfg["broker"]
        self.limiter = SampleToInsertRatio(b["samples_per_insert"], b["min_size"], b["spi_error_buffer"])
        mb = int(cfg["network"]["max_message_mb"])
        #: network.max_message_mb = 0: the cap follows the env spec (:func:`auto_cap_bytes`)
        self.auto_cap = mb <= 0
        self.max_bytes = mb << 20 if mb > 0 else DEFAULT_MAX_MESSAGE_BYTES
        #: per-identity fairness on the serve socket: all requests, and status reports (costlier)
        self.requests = TokenBucket(b["request_rate"], b["request_burst"], max_identities=MAX_WORKERS)
        self.status_requests = TokenBucket(b["status_rate"], b["status_burst"], max_identities=MAX_WORKERS)
        self.loops = {"ingest": LoopClock(), "serve": LoopClock()}
        self._error_logged = -1e9
        self._joins_window = -1e9
        self._joins_logged = 0
        self.joins_unlogged = 0
        self.retry_ms = int(b["retry_ms"])
        self.wait_when_full = b["when_full"] == "wait"
        #: segments per batch the learner last asked for (what "the learner can make progress" means)
        self.last_batch_size = 1
        self.spec: Optional[EnvSpec] = None
        self.store: Optional[Store] = None
        self.drops = DropCounter(log, "messages")
        self.retries: Counter = Counter()
        self.workers: "OrderedDict[str, WorkerInfo]" = OrderedDict()
        self.t0 = time.monotonic()
        self.insert_meter = RateMeter(now=self.t0)
        self.sample_meter = RateMeter(now=self.t0)
        self.episodes = EpisodeWindow()  # the episodes the segments reported
        self.resources = ResourceMeter()  # this process's CPU, memory, threads: the report's ``resources``
        self.snapshots: Optional[snapshot.Snapshotter] = None
        self.identity = f"broker-{socket.gethostname()}-{os.getpid()}"
        self.refused: Counter = Counter()
        self._refusal_logged: Dict[Tuple[str, str], float] = {}
        self._clients: set = set()
        #: what the snapshot restored at start brought (counters before this process), or None
        self.restored: Optional[Dict[str, int]] = None

    # ---------------------------------------------------------------------------------- ingest

    def handler_failed(self, where: str, exc: BaseException) -> None:
        """A handler raised on one message: count it (``internal``) and log it with its traceback at most
        once per :data:`ERROR_LOG_S` (the count goes on); the loop then carries on with the next one."""
        self.drops.counts["internal"] += 1
        now = time.monotonic()
        if now - self._error_logged >= ERROR_LOG_S:
            self._error_logged = now
            self.log.error(f"{where} handler failed", error=repr(exc)[:300],
                           internal=self.drops.counts["internal"], exc_info=True)

    def on_ingest(self, frames: Sequence[Frame]) -> None:
        """One message off the PULL socket: a worker ``hello`` or ``segment``; never raises."""
        self.loops["ingest"].tick(time.monotonic())
        try:
            size = sum(len(f) for f in frames)
            if size > self.max_bytes:
                self.drops.drop("oversize", f"{size} bytes > {self.max_bytes}")
                return
            head = header_length(frames)
            if head > INGEST_HEADER_BYTES:  # before msgpack reads a byte of it (1,100 1-MiB hellos)
                raise WireError("oversize_header", f"header of {head} bytes > {INGEST_HEADER_BYTES}")
            msg = parse(frames, ("hello", "segment"))
            if msg.kind == "hello":
                self._on_hello(msg)
            else:
                self._on_segment(msg)
        except WireError as exc:
            self.drops.drop(exc.cause, str(exc))
        except Exception as exc:  # a bug must not take the broker (and the run) down
            self.handler_failed("ingest", exc)

    def _worker(self, identity: str, now: float) -> WorkerInfo:
        info = self.workers.get(identity)
        if info is None:
            if len(self.workers) >= MAX_WORKERS:  # forget the one silent the longest
                oldest = min(self.workers, key=lambda k: self.workers[k].last_seen)
                del self.workers[oldest]
            info = self.workers[identity] = WorkerInfo(now)
            if now - self._joins_window >= ERROR_LOG_S:
                if self.joins_unlogged:
                    self.log.info("workers joined without a log line", count=self.joins_unlogged)
                self._joins_window, self._joins_logged, self.joins_unlogged = now, 0, 0
            if self._joins_logged < JOIN_LOGS_PER_INTERVAL:
                self._joins_logged += 1
                self.log.info("worker joined", worker=identity)
            else:
                self.joins_unlogged += 1
        info.last_seen = now
        return info

    def _on_hello(self, msg: Message) -> None:
        spec_d = msg["spec"]
        if spec_d is not None:
            spec = EnvSpec.from_dict(spec_d)
            if self.spec is None:
                self._adopt(spec, msg["identity"])
            elif spec.hash != self.spec.hash:
                who = msg["identity"]
                detail = f"hello from {who!r} has spec {spec.hash}, run has {self.spec.hash}"
                raise WireError("bad_spec", detail)
        if msg["role"] != "worker":
            return
        self._fix_segment_length(msg["segment_length"])
        info = self._worker(msg["identity"], time.monotonic())
        info.host = msg["host"]
        info.pid = msg["pid"]
        info.resources = resources_from_wire(msg.get("resources"))

    def _adopt(self, spec: EnvSpec, identity: str) -> None:
        b = self.cfg["broker"]
        self.store = Store(
            spec,
            b["capacity"],
            mode=b["mode"],
            max_reuse=b["max_reuse"],
            max_staleness=b["max_staleness"],
            alpha=b["priority_alpha"],
            beta=b["priority_beta"],
            seed=self.cfg["run"]["seed"],
            option_balanced=bool(b["option_balanced"]),
            eviction=b["eviction"],
            # the bounds workers end episodes at, checked again: a worker may be old or foreign
            max_abs_obs=float(self.cfg["worker"]["max_abs_obs"]),
            max_abs_reward=float(self.cfg["worker"]["max_abs_reward"]),
        )
        self.spec = spec
        if self.auto_cap:  # the ingest socket's MAXMSGSIZE follows in the loop (IngestSocket.follow)
            w = self.cfg["worker"]
            self.max_bytes = auto_cap_bytes(spec, w["envs"], w["segment_length"])
        self.log.info("adopted env spec", spec=spec.to_dict(), spec_hash=spec.hash, source=identity)

    def _on_segment(self, msg: Message) -> None:
        if self.spec is None or self.store is None:
            raise WireError("no_spec", "segment before any worker hello told the env spec")
        first = self.store.T is None
        try:
            key = self.store.insert(msg)  # validates everything before writing; raises WireError
        except WireError as exc:
            if exc.cause == "out_of_range":  # a blown-up simulator: whose, in the status report
                self._worker(msg["worker"], time.monotonic()).out_of_range += 1
            raise
        if first:
            self.log.info("segment length fixed", T=self.store.T, source=msg["worker"])
        now = time.monotonic()
        envs = self.store.columns(key)
        steps = int(self.store.T * envs)  # type: ignore[operator]
        self.limiter.on_insert(1)
        self.insert_meter.add(steps, now)
        info = self._worker(msg["worker"], now)
        info.envs = envs
        info.segments += 1
        info.steps += steps
        info.rate.add(steps, now)
        v = int(msg.arrays["policy_version"].max())
        if info.version is None or v > info.version:
            info.version, info.version_t = v, now
        self.episodes.add(msg["episodes"])

    def accepting(self) -> bool:
        """Whether the loop should read the ingest socket now (``broker.when_full``).

        With ``when_full = "wait"`` the broker stops reading while the next insert would evict a
        segment that was never sampled, as long as the learner can still make progress (the rate
        limiter would let it sample a batch of the size it last asked
        for). Unread segments wait in the PULL socket and the workers' send queues, whose backpressure blocks
        the workers: flow control from the learner back to the env loop, instead of work
        thrown away at the broker.
        """
        st = self.store
        return not (self.wait_when_full and st is not None and st.next_insert_evicts_unused
                    and self.limiter.allowed_now() >= self.last_batch_size)

    # ----------------------------------------------------------------------------------- serve

    def on_request(self, frames: Sequence[Frame]) -> Optional[List[Any]]:
        """One message off the ROUTER socket; return the frames to send back (None: nobody to answer)."""
        if len(frames) < 1:
            return None
        identity = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
        now = time.monotonic()
        self.loops["serve"].tick(now)
        try:
            if len(frames) < 3 or len(frames[1]) != 0:
                raise WireError("malformed", "request is not [identity, empty delimiter, message...]")
            wait = self.requests.take(identity, now)
            if wait is not None:  # this client asks faster than broker.request_rate: it waits, not others
                return [identity, b""] + self._retry("client_rate", wait)
            body = frames[2:]
            size = sum(len(f) for f in body)
            if size > self.max_bytes:
                raise WireError("oversize", f"{size} bytes > {self.max_bytes}")
            head = header_length(body)
            if head > MAX_REQUEST_HEADER_BYTES:  # under the socket's cap, over any request: before msgpack
                raise WireError("oversize_header", f"request header of {head} bytes > "
                                f"{MAX_REQUEST_HEADER_BYTES}")
            msg = parse(body, ("sample", "status", "hello"))
            if msg.kind == "hello":
                reply = self._on_hello_request(msg)
            elif msg.kind == "status":
                wait = self.status_requests.take(identity, now)
                reply = self.report_message() if wait is None else self._retry("client_rate", wait)
            else:
                reply = self._on_sample(msg)
        except WireError as exc:
            self.drops.drop(exc.cause, str(exc))
            if exc.cause == "bad_version":  # another protocol: a clear refusal, in the peer's version
                reply = self._refuse("?", exc.cause, f"{exc}; this broker speaks protocol "
                                     f"v{PROTOCOL_VERSION}", version=peer_version(body))
            else:
                reply = make("error", reason=str(exc)[:500])
        except Exception as exc:
            self.handler_failed("request", exc)
            reply = make("error", reason="internal error")
        return [identity, b""] + list(reply)

    def _on_hello_request(self, msg: Message) -> List[Frame]:
        """The handshake and heartbeat: ``welcome`` if the client may go on, else ``refused`` with why.

        A worker must announce an env spec; the first one the broker sees becomes the run's (unless a
        snapshot already fixed it), and any other is refused, before the worker sends a segment.
        """
        who, role, spec_d = msg["identity"], msg["role"], msg["spec"]
        if spec_d is None and role == "worker":
            return self._refuse(who, "no_spec", "a worker hello must carry its env spec")
        if spec_d is not None:
            try:
                spec = EnvSpec.from_dict(spec_d)
            except WireError as exc:  # a client that cannot describe its env cannot be served: say so
                return self._refuse(who, "bad_spec", str(exc))
            if self.spec is None:
                self._adopt(spec, who)
            elif spec.hash != self.spec.hash:
                return self._refuse(who, "bad_spec", f"env spec {spec.hash} ({spec.env_id}) differs from the "
                                    f"run's {self.spec.hash} ({self.spec.env_id})")
        if role == "worker":
            T = msg["segment_length"]
            if T is None or not 1 <= T <= MAX_SEGMENT_STEPS:
                return self._refuse(who, "bad_shape", "a worker hello must carry its segment_length, in "
                                    f"1..{MAX_SEGMENT_STEPS}")
            self._fix_segment_length(T)
            info = self._worker(who, time.monotonic())
            info.host, info.pid = msg["host"], msg["pid"]
            info.resources = resources_from_wire(msg.get("resources"))  # the heartbeat's, every 5 s
        elif who not in self._clients:  # a learner or a tool: say who came, once
            if len(self._clients) >= MAX_WORKERS:
                self._clients.clear()
            self._clients.add(who)
            self.log.info("client said hello", client=who, role=role, host=msg["host"], pid=msg["pid"],
                          zclaw=msg["zclaw"])
        return make("welcome", role="broker", identity=self.identity, host=socket.gethostname(),
                    pid=os.getpid(), zclaw=__version__,
                    spec=self.spec.to_dict() if self.spec is not None else None,
                    segment_length=self.store.T if self.store is not None else None,
                    max_message_bytes=int(self.max_bytes))

    def _fix_segment_length(self, T: Any) -> None:
        """The run's steps per segment: the first worker's (unless a snapshot or an earlier worker fixed it),
        announced in every ``welcome``; a worker that said another T adopts the welcome's before it sends."""
        if (self.store is not None and self.store.T is None and isinstance(T, int)
                and 1 <= T <= MAX_SEGMENT_STEPS):
            self.store.fix_segment_length(T)
            self.log.info("segment length fixed", T=T)

    def _refuse(self, who: str, cause: str, reason: str, version: Optional[int] = None) -> List[Frame]:
        """Count a refusal and log it (once a minute per client and cause: a retrying client cannot flood)."""
        self.refused[cause] += 1
        now = time.monotonic()
        key = (who, cause)
        if now - self._refusal_logged.get(key, -1e9) >= 60.0:
            if len(self._refusal_logged) >= MAX_WORKERS:
                self._refusal_logged.clear()
            self._refusal_logged[key] = now
            self.log.warning("refused", client=who, cause=cause, reason=reason)
        return encode_refusal(reason[:500], cause, version if version is not None else PROTOCOL_VERSION)

    def _retry(self, reason: str, wait_s: Optional[float] = None) -> List[Frame]:
        self.retries[reason] += 1
        ms = self.retry_ms if wait_s is None else max(1, int(wait_s * 1000 + 0.999))
        return make("retry", reason=reason, retry_ms=ms)

    def _on_sample(self, msg: Message) -> List[Frame]:
        keys = msg.get("priority_keys") or []
        values = msg.get("priorities") or []
        if keys or values:  # priorities of the previous batch first: they shape this one
            if self.store is not None:
                try:
                    self.store.update_priorities(keys, values)
                except ValueError as exc:  # refused as a whole; the request itself is still served
                    self.drops.drop("bad_value", f"priorities: {exc}")
        n = msg["batch_size"]
        top = min(self.cfg["broker"]["capacity"], MAX_BATCH_SEGMENTS)
        if not 1 <= n <= top:
            raise WireError("bad_value", f"batch_size = {n} must be in [1, {top}] (broker.capacity, and "
                            f"{MAX_BATCH_SEGMENTS} segments per batch at most)")
        columns = msg.get("columns") or 0
        if not 0 <= columns <= MAX_BATCH_COLUMNS:
            raise WireError("bad_value", f"columns = {columns} must be in [0, {MAX_BATCH_COLUMNS}] (0: "
                            f"batch_size segments)")
        if msg["version"] < 0:
            raise WireError("bad_value", f"version = {msg['version']} must be >= 0")
        # what the learner needs to move (accepting() weighs it): sized in columns, the batch's segment
        # count is known once drawn, so one segment until then
        self.last_batch_size = 1 if columns else n
        reason = self.limiter.can_sample(self.last_batch_size)
        if reason is not None:
            return self._retry(reason)
        if self.store is None or self.spec is None:
            return self._retry("not_enough_data")
        batch = self.store.sample(n, msg["version"], commit=False, columns=columns)
        if batch is None:
            return self._retry(self.store.last_reason or "not_enough_data")
        n = len(batch.keys)
        self.last_batch_size = n
        reason = self.limiter.can_sample(n) if columns else None
        if reason is not None:  # drawn but not committed: nothing is used up
            return self._retry(reason)
        # built first, committed after: a batch that cannot be sent uses no segment up
        reply = make(
            "batch",
            batch.wire_arrays(),
            keys=batch.keys,
            columns=batch.columns,
            workers=batch.workers,
            seqs=batch.seqs,
            episodes=batch.episodes,
            spec_hash=self.spec.hash,
            fill=self.store.fill,
        )
        if len(reply[0]) > MAX_HEADER_BYTES:  # cannot happen with the wire's limits; counted if it does
            raise WireError("batch_unbuildable", f"batch header of {len(reply[0])} bytes > "
                            f"{MAX_HEADER_BYTES}")
        self.store.commit(batch)
        self.limiter.on_sample(n)
        self.sample_meter.add(n)
        return reply

    # ---------------------------------------------------------------------------------- report

    def report(self) -> Dict[str, Any]:
        """The ``status`` report (the exact keys every role's tools rely on; see docs)."""
        now = time.monotonic()
        st = self.store
        drops = Counter(self.drops.as_dict())
        if st is not None:
            drops.update(st.drops)
        return {
            "role": "broker",
            "uptime_s": round(now - self.t0, 3),
            "spec": self.spec.to_dict() if self.spec is not None else None,
            "capacity": self.cfg["broker"]["capacity"],
            "fill": st.fill if st is not None else 0,
            "inserted_segments": st.inserted if st is not None else 0,
            "inserted_steps": st.inserted_steps if st is not None else 0,
            "sampled_segments": st.sampled if st is not None else 0,
            "batches": st.batches if st is not None else 0,
            "insert_rate": self.insert_meter.rate(now),
            "sample_rate": self.sample_meter.rate(now),
            "drops": {str(k): int(v) for k, v in drops.items()},
            "lag_hist": dict(st.lag_hist) if st is not None else {b: 0 for b in LAG_BUCKETS},
            # bounded by construction: the MAX_REPORT_WORKERS most recently seen (every string in it is
            # bounded by the wire's limits), and how many there are in all
            "workers": {k: self.workers[k].report(now) for k in self._recent_workers()},
            "workers_total": len(self.workers),
            "out_of_range": sum(w.out_of_range for w in self.workers.values()),
            "loops": {name: clock.report(now) for name, clock in self.loops.items()},
            "max_message_bytes": self.max_bytes,
            "episodes": self.episodes.total,
            "return_mean_100": self.episodes.return_mean(),
            "success_rate_100": self.episodes.success_rate(),
            "retries": dict(self.retries),
            "snapshot": self.snapshots.report() if self.snapshots is not None else None,
            "refused": dict(self.refused),
            "restored": self.restored,
            "resources": self.resources.report(now),
        }

    def _recent_workers(self) -> List[str]:
        if len(self.workers) <= MAX_REPORT_WORKERS:
            return list(self.workers)
        return sorted(self.workers, key=lambda k: self.workers[k].last_seen)[-MAX_REPORT_WORKERS:]

    def report_message(self) -> List[Frame]:
        return make("status", report=self.report(), role="broker")

    def log_status(self) -> None:
        r = self.report()
        self.log.info(
            "status",
            fill=r["fill"],
            capacity=r["capacity"],
            inserted=r["inserted_segments"],
            batches=r["batches"],
            insert_rate=round(r["insert_rate"], 1),
            sample_rate=round(r["sample_rate"], 2),
            workers=r["workers_total"],
            drops=r["drops"],
            retries=r["retries"],
            lag_hist=r["lag_hist"],
        )

    # -------------------------------------------------------------------------------- snapshots

    def snapshot_state(self) -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
        """(arrays, meta) for :mod:`zclaw.broker.snapshot`, or None while there is no store yet."""
        if self.store is None:
            return None
        arrays, store_meta = self.store.state()
        meta = {
            "store": store_meta, "zclaw": __version__, "written_at": time.time(),
            "broker": dict(self.episodes.state(), limiter_inserts=self.limiter.inserts,
                           limiter_samples=self.limiter.samples),
        }
        return arrays, meta

    def snapshot_marker(self) -> Any:
        """Changes whenever the store does (inserts, batches served): an idle store is not rewritten."""
        st = self.store
        return None if st is None else (st.inserted, st.batches, st.fill)

    def restore_snapshot(self, arrays: Dict[str, Any], meta: Dict[str, Any]) -> int:
        """Adopt the snapshot's env spec and load its store; return the segments restored.

        Raises ``ValueError`` (leaving the broker empty) when it does not fit this configuration.
        """
        spec = EnvSpec.from_dict(meta["store"]["spec"])
        self._adopt(spec, "snapshot")
        assert self.store is not None
        try:
            n = self.store.restore(arrays, meta["store"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            self.store, self.spec = None, None
            if self.auto_cap:  # the cap of a spec not adopted after all: back to the bound before any spec
                self.max_bytes = DEFAULT_MAX_MESSAGE_BYTES
            raise ValueError(str(exc)) from None
        b = meta.get("broker") or {}
        self.episodes.restore(b)
        self.limiter.inserts = int(b.get("limiter_inserts", self.store.inserted))
        self.limiter.samples = int(b.get("limiter_samples", self.store.sampled))
        self.restored = {"segments": n, "inserted_segments": self.store.inserted,
                         "inserted_steps": self.store.inserted_steps, "episodes": self.episodes.total}
        return n


def _restore(broker: Broker, path: Path, log: Any) -> None:
    """Restore the latest snapshot at ``path`` if there is one; log what was restored (or why not)."""
    def reject(error: str, why: str) -> None:
        kept = path.with_name(path.name + ".rejected")  # the next snapshot must not overwrite it unseen
        try:
            path.replace(kept)
        except OSError:
            kept = path
        log.error(f"snapshot not restored: {why}; starting empty", path=str(kept), error=error)

    try:
        state = snapshot.load(path)
    except snapshot.SnapshotError as exc:  # unreadable, or another format (an older zclaw's)
        reject(str(exc), "it cannot be read")
        return
    if state is None:
        log.info("no snapshot to restore", path=str(path))
        return
    arrays, meta = state
    try:
        n = broker.restore_snapshot(arrays, meta)
    except (ValueError, KeyError, TypeError, WireError) as exc:
        reject(str(exc), "it does not fit this configuration")
        return
    st = broker.store
    assert st is not None
    log.info(
        "restored snapshot", path=str(path), segments=n, inserted=st.inserted, sampled=st.sampled,
        batches=st.batches, age_s=round(time.time() - float(meta.get("written_at", time.time())), 3),
        spec_hash=broker.spec.hash if broker.spec else None,
    )


def main(
    cfg: Dict[str, Dict[str, Any]],
    log: Any,
    run_dir: Optional[Path] = None,
    stop: Optional[threading.Event] = None,
    restore: bool = True,
    shard: int = 0,
) -> int:
    """Run the broker until SIGINT/SIGTERM (or ``stop`` is set); return the exit code (zclaw/stopping.py):
    0 on a clean stop, 1 when a port cannot be bound, 2 when it cannot start as configured.

    With ``run_dir`` the store is restored from ``run_dir/snapshots/store.npz`` at start, snapshotted
    every ``broker.snapshot_s`` seconds without pausing ingest, and once more on the way out;
    ``restore=False`` (``--fresh``) starts empty instead, and the next snapshot replaces the old one.
    ``shard`` names the snapshot of a sharded run's broker (``cfg`` already holds that shard's address:
    ``zclaw.fleet.as_shard``).
    """
    return startup.run_role(log, lambda stop: _serve(cfg, log, run_dir, stop, restore, shard), stop)


def _serve(
    cfg: Dict[str, Dict[str, Any]], log: Any, run_dir: Optional[Path], stop: threading.Event, restore: bool,
    shard: int = 0,
) -> int:
    """:func:`main`'s body, run with the stop signals installed (zclaw/startup.py)."""
    net = cfg["network"]
    host = net["bind_host"] or net["broker_host"]
    # CURVE keys (docs/multihost.md); no unprotected bind beyond loopback
    sec = startup.security(cfg, "broker", log, bind_host=host)
    try:
        broker = Broker(cfg, log)
    except ValueError as exc:
        raise startup.CannotStart("bad broker configuration", error=str(exc)) from None
    snaps: Optional[snapshot.Snapshotter] = None
    if run_dir is not None:
        path = snapshot.snapshot_path(run_dir, shard)
        snaps = snapshot.Snapshotter(path, cfg["broker"]["snapshot_s"], log, broker.snapshot_state,
                                     broker.snapshot_marker, mode=cfg["broker"]["snapshot_mode"])
        if restore:
            _restore(broker, path, log)
            snaps.mark_restored()
        else:
            log.info("starting with an empty store (--fresh)", path=str(path))
    else:
        log.info("store snapshots off: no --run-dir")
    broker.snapshots = snaps
    # libzmq copies a socket's options into its listener at bind: ingest gets the cap known now (tight when
    # it is explicit or a restored snapshot told the env spec) and is bound again when a spec is adopted
    # (IngestSocket); serve takes requests only, capped by the wire's limits whatever the segment cap
    socket_cap = socket_cap_bytes(broker.max_bytes)
    ctx = zmq.Context()
    ingest = make_socket(ctx, zmq.PULL, max_message_bytes=socket_cap, curve=sec.server())
    serve = make_socket(ctx, zmq.ROUTER, max_message_bytes=REQUEST_SOCKET_BYTES, curve=sec.server())
    feed = IngestSocket(ingest, socket_cap)
    try:
        try:
            ingest_port = bind(ingest, host, net["ingest_port"])
            serve_port = bind(serve, host, net["serve_port"])
            feed.bound()
        except zmq.ZMQError as exc:
            log.error("cannot bind", host=host, error=str(exc))
            return EXIT_FAILED
        log.info(
            "broker listening",
            host=host,
            ingest_port=ingest_port,
            serve_port=serve_port,
            mode=cfg["broker"]["mode"],
            capacity=cfg["broker"]["capacity"],
            max_message_mb=net["max_message_mb"],
            max_message_bytes=broker.max_bytes,
            socket_cap_bytes=socket_cap,
            serve_cap_bytes=REQUEST_SOCKET_BYTES,
            zclaw=__version__,
            **sec.summary(),
        )
        poller = zmq.Poller()
        poller.register(ingest, zmq.POLLIN)
        poller.register(serve, zmq.POLLIN)
        status_s = float(cfg["log"]["status_s"])
        next_status = time.monotonic() + status_s
        reading = True
        while not stop.is_set() and feed.lost is None:
            if broker.accepting() != reading:  # broker.when_full = "wait": pause or resume ingest
                reading = not reading
                poller.modify(ingest, zmq.POLLIN if reading else 0)
            events = dict(poller.poll(0 if feed.pending and reading else POLL_MS))
            if events.get(serve):
                while True:
                    try:
                        frames = recv_frames(serve, zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        reply = broker.on_request(frames)
                    except Exception as exc:  # on_request catches its own; this is the last line
                        broker.handler_failed("request", exc)
                        continue
                    feed.follow(broker)  # a hello adopted the spec: ingest's new cap before the welcome goes
                    if reply is not None:
                        try:
                            # copy=True: received frames forwarded as parts still go by reference count
                            # (pyzmq sends a zmq.Frame as itself); every other buffer, the stacked small
                            # fields, is copied into ZeroMQ rather than lent zero-copy, which would hand
                            # each one to pyzmq's garbage-collector thread. On 2 cores at the default
                            # segment size that thread cost more than the copy: broker CPU 202-238 against
                            # 232-297 us per segment (4 alternated runs each).
                            serve.send_multipart(reply, copy=True)
                        except zmq.ZMQError as exc:  # the peer vanished or its queue is full: its problem
                            broker.drops.drop("reply_failed", str(exc))
                        except Exception as exc:
                            broker.handler_failed("reply", exc)
            if events.get(ingest) or (feed.pending and reading):
                for _ in range(INGEST_BURST):
                    frames = feed.next()
                    if frames is None:
                        break
                    broker.on_ingest(frames)
                    feed.follow(broker)
                    # a waiting request goes first (a learner idle for a whole burst is the costlier wait),
                    # and a full store stops the burst when broker.when_full = "wait"
                    if serve.getsockopt(zmq.EVENTS) & zmq.POLLIN or not broker.accepting():
                        break
            now = time.monotonic()
            try:
                if snaps is not None:
                    snaps.tick(now)
                if now >= next_status:
                    next_status = now + status_s
                    broker.log_status()
            except Exception as exc:  # a snapshot or a log line must not end the service loops
                broker.handler_failed("housekeeping", exc)
        log.info("stopping")
        broker.log_status()
        if snaps is not None:
            outcome = snaps.final()
            log.info("final snapshot", path=str(snaps.path), outcome=outcome,
                     segments=broker.store.fill if broker.store is not None else 0,
                     inserted=broker.store.inserted if broker.store is not None else 0)
        return EXIT_OK if feed.lost is None else EXIT_FAILED
    finally:
        ingest.close(linger=0)
        serve.close(linger=0)
        term_context(ctx)
