"""Broker store snapshots: state/restore round trip, atomic files, a real broker restored after SIGKILL."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
from support.logs import parse_lines
from support.peers import SPEC, T, N, Worker, seg_arrays
from support.procs import children
from support.synthetic import assert_same_segment, random_segment

from zclaw.broker import snapshot
from zclaw.broker.store import Store
from zclaw.wire import Segment, parse


def filled_store(mode: str = "prioritized", capacity: int = 8, inserts: int = 11, seed: int = 3) -> Store:
    rng = np.random.default_rng(seed)
    st = Store(SPEC, capacity, mode=mode, max_reuse=2, seed=seed)
    for i in range(inserts):
        seg = Segment(f"w{i % 3}", i, SPEC.hash, random_segment(SPEC, T, N, rng, version=i, M=i % 3),
                      [{"return": float(i), "length": 5}] if i % 2 else [])
        st.insert(parse(seg.frames()))
    b = st.sample(3, learner_version=11)
    assert b is not None
    if mode == "prioritized":
        st.update_priorities(b.keys, [0.5, 2.0, 7.0])
    return st


@pytest.mark.parametrize("mode", ["queue", "uniform", "prioritized"])
def test_state_restore_round_trip_samples_identically(tmp_path: Path, mode: str) -> None:
    st = filled_store(mode)
    path = tmp_path / "s" / "store.npz"
    path.parent.mkdir()
    arrays, meta = st.state()
    snapshot.write(path, arrays, meta)
    loaded = snapshot.load(path)
    assert loaded is not None
    back = Store(SPEC, 8, mode=mode, max_reuse=2, seed=99)  # another seed: the RNG state is restored too
    assert back.restore(*loaded) == st.fill == 8
    assert back.keys() == st.keys() and [back.uses(k) for k in back.keys()] == [st.uses(k) for k in st.keys()]
    assert (back.inserted, back.sampled, back.batches, dict(back.drops), back.lag_hist) == \
        (st.inserted, st.sampled, st.batches, dict(st.drops), st.lag_hist)
    if mode == "prioritized":
        assert [back.priority(k) for k in back.keys()] == [st.priority(k) for k in st.keys()]
    for _ in range(3):  # the restored store behaves exactly as the original from here on
        a, b = st.sample(2, 12), back.sample(2, 12)
        assert (a is None) == (b is None)
        if a is None:
            break
        assert a.keys == b.keys and a.workers == b.workers and a.seqs == b.seqs and a.episodes == b.episodes
        for name in a.arrays:
            assert a.arrays[name].tobytes() == b.arrays[name].tobytes(), name


def test_restore_refuses_another_spec_capacity_or_mode_and_changes_nothing(tmp_path: Path) -> None:
    arrays, meta = filled_store("uniform").state()
    for store in (Store(SPEC, 16, mode="uniform"), Store(SPEC, 8, mode="queue")):
        with pytest.raises(ValueError, match="capacity"):
            store.restore(arrays, meta)
        assert store.fill == 0 and store.T is None
    other = dict(meta, spec=dict(meta["spec"], env_id="test:Other-v0"))
    with pytest.raises(ValueError, match="spec"):
        Store(SPEC, 8, mode="uniform").restore(arrays, other)
    for keys in (np.full_like(arrays["key"], arrays["key"][0]), arrays["key"] + meta["next_key"]):
        bad = dict(arrays, key=keys)  # repeated keys; keys the store never handed out
        with pytest.raises(ValueError, match="keys"):
            Store(SPEC, 8, mode="uniform").restore(bad, meta)
    store = Store(SPEC, 8, mode="uniform")
    with pytest.raises(ValueError, match="worker_columns"):
        store.restore(arrays, dict(meta, worker_columns={"w0": "lots"}))
    assert store.fill == 0 and store.T is None


def test_restore_keeps_each_workers_eviction_counts_and_reads_format_2(tmp_path: Path) -> None:
    """Fair eviction's per-worker counts survive a snapshot, so the restored store evicts as the original
    would; a format 2 snapshot (no counts) restores with the stored segments counted as sent."""
    st = filled_store("queue", inserts=20)
    arrays, meta = st.state()
    # 12 of the 20 were evicted before any was sampled
    assert sum(lost for _, lost in meta["worker_columns"].values()) > 0
    back = Store(SPEC, 8, mode="queue", max_reuse=2)
    back.restore(arrays, meta)
    assert back.state()[1]["worker_columns"] == meta["worker_columns"]
    rng = np.random.default_rng(5)
    for i in range(20, 30):  # further inserts from one worker: both stores pick the same victims
        for store in (st, back):
            seg = Segment("w0", i, SPEC.hash, random_segment(SPEC, T, N, rng, version=i), [])
            store.insert(parse(seg.frames()))
        assert back.keys() == st.keys()
    old = {k: v for k, v in meta.items() if k != "worker_columns"}
    two = Store(SPEC, 8, mode="queue", max_reuse=2)
    assert two.restore(arrays, old) == 8
    counted = two.state()[1]["worker_columns"]
    assert sum(sent for sent, _ in counted.values()) == 8 * N
    assert all(lost == 0 for _, lost in counted.values())


def test_snapshot_file_is_atomic_and_crash_leftovers_are_cleared(tmp_path: Path) -> None:
    path = tmp_path / "store.npz"
    st = filled_store("queue")
    snapshot.write(path, *st.state())
    before = path.read_bytes()
    stale = tmp_path / ".store.npz.abc123.tmp"  # what a writer killed mid-write leaves
    stale.write_bytes(b"half a file")
    with pytest.raises(ValueError):  # a failing writer leaves the previous snapshot as it was
        snapshot.write(path, {"x": object()}, {})  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert snapshot.load(path) is not None and not stale.exists()
    assert not list(tmp_path.glob(".store.npz.*"))
    path.write_bytes(b"not an npz")
    with pytest.raises(snapshot.SnapshotError):
        snapshot.load(path)


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_broker_snapshots_while_ingesting_and_restores_after_sigkill(
    start_broker, tmp_path: Path, mode: str
) -> None:
    run_dir = tmp_path / "run"
    opts = ("broker.capacity=32", "broker.snapshot_s=0.3", "broker.max_reuse=1",
            f"broker.snapshot_mode={mode}")
    broker = start_broker(*opts, extra_args=("--run-dir", str(run_dir)))
    rng = np.random.default_rng(0)
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    sent = [w.segment(seg_arrays(rng, version=i), episodes=[{"return": -1.0 * i, "length": 4}])
            for i in range(6)]
    broker.wait_for(lambda r: r["inserted_segments"] == 6, "inserts")
    batch = broker.sample(1)  # one sampled and removed (max_reuse 1): the snapshot must remember that
    assert batch.kind == "batch" and batch["seqs"] == [0]
    # the snapshot that holds the sample too (a slow host may still be writing one from before it)
    rep = broker.wait_for(lambda r: r["snapshot"]["current"] and not r["snapshot"]["in_progress"]
                          and r["snapshot"]["age_s"] is not None, "a current snapshot", timeout_s=30)
    assert not children(broker.proc.pid), "no snapshot child is left (fork mode reaps it)"
    ports = (broker.ingest_port, broker.serve_port)
    w.close()
    broker.kill()  # SIGKILL: no final snapshot, the periodic one is all there is

    again = start_broker(*opts, ports=ports, extra_args=("--run-dir", str(run_dir)))
    rep = again.status()
    assert rep["spec"] == SPEC.to_dict(), "the env spec comes back with the snapshot, before any hello"
    assert (rep["inserted_segments"], rep["sampled_segments"], rep["fill"]) == (6, 1, 5)
    assert rep["episodes"] == 6
    restored = [e for e in parse_lines(again.output()) if e.get("event") == "restored snapshot"]
    assert restored and restored[0]["segments"] == 5
    w2 = Worker(again.ctx, again.ingest_port, identity="w1-new")  # no hello: the spec is already known
    later = w2.segment(seg_arrays(rng, version=9))
    again.wait_for(lambda r: r["inserted_segments"] == 7, "insert after restore")
    batch = again.sample(6, version=9)
    assert batch.kind == "batch", batch.header
    assert batch["seqs"] == [1, 2, 3, 4, 5, 0] and batch["workers"][-1] == "w1-new"
    for b, seg in enumerate(sent[1:] + [later]):
        assert_same_segment(batch.arrays, batch["columns"], b, seg.arrays)
    w2.close()

    t0 = time.monotonic()
    again.proc.send_signal(signal.SIGTERM)
    assert again.proc.wait(10) == 0
    assert time.monotonic() - t0 < 10
    final = [e for e in parse_lines(again.output()) if e.get("event") == "final snapshot"]
    # "current": a periodic snapshot (every 0.3 s) after the last sample already holds this state
    assert final and final[0]["outcome"] in ("written", "current"), final
    loaded = snapshot.load(snapshot.snapshot_path(run_dir))
    assert loaded is not None and loaded[1]["store"]["sampled"] == 7 and len(loaded[0]["slot"]) == 0


def test_broker_with_snapshots_off_writes_only_the_final_one(start_broker, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    broker = start_broker("broker.snapshot_s=0", extra_args=("--run-dir", str(run_dir)))
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    w.segment(seg_arrays(np.random.default_rng(1)))
    broker.wait_for(lambda r: r["inserted_segments"] == 1, "insert")
    path = snapshot.snapshot_path(run_dir)
    time.sleep(0.5)
    assert not path.exists()
    w.close()
    broker.stop()
    arrays, meta = snapshot.load(path)
    assert len(arrays["slot"]) == 1 and meta["store"]["inserted"] == 1


def test_fresh_broker_ignores_the_snapshot_and_a_restored_one_reports_what_it_brought(
    start_broker, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    broker = start_broker("broker.snapshot_s=0", extra_args=("--run-dir", str(run_dir)))
    w = Worker(broker.ctx, broker.ingest_port)
    w.hello()
    for i in range(3):
        w.segment(seg_arrays(np.random.default_rng(i)), episodes=[{"return": 1.0, "length": 2}])
    broker.wait_for(lambda r: r["inserted_segments"] == 3, "inserts")
    assert broker.status()["restored"] is None
    w.close()
    broker.stop()
    again = start_broker(extra_args=("--run-dir", str(run_dir)))
    assert again.status()["restored"] == {"segments": 3, "inserted_segments": 3, "inserted_steps": 3 * T * N,
                                          "episodes": 3}
    again.stop()
    other = start_broker("broker.capacity=7", extra_args=("--run-dir", str(run_dir)))  # does not fit
    assert other.status()["restored"] is None and other.status()["fill"] == 0
    assert "snapshot not restored" in other.output()
    path = snapshot.snapshot_path(run_dir)
    assert not path.exists() and path.with_name("store.npz.rejected").exists(), "kept aside, not overwritten"
    other.stop()
    path.with_name("store.npz.rejected").replace(path)
    fresh = start_broker(extra_args=("--run-dir", str(run_dir), "--fresh"))
    rep = fresh.status()
    assert rep["inserted_segments"] == 0 and rep["spec"] is None and rep["restored"] is None
    assert "starting with an empty store (--fresh)" in fresh.output()
    fresh.stop()
