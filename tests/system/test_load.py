"""Load: 32 synthetic workers flood a real broker while a learner samples; memory stays bounded and the
overflow is counted, segment for segment (figures: ``bench/load.py``; no timing is asserted here)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.procs import BrokerProc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import load as load_bench  # noqa: E402

pytestmark = pytest.mark.slow


def test_32_workers_flooding_the_broker_stay_within_memory_and_every_segment_is_accounted_for() -> None:
    broker = BrokerProc('broker.mode="queue"', "broker.capacity=128", "broker.max_reuse=1", "log.status_s=30")
    try:
        r = load_bench.run(broker.ingest_port, broker.serve_port, broker.proc.pid, seconds=3.0, workers=32)
        assert broker.proc.poll() is None, broker.output()
        drops = r["drops"]
        evicted = drops.pop("evicted_unused", 0)
        assert r["sent"] > r["capacity"] and r["inserted"] == r["sent"], "PUSH/PULL loses nothing"
        assert drops == {}, drops
        assert evicted > 0, "the learner is slower than 32 workers: the ring must overflow, and count it"
        assert r["inserted"] == r["sampled"] + r["fill"] + evicted, "every segment sampled, stored or counted"
        assert r["fill"] == r["capacity"] and r["batches"] > 0
        assert r["rss_max_mib"] < r["rss_bound_mib"], r
        broker.stop()
    finally:
        broker.kill()
