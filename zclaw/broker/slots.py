"""One array of the store, kept as a ring of per-slot references to the received buffers.

Why not one preallocated ``[capacity, T, N, ...]`` block: copying each segment into a block on insert
and out of it again for every batch are two full passes over every byte, and on a small host they
were a third of the broker's time. Here a slot holds the read-only numpy view of the ZeroMQ frame the
segment arrived in (validated, never written), and a batch is sent as those same buffers, one frame
per segment (``zclaw.wire.protocol.Parts``): the broker copies nothing. Memory stays bounded by
``capacity`` segments, because a slot is only ever replaced, never added; a buffer still queued in a
ZeroMQ send stays alive until that send finishes (ZeroMQ holds a reference), then goes. A dimension given
as ``None`` is free per slot: workers of different env counts N share one store (protocol v2).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

Index = Union[int, np.integer, Sequence[int], np.ndarray]


def stack_parts(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``np.stack(parts)`` for parts of one shape, as one concatenation (half np.stack's per-part cost)."""
    return np.concatenate(parts).reshape((len(parts),) + tuple(parts[0].shape))


class SlotRing:
    """``capacity`` slots of arrays of one dtype and shape; indexes like a ``[capacity, *shape]`` array.

    ``ring[s] = a`` keeps a reference to ``a`` (checked, not copied); ``ring[s]`` is that array;
    ``ring[slots]`` (an index array) stacks copies, as numpy fancy indexing would; ``np.asarray(ring)``
    stacks every slot (empty slots read as zeros). With a free (``None``) dimension in ``shape`` only
    slots of one shape stack, and an empty slot has no array to read.
    """

    def __init__(self, capacity: int, dtype: Any, shape: Tuple[Optional[int], ...]) -> None:
        self.capacity = int(capacity)
        self.dtype = np.dtype(dtype)
        self.item_shape = tuple(None if d is None else int(d) for d in shape)
        self._items: List[Optional[np.ndarray]] = [None] * self.capacity
        self._zeros: Optional[np.ndarray] = None
        if None not in self.item_shape:
            self._zeros = np.zeros(cast(Tuple[int, ...], self.item_shape), self.dtype)
            self._zeros.setflags(write=False)

    @property
    def shape(self) -> Tuple[Optional[int], ...]:
        return (self.capacity,) + self.item_shape

    def _fits(self, shape: Tuple[int, ...]) -> bool:
        return len(shape) == len(self.item_shape) and all(
            want is None or want == got for want, got in zip(self.item_shape, shape))

    def _check(self, a: Any) -> np.ndarray:
        a = np.asarray(a)
        if a.dtype != self.dtype or not self._fits(a.shape):
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
        if value.shape[:1] != (len(slots),) or not self._fits(value.shape[1:]):
            raise ValueError(f"{len(slots)} slots need {self.dtype}{[len(slots), *self.item_shape]}, got "
                             f"{value.dtype}{list(value.shape)}")
        for i, s in enumerate(slots):
            self._items[int(s)] = self._check(np.array(value[i]))  # own copies: value may be a temporary

    def __getitem__(self, index: Index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            item = self._items[int(index)]
            return self._empty(int(index)) if item is None else item
        parts = self.parts(np.asarray(index, dtype=np.int64).reshape(-1))
        if not parts:
            return np.zeros((0,) + tuple(d or 0 for d in self.item_shape), self.dtype)
        if len({p.shape for p in parts}) != 1:
            raise ValueError("slots of different shapes do not stack")
        return stack_parts(parts)

    def _empty(self, slot: int) -> np.ndarray:
        if self._zeros is None:
            raise KeyError(f"slot {slot} is empty and the ring's item shape {list(self.item_shape)} is free")
        return self._zeros

    def parts(self, slots: Union[Sequence[int], np.ndarray]) -> List[np.ndarray]:
        """The arrays held by ``slots``, in order, by reference (what a batch reply sends)."""
        # every field of every batch comes through here: index the list, no call per slot
        items = self._items
        index = slots.tolist() if isinstance(slots, np.ndarray) else slots
        return [self._empty(s) if items[s] is None else items[s] for s in index]  # type: ignore[misc]

    def clear(self, slot: int) -> None:
        """Let go of a slot's buffer (the frame is freed once nothing else refers to it)."""
        self._items[int(slot)] = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[np.arange(self.capacity)]
        return out.astype(dtype, copy=False) if dtype is not None else out

    def __len__(self) -> int:
        return self.capacity
