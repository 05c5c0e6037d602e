"""TokenBucket: the arithmetic of its docstring, eviction, and refused arguments."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zclaw.tokens import TokenBucket


def test_burst_then_rate() -> None:
    tb = TokenBucket(rate=2.0, burst=3.0)
    assert [tb.take(b"a", 0.0) for _ in range(3)] == [None, None, None]
    wait = tb.take(b"a", 0.0)
    assert wait == pytest.approx(0.5)
    # another identity has its own bucket
    assert tb.take(b"b", 0.0) is None
    # half a second later one token is back, not two
    assert tb.take(b"a", 0.5) is None
    assert tb.take(b"a", 0.5) == pytest.approx(0.5)
    assert (tb.allowed, tb.refused) == (5, 2)


def test_clock_going_backwards_refills_nothing() -> None:
    tb = TokenBucket(rate=1.0, burst=1.0)
    assert tb.take(b"a", 10.0) is None
    assert tb.take(b"a", 5.0) == pytest.approx(1.0)
    assert tb.tokens(b"a", 5.0) == 0.0


def test_bounded_identities_evict_least_recent() -> None:
    tb = TokenBucket(rate=1.0, burst=1.0, max_identities=2)
    tb.take(b"a", 0.0)
    tb.take(b"b", 0.0)
    tb.take(b"a", 0.0)  # a asked last: b is the oldest
    tb.take(b"c", 0.0)
    assert len(tb) == 2 and tb.evicted == 1
    assert tb.tokens(b"b", 0.0) == 1.0  # forgotten: full again
    assert tb.tokens(b"a", 0.0) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0, "burst": 1},
        {"rate": -1, "burst": 1},
        {"rate": math.inf, "burst": 1},
        {"rate": math.nan, "burst": 1},
        {"rate": True, "burst": 1},
        {"rate": 1, "burst": 0.5},
        {"rate": 1, "burst": "2"},
        {"rate": 1, "burst": 1, "max_identities": 0},
        {"rate": 1, "burst": 1, "max_identities": 1.5},
    ],
)
def test_bad_arguments_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TokenBucket(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 100.0),
    burst=st.floats(1.0, 20.0),
    gaps=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=80),
)
def test_allowed_never_exceeds_burst_plus_rate_times_window(rate: float, burst: float, gaps: list) -> None:
    tb = TokenBucket(rate, burst)
    now = 0.0
    allowed = 0
    for gap in gaps:
        now += gap
        wait = tb.take(b"x", now)
        if wait is None:
            allowed += 1
        else:
            assert 0 < wait <= 1.0 / rate + 1e-9
    assert allowed <= burst + rate * now + 1e-6
