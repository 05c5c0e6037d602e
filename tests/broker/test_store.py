"""Store: ring, keys, modes, reuse, staleness, priorities; property-based where a rule is general."""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
from support.synthetic import assert_same_segment, random_segment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zclaw.broker import Store
from zclaw.broker.store import MIN_PRIORITY, SampledBatch, lag_buckets
from zclaw.broker.sumtree import SumTree
from zclaw.wire.messages import EnvSpec, Segment, parse
from zclaw.wire.protocol import Message, WireError

SPEC = EnvSpec("test:Dummy-v0", (3,), (2,), (-1.0, -1.0), (1.0, 1.0))


def seg_arrays(
    T: int, N: int, rng: np.random.Generator, version: Any = 0, M: int = 0
) -> Dict[str, np.ndarray]:
    """Random arrays in the SEGMENT_ARRAYS layout (plus M truncation rows)."""
    return random_segment(SPEC, T, N, rng, version=version, M=M, options=4)


def seg_msg(arrays: Dict[str, np.ndarray], seq: int = 0, worker: str = "w0", episodes: Optional[list] = None,
            spec_hash: Optional[str] = None) -> Message:
    seg = Segment(worker, seq, spec_hash or SPEC.hash, arrays, episodes or [])
    return parse(seg.frames(), ["segment"])


def assert_segment_equal(batch: SampledBatch, b: int, arrays: Dict[str, np.ndarray]) -> None:
    assert_same_segment(batch.arrays, batch.columns, b, arrays)


# ------------------------------------------------------------------------------------- unit tests


def test_segment_comes_back_bit_for_bit_with_truncation_rows() -> None:
    rng = np.random.default_rng(0)
    store = Store(SPEC, capacity=4, mode="queue", max_reuse=1)
    segs = [seg_arrays(5, n, rng, version=7, M=m) for n, m in ((3, 2), (1, 0), (4, 3))]  # workers differ in N
    eps = [[{"return": 1.5, "length": 9, "success": True}], [], [{"return": -2.0, "length": 4}]]
    for i, (a, e) in enumerate(zip(segs, eps)):
        assert store.insert(seg_msg(a, seq=10 + i, worker=f"w{i}", episodes=e)) == i
    batch = store.sample(3, learner_version=7)
    assert batch is not None
    assert batch.keys == [0, 1, 2] and batch.seqs == [10, 11, 12] and batch.workers == ["w0", "w1", "w2"]
    for b, a in enumerate(segs):
        assert_segment_equal(batch, b, a)
    assert batch.columns == [3, 1, 4] and batch.arrays["obs"].shape == (6, 8, 3)
    assert batch.arrays["final_at"].shape == (5, 2) and batch.arrays["final_obs"].shape == (5, 3)
    assert batch.arrays["is_weight"].dtype == np.float32 and (batch.arrays["is_weight"] == 1).all()
    assert batch.episodes == eps[0] + eps[2]
    assert batch.lag_hist["0"] == 5 * (3 + 1 + 4) and store.fill == 0


def test_arrays_are_copies_not_views_of_the_ring() -> None:
    rng = np.random.default_rng(1)
    store = Store(SPEC, capacity=1, mode="uniform", max_reuse=0)
    a = seg_arrays(2, 2, rng)
    store.insert(seg_msg(a))
    batch = store.sample(1, 0)
    store.insert(seg_msg(seg_arrays(2, 2, rng), seq=1))  # overwrites the only slot
    assert_segment_equal(batch, 0, a)


def test_bad_segments_raise_and_leave_stored_data_alone() -> None:
    rng = np.random.default_rng(2)
    store = Store(SPEC, capacity=4, mode="uniform", max_reuse=0)
    good = seg_arrays(4, 2, rng)
    store.insert(seg_msg(good))
    other_T = seg_arrays(5, 2, rng)
    with pytest.raises(WireError) as exc:
        store.insert(seg_msg(other_T))
    assert exc.value.cause == "bad_shape"
    with pytest.raises(WireError) as exc:
        store.insert(seg_msg(seg_arrays(4, 2, rng), spec_hash="0" * 16))
    assert exc.value.cause == "bad_spec"
    assert store.fill == 1 and store.inserted == 1
    batch = store.sample(1, 0)
    assert_segment_equal(batch, 0, good)


def test_full_ring_evicts_oldest_and_counts_unused() -> None:
    rng = np.random.default_rng(3)
    store = Store(SPEC, capacity=3, mode="queue", max_reuse=2)
    for i in range(3):
        store.insert(seg_msg(seg_arrays(2, 1, rng), seq=i))
    store.sample(1, 0)  # key 0 used once
    store.insert(seg_msg(seg_arrays(2, 1, rng), seq=3))  # evicts key 0 (used): not counted
    store.insert(seg_msg(seg_arrays(2, 1, rng), seq=4))  # evicts key 1 (unused)
    assert store.keys() == [2, 3, 4]
    assert store.drops["evicted_unused"] == 1


def test_stale_segments_are_dropped_at_sample_time() -> None:
    rng = np.random.default_rng(4)
    store = Store(SPEC, capacity=8, mode="uniform", max_reuse=0, max_staleness=2)
    versions = [np.array([0, 5]), np.array([3, 4]), np.array([5, 5])]  # min versions 0, 3, 5
    for i, v in enumerate(versions):
        store.insert(seg_msg(seg_arrays(2, 1, rng, version=v), seq=i))
    assert store.sample(3, learner_version=2) is not None  # lags 2, -1, -3: all kept
    assert store.drops["stale"] == 0
    assert store.sample(3, learner_version=5) is None  # lag of key 0 is 5 > 2: dropped
    assert store.last_reason == "not_enough_data" and store.drops["stale"] == 1
    batch = store.sample(2, learner_version=5)
    assert sorted(batch.keys) == [1, 2]
    assert store.sample(1, learner_version=8) is None and store.drops["stale"] == 3


def test_lag_histogram_buckets() -> None:
    lags = np.array([-3, 0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 1000])
    assert lag_buckets(lags) == {"0": 2, "1": 1, "2": 1, "3-4": 2, "5-8": 2, "9-16": 2, "17+": 2}
    rng = np.random.default_rng(5)
    store = Store(SPEC, capacity=2, mode="queue", max_reuse=1)
    store.insert(seg_msg(seg_arrays(3, 4, rng, version=np.array([0, 6, 10]))))
    store.sample(1, learner_version=10)  # step lags 10, 4, 0, each x 4 envs
    assert store.lag_hist == {"0": 4, "1": 0, "2": 0, "3-4": 4, "5-8": 0, "9-16": 4, "17+": 0}


def test_update_priorities_validates_and_ignores_unknown_keys() -> None:
    rng = np.random.default_rng(6)
    store = Store(SPEC, capacity=2, mode="prioritized", max_reuse=0, alpha=1.0)
    for i in range(3):
        store.insert(seg_msg(seg_arrays(2, 1, rng), seq=i))  # key 0 evicted by key 2
    assert store.priority(1) == pytest.approx(1.0)  # entered with the max priority seen (1 at start)
    for bad in ([float("nan")], [float("inf")], [-0.5], ["x"], [True]):
        with pytest.raises(ValueError):
            store.update_priorities([1], bad)
    with pytest.raises(ValueError):
        store.update_priorities([1, 2], [1.0, float("nan")])  # all or nothing
    with pytest.raises(ValueError):
        store.update_priorities([1], [1.0, 2.0])
    with pytest.raises(ValueError):
        store.update_priorities(["1"], [1.0])
    assert store.priority(1) == pytest.approx(1.0) and store.priority(2) == pytest.approx(1.0)
    assert store.update_priorities([0, 1, 99, -1], [5.0, 3.0, 7.0, 2.0]) == 1  # keys 0, 99, -1 not stored
    assert store.priority(1) == pytest.approx(3.0) and store.priority(2) == pytest.approx(1.0)
    store.insert(seg_msg(seg_arrays(2, 1, rng), seq=3))  # new: max priority seen is 3
    assert store.priority(3) == pytest.approx(3.0)
    store.update_priorities([3], [0.0])
    assert store.priority(3) == pytest.approx(MIN_PRIORITY)


def test_importance_weights() -> None:
    rng = np.random.default_rng(7)
    store = Store(SPEC, capacity=2, mode="prioritized", max_reuse=0, alpha=1.0, beta=0.5)
    for i in range(2):
        store.insert(seg_msg(seg_arrays(2, 1, rng), seq=i))
    store.update_priorities([0, 1], [1.0, 3.0])
    batch = store.sample(2, 0)
    w = dict(zip(batch.keys, batch.arrays["is_weight"]))
    # w_i = (N P_i)^-beta / max: P = (1/4, 3/4) -> (2 * 1/4)^-0.5 = sqrt 2, (2 * 3/4)^-0.5; the rarer gets 1
    assert w[0] == pytest.approx(1.0)
    assert w[1] == pytest.approx((1.5 ** -0.5) / (0.5 ** -0.5))


def test_a_batch_sized_in_columns_keeps_whole_segments_in_draw_order_until_the_target() -> None:
    """Queue mode draws oldest first: 8 + 8 + 16 = 32 < 40, + 64 reaches it, so four segments (96 columns)
    are served, the fifth is not; the next batch starts where this one stopped."""
    rng = np.random.default_rng(3)
    store = Store(SPEC, capacity=8, mode="queue", max_reuse=1)
    for i, n in enumerate((8, 8, 16, 64, 8, 8)):
        store.insert(seg_msg(seg_arrays(4, n, rng), seq=i, worker=f"w{n}"))
    batch = store.sample(64, learner_version=0, columns=40)
    assert batch is not None and batch.keys == [0, 1, 2, 3] and batch.columns == [8, 8, 16, 64]
    assert batch.arrays["obs"].shape == (5, 96, 3) and len(batch.arrays["is_weight"]) == 4
    assert store.fill == 2
    # 16 columns left, fewer than 40 and fewer segments than the 64 allowed: not enough data, nothing used
    assert store.sample(64, learner_version=0, columns=40) is None and store.last_reason == "not_enough_data"
    assert store.fill == 2
    # with at most 2 segments allowed they are served even short of the target
    batch = store.sample(2, learner_version=0, columns=40)
    assert batch is not None and batch.columns == [8, 8]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["uniform", "prioritized", "queue"]),
    envs=st.lists(st.sampled_from([1, 2, 8, 16, 64]), min_size=1, max_size=12),
    target=st.integers(1, 300),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_a_column_sized_batch_is_the_shortest_draw_that_reaches_its_target(
        mode: str, envs: List[int], target: int, n: int, seed: int) -> None:
    """In every mode: the batch is served exactly when the store could fill it, holds at most ``n``
    segments, and drops its last segment only by falling short of the target (or hitting ``n``)."""
    rng = np.random.default_rng(seed)
    store = Store(SPEC, capacity=16, mode=mode, max_reuse=1, alpha=0.6, beta=0.4, seed=seed)
    for i, N in enumerate(envs):
        store.insert(seg_msg(seg_arrays(2, N, rng), seq=i))
    batch = store.sample(n, learner_version=0, columns=target)
    if len(envs) < n and sum(envs) < target:
        assert batch is None and store.last_reason == "not_enough_data"
        return
    assert batch is not None
    cols = batch.columns
    assert 1 <= len(cols) <= n and len(set(batch.keys)) == len(cols)
    assert sum(cols[:-1]) < target  # without its last segment the batch would fall short
    assert sum(cols) >= target or len(cols) == min(n, len(envs))
    assert batch.arrays["obs"].shape[1] == sum(cols)
    w = batch.arrays["is_weight"]
    assert len(w) == len(cols) and w.max() == pytest.approx(1.0) and (w > 0).all()


def test_column_target_zero_is_the_segment_count_and_bad_targets_are_refused() -> None:
    rng = np.random.default_rng(4)
    store = Store(SPEC, capacity=4, mode="uniform", max_reuse=0, seed=1)
    for i, N in enumerate((2, 64, 2)):
        store.insert(seg_msg(seg_arrays(2, N, rng), seq=i))
    assert all(len(store.sample(2, 0, columns=0).columns) == 2 for _ in range(20))  # whatever their columns
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="columns"):
            store.sample(2, 0, columns=bad)


def test_constructor_refuses_bad_arguments_quoting_them() -> None:
    with pytest.raises(ValueError, match="max_reuse = 0"):
        Store(SPEC, 4, mode="queue", max_reuse=0)
    with pytest.raises(ValueError, match="'fifo'"):
        Store(SPEC, 4, mode="fifo")
    with pytest.raises(ValueError, match="capacity = 0"):
        Store(SPEC, 0)
    with pytest.raises(ValueError, match="max_staleness = -2"):
        Store(SPEC, 4, max_staleness=-2)
    with pytest.raises(ValueError, match="alpha = 1.5"):
        Store(SPEC, 4, mode="prioritized", alpha=1.5)


# -------------------------------------------------------------------------------- property tests

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 3)),  # number of truncation rows
        st.tuples(st.just("sample"), st.integers(1, 5)),
        st.tuples(st.just("prio"), st.lists(st.floats(0, 100), min_size=1, max_size=4)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 6),
    mode=st.sampled_from(["queue", "uniform", "prioritized"]),
    max_reuse=st.integers(0, 3),
    ops=OPS,
    seed=st.integers(0, 2**16),
)
def test_store_invariants(capacity: int, mode: str, max_reuse: int, ops: list, seed: int) -> None:
    """Fill <= capacity; stored keys follow the eviction and reuse model; queue is FIFO; batch keys unique;
    no key sampled more than max_reuse times; data back bit-for-bit; episodes reported once."""
    if mode == "queue" and max_reuse == 0:
        max_reuse = 1
    rng = np.random.default_rng(seed)
    store = Store(SPEC, capacity, mode=mode, max_reuse=max_reuse, seed=seed)
    originals: Dict[int, Dict[str, np.ndarray]] = {}
    model: List[int] = []  # keys that should be stored, oldest first
    uses: Counter = Counter()
    episodes_seen: Counter = Counter()
    next_key = 0
    for op, arg in ops:
        if op == "insert":
            a = seg_arrays(2, 2, rng, M=arg)
            key = store.insert(seg_msg(a, seq=next_key, episodes=[{"return": float(next_key), "length": 1}]))
            assert key == next_key
            originals[key] = a
            # a full store overwrites its oldest (one worker: fair eviction is the ring's); a free slot, one
            # that a sample emptied, is filled first, whatever key held it
            model = (model[1:] if len(model) == capacity else model) + [key]
            next_key += 1
        elif op == "sample":
            before = list(model)
            batch = store.sample(arg, learner_version=0)
            if len(before) < arg:
                assert batch is None and store.last_reason == "not_enough_data"
                continue
            assert batch is not None
            assert len(set(batch.keys)) == len(batch.keys) == arg
            assert set(batch.keys) <= set(before)
            if mode == "queue":
                assert batch.keys == before[:arg]
            for b, k in enumerate(batch.keys):
                assert_segment_equal(batch, b, originals[k])
                uses[k] += 1
                if max_reuse:
                    assert uses[k] <= max_reuse
            for ep in batch.episodes:
                episodes_seen[int(ep["return"])] += 1
            firsts = sorted(k for k in batch.keys if uses[k] == 1)
            assert sorted(int(ep["return"]) for ep in batch.episodes) == firsts
            if max_reuse:
                model = [k for k in model if uses[k] < max_reuse]
        else:
            keys = [int(rng.integers(0, next_key + 2)) for _ in arg]
            store.update_priorities(keys, arg)
        assert 0 <= store.fill <= capacity
        assert store.keys() == model
    assert all(c == 1 for c in episodes_seen.values())


@settings(max_examples=8, deadline=None)
@given(
    priorities=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=5),
    alpha=st.sampled_from([0.5, 1.0]),
    seed=st.integers(0, 1000),
)
def test_prioritized_frequencies_follow_priorities(priorities: List[float], alpha: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = Store(SPEC, capacity=len(priorities), mode="prioritized", max_reuse=0, alpha=alpha, seed=seed)
    for i in range(len(priorities)):
        store.insert(seg_msg(seg_arrays(1, 1, rng), seq=i))
    store.update_priorities(list(range(len(priorities))), priorities)
    draws = 3000
    counts = Counter()
    for _ in range(draws):
        counts[store.sample(1, 0).keys[0]] += 1
    p = np.asarray(priorities) ** alpha
    expected = p / p.sum()
    freq = np.array([counts[i] / draws for i in range(len(priorities))])
    # 3000 draws: the standard error of a frequency is <= 0.0092; 0.04 is over 4 sigma
    assert np.abs(freq - expected).max() < 0.04, (freq, expected)


@settings(max_examples=50, deadline=None)
@given(
    capacity=st.integers(1, 40),
    updates=st.lists(st.tuples(st.integers(0, 39), st.floats(0, 1e6)), max_size=200),
)
def test_sum_tree_total_equals_sum_of_leaves(capacity: int, updates: list) -> None:
    tree = SumTree(capacity)
    leaves = np.zeros(capacity)
    for idx, v in updates:
        idx %= capacity
        tree.update(idx, v)
        leaves[idx] = v
    assert tree.total == pytest.approx(leaves.sum(), rel=1e-12, abs=1e-9)
    assert np.array_equal(tree.values(), leaves)
    if leaves.sum() > 0:
        for u in np.linspace(0, tree.total, 17, endpoint=False):
            assert leaves[tree.find(u)] > 0


@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(1, 8),
    alpha=st.floats(0, 1),
    prios=st.lists(st.tuples(st.integers(0, 20), st.floats(0, 50)), max_size=30),
)
def test_store_tree_total_equals_sum_of_stored_priorities(capacity: int, alpha: float, prios: list) -> None:
    rng = np.random.default_rng(0)
    store = Store(SPEC, capacity, mode="prioritized", max_reuse=0, alpha=alpha)
    expected: Dict[int, float] = {}
    for i in range(12):
        key = store.insert(seg_msg(seg_arrays(1, 1, rng), seq=i))
        expected[key] = max(store.max_priority, MIN_PRIORITY) ** alpha
        for k, v in prios[i::12]:
            if store.update_priorities([k], [v]) == 1:
                expected[k] = max(v, MIN_PRIORITY) ** alpha
    stored = store.keys()
    assert store.tree_total() == pytest.approx(sum(expected[k] for k in stored), rel=1e-9)
    for k in stored:
        assert store.priority(k) == pytest.approx(expected[k])
