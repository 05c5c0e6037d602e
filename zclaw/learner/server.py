"""The learner process: ask the broker for batches, train, publish versioned weights.

Sockets (config ``[network]``)::

    REQ  -> broker serve (Lazy Pirate)   hello until the welcome names the env spec, then sample / batch
    PUB  <- publish_port                 every new version, packed single frame (workers use CONFLATE)
    ROUTER <- learner_port               snapshot (ZeroMQ guide's Clone pattern) and status, served from
                                         a background thread so it answers while the main thread trains;
                                         a snapshot for another env spec is answered ``refused``; each
                                         client identity has a token bucket (learner.request_rate /
                                         request_burst): over it, the answer is ``retry``

Loop, as ``docs`` and every role assume it::

    spec   = hello(broker) -> welcome.spec           # once a worker said hello (or a snapshot was restored)
    model  = OptionPolicy(spec) or checkpoint        # version 0, or the checkpoint's version (--resume)
    publish(version)
    while not stopped:
        reply = sample(batch_size, version, keys and priorities of the previous batch)
        if reply is retry: sleep retry_ms; continue
        metrics = trainer.update(batch, version); version += 1; publish(version)

A checkpoint is written every ``learner.checkpoint_s`` seconds and on exit; ``learner_final.json`` in
the run directory holds the final report (``zclaw train`` reads it).
"""
from __future__ import annotations

import heapq
import json
import math
import os
import random
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import zmq

from .. import __version__, logs
from ..fileio import atomic_write, finite_json
from ..policy.networks import OptionPolicy
from ..policy.weights import policy_config, weights_message
from ..wire import (
    CreditPirate, DropCounter, EnvSpec, LazyPirate, Message, WireError, bind, make, make_socket, parse, tcp,
)
from ..wire.limits import REQUEST_SOCKET_BYTES
from ..wire.messages import batch_dims
from ..wire.sockets import CurveServer, term_context
from ..telemetry import EpisodeWindow, RateMeter, ResourceMeter, cuda_index, resource_scalars
from ..tokens import TokenBucket
from .. import startup
from ..stopping import EXIT_CANNOT_START, EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from . import checkpoint as ckpt
from .trainer import Trainer

PUB_HWM = 4  # weights messages are large and only the newest matters: never queue many
#: how long the metrics line waits for the broker's status (one try; the last report is kept otherwise)
STATUS_TIMEOUT_MS = 500
#: the service thread logs a request that raised at most once per this many seconds (all are counted)
ERROR_LOG_S = 10.0
#: client identities the ROUTER's token buckets track (least recently seen evicted beyond that)
MAX_CLIENTS = 4096
#: requests per second the ROUTER's service thread handles for all clients together (a burst of a tenth of a
#: second's worth). Why: each request costs ~50 us of CPU even when answered ``retry``, so a client that
#: pipelines requests as fast as it can (~10-20k/s) took 0.5-1 core and starved training and workers on a
#: small host (bench/hostile.py). ZeroMQ's ROUTER fair-queues its peers, so when a flood fills the queue
#: another client's request waits for at most one request per other busy peer: ~1 ms at this rate.
#: Workers ask once on join and tools every 0.5-2 s; 2,000/s also serves 1,000 workers joining at once.
MAX_ANSWERS_PER_S = 2000.0
#: when that budget is spent the thread sleeps at least this long (one futex wait buys ~20 answers, not one)
PACE_SLEEP_S = 0.01
#: a request over its client's token bucket is answered ``retry`` when that client's turn would come (its next
#: token, and one token interval after the previous one held for it), held by the loop meanwhile, but at most
#: this long: under any client's timeout (a worker's snapshot request waits 1 s). Why: answered at once, a
#: client that pipelines requests gets as many ``retry`` answers as the loop's pace allows (2,000/s), each
#: costing both sides CPU, and it kept the pace spent, so the loop slept (PACE_SLEEP_S) while a joining
#: worker's snapshot request waited: joins took 1.43-1.79x their idle time beside such a flood
#: (bench/hostile.py). Held, a client with k requests in flight gets about k / RETRY_HOLD_S answers per
#: second (32 in flight: ~130/s), the pace is not spent, and others' requests are read as they come.
RETRY_HOLD_S = 0.25
#: requests held at once, all clients together (an envelope each, a few dozen bytes); beyond it the ``retry``
#: goes at once, as it did before requests were held
MAX_HELD = 1024
#: held answers sent per loop turn at most, between two reads of the socket: a peer's send queue holds 64
#: (HWM) and libzmq learns what its I/O thread drained only every ~1 ms, so a burst to one peer fills it; the
#: socket has ROUTER_MANDATORY, so a full queue is told (EAGAIN) and that answer goes again 2 ms later
RELEASE_BURST = 16


def loop_report(last_answer: Optional[float], answered: int, errors: int) -> Dict[str, Any]:
    """One service loop's entry in a status report's ``loops`` map (the broker's report has the same):
    ``last_answer_unix`` (wall time of its last answer before this report; None: none yet),
    ``last_answer_age_s``, ``answered`` and ``errors`` (requests whose handling raised)."""
    return {
        "last_answer_unix": None if last_answer is None else round(last_answer, 3),
        "last_answer_age_s": None if last_answer is None else round(max(0.0, time.time() - last_answer), 3),
        "answered": int(answered),
        "errors": int(errors),
    }


class _Service(threading.Thread):
    """Answers ``snapshot`` and ``status`` on the learner ROUTER from its own thread and own socket.

    ZeroMQ sockets are not thread-safe, so this thread creates, uses and closes its socket itself; it
    only reads ``weights`` (packed bytes) and ``report`` (a dict), which the main thread replaces with
    single attribute assignments (atomic in CPython), never mutates in place.

    The loop cannot die of one request: whatever handling a request raises is counted under
    ``handler_error`` (and in ``loops``), logged with its traceback at most once per
    :data:`ERROR_LOG_S`, and answered ``error``; the loop goes on. Why: it is the only way a joining
    worker gets weights, and one bad request must not cost every later worker its join.

    Fair service: before a request is even parsed, its client identity takes a token from a
    :class:`zclaw.tokens.TokenBucket` (``rate`` per second, ``burst``); without one the answer is a
    ``retry`` naming how long to wait, counted as ``rate_limited``. The snapshot answer is one cached
    ``zmq.Frame`` per published version, so a snapshot costs the send and nothing else. The loop as a
    whole handles at most ``answer_rate`` requests per second (:data:`MAX_ANSWERS_PER_S`): what a flood
    costs the learner's CPU is bounded whatever the number of identities, and ROUTER's fair queueing keeps
    other clients' requests from waiting behind it. A ``retry`` is sent when the client's turn would come,
    not at once (:data:`RETRY_HOLD_S`): a client pipelining requests then paces itself, and the loop's
    pace stays unspent for everyone else. The socket's ``MAXMSGSIZE`` is the wire's
    :data:`~zclaw.wire.limits.REQUEST_SOCKET_BYTES` (snapshot and status requests are a few bytes).
    """

    def __init__(
        self, ctx: zmq.Context, host: str, port: int, max_bytes: int, log: Any, stop: threading.Event,
        curve: Optional[CurveServer] = None, rate: float = 20.0, burst: float = 40.0,
        answer_rate: float = MAX_ANSWERS_PER_S,
    ) -> None:
        super().__init__(name="learner-service", daemon=True)
        self.ctx, self.host, self.port, self.max_bytes = ctx, host, port, max_bytes
        self.curve = curve
        self.log, self.stop = log, stop
        self.weights: Optional[bytes] = None
        self.spec_hash: Optional[str] = None
        self.report: Dict[str, Any] = {"role": "learner"}
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.error: Optional[str] = None
        self.bound_port: Optional[int] = None
        self.drops = DropCounter(log, "learner requests")  # refused snapshots count as refused_bad_spec
        #: this learner process; in every weights message, so workers tell a restarted learner apart
        self.identity = f"learner-{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        self.served: Counter = Counter()  # requests answered, by kind (status, snapshot)
        self.bucket = TokenBucket(rate, burst, max_identities=MAX_CLIENTS)
        #: the loop's own budget, all clients together (one identity)
        self.pace = TokenBucket(answer_rate, max(1.0, answer_rate / 10), max_identities=1)
        self.paced = 0  # times the loop slept because the budget was spent
        self.answered = 0
        self.errors = 0
        self.last_answer: Optional[float] = None  # wall time of the last answer sent
        self._error_logged = -ERROR_LOG_S
        self._frame: Optional[zmq.Frame] = None  # the snapshot answer of ...
        self._frame_of: Optional[bytes] = None  # ... this weights message
        #: requests over their client's bucket, answered ``retry`` at their time: (due, seq, client, envelope,
        #: the time after which a peer whose queue stays full loses it)
        self._held: List[Any] = []
        self._held_seq = 0
        self._last_due: Dict[bytes, float] = {}  # per client, the due time of its latest held request
        self.held_max = 0  # the most held at once (a figure for tests and the bench)

    def run(self) -> None:
        cap = min(self.max_bytes, REQUEST_SOCKET_BYTES) if self.max_bytes > 0 else REQUEST_SOCKET_BYTES
        sock = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=cap, curve=self.curve)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer queue is told (EAGAIN), not dropped unseen
        try:
            self.bound_port = bind(sock, self.host, self.port)
        except zmq.ZMQError as exc:
            self.error = f"cannot bind learner ROUTER on {tcp(self.host, self.port)}: {exc}"
            sock.close(linger=0)
            self.ready.set()
            return
        self.ready.set()
        try:
            while not self.stop.is_set():
                try:
                    if not sock.poll(self._release_due(sock), zmq.POLLIN):
                        continue
                    wait = self.pace.take(b"", time.monotonic())
                    if wait is not None:  # the loop's budget is spent: requests wait in ZeroMQ's queue
                        self.paced += 1
                        self.stop.wait(max(wait, PACE_SLEEP_S))
                        continue
                    self._serve_one(sock)
                except zmq.ContextTerminated:
                    break
                except Exception as exc:  # a receive or send that failed: counted, and the loop goes on
                    self._failed("service_error", exc)
        finally:
            sock.close(linger=0)

    def _serve_one(self, sock: zmq.Socket) -> None:
        """Receive one request and send its answer; nothing one request does escapes as an exception
        except a failed receive/send (the caller counts those)."""
        frames = sock.recv_multipart()
        try:
            cut = frames.index(b"")  # REQ envelope: [identity..., b"", body...]
        except ValueError:
            self.drops.drop("no_envelope")
            return
        envelope, body = frames[: cut + 1], frames[cut + 1 :]
        client = b"".join(envelope[:-1])
        now = time.monotonic()
        wait = self.bucket.take(client, now)
        if wait is not None:  # over its token bucket: "ask again later", before any parsing, at its turn
            self.drops.drop("rate_limited", f"client {client.hex()[:16]}")
            if self._hold(client, envelope, wait, now):
                return
            answer = self._retry(wait)
        else:
            try:
                answer = self._answer(client, body)
            except Exception as exc:  # a bug or an input nobody foresaw: this request only, never the loop
                self._failed("handler_error", exc)
                answer = make("error", reason="the learner could not handle this request (counted as "
                                              "handler_error)")
        if not self._send(sock, envelope + answer):  # as a ROUTER without ROUTER_MANDATORY would, counted
            self.drops.drop("reply_dropped", "the client's queue is full: it does not read its answers")

    def _send(self, sock: zmq.Socket, frames: List[Any]) -> bool:
        """Send one answer without blocking; False if the peer's queue is full (it is not reading: the
        socket has ``ROUTER_MANDATORY``, so libzmq says so instead of dropping it unseen). An answer to a
        peer that is gone is dropped (counted as ``peer_gone``)."""
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.drops.drop("peer_gone", "answer to a client that disconnected")
            return True
        self.answered += 1
        self.last_answer = time.time()
        return True

    @staticmethod
    def _retry(wait: float) -> List[Any]:
        return make("retry", reason="rate_limited", retry_ms=max(1, int(math.ceil(wait * 1000))))

    def _hold(self, client: bytes, envelope: List[Any], wait: float, now: float) -> bool:
        """Keep a request over its client's bucket, to be answered ``retry`` at its turn (the client's next
        token, and one token interval after its previous held request; at most RETRY_HOLD_S from now);
        False when MAX_HELD are held already (then it is answered at once)."""
        if len(self._held) >= MAX_HELD:
            return False
        turn = max(now + wait, self._last_due.get(client, 0.0) + 1.0 / self.bucket.rate)
        due = min(now + RETRY_HOLD_S, turn)
        if len(self._last_due) >= MAX_CLIENTS:  # only clients with a request still held need remembering
            self._last_due = {k: v for k, v in self._last_due.items() if v > now}
        self._last_due[client] = due
        heapq.heappush(self._held, (due, self._held_seq, client, envelope, due + RETRY_HOLD_S))
        self._held_seq += 1
        self.held_max = max(self.held_max, len(self._held))
        return True

    def _release_due(self, sock: zmq.Socket) -> int:
        """Answer ``retry`` to held requests whose time has come (at most RELEASE_BURST); the poll timeout in
        ms until the next one is due (100 with none held)."""
        now = time.monotonic()
        for _ in range(RELEASE_BURST):
            if not self._held or self._held[0][0] > now:
                break
            due, seq, client, envelope, until = self._held[0]
            tokens = self.bucket.tokens(client, now)  # the wait it names is from now, for its next token
            if self._send(sock, envelope + self._retry(max(0.0, (1.0 - tokens) / self.bucket.rate))):
                heapq.heappop(self._held)
            elif now >= until:  # a client that does not read its answers: dropped, as ROUTER would
                heapq.heappop(self._held)
                self.drops.drop("reply_dropped", "the client's queue is full: it does not read its answers")
            else:  # its queue is full (libzmq's I/O thread lags a burst): again in 2 ms, the others first
                heapq.heapreplace(self._held, (now + 0.002, seq, client, envelope, until))
                break
        if not self._held:
            return 100
        return max(0, min(100, int(math.ceil((self._held[0][0] - now) * 1000))))

    def _failed(self, cause: str, exc: BaseException) -> None:
        """Count a request whose handling raised; its traceback is logged at most once per ERROR_LOG_S."""
        self.errors += 1
        self.drops.drop(cause, f"{type(exc).__name__}: {exc}")
        now = time.monotonic()
        if now - self._error_logged >= ERROR_LOG_S:
            self._error_logged = now
            self.log.error("learner service: a request raised; counted, the service goes on", cause=cause,
                           error=f"{type(exc).__name__}: {str(exc)[:200]}", errors=self.errors, exc_info=True)

    def loops(self) -> Dict[str, Any]:
        """This thread's entry for the status report's ``loops`` map."""
        return {"learner-router": dict(loop_report(self.last_answer, self.answered, self.errors),
                                       paced=self.paced)}

    def _answer(self, client: bytes, body: List[bytes]) -> List[Any]:
        """The answer to one request whose client was within its bucket (:meth:`_serve_one` checked)."""
        try:
            msg = parse(body, ("snapshot", "status"))
        except WireError as exc:
            self.drops.drop(exc.cause, str(exc))
            return make("error", reason=f"not understood: {exc}"[:500])
        self.served[msg.kind] += 1
        if msg.kind == "status":
            report = dict(self.report)
            report["uptime_s"] = round(time.monotonic() - self.started, 3)
            report["request_drops"] = self.drops.as_dict()  # what this ROUTER dropped, by cause
            report["requests_served"] = dict(self.served)
            report["identity"] = self.identity
            report["loops"] = dict(report.get("loops") or {}, **self.loops())
            return make("status", report=report, role="learner")
        weights = self.weights
        if weights is None:
            return make("retry", reason="no weights yet", retry_ms=200)
        want = msg.get("spec_hash")
        if want is not None and self.spec_hash is not None and want != self.spec_hash:
            self.drops.drop("refused_bad_spec", f"snapshot for spec {want}")
            return make("refused", cause="bad_spec",
                        reason=f"env spec {want} differs from the learner's {self.spec_hash}")
        if self._frame_of is not weights:  # once per published version, not once per request
            self._frame, self._frame_of = zmq.Frame(weights), weights
        return [self._frame]


class Learner:
    """State of one learner process; :func:`main` runs it."""

    def __init__(
        self, cfg: Dict[str, Dict[str, Any]], log: Any, run_dir: Path, stop: threading.Event
    ) -> None:
        self.cfg, self.log, self.run_dir, self.stop = cfg, log, Path(run_dir), stop
        self.lcfg = cfg["learner"]
        self.net = cfg["network"]
        # CURVE keys and the loopback rule first: raises startup.CannotStart before any socket exists
        self.security = startup.security(cfg, "learner", log,
                                         bind_host=self._bind_host(self.net["learner_host"]))
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.started = time.monotonic()
        self.ctx = zmq.Context()
        self.pub: Optional[zmq.Socket] = None
        self.service: Optional[_Service] = None
        self.broker: Optional[LazyPirate] = None  # status and hello: one question, one answer
        #: the broker status asked for the metrics line: one try, a short wait, never in the way of training
        self.broker_status: Optional[LazyPirate] = None
        self.batches: Optional[CreditPirate] = None  # sample requests, learner.prefetch of them in flight
        self.writer: Any = None
        self.spec: Optional[EnvSpec] = None
        self.model: Optional[OptionPolicy] = None
        self.trainer: Optional[Trainer] = None
        self.version: Optional[int] = None
        self.updates = 0
        self.steps_consumed = 0
        self.losses: Dict[str, float] = {}
        self.lag_sum = 0.0
        self.lag_n = 0
        self.lag_max_all = 0.0
        self.episodes = EpisodeWindow()  # the episodes the batches reported
        self.retries: Counter = Counter()
        self.drops = DropCounter(log, "batches")
        self.last_checkpoint: Optional[str] = None
        self.step_meter, self.update_meter = RateMeter(), RateMeter()  # env steps and updates trained
        self.prio_keys: List[Any] = []
        self.prios: List[float] = []
        self.last_metrics: Dict[str, Any] = {}
        self.refused: Optional[str] = None  # why the broker refused us, if it did
        self.options: Optional[Dict[str, Any]] = None  # OptionHealth.summary of the latest update
        self.broker_report: Optional[Dict[str, Any]] = None  # the broker's last status (metrics.jsonl, TB)
        #: this process's CPU, memory, threads and (learner.device = cuda) GPU: report, metrics.jsonl, TB;
        #: report() runs per update, the meter samples at most every RESOURCE_INTERVAL_S
        self.resources = ResourceMeter(gpu=cuda_index(self.lcfg["device"]))
        self.last_update: Optional[float] = None  # wall time of the last update (the "train" loop's answer)

    # -- setup ------------------------------------------------------------------------------------------
    def _bind_host(self, host: str) -> str:
        return self.net["bind_host"] or host

    def open_sockets(self) -> Optional[str]:
        """Bind PUB and start the ROUTER service thread; return an error text if a bind fails."""
        max_bytes = int(self.net["max_message_mb"]) << 20
        host = self._bind_host(self.net["learner_host"])
        self.pub = make_socket(self.ctx, zmq.PUB, max_message_bytes=max_bytes, hwm=PUB_HWM,
                               curve=self.security.server())
        try:
            bind(self.pub, host, int(self.net["publish_port"]))
        except zmq.ZMQError as exc:
            return f"cannot bind learner PUB on {tcp(host, self.net['publish_port'])}: {exc}"
        self.service = _Service(self.ctx, host, int(self.net["learner_port"]), max_bytes, self.log, self.stop,
                                curve=self.security.server(), rate=float(self.lcfg["request_rate"]),
                                burst=float(self.lcfg["request_burst"]))
        self.service.start()
        self.service.ready.wait(10)
        if self.service.error:
            return self.service.error
        broker_at = tcp(self.net["broker_host"], int(self.net["serve_port"]))
        client = dict(timeout_ms=int(self.net["request_timeout_ms"]), retries=None,
                      max_message_bytes=max_bytes, log=self.log, curve=self.security.client("broker"))
        self.broker = LazyPirate(self.ctx, broker_at, **client)
        self.broker_status = LazyPirate(self.ctx, broker_at,
                                        **dict(client, retries=0, timeout_ms=STATUS_TIMEOUT_MS))
        self.batches = CreditPirate(self.ctx, broker_at, credit=int(self.lcfg["prefetch"]), **client)
        self._report(state="waiting for env spec")
        return None

    def wait_for_spec(self) -> Optional[EnvSpec]:
        """Say ``hello`` to the broker until its ``welcome`` names the env spec (a worker said hello, or a
        snapshot was restored); None if stopped or refused (``self.refused`` says why)."""
        assert self.broker is not None
        last_log = 0.0
        ident = self.service.identity if self.service is not None else f"learner-{os.getpid()}"
        hello = make("hello", role="learner", identity=ident, host=socket.gethostname(), pid=os.getpid(),
                     zclaw=__version__, spec=None)
        while not self.stop.is_set():
            reply = self.broker.request(hello, ("welcome", "refused"), stop=self.stop.is_set)
            if reply is None:
                return None
            if reply.kind == "refused":
                self.refused = f"{reply['cause']}: {reply['reason']}"
                self.log.error("refused by the broker", cause=reply["cause"], reason=reply["reason"])
                return None
            spec_d = reply["spec"]
            if spec_d:
                try:
                    return EnvSpec.from_dict(spec_d)
                except WireError as exc:
                    self.log.error("broker reports an unusable env spec", error=str(exc))
            if time.monotonic() - last_log > 5.0:
                self.log.info("waiting for the broker to learn the env spec (no worker yet)")
                last_log = time.monotonic()
            self.stop.wait(0.25)
        return None

    def build(self, spec: EnvSpec, state: Optional[Dict[str, Any]]) -> None:
        """Build the network and optimiser, from scratch or from a checkpoint (``state``)."""
        device = torch.device(self.lcfg["device"])
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ckpt.CheckpointError(f"learner.device = {self.lcfg['device']!r} but CUDA is not available")
        pcfg = policy_config(self.cfg["policy"], spec)
        if state is not None:
            ckpt.check_compatible(state, spec.to_dict(), pcfg)
        self.spec = spec
        self.model = OptionPolicy(pcfg)
        # the normaliser leaves out rows beyond the bound workers and the broker enforce (the last line)
        self.trainer = Trainer(self.model, self.lcfg, device, action_low=spec.action_low,
                               action_high=spec.action_high, obs_max_abs=self.cfg["worker"]["max_abs_obs"])
        if state is None:
            self.version = 0
        else:
            ckpt.restore(state, self.model, self.trainer.optimizer)
            self.trainer.load_state_dict(state.get("trainer"))
            self.version = int(state["version"])
            self.updates = int(state["updates"])
            self.steps_consumed = int(state["steps_consumed"])
            extra = state.get("extra") or {}
            self.episodes.restore({"returns": extra.get("returns_100", [])})
            self.last_checkpoint = state.get("path")
        if self.service is not None:
            self.service.spec_hash = spec.hash
        self.publish()
        if state is not None:  # logged once the restored version is published and in the report
            self.log.info("resumed", checkpoint=state.get("path"), version=self.version, updates=self.updates,
                          steps=self.steps_consumed)

    # -- publishing -------------------------------------------------------------------------------------
    def publish(self) -> None:
        """Send the current version on PUB and make it the snapshot the service thread hands out."""
        assert self.model is not None and self.spec is not None and self.version is not None
        packed = weights_message(self.model, self.version, self.steps_consumed, self.spec.hash,
                                 learner=self.service.identity if self.service is not None else None)
        if self.service is not None:
            self.service.weights = packed
        if self.pub is not None:
            try:
                self.pub.send(packed, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # PUB never blocks, but be explicit: a full queue drops, workers use snapshots
                self.drops.drop("pub_full")
        logs.set_version(self.version)
        self._report()

    def report(self) -> Dict[str, Any]:
        now = time.monotonic()
        return finite_json({
            "role": "learner",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "version": self.version,
            "updates": self.updates,
            "steps_consumed": self.steps_consumed,
            "updates_per_s": self.update_meter.rate(now),
            "steps_per_s": self.step_meter.rate(now),
            "losses": dict(self.losses),
            "lag_mean": self.last_metrics.get("lag_mean"),
            "lag_max": self.last_metrics.get("lag_max"),
            "lag_mean_all": self.lag_sum / self.lag_n if self.lag_n else None,
            "lag_max_all": self.lag_max_all if self.lag_n else None,
            "episodes": self.episodes.total,
            "return_mean_100": self.episodes.return_mean(),
            "success_rate_100": self.episodes.success_rate(),
            "last_checkpoint": self.last_checkpoint,
            "spec": self.spec.to_dict() if self.spec is not None else None,
            "retries": dict(self.retries),
            "drops": self.drops.as_dict(),
            "options": self.options,
            # the broker status asks of the metrics line that got no usable answer, by cause
            "broker_status_drops": dict(self.broker_status.drops) if self.broker_status is not None else {},
            "loops": {"learner-train": loop_report(self.last_update, self.updates, self.drops.counts.get(
                "train_error", 0))},
            "resources": self.resources.report(now),
        })

    def _report(self, **extra: Any) -> None:
        rep = self.report()
        rep.update(extra)
        if self.service is not None:
            self.service.report = rep  # one assignment: the service thread sees the old or the new dict

    # -- training ---------------------------------------------------------------------------------------
    def _record(self, msg: Message, metrics: Dict[str, Any], seconds: float) -> None:
        B, T, N = msg.arrays["action"].shape[:3]
        steps = int(B * T * N)
        self.steps_consumed += steps
        self.updates += 1
        self.step_meter.add(steps)
        self.update_meter.add(1)
        self.last_metrics = metrics
        if self.trainer is not None:  # option health (usage, duration, ...): report, status line, TB
            self.options = self.trainer.health_summary()
        self.losses = {k: float(v) for k, v in metrics.items() if k != "priorities" and isinstance(v, float)}
        self.lag_sum += metrics["lag_mean"] * steps
        self.lag_n += steps
        self.lag_max_all = max(self.lag_max_all, metrics["lag_max"])
        batch = self.episodes.add(msg["episodes"])
        if self.writer is not None:
            g = self.steps_consumed
            w = self.writer
            for k, v in self.losses.items():
                if math.isfinite(v):
                    w.add_scalar(f"learner/{k}", v, g)
            w.add_scalar("throughput/env_steps_per_s", self.step_meter.rate(), g)
            w.add_scalar("throughput/updates_per_s", self.update_meter.rate(), g)
            w.add_scalar("throughput/update_seconds", seconds, g)
            w.add_scalar("lag/mean", metrics["lag_mean"], g)
            w.add_scalar("lag/max", metrics["lag_max"], g)
            w.add_scalar("version", self.version, g)
            if self.trainer is not None and self.options is not None:
                for k, v in self.trainer.health.scalars(self.options).items():
                    w.add_scalar(k, v, g)
            for name, values in (("return", batch["returns"]), ("length", batch["lengths"]),
                                 ("success", batch["successes"])):
                if values:
                    w.add_scalar(f"episode/{name}", float(np.mean(values)), g)
            if self.episodes.returns:
                w.add_scalar("episode/return_mean_100", self.episodes.return_mean(), g)

    def train_loop(self) -> None:
        assert self.batches is not None and self.trainer is not None and self.spec is not None
        B = int(self.lcfg["batch_segments"])
        status_s = float(self.cfg["log"]["status_s"])
        metrics_s = float(self.cfg["log"].get("metrics_s", 0.0))
        last_metrics_line = 0.0
        ckpt_s = float(self.lcfg["checkpoint_s"])
        last_status = last_ckpt = time.monotonic()
        self.step_meter, self.update_meter = RateMeter(), RateMeter()  # rates of training, not of waiting
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last_ckpt >= ckpt_s:
                self.checkpoint()
                last_ckpt = now
            if metrics_s > 0 and now - last_metrics_line >= metrics_s:
                self.write_metrics(ask_broker=True)
                last_metrics_line = now
            if now - last_status >= status_s:
                self.status_line()
                last_status = now
            request = make("sample", batch_size=B, version=int(self.version), priority_keys=self.prio_keys,
                           priorities=self.prios)
            # each batch's priorities travel once (prefetch: 2 requests on)
            self.prio_keys, self.prios = [], []
            reply = self.batches.exchange(request, ("batch", "retry", "error"), stop=self.stop.is_set)
            if reply is None:
                break  # stopped
            if reply.kind == "retry":
                self.retries[reply["reason"]] += 1
                self.stop.wait(min(max(int(reply["retry_ms"]), 1), 5000) / 1000.0)
                continue
            if reply.kind == "error":
                self.drops.drop("broker_error", str(reply["reason"]))
                self.stop.wait(1.0)
                continue
            try:
                batch_dims(reply, self.spec)
            except WireError as exc:
                self.drops.drop(exc.cause, str(exc))
                continue
            t0 = time.monotonic()
            try:
                metrics = self.trainer.update(reply, int(self.version))
            except Exception as exc:  # a batch that breaks the update must not end the run
                self.log.exception("update failed; batch dropped", error=str(exc))
                self.drops.drop("train_error", str(exc))
                continue
            self.version = int(self.version) + 1
            self.prio_keys = list(reply["keys"])
            self.prios = [float(p) if math.isfinite(p) else 0.0 for p in metrics["priorities"]]
            self._record(reply, metrics, time.monotonic() - t0)
            self.last_update = time.time()
            self.publish()

    def write_metrics(self, ask_broker: bool) -> None:
        """Append one line to ``RUN_DIR/metrics.jsonl`` and the broker/worker TensorBoard scalars.

        The line is the learner's report plus the broker's (asked for here, one status round trip every
        ``log.metrics_s``), so that ``zclaw plot`` and TensorBoard see every role's throughput, the lag
        histogram and the drops of a run, whoever started its processes. Never raises: records are a
        by-product and must not stop training.
        """
        try:
            # a broker that does not answer: last report kept
            if ask_broker and self.broker_status is not None:
                reply = self.broker_status.request(make("status"), ("status",), stop=self.stop.is_set)
                if reply is not None and isinstance(reply.get("report"), dict):
                    self.broker_report = reply["report"]
            rep = self.report()
            b = self.broker_report or {}
            line = {
                "time": time.time(), "wall_s": rep["uptime_s"], "version": rep["version"],
                "updates": rep["updates"], "steps_consumed": rep["steps_consumed"],
                "env_steps": b.get("inserted_steps"), "updates_per_s": rep["updates_per_s"],
                "learner_steps_per_s": rep["steps_per_s"], "return_mean_100": rep["return_mean_100"],
                "success_rate_100": rep["success_rate_100"], "episodes": rep["episodes"],
                "lag_mean": rep["lag_mean"], "lag_max": rep["lag_max"], "losses": rep["losses"],
                "options": rep.get("options"),
                "broker": {k: b.get(k) for k in ("fill", "capacity", "insert_rate", "sample_rate", "drops",
                                                 "lag_hist", "episodes", "return_mean_100")} if b else None,
                "workers": {k: {"rate": w.get("rate"), "version": w.get("version"), "host": w.get("host"),
                                "resources": w.get("resources")}
                            for k, w in (b.get("workers") or {}).items()},
                # each role process's CPU (% of one core), RSS (MiB), threads and GPU (or "no GPU")
                "resources": {"learner": rep.get("resources"), "broker": b.get("resources")},
            }
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(finite_json(line), sort_keys=True) + "\n")
            if self.writer is not None:  # resources/<role>/<figure>, resources/worker/<id>/<figure>
                roles = [("learner", rep.get("resources")), ("broker", b.get("resources"))]
                roles += [(f"worker/{k}", w.get("resources")) for k, w in (b.get("workers") or {}).items()]
                for role, res in roles:
                    for k, v in resource_scalars(res).items():
                        self.writer.add_scalar(f"resources/{role}/{k}", v, self.steps_consumed)
            if self.writer is not None and b:
                g, w = self.steps_consumed, self.writer
                w.add_scalar("throughput/broker_insert_steps_per_s", float(b.get("insert_rate") or 0.0), g)
                w.add_scalar("throughput/broker_sample_segments_per_s", float(b.get("sample_rate") or 0.0), g)
                for ident, info in (b.get("workers") or {}).items():
                    w.add_scalar(f"throughput/worker/{ident}", float(info.get("rate") or 0.0), g)
                w.add_scalar("broker/fill", float(b.get("fill") or 0), g)
                for cause, n in (b.get("drops") or {}).items():
                    w.add_scalar(f"broker/drops/{cause}", float(n), g)
                hist = b.get("lag_hist") or {}
                total = float(sum(hist.values())) or 1.0
                for bucket, n in hist.items():
                    w.add_scalar(f"lag/share/{bucket}", n / total, g)
        except Exception as exc:  # a full disk or a broken report must not end the run
            self.log.warning("cannot write metrics", error=str(exc))

    def status_line(self) -> None:
        r = self.report()
        self.log.info(
            "learner status", updates=r["updates"], steps=r["steps_consumed"],
            steps_per_s=round(r["steps_per_s"] or 0.0, 1), updates_per_s=round(r["updates_per_s"] or 0.0, 2),
            return_mean_100=r["return_mean_100"], lag_mean=r["lag_mean"], lag_max=r["lag_max"],
            policy_loss=self.losses.get("loss/policy"), value_loss=self.losses.get("loss/value"),
            student_loss=self.losses.get("loss/student"),
            approx_kl=self.losses.get("approx_kl"), retries=r["retries"], drops=r["drops"],
        )
        o = self.options
        if o is not None and o["K"] > 1:
            rnd = lambda xs: [None if v is None else round(v, 3) for v in xs]  # noqa: E731
            self.log.info("option health", usage=rnd(o["usage"]), duration=rnd(o["duration"]),
                          termination_rate=rnd(o["termination_rate"]), entropy=rnd(o["entropy"]),
                          distance_min=o["distance_min"], spread_min=o.get("spread_min"))
            for warning in o["warnings"]:
                self.log.warning(warning)

    def checkpoint(self) -> Optional[Path]:
        if self.model is None or self.trainer is None or self.spec is None:
            return None
        try:
            path = ckpt.save(
                self.ckpt_dir, self.model, self.trainer.optimizer, version=int(self.version),
                updates=self.updates,
                steps_consumed=self.steps_consumed, config=self.cfg, spec=self.spec.to_dict(),
                extra={"returns_100": list(self.episodes.returns)}, trainer=self.trainer.state_dict(),
            )
        except OSError as exc:  # a full disk must not kill training; say so loudly
            self.log.error("checkpoint failed", error=str(exc), dir=str(self.ckpt_dir))
            return None
        self.last_checkpoint = str(path)
        self._report()
        return path

    # -- teardown ---------------------------------------------------------------------------------------
    def finish(self) -> Dict[str, Any]:
        """Final checkpoint, final report (``learner_final.json``); returns the report."""
        path = self.checkpoint()
        if path is not None:
            self.log.info("final checkpoint", path=str(path), version=self.version)
        rep = self.report()
        if float(self.cfg["log"].get("metrics_s", 0.0)) > 0:
            self.write_metrics(ask_broker=False)
        rep["returns_100"] = list(self.episodes.returns)
        rep = finite_json(rep)
        try:
            text = json.dumps(rep, indent=2, sort_keys=True).encode()
            atomic_write(self.run_dir / "learner_final.json", lambda f: f.write(text))
        except OSError as exc:
            self.log.error("cannot write learner_final.json", error=str(exc))
        return rep

    def close(self) -> None:
        self.stop.set()
        if self.service is not None:
            self.service.join(timeout=5)
        for client in (self.broker, self.broker_status, self.batches):
            if client is not None:
                client.close()
        if self.pub is not None:
            self.pub.close(linger=0)
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # tensorboard flush problems must not turn a clean exit into a crash
                pass
        term_context(self.ctx)


def main(cfg: Dict[str, Dict[str, Any]], log: Any, run_dir: Path, resume: bool) -> int:
    """Run the learner until SIGINT/SIGTERM; return the exit code (zclaw/stopping.py): 0 on a clean stop,
    1 on a socket error, 2 when it cannot start (keys, bind host, a bad resume), 3 when the broker refused
    it."""
    return startup.run_role(log, lambda stop: _run(cfg, log, Path(run_dir), resume, stop))


def _run(cfg: Dict[str, Dict[str, Any]], log: Any, run_dir: Path, resume: bool, stop: threading.Event) -> int:
    """:func:`main`'s body, run with the stop signals installed (zclaw/startup.py)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(cfg["learner"]["threads"]))

    state: Optional[Dict[str, Any]] = None
    if resume:
        try:
            state = ckpt.load(run_dir / "checkpoints")
        except ckpt.CheckpointError as exc:
            raise startup.CannotStart("cannot resume", error=str(exc)) from None
    else:
        seed = int(cfg["run"]["seed"])
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    learner = Learner(cfg, log, run_dir, stop)  # keys that do not load, an unprotected bind: CannotStart
    code = EXIT_OK
    try:
        err = learner.open_sockets()
        if err is not None:
            log.error(err)
            return EXIT_FAILED
        log.info("learner up", publish=learner.net["publish_port"], serve=learner.net["learner_port"],
                 broker=learner.broker.endpoint if learner.broker else None, run_dir=str(run_dir),
                 **learner.security.summary())
        if cfg["learner"]["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            learner.writer = SummaryWriter(str(run_dir / "tb"), flush_secs=10)
        spec = learner.wait_for_spec()
        if spec is not None:
            try:
                learner.build(spec, state)
            except ckpt.CheckpointError as exc:
                log.error("cannot resume", error=str(exc))
                code = EXIT_CANNOT_START
            else:
                log.info("serving weights", version=learner.version, spec_hash=spec.hash)
                learner.train_loop()
        elif learner.refused is not None:
            code = EXIT_REFUSED
        if code == EXIT_OK:
            rep = learner.finish()
            log.info("learner stopped", version=rep["version"], updates=rep["updates"],
                     steps=rep["steps_consumed"], return_mean_100=rep["return_mean_100"])
        return code
    finally:
        learner.close()
