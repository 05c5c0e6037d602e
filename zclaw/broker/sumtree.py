"""A sum tree: O(log C) priority updates and O(log C) sampling proportional to priority.

Leaves hold the (already exponentiated) priorities ``p_i^alpha`` of the store's slots; every inner
node holds the sum of its two children, so the root is the total mass and a uniform draw
``u ~ U[0, total)`` is turned into a slot by walking down: go left if ``u`` is below the left
child's sum, else subtract it and go right (Schaul et al. 2016, "Prioritized Experience Replay").

Parents are recomputed as the sum of their children on every update (never adjusted by a delta), so
floating-point error does not accumulate over millions of updates.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class SumTree:
    """Sum tree over ``capacity`` leaves, all zero at start."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity = {capacity!r} must be >= 1")
        self.capacity = int(capacity)
        size = 1
        while size < self.capacity:
            size *= 2
        self._size = size  # leaves live at [size, 2 * size)
        self._tree = np.zeros(2 * size, dtype=np.float64)

    @property
    def total(self) -> float:
        """The sum of all leaves."""
        return float(self._tree[1])

    def __getitem__(self, idx: int) -> float:
        return float(self._tree[self._size + idx])

    def values(self) -> np.ndarray:
        """A copy of the leaves (``capacity`` of them)."""
        return self._tree[self._size : self._size + self.capacity].copy()

    def update(self, idx: int, value: float) -> None:
        """Set leaf ``idx`` to ``value`` (finite, >= 0) and fix the sums above it."""
        if not 0 <= idx < self.capacity:
            raise IndexError(f"leaf {idx} outside [0, {self.capacity})")
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"sum tree value {value!r} must be finite and >= 0")
        i = self._size + int(idx)
        tree = self._tree
        tree[i] = value
        i //= 2
        while i >= 1:
            tree[i] = tree[2 * i] + tree[2 * i + 1]
            i //= 2

    def update_many(self, idxs: Sequence[int], values: Sequence[float]) -> None:
        for i, v in zip(idxs, values):
            self.update(int(i), float(v))

    def find(self, u: float) -> int:
        """The leaf whose cumulative-sum interval holds ``u`` (``0 <= u < total``); never a zero leaf.

        Rounding can walk the descent onto a zero-mass leaf when ``u`` is within an ulp of an
        interval's end; the walk then steps to the nearest leaf with mass instead.
        """
        tree = self._tree
        if tree[1] <= 0:
            raise ValueError("sum tree is empty (total mass 0)")
        i = 1
        while i < self._size:
            left = tree[2 * i]
            if u < left:
                i = 2 * i
            else:
                u -= left
                i = 2 * i + 1
        leaf = i - self._size
        if leaf >= self.capacity or tree[i] <= 0:
            leaves = tree[self._size : self._size + self.capacity]
            nz = np.flatnonzero(leaves > 0)
            leaf = int(nz[np.argmin(np.abs(nz - leaf))])
        return leaf
