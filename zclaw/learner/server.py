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
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import zmq

from .. import __version__, logs
from ..fileio import atomic_write, finite_json
from ..policy.networks import OptionPolicy
from ..policy.weights import policy_config, weights_message
from ..fleet import broker_shards, broker_total
from ..wire import DropCounter, EnvSpec, Message, WireError, bind, make, make_socket, parse, tcp
from ..wire.limits import MAX_BATCH_SEGMENTS, REQUEST_SOCKET_BYTES
from ..wire.protocol import PROTOCOL_VERSION, encode_refusal, peer_version
from ..wire.messages import batch_dims
from ..wire.sockets import CurveServer, term_context
from ..telemetry import EpisodeWindow, RateMeter, ResourceMeter, cuda_index, resource_scalars
from ..tokens import TokenBucket
from .. import startup
from ..stopping import EXIT_CANNOT_START, EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from . import checkpoint as ckpt
from . import distributed
from .shards import ShardSampler, ShardWatch
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


def batch_request_size(cfg: Dict[str, Dict[str, Any]]) -> Tuple[int, int]:
    """``(batch_size, columns)`` of this learner's ``sample`` requests: ``learner.batch_segments`` segments,
    or with ``learner.batch_columns`` on, that many columns out of at most as many segments as a broker
    serves (64, or fewer when ``broker.capacity`` is smaller)."""
    L = cfg["learner"]
    columns = int(L["batch_columns"])
    if columns == 0:
        return int(L["batch_segments"]), 0
    return min(MAX_BATCH_SEGMENTS, int(cfg["broker"]["capacity"])), columns


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
            if exc.cause == "bad_version":  # another protocol: refused, in the peer's version, readably
                return encode_refusal(f"{exc}; this learner speaks protocol v{PROTOCOL_VERSION}"[:500],
                                      exc.cause, peer_version(body) or PROTOCOL_VERSION)
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
        self, cfg: Dict[str, Dict[str, Any]], log: Any, run_dir: Path, stop: threading.Event,
        sync: Optional[distributed.Sync] = None,
    ) -> None:
        self.cfg, self.log, self.run_dir, self.stop = cfg, log, Path(run_dir), stop
        self.lcfg = cfg["learner"]
        #: data-parallel ranks (zclaw/learner/distributed.py): rank 0 alone binds PUB and ROUTER, publishes,
        #: checkpoints and writes metrics; every rank trains and counts versions. Alone: rank 0 of 1.
        self.sync = sync if sync is not None else distributed.Sync(device=self.lcfg["device"])
        self.world = self.sync.world
        self.net = cfg["network"]
        # CURVE keys and the loopback rule first: raises startup.CannotStart before any socket exists
        self.security = startup.security(cfg, "learner", log,
                                         bind_host=self._bind_host(self.net["learner_host"]))
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.started = time.monotonic()
        self.run_started = startup.run_started()  # what run.time counts from (learner.lr_anneal)
        self.ctx = zmq.Context()
        self.pub: Optional[zmq.Socket] = None
        self.service: Optional[_Service] = None
        #: every broker shard: hello, batches (learner.prefetch requests in flight each), status (zclaw.fleet)
        self.shards: Optional[ShardSampler] = None
        self.shard_watch: Optional[ShardWatch] = None
        self.writer: Any = None
        self.spec: Optional[EnvSpec] = None
        self.model: Optional[OptionPolicy] = None
        self.trainer: Optional[Trainer] = None
        self.version: Optional[int] = None
        self.updates = 0
        self.steps_consumed = 0
        self._told_unlike = False  # the hint to size batches in columns was logged
        self.losses: Dict[str, float] = {}
        self.lag_sum = 0.0
        self.lag_n = 0
        self.lag_max_all = 0.0
        self.episodes = EpisodeWindow()  # the episodes the batches reported
        self.retries: Counter = Counter()
        self.drops = DropCounter(log, "batches")
        self.last_checkpoint: Optional[str] = None
        self.step_meter, self.update_meter = RateMeter(), RateMeter()  # env steps and updates trained
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
        """Bind PUB and start the ROUTER service thread (rank 0 only: other ranks only train); return an error
        text if a bind fails."""
        max_bytes = int(self.net["max_message_mb"]) << 20
        host = self._bind_host(self.net["learner_host"])
        if self.world.main:
            self.pub = make_socket(self.ctx, zmq.PUB, max_message_bytes=max_bytes, hwm=PUB_HWM,
                                   curve=self.security.server())
            try:
                bind(self.pub, host, int(self.net["publish_port"]))
            except zmq.ZMQError as exc:
                return f"cannot bind learner PUB on {tcp(host, self.net['publish_port'])}: {exc}"
            self.service = _Service(self.ctx, host, int(self.net["learner_port"]), max_bytes, self.log,
                                    self.stop, curve=self.security.server(),
                                    rate=float(self.lcfg["request_rate"]),
                                    burst=float(self.lcfg["request_burst"]))
            self.service.start()
            self.service.ready.wait(10)
            if self.service.error:
                return self.service.error
        client = dict(timeout_ms=int(self.net["request_timeout_ms"]), retries=None,
                      max_message_bytes=max_bytes, log=self.log, curve=self.security.client("broker"))
        self.shards = ShardSampler(self.ctx, broker_shards(self.cfg), client,
                                   credit=int(self.lcfg["prefetch"]), status_timeout_ms=STATUS_TIMEOUT_MS,
                                   log=self.log, seed=int(self.cfg["run"]["seed"]))
        # the brokers' status for metrics and the draw, asked in a thread: never in the way of training
        metrics_s = float(self.cfg["log"].get("metrics_s", 0.0))
        self.shard_watch = ShardWatch(self.shards, metrics_s if metrics_s > 0 else 5.0, self.stop)
        self.shard_watch.start()
        self._report(state="waiting for env spec")
        return None

    def wait_for_spec(self) -> Optional[EnvSpec]:
        """Say ``hello`` to the broker until its ``welcome`` names the env spec (a worker said hello, or a
        snapshot was restored); None if stopped or refused (``self.refused`` says why)."""
        assert self.shards is not None
        last_log = 0.0
        ident = (self.service.identity if self.service is not None  # other ranks: an identity of their own
                 else f"learner-{socket.gethostname()}-{os.getpid()}-rank{self.world.rank}")
        hello = make("hello", role="learner", identity=ident, host=socket.gethostname(), pid=os.getpid(),
                     zclaw=__version__, spec=None, segment_length=None)
        while not self.stop.is_set():
            reply = self.shards.welcome(hello, stop=self.stop.is_set)
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
        """Build the network and optimiser, from scratch or from a checkpoint (``state``); with ranks, every
        rank from rank 0's."""
        device = self.sync.device  # learner.device; a rank's own GPU with ranks on CUDA
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ckpt.CheckpointError(f"learner.device = {self.lcfg['device']!r} but CUDA is not available")
        pcfg = policy_config(self.cfg["policy"], spec)
        if state is not None:
            ckpt.check_compatible(state, spec.to_dict(), pcfg)
        self.spec = spec
        self.model = OptionPolicy(pcfg)
        # the normaliser leaves out rows beyond the bound workers and the broker enforce (the last line)
        self.trainer = Trainer(self.model, self.lcfg, device, action_low=spec.action_low,
                               action_high=spec.action_high, obs_max_abs=self.cfg["worker"]["max_abs_obs"],
                               sync=self.sync)
        if self.world.parallel:
            state = self._state_of_rank0(state)
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
            self.trainer.floor_log_std()  # a checkpoint written under a lower floor obeys this run's
        if self.service is not None:
            self.service.spec_hash = spec.hash
        self.publish()
        if state is not None:  # logged once the restored version is published and in the report
            self.log.info("resumed", checkpoint=state.get("path"), version=self.version, updates=self.updates,
                          steps=self.steps_consumed)

    def _state_of_rank0(self, state: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Every rank starts where rank 0 does: rank 0's checkpoint (``--resume``; only rank 0 reads it), sent
        to every rank and returned, or rank 0's fresh weights and normaliser, loaded here (None returned)."""
        assert self.model is not None and self.spec is not None
        mine = None
        if self.world.main:
            mine = ckpt.encode(state if state is not None else ckpt.snapshot(
                self.model, None, version=0, updates=0, steps_consumed=0, config=self.cfg,
                spec=self.spec.to_dict()))
        shared = ckpt.decode(self.sync.share(mine))
        if shared.get("path") is None:  # a fresh start (a loaded checkpoint says where it came from)
            self.model.load_state_dict(shared["model"])
            return None
        return shared

    # -- publishing -------------------------------------------------------------------------------------
    def publish(self) -> None:
        """Send the current version on PUB and make it the snapshot the service thread hands out (rank 0:
        it publishes every rank's version, which is the same)."""
        assert self.model is not None and self.spec is not None and self.version is not None
        if not self.world.main:
            logs.set_version(self.version)
            return
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
            # the broker status asks of the shard watcher that got no usable answer, by cause
            "broker_status_drops": self._status_drops(),
            # per broker shard: endpoint, up, fill, batches it served this learner
            "shards": self.shards.summary() if self.shards is not None else [],
            "loops": {"learner-train": loop_report(self.last_update, self.updates, self.drops.counts.get(
                "train_error", 0))},
            "resources": self.resources.report(now),
            # data-parallel ranks: rank, size, backend and the seconds spent in collectives (rank 0's)
            "ranks": self.sync.report() if self.world.parallel else None,
        })

    def _report(self, **extra: Any) -> None:
        rep = self.report()
        rep.update(extra)
        if self.service is not None:
            self.service.report = rep  # one assignment: the service thread sees the old or the new dict

    # -- training ---------------------------------------------------------------------------------------
    def _record(self, msg: Message, metrics: Dict[str, Any], seconds: float) -> None:
        T, C = msg.arrays["action"].shape[:2]  # C: the batch's env columns, whatever each worker's N
        steps = int(metrics.get("steps_all", T * C))  # with data-parallel ranks, every rank's batch together
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
        assert self.shards is not None and self.trainer is not None and self.spec is not None
        B, C = batch_request_size(self.cfg)
        status_s = float(self.cfg["log"]["status_s"])
        metrics_s = float(self.cfg["log"].get("metrics_s", 0.0))
        last_metrics_line = 0.0
        ckpt_s = float(self.lcfg["checkpoint_s"])
        last_status = last_ckpt = time.monotonic()
        self.step_meter, self.update_meter = RateMeter(), RateMeter()  # rates of training, not of waiting
        voted = False  # left the loop by the ranks' stop vote
        anneal = self.lcfg["lr_anneal"] == "linear"
        if anneal:
            run = self.cfg["run"]
            if run["time"] or run["steps"]:
                self.log.info("learning rate anneals linearly to 0 over the run's budget", lr=self.lcfg["lr"],
                              time_s=run["time"] or None, steps=run["steps"] or None)
            else:
                self.log.warning("learner.lr_anneal = linear, but the run sets neither run.time nor "
                                 "run.steps: the learning rate stays at learner.lr")
        told_spent = False
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
            shard, wait = self.shards.pick()
            if shard is None:  # every shard asked us to retry later, or is down
                self.stop.wait(wait)
                continue
            version = int(self.version)
            reply = self.shards.request(
                shard, lambda keys, prios: make("sample", batch_size=B, columns=C, version=version,
                                                priority_keys=keys, priorities=prios), stop=self.stop.is_set)
            if reply is None:
                if self.stop.is_set():
                    break
                continue  # that shard is down: the others go on
            if reply.kind == "retry":
                self.retries[reply["reason"]] += 1
                continue  # the shard waits out its retry_ms (ShardSampler.pick)
            if reply.kind == "error":
                self.drops.drop("broker_error", str(reply["reason"]))
                self.stop.wait(1.0)
                continue
            try:
                batch_dims(reply, self.spec)
            except WireError as exc:
                self.drops.drop(exc.cause, str(exc))
                continue
            if C == 0 and not self._told_unlike and len(set(reply["columns"])) > 1:
                self._told_unlike = True  # once per run: the batches still train, they just vary in size
                self.log.warning("workers of different env counts: batches of batch_segments segments vary "
                                 "in size; set learner.batch_columns for batches of one size",
                                 columns=list(reply["columns"]), batch_segments=B)
            # data-parallel ranks update in step: each has a batch now; none goes on once one stops
            stop, spent = self.sync.vote(self.stop.is_set(), self.budget_spent())
            if stop:
                voted = True
                break
            if anneal:
                self.trainer.anneal(1.0 - spent)
                if spent >= 1.0 and not told_spent:
                    told_spent = True
                    self.log.warning("the run's budget is spent: learning rate 0, updates no longer change "
                                     "the policy (raise run.time / run.steps, or learner.lr_anneal = off)",
                                     steps_consumed=self.steps_consumed)
            t0 = time.monotonic()
            try:
                metrics = self.trainer.update(reply, int(self.version))
            except Exception as exc:  # a batch that breaks the update must not end the run ...
                if self.world.parallel:  # ... unless ranks wait for this one in a collective: out of step
                    raise
                self.log.exception("update failed; batch dropped", error=str(exc))
                self.drops.drop("train_error", str(exc))
                continue
            self.version = int(self.version) + 1
            self.shards.trained(shard, reply["keys"],
                                [float(p) if math.isfinite(p) else 0.0 for p in metrics["priorities"]])
            self._record(reply, metrics, time.monotonic() - t0)
            self.last_update = time.time()
            self.publish()
        if not voted:  # stopped on its own (waiting for a batch): the ranks waiting in the vote learn it
            self.sync.any(True)

    def budget_spent(self) -> float:
        """The share of the run's budget spent, in [0, 1]: the larger of the wall time since the run began
        (``zclaw train``'s start, which a restarted learner keeps; else this learner's) over ``run.time`` and
        the env steps trained on over ``run.steps`` (0 when the run sets neither)."""
        run = self.cfg["run"]
        spent = 0.0
        if run["time"] > 0:
            spent = (time.monotonic() - self.run_started) / float(run["time"])
        if run["steps"] > 0:
            spent = max(spent, self.steps_consumed / float(run["steps"]))
        return min(spent, 1.0)

    def _status_drops(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for shard in (self.shards.shards if self.shards is not None else []):
            for k, v in shard.status.drops.items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def write_metrics(self, ask_broker: bool) -> None:
        """Append one line to ``RUN_DIR/metrics.jsonl`` and the broker/worker TensorBoard scalars.

        The line is the learner's report plus the brokers' (their shards' total, and each shard's when there
        are several; asked every ``log.metrics_s`` by the shard watcher's thread), so that ``zclaw plot`` and
        TensorBoard see every role's throughput, the lag histogram and the drops of a run, whoever started
        its processes. Never raises: records are a by-product and must not stop training.
        """
        if not self.world.main:  # rank 0 writes the records of every rank
            return
        try:
            shard_reports = self.shards.reports() if self.shards is not None else []
            if ask_broker and shard_reports:  # a shard that does not answer: its last report kept
                self.broker_report = broker_total(shard_reports)
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
            if len(shard_reports) > 1:
                line["brokers"] = [None if r is None else {k: r.get(k) for k in (
                    "fill", "insert_rate", "sample_rate", "inserted_steps", "drops", "resources")}
                    for r in shard_reports]
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
        if self.model is None or self.trainer is None or self.spec is None or not self.world.main:
            return None  # rank 0 checkpoints for every rank (they hold the same state)
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
        """Final checkpoint, final report (``learner_final.json``); returns the report. Rank 0's work: other
        ranks only return their report."""
        if not self.world.main:
            return self.report()
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
        if self.shard_watch is not None:
            self.shard_watch.join(timeout=5)
        if self.shards is not None:
            self.shards.close()
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
    try:  # a data-parallel rank (torchrun, zclaw learner --nproc) joins its group; alone, nothing happens
        sync = distributed.start(cfg["learner"]["device"])
    except ValueError as exc:
        raise startup.CannotStart("cannot start as a learner rank", error=str(exc)) from None

    state: Optional[Dict[str, Any]] = None
    if resume and sync.world.main:  # other ranks start from what rank 0 loads (Learner.build)
        try:
            state = ckpt.load(run_dir / "checkpoints")
        except ckpt.CheckpointError as exc:
            raise startup.CannotStart("cannot resume", error=str(exc)) from None
    else:
        seed = int(cfg["run"]["seed"])
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    learner = Learner(cfg, log, run_dir, stop, sync)  # keys that do not load, an open bind: CannotStart
    code = EXIT_OK
    try:
        err = learner.open_sockets()
        if err is not None:
            log.error(err)
            return EXIT_FAILED
        log.info("learner up", publish=learner.net["publish_port"] if learner.pub else None,
                 serve=learner.net["learner_port"] if learner.service else None,
                 ranks=sync.world.describe() if sync.world.parallel else None,
                 brokers=[sh.endpoint for sh in learner.shards.shards] if learner.shards else None,
                 run_dir=str(run_dir),
                 **learner.security.summary())
        if cfg["learner"]["tensorboard"] and sync.world.main:
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
    except distributed.GroupBroken as exc:  # another rank is gone: no final checkpoint (maybe half an update)
        log.error("learner ranks out of step: stopping", error=str(exc))
        return EXIT_FAILED
    finally:
        learner.close()
        distributed.leave()
