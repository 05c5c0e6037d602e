"""The learner's ROUTER service against hostile and buggy clients: it cannot die of one request, answers a
flooding client ``retry`` (token bucket) while others are served, and clients of undecodable replies
give up after their bounded tries.

These run the service thread in-process on real loopback sockets (fast, exact counts); the same attacks
against live roles are in tests/system/test_faults.py.
"""
from __future__ import annotations

from contextlib import contextmanager
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import msgpack
import pytest
from support.logs import log_lines, wait_event
from support.procs import ZCLAW, Roles
import zmq

from zclaw.launch import StatusClient
from zclaw.learner import server
from zclaw.wire import LazyPirate, make, parse, tcp
from zclaw.wire.protocol import MAX_HEADER_BYTES, PROTOCOL_VERSION

WEIGHTS = b"\x00" * 100_000  # stands for a packed weights message: the service never looks inside


class _Log:
    """Collects structlog-style calls so tests can count what was logged."""

    def __init__(self) -> None:
        self.lines: List[Any] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.lines.append((level, event, kw))


@contextmanager
def _running(**kw: Any) -> Iterator[server._Service]:
    """The learner's ROUTER service thread on a free loopback port (per-client bucket 5/s, burst 10)."""
    ctx = zmq.Context()
    stop = threading.Event()
    svc = server._Service(ctx, "127.0.0.1", 0, 64 << 20, _Log(), stop, rate=5.0, burst=10.0, **kw)
    svc.start()
    assert svc.ready.wait(10) and svc.error is None
    svc.weights, svc.spec_hash = WEIGHTS, "abc"
    svc.ctx_for_test = ctx  # type: ignore[attr-defined]
    try:
        yield svc
    finally:
        stop.set()
        svc.join(10)
        ctx.destroy(linger=0)


@pytest.fixture
def service() -> Iterator[server._Service]:
    with _running() as svc:
        yield svc


PACE = 100.0  # answers per second of the paced service: small, so a few hundred requests take seconds


@pytest.fixture
def paced() -> Iterator[server._Service]:
    with _running(answer_rate=PACE) as svc:
        yield svc


def _req(svc: server._Service, timeout_ms: int = 5000) -> LazyPirate:
    return LazyPirate(svc.ctx_for_test, tcp("127.0.0.1", svc.bound_port),  # type: ignore[attr-defined]
                      timeout_ms=timeout_ms, retries=0)


def huge_parts_status() -> List[bytes]:
    """ONE status request whose header lists parts of shape [2, 2**39, 2**39], with two 4-byte frames."""
    header = {"kind": "status", "v": PROTOCOL_VERSION,
              "arrays": [["x", "<f4", [2, 1 << 39, 1 << 39], 0, [1, 1]]]}
    return [msgpack.packb(header, use_bin_type=True), b"\x00" * 4, b"\x00" * 4]


def test_one_request_that_raises_never_stops_the_service(service: server._Service, monkeypatch) -> None:
    c = _req(service)
    try:
        # the wire's own answer to the huge parts shape: whatever decode does, the service answers
        raw = service.ctx_for_test.socket(zmq.REQ)  # type: ignore[attr-defined]
        raw.connect(tcp("127.0.0.1", service.bound_port))
        raw.send_multipart(huge_parts_status())
        assert raw.poll(5000), "no answer to the huge parts request"
        assert parse(raw.recv_multipart()).kind == "error"
        raw.close(linger=0)
        drops = dict(service.drops.counts)
        assert sum(drops.values()) == 1 and "internal" not in drops, drops

        # a handler that raises something nobody foresaw: counted, logged once, answered, loop goes on
        real_parse = server.parse

        def boom(body: Any, kinds: Any = None) -> Any:
            msg = real_parse(body, kinds)
            if msg.kind == "status" and msg.get("reason") == "boom":
                raise RuntimeError("boom")
            return msg

        monkeypatch.setattr(server, "parse", boom)
        before, errors = service.drops.counts["handler_error"], service.errors
        for _ in range(3):
            assert c.request(make("status", reason="boom")).kind == "error"
        assert service.drops.counts["handler_error"] == before + 3 and service.errors == errors + 3
        logged = [ln for ln in service.log.lines if ln[1].startswith("learner service: a request raised")]
        assert len(logged) == 1, "one log line per interval, not one per request"
        assert service.is_alive()
        rep = c.request(make("status"), ("status",)).get("report")
        loop = rep["loops"]["learner-router"]
        assert loop["errors"] == errors + 3 and loop["answered"] >= 4 and loop["last_answer_unix"] is not None
        assert rep["request_drops"]["handler_error"] == before + 3
        raw = service.ctx_for_test.socket(zmq.REQ)  # type: ignore[attr-defined]
        raw.connect(tcp("127.0.0.1", service.bound_port))
        raw.send_multipart(make("snapshot", spec_hash="abc"))
        assert raw.poll(5000) and raw.recv_multipart() == [WEIGHTS]
        raw.close(linger=0)
        assert service.served["snapshot"] == 1
    finally:
        c.close()


def test_a_flooding_client_gets_retry_and_others_are_served(service: server._Service) -> None:
    flood = service.ctx_for_test.socket(zmq.DEALER)  # type: ignore[attr-defined]
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(tcp("127.0.0.1", service.bound_port))
    c = _req(service)
    try:
        n = 200  # pipelined, no waiting: far more than burst (10) + rate (5/s) x the test's duration
        for _ in range(n):
            flood.send_multipart([b""] + make("snapshot", spec_hash="abc"))
        kinds: List[str] = []
        deadline = time.monotonic() + 30
        while len(kinds) < n and time.monotonic() < deadline:
            if flood.poll(1000):
                frames = flood.recv_multipart()
                kinds.append("weights" if frames[1] == WEIGHTS else parse(frames[1:]).kind)
        assert len(kinds) == n
        allowed = kinds.count("weights")
        assert kinds.count("retry") == n - allowed and 10 <= allowed <= 10 + 5 * 30 + 1
        assert service.drops.counts["rate_limited"] == n - allowed
        # another client (its own identity, its own bucket) gets the weights at once
        raw = service.ctx_for_test.socket(zmq.REQ)  # type: ignore[attr-defined]
        raw.connect(tcp("127.0.0.1", service.bound_port))
        raw.send_multipart(make("snapshot", spec_hash="abc"))
        assert raw.poll(5000) and raw.recv_multipart() == [WEIGHTS]
        raw.close(linger=0)
        # the retry names how long to wait: after that the flooder is served again. (Retries are sent at the
        # client's turn, so its bucket refilled meanwhile: ask one at a time until one is refused.)
        for _ in range(20):
            flood.send_multipart([b""] + make("snapshot", spec_hash="abc"))
            assert flood.poll(5000)
            frames = flood.recv_multipart()
            if frames[1:] != [WEIGHTS]:
                break
        reply = parse(frames[1:])
        assert reply.kind == "retry" and reply["reason"] == "rate_limited" and 1 <= reply["retry_ms"] <= 200
        time.sleep(reply["retry_ms"] / 1000.0 + 0.05)
        flood.send_multipart([b""] + make("snapshot", spec_hash="abc"))
        assert flood.poll(5000) and flood.recv_multipart()[1:] == [WEIGHTS]
    finally:
        flood.close(linger=0)
        c.close()


class _BadStatusServer(threading.Thread):
    """A REP server whose every status answer is undecodable (a header past the decoder's cap)."""

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.asked = 0
        self.stop = threading.Event()
        self.answer = make("status", report={"blob": "x" * (MAX_HEADER_BYTES + 1024)})

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                self.sock.recv_multipart()
                self.asked += 1
                self.sock.send_multipart(self.answer)
        self.sock.close(linger=0)


def test_clients_give_up_on_undecodable_replies_after_their_tries() -> None:
    ctx = zmq.Context()
    bad = _BadStatusServer(ctx)
    bad.start()
    log = _Log()
    try:
        status = StatusClient(ctx, tcp("127.0.0.1", bad.port), timeout_ms=2000)
        t0 = time.monotonic()
        assert status.report() is None  # one question, whatever the answer: returns
        assert bad.asked == 1
        status.close()
        pirate = LazyPirate(ctx, tcp("127.0.0.1", bad.port), timeout_ms=2000, retries=2, log=log)
        assert pirate.request(make("status"), ("status",)) is None
        assert bad.asked == 4 and pirate.drops["oversize"] == 3
        assert len([ln for ln in log.lines if ln[1] == "bad reply"]) == 1, "rate-limited log"
        pirate.close()
        # retries=None (the learner's broker client) still stops when told to
        forever = LazyPirate(ctx, tcp("127.0.0.1", bad.port), timeout_ms=2000, retries=None)
        asked = bad.asked
        deadline = time.monotonic() + 1.0
        assert forever.request(make("status"), ("status",), stop=lambda: time.monotonic() > deadline) is None
        assert bad.asked - asked <= 10, "backoff between undecodable replies, not a tight loop"
        forever.close()
        print(f"\nundecodable replies: gave up after {time.monotonic() - t0:.2f} s in all")
    finally:
        bad.stop.set()
        bad.join(5)
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------- the same, against live roles


class _Flood(threading.Thread):
    """One client sending snapshot and status requests as fast as it can (32 in flight on a DEALER)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.stop = threading.Event()
        self.replies: Dict[str, int] = {}

    def run(self) -> None:
        reqs = [[b""] + make("snapshot"), [b""] + make("status")]
        in_flight, i = 0, 0
        while not self.stop.is_set():
            while in_flight < 32:
                self.sock.send_multipart(reqs[i % 2])
                in_flight, i = in_flight + 1, i + 1
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                in_flight -= 1
                try:
                    kind = parse(frames[1:]).kind
                except Exception:
                    kind = "other"
                self.replies[kind] = self.replies.get(kind, 0) + 1
        self.sock.close(linger=0)


@pytest.mark.fault
def test_live_learner_answers_after_huge_parts_and_a_joining_worker_acts_through_a_flood(
    roles: Roles, tmp_path: Path
) -> None:
    roles.start("broker")
    roles.start("learner", "--run-dir", str(tmp_path / "run"), "--set", "learner.tensorboard=false")
    roles.start("worker", "--index", "0", name="worker0")
    roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 2, timeout=120)
    endpoint = tcp("127.0.0.1", roles.ports["learner_port"])

    raw = roles.ctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    raw.send_multipart(huge_parts_status())
    assert raw.poll(10000), "the learner did not answer the huge parts request"
    assert parse(raw.recv_multipart()).kind == "error"
    raw.close(linger=0)
    rep = roles.learner.report()
    assert rep is not None, "the learner stopped answering status"
    drops = rep["request_drops"]
    assert sum(drops.values()) >= 1 and "internal" not in drops, drops

    roles.start("worker", "--index", "1", name="worker1")
    idle = wait_event(tmp_path / "worker1.log", "acting", 90)
    flood = _Flood(roles.ctx, endpoint)
    flood.start()
    try:
        v0 = roles.learner.report()["version"]
        roles.start("worker", "--index", "2", name="worker2")
        flooded = wait_event(tmp_path / "worker2.log", "acting", 90)
        roles.wait(roles.learner, lambda r: r["version"] >= v0 + 2, timeout=60)  # training goes on
    finally:
        flood.stop.set()
        flood.join(10)
    assert flooded["version"] >= v0, "the joining worker got current weights"
    assert flood.replies.get("retry", 0) > 0, flood.replies
    rep = roles.learner.report()
    assert rep["request_drops"].get("rate_limited", 0) > 0 and "internal" not in rep["request_drops"], rep
    print(f"\njoin_s idle {idle['join_s']} s, under a snapshot+status flood {flooded['join_s']} s; "
          f"flood replies {flood.replies}")


class _StatusSpoiler(threading.Thread):
    """Stands between the learner and the broker: forwards everything, but answers ``status`` itself with
    a reply no zclaw decoder accepts (a header past MAX_HEADER_BYTES), as a broker whose report grew."""

    def __init__(self, ctx: zmq.Context, broker: str) -> None:
        super().__init__(daemon=True)
        self.ctx, self.broker = ctx, broker
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.backs: Dict[bytes, zmq.Socket] = {}  # one DEALER per client: the broker sees one peer each
        self.stop = threading.Event()
        self.spoiled = 0
        self.answer = make("status", report={"blob": "x" * (MAX_HEADER_BYTES + 1024)})

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(100))
            if self.front in ready:
                frames = self.front.recv_multipart()
                ident, rest = frames[0], frames[1:]
                try:
                    kind = parse(rest[1:]).kind
                except Exception:
                    kind = ""
                if kind == "status":
                    self.spoiled += 1
                    self.front.send_multipart([ident, b""] + self.answer)
                else:
                    if ident not in self.backs:
                        back = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.broker)
                        self.backs[ident] = back
                        poller.register(back, zmq.POLLIN)
                    self.backs[ident].send_multipart(rest)
            for ident, back in self.backs.items():
                if back in ready:
                    self.front.send_multipart([ident] + back.recv_multipart())
        self.front.close(linger=0)
        for back in self.backs.values():
            back.close(linger=0)


@pytest.mark.fault
def test_learner_trains_on_and_status_returns_when_the_brokers_status_cannot_be_decoded(
    roles: Roles, tmp_path: Path
) -> None:
    spoiler = _StatusSpoiler(roles.ctx, tcp("127.0.0.1", roles.ports["serve_port"]))
    spoiler.start()
    try:
        roles.start("broker")
        roles.start("learner", "--run-dir", str(tmp_path / "run"), "--set", "learner.tensorboard=false",
                    "--set", "log.metrics_s=0.5", "--set", f"network.serve_port={spoiler.port}")
        roles.start("worker", "--index", "0", name="worker0")
        rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 2, timeout=120)
        v = rep["version"]
        rep = roles.wait(roles.learner, lambda r: r["version"] >= v + 5 and sum(
            (r.get("broker_status_drops") or {}).values()) >= 3, timeout=90)
        assert spoiler.spoiled >= 3 and "oversize" in rep["broker_status_drops"], rep
        bad = [e for e in log_lines(tmp_path / "learner.log") if e.get("event") == "bad reply"]
        assert len(bad) <= 1 + spoiler.spoiled // 10, "bad replies are logged at most once per interval"
        out = subprocess.run(ZCLAW + ["status", "--once", "--broker", f"127.0.0.1:{spoiler.port}",
                                      "--learner", f"127.0.0.1:{roles.ports['learner_port']}"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "BROKER   no answer" in out.stdout and "LEARNER  version" in out.stdout, out.stdout
    finally:
        spoiler.stop.set()
        spoiler.join(5)


# -- the loop's own pace: a flood costs a bounded share of a core, every request is still answered, and
# another client is served through it (ROUTER fair-queues peers); what it buys is measured by bench/hostile.py


def test_a_flood_is_answered_at_the_loops_pace_and_another_client_is_served_through_it(
    paced: server._Service,
) -> None:
    ctx = paced.ctx_for_test  # type: ignore[attr-defined]
    endpoint = tcp("127.0.0.1", paced.bound_port)
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.connect(endpoint)
    other = ctx.socket(zmq.REQ)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(endpoint)
    try:
        n = 300  # three seconds' worth at PACE, all pipelined at once
        t0 = time.monotonic()
        for _ in range(n):
            flood.send_multipart([b""] + make("snapshot", spec_hash="abc"))
        other.send_multipart(make("snapshot", spec_hash="abc"))
        assert other.poll(30_000), "the other client got no answer during the flood"
        assert other.recv_multipart() == [WEIGHTS]
        kinds = []
        deadline = time.monotonic() + 60
        while len(kinds) < n and time.monotonic() < deadline:
            if flood.poll(1000):
                frames = flood.recv_multipart()
                kinds.append("weights" if frames[1:] == [WEIGHTS] else parse(frames[1:]).kind)
        elapsed = time.monotonic() - t0
        assert len(kinds) == n, f"{len(kinds)} of {n} flood requests answered"
        assert set(kinds) <= {"weights", "retry"} and kinds.count("retry") >= n - 10 - 5 * elapsed - 1
        # the pace: no more than the burst (PACE / 10) plus PACE per second, for all clients together
        assert paced.answered <= PACE / 10 + PACE * elapsed + 1, (paced.answered, elapsed)
        assert paced.paced > 0
        assert paced.loops()["learner-router"]["paced"] == paced.paced
    finally:
        flood.close(linger=0)
        other.close(linger=0)


def test_a_pipelining_client_is_answered_at_its_turn_and_the_pace_stays_unspent_for_others(
    service: server._Service,
) -> None:
    """A client keeping 32 snapshot+status requests in flight (bench/hostile.py's flood) is answered
    ``retry`` when its turn would come, not at once: it gets about 32 / RETRY_HOLD_S answers per second
    instead of the loop's whole pace (2,000/s), the loop never sleeps, and another client's snapshot is
    answered as it comes. Answered at once, the flood kept the pace spent, and a joining worker's request
    waited out the pace's sleeps (joins at 1.43-1.79x their idle time in bench/hostile.py)."""
    ctx = service.ctx_for_test  # type: ignore[attr-defined]
    endpoint = tcp("127.0.0.1", service.bound_port)
    flood = _Flood(ctx, endpoint)
    flood.start()
    try:
        time.sleep(0.5)  # the flood at full rate
        answered, t0 = service.answered, time.monotonic()
        waits: List[float] = []
        for _ in range(20):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            t = time.monotonic()
            sock.send_multipart(make("snapshot", spec_hash="abc"))
            assert sock.poll(5000), "no answer to a snapshot request during the flood"
            assert sock.recv_multipart() == [WEIGHTS]
            waits.append(time.monotonic() - t)
            sock.close(linger=0)
            time.sleep(0.05)
        rate = (service.answered - answered - len(waits)) / (time.monotonic() - t0)
    finally:
        flood.stop.set()
        flood.join(10)
    waits.sort()
    print(f"\nflood answered {rate:.0f}/s (held at most {service.held_max}), paced {service.paced}; "
          f"snapshot answers during it: median {1000 * waits[len(waits) // 2]:.1f} ms, worst "
          f"{1000 * waits[-1]:.1f} ms")
    assert flood.replies.get("retry", 0) > 0 and service.held_max >= 16, (flood.replies, service.held_max)
    assert rate < server.MAX_ANSWERS_PER_S / 4, "the flood is answered as fast as the pace allows"
    assert service.paced == 0, "the flood spent the loop's pace: others' requests waited out its sleeps"
    assert waits[len(waits) // 2] < 0.05


def test_the_learners_router_refuses_a_2_mib_request_unread_and_goes_on(service: server._Service) -> None:
    """Snapshot and status requests are a few bytes: the ROUTER's MAXMSGSIZE is the wire's
    REQUEST_SOCKET_BYTES (256 KiB), whatever ``network.max_message_mb``, so libzmq drops a 2 MiB request
    at its size prefix (no answer, nothing read or counted) and the others are served."""
    ctx = service.ctx_for_test  # type: ignore[attr-defined]
    drops = dict(service.drops.counts)
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(tcp("127.0.0.1", service.bound_port))
    c = _req(service)
    try:
        big.send_multipart([b"", make("status", reason="x" * (2 << 20))[0]])
        assert not big.poll(1500), "a 2 MiB request was read and answered: the ROUTER's cap is loose"
        assert dict(service.drops.counts) == drops
        assert c.request(make("status"), ("status",)).kind == "status"
    finally:
        big.close(linger=0)
        c.close()
