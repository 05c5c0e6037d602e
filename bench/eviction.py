"""What fair eviction costs the broker: insert time into a full store, ``fair`` against ``oldest``.

A store of ``capacity`` segments (T 64 x N 16, bench/pipeline.py's arrays) is kept full by
``workers`` workers sending in turn, while a learner takes a 64-column queue batch (4 segments) every eighth
insert (so half of what arrives is evicted). Each (capacity, workers) cell times the same stream of inserts
with each policy, rounds alternating, and prints the median microseconds per insert and the ratio fair /
oldest. The segments are parsed once and reused: the time is the store's alone, not the wire's.

    python bench/eviction.py [--rounds 3] [--inserts 4000] [--capacities 64,1024,8192] [--workers 3,64,1024]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import SPEC, segment_arrays  # noqa: E402 (bench/ is on sys.path when run)

from zclaw.broker import Store  # noqa: E402
from zclaw.wire.messages import Message, Segment, parse  # noqa: E402

T, N = 64, 16


def segments(workers: int) -> List[Message]:
    """One parsed segment per worker identity; the stream sends them in turn (the store only reads them)."""
    arrays = segment_arrays(T, N)
    return [parse(Segment(f"w{i}", i, SPEC.hash, arrays, []).frames(), ["segment"]) for i in range(workers)]


def one(policy: str, capacity: int, msgs: List[Message], inserts: int) -> float:
    """Microseconds per insert, the store full from the start."""
    store = Store(SPEC, capacity, mode="queue", max_reuse=1, eviction=policy)
    for i in range(capacity):
        store.insert(msgs[i % len(msgs)])
    t0 = time.perf_counter()
    for i in range(inserts):
        store.insert(msgs[(capacity + i) % len(msgs)])
        if i % 8 == 7:
            store.sample(64, 0, columns=64)
    return (time.perf_counter() - t0) / inserts * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inserts", type=int, default=4000, help="timed inserts per run")
    ap.add_argument("--capacities", default="64,1024,8192", help="store sizes, in segments")
    ap.add_argument("--workers", default="3,64,1024", help="worker identities sending in turn")
    a = ap.parse_args()
    print("| capacity | workers | oldest, us/insert | fair, us/insert | fair / oldest |")
    print("|---|---|---|---|---|")
    for capacity in (int(x) for x in a.capacities.split(",")):
        for workers in (int(x) for x in a.workers.split(",")):
            msgs = segments(workers)
            times = {"oldest": [], "fair": []}
            for r in range(a.rounds):
                for policy in (("oldest", "fair") if r % 2 == 0 else ("fair", "oldest")):
                    times[policy].append(one(policy, capacity, msgs, a.inserts))
            old, fair = statistics.median(times["oldest"]), statistics.median(times["fair"])
            print(f"| {capacity} | {workers} | {old:.1f} | {fair:.1f} | {fair / old:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
