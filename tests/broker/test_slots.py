"""The store's slot ring holds received buffers by reference and is never written through."""
from __future__ import annotations

import numpy as np
import pytest

from zclaw.broker.slots import SlotRing


def test_slots_hold_references_and_stack_copies() -> None:
    ring = SlotRing(4, np.float32, (3, 2))
    a, b = np.full((3, 2), 1, np.float32), np.full((3, 2), 2, np.float32)
    ring[1], ring[3] = a, b
    assert np.shares_memory(ring[1], a) and np.shares_memory(ring.parts([3, 1])[0], b)
    stacked = ring[np.array([3, 1])]
    assert stacked.shape == (2, 3, 2) and not np.shares_memory(stacked, a)
    np.testing.assert_array_equal(stacked[0], b)
    np.testing.assert_array_equal(np.asarray(ring)[0], 0)  # an empty slot reads as zeros
    assert np.asarray(ring).shape == ring.shape == (4, 3, 2)


def test_a_stored_buffer_cannot_be_written_through_the_ring() -> None:
    ring = SlotRing(2, np.int32, (2,))
    ring[0] = np.array([1, 2], np.int32)
    with pytest.raises(ValueError):
        ring[0][0] = 5
    ring.clear(0)
    np.testing.assert_array_equal(ring[0], [0, 0])


def test_wrong_dtype_or_shape_is_refused_and_changes_nothing() -> None:
    ring = SlotRing(2, np.float32, (2,))
    ring[0] = np.ones(2, np.float32)
    for bad in (np.ones(2, np.float64), np.ones(3, np.float32)):
        with pytest.raises(ValueError):
            ring[0] = bad
    np.testing.assert_array_equal(ring[0], [1, 1])


def test_assigning_many_slots_copies_rows_of_a_block() -> None:
    ring = SlotRing(3, np.float32, (2,))
    block = np.arange(4, dtype=np.float32).reshape(2, 2)
    ring[np.array([2, 0])] = block
    block[:] = -1  # the ring took copies of a block it was handed (a snapshot being restored)
    np.testing.assert_array_equal(ring[2], [0, 1])
    np.testing.assert_array_equal(ring[0], [2, 3])
