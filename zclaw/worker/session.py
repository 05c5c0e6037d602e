"""The worker's handshake and heartbeat with the broker: ``hello`` -> ``welcome`` or ``refused``.

PUSH is one-way, so a worker that only pushes can never learn that the broker drops everything it
sends (another env spec, another protocol version). So before it pushes a segment the worker says
``hello`` on the broker's serve socket (REQ -> ROUTER) and waits for the answer:

* ``welcome``: go on. It names the broker (identity, host, pid, zclaw version) and the run's env spec.
* ``refused``: the broker will not take this worker's data; :class:`Refused` carries the reason, the
  worker logs it and exits with :data:`zclaw.stopping.EXIT_REFUSED` (3). It does not retry: a
  mismatched spec or protocol does not fix itself, and ``zclaw train`` does not restart such a worker.
* no answer: the broker is down or restarting; Lazy Pirate (close, reconnect, back off), forever.

After the handshake the same ``hello`` is the heartbeat, every ``interval_s``, without ever blocking
the env loop (:meth:`BrokerSession.tick` sends, and collects the answer on a later call). A restarted
broker (new identity) is logged, and a broker that has changed its mind (a fresh one that adopted
another worker's spec first) refuses at the next heartbeat.
"""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import zmq

from ..wire import EnvSpec, Message, WireError, make_socket, parse, recv_frames
from ..wire.protocol import PROTOCOL_VERSION, Frame

WAIT_LOG_S = 5.0


class Refused(Exception):
    """A server refused this client; ``cause`` is the short code, ``reason`` the text to log."""

    def __init__(self, server: str, cause: str, reason: str) -> None:
        super().__init__(f"refused by the {server}: {reason}")
        self.server, self.cause, self.reason = server, cause, reason


class BrokerSession:
    """REQ handshake/heartbeat client; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        hello: Callable[[], List[Frame]],
        log: Any,
        *,
        spec_hash: str,
        timeout_ms: int = 3000,
        interval_s: float = 5.0,
        curve: Any = None,
    ) -> None:
        self.ctx, self.endpoint, self.hello, self.log = ctx, endpoint, hello, log
        self.spec_hash = spec_hash
        self.timeout_s = timeout_ms / 1000.0
        self.interval_s = float(interval_s)
        self.curve = curve  # zclaw.wire.sockets.CurveClient or None
        self.sock: Optional[zmq.Socket] = None
        self.sent_at: Optional[float] = None  # an unanswered hello is out since then
        self.next_at = 0.0
        self.broker: Optional[str] = None  # identity of the broker that last welcomed us
        self.missed = 0  # heartbeats in a row without an answer
        self.welcomes = 0
        #: the segment length this worker sends (set once it adopted the run's): a welcome naming another
        #: one means its segments cannot be stored, so it is refused (None: not yet fixed)
        self.segment_length: Optional[int] = None

    # -------------------------------------------------------------------------------- socket
    def _send(self) -> None:
        if self.sock is None:
            self.sock = make_socket(self.ctx, zmq.REQ, curve=self.curve)
            self.sock.connect(self.endpoint)
        self.sock.send_multipart(self.hello(), copy=False)
        self.sent_at = time.monotonic()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.sent_at = None

    def _answer(self, frames: List[Any]) -> Optional[Message]:
        """Handle one reply; return the ``welcome``, raise :class:`Refused`, None for a reply to ignore."""
        try:
            msg = parse(frames, ("welcome", "refused", "error"))
        except WireError as exc:
            if exc.cause == "bad_version":
                raise Refused("broker", "bad_version", f"the broker answers in another protocol ({exc}); "
                              f"this worker speaks v{PROTOCOL_VERSION}")
            self.log.warning("bad reply from the broker", error=str(exc))
            return None
        if msg.kind == "refused":
            raise Refused("broker", msg["cause"], msg["reason"])
        if msg.kind == "error":
            self.log.warning("the broker did not understand our hello", reason=msg["reason"])
            return None
        spec = msg["spec"]
        if spec is not None:

            try:
                theirs = EnvSpec.from_dict(spec).hash
            except WireError as exc:
                self.log.warning("the broker's welcome has an unusable env spec", error=str(exc))
                return None
            if theirs != self.spec_hash:  # a broker must refuse this itself; do not trust that it did
                raise Refused("broker", "bad_spec",
                              f"the run's env spec is {theirs}, this worker's is {self.spec_hash}")
        theirs_T = msg["segment_length"]
        if self.segment_length is not None and theirs_T is not None and theirs_T != self.segment_length:
            raise Refused("broker", "bad_shape", f"the run's segment length is {theirs_T}, this worker sends "
                          f"{self.segment_length}-step segments; restart it to join the run")
        if msg["identity"] != self.broker:
            self.log.info("broker welcomed us", broker=msg["identity"], host=msg["host"], pid=msg["pid"],
                          zclaw=msg["zclaw"], rejoined=self.broker is not None)
            self.broker = msg["identity"]
        self.missed = 0
        self.welcomes += 1
        return msg

    # ---------------------------------------------------------------------------------- calls
    def handshake(self, stop: Callable[[], bool]) -> Optional[Message]:
        """Block until the broker welcomes us (None if ``stop()`` first); raise :class:`Refused`."""
        started = time.monotonic()
        last_log = started
        backoff = 0.1
        while not stop():
            self.close()
            self._send()
            deadline = time.monotonic() + self.timeout_s
            while not stop() and time.monotonic() < deadline:
                assert self.sock is not None
                if self.sock.poll(100, zmq.POLLIN):
                    reply = self._answer(recv_frames(self.sock))
                    self.sent_at = None
                    if reply is not None:
                        self.next_at = time.monotonic() + self.interval_s
                        return reply
                    break
            now = time.monotonic()
            if now - last_log >= WAIT_LOG_S:
                self.log.info("waiting for the broker", endpoint=self.endpoint,
                              waited_s=round(now - started, 1))
                last_log = now
            end = time.monotonic() + backoff
            backoff = min(backoff * 2, 2.0)
            while not stop() and time.monotonic() < end:
                time.sleep(0.02)
        self.close()
        return None

    def tick(self) -> None:
        """Heartbeat step, never blocking: collect an answer, give up on a late one, or send the next."""
        now = time.monotonic()
        if self.sent_at is not None:
            assert self.sock is not None
            if self.sock.poll(0, zmq.POLLIN):
                self.sent_at = None
                self._answer(recv_frames(self.sock))
            elif now - self.sent_at > self.timeout_s:  # Lazy Pirate: the REQ socket is stuck, replace it
                self.close()
                self.missed += 1
                if self.missed == 1 or self.missed % 10 == 0:
                    self.log.warning("broker not answering heartbeats", endpoint=self.endpoint,
                                     missed=self.missed)
            return
        if now >= self.next_at:
            self.next_at = now + self.interval_s
            self._send()
