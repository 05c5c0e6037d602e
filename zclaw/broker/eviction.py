"""Which segment a full store overwrites: the oldest one, or the oldest of the worker that lost least.

A store that is full when a segment arrives must throw one away. Throwing the *oldest* away (a plain
ring) is fair only when the workers' segments arrive in random order. Real workers send at steady
periods, and batches sized in env columns end at whatever segment reaches the column count, which is
more often a wide one (a 64-env segment reaches 64 columns alone). After such a batch the store's head
is the narrow segments that came after it, while the next wide one is a period away, so the ring
evicts narrow segments first: measured with workers of 8, 16 and 64 envs and a third of the data
evicted, the 64-env worker sent 43 % of the env steps and the learner trained on 45-50 % of them
(docs/benchmarks.md, "Mixed shapes"; a model of the ring with periodic arrivals gives the same, and
none with Poisson ones).

``fair`` (the default, ``broker.eviction``) evicts instead, like a router's longest-queue drop, from
the worker whose data was evicted unused the least in proportion to what it sent: ``lost_w / sent_w``
in env columns, smallest first; that worker's oldest stored segment goes, and ties (no eviction yet,
or one worker) go to the oldest segment, as in the ring. Every worker then loses the same share of
what it sent whatever its env count or timing, so what reaches the learner is in proportion to what
each sent. ``oldest`` keeps the ring's rule.

Bookkeeping is per worker identity: the keys of its stored segments in key order (consumed ones are
dropped lazily, when found at the front) and its sent/lost column counts, kept after its segments are
gone so that a worker pausing between segments keeps its history (at most ``MAX_WORKERS`` identities,
the least recently seen without stored segments forgotten first). The victim comes from a lazy heap of
(lost/sent, oldest key) per worker: a worker's rank only rises between its inserts (evictions raise its
loss, samples its oldest key), so an insert pushes its new rank and a stale entry met at the top is
replaced by the worker's current rank; the heap is rebuilt when stale entries outnumber the workers.
An insert then costs O(log workers) (bench/eviction.py).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

POLICIES = ("fair", "oldest")

#: worker identities whose counts are kept (a worker restarts under a new identity: new pid)
MAX_WORKERS = 4096


class Eviction:
    """Per-worker record of what a store holds and lost, and the victim of the next eviction."""

    def __init__(self, policy: str = "fair") -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction = {policy!r} must be one of {', '.join(POLICIES)}")
        self.policy = policy
        #: worker -> [columns inserted, columns evicted unused], least recently seen first
        self.columns: "OrderedDict[str, List[int]]" = OrderedDict()
        #: worker -> keys of its segments in key order (some may be gone already: dropped when met)
        self._keys: Dict[str, Deque[int]] = {}
        #: (lost/sent, oldest key, worker), each at most the worker's current rank (the module doc)
        self._heap: List[Tuple[float, int, str]] = []

    def inserted(self, worker: str, key: int, columns: int, stored: Callable[[int], bool]) -> None:
        """Note that ``worker``'s segment ``key`` of ``columns`` env columns is stored (keys in increasing
        order), counting its columns as sent (0: a segment restored from a snapshot, counted before)."""
        if worker in self.columns:
            self.columns.move_to_end(worker)
        else:
            self._forget(stored)
            self.columns[worker] = [0, 0]
        self.columns[worker][0] += columns
        keys = self._keys.setdefault(worker, deque())
        keys.append(key)
        if len(keys) > 64 and len(keys) % 64 == 0:  # consumed keys behind a long-lived one: compact
            self._keys[worker] = deque(k for k in keys if stored(k))
        self._push(worker, stored)  # its rank fell (more sent, or a first key): the heap must hear of it

    def evicted(self, worker: str, columns: int, unused: bool) -> None:
        """Count an eviction of ``worker``'s segment (lost only if it was never sampled)."""
        if unused and worker in self.columns:
            self.columns[worker][1] += columns

    def victim(self, oldest: int, stored: Callable[[int], bool]) -> int:
        """The key to evict from a full store whose oldest stored key is ``oldest``."""
        if self.policy == "oldest":
            return oldest
        heap = self._heap
        while heap:
            lost_share, key, worker = heap[0]
            now = self._rank(worker, stored)
            if now == (lost_share, key):
                return key
            heapq.heappop(heap)  # stale: the worker's rank rose since (or it holds nothing now)
            if now is not None:
                heapq.heappush(heap, (now[0], now[1], worker))
        return oldest

    def _rank(self, worker: str, stored: Callable[[int], bool]) -> Optional[Tuple[float, int]]:
        """(lost/sent, oldest stored key) of ``worker``, or None if it holds nothing."""
        keys = self._keys.get(worker)
        while keys and not stored(keys[0]):
            keys.popleft()
        if not keys:
            self._keys.pop(worker, None)
            return None
        sent, lost = self.columns.get(worker, (1, 0))
        return lost / max(sent, 1), keys[0]

    def _push(self, worker: str, stored: Callable[[int], bool]) -> None:
        if self.policy != "fair":
            return
        rank = self._rank(worker, stored)
        if rank is not None:
            heapq.heappush(self._heap, (rank[0], rank[1], worker))
        if len(self._heap) > 2 * len(self._keys) + 64:  # mostly stale entries: rebuild from the ranks
            ranks = [(w, self._rank(w, stored)) for w in list(self._keys)]
            self._heap = [(r[0], r[1], w) for w, r in ranks if r is not None]
            heapq.heapify(self._heap)

    def _forget(self, stored: Callable[[int], bool]) -> None:
        """Make room for one more identity within MAX_WORKERS: forget the least recently seen one that
        has nothing stored (none, if every identity has: their count is bounded by the capacity)."""
        for worker in list(self.columns):
            if len(self.columns) < MAX_WORKERS:
                return
            keys = self._keys.get(worker)
            if not keys or not any(stored(k) for k in keys):
                del self.columns[worker]
                self._keys.pop(worker, None)

    def state(self) -> Dict[str, List[int]]:
        """The per-worker counts, for a snapshot (the stored keys are rebuilt from the store)."""
        return {w: list(c) for w, c in self.columns.items()}

    def restore(self, counts: Dict[str, List[int]]) -> None:
        """Load counts written by :meth:`state` (before the stored segments are replayed into it)."""
        for worker, (sent, lost) in counts.items():
            self.columns[worker] = [sent, lost]
