"""Fair eviction: a full store loses every worker's data in proportion to what it sent, whatever its shape."""
from __future__ import annotations

from collections import Counter
from typing import Dict, Tuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.synthetic import random_segment

from zclaw.broker import Store
from zclaw.broker import eviction as eviction_mod
from zclaw.broker.eviction import Eviction
from zclaw.wire.messages import EnvSpec, Segment, parse

SPEC = EnvSpec("test:Dummy-v0", (3,), (2,), (-1.0, -1.0), (1.0, 1.0))


def insert(store: Store, worker: str, envs: int, seq: int, rng: np.random.Generator) -> int:
    arrays = random_segment(SPEC, 2, envs, rng)
    return store.insert(parse(Segment(worker, seq, SPEC.hash, arrays, []).frames(), ["segment"]))


def test_victim_is_the_oldest_of_the_worker_that_lost_least_and_ties_go_to_the_oldest() -> None:
    stored = {0, 1, 2, 3}.__contains__
    ev = Eviction("fair")
    for key, worker in enumerate(("a", "b", "a", "b")):
        ev.inserted(worker, key, 10, stored)
    assert ev.victim(0, stored) == 0  # nobody lost anything: the oldest, as a ring would
    ev.evicted("a", 10, unused=True)  # a lost 10 of 20
    assert ev.victim(0, stored) == 1  # b's oldest, although a's key 0 is older
    ev.evicted("b", 10, unused=False)  # a segment already trained on is no loss
    assert ev.victim(0, stored) == 1
    assert Eviction("oldest").victim(7, stored) == 7
    with pytest.raises(ValueError, match="'lru'"):
        Eviction("lru")


def test_consumed_keys_are_skipped_and_identities_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    live = {5}
    ev = Eviction("fair")
    ev.inserted("a", 4, 8, live.__contains__)
    ev.inserted("a", 5, 8, live.__contains__)
    ev.inserted("b", 3, 8, live.__contains__)
    ev.evicted("b", 8, unused=True)
    assert ev.victim(5, live.__contains__) == 5  # key 4 was consumed, b holds nothing: a's key 5
    ev.inserted("c", 6, 8, live.__contains__)
    monkeypatch.setattr(eviction_mod, "MAX_WORKERS", 3)
    live.add(7)
    ev.inserted("d", 7, 8, live.__contains__)
    # a still holds key 5, so the least recently seen identity with nothing stored, b, is forgotten
    assert list(ev.columns) == ["a", "c", "d"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "insert", "sample", "evict"]), st.integers(0, 5),
                          st.sampled_from([1, 8, 64]), st.integers(0, 10**6)), max_size=120))
def test_the_heap_picks_what_a_scan_of_every_worker_picks(ops) -> None:
    """The lazy heap's victim is the minimum of (lost/sent, oldest stored key) over the workers holding
    something, after any mix of inserts, samples (a stored key vanishes) and evictions."""
    live: Dict[int, str] = {}
    sent: Counter = Counter()
    lost: Counter = Counter()
    ev = Eviction("fair")
    next_key = 0
    for op, w, cols, pick in ops:
        worker = f"w{w}"
        if op == "insert":
            live[next_key] = worker
            sent[worker] += cols
            ev.inserted(worker, next_key, cols, live.__contains__)
            next_key += 1
        elif live and op == "sample":
            del live[sorted(live)[pick % len(live)]]
        elif live:
            oldest = {}
            for k in sorted(live):
                oldest.setdefault(live[k], k)
            expect = min((lost[x] / max(sent[x], 1), k) for x, k in oldest.items())[1]
            assert ev.victim(min(live), live.__contains__) == expect
            victim = live.pop(expect)
            lost[victim] += cols  # the size is irrelevant to the rule: any positive loss
            ev.evicted(victim, cols, unused=True)


Shares = Dict[str, float]


def feed(eviction: str, seed: int = 0, seconds: float = 600.0) -> Tuple[Shares, Shares, float]:
    """Workers of 8, 16 and 64 envs sending at steady periods (+-20 %) into a store of 64 segments
    served as 64-column queue batches at a rate that leaves about a third of the data unused; returns
    each worker's share of the columns sent, of those trained on, and the share evicted."""
    rng = np.random.default_rng(seed)
    shapes = {"w8": 8, "w16": 16, "w64": 64}
    period = {"w8": 1 / 3.0, "w16": 1 / 2.06, "w64": 1 / 0.67}  # 24 / 33 / 43 % of the columns
    store = Store(SPEC, capacity=64, mode="queue", max_reuse=1, eviction=eviction)
    due = {w: float(rng.uniform(0, p)) for w, p in period.items()}
    next_batch, t, seq = 1.0, 0.0, 0
    sent: Counter = Counter()
    trained: Counter = Counter()
    while t < seconds:
        w = min(due, key=due.__getitem__)
        if due[w] < next_batch:
            t = due[w]
            due[w] += period[w] * float(rng.uniform(0.8, 1.2))
            insert(store, w, shapes[w], seq, rng)
            seq += 1
            sent[w] += shapes[w]
        else:
            t, next_batch = next_batch, next_batch + float(rng.exponential(1 / 0.9))
            batch = store.sample(64, learner_version=0, columns=64)
            for who, cols in zip(batch.workers if batch else [], batch.columns if batch else []):
                trained[who] += cols
    total_sent, total_trained = sum(sent.values()), sum(trained.values())
    return ({w: sent[w] / total_sent for w in shapes}, {w: trained[w] / total_trained for w in shapes},
            1 - total_trained / total_sent)


def test_fair_eviction_trains_on_every_shape_in_proportion_to_what_it_sent() -> None:
    """The mixed-shape skew (docs/benchmarks.md) reproduced on the real store: with the oldest segment
    evicted, the 64-env worker's share of the training data is over its share of what was sent; with
    fair eviction every worker's shares agree, at the same fraction evicted."""
    sent, trained, evicted = feed("oldest")
    assert 0.2 < evicted < 0.5
    assert trained["w64"] - sent["w64"] > 0.01
    sent, trained, evicted_fair = feed("fair")
    assert abs(evicted_fair - evicted) < 0.05
    for w in sent:
        assert trained[w] == pytest.approx(sent[w], abs=0.005), (w, sent, trained)
