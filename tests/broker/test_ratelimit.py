"""SampleToInsertRatio: the arithmetic of its docstring, argument checks and refused configurations."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zclaw.broker import SampleToInsertRatio


def test_min_size_gates_everything_until_reached() -> None:
    rl = SampleToInsertRatio(0.0, min_size=3, error_buffer=0.0)
    assert rl.can_sample(1) == "min_size"
    rl.on_insert(2)
    assert rl.can_sample(1) == "min_size"
    rl.on_insert()
    assert rl.can_sample(1) is None
    # spi == 0: only min_size applies, however much is sampled
    rl.on_sample(10_000)
    assert rl.can_sample(10_000) is None
    assert rl.allowed_now() == math.inf
    assert rl.refused_min_size == 2 and rl.refused_rate == 0


def test_ratio_with_error_buffer() -> None:
    rl = SampleToInsertRatio(2.0, min_size=1, error_buffer=1.0)
    rl.on_insert(1)  # allowed: samples + n <= 1 * 2 + 1 = 3
    assert rl.can_sample(3) is None
    assert rl.can_sample(4) == "rate_limited"
    rl.on_sample(3)
    assert rl.can_sample(1) == "rate_limited"
    assert rl.allowed_now() == 0
    rl.on_insert()  # bound 5
    assert rl.can_sample(2) is None
    assert rl.can_sample(3) == "rate_limited"
    assert rl.refused_rate == 3
    assert (rl.inserts, rl.samples) == (2, 3)


@settings(max_examples=200, deadline=None)
@given(
    spi=st.floats(0.0, 8.0),
    min_size=st.integers(1, 10),
    buf=st.floats(1.0, 20.0),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 8)), max_size=60),
)
def test_can_sample_matches_the_stated_rule(spi: float, min_size: int, buf: float, ops: list) -> None:
    rl = SampleToInsertRatio(spi, min_size, buf)
    inserts = samples = 0
    for is_insert, n in ops:
        if is_insert:
            rl.on_insert(n)
            inserts += n
            continue
        expected_ok = inserts >= min_size and (spi == 0 or samples + n <= inserts * spi + buf)
        reason = rl.can_sample(n)
        assert (reason is None) == expected_ok
        if reason is None:
            rl.on_sample(n)
            samples += n
        else:
            assert reason == ("min_size" if inserts < min_size else "rate_limited")
        if spi > 0 and inserts >= min_size:  # the ratio holds within the buffer at all times
            assert rl.samples <= rl.inserts * spi + buf
    assert (rl.inserts, rl.samples) == (inserts, samples)


@pytest.mark.parametrize(
    "args, quoted",
    [
        ((-1.0, 1, 2.0), "-1.0"),
        ((math.nan, 1, 2.0), "nan"),
        ((math.inf, 1, 2.0), "inf"),
        (("2", 1, 2.0), "'2'"),
        ((1.0, 0, 2.0), "min_size = 0"),
        ((1.0, 2.5, 2.0), "2.5"),
        ((1.0, 1, -3.0), "-3.0"),
        ((1.0, 1, math.inf), "inf"),
    ],
)
def test_bad_arguments_are_refused_with_the_value_quoted(args: tuple, quoted: str) -> None:
    with pytest.raises(ValueError, match=quoted.replace(".", r"\.")):
        SampleToInsertRatio(*args)


def test_buffer_below_one_segment_is_refused_when_the_ratio_is_on() -> None:
    with pytest.raises(ValueError, match=r"error_buffer = 0\.5"):
        SampleToInsertRatio(1.0, 1, 0.5)
    SampleToInsertRatio(0.0, 1, 0.0)  # ratio off: no buffer needed
    SampleToInsertRatio(1.0, 1, 1.0)


def test_negative_counts_are_refused() -> None:
    rl = SampleToInsertRatio(1.0, 1, 1.0)
    with pytest.raises(ValueError):
        rl.on_insert(-1)
    with pytest.raises(ValueError):
        rl.on_sample(-1)
    with pytest.raises(ValueError):
        rl.can_sample(-1)
