"""The learner's ROUTER service against hostile and buggy clients: it cannot die of one request, answers a
flooding client ``retry`` (token bucket) while others are served, and clients of undecodable replies
give up after their bounded tries.

These run the service thread in-process on real loopback sockets (fast, exact counts); the same attacks
against live roles are in tests/test_faults.py.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Iterator, List

import msgpack
import pytest
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


@pytest.fixture
def service() -> Iterator[server._Service]:
    ctx = zmq.Context()
    stop = threading.Event()
    svc = server._Service(ctx, "127.0.0.1", 0, 64 << 20, _Log(), stop, rate=5.0, burst=10.0)
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


def _req(svc: server._Service, timeout_ms: int = 5000) -> LazyPirate:
    return LazyPirate(svc.ctx_for_test, tcp("127.0.0.1", svc.bound_port),  # type: ignore[attr-defined]
                      timeout_ms=timeout_ms, retries=0)


def huge_parts_status() -> List[bytes]:
    """ONE status request whose header lists parts of shape [2, 2**39, 2**39], with two 4-byte frames."""
    header = {"kind": "status", "v": PROTOCOL_VERSION, "arrays": [["x", "<f4", [2, 1 << 39, 1 << 39], 2]]}
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
        # the retry names how long to wait: after that the flooder is served again
        flood.send_multipart([b""] + make("snapshot", spec_hash="abc"))
        assert flood.poll(5000)
        reply = parse(flood.recv_multipart()[1:])
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
