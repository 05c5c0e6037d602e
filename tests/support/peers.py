"""Peers the test plays with real sockets, in its own process: what a role sees arriving is exactly what a
real peer would send over TCP.

* :class:`Worker`: a worker's PUSH to the broker's ingest (``hello``, segments), speaking the protocol;
  :data:`SPEC` is its env spec, :data:`T` x :data:`N` its segments' shape, :func:`seg_arrays` their
  arrays (built by ``synthetic.random_segment``, support/synthetic.py), :func:`with_header` forges a header.
* :class:`StandInLearner`: a learner's PUB (weights every 100 ms) and ROUTER (``snapshot``), which also
  answers the worker's ``hello`` handshake as the broker would.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional

import msgpack
import numpy as np
import zmq
from support.synthetic import random_segment

from zclaw import __version__, config
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config, weights_message
from zclaw.wire import bind, make_socket
from zclaw.wire.messages import EnvSpec, Segment, make, parse

#: the env spec of the broker tests' stand-in worker, and its segments' steps x envs
SPEC = EnvSpec("test:Dummy-v0", (10,), (2,), (-1.0, -1.0), (1.0, 1.0))
T, N = 4, 3


def seg_arrays(
    rng: np.random.Generator, version: Any = 0, T: int = T, N: int = N, M: int = 1
) -> Dict[str, np.ndarray]:
    """One random segment of :data:`SPEC` (``M`` truncation rows, 3 options)."""
    return random_segment(SPEC, T, N, rng, version=version, M=M, options=3)


def with_header(frames: List[Any], **changes: Any) -> List[Any]:
    """``frames`` with header fields changed (or added): a message no honest sender makes."""
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header.update(changes)
    return [msgpack.packb(header, use_bin_type=True)] + list(frames[1:])


class Worker:
    """A stand-in worker: a real PUSH socket speaking protocol v2."""

    def __init__(self, ctx: zmq.Context, port: int, identity: str = "w0-test") -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.identity = identity
        self.seq = 0

    def hello(self, spec: EnvSpec = SPEC, segment_length: Optional[int] = None) -> None:
        """On ingest; ``segment_length`` None leaves the run's T to the first segment."""
        self.send(make("hello", role="worker", identity=self.identity, host="testhost", pid=os.getpid(),
                       zclaw=__version__, spec=spec.to_dict(), segment_length=segment_length))

    def segment(
        self,
        arrays: Dict[str, np.ndarray],
        episodes: Optional[list] = None,
        spec_hash: Optional[str] = None,
        worker: Optional[str] = None,
    ) -> Segment:
        seg = Segment(worker or self.identity, self.seq, spec_hash or SPEC.hash, arrays, episodes or [])
        self.seq += 1
        self.send(seg.frames())
        return seg

    def send(self, frames: List[Any]) -> None:
        self.sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self.sock.close()


class StandInLearner:
    """Real PUB + ROUTER sockets in a thread: answers ``snapshot`` with the served weights, publishes
    the newest published version every 100 ms (a SUB that joins late still gets it). The ROUTER also
    plays the broker's serve socket: it answers the worker's ``hello`` handshake with ``welcome``."""

    def __init__(self, ctx: zmq.Context, spec: EnvSpec, version: int, pub_port: int = 0,
                 router_port: int = 0) -> None:
        cfg = config.load()
        self.model = OptionPolicy(policy_config(cfg["policy"], spec))
        self.spec = spec
        self.served = weights_message(self.model, version, 0, spec.hash)
        self.published: Optional[bytes] = None
        self.snapshots = 0
        self.hellos = 0
        self.pub = make_socket(ctx, zmq.PUB)
        self.router = make_socket(ctx, zmq.ROUTER)
        self.pub_port = bind(self.pub, "127.0.0.1", pub_port)
        self.router_port = bind(self.router, "127.0.0.1", router_port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def serve(self, version: int) -> None:
        self.served = weights_message(self.model, version, 0, self.spec.hash)

    def publish(self, version: int) -> None:
        self.published = weights_message(self.model, version, 0, self.spec.hash)

    def _loop(self) -> None:
        last_pub = 0.0
        while not self._stop.is_set():
            if self.router.poll(20):
                ident, empty, *frames = self.router.recv_multipart()
                msg = parse(frames)
                if msg.kind == "snapshot":
                    self.snapshots += 1
                    self.router.send_multipart([ident, empty, self.served])
                elif msg.kind == "hello":
                    self.hellos += 1
                    self.router.send_multipart([ident, empty] + make(
                        "welcome", role="broker", identity="broker-standin", host="h", pid=1, zclaw="0",
                        spec=msg["spec"], segment_length=msg["segment_length"], max_message_bytes=1 << 30))
            if self.published is not None and time.monotonic() - last_pub > 0.1:
                self.pub.send(self.published)
                last_pub = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the stand-in's thread still uses its sockets"
        self.pub.close(0)
        self.router.close(0)
