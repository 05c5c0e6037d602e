"""Option-balanced sampling: draw segments so that rarely executed options are not starved of data.

Each stored segment s carries its option counts ``n_o(s)`` (steps executed by option o). With the
store's totals ``n_o = sum_s n_o(s)`` over the segments stored now, segment s is drawn with weight::

    w(s) = sum_o n_o(s) / n_o                  (options with n_o = 0 contribute nothing)
    P(s) = w(s) / sum_s' w(s')

Every option present then gets the same expected number of steps in a batch of segments drawn
with replacement (each option's steps carry total weight 1, spread over the segments that hold
them), whatever its share of the data; when every segment holds the same mix, P is uniform. The
balance is a deliberate bias, like per-option loss weights, not an importance-corrected sampler:
no importance weight is returned for it. It is used by the store's ``queue`` and ``uniform`` modes
when ``broker.option_balanced`` is on (``prioritized`` has its own distribution).
"""
from __future__ import annotations

import numpy as np


class OptionBalancer:
    """Per-slot option counts of a store of ``capacity`` slots, and the weighted draw."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.counts = np.zeros((self.capacity, 1), dtype=np.int64)

    def insert(self, slot: int, option: np.ndarray) -> None:
        """Record the option counts of the segment now in ``slot`` (``option`` [T, N], integers >= 0)."""
        c = np.bincount(np.ravel(option))  # segment_dims already refused negative options
        if c.shape[0] > self.counts.shape[1]:
            grown = np.zeros((self.capacity, c.shape[0]), dtype=np.int64)
            grown[:, : self.counts.shape[1]] = self.counts
            self.counts = grown
        self.counts[slot] = 0
        self.counts[slot, : c.shape[0]] = c

    def weights(self, slots: np.ndarray) -> np.ndarray:
        """``P(s)`` for the given occupied slots (sums to 1)."""
        c = self.counts[np.asarray(slots, dtype=np.int64)].astype(np.float64)
        total = c.sum(axis=0)
        inv = np.divide(1.0, total, out=np.zeros_like(total), where=total > 0)
        w = c @ inv
        s = w.sum()
        return w / s if s > 0 else np.full(len(slots), 1.0 / max(len(slots), 1))

    def choose(self, slots: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` distinct slots drawn with probability ``P(s)`` (sequentially, without replacement)."""
        slots = np.asarray(slots, dtype=np.int64)
        probs = self.weights(slots)
        nz = int((probs > 0).sum())
        if nz < n:  # fewer weighted segments than asked: fill up with the rest, uniformly
            probs = probs + (1e-12 if nz else 1.0) / len(slots)
            probs = probs / probs.sum()
        return rng.choice(slots, size=n, replace=False, p=probs)
