"""The broker's store: ``capacity`` segment slots, which one a full store overwrites, three ways to sample.

Layout: one :class:`~zclaw.broker.slots.SlotRing` per field of :data:`zclaw.wire.messages.SEGMENT_ARRAYS`,
indexed like a ``[capacity, T+1, N_slot, ...]`` array. T, the segment length, is one per run: fixed by
:meth:`Store.fix_segment_length` (the first worker hello, announced in every ``welcome``) or by the
first segment; N, the env count, is each worker's own (protocol v2), so workers with 8 and 4096 envs
feed one store and a batch joins their *columns* (one env's T steps) along the env axis. A slot holds
read-only references to the buffers the segment arrived in: no copy on insert, none on sample (a batch
is sent from those buffers), and memory is bounded by ``capacity`` segments of the workers' sizes. The
sparse truncation data (``final_obs``/``final_at``, a few rows per segment) is kept per slot as small
copies.

Keys: every insert gets the next integer key (0, 1, 2, ...) and a free slot (the store maps keys to
slots). A key is never reused, so a priority update that names a key that was evicted or used up is
simply ignored instead of landing on whatever segment took the slot. When no slot is free, the insert
overwrites the segment :mod:`zclaw.broker.eviction` picks (``broker.eviction``: ``fair``, the oldest
of the worker that lost the least of what it sent, or ``oldest``), counted as drop cause
``"evicted_unused"`` if it was never sampled: data the workers paid for and nobody used.

Modes (which ``n`` segments :meth:`Store.sample` returns):

* ``queue``: FIFO, the ``n`` oldest stored segments; each sample counts one use and a segment is
  removed after ``max_reuse`` uses (``max_reuse = 0``, unlimited, would serve the same oldest
  segments forever and is refused). The on-policy default.
* ``uniform``: ``n`` distinct segments drawn uniformly from those stored.
* ``prioritized``: ``n`` distinct segments drawn one after another with probability
  ``P(i) = p_i^alpha / sum_k p_k^alpha`` (a sum tree), each returned with the importance weight
  ``w_i = (N * P(i))^-beta / max_j w_j`` (N segments stored, max over the batch), as in Schaul et
  al. (2016). New segments enter with the largest priority seen so far (Ape-X), so every segment is
  likely to be seen once; the learner sends new priorities with its next request
  (:meth:`Store.update_priorities`).

With ``option_balanced`` (queue and uniform modes) the ``n`` segments are drawn, without replacement,
with probability ``P(s) ~ sum_o n_o(s) / n_o`` instead (:mod:`zclaw.broker.balance`).

In every mode ``max_reuse > 0`` removes a segment after that many uses, and ``max_staleness >= 0``
removes, at sample time, segments whose lag ``learner_version - min(policy_version)`` exceeds it
(drop cause ``"stale"``): off-policy corrections only stretch so far.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..wire.messages import ENV_ARRAYS, ENV_AXIS, SEGMENT_ARRAYS, EnvSpec, segment_dims
from ..wire.protocol import PART_MIN_BYTES, Message, Parts, WireError
from .balance import OptionBalancer
from .eviction import Eviction
from .slots import SlotRing, stack_parts
from .sumtree import SumTree

MODES = ("queue", "uniform", "prioritized")

#: version-lag histogram buckets (inclusive upper bounds; the last one is open)
LAG_BUCKETS = ("0", "1", "2", "3-4", "5-8", "9-16", "17+")
_LAG_EDGES = np.array([0, 1, 2, 4, 8, 16], dtype=np.int64)

#: priorities below this are stored as this, so a segment whose error is exactly 0 is not starved forever
MIN_PRIORITY = 1e-6


def lag_buckets(lags: np.ndarray, weight: int = 1) -> Dict[str, int]:
    """Histogram of integer lags over :data:`LAG_BUCKETS` (negative lags, a restarted learner, count as 0)."""
    idx = np.searchsorted(_LAG_EDGES, np.maximum(np.asarray(lags, dtype=np.int64), 0), side="left")
    counts = np.bincount(idx.ravel(), minlength=len(LAG_BUCKETS))
    return {b: int(c) * weight for b, c in zip(LAG_BUCKETS, counts)}


def join_columns(parts: List[np.ndarray]) -> np.ndarray:
    """Segments' arrays joined along the env axis (a copy): the batch layout of one field."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=ENV_AXIS)


@dataclass
class SampledBatch:
    """What :meth:`Store.sample` returns: the batch's arrays plus per-segment metadata.

    ``parts`` holds, per field of ``SEGMENT_ARRAYS``, the B segments' arrays by reference (the
    store's read-only received buffers, never written: see ``zclaw.broker.slots``), which the broker
    sends as they are, one frame per segment, for fields large enough to gain from it (:meth:`wire_arrays`);
    ``extra`` holds ``final_obs`` ``[M, *obs_shape]`` with ``final_at`` rows ``(t, c)`` (c a batch
    column) and ``is_weight[B]`` (see ``zclaw.wire.messages.BATCH_EXTRA``); ``columns[b]`` is segment b's
    env count. :attr:`arrays` is the batch layout the learner decodes. ``episodes`` holds the episode
    stats of the segments sampled here for the first time only, so a learner counting them sees
    each episode once whatever ``max_reuse`` is.
    """

    parts: Dict[str, List[np.ndarray]]
    extra: Dict[str, np.ndarray]
    keys: List[int]
    workers: List[str]
    seqs: List[int]
    columns: List[int] = field(default_factory=list)
    episodes: List[Dict[str, Any]] = field(default_factory=list)
    lag_hist: Dict[str, int] = field(default_factory=dict)
    #: the store slots the segments came from (what :meth:`Store.commit` counts a use of)
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def arrays(self) -> Dict[str, np.ndarray]:
        """Every field in batch layout (copies), as the learner receives the batch: per-env fields joined
        along the env axis, ``policy_version`` stacked ``[B, T]``."""
        out: Dict[str, np.ndarray] = {name: np.concatenate(p, axis=ENV_AXIS) for name, p in self.parts.items()
                                      if name in ENV_ARRAYS}
        out["policy_version"] = stack_parts(self.parts["policy_version"])
        out.update(self.extra)
        return out

    def wire_arrays(self) -> Dict[str, Any]:
        """What ``zclaw.wire.make("batch", ...)`` sends: the extras, and each field as per-segment
        :class:`Parts` (no copy) when a segment's array is at least ``PART_MIN_BYTES``, else joined into
        one frame.

        Why both: parts are the received frames themselves, forwarded by reference count, but each costs
        per-frame work on both ends (send, receive, view, check); for a small field that work outweighs
        one joined copy of the same bytes in one frame. Large fields (observations) go as parts. The
        broker sends the joined frames with ``copy=True`` (see ``zclaw.broker.server``). Measured at
        the default size (obs 42 KB per segment): forwarding observations as parts instead of stacking
        them made no difference beyond the noise, so the threshold stays at pyzmq's copy threshold.
        """
        out: Dict[str, Any] = {}
        for name, p in self.parts.items():
            if name not in ENV_ARRAYS:
                out[name] = stack_parts(p)
            elif min(a.nbytes for a in p) >= PART_MIN_BYTES:
                out[name] = Parts(p, ENV_AXIS)
            else:
                out[name] = join_columns(p)
        out.update(self.extra)
        return out


class Store:
    """``capacity`` segments of one env spec; see the module docstring for the rules."""

    def __init__(
        self,
        spec: EnvSpec,
        capacity: int,
        mode: str = "queue",
        max_reuse: int = 1,
        max_staleness: int = -1,
        alpha: float = 0.6,
        beta: float = 0.4,
        seed: int = 0,
        option_balanced: bool = False,
        max_abs_obs: float = 0.0,
        max_abs_reward: float = 0.0,
        eviction: str = "fair",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity = {capacity!r} must be an integer >= 1")
        if mode not in MODES:
            raise ValueError(f"mode = {mode!r} must be one of {', '.join(MODES)}")
        if isinstance(max_reuse, bool) or not isinstance(max_reuse, int) or max_reuse < 0:
            raise ValueError(f"max_reuse = {max_reuse!r} must be an integer >= 0 (0: unlimited)")
        if mode == "queue" and max_reuse == 0:
            raise ValueError("max_reuse = 0 (unlimited) in queue mode serves the oldest segments for ever")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < -1:
            raise ValueError(f"max_staleness = {max_staleness!r} must be an integer >= 0, or -1 for off")
        if not (0 <= alpha <= 1):
            raise ValueError(f"alpha = {alpha!r} must be in [0, 1]")
        if not (0 <= beta <= 1):
            raise ValueError(f"beta = {beta!r} must be in [0, 1]")
        self.spec = spec
        self.capacity = capacity
        #: bounds on |obs| (with final_obs) and |reward| of an accepted segment (0: off)
        self.max_abs_obs = float(max_abs_obs)
        self.max_abs_reward = float(max_abs_reward)
        self.mode = mode
        self.max_reuse = max_reuse
        self.max_staleness = max_staleness
        self.alpha = float(alpha)
        self.beta = float(beta)
        #: steps per segment, one per run (None until fixed); env counts are per slot (``_cols``)
        self.T: Optional[int] = None
        self._rng = np.random.default_rng(seed)
        self._data: Dict[str, SlotRing] = {}
        C = capacity
        self._key = np.full(C, -1, dtype=np.int64)  # -1: empty slot
        self._slot_by_key: Dict[int, int] = {}  # stored keys in increasing order (dict order) -> slot
        self._free: List[int] = list(range(C - 1, -1, -1))  # free slots, the lowest popped first
        #: which segment a full store overwrites (and each worker's sent and lost columns)
        self._evict = Eviction(eviction)
        self._uses = np.zeros(C, dtype=np.int64)
        self._cols = np.zeros(C, dtype=np.int64)  # env count N of each stored segment
        self._min_version = np.zeros(C, dtype=np.int64)
        self._workers: List[str] = [""] * C
        self._seqs: List[int] = [0] * C
        self._episodes: List[List[Dict[str, Any]]] = [[] for _ in range(C)]
        self._final_obs: List[Optional[np.ndarray]] = [None] * C
        self._final_at: List[Optional[np.ndarray]] = [None] * C
        self._tree = SumTree(C) if mode == "prioritized" else None
        #: option-balanced draws in queue/uniform modes (see zclaw/broker/balance.py)
        self._balance = OptionBalancer(C) if option_balanced and mode != "prioritized" else None
        self.max_priority = 1.0
        self._next_key = 0
        self._fill = 0
        #: segments the store itself discarded, by cause ("evicted_unused", "stale")
        self.drops: Counter = Counter()
        #: version lag of every sampled transition (a step of a segment x its N envs), by bucket
        self.lag_hist: Dict[str, int] = {b: 0 for b in LAG_BUCKETS}
        self.inserted = 0
        self.inserted_steps = 0
        self.sampled = 0
        self.batches = 0
        #: why the last :meth:`sample` returned None
        self.last_reason: Optional[str] = None

    # ------------------------------------------------------------------------------------ state

    @property
    def fill(self) -> int:
        """Segments stored now."""
        return self._fill

    def __len__(self) -> int:
        return self._fill

    @property
    def next_insert_evicts_unused(self) -> bool:
        """Whether the next insert would overwrite a segment that was never sampled.

        The broker's ``when_full = "wait"`` stops reading new segments while this holds, so that
        no segment a worker paid for is thrown away unused (see ``zclaw.broker.server``).
        """
        if self._free:
            return False
        return bool(self._uses[self._slot_by_key[self._victim()]] == 0)

    def _victim(self) -> int:
        """The key the next insert overwrites (the store is full)."""
        return self._evict.victim(next(iter(self._slot_by_key)), self._slot_by_key.__contains__)

    def keys(self) -> List[int]:
        """Keys of the stored segments, oldest first."""
        k = self._key[self._key >= 0]
        return [int(x) for x in np.sort(k)]

    def _slot_of(self, key: int) -> Optional[int]:
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            return None
        return self._slot_by_key.get(int(key))

    def columns(self, key: int) -> int:
        """The env count N of the stored segment ``key`` (0 if it is not stored)."""
        slot = self._slot_of(key)
        return 0 if slot is None else int(self._cols[slot])

    def uses(self, key: int) -> Optional[int]:
        """Times the segment ``key`` was sampled, or None if it is not stored."""
        slot = self._slot_of(key)
        return None if slot is None else int(self._uses[slot])

    def priority(self, key: int) -> Optional[float]:
        """The sum-tree mass ``p^alpha`` of ``key`` (prioritized mode), or None if not stored."""
        slot = self._slot_of(key)
        if slot is None or self._tree is None:
            return None
        return self._tree[slot]

    def tree_total(self) -> float:
        return self._tree.total if self._tree is not None else float(self._fill)

    # -------------------------------------------------------------------------------- snapshots

    def state(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """Everything :meth:`restore` needs: arrays (occupied slots only) and JSON-able metadata.

        The data arrays are lists of the occupied slots' own arrays (which ``snapshot.write`` streams
        as stacked rows) or stacked copies; ``zclaw.broker.snapshot`` calls this in a forked child,
        frozen copy-on-write, where it costs the broker's loop nothing.
        """
        slots = np.flatnonzero(self._key >= 0)
        arrays: Dict[str, Any] = {"slot": slots, "key": self._key[slots], "uses": self._uses[slots],
                                  "min_version": self._min_version[slots], "columns": self._cols[slots]}
        # slots by reference, each flattened (a view): no copy of the store, whatever each segment's N
        for name, data in self._data.items():
            arrays["data." + name] = ([a.reshape(-1) for a in data.parts(slots)] if len(slots)
                                      else np.zeros(0, data.dtype))
        counts = [0 if self._final_at[s] is None else len(self._final_at[s]) for s in slots]
        arrays["final_count"] = np.asarray(counts, dtype=np.int64)
        fo = [self._final_obs[s] for s in slots if self._final_obs[s] is not None]
        fa = [self._final_at[s] for s in slots if self._final_at[s] is not None]
        arrays["final_obs"] = np.concatenate(fo) if fo else np.zeros((0,) + self.spec.obs_shape, np.float32)
        arrays["final_at"] = np.concatenate(fa) if fa else np.zeros((0, 2), np.int32)
        if self._tree is not None:
            arrays["priority"] = self._tree.values()[slots]
        meta = {
            "spec": self.spec.to_dict(), "capacity": self.capacity, "mode": self.mode,
            "T": self.T,
            "workers": [self._workers[s] for s in slots], "seqs": [self._seqs[s] for s in slots],
            "episodes": [self._episodes[s] for s in slots], "next_key": self._next_key,
            "max_priority": self.max_priority, "inserted": self.inserted,
            "inserted_steps": self.inserted_steps,
            "sampled": self.sampled, "batches": self.batches, "drops": dict(self.drops),
            "lag_hist": dict(self.lag_hist), "rng": self._rng.bit_generator.state,
            "worker_columns": self._evict.state(),
        }
        return arrays, meta

    def restore(self, arrays: Dict[str, np.ndarray], meta: Dict[str, Any]) -> int:
        """Load what :meth:`state` returned into this (empty) store; return the segments restored.

        Raises ``ValueError`` (and changes nothing) when the snapshot is for another env spec,
        capacity or mode, or its arrays do not fit the layout.
        """
        if EnvSpec.from_dict(meta["spec"]).hash != self.spec.hash:
            raise ValueError(f"snapshot env spec {meta['spec'].get('env_id')!r} differs from the store's")
        if (meta["capacity"], meta["mode"]) != (self.capacity, self.mode):
            raise ValueError(f"snapshot is capacity {meta['capacity']} {meta['mode']}, the store is "
                             f"capacity {self.capacity} {self.mode}")
        if self.T is not None:
            raise ValueError("restore needs an empty store")
        slots = np.asarray(arrays["slot"], dtype=np.int64)
        n = len(slots)
        if n and meta["T"] is None:
            raise ValueError("snapshot has segments but no segment shape")
        if n and ((slots < 0).any() or (slots >= self.capacity).any() or len(np.unique(slots)) != n):
            raise ValueError("snapshot slots are out of range or repeated")
        counts = np.asarray(arrays["final_count"], dtype=np.int64)
        if len(counts) != n or not int(counts.sum()) == len(arrays["final_at"]) == len(arrays["final_obs"]):
            raise ValueError("snapshot truncation rows do not add up")
        keys = np.asarray(arrays["key"], dtype=np.int64)
        if len(keys) != n or (n and ((keys < 0).any() or (keys >= int(meta["next_key"])).any()
                                     or len(np.unique(keys)) != n)):
            raise ValueError("snapshot keys are missing, out of range or repeated")
        cols = np.asarray(arrays["columns"], dtype=np.int64)
        if len(cols) != n or (cols < 1).any():
            raise ValueError("snapshot env counts are missing or out of range")
        sent_lost = meta.get("worker_columns")  # absent in format 2: then the stored segments are all we know
        try:
            sent_lost = (None if sent_lost is None
                         else {str(w): [int(a), int(b)] for w, (a, b) in sent_lost.items()})
        except (AttributeError, TypeError, ValueError):
            raise ValueError("snapshot worker_columns are not {worker: [sent, lost]}") from None
        if meta["T"] is not None:
            T = int(meta["T"])
            rows: Dict[str, List[np.ndarray]] = {}
            for name, (dtype, shape_of) in SEGMENT_ARRAYS.items():
                a = np.asarray(arrays["data." + name]).reshape(-1)
                shapes = [tuple(shape_of(T, int(N), self.spec)) for N in cols]
                sizes = [int(np.prod(sh)) for sh in shapes]
                if a.dtype != np.dtype(dtype) or a.size != sum(sizes):
                    raise ValueError(f"snapshot array {name} is {a.dtype}[{a.size}], the segments need "
                                     f"{np.dtype(dtype)}[{sum(sizes)}]")
                ends = np.cumsum(sizes)
                rows[name] = [a[e - k:e].reshape(sh) for e, k, sh in zip(ends, sizes, shapes)]
            self._allocate(T)
            for name in SEGMENT_ARRAYS:
                for s, row in zip(slots, rows[name]):
                    self._data[name][int(s)] = row
            self._cols[slots] = cols
        ends = np.cumsum(counts)
        for i, s in enumerate(slots):
            s = int(s)
            self._key[s] = int(arrays["key"][i])
            self._uses[s] = int(arrays["uses"][i])
            self._min_version[s] = int(arrays["min_version"][i])
            self._workers[s] = str(meta["workers"][i])
            self._seqs[s] = int(meta["seqs"][i])
            self._episodes[s] = [dict(ep) for ep in meta["episodes"][i]]
            if counts[i]:
                lo, hi = int(ends[i] - counts[i]), int(ends[i])
                self._final_obs[s] = np.array(arrays["final_obs"][lo:hi], dtype=np.float32)
                self._final_at[s] = np.array(arrays["final_at"][lo:hi], dtype=np.int32)
            if self._tree is not None:
                prio = arrays.get("priority")
                self._tree.update(s, float(prio[i]) if prio is not None else 1.0)
        self._fill = n
        self._evict.restore(sent_lost or {})
        for i in np.argsort(keys, kind="stable"):
            key, s = int(keys[i]), int(slots[i])
            self._slot_by_key[key] = s
            self._evict.inserted(self._workers[s], key, int(cols[i]) if sent_lost is None else 0,
                                 self._slot_by_key.__contains__)
        taken = set(int(s) for s in slots)
        self._free = [s for s in range(self.capacity - 1, -1, -1) if s not in taken]
        self._next_key = int(meta["next_key"])
        self.max_priority = float(meta["max_priority"])
        for name in ("inserted", "inserted_steps", "sampled", "batches"):
            setattr(self, name, int(meta[name]))
        self.drops = Counter({str(k): int(v) for k, v in meta["drops"].items()})
        self.lag_hist = {b: int(meta["lag_hist"].get(b, 0)) for b in LAG_BUCKETS}
        self._rng.bit_generator.state = meta["rng"]
        return n

    # ----------------------------------------------------------------------------------- insert

    def fix_segment_length(self, T: int) -> None:
        """Fix the run's steps per segment before the first segment (the broker does so from the first
        worker hello and announces it in every ``welcome``); ``ValueError`` if another T is fixed."""
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"segment length {T!r} must be an integer >= 1")
        if self.T is None:
            self._allocate(T)
        elif T != self.T:
            raise ValueError(f"segment length {T} differs from the store's {self.T}")

    def _allocate(self, T: int) -> None:
        self.T = T
        for name, (dtype, shape_of) in SEGMENT_ARRAYS.items():
            self._data[name] = SlotRing(self.capacity, dtype, tuple(shape_of(T, None, self.spec)))

    def _remove(self, slot: int) -> None:
        for ring in self._data.values():
            ring.clear(slot)
        del self._slot_by_key[int(self._key[slot])]
        self._free.append(slot)
        self._key[slot] = -1
        self._uses[slot] = 0
        self._cols[slot] = 0
        self._episodes[slot] = []
        self._final_obs[slot] = None
        self._final_at[slot] = None
        if self._tree is not None:
            self._tree.update(slot, 0.0)
        self._fill -= 1

    def insert(self, msg: Message) -> int:
        """Validate a ``segment`` message and keep it in the ring; return its key.

        The ring keeps references to the message's arrays, not copies (see ``zclaw.broker.slots``):
        frames received from a socket belong to nobody else; a caller passing its own arrays must
        not modify them afterwards.

        Raises :class:`WireError` (``bad_spec``, ``bad_shape``, ``bad_dtype``, ``bad_value``, ...)
        before anything is written, so a bad segment never touches stored data.
        """
        T, N, M = segment_dims(msg, self.spec)
        if self.T is not None and T != self.T:
            raise WireError("bad_shape", f"segment has T={T} steps, the run's segment_length is {self.T} "
                            "(announced in the welcome)")
        self._check_range(msg)
        if self.T is None:
            self._allocate(T)
        key = self._next_key
        if not self._free:  # full: overwrite the segment the eviction policy picks
            slot = self._slot_by_key[self._victim()]
            unused = bool(self._uses[slot] == 0)
            if unused:
                self.drops["evicted_unused"] += 1
            self._evict.evicted(self._workers[slot], int(self._cols[slot]), unused)
            self._remove(slot)
        slot = self._free.pop()
        for name in SEGMENT_ARRAYS:
            self._data[name][slot] = msg.arrays[name]
        self._final_obs[slot] = np.array(msg.arrays["final_obs"], copy=True) if M else None
        self._final_at[slot] = np.array(msg.arrays["final_at"], copy=True) if M else None
        self._key[slot] = key
        self._slot_by_key[key] = slot
        self._uses[slot] = 0
        self._cols[slot] = N
        pv = msg.arrays["policy_version"]
        self._min_version[slot] = int(pv.min())
        self._workers[slot] = msg["worker"]
        self._seqs[slot] = int(msg["seq"])
        self._episodes[slot] = [dict(ep) for ep in msg["episodes"]]
        if self._balance is not None:
            self._balance.insert(slot, msg.arrays["option"])
        if self._tree is not None:
            self._tree.update(slot, max(self.max_priority, MIN_PRIORITY) ** self.alpha)
        self._evict.inserted(msg["worker"], key, N, self._slot_by_key.__contains__)
        self._next_key += 1
        self._fill += 1
        self.inserted += 1
        self.inserted_steps += T * N
        return key

    def _check_range(self, msg: Message) -> None:
        """``out_of_range`` if an observation (``obs``, ``final_obs``) or reward is beyond its bound.

        Why: a simulator that blew up sends huge *finite* values, which pass the wire's finiteness
        check and would poison every statistic trained on them (the learner's observation normaliser
        above all). min and max, not abs: two passes without a temporary copy of the array.
        """
        for names, bound in ((("obs", "final_obs"), self.max_abs_obs), (("reward",), self.max_abs_reward)):
            if bound <= 0:
                continue
            for name in names:
                a = msg.arrays[name]
                if a.size and (float(a.max()) > bound or float(a.min()) < -bound):
                    raise WireError("out_of_range", f"{name} beyond +-{bound:g}")

    # ------------------------------------------------------------------------------- priorities

    def update_priorities(self, keys: Sequence[Any], values: Sequence[Any]) -> int:
        """Set new priorities ``p`` for ``keys``; return how many were applied.

        All-or-nothing validation first: ``ValueError`` if the lists differ in length, a key is not
        an integer, or a value is not a finite number >= 0 (one bad value from a diverging learner
        must not poison the tree). Keys no longer stored (evicted, used up, never existed) are
        ignored. Outside prioritized mode nothing is stored and 0 is returned.
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} priority keys but {len(values)} priorities")
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise ValueError(f"priority key {k!r} is not an integer")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise ValueError(f"priority {v!r} is not a number")
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"priority {v!r} must be finite and >= 0")
        if self._tree is None:
            return 0
        applied = 0
        for k, v in zip(keys, values):
            slot = self._slot_of(k)
            if slot is None:
                continue
            v = float(v)
            self._tree.update(slot, max(v, MIN_PRIORITY) ** self.alpha)
            if v > self.max_priority:
                self.max_priority = v
            applied += 1
        return applied

    # ----------------------------------------------------------------------------------- sample

    def drop_stale(self, learner_version: int) -> int:
        """Remove segments whose lag exceeds ``max_staleness``; return how many (cause ``"stale"``)."""
        if self.max_staleness < 0:
            return 0
        occupied = np.flatnonzero(self._key >= 0)
        stale = occupied[(int(learner_version) - self._min_version[occupied]) > self.max_staleness]
        for slot in stale:
            self._remove(int(slot))
        if len(stale):
            self.drops["stale"] += int(len(stale))
        return int(len(stale))

    def sample(self, n: int, learner_version: int, commit: bool = True,
               columns: int = 0) -> Optional[SampledBatch]:
        """``n`` distinct segments in batch layout, or None (``last_reason`` says why).

        With ``columns > 0`` the batch is sized in env columns instead: segments are drawn as for ``n``
        and kept, in the order drawn, until their columns reach ``columns`` (or ``n`` were drawn), so
        workers of 8 and of 64 envs make batches of one size. Segments are never split: a batch holds
        at most one segment's columns over ``columns``. Drawing stops early with the same distribution
        as a smaller ``n`` (every mode draws sequentially or in a random order), and importance weights
        are those of the segments kept.

        Stale segments are dropped first; then if fewer than ``n`` remain (with ``columns``: fewer than
        ``n`` and fewer than ``columns`` columns in all) the answer is None with ``last_reason =
        "not_enough_data"``. Counts one use of each segment returned and removes
        those that reached ``max_reuse``; with ``commit=False`` that is left to :meth:`commit`, which the
        caller runs once the batch was built into a message (a batch that could not be sent must not
        use its segments up).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n = {n!r} must be an integer >= 1")
        if isinstance(columns, bool) or not isinstance(columns, int) or columns < 0:
            raise ValueError(f"columns = {columns!r} must be an integer >= 0")
        self.last_reason = None
        if self.T is None:
            self.last_reason = "not_enough_data"
            return None
        self.drop_stale(learner_version)
        occupied = np.flatnonzero(self._key >= 0)
        if len(occupied) < n and (columns == 0 or int(self._cols[occupied].sum()) < columns):
            self.last_reason = "not_enough_data"
            return None
        m = min(n, len(occupied))
        is_weight = np.ones(m, dtype=np.float32)
        if self._balance is not None:
            slots = self._balance.choose(occupied, m, self._rng)
        elif self.mode == "queue":
            slots = occupied[np.argsort(self._key[occupied], kind="stable")[:m]]
        elif self.mode == "uniform":
            slots = self._rng.choice(occupied, size=m, replace=False)
        else:
            slots, probs = self._sample_prioritized(m)
            is_weight = ((len(occupied) * probs) ** (-self.beta)).astype(np.float32)
        slots = np.asarray(slots, dtype=np.int64)
        if columns > 0:  # the shortest prefix of the draw whose columns reach the target
            reached = np.flatnonzero(np.cumsum(self._cols[slots]) >= columns)
            keep = int(reached[0]) + 1 if len(reached) else m
            slots, is_weight = slots[:keep], is_weight[:keep]
        is_weight = (is_weight / is_weight.max()).astype(np.float32)
        batch = self._gather(slots, is_weight, int(learner_version))
        if commit:
            self.commit(batch)
        return batch

    def _sample_prioritized(self, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """Draw ``n`` distinct slots proportionally to priority (sequentially, without replacement).

        Each drawn leaf is zeroed for the rest of the batch and restored afterwards; the returned
        probabilities are those of the full distribution, which is what the IS weights correct for.
        """
        tree = self._tree
        assert tree is not None
        total = tree.total
        slots = np.empty(n, dtype=np.int64)
        mass = np.empty(n, dtype=np.float64)
        for i in range(n):
            s = tree.find(self._rng.random() * tree.total)
            slots[i] = s
            mass[i] = tree[s]
            tree.update(s, 0.0)
        for s, m in zip(slots, mass):
            tree.update(int(s), float(m))
        return slots, mass / total

    def _gather(self, slots: np.ndarray, is_weight: np.ndarray, learner_version: int) -> SampledBatch:
        parts = {name: self._data[name].parts(slots) for name in SEGMENT_ARRAYS}
        columns = [int(n) for n in self._cols[slots]]
        first_col = np.cumsum([0] + columns[:-1])  # the batch column of each segment's env 0
        extra: Dict[str, np.ndarray] = {}
        fo_parts, fa_parts = [], []
        for b, s in enumerate(slots):
            fa = self._final_at[s]
            if fa is not None and len(fa):  # (t, n) of the segment -> (t, c) of the batch
                fa_parts.append(np.stack([fa[:, 0], fa[:, 1] + first_col[b]], axis=1).astype(np.int32))
                fo_parts.append(self._final_obs[s])
        if fo_parts:
            extra["final_obs"] = np.concatenate(fo_parts, axis=0).astype(np.float32, copy=False)
            extra["final_at"] = np.concatenate(fa_parts, axis=0).astype(np.int32, copy=False)
        else:
            extra["final_obs"] = np.zeros((0,) + tuple(self.spec.obs_shape), dtype=np.float32)
            extra["final_at"] = np.zeros((0, 2), dtype=np.int32)
        extra["is_weight"] = is_weight
        hist = {b: 0 for b in LAG_BUCKETS}
        for pv, n in zip(parts["policy_version"], columns):  # each step's lag counts once per env
            for k, c in lag_buckets(learner_version - pv, weight=n).items():
                hist[k] += c
        episodes: List[Dict[str, Any]] = []
        for s in slots:
            if self._uses[s] == 0:
                episodes.extend(self._episodes[s])
        batch = SampledBatch(
            parts=parts,
            extra=extra,
            keys=[int(self._key[s]) for s in slots],
            workers=[self._workers[s] for s in slots],
            seqs=[self._seqs[s] for s in slots],
            columns=columns,
            episodes=episodes,
            lag_hist=hist,
            slots=slots,
        )
        return batch

    def commit(self, batch: SampledBatch) -> None:
        """Count ``batch`` as served: one use of each of its segments (removing those at ``max_reuse``),
        its lags in the histogram. Call once, right after :meth:`sample` with ``commit=False``."""
        slots = batch.slots
        for b, c in batch.lag_hist.items():
            self.lag_hist[b] += c
        self._uses[slots] += 1
        if self.max_reuse > 0:
            for s in slots:
                if self._uses[s] >= self.max_reuse:
                    self._remove(int(s))
        self.sampled += len(slots)
        self.batches += 1
