"""Bounds on everything that comes off the wire, defined once (``docs/protocol.md``, "Limits").

Why: a peer chooses every string, list and shape it sends. Whatever a receiver keeps (the broker's
worker table, its status report, the batch headers it builds from stored segments) must not grow with
what one peer chose to send, so each field has a limit and a message over it is dropped whole under
a named cause (``oversize_field``, ``unknown_fields``, ``oversize_header``), never truncated into
something the sender did not say.

The numbers are sized so that the bounds compose: a batch header carries, per segment, at most what
that segment's own header carried (its worker id, seq and episode stats) plus its key, so with
``MAX_SEGMENT_HEADER_BYTES`` per segment a batch of ``MAX_BATCH_SEGMENTS`` segments always fits the
decoder's ``MAX_HEADER_BYTES`` (asserted below).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

from .protocol import MAX_HEADER_BYTES

#: characters of any top-level string header field (identity, host, worker, role, spec_hash, ...): a
#: hostname is at most 253 characters, so ``w<index>-<host>-<pid>`` fits with room to spare
MAX_TEXT_CHARS = 512
#: characters of a ``reason`` (refused, retry, error): text a client logs
MAX_REASON_CHARS = 2048
#: episode stats one segment may carry (each a map of return, length and success: at most 42 bytes);
#: a worker whose segments end more episodes than this must use shorter segments
MAX_EPISODES = 256
#: header fields outside a kind's schema: at most this many, of at most this many packed bytes in all
#: (kept so a later minor addition does not break older receivers; anything more is dropped)
MAX_UNKNOWN_FIELDS = 8
MAX_UNKNOWN_BYTES = 1024
#: steps T of one segment (a run's segment_length): a hello or welcome naming more is refused, so no one peer
#: can make every worker of a run allocate segment buffers of its choosing
MAX_SEGMENT_STEPS = 1 << 16
#: segments one ``sample`` may ask for (and one ``batch`` may carry, with as many priorities)
MAX_BATCH_SEGMENTS = 64
#: env columns one ``sample`` may ask for (``columns``: a batch sized in columns, still at most
#: MAX_BATCH_SEGMENTS segments)
MAX_BATCH_COLUMNS = 1 << 20
#: bytes of a segment's header frame (worker id, seq, spec hash, episodes, the arrays list)
MAX_SEGMENT_HEADER_BYTES = 16_000
#: what a batch header holds besides its per-segment entries (kind, v, spec_hash, the arrays list with
#: the part sizes of each array sent in parts: at most MAX_BATCH_SEGMENTS ints per array)
BATCH_HEADER_OVERHEAD = 16384
#: bytes a segment adds to a batch header beyond what its own header held: its key and its column
#: count (two msgpack ints)
BATCH_KEY_BYTES = 18
#: header bytes per kind (the decoder's MAX_HEADER_BYTES for the rest: weights, status, batch)
KIND_HEADER_BYTES: Dict[str, int] = {
    "segment": MAX_SEGMENT_HEADER_BYTES,
    "hello": 64 << 10,
    "welcome": 64 << 10,
    "sample": 64 << 10,
    "snapshot": 4 << 10,
    "refused": 8 << 10,
    "retry": 8 << 10,
    "error": 8 << 10,
}
#: per (kind, list field): most entries; every other list field of a header is capped at MAX_BATCH_SEGMENTS
LIST_LIMITS: Dict[tuple, int] = {
    ("segment", "episodes"): MAX_EPISODES,
    ("batch", "episodes"): MAX_EPISODES * MAX_BATCH_SEGMENTS,
}
#: integers in headers (seq, pid, version, batch_size, ...) fit a signed 64-bit integer
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
#: elements of one observation or action (the env spec's shape products): a 1024 x 1024 x 4 image fits
MAX_SPEC_ELEMENTS = 1 << 22
#: a reply the broker builds from what peers told it (status) lists at most this many workers
MAX_REPORT_WORKERS = 64

assert MAX_BATCH_SEGMENTS * (MAX_SEGMENT_HEADER_BYTES + BATCH_KEY_BYTES) + BATCH_HEADER_OVERHEAD \
    <= MAX_HEADER_BYTES, "a full batch header must fit the decoder's header cap"

#: kinds a request socket (the broker's serve ROUTER, the learner's ROUTER) answers: each is one header
#: frame and no arrays (hello, sample with its priority lists, status, snapshot)
REQUEST_KINDS = ("hello", "sample", "status", "snapshot")
#: the largest request header the wire allows (hello and sample: 64 KiB; a status request carries no
#: report, so its kind's cap, sized for the reply, does not apply to requests)
MAX_REQUEST_HEADER_BYTES = max(KIND_HEADER_BYTES[k] for k in ("hello", "sample", "snapshot"))
#: ``ZMQ_MAXMSGSIZE`` of the request sockets (libzmq checks it per frame, at the frame's size prefix, and
#: drops the connection of a peer that announces a larger one: nothing of it is read, and it is not
#: counted, since libzmq reports no cause). Why not the segment cap: these sockets never carry a
#: segment, and a 1 MiB-identity hello (two froze a run, 1,100 cost 0.64x of updates) would otherwise be
#: received whole before being dropped. 4x the largest legal request, so that a field added later does
#: not need this changed in lockstep; a request past it but under it is dropped by the decoder, counted.
REQUEST_SOCKET_BYTES = 4 * MAX_REQUEST_HEADER_BYTES
#: the largest header the broker's ingest takes (hello, segment): a header over it is dropped, counted as
#: ``oversize_header``, before msgpack reads a byte of it (the decoder itself would read up to
#: MAX_HEADER_BYTES before its per-kind check)
INGEST_HEADER_BYTES = max(KIND_HEADER_BYTES["hello"], KIND_HEADER_BYTES["segment"])


def header_length(frames: Sequence[Any]) -> int:
    """Bytes of a message's header, read without decoding anything: the first frame's length, or for the
    packed single-frame form (a zero first byte) its big-endian length prefix, at most the bytes that
    follow it (a prefix claiming more is the decoder's ``malformed``); 0 for no frames. Cheap enough to
    run on every message before :func:`zclaw.wire.messages.parse`."""
    if not frames:
        return 0
    buf = memoryview(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]).cast("B")
    if len(frames) == 1 and len(buf) >= 4 and buf[0] == 0:
        return min(int.from_bytes(buf[:4], "big"), len(buf) - 4)
    return len(buf)
