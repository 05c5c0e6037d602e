"""The broker's samples-per-insert rate limiter (after Reverb's ``rate_limiters.SampleToInsertRatio``).

Why a limiter at all: with asynchronous workers and learner, nothing ties how often a stored step
is trained on to how fast steps arrive. A fast learner over-fits the few segments it has; a slow one
lets workers run ahead. The ratio of segments sampled to segments inserted (``samples_per_insert``)
is the knob that fixes data reuse regardless of the speed of either side.

Unlike Reverb, the limiter here only ever holds back the *sampler*: inserts are governed by the
store's ``broker.when_full`` instead (``evict`` the oldest segment, or ``wait``: stop reading ingest
while the learner could still sample, see
:meth:`zclaw.broker.server.Broker.accepting`). It also never blocks: :meth:`SampleToInsertRatio.can_sample`
answers at once, and the broker turns a refusal into a ``retry`` reply ("not yet, ask again in N ms").
"""
from __future__ import annotations

import math
from typing import Optional


class SampleToInsertRatio:
    """Keeps the number of segments sampled close to ``samples_per_insert`` x the number inserted.

    With ``inserts`` and ``samples`` the counts so far, a request to sample ``n`` segments is allowed
    iff::

        inserts >= min_size                                            (stage 1: fill up)
        samples + n <= inserts * samples_per_insert + error_buffer     (stage 2: the ratio)

    The second condition is skipped when ``samples_per_insert == 0`` (limiter off: only ``min_size``
    applies). ``error_buffer`` is the slack, in segments, that lets the learner sample a little ahead
    of the inserts instead of waiting in lockstep for each one; there is no lower bound because the
    limiter never holds back inserts (a learner that falls behind has more data to choose from, and
    ``when_full = "wait"`` holds inserts back only while this limiter would let the learner sample).

    Refusal reasons (what :meth:`can_sample` returns): ``"min_size"`` while fewer than ``min_size``
    segments were ever inserted, ``"rate_limited"`` when the ratio says "not yet".

    Refused up front (``ValueError`` quoting the value):

    * ``samples_per_insert`` negative or not finite, ``error_buffer`` negative or not finite,
      ``min_size`` not an integer >= 1;
    * ``samples_per_insert > 0`` with ``error_buffer < 1``. Reverb refuses buffers smaller than
      ``max(1, samples_per_insert)`` because there inserts block too, and such a buffer can block
      both sides against each other for good. Inserts never block while the sampler is refused here, so
      the counts always move and no setting deadlocks outright; but with less than one segment of slack the
      limiter is a barrier rather than a buffer (each request waits for the one insert that lets
      ``inserts * samples_per_insert`` catch up), which is never what a user wants. ``zclaw.config``
      refuses the same combination, so a config that loads never trips this.
    """

    def __init__(self, samples_per_insert: float, min_size: int, error_buffer: float) -> None:
        if isinstance(samples_per_insert, bool) or not isinstance(samples_per_insert, (int, float)):
            raise ValueError(f"samples_per_insert = {samples_per_insert!r} must be a number >= 0")
        if not math.isfinite(samples_per_insert) or samples_per_insert < 0:
            raise ValueError(f"samples_per_insert = {samples_per_insert!r} must be a finite number >= 0")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise ValueError(f"min_size = {min_size!r} must be an integer >= 1")
        if isinstance(error_buffer, bool) or not isinstance(error_buffer, (int, float)):
            raise ValueError(f"error_buffer = {error_buffer!r} must be a number >= 0")
        if not math.isfinite(error_buffer) or error_buffer < 0:
            raise ValueError(f"error_buffer = {error_buffer!r} must be a finite number >= 0")
        if samples_per_insert > 0 and error_buffer < 1:
            raise ValueError(
                f"error_buffer = {error_buffer!r} with samples_per_insert = {samples_per_insert!r}: "
                "the buffer must be >= 1 segment, or every request waits in lockstep for single inserts "
                "(see the class docstring)"
            )
        self.samples_per_insert = float(samples_per_insert)
        self.min_size = int(min_size)
        self.error_buffer = float(error_buffer)
        #: segments inserted so far (never decreases: evictions and removals do not give credit back)
        self.inserts = 0
        #: segments handed out in batches so far
        self.samples = 0
        #: refusals so far, by reason
        self.refused_min_size = 0
        self.refused_rate = 0

    def can_sample(self, n: int) -> Optional[str]:
        """None if ``n`` segments may be sampled now, else the reason (``"min_size"``, ``"rate_limited"``).

        Does not change the counters (call :meth:`on_sample` once the batch was actually served),
        except the refusal tallies.
        """
        if n < 0:
            raise ValueError(f"n = {n!r} must be >= 0")
        if self.inserts < self.min_size:
            self.refused_min_size += 1
            return "min_size"
        bound = self.inserts * self.samples_per_insert + self.error_buffer
        if self.samples_per_insert > 0 and self.samples + n > bound:
            self.refused_rate += 1
            return "rate_limited"
        return None

    def on_insert(self, k: int = 1) -> None:
        """Count ``k`` inserted segments."""
        if k < 0:
            raise ValueError(f"k = {k!r} must be >= 0")
        self.inserts += int(k)

    def on_sample(self, n: int) -> None:
        """Count ``n`` segments that were served in a batch."""
        if n < 0:
            raise ValueError(f"n = {n!r} must be >= 0")
        self.samples += int(n)

    def allowed_now(self) -> float:
        """How many more segments may be sampled right now (inf with the ratio off, 0 in stage 1)."""
        if self.inserts < self.min_size:
            return 0.0
        if self.samples_per_insert == 0:
            return math.inf
        return max(0.0, self.inserts * self.samples_per_insert + self.error_buffer - self.samples)

    def __repr__(self) -> str:
        return (
            f"SampleToInsertRatio(samples_per_insert={self.samples_per_insert}, min_size={self.min_size}, "
            f"error_buffer={self.error_buffer}, inserts={self.inserts}, samples={self.samples})"
        )
