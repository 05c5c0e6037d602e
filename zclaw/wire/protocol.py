"""Wire protocol v2: framing, array codec and strict validation.

A message is a list of ZeroMQ frames ``[header, array_0, array_1, ...]``. The header is a msgpack map
that always carries ``v`` (the protocol version) and ``kind``; numpy arrays travel as raw frames whose
dtype and shape the header lists under ``arrays`` (msgpack cannot pack ndarrays, and raw frames sent
with ``copy=False`` avoid a copy). Sockets that use ``CONFLATE`` keep only the last frame of a
multipart message, so those carry the *packed* form: one frame holding a 4-byte big-endian header
length, the header, then the array bytes back to back.

An array may travel in *parts* (:class:`Parts`): split along one axis into several frames, which the
receiver joins into one array. Protocol v2 made the part sizes free (v1 split a stacked leading axis
into equal rows): a batch joins segments of different env counts along the env axis, each segment's
frame forwarded as the broker holds it.

Every receive is validated before anything else looks at it; anything not fully understood raises
:class:`WireError` with a short ``cause`` (used as the drop-counter key) and is never half-applied.
Nothing that came off a socket is ever unpickled.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import msgpack
import numpy as np
import zmq

PROTOCOL_VERSION = 2
#: ``refused`` is readable at any of these versions (its fields never change): a server answers an older
#: peer's hello in that peer's version, so the peer can decode why it is turned away and exit
READABLE_REFUSAL_VERSIONS = (1, 2)

#: dtypes allowed on the wire, by their numpy ``.str`` (explicit little-endian or byte-sized).
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<f2", "<i1", "<i2", "<i4", "<i8", "|i1", "|u1", "|b1", "<u2",
                            "<u4"})

_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}

#: the largest header we decode; headers are small maps, arrays travel in their own frames.
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAYS = 64
MAX_PARTS = 4096  # frames one array may be split into (a batch sends one part per segment)
#: parts smaller than this are not worth a frame each: pyzmq copies frames under its ``COPY_THRESHOLD``
#: (64 KiB) even with ``copy=False``, so a sender stacks such parts into one frame instead
PART_MIN_BYTES = 64 << 10
MAX_NDIM = 8

Frame = Union[bytes, memoryview, Any]  # bytes, memoryview or zmq.Frame


class WireError(ValueError):
    """A message that does not conform to the protocol; ``cause`` names the drop counter."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause
        self.detail = detail


def _as_buffer(frame: Frame) -> memoryview:
    """A flat byte view of a frame (bytes, memoryview of any shape, or zmq.Frame), without copying."""
    if type(frame) is zmq.Frame:  # the common case, first: a received frame's buffer is flat bytes
        return frame.buffer
    buf = getattr(frame, "buffer", None)  # zmq.Frame subclasses
    view = buf if buf is not None else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


_WIRE_NAMES: Dict[np.dtype, str] = {}  # dtype -> allowed wire name, filled as dtypes are first sent


def wire_dtype(dtype: np.dtype) -> str:
    """The allowlisted wire name of a numpy dtype, normalised to little-endian."""
    dt = np.dtype(dtype)
    name = _WIRE_NAMES.get(dt)
    if name is None:  # every array of every message sent asks: work the answer out once per dtype
        name = dt.newbyteorder("<").str if dt.itemsize > 1 else dt.str
        if name not in ALLOWED_DTYPES:
            raise WireError("bad_dtype", f"dtype {dt} is not allowed on the wire")
        _WIRE_NAMES[dt] = name
    return name


def _wire_array(arr: Any) -> np.ndarray:
    a = np.asarray(arr)
    if not a.dtype.isnative and a.dtype.itemsize > 1:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


def _payload(a: np.ndarray) -> Frame:
    """What to send for a contiguous array: the received ``zmq.Frame`` it views, if it views one whole.

    An array decoded from a received frame (:func:`decode`) is a view of that frame's buffer; sending
    the frame itself makes ZeroMQ share the message by reference count, where sending the view's
    buffer with ``copy=False`` would register it with pyzmq's garbage-collector thread (which on the
    broker's batch replies cost more CPU than the stacking it saved). Anything else goes as its bytes.
    """
    if not a.size:
        return b""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    frame = base.obj if isinstance(base, memoryview) else base
    # contiguous and as long as the whole frame: then it cannot start anywhere but the frame's start
    if isinstance(frame, zmq.Frame) and a.flags.c_contiguous and a.nbytes == len(frame):
        return frame
    return a.data


class Parts(NamedTuple):
    """An array sent as several frames: ``arrays`` joined along ``axis`` (every other dimension equal).

    Why: the broker answers a batch straight from the segments it holds, one frame per segment, and the
    receiver joins them once (:func:`decode`); stacking them first would copy every byte on the broker.
    """

    arrays: Sequence[np.ndarray]
    axis: int


def encode(
    header: Mapping[str, Any], arrays: Optional[Mapping[str, Union[np.ndarray, Parts]]] = None
) -> List[Frame]:
    """Encode a header and named arrays into frames ``[header, *array_bytes]`` (no copies of arrays).

    An array given as :class:`Parts` travels in one frame per part; its header entry is
    ``[name, dtype, joined shape, axis, [size of each part along axis]]`` (a single part is sent as a
    plain array). ``header`` must not already contain ``v`` or ``arrays``; ``kind`` is required.
    """
    if "kind" not in header:
        raise ValueError("header needs a 'kind'")
    descr = []
    frames: List[Frame] = [b""]
    for name, arr in (arrays or {}).items():
        if isinstance(arr, Parts):
            parts = [_wire_array(p) for p in arr.arrays]
            axis = arr.axis
            if not parts or len({p.dtype.str for p in parts}) != 1 or not 0 <= axis < parts[0].ndim:
                raise ValueError(f"array {name!r}: parts must be a non-empty list of one dtype with an axis "
                                 f"{axis} to join along")
            rest = {p.shape[:axis] + p.shape[axis + 1:] for p in parts}
            if len(rest) != 1 or len({p.ndim for p in parts}) != 1:
                raise ValueError(f"array {name!r}: parts differ outside axis {axis}")
            if len(parts) > 1:
                sizes = [int(p.shape[axis]) for p in parts]
                shape = list(parts[0].shape)
                shape[axis] = sum(sizes)
                descr.append([name, wire_dtype(parts[0].dtype), shape, axis, sizes])
                frames.extend(_payload(p) for p in parts)
                continue
            arr = parts[0]
        elif isinstance(arr, (list, tuple)):
            raise ValueError(f"array {name!r}: a list of arrays must be given as Parts(arrays, axis)")
        a = _wire_array(arr)
        descr.append([name, wire_dtype(a.dtype), list(a.shape)])
        frames.append(_payload(a))
    full = dict(header)
    full["v"] = PROTOCOL_VERSION
    full["arrays"] = descr
    frames[0] = msgpack.packb(full, use_bin_type=True)
    return frames


def encode_refusal(reason: str, cause: str, version: int = PROTOCOL_VERSION) -> List[Frame]:
    """A ``refused`` message in protocol ``version`` (one of :data:`READABLE_REFUSAL_VERSIONS`), so that a
    peer of an older version can read why it is turned away; its header is the same at every version."""
    if version not in READABLE_REFUSAL_VERSIONS:
        version = PROTOCOL_VERSION
    header = {"kind": "refused", "reason": reason, "cause": cause, "v": version, "arrays": []}
    return [msgpack.packb(header, use_bin_type=True)]


def peer_version(frames: Sequence[Frame]) -> Optional[int]:
    """The protocol version a message's header claims (None if it has no readable one): what a server
    answers a peer of another version in (:func:`encode_refusal`). Only called on a message already
    refused for its version, and no larger than the socket's cap."""
    try:
        raw = _as_buffer(frames[0])
        if len(frames) == 1 and raw[:1].tobytes() == b"\x00":  # packed: length prefix, header, arrays
            (hlen,) = struct.unpack(">I", bytes(raw[:4]))
            raw = raw[4:4 + hlen]
        header = msgpack.unpackb(raw, raw=False, max_bin_len=MAX_HEADER_BYTES, max_str_len=MAX_HEADER_BYTES)
    except Exception:  # msgpack raises several unrelated types on garbage
        return None
    v = header.get("v") if isinstance(header, dict) else None
    return v if type(v) is int else None


def pack(frames: Sequence[Frame]) -> bytes:
    """Join frames into the single-frame (packed) form used on ``CONFLATE`` sockets."""
    header = bytes(_as_buffer(frames[0]))
    parts = [struct.pack(">I", len(header)), header]
    parts.extend(bytes(_as_buffer(f)) for f in frames[1:])
    return b"".join(parts)


def unpack(frame: Frame) -> List[memoryview]:
    """Split a packed single frame back into ``[header, *array_bytes]`` using the header's array list."""
    buf = _as_buffer(frame)
    if len(buf) < 4:
        raise WireError("malformed", "packed frame shorter than its length prefix")
    (hlen,) = struct.unpack(">I", bytes(buf[:4]))
    if hlen > MAX_HEADER_BYTES or 4 + hlen > len(buf):
        raise WireError("malformed", "packed header length out of range")
    header_bytes = buf[4 : 4 + hlen]
    header = _decode_header(header_bytes)
    out: List[memoryview] = [header_bytes]
    pos = 4 + hlen
    for name, dtype, shape, axis, sizes in _array_list(header):
        for n in _frame_bytes(shape, _DTYPES[dtype].itemsize, axis, sizes):
            if pos + n > len(buf):
                raise WireError("bad_length", f"array {name!r} runs past the end of the packed frame")
            out.append(buf[pos : pos + n])
            pos += n
    if pos != len(buf):
        raise WireError("bad_length", "trailing bytes after the last array of a packed frame")
    return out


def _decode_header(raw: Frame) -> Dict[str, Any]:
    buf = _as_buffer(raw)
    if len(buf) > MAX_HEADER_BYTES:
        raise WireError("oversize", f"header of {len(buf)} bytes")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError("malformed", f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise WireError("malformed", "header is not a map")
    if header.get("v") != PROTOCOL_VERSION and not (header.get("kind") == "refused"
                                                    and header.get("v") in READABLE_REFUSAL_VERSIONS):
        raise WireError("bad_version", f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    if not isinstance(header.get("kind"), str):
        raise WireError("malformed", "header has no kind")
    return header


_MAX_DIM = 1 << 40
#: what numpy can describe at all (its sizes are signed 64-bit); only zero-sized arrays get near it
_MAX_NDARRAY_BYTES = 1 << 62


def _dims_ok(shape: Any) -> bool:
    """``shape`` is a list of at most MAX_NDIM plain ints in [0, 2**40) (bools are not dimensions).
    This runs for every array of every message received; a plain loop over a handful of dimensions beats
    building a set of their types (~0.25 against ~0.8 us for three)."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        return False
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_DIM:
            return False
    return True


ArrayEntry = Tuple[str, str, Tuple[int, ...], int, Optional[List[int]]]


def _array_list(header: Mapping[str, Any]) -> List[ArrayEntry]:
    """The validated ``arrays`` list: (name, dtype, shape, axis, part sizes) per array; an array in one
    frame has axis 0 and sizes None."""
    descr = header.get("arrays")
    if not isinstance(descr, list) or len(descr) > MAX_ARRAYS:
        raise WireError("malformed", "header 'arrays' is not a list of at most %d entries" % MAX_ARRAYS)
    out = []
    seen = set()
    total_parts = 0
    for entry in descr:
        if not isinstance(entry, list) or len(entry) not in (3, 5):
            raise WireError("malformed", "array entry is not [name, dtype, shape] or [name, "
                            "dtype, shape, axis, sizes]")
        name, dtype, shape = entry[0], entry[1], entry[2]
        if not isinstance(name, str) or name in seen:
            raise WireError("malformed", f"array name {name!r} missing or repeated")
        seen.add(name)
        if dtype not in ALLOWED_DTYPES:
            raise WireError("bad_dtype", f"array {name!r} has dtype {dtype!r}")
        if not _dims_ok(shape):
            raise WireError("bad_shape", f"array {name!r} has shape {shape!r}")
        axis, sizes, parts = 0, None, 1
        if len(entry) == 5:
            axis, sizes = entry[3], entry[4]
            if not (type(axis) is int and 0 <= axis < len(shape) and type(sizes) is list
                    and 2 <= len(sizes) <= MAX_PARTS and all(type(n) is int and n >= 1 for n in sizes)
                    and sum(sizes) == shape[axis]):
                raise WireError("bad_shape", f"array {name!r}: parts {sizes!r} along axis {axis!r} of shape "
                                             f"{shape!r} (needs 2..{MAX_PARTS} sizes >= 1 summing to that "
                                             f"dimension)")
            parts = len(sizes)
        total_parts += parts
        if total_parts > MAX_PARTS:
            raise WireError("malformed", f"more than {MAX_PARTS} array frames")
        out.append((name, dtype, tuple(shape), axis, sizes))
    return out


def _part_shapes(shape: Tuple[int, ...], axis: int, sizes: Optional[List[int]]) -> List[Tuple[int, ...]]:
    """The shape of each frame of an array: the whole shape, or one per part along ``axis``."""
    if sizes is None:
        return [shape]
    return [shape[:axis] + (n,) + shape[axis + 1:] for n in sizes]


def _frame_bytes(shape: Tuple[int, ...], itemsize: int, axis: int, sizes: Optional[List[int]]) -> List[int]:
    """Bytes of each frame of an array, in Python ints (no overflow whatever the header claims)."""
    return [math.prod(s) * itemsize for s in _part_shapes(shape, axis, sizes)]


class Message:
    """A decoded, validated message: ``kind``, the header map and numpy views of its arrays."""

    __slots__ = ("header", "arrays", "header_bytes")

    def __init__(self, header: Dict[str, Any], arrays: Dict[str, np.ndarray], header_bytes: int = 0) -> None:
        self.header = header
        self.arrays = arrays
        #: bytes of the header frame it was decoded from (0 for a message built locally)
        self.header_bytes = header_bytes

    @property
    def kind(self) -> str:
        return self.header["kind"]

    def __getitem__(self, key: str) -> Any:
        return self.header[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)

    def __repr__(self) -> str:
        shapes = {k: (v.dtype.str, v.shape) for k, v in self.arrays.items()}
        return f"Message(kind={self.kind!r}, arrays={shapes})"


def decode(frames: Sequence[Frame], check_finite: bool = True) -> Message:
    """Decode and validate frames into a :class:`Message`; raise :class:`WireError` on anything off.

    Arrays are zero-copy views of the received frames, writable where the frame's buffer is (pyzmq's
    received frames are: the receiver owns them; the broker's store keeps read-only views, see
    ``zclaw.broker.slots``). An array sent in parts is one fresh joined copy. With ``check_finite``
    every float array is checked for NaN and infinity.
    """
    if len(frames) == 0:
        raise WireError("malformed", "empty message")
    if len(frames) == 1 and _as_buffer(frames[0])[:1].tobytes() == b"\x00":
        frames = unpack(frames[0])  # packed form: a big-endian length prefix starts with a zero byte
    header = _decode_header(frames[0])
    descr = _array_list(header)
    n_frames = sum(1 if sizes is None else len(sizes) for _, _, _, _, sizes in descr)
    if n_frames != len(frames) - 1:
        raise WireError("bad_length", f"header lists {n_frames} array frames, message has {len(frames) - 1}")
    # every frame's length against what its header entry implies, in Python ints (no overflow), before
    # anything is allocated: a header may claim any shape, only the bytes received are real
    pos = 1
    for name, dtype, shape, axis, sizes in descr:
        if math.prod(d for d in shape if d) * _DTYPES[dtype].itemsize >= _MAX_NDARRAY_BYTES:
            # numpy refuses such a shape even with a zero dimension somewhere (the array holds nothing)
            raise WireError("bad_shape", f"array {name!r} has shape {list(shape)}: beyond any address space")
        for expected in _frame_bytes(shape, _DTYPES[dtype].itemsize, axis, sizes):
            got = len(_as_buffer(frames[pos]))
            if got != expected:
                raise WireError("bad_length", f"array {name!r}: {got} bytes, {dtype}{list(shape)} in "
                                f"{1 if sizes is None else len(sizes)} frame(s) needs {expected} in this one")
            pos += 1
    arrays: Dict[str, np.ndarray] = {}
    pos = 1
    for name, dtype, shape, axis, sizes in descr:
        dt = _DTYPES[dtype]  # _array_list allowed only these
        if sizes is None:
            arrays[name] = _view(frames[pos], name, dt, shape, check_finite)
            pos += 1
            continue
        # parts, each checked, copied once into a fresh array (which the receiver needs anyway)
        out = np.empty(shape, dt)  # no larger than the parts' bytes, which were all received
        lo = 0
        for part_shape in _part_shapes(shape, axis, sizes):
            hi = lo + part_shape[axis]
            out[(slice(None),) * axis + (slice(lo, hi),)] = _view(frames[pos], name, dt, part_shape,
                                                                  check_finite)
            lo = hi
            pos += 1
        arrays[name] = out
    del header["arrays"]
    return Message(header, arrays, len(_as_buffer(frames[0])))


def _view(frame: Frame, name: str, dt: np.dtype, shape: Tuple[int, ...], check_finite: bool) -> np.ndarray:
    """An array view of one frame, after checking its length (and finiteness)."""
    # a received zmq.Frame is a flat byte buffer itself: numpy can view it without a memoryview first
    buf = frame if type(frame) is zmq.Frame else _as_buffer(frame)
    expected = math.prod(shape) * dt.itemsize
    if len(buf) != expected:
        raise WireError("bad_length", f"array {name!r}: {len(buf)} bytes, "
                        f"{dt.str}{list(shape)} needs {expected}")
    # a zero-byte array: numpy refuses shapes whose other dimensions overflow even when one is 0
    arr = np.ndarray(shape, dt, buf) if expected else np.zeros(shape, dt)
    if check_finite and dt.kind == "f" and expected and not np.isfinite(arr).all():
        raise WireError("non_finite", f"array {name!r} holds NaN or infinity")
    return arr
