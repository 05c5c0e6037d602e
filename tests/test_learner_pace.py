"""The learner's ROUTER service answers at most ``answer_rate`` requests per second, all clients together,
so a client pipelining requests as fast as it can costs the learner a bounded share of a core; every
request is still answered, and another client is served through the flood (ROUTER fair-queues peers).

The service thread runs in-process on real loopback sockets, as in tests/test_hostile_learner.py. The only
timing figure asserted is an upper bound that a slower machine only makes easier to meet (it answers fewer);
what the pace buys in CPU and traffic is measured by bench/hostile.py.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest
import zmq

from zclaw.learner import server
from zclaw.wire import make, parse, tcp

WEIGHTS = b"\x00" * 10_000
RATE = 100.0  # answers per second: small, so a few hundred requests take seconds


class _Log:
    def __getattr__(self, level: str):  # structlog-style calls, ignored
        return lambda event, **kw: None


@pytest.fixture
def paced() -> Iterator[server._Service]:
    ctx = zmq.Context()
    stop = threading.Event()
    svc = server._Service(ctx, "127.0.0.1", 0, 64 << 20, _Log(), stop, rate=5.0, burst=10.0, answer_rate=RATE)
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
        n = 300  # three seconds' worth at RATE, all pipelined at once
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
        # the pace: no more than the burst (RATE / 10) plus RATE per second, for all clients together
        assert paced.answered <= RATE / 10 + RATE * elapsed + 1, (paced.answered, elapsed)
        assert paced.paced > 0
        assert paced.loops()["learner-router"]["paced"] == paced.paced
    finally:
        flood.close(linger=0)
        other.close(linger=0)
