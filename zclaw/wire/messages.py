"""Message kinds of protocol v2: header schemas, builders and the segment/batch layout.

``docs/protocol.md`` is the human specification of what this module enforces; the golden files in
``tests/golden/`` pin the bytes. Every kind has a header schema (field -> allowed types); receivers
call :func:`parse` which runs :func:`zclaw.wire.protocol.decode` and then the schema check, so a
role only ever sees messages it fully understands.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack
import numpy as np

from .limits import (INT_MAX, INT_MIN, KIND_HEADER_BYTES, LIST_LIMITS, MAX_BATCH_SEGMENTS,
                     MAX_REASON_CHARS, MAX_SEGMENT_HEADER_BYTES, MAX_SEGMENT_STEPS, MAX_SPEC_ELEMENTS,
                     MAX_TEXT_CHARS, MAX_UNKNOWN_BYTES, MAX_UNKNOWN_FIELDS)
from .protocol import Frame, Message, WireError, decode, encode

_NUM = (int, float)
#: header fields every message has (the framing's, not the kind's)
_FRAMING = frozenset({"v", "kind", "arrays"})
_OPT_STR = (str, type(None))

#: how a role announces itself (``hello``) and how the broker answers it (``welcome``)
_ANNOUNCE: Dict[str, Tuple[tuple, bool]] = {
    "role": ((str,), True),
    "identity": ((str,), True),
    "host": ((str,), True),
    "pid": ((int,), True),
    "zclaw": ((str,), True),
    "spec": ((dict, type(None)), True),
    # steps T per segment: a worker's own in its hello; in a welcome the run's, which every segment must
    # have (None until the first worker said hello or a snapshot fixed it); learners and tools send None
    "segment_length": ((int, type(None)), True),
}

#: header schema of each kind: field -> (allowed python types, required)
SCHEMAS: Dict[str, Dict[str, Tuple[tuple, bool]]] = {
    # worker -> broker (PUSH): T x N steps of one worker
    "segment": {
        "worker": ((str,), True),
        "seq": ((int,), True),
        "spec_hash": ((str,), True),
        "episodes": ((list,), True),
    },
    # any role -> broker: identity, env spec and segment length. On the broker's serve socket (REQ ->
    # ROUTER) it is the handshake and heartbeat, answered by ``welcome`` or ``refused``; on ingest (PUSH)
    # it is sent on every (re)connection ahead of segments. The protocol version is the header's ``v``.
    # ``resources``: the sender's CPU, memory, threads and GPU (a worker's, with every heartbeat; the broker
    # keeps it only in the fixed shape zclaw.telemetry.resources_from_wire rebuilds)
    "hello": dict(_ANNOUNCE, resources=((dict,), False)),
    # learner -> broker (DEALER): ask for a batch, return priorities of one already trained.
    # ``batch_size``: segments; with ``columns`` > 0 the most segments, kept in the order drawn until their
    # env columns reach ``columns`` (a batch of one size from workers of any env count)
    "sample": {
        "batch_size": ((int,), True),
        "columns": ((int,), False),
        "version": ((int,), True),
        "priority_keys": ((list,), False),
        "priorities": ((list,), False),
    },
    # broker -> learner (reply to ``sample``): B segments joined along the env axis (BATCH_EXTRA)
    "batch": {
        "keys": ((list,), True),
        "columns": ((list,), True),
        "workers": ((list,), True),
        "seqs": ((list,), True),
        "episodes": ((list,), True),
        "spec_hash": ((str,), True),
        # segments the broker holds (before this batch's uses are counted): how a learner sampling several
        # broker shards weighs them
        "fill": ((int,), False),
    },
    # broker -> client (reply to ``hello``): you may go on; who the broker is, the run's env spec and segment
    # length, and the largest message its ingest accepts (a worker whose segments cannot fit stops, saying so)
    "welcome": dict(_ANNOUNCE, max_message_bytes=((int,), True)),
    # any server -> client: you are not served, and why (``cause``: bad_spec, bad_version, no_spec,
    # bad_shape); the client logs ``reason`` and stops. Its fields never change, so any protocol version
    # can read it (a server answers an older peer in that peer's version: ``encode_refusal``).
    "refused": {"reason": ((str,), True), "cause": ((str,), True)},
    # any server -> client: "not now, ask again in retry_ms"
    "retry": {"reason": ((str,), True), "retry_ms": ((int,), True)},
    # any server -> client: the request was understood but refused
    "error": {"reason": ((str,), True)},
    # learner -> workers (PUB, and REP to a snapshot request): versioned weights + normaliser
    "weights": {
        "version": ((int,), True),
        "step": ((int,), True),
        "spec_hash": ((str,), True),
        "policy": ((dict,), True),
        # the publishing learner process (host-pid-start): a new one may restart at a lower version
        "learner": ((str,), False),
    },
    # worker -> learner (REQ): Clone pattern snapshot request for the current weights
    "snapshot": {"spec_hash": ((str,), False)},
    # client -> server: empty request; server -> client: ``report`` holds the figures
    "status": {"report": ((dict,), False), "role": ((str,), False)},
}


def check_header(msg: Message, limits: bool = True) -> Message:
    """Validate ``msg``'s header against its kind's schema and the wire's limits (:mod:`.limits`);
    raise :class:`WireError` if it does not fit: ``malformed`` (a field missing or mistyped),
    ``oversize_header`` (a header larger than its kind allows), ``oversize_field`` (a string or list
    over its limit, an integer outside int64), ``unknown_fields`` (too many or too large fields outside
    the schema). ``limits=False`` checks the schema only (what :func:`make` does for a sender's own
    messages: the receiver enforces the limits)."""
    schema = SCHEMAS.get(msg.kind)
    if schema is None:
        raise WireError("unknown_kind", f"kind {msg.kind!r}")
    cap = KIND_HEADER_BYTES.get(msg.kind)
    if limits and cap is not None and msg.header_bytes > cap:
        raise WireError("oversize_header", f"{msg.kind} header of {msg.header_bytes} bytes > {cap}")
    for name, (types, required) in schema.items():
        if name not in msg.header:
            if required:
                raise WireError("malformed", f"{msg.kind} header lacks {name!r}")
            continue
        value = msg.header[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise WireError("malformed", f"{msg.kind} header field {name!r} has type {type(value).__name__}")
        if not limits:
            continue
        if isinstance(value, str):
            limit = MAX_REASON_CHARS if name == "reason" else MAX_TEXT_CHARS
            if len(value) > limit:
                raise WireError("oversize_field", f"{msg.kind} field {name!r} has {len(value)} characters "
                                f"> {limit}")
        elif isinstance(value, list):
            limit = LIST_LIMITS.get((msg.kind, name), MAX_BATCH_SEGMENTS)
            if len(value) > limit:
                raise WireError("oversize_field", f"{msg.kind} field {name!r} has {len(value)} entries "
                                f"> {limit}")
        elif isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
            raise WireError("oversize_field", f"{msg.kind} field {name!r} is outside int64")
    unknown = [k for k in msg.header if k not in schema and k not in _FRAMING] if limits else []
    if unknown:
        if len(unknown) > MAX_UNKNOWN_FIELDS:
            raise WireError("unknown_fields", f"{len(unknown)} fields outside the {msg.kind} schema "
                            f"> {MAX_UNKNOWN_FIELDS}")
        size = sum(len(k) + len(msgpack.packb(msg.header[k], use_bin_type=True)) for k in unknown)
        if size > MAX_UNKNOWN_BYTES:
            raise WireError("unknown_fields", f"{size} bytes of fields outside the {msg.kind} schema "
                            f"> {MAX_UNKNOWN_BYTES}")
    return msg


def parse(frames: Sequence[Frame], kinds: Optional[Sequence[str]] = None) -> Message:
    """Decode, validate and schema-check one received message; optionally restrict the kinds accepted."""
    msg = check_header(decode(frames))
    if kinds is not None and msg.kind not in kinds:
        raise WireError("unexpected_kind", f"{msg.kind!r} where {list(kinds)} are accepted")
    return msg


def make(kind: str, arrays: Optional[Mapping[str, np.ndarray]] = None, **fields: Any) -> List[Frame]:
    """Build the frames of a message of ``kind`` (the header is checked against the schema first)."""
    header = {"kind": kind, **fields}
    check_header(Message(header, {}), limits=False)
    return encode(header, arrays)


# --------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class EnvSpec:
    """What every role must agree on about the env: the id and the observation and action spaces."""

    env_id: str
    obs_shape: Tuple[int, ...]
    action_shape: Tuple[int, ...]
    action_low: Tuple[float, ...]
    action_high: Tuple[float, ...]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "env_id": self.env_id,
            "obs_shape": list(self.obs_shape),
            "action_shape": list(self.action_shape),
            "action_low": [float(x) for x in self.action_low],
            "action_high": [float(x) for x in self.action_high],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EnvSpec":
        """The spec of a map that came off the wire; :class:`WireError` (``bad_spec``) if it is not
        one: fields missing or mistyped, shapes not lists of at most 8 positive ints whose product is at
        most ``MAX_SPEC_ELEMENTS``, bounds not finite numbers, the id over ``MAX_TEXT_CHARS``."""
        try:
            if not isinstance(d, Mapping):
                raise TypeError("not a map")
            shapes = [d["obs_shape"], d["action_shape"]]
            bounds = [d["action_low"], d["action_high"]]
            for shape in shapes:
                if (not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= 8
                        or any(isinstance(x, bool) or not isinstance(x, int) for x in shape)):
                    raise TypeError("a shape must be a list of 1 to 8 integers")
                if any(x <= 0 for x in shape) or math.prod(shape) > MAX_SPEC_ELEMENTS:
                    raise ValueError(f"shapes must be positive with at most {MAX_SPEC_ELEMENTS} elements")
            for b in bounds:
                if (not isinstance(b, (list, tuple)) or len(b) > MAX_SPEC_ELEMENTS
                        or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in b)):
                    raise TypeError("action bounds must be lists of numbers")
            if not isinstance(d["env_id"], str) or len(d["env_id"]) > MAX_TEXT_CHARS:
                raise TypeError(f"env_id must be a string of at most {MAX_TEXT_CHARS} characters")
            spec = cls(
                env_id=str(d["env_id"]),
                obs_shape=tuple(int(x) for x in d["obs_shape"]),
                action_shape=tuple(int(x) for x in d["action_shape"]),
                action_low=tuple(float(x) for x in d["action_low"]),
                action_high=tuple(float(x) for x in d["action_high"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise WireError("bad_spec", f"env spec is incomplete or mistyped ({exc})") from None
        n_act = int(np.prod(spec.action_shape))
        if len(spec.action_low) != n_act or len(spec.action_high) != n_act:
            raise WireError("bad_spec", "action bounds do not match the action shape")
        if not all(math.isfinite(x) for x in spec.action_low + spec.action_high):
            raise WireError("bad_spec", "action bounds must be finite")
        return spec

    @cached_property  # the spec is frozen; segments and batches compare it on the broker's hot path
    def hash(self) -> str:
        """A short digest that two roles compare to know they run the same env."""
        blob = msgpack.packb(self.to_dict(), use_bin_type=True)
        return hashlib.sha256(blob).hexdigest()[:16]


# ------------------------------------------------------------------------------------------ segment

#: Per-step arrays of a segment: name -> (dtype, shape as a function of T, N and the spec).
#: ``obs`` has T+1 rows: the last one bootstraps the value of the step after the segment. Every array but
#: ``policy_version`` (one per step, shared by the segment's envs) has the env axis at :data:`ENV_AXIS`.
SEGMENT_ARRAYS: Dict[str, Tuple[str, Any]] = {
    "obs": ("<f4", lambda T, N, s: (T + 1, N) + s.obs_shape),
    "action": ("<f4", lambda T, N, s: (T, N) + s.action_shape),
    "reward": ("<f4", lambda T, N, s: (T, N)),
    "terminated": ("|b1", lambda T, N, s: (T, N)),
    "truncated": ("|b1", lambda T, N, s: (T, N)),
    "option": ("<i4", lambda T, N, s: (T, N)),
    "option_start": ("|b1", lambda T, N, s: (T, N)),
    "logp_action": ("<f4", lambda T, N, s: (T, N)),
    "logp_option": ("<f4", lambda T, N, s: (T, N)),
    "policy_version": ("<i8", lambda T, N, s: (T,)),
}
#: the env axis of the per-env arrays: a batch joins segments of any env count N along it
ENV_AXIS = 1
#: the per-step arrays a batch joins along :data:`ENV_AXIS` (all but ``policy_version``)
ENV_ARRAYS = tuple(name for name in SEGMENT_ARRAYS if name != "policy_version")
#: most envs one segment may carry (a GPU worker's batch of envs; bounds a column count a peer chooses)
MAX_SEGMENT_ENVS = 1 << 16
FINAL_ARRAYS: Dict[str, Tuple[str, Any]] = {
    "final_obs": ("<f4", lambda M, s: (M,) + s.obs_shape),
    "final_at": ("<i4", lambda M, s: (M, 2)),
}
EPISODE_KEYS = {"return": _NUM, "length": (int,), "success": (bool, type(None))}


#: the most options a policy may have (``policy.options``); an option index at or above it is refused,
#: which also bounds what a receiver keeps per option (the broker's option-balanced counts)
MAX_OPTIONS = 64


def segment_dims(msg: Message, spec: EnvSpec, max_options: int = MAX_OPTIONS) -> Tuple[int, int, int]:
    """Check a segment's arrays against ``spec``; return (T, N, M). Raise :class:`WireError` if off."""
    if msg.kind != "segment":
        raise WireError("unexpected_kind", msg.kind)
    if msg["spec_hash"] != spec.hash:
        raise WireError("bad_spec", f"segment for spec {msg['spec_hash']}, run has {spec.hash}")
    names = set(SEGMENT_ARRAYS) | set(FINAL_ARRAYS)
    if set(msg.arrays) != names:
        raise WireError("bad_shape", f"segment arrays {sorted(msg.arrays)} != {sorted(names)}")
    act = msg.arrays["action"]
    if act.ndim < 2 or act.shape[0] < 1 or act.shape[1] < 1:
        raise WireError("bad_shape", "action must be [T, N, ...] with T, N >= 1")
    T, N = act.shape[:2]
    if N > MAX_SEGMENT_ENVS or T > MAX_SEGMENT_STEPS:
        raise WireError("bad_shape", f"segment of {T} steps x {N} envs: at most {MAX_SEGMENT_STEPS} x "
                        f"{MAX_SEGMENT_ENVS}")
    M = msg.arrays["final_obs"].shape[0] if msg.arrays["final_obs"].ndim else -1
    for name, (dtype, shape) in _segment_layout(T, N, M, spec):
        _expect(msg.arrays[name], name, dtype, shape)
    fa = msg.arrays["final_at"]
    if M and ((fa[:, 0] < 0).any() or (fa[:, 0] >= T).any() or (fa[:, 1] < 0).any() or (fa[:, 1] >= N).any()):
        raise WireError("bad_shape", "final_at indexes outside the segment")
    # one pass each: a negative int32 read as uint32 is >= 2**31, so a single max catches both ends
    if msg.arrays["option"].view("<u4").max() >= max_options:
        raise WireError("bad_value", "option index out of range")
    if msg.arrays["policy_version"].min() < 0:
        raise WireError("bad_value", "negative policy version")
    episodes = msg["episodes"]
    if len(episodes) > T * N:
        raise WireError("malformed", "more episodes than steps")
    for ep in episodes:
        if (not isinstance(ep, dict) or not set(ep) <= set(EPISODE_KEYS)
                or "return" not in ep or "length" not in ep):
            raise WireError("malformed", "episode stats must be maps of return, length and optional success")
        for k, types in EPISODE_KEYS.items():
            if k in ep and (not isinstance(ep[k], types) or (isinstance(ep[k], bool) and bool not in types)):
                raise WireError("malformed", f"episode {k} has type {type(ep[k]).__name__}")
        if not math.isfinite(ep["return"]):
            raise WireError("non_finite", "episode return is not finite")
    return T, N, M


def max_segment_bytes(spec: EnvSpec, T: int, N: int, truncations: Optional[int] = None) -> int:
    """Bytes of the largest legal T x N segment of ``spec`` with ``truncations`` rows of ``final_obs`` (None:
    a truncation at every step, M = T x N, the bound), plus the largest segment header the wire allows."""
    M = T * N if truncations is None else truncations
    total = MAX_SEGMENT_HEADER_BYTES
    for dtype, shape_of in SEGMENT_ARRAYS.values():
        total += math.prod(shape_of(T, N, spec)) * np.dtype(dtype).itemsize
    for dtype, shape_of in FINAL_ARRAYS.values():
        total += math.prod(shape_of(M, spec)) * np.dtype(dtype).itemsize
    return int(total)


@lru_cache(maxsize=64)
def _segment_layout(T: int, N: int, M: int,
                    spec: EnvSpec) -> Tuple[Tuple[str, Tuple[str, Tuple[int, ...]]], ...]:
    """(name, (dtype, shape)) of every array of a T x N segment with M truncations (the same for every
    segment of a run, so worked out once, not per message)."""
    out = [(name, (dtype, tuple(shape_of(T, N, spec)))) for name, (dtype, shape_of) in SEGMENT_ARRAYS.items()]
    out += [(name, (dtype, tuple(shape_of(M, spec)))) for name, (dtype, shape_of) in FINAL_ARRAYS.items()]
    return tuple(out)


def _expect(arr: np.ndarray, name: str, dtype: str, shape: Tuple[int, ...]) -> None:
    if arr.dtype.str != dtype:
        raise WireError("bad_dtype", f"{name}: dtype {arr.dtype.str}, expected {dtype}")
    if tuple(arr.shape) != tuple(shape):
        raise WireError("bad_shape", f"{name}: shape {list(arr.shape)}, expected {list(shape)}")


@dataclass
class Segment:
    """T steps x N envs of one worker, in wire layout (see :data:`SEGMENT_ARRAYS`)."""

    worker: str
    seq: int
    spec_hash: str
    arrays: Dict[str, np.ndarray]
    episodes: List[Dict[str, Any]] = field(default_factory=list)

    def frames(self) -> List[Frame]:
        return make(
            "segment", self.arrays, worker=self.worker, seq=self.seq, spec_hash=self.spec_hash,
            episodes=self.episodes
        )

    @property
    def steps(self) -> int:
        T, N = self.arrays["action"].shape[:2]
        return int(T * N)


# -------------------------------------------------------------------------------------------- batch

#: A batch joins B stored segments of T steps and N_b envs each along the env axis: every array of
#: :data:`ENV_ARRAYS` is ``[T(+1), C, ...]`` with C = sum(N_b) *columns* (column c is one env's T steps;
#: the header's ``columns`` lists N_b, so segment b holds columns ``sum(N_<b) .. sum(N_<=b) - 1``);
#: ``policy_version`` is stacked per segment, ``[B, T]``; the sparse truncation arrays are re-indexed as
#: ``final_at`` rows (t, c); ``is_weight[B]`` is each segment's importance weight (1 outside prioritized
#: mode). Protocol v1 stacked segments of one N as ``[B, T, N, ...]``; v2 lets every worker have its own N.
BATCH_EXTRA: Dict[str, Tuple[str, Any]] = {
    "final_obs": ("<f4", lambda M, s: (M,) + s.obs_shape),
    "final_at": ("<i4", lambda M, s: (M, 2)),
    "is_weight": ("<f4", lambda B, s: (B,)),
}


def batch_shape(name: str, B: int, T: int, C: int, spec: EnvSpec) -> Tuple[int, ...]:
    """The shape of the per-step array ``name`` in a batch of B segments, T steps and C columns."""
    if name == "policy_version":
        return (B, T)
    return tuple(SEGMENT_ARRAYS[name][1](T, C, spec))


def batch_dims(msg: Message, spec: EnvSpec) -> Tuple[int, int, int, int]:
    """Check a batch against ``spec``; return (B, T, C, M). Raise :class:`WireError` if off."""
    if msg.kind != "batch":
        raise WireError("unexpected_kind", msg.kind)
    if msg["spec_hash"] != spec.hash:
        raise WireError("bad_spec", f"batch for spec {msg['spec_hash']}, learner has {spec.hash}")
    names = set(SEGMENT_ARRAYS) | set(BATCH_EXTRA)
    if set(msg.arrays) != names:
        raise WireError("bad_shape", f"batch arrays {sorted(msg.arrays)} != {sorted(names)}")
    act, pv = msg.arrays["action"], msg.arrays["policy_version"]
    if act.ndim < 2 or pv.ndim != 2:
        raise WireError("bad_shape", "action must be [T, C, ...] and policy_version [B, T]")
    T, C = act.shape[:2]
    B = pv.shape[0]
    columns = msg["columns"]
    if len(columns) != B or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in columns):
        raise WireError("malformed", "columns must list one env count >= 1 per segment")
    if sum(columns) != C:
        raise WireError("bad_shape", f"columns add up to {sum(columns)}, the arrays have {C}")
    M = msg.arrays["final_obs"].shape[0] if msg.arrays["final_obs"].ndim else -1
    for name, (dtype, _) in SEGMENT_ARRAYS.items():
        _expect(msg.arrays[name], name, dtype, batch_shape(name, B, T, C, spec))
    _expect(msg.arrays["final_obs"], "final_obs", "<f4", BATCH_EXTRA["final_obs"][1](M, spec))
    _expect(msg.arrays["final_at"], "final_at", "<i4", BATCH_EXTRA["final_at"][1](M, spec))
    _expect(msg.arrays["is_weight"], "is_weight", "<f4", (B,))
    fa = msg.arrays["final_at"]
    if M and ((fa[:, 0] < 0).any() or (fa[:, 0] >= T).any() or (fa[:, 1] < 0).any() or (fa[:, 1] >= C).any()):
        raise WireError("bad_shape", "final_at indexes outside the batch")
    if len(msg["keys"]) != B or len(msg["workers"]) != B or len(msg["seqs"]) != B:
        raise WireError("malformed", "keys, workers and seqs must have one entry per segment")
    return B, T, C, M
