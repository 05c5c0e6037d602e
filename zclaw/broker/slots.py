"""One array of the store, kept as a ring of per-slot references to the received buffers.

Why not one preallocated ``[capacity, T, N, ...]`` block: copying each segment into a block on insert
and out of it again for every batch are two full passes over every byte, and on a small host they
were a third of the broker's time. Here a slot holds the read-only numpy view of the ZeroMQ frame the
segment arrived in (validated, never written), and a batch is sent as those same buffers, one frame
per segment (``zclaw.wire.protocol.encode`` parts): the broker copies nothing. Memory stays bounded
exactly as a block would bound it, ``capacity`` segments of the one shape the store holds, because a
slot is only ever replaced, never added; a buffer still queued in a ZeroMQ send stays alive until that
send finishes (ZeroMQ holds a reference), then goes.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

Index = Union[int, np.integer, Sequence[int], np.ndarray]


def stack_parts(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``np.stack(parts)`` for parts of one shape, as one concatenation (half np.stack's per-part cost)."""
    return np.concatenate(parts).reshape((len(parts),) + tuple(parts[0].shape))


class SlotRing:
    """``capacity`` slots of arrays of one dtype and shape; indexes like a ``[capacity, *shape]`` array.

    ``ring[s] = a`` keeps a reference to ``a`` (checked, not copied); ``ring[s]`` is that array;
    ``ring[slots]`` (an index array) stacks copies, as numpy fancy indexing would; ``np.asarray(ring)``
    stacks every slot (empty slots read as zeros).
    """

    def __init__(self, capacity: int, dtype: Any, shape: Tuple[int, ...]) -> None:
        self.capacity = int(capacity)
        self.dtype = np.dtype(dtype)
        self.item_shape = tuple(int(d) for d in shape)
        self._items: List[Optional[np.ndarray]] = [None] * self.capacity
        self._zeros = np.zeros(self.item_shape, self.dtype)
        self._zeros.setflags(write=False)

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.capacity,) + self.item_shape

    def _check(self, a: Any) -> np.ndarray:
        a = np.asarray(a)
        if a.dtype != self.dtype or a.shape != self.item_shape:
            raise ValueError(f"slot array is {a.dtype}{list(a.shape)}, the ring holds "
                             f"{self.dtype}{list(self.item_shape)}")
        if not a.flags.writeable:  # already read-only: no need for a view of our own
            return a
        view = a.view()
        view.setflags(write=False)  # a stored segment is never written through the store
        return view

    def __setitem__(self, index: Index, value: Any) -> None:
        if isinstance(index, (int, np.integer)):
            self._items[int(index)] = self._check(value)
            return
        slots = np.asarray(index, dtype=np.int64).reshape(-1)
        value = np.asarray(value)
        if value.shape != (len(slots),) + self.item_shape:
            raise ValueError(f"{len(slots)} slots need {self.dtype}{[len(slots), *self.item_shape]}, got "
                             f"{value.dtype}{list(value.shape)}")
        for i, s in enumerate(slots):
            self._items[int(s)] = self._check(np.array(value[i]))  # own copies: value may be a temporary

    def __getitem__(self, index: Index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            item = self._items[int(index)]
            return self._zeros if item is None else item
        parts = self.parts(np.asarray(index, dtype=np.int64).reshape(-1))
        if not parts:
            return np.zeros((0,) + self.item_shape, self.dtype)
        return stack_parts(parts)

    def parts(self, slots: Union[Sequence[int], np.ndarray]) -> List[np.ndarray]:
        """The arrays held by ``slots``, in order, by reference (what a batch reply sends)."""
        # every field of every batch comes through here: index the list, no call per slot
        items, zeros = self._items, self._zeros
        index = slots.tolist() if isinstance(slots, np.ndarray) else slots
        return [zeros if items[s] is None else items[s] for s in index]

    def clear(self, slot: int) -> None:
        """Let go of a slot's buffer (the frame is freed once nothing else refers to it)."""
        self._items[int(slot)] = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(self.capacity)]
        return out.astype(dtype, copy=False) if dtype is not None else out

    def __len__(self) -> int:
        return self.capacity
