"""The broker as a real process: a test acts as a worker (PUSH) and as a learner (REQ) on loopback."""
from __future__ import annotations

import os
import time
from typing import Dict, List

import numpy as np
import pytest
from support.peers import SPEC, N, T, Worker, seg_arrays, with_header
from support.synthetic import assert_same_segment
import zmq

from zclaw import __version__
from zclaw.wire.messages import EnvSpec, Segment, batch_dims, make, parse

# -------------------------------------------------------------------------------------------- tests


def test_data_flows_bit_for_bit_and_hostile_input_is_dropped_and_counted(start_broker) -> None:
    broker = start_broker(
        'broker.mode="queue"', "broker.capacity=16", "broker.min_size=2", "broker.max_reuse=1",
        "network.max_message_mb=1",
    )
    rng = np.random.default_rng(0)
    report = broker.status()
    assert report["spec"] is None and report["fill"] == 0 and report["capacity"] == 16

    good = Worker(broker.ctx, broker.ingest_port)
    good.segment(seg_arrays(rng))  # before any hello: the broker cannot know the spec
    broker.wait_for(lambda r: r["drops"].get("no_spec") == 1, "no_spec drop")

    good.hello()
    report = broker.wait_for(lambda r: r["spec"] is not None, "spec adoption")
    assert report["spec"] == SPEC.to_dict()
    me = report["workers"]["w0-test"]
    assert me["host"] == "testhost" and me["pid"] == os.getpid()

    # min_size = 2: no batch with fewer inserts
    reply = broker.sample(2)
    assert reply.kind == "retry" and reply["reason"] == "min_size" and reply["retry_ms"] == 20
    episodes0 = [{"return": 3.5, "length": 10, "success": True}]
    episodes1 = [{"return": -1.5, "length": 7, "success": False}, {"return": 0.5, "length": 2}]
    seg0 = good.segment(seg_arrays(rng, version=0), episodes=episodes0)
    broker.wait_for(lambda r: r["inserted_segments"] == 1, "first insert")
    assert broker.sample(2)["reason"] == "min_size"
    seg1 = good.segment(seg_arrays(rng, version=0), episodes=episodes1)
    broker.wait_for(lambda r: r["inserted_segments"] == 2, "second insert")

    batch = broker.sample(2, version=1)
    assert batch.kind == "batch", batch.header
    assert batch_dims(batch, SPEC) == (2, T, 2 * N, 2) and batch["columns"] == [N, N]
    assert batch["keys"] == [0, 1] and batch["seqs"] == [1, 2] and batch["workers"] == ["w0-test", "w0-test"]
    assert batch["spec_hash"] == SPEC.hash
    assert batch["episodes"] == episodes0 + episodes1
    assert_same_segment(batch.arrays, batch["columns"], 0, seg0.arrays)
    assert_same_segment(batch.arrays, batch["columns"], 1, seg1.arrays)
    assert batch.arrays["is_weight"].tolist() == [1.0, 1.0]

    # max_reuse = 1: both were used up
    reply = broker.sample(1)
    assert reply.kind == "retry" and reply["reason"] == "not_enough_data"

    # a segment stored before the attack must come back unchanged after it
    seg2 = good.segment(seg_arrays(rng, version=1))
    broker.wait_for(lambda r: r["inserted_segments"] == 3, "third insert")

    bad = Worker(broker.ctx, broker.ingest_port, identity="evil")
    bad.send([np.random.default_rng(1).bytes(1000)])  # garbage
    # unknown protocol version
    bad.send(with_header(Segment("evil", 0, SPEC.hash, seg_arrays(rng)).frames(), v=1))
    wrong_dtype = seg_arrays(rng)
    wrong_dtype["obs"] = wrong_dtype["obs"].astype("<f8")
    bad.segment(wrong_dtype)
    wrong_shape = seg_arrays(rng)
    wrong_shape["obs"] = np.zeros((T + 1, N, 9), "<f4")
    bad.segment(wrong_shape)
    nan_reward = seg_arrays(rng)
    nan_reward["reward"][1, 2] = np.nan
    bad.segment(nan_reward)
    # ~1.4 MiB > max_message_mb = 1 (it would also be bad_shape: T differs; oversize must be seen first)
    bad.segment(seg_arrays(rng, T=20_000, N=1))
    bad.segment(seg_arrays(rng), spec_hash="0123456789abcdef")
    other = EnvSpec("test:Other-v0", (10,), (2,), (-1.0, -1.0), (1.0, 1.0))
    bad.hello(other)
    seg3 = good.segment(seg_arrays(rng, version=1))  # the well-behaved worker keeps going

    expected = {
        "no_spec": 1, "malformed": 1, "bad_version": 1, "bad_dtype": 1, "bad_shape": 1, "non_finite": 1,
        "oversize": 1, "bad_spec": 2,
    }
    report = broker.wait_for(lambda r: r["drops"] == expected and r["inserted_segments"] == 4, "the drops")
    assert report["fill"] == 2
    assert "evil" not in report["workers"] or report["workers"]["evil"]["segments"] == 0

    batch = broker.sample(2, version=2)
    assert batch.kind == "batch" and batch["keys"] == [2, 3]
    assert_same_segment(batch.arrays, batch["columns"], 0, seg2.arrays)
    assert_same_segment(batch.arrays, batch["columns"], 1, seg3.arrays)

    # bad requests on the serve socket get an error reply (a REQ must never be left hanging) and are counted
    for frames, cause in [
        ([b"\xc1garbage"], "malformed"),
        (make("retry", reason="x", retry_ms=1), "unexpected_kind"),  # hello is served here (handshake)
        (make("sample", batch_size=0, version=0), "bad_value"),
        (make("sample", batch_size=17, version=0), "bad_value"),
    ]:
        reply = broker.request(frames)
        assert reply.kind == "error" and reply["reason"], cause

    report = broker.status()
    assert report["drops"]["malformed"] == 2 and report["drops"]["unexpected_kind"] == 1
    assert report["drops"]["bad_value"] == 2
    w = report["workers"]["w0-test"]
    assert w["segments"] == 4 and w["steps"] == 4 * T * N and w["version"] == 1 and w["last_seen_s"] < 10
    assert report["inserted_steps"] == 4 * T * N
    assert report["sampled_segments"] == 4 and report["batches"] == 2
    assert report["episodes"] == 3
    assert report["return_mean_100"] == pytest.approx((3.5 - 1.5 + 0.5) / 3)
    assert report["success_rate_100"] == pytest.approx(0.5)
    # lag per step x env: batch 1 (version 1) of data at 0 and batch 2 (version 2) of data at 1: all lag 1
    assert report["lag_hist"] == {"0": 0, "1": 4 * T * N, "2": 0, "3-4": 0, "5-8": 0, "9-16": 0, "17+": 0}
    assert report["retries"] == {"min_size": 2, "not_enough_data": 1}
    assert report["uptime_s"] > 0
    good.close()
    bad.close()
    broker.stop()


def test_workers_of_different_env_counts_feed_one_store_and_every_segment_reaches_the_learner(
    start_broker,
) -> None:
    """Protocol v2: workers with 1, 3 and 8 envs in one run; nothing is dropped for its shape, a batch joins
    their columns, and each worker's data comes back bit for bit, in proportion to what it sent (queue mode:
    every segment once)."""
    broker = start_broker("broker.min_size=1")
    rng = np.random.default_rng(5)
    workers = {n: Worker(broker.ctx, broker.ingest_port, identity=f"w{n}-mixed") for n in (1, 3, 8)}
    for w in workers.values():
        w.hello(segment_length=T)
    sent: Dict[str, List[Segment]] = {w.identity: [] for w in workers.values()}
    for i in range(3):
        for n, w in workers.items():
            sent[w.identity].append(w.segment(seg_arrays(rng, version=i, N=n, M=i % 2)))
    report = broker.wait_for(lambda r: r["inserted_segments"] == 9, "nine inserts")
    assert "bad_shape" not in report["drops"], report["drops"]
    assert report["inserted_steps"] == 3 * T * (1 + 3 + 8)
    envs = {k: v["envs"] for k, v in report["workers"].items()}
    assert envs == {"w1-mixed": 1, "w3-mixed": 3, "w8-mixed": 8}
    got: Dict[str, int] = {}
    for _ in range(3):
        batch = broker.sample(3, version=3)
        assert batch.kind == "batch", batch.header
        B, T_, C, _ = batch_dims(batch, SPEC)
        assert (B, T_, C) == (3, T, sum(batch["columns"]))
        for b, (who, seq) in enumerate(zip(batch["workers"], batch["seqs"])):
            assert_same_segment(batch.arrays, batch["columns"], b, sent[who][seq].arrays)
            got[who] = got.get(who, 0) + batch["columns"][b] * T
    assert got == {"w1-mixed": 3 * T, "w3-mixed": 9 * T, "w8-mixed": 24 * T}
    assert broker.status()["lag_hist"]["3-4"] + broker.status()["lag_hist"]["2"] > 0
    for w in workers.values():
        w.close()
    broker.stop()


def test_a_batch_sized_in_columns_is_one_size_whatever_the_workers_env_counts(start_broker) -> None:
    """``columns`` in a sample request: workers of 2 and 16 envs, batches of at least 32 columns made of
    whole segments (never more than one segment past the target), each segment bit for bit; the rate
    limiter counts the segments actually served; a target out of range is an error, counted."""
    broker = start_broker("broker.min_size=1", "broker.mode=\"uniform\"", "broker.max_reuse=0",
                          "broker.samples_per_insert=2.0", "broker.spi_error_buffer=4.0")
    rng = np.random.default_rng(6)
    workers = {n: Worker(broker.ctx, broker.ingest_port, identity=f"w{n}-cols") for n in (2, 16)}
    sent: Dict[str, List[Segment]] = {w.identity: [] for w in workers.values()}
    for w in workers.values():
        w.hello(segment_length=T)
    for i in range(6):
        for n, w in workers.items():
            sent[w.identity].append(w.segment(seg_arrays(rng, version=0, N=n)))
    broker.wait_for(lambda r: r["inserted_segments"] == 12, "twelve inserts")
    served = 0
    sizes = set()
    while True:
        batch = broker.sample(64, columns=32)
        if batch.kind != "batch":
            assert batch.kind == "retry" and batch["reason"] == "rate_limited", batch.header
            break
        cols = batch["columns"]
        assert sum(cols) >= 32 and sum(cols[:-1]) < 32, cols
        sizes.add(len(cols))
        served += len(cols)
        for b, (who, seq) in enumerate(zip(batch["workers"], batch["seqs"])):
            assert_same_segment(batch.arrays, cols, b, sent[who][seq].arrays)
    assert len(sizes) > 1  # 2 x 16, 1 x 16 + 8 x 2, ...: the segment count follows the shapes drawn
    # samples_per_insert 2 with a buffer of 4: the served segments stay within 12 x 2 + 4
    assert 12 * 2 - 16 < served <= 12 * 2 + 4
    assert broker.status()["sampled_segments"] == served
    assert broker.sample(4, columns=(1 << 20) + 1).kind == "error"
    assert broker.status()["drops"].get("bad_value") == 1
    for w in workers.values():
        w.close()
    broker.stop()


def test_rate_limiter_samples_per_insert(start_broker) -> None:
    broker = start_broker("broker.mode=\"uniform\"", "broker.max_reuse=0", "broker.samples_per_insert=1.0",
                          "broker.spi_error_buffer=1.0", "broker.min_size=1")
    rng = np.random.default_rng(2)
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    w.segment(seg_arrays(rng))
    w.segment(seg_arrays(rng))
    broker.wait_for(lambda r: r["inserted_segments"] == 2, "inserts")
    # allowed iff samples + n <= inserts * 1.0 + 1.0 = 3
    for _ in range(3):
        assert broker.sample(1).kind == "batch"
    reply = broker.sample(1)
    assert reply.kind == "retry" and reply["reason"] == "rate_limited"
    w.segment(seg_arrays(rng))
    broker.wait_for(lambda r: r["inserted_segments"] == 3, "third insert")
    assert broker.sample(1).kind == "batch"
    assert broker.sample(1)["reason"] == "rate_limited"
    report = broker.status()
    assert report["retries"] == {"rate_limited": 2} and report["sampled_segments"] == 4
    w.close()
    broker.stop()


def test_max_reuse_priorities_and_max_staleness(start_broker) -> None:
    broker = start_broker("broker.mode=\"prioritized\"", "broker.max_reuse=2", "broker.min_size=1",
                          "broker.capacity=8", "broker.max_staleness=3")
    rng = np.random.default_rng(3)
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    segs = [w.segment(seg_arrays(rng, version=0)) for _ in range(2)]
    broker.wait_for(lambda r: r["inserted_segments"] == 2, "inserts")

    first = broker.sample(2, version=1)
    assert first.kind == "batch" and sorted(first["keys"]) == [0, 1]
    assert float(first.arrays["is_weight"].max()) == 1.0
    for b, k in enumerate(first["keys"]):
        assert_same_segment(first.arrays, first["columns"], b, segs[k].arrays)
    second = broker.sample(2, version=1, keys=first["keys"], prios=[0.5, 2.0])
    assert second.kind == "batch" and sorted(second["keys"]) == [0, 1]
    assert second["episodes"] == []  # not the first time these were sampled
    # max_reuse = 2: both are gone; a request with broken priorities is still answered, and counted
    reply = broker.sample(1, version=1, keys=second["keys"], prios=[float("nan"), 1.0])
    assert reply.kind == "retry" and reply["reason"] == "not_enough_data"
    assert broker.status()["drops"] == {"bad_value": 1}

    # max_staleness = 3: data acted by version 0 is dropped when the learner is at version 4
    w.segment(seg_arrays(rng, version=np.array([0, 4, 4, 4])))
    w.segment(seg_arrays(rng, version=4))
    broker.wait_for(lambda r: r["inserted_segments"] == 4, "more inserts")
    assert broker.sample(2, version=4)["reason"] == "not_enough_data"
    report = broker.status()
    assert report["drops"]["stale"] == 1 and report["fill"] == 1
    batch = broker.sample(1, version=4)
    assert batch.kind == "batch" and batch["keys"] == [3]
    w.close()
    broker.stop()


def test_sigterm_exits_cleanly_while_traffic_flows(start_broker) -> None:
    broker = start_broker("broker.capacity=4", "broker.max_reuse=1")
    rng = np.random.default_rng(4)
    w = Worker(broker.ctx, broker.ingest_port)
    w.sock.setsockopt(zmq.LINGER, 0)
    w.hello()
    for _ in range(20):
        w.segment(seg_arrays(rng))
    broker.wait_for(lambda r: r["inserted_segments"] == 20, "inserts")
    report = broker.status()
    assert report["fill"] == 4 and report["drops"] == {"evicted_unused": 16}
    assert report["insert_rate"] > 0 and report["workers"]["w0-test"]["rate"] > 0
    w.close()
    broker.stop()


@pytest.mark.parametrize("when_full", ["evict", "wait"])
def test_when_full_evicts_or_holds_back_ingest(start_broker, when_full: str) -> None:
    """A full store of never-sampled segments: ``evict`` overwrites and counts them; ``wait`` stops
    reading ingest (nothing lost, nothing evicted) until the learner samples, then takes the rest in order."""
    broker = start_broker('broker.mode="queue"', "broker.capacity=4", "broker.max_reuse=1",
                          f'broker.when_full="{when_full}"')
    rng = np.random.default_rng(3)
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    sent = [w.segment(seg_arrays(rng, version=0)) for _ in range(10)]
    if when_full == "evict":
        report = broker.wait_for(lambda r: r["inserted_segments"] == 10, "all 10 inserted")
        assert report["fill"] == 4 and report["drops"].get("evicted_unused") == 6
        batch = broker.sample(4)
        assert batch["seqs"] == [6, 7, 8, 9]  # the newest four: the oldest six were thrown away
    else:
        report = broker.wait_for(lambda r: r["inserted_segments"] == 4, "the store to fill")
        time.sleep(0.5)  # segments 4..9 wait in the sockets, not in the store
        report = broker.status()
        assert report["inserted_segments"] == 4 and report["fill"] == 4
        assert report["drops"].get("evicted_unused", 0) == 0
        seen = []
        for _ in range(2):
            batch = broker.sample(4)
            assert batch.kind == "batch"
            seen += batch["seqs"]
            broker.wait_for(lambda r: r["fill"] == 4 or r["inserted_segments"] == 10, "ingest to resume")
        last = broker.sample(2)
        seen += last["seqs"]
        assert seen == list(range(10))  # every segment, in order, none evicted
        assert_same_segment(last.arrays, last["columns"], 1, {k: v for k, v in sent[9].arrays.items()})
        assert broker.status()["drops"].get("evicted_unused", 0) == 0
    w.close()
    broker.stop()


def test_when_full_wait_never_holds_back_ingest_while_the_rate_limiter_refuses_the_learner() -> None:
    """Reverb's deadlock, refused by construction: with ``when_full = "wait"`` ingest pauses only while
    the learner could sample the batch size it asks for; when the limiter says "not yet", ingest goes on."""
    import structlog

    from zclaw.broker.server import Broker
    from zclaw.config import defaults

    cfg = defaults()
    cfg["broker"].update(capacity=4, when_full="wait", samples_per_insert=0.5, spi_error_buffer=1.0)
    broker = Broker(cfg, structlog.get_logger())
    rng = np.random.default_rng(4)
    broker.on_ingest(make("hello", role="worker", identity="w0", host="h", pid=1, zclaw=__version__,
                          spec=SPEC.to_dict(), segment_length=None))

    def insert(seq: int) -> None:
        broker.on_ingest(Segment("w0", seq, SPEC.hash, seg_arrays(rng), []).frames())

    for seq in range(4):
        assert broker.accepting()
        insert(seq)
    assert broker.store.fill == 4 and not broker.accepting()  # full of unsampled data, learner may sample 1
    batch_request = make("sample", batch_size=4, version=0, priority_keys=[], priorities=[])
    reply = parse(broker.on_request([b"learner", b""] + batch_request)[2:])
    assert reply.kind == "retry" and reply["reason"] == "rate_limited"  # 0 + 4 > 4 * 0.5 + 1
    assert broker.accepting()  # the learner cannot move: ingest must, or both wait for ever
    insert(4)
    insert(5)  # inserts 6: 6 * 0.5 + 1 = 4 allows the batch of 4 again
    assert not broker.accepting()
    reply = parse(broker.on_request([b"learner", b""] + batch_request)[2:])
    assert reply.kind == "batch" and reply["seqs"] == [2, 3, 4, 5]
    assert broker.accepting() and broker.store.drops["evicted_unused"] == 2
