"""Wire protocol v1: framing, array codec and strict validation.

A message is a list of ZeroMQ frames ``[header, array_0, array_1, ...]``. The header is a msgpack map
that always carries ``v`` (the protocol version) and ``kind``; numpy arrays travel as raw frames whose
dtype and shape the header lists under ``arrays`` (msgpack cannot pack ndarrays, and raw frames sent
with ``copy=False`` avoid a copy). Sockets that use ``CONFLATE`` keep only the last frame of a
multipart message, so those carry the *packed* form: one frame holding a 4-byte big-endian header
length, the header, then the array bytes back to back.

Every receive is validated before anything else looks at it; anything not fully understood raises
:class:`WireError` with a short ``cause`` (used as the drop-counter key) and is never half-applied.
Nothing that came off a socket is ever unpickled.
"""
from __future__ import annotations

import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

#: dtypes allowed on the wire, by their numpy ``.str`` (explicit little-endian or byte-sized).
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<f2", "<i1", "<i2", "<i4", "<i8", "|i1", "|u1", "|b1", "<u2", "<u4"})

#: the largest header we decode; headers are small maps, arrays travel in their own frames.
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAYS = 64
MAX_NDIM = 8

Frame = Union[bytes, memoryview, Any]  # bytes, memoryview or zmq.Frame


class WireError(ValueError):
    """A message that does not conform to protocol v1; ``cause`` names the drop counter."""

    def __init__(self, cause: str, detail: str = "") -> None:
        super().__init__(f"{cause}: {detail}" if detail else cause)
        self.cause = cause
        self.detail = detail


def _as_buffer(frame: Frame) -> memoryview:
    """A flat byte view of a frame (bytes, memoryview of any shape, or zmq.Frame), without copying."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    view = buf if buf is not None else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def wire_dtype(dtype: np.dtype) -> str:
    """The allowlisted wire name of a numpy dtype, normalised to little-endian."""
    name = np.dtype(dtype).newbyteorder("<").str if np.dtype(dtype).itemsize > 1 else np.dtype(dtype).str
    if name not in ALLOWED_DTYPES:
        raise WireError("bad_dtype", f"dtype {np.dtype(dtype)} is not allowed on the wire")
    return name


def encode(header: Mapping[str, Any], arrays: Optional[Mapping[str, np.ndarray]] = None) -> List[Frame]:
    """Encode a header and named arrays into frames ``[header, *array_bytes]`` (no copies of arrays).

    ``header`` must not already contain ``v`` or ``arrays``; ``kind`` is required.
    """
    if "kind" not in header:
        raise ValueError("header needs a 'kind'")
    descr = []
    frames: List[Frame] = [b""]
    for name, arr in (arrays or {}).items():
        a = np.asarray(arr)
        if not a.dtype.isnative and a.dtype.itemsize > 1:
            a = a.astype(a.dtype.newbyteorder("="))
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        descr.append([name, wire_dtype(a.dtype), list(a.shape)])
        frames.append(a.data if a.size else b"")
    full = dict(header)
    full["v"] = PROTOCOL_VERSION
    full["arrays"] = descr
    frames[0] = msgpack.packb(full, use_bin_type=True)
    return frames


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
    for name, dtype, shape in _array_list(header):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
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
    if header.get("v") != PROTOCOL_VERSION:
        raise WireError("bad_version", f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    if not isinstance(header.get("kind"), str):
        raise WireError("malformed", "header has no kind")
    return header


def _array_list(header: Mapping[str, Any]) -> List[Tuple[str, str, Tuple[int, ...]]]:
    descr = header.get("arrays")
    if not isinstance(descr, list) or len(descr) > MAX_ARRAYS:
        raise WireError("malformed", "header 'arrays' is not a list of at most %d entries" % MAX_ARRAYS)
    out = []
    seen = set()
    for entry in descr:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise WireError("malformed", "array entry is not [name, dtype, shape]")
        name, dtype, shape = entry
        if not isinstance(name, str) or name in seen:
            raise WireError("malformed", f"array name {name!r} missing or repeated")
        seen.add(name)
        if dtype not in ALLOWED_DTYPES:
            raise WireError("bad_dtype", f"array {name!r} has dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)
        ):
            raise WireError("bad_shape", f"array {name!r} has shape {shape!r}")
        out.append((name, dtype, tuple(shape)))
    return out


class Message:
    """A decoded, validated message: ``kind``, the header map and read-only numpy views of its arrays."""

    __slots__ = ("header", "arrays")

    def __init__(self, header: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
        self.header = header
        self.arrays = arrays

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

    Arrays are zero-copy, read-only views of the received frames. With ``check_finite`` every float
    array is checked for NaN and infinity.
    """
    if len(frames) == 0:
        raise WireError("malformed", "empty message")
    if len(frames) == 1 and _as_buffer(frames[0])[:1].tobytes() == b"\x00":
        frames = unpack(frames[0])  # packed form: a big-endian length prefix starts with a zero byte
    header = _decode_header(frames[0])
    descr = _array_list(header)
    if len(descr) != len(frames) - 1:
        raise WireError("bad_length", f"header lists {len(descr)} arrays, message has {len(frames) - 1}")
    arrays: Dict[str, np.ndarray] = {}
    for (name, dtype, shape), frame in zip(descr, frames[1:]):
        buf = _as_buffer(frame)
        dt = np.dtype(dtype)
        expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if len(buf) != expected:
            raise WireError("bad_length", f"array {name!r}: {len(buf)} bytes, {dtype}{list(shape)} needs {expected}")
        arr = np.frombuffer(buf, dtype=dt).reshape(shape) if expected else np.zeros(shape, dt)
        if check_finite and dt.kind == "f" and arr.size and not np.isfinite(arr).all():
            raise WireError("non_finite", f"array {name!r} holds NaN or infinity")
        arrays[name] = arr
    del header["arrays"]
    return Message(header, arrays)
