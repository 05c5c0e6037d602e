"""Lazy Pirate with credit: requests stay in flight, replies come back in order, a dead peer is survived."""
from __future__ import annotations

import threading
import time
from typing import List

from support.procs import free_port
from support.waiting import wait_until
import zmq

from zclaw.wire import CreditPirate, make, parse


class Server(threading.Thread):
    """A ROUTER on loopback TCP that answers ``retry`` requests in order, once ``hold`` of them queue."""

    def __init__(self, ctx: zmq.Context, port: int, hold: int = 1, answer: bool = True) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        deadline = time.monotonic() + 5
        while True:  # a listener closed a moment ago is released by ZeroMQ's I/O thread asynchronously
            try:
                self.sock.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self.sock.close(0)
                    raise
                time.sleep(0.05)
        self.hold, self.answer = hold, answer
        self.seen: List[int] = []
        self.max_queued = 0
        self.stop = threading.Event()

    def run(self) -> None:
        queued = []
        while not self.stop.is_set():
            if self.sock.poll(20):
                ident, empty, *body = self.sock.recv_multipart()
                msg = parse(body)
                self.seen.append(msg["retry_ms"])
                queued.append((ident, msg["retry_ms"]))
                self.max_queued = max(self.max_queued, len(queued))
            if self.answer and len(queued) >= self.hold:
                for ident, n in queued:
                    self.sock.send_multipart([ident, b""] + make("retry", reason="echo", retry_ms=n))
                queued = []
        self.sock.close(0)


def test_credit_keeps_requests_in_flight_and_replies_in_order() -> None:
    ctx = zmq.Context()
    port = free_port()
    server = Server(ctx, port, hold=3)  # answers only once three requests wait: proves they were in flight
    server.start()
    client = CreditPirate(ctx, f"tcp://127.0.0.1:{port}", credit=3, timeout_ms=2000, retries=1)
    try:
        replies = [client.exchange(make("retry", reason="q", retry_ms=i + 1)) for i in range(6)]
        # the first call fills three credits with request 1; each later call adds one
        # request and takes one reply
        assert [r["retry_ms"] for r in replies] == [1, 1, 1, 2, 3, 4]
        assert server.max_queued == 3 and len(client.in_flight) == 2
    finally:
        server.stop.set()
        server.join()
        client.close()
        ctx.term()


def test_a_silent_peer_is_replaced_and_outstanding_requests_are_sent_again() -> None:
    ctx = zmq.Context()
    port = free_port()
    servers = [Server(ctx, port, answer=False)]
    servers[0].start()
    client = CreditPirate(ctx, f"tcp://127.0.0.1:{port}", credit=2, timeout_ms=300, retries=None)
    done = threading.Event()  # ends the client's retries if the test fails before the peer comes back
    result = {}
    ask = make("retry", reason="q", retry_ms=7)
    t = threading.Thread(target=lambda: result.setdefault("r", client.exchange(ask, stop=done.is_set)),
                         daemon=True)
    try:
        t.start()
        mute = servers[0]
        wait_until(lambda: len(mute.seen) >= 2, 5, "both credits sent to the mute peer", interval=0.01)
        assert mute.seen == [7, 7]  # both credits went out, neither is answered
        stop(mute)
        live = Server(ctx, port)  # the peer comes back on the same port
        servers.append(live)
        live.start()
        t.join(10)
        assert result["r"]["retry_ms"] == 7 and client.failures == 0
        # the client returns on the first reply; the second request may still be on its way in
        wait_until(lambda: len(live.seen) >= 2, 5, "both requests asked again", interval=0.01)
        assert live.seen[:2] == [7, 7]  # the fresh socket asked both outstanding requests again
    finally:
        done.set()
        for server in servers:  # every socket closed before ctx.term(), or term() waits forever
            stop(server)
        t.join(5)
        client.close()
        ctx.term()


def stop(server: Server) -> None:
    server.stop.set()
    if server.is_alive():
        server.join()


def test_retries_used_up_returns_none() -> None:
    ctx = zmq.Context()
    client = CreditPirate(ctx, f"tcp://127.0.0.1:{free_port()}", credit=2, timeout_ms=50, retries=1,
                          backoff_max_ms=50)
    try:
        assert client.exchange(make("retry", reason="q", retry_ms=1)) is None
        assert client.failures == 2
    finally:
        client.close()
        ctx.term()
