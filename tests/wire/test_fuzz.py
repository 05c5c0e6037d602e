"""Fuzz: 100,000 random and mutated messages against a real broker (ingest + serve) and learner (ROUTER).

Every message is built from a valid frame by a mutation that makes it invalid *by construction* (a
truncated header, a wrong protocol version, a frame short by some bytes, a NaN, another spec hash, ...)
or is random bytes that msgpack itself cannot read as a map, so the number of messages each role must
drop is known exactly. Meanwhile a good worker pushes real segments through the same ingest socket;
they must all come back out of the broker bit for bit, and the broker's RSS must stay under
:data:`RSS_BOUND_MIB` throughout. Sent fast: NOBLOCK sends, small messages, replies collected in a
bounded window.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import msgpack
import numpy as np
import pytest
import zmq
from support.peers import SPEC
from support.procs import BrokerProc, free_port, rss_mib, spawn
from support.synthetic import assert_same_segment, random_segment

from zclaw import __version__
from zclaw.launch import stop_processes
from zclaw.wire import PROTOCOL_VERSION, SCHEMAS, Segment, make, parse

pytestmark = pytest.mark.slow

#: the broker's resident memory must stay below this during the fuzz (measured: 42 MiB at start, 51 at most)
RSS_BOUND_MIB = 120
N_INGEST, N_SERVE, N_LEARNER = 50_000, 30_000, 20_000
GOOD_EVERY = 250  # one good segment per this many bad ingest messages
T, N = 2, 2
#: requests in flight on a DEALER: a ROUTER drops replies past its HWM (ROUTER_MANDATORY off), and a burst of
#: 48 pipelined ones already loses some; REQ clients (one in flight) never meet this
WINDOW = 8

Frames = List[bytes]


def as_bytes(frames: List[Any]) -> Frames:
    return [bytes(memoryview(f).cast("B")) for f in frames]


class Mutator:
    """Seeded generator of invalid messages from a valid segment; each family says what is wrong."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        arrays = random_segment(SPEC, T, N, self.rng, version=1, M=1, options=2)
        self.frames = as_bytes(Segment("fuzz", 0, SPEC.hash, arrays, [{"return": 1.0, "length": 3}]).frames())
        self.header = msgpack.unpackb(self.frames[0], raw=False)
        self.index = {d[0]: i + 1 for i, d in enumerate(self.header["arrays"])}
        self.families: Dict[str, Callable[[], Frames]] = {
            name[4:]: getattr(self, name) for name in sorted(dir(self)) if name.startswith("fam_")
        }
        self.names = list(self.families)

    def _hdr(self, **changes: Any) -> Frames:
        h = dict(self.header)
        h.update(changes)
        return [msgpack.packb(h, use_bin_type=True)] + self.frames[1:]

    def _set(self, name: str, fn: Callable[[np.ndarray], None]) -> Frames:
        i = self.index[name]
        d = self.header["arrays"][i - 1]
        a = np.frombuffer(self.frames[i], dtype=d[1]).reshape(d[2]).copy()
        fn(a)
        out = list(self.frames)
        out[i] = a.tobytes()
        return out

    # ------------------------------------------------------------------------ families (all invalid)
    def fam_garbage(self) -> Frames:
        blob = bytearray(self.rng.bytes(int(self.rng.integers(1, 48))))
        up = msgpack.Unpacker(raw=False)
        up.feed(bytes(blob))
        try:
            first = next(up)
        except Exception:
            first = None
        if blob[0] == 0 or isinstance(first, dict):  # a packed-form prefix, or (never seen) a map: spoil it
            blob[0] = 0xC1  # a byte msgpack never uses
        extra = [self.rng.bytes(int(self.rng.integers(1, 16))) for _ in range(int(self.rng.integers(0, 3)))]
        return [bytes(blob)] + extra

    def fam_empty_header(self) -> Frames:
        return [b""]

    def fam_truncated_header(self) -> Frames:
        return [self.frames[0][: int(self.rng.integers(1, len(self.frames[0])))]] + self.frames[1:]

    def fam_bad_version(self) -> Frames:
        v = int(self.rng.integers(0, 255))  # any version but this one's
        return self._hdr(v=v if v < PROTOCOL_VERSION else v + 1)

    def fam_unknown_kind(self) -> Frames:
        kind = "k" + self.rng.bytes(6).hex()
        assert kind not in SCHEMAS
        return self._hdr(kind=kind)

    def fam_missing_field(self) -> Frames:
        h = dict(self.header)
        del h[["worker", "seq", "spec_hash", "episodes"][int(self.rng.integers(0, 4))]]
        return [msgpack.packb(h, use_bin_type=True)] + self.frames[1:]

    def fam_wrong_type(self) -> Frames:
        field, value = [("seq", "7"), ("worker", 7), ("episodes", {"a": 1}), ("spec_hash", 1.5)][
            int(self.rng.integers(0, 4))]
        return self._hdr(**{field: value})

    def fam_short_frame(self) -> Frames:
        i = self.index[["obs", "action", "reward", "policy_version"][int(self.rng.integers(0, 4))]]
        out = list(self.frames)
        out[i] = out[i][: len(out[i]) - int(self.rng.integers(1, len(out[i]) + 1))]
        return out

    def fam_missing_frame(self) -> Frames:
        return self.frames[:-1]

    def fam_extra_frame(self) -> Frames:
        return self.frames + [self.rng.bytes(8)]

    def fam_bad_dtype(self) -> Frames:
        arrays = [list(d) for d in self.header["arrays"]]
        arrays[self.index["reward"] - 1][1] = "<i4"  # same byte length, wrong dtype for the layout
        return self._hdr(arrays=arrays)

    def fam_bad_shape(self) -> Frames:
        arrays = [list(d) for d in self.header["arrays"]]
        arrays[self.index["obs"] - 1][2] = [T + 1, N * 10, 1]  # same bytes, wrong layout
        return self._hdr(arrays=arrays)

    def fam_nan(self) -> Frames:
        def poison(a: np.ndarray) -> None:
            bad = [np.nan, np.inf, -np.inf][int(self.rng.integers(0, 3))]
            a.flat[int(self.rng.integers(0, a.size))] = bad
        return self._set(["reward", "obs", "logp_action"][int(self.rng.integers(0, 3))], poison)

    def fam_other_spec(self) -> Frames:
        return self._hdr(spec_hash=self.rng.bytes(8).hex())

    def fam_option_range(self) -> Frames:
        return self._set("option", lambda a: a.__setitem__((0, 0), 1 << 20))

    def fam_negative_version(self) -> Frames:
        return self._set("policy_version", lambda a: a.__setitem__(0, -1))

    def fam_bad_episode(self) -> Frames:
        return self._hdr(episodes=[{"return": "x", "length": 1}])

    def stream(self, n: int) -> Iterator[Tuple[str, Frames]]:
        for _ in range(n):
            name = self.names[int(self.rng.integers(0, len(self.names)))]
            yield name, self.families[name]()


def push_all(sock: zmq.Socket, frames: Frames) -> None:
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            assert sock.poll(30000, zmq.POLLOUT), "the broker stopped taking messages"


class Dealer:
    """Pipelined requests on a DEALER: at most WINDOW in flight, every reply counted by kind."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.outstanding = 0
        self.replies: Counter = Counter()

    def send(self, body: Frames, expect_reply: bool = True) -> None:
        while self.outstanding >= WINDOW:
            assert self.sock.poll(10000), "no reply within 10 s"
            self._recv()
        while True:
            try:
                self.sock.send_multipart(body, zmq.NOBLOCK)
                break
            except zmq.Again:
                self._recv() if self.sock.poll(1000) else None
        self.outstanding += expect_reply
        while self.sock.poll(0):
            self._recv()

    def _recv(self) -> None:
        frames = self.sock.recv_multipart()
        assert frames[0] == b"", frames
        self.replies[parse(frames[1:]).kind] += 1
        self.outstanding -= 1

    def receive(self, timeout_ms: int) -> None:
        """Take one reply if it comes within ``timeout_ms``."""
        if self.sock.poll(timeout_ms):
            self._recv()

    def drain(self) -> None:
        while self.outstanding > 0:
            assert self.sock.poll(10000), f"{self.outstanding} replies missing"
            self._recv()

    def close(self) -> None:
        self.sock.close()


def test_fuzz_broker_and_learner_drop_exactly_the_bad_and_keep_good_data(tmp_path: Path) -> None:
    t_start = time.monotonic()
    # the fuzz checks decoding, not fairness: no token bucket in the way of its 30,000 requests (a fast
    # host sends them above broker.request_rate; tests/broker/test_hostile_broker.py covers the bucket)
    broker = BrokerProc('broker.mode="queue"', "broker.capacity=256", "broker.min_size=1",
                        "broker.max_reuse=1", "network.max_message_mb=1", "log.status_s=30",
                        "broker.request_rate=1e6", "broker.request_burst=1e6")
    learner_port = free_port()
    learner_log = open(tmp_path / "learner.log", "wb")
    learner = spawn(  # its broker port leads nowhere: it waits for a spec while its ROUTER serves
        ["learner", "--run-dir", str(tmp_path / "run"),
         "--set", f"network.learner_port={learner_port}", "--set", f"network.publish_port={free_port()}",
         "--set", f"network.serve_port={free_port()}", "--set", "learner.tensorboard=false",
         # the fuzz checks decoding, not fairness: no token bucket in the way of its 20,000 requests
         "--set", "learner.request_rate=1e6", "--set", "learner.request_burst=1e6",
         "--set", 'log.format="json"'], stdout=learner_log)
    ctx = broker.ctx
    try:
        rss0 = rss_mib(broker.proc.pid)
        rss_max = rss0
        mut = Mutator(seed=1234)
        rng = np.random.default_rng(7)

        # ---------------------------------------------------------------- ingest (PULL): bad + good
        bad = ctx.socket(zmq.PUSH)
        good = ctx.socket(zmq.PUSH)
        for s in (bad, good):
            s.setsockopt(zmq.SNDHWM, 1000)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(f"tcp://127.0.0.1:{broker.ingest_port}")
        push_all(good, as_bytes(make("hello", role="worker", identity="w0-good", host="h", pid=os.getpid(),
                                     zclaw=__version__, spec=SPEC.to_dict(),
                                     segment_length=T)))
        broker.wait_for(lambda r: r["spec"] is not None, "spec adoption")
        sent_good: List[Segment] = []
        families: Counter = Counter()
        for i, (name, frames) in enumerate(mut.stream(N_INGEST)):
            families[name] += 1
            push_all(bad, frames)
            if i % GOOD_EVERY == 0:
                seg = Segment("w0-good", len(sent_good), SPEC.hash,
                              random_segment(SPEC, T, N, rng, version=len(sent_good), M=len(sent_good) % 2,
                                             options=2), [{"return": float(len(sent_good)), "length": 2}])
                sent_good.append(seg)
                push_all(good, seg.frames())
            if i % 10_000 == 0:
                rss_max = max(rss_max, rss_mib(broker.proc.pid))
        oversize = [b"\x00" * (1 << 20) + b"x"]  # above network.max_message_mb, below the socket cap
        for _ in range(5):
            push_all(bad, as_bytes(make("status")) + oversize)
        n_bad_ingest = N_INGEST + 5
        rep = broker.wait_for(lambda r: sum(r["drops"].values()) >= n_bad_ingest
                              and r["inserted_segments"] >= len(sent_good), "ingest drops", timeout_s=60)
        assert sum(rep["drops"].values()) == n_bad_ingest, rep["drops"]
        assert rep["inserted_segments"] == len(sent_good) and rep["fill"] == len(sent_good)
        d = rep["drops"]
        assert d["bad_version"] == families["bad_version"] and d["unknown_kind"] == families["unknown_kind"]
        assert d["non_finite"] == families["nan"] and d["bad_spec"] == families["other_spec"]
        assert d["oversize"] == 5 and d["bad_dtype"] == families["bad_dtype"]
        assert d["bad_value"] == families["option_range"] + families["negative_version"]
        rss_max = max(rss_max, rss_mib(broker.proc.pid))

        # ---------------------------------------------------------------- serve (ROUTER) via a DEALER
        dealer = Dealer(ctx, broker.serve_port)
        n_serve = 0
        for name, frames in mut.stream(N_SERVE // 2):  # segment mutants, and valid segments: wrong socket
            dealer.send([b""] + frames)
            n_serve += 1
        valid = mut.frames
        for i in range(N_SERVE // 2):
            r = i % 4
            if r == 0:
                body = [b""] + valid  # a valid segment is not a request: unexpected_kind
            elif r == 1:
                body = [b""] + as_bytes(make("sample", batch_size=int(rng.integers(257, 10**6)), version=0))
            elif r == 2:
                body = [bytes([0xC1]) + rng.bytes(4)]  # no REQ delimiter at all
            else:
                h = bytearray(valid[0])
                h[int(rng.integers(0, len(h)))] ^= int(rng.integers(1, 256))  # one flipped header byte
                body = [b"", bytes(h)] + valid[1:]
            dealer.send(body)
            n_serve += 1
            if i % 5000 == 0:
                rss_max = max(rss_max, rss_mib(broker.proc.pid))
        dealer.drain()
        assert sum(dealer.replies.values()) == n_serve, "every request, however bad, gets a reply"
        assert set(dealer.replies) <= {"error", "refused"}, dealer.replies
        rep = broker.status()
        assert sum(rep["drops"].values()) == n_bad_ingest + n_serve, rep["drops"]
        rss_max = max(rss_max, rss_mib(broker.proc.pid))

        # ---------------------------------------------------------------- learner ROUTER via a DEALER
        ldealer = Dealer(ctx, learner_port)
        # its ROUTER is up once it answers status: the DEALER holds the request until the learner binds
        ldealer.send([b""] + as_bytes(make("status")))
        deadline = time.monotonic() + 120
        while not ldealer.replies["status"]:
            ldealer.receive(1000)
            alive = learner.poll() is None
            assert time.monotonic() < deadline and alive, (tmp_path / "learner.log").read_text()
        for i, (name, frames) in enumerate(mut.stream(N_LEARNER)):
            ldealer.send([b""] + frames)
        ldealer.drain()
        # every mutant is answered: another protocol version with a refusal it can read, the rest with error
        assert ldealer.replies["error"] + ldealer.replies["refused"] == N_LEARNER, ldealer.replies
        probe = Dealer(ctx, learner_port)
        probe.sock.send_multipart([b""] + as_bytes(make("status")))
        assert probe.sock.poll(10000)
        lrep = parse(probe.sock.recv_multipart()[1:])["report"]
        assert sum(lrep["request_drops"].values()) == N_LEARNER, lrep["request_drops"]
        drops = lrep["request_drops"]
        assert drops.get("bad_version", 0) == ldealer.replies["refused"], drops
        assert learner.poll() is None, "the learner survived"

        # ---------------------------------------------------------------- the good data, bit for bit
        got: List[Tuple[int, Any]] = []
        while len(got) < len(sent_good):
            n = min(32, len(sent_good) - len(got))
            batch = broker.sample(n, version=len(sent_good))
            assert batch.kind == "batch", batch.header
            assert batch["workers"] == ["w0-good"] * n
            for b, seq in enumerate(batch["seqs"]):
                assert_same_segment(batch.arrays, batch["columns"], b, sent_good[seq].arrays)
                got.append((seq, b))
        assert [s for s, _ in got] == list(range(len(sent_good))), "all good segments, in order"
        rss_max = max(rss_max, rss_mib(broker.proc.pid))
        n_bad = n_bad_ingest + n_serve + N_LEARNER
        print(f"\nfuzz: {n_bad} bad messages + {len(sent_good)} good segments in "
              f"{time.monotonic() - t_start:.1f} s; broker RSS {rss0:.0f} -> max {rss_max:.0f} MiB")
        assert rss_max < RSS_BOUND_MIB, f"broker RSS reached {rss_max:.0f} MiB"
        for s in (bad, good):
            s.close()
        for dl in (dealer, ldealer, probe):
            dl.close()
        broker.stop()
    finally:
        broker.kill()
        stop_processes([learner], 20)
        learner_log.close()
