"""The telemetry every role shares: windowed rates and the last-100 episode statistics."""
from __future__ import annotations

import math

import pytest

from zclaw.telemetry import EpisodeWindow, RateMeter


def test_rate_meter_counts_the_window_only() -> None:
    m = RateMeter(window_s=10.0, now=0.0)
    m.add(50, now=1.0)
    assert m.rate(now=5.0) == pytest.approx(10.0)  # younger than the window: over its age
    m.add(100, now=12.0)
    assert m.rate(now=12.0) == pytest.approx(10.0)  # the event at t=1 left the window (2, 12]
    assert m.rate(now=30.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        RateMeter(window_s=0.0)


def test_episode_window_keeps_the_last_hundred_and_skips_what_is_malformed() -> None:
    w = EpisodeWindow(size=100)
    batch = w.add([{"return": 1.0, "length": 5, "success": True}, {"return": 3, "length": 7},
                   {"return": "x"}, {"return": math.nan}, "not a map", {"return": True}, {"length": 2}])
    assert batch == {"returns": [1.0, 3.0], "lengths": [5, 7], "successes": [True]}
    assert w.total == 2 and w.return_mean() == 2.0 and w.success_rate() == 1.0
    w.add({"return": float(i), "success": i % 4 == 0} for i in range(200))
    assert w.total == 202 and len(w.returns) == 100
    assert w.return_mean() == pytest.approx(sum(range(100, 200)) / 100)
    assert w.success_rate() == pytest.approx(0.25)


def test_episode_window_state_round_trips() -> None:
    w = EpisodeWindow()
    w.add([{"return": -4.5, "success": False}, {"return": -3.0}])
    again = EpisodeWindow()
    again.restore(w.state())
    assert (again.total, list(again.returns), list(again.successes)) == (2, [-4.5, -3.0], [False])
    empty = EpisodeWindow()
    empty.restore({})
    assert empty.total == 0 and empty.return_mean() is None and empty.success_rate() is None
