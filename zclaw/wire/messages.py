"""Message kinds of protocol v1: header schemas, builders and the segment/batch layout.

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
                     MAX_REASON_CHARS, MAX_SEGMENT_HEADER_BYTES, MAX_SPEC_ELEMENTS, MAX_TEXT_CHARS,
                     MAX_UNKNOWN_BYTES, MAX_UNKNOWN_FIELDS)
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
    # any role -> broker: identity and env spec. On the broker's serve socket (REQ -> ROUTER) it is the
    # handshake and heartbeat, answered by ``welcome`` or ``refused``; on ingest (PUSH) it is sent on every
    # (re)connection ahead of segments. The protocol version is the header's ``v``.
    "hello": dict(_ANNOUNCE),
    # learner -> broker (DEALER): ask for a batch, return priorities of one already trained
    "sample": {
        "batch_size": ((int,), True),
        "version": ((int,), True),
        "priority_keys": ((list,), False),
        "priorities": ((list,), False),
    },
    # broker -> learner (reply to ``sample``): B segments, each per-step array in one part per segment
    "batch": {
        "keys": ((list,), True),
        "workers": ((list,), True),
        "seqs": ((list,), True),
        "episodes": ((list,), True),
        "spec_hash": ((str,), True),
    },
    # broker -> client (reply to ``hello``): you may go on; who the broker is and the run's env spec
    "welcome": dict(_ANNOUNCE),
    # any server -> client: you are not served, and why (``cause``: bad_spec, bad_version, no_spec); the
    # client logs ``reason`` and stops. Its fields never change, so any protocol version can read it.
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
#: ``obs`` has T+1 rows: the last one bootstraps the value of the step after the segment.
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
#: Sparse arrays: the real final observation of steps that were truncated (time limit), which the
#: autoreset replaced in ``obs``; ``final_at`` rows are (t, n). Needed to bootstrap a truncation.
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


def max_segment_bytes(spec: EnvSpec, T: int, N: int) -> int:
    """Bytes of the largest legal T x N segment of ``spec``: every array with a truncation at every step
    (M = T x N rows of ``final_obs``), plus the largest segment header the wire allows."""
    total = MAX_SEGMENT_HEADER_BYTES
    for dtype, shape_of in SEGMENT_ARRAYS.values():
        total += math.prod(shape_of(T, N, spec)) * np.dtype(dtype).itemsize
    for dtype, shape_of in FINAL_ARRAYS.values():
        total += math.prod(shape_of(T * N, spec)) * np.dtype(dtype).itemsize
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

#: A batch stacks B stored segments: every array of :data:`SEGMENT_ARRAYS` with a leading B axis,
#: the sparse truncation arrays re-indexed as ``final_at`` rows (b, t, n), and ``is_weight[B]``, the
#: importance weight of each segment (1 outside prioritized mode).
BATCH_EXTRA: Dict[str, Tuple[str, Any]] = {
    "final_obs": ("<f4", lambda M, s: (M,) + s.obs_shape),
    "final_at": ("<i4", lambda M, s: (M, 3)),
    "is_weight": ("<f4", lambda B, s: (B,)),
}


def batch_dims(msg: Message, spec: EnvSpec) -> Tuple[int, int, int, int]:
    """Check a batch against ``spec``; return (B, T, N, M). Raise :class:`WireError` if off."""
    if msg.kind != "batch":
        raise WireError("unexpected_kind", msg.kind)
    if msg["spec_hash"] != spec.hash:
        raise WireError("bad_spec", f"batch for spec {msg['spec_hash']}, learner has {spec.hash}")
    names = set(SEGMENT_ARRAYS) | set(BATCH_EXTRA)
    if set(msg.arrays) != names:
        raise WireError("bad_shape", f"batch arrays {sorted(msg.arrays)} != {sorted(names)}")
    act = msg.arrays["action"]
    if act.ndim < 3:
        raise WireError("bad_shape", "action must be [B, T, N, ...]")
    B, T, N = act.shape[:3]
    M = msg.arrays["final_obs"].shape[0] if msg.arrays["final_obs"].ndim else -1
    for name, (dtype, shape_of) in SEGMENT_ARRAYS.items():
        _expect(msg.arrays[name], name, dtype, (B,) + tuple(shape_of(T, N, spec)))
    _expect(msg.arrays["final_obs"], "final_obs", "<f4", BATCH_EXTRA["final_obs"][1](M, spec))
    _expect(msg.arrays["final_at"], "final_at", "<i4", BATCH_EXTRA["final_at"][1](M, spec))
    _expect(msg.arrays["is_weight"], "is_weight", "<f4", (B,))
    if len(msg["keys"]) != B or len(msg["workers"]) != B or len(msg["seqs"]) != B:
        raise WireError("malformed", "keys, workers and seqs must have one entry per segment")
    return B, T, N, M
