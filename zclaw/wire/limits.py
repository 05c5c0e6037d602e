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

from typing import Dict

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
#: segments one ``sample`` may ask for (and one ``batch`` may carry, with as many priorities)
MAX_BATCH_SEGMENTS = 64
#: bytes of a segment's header frame (worker id, seq, spec hash, episodes, the arrays list)
MAX_SEGMENT_HEADER_BYTES = 16_000
#: what a batch header holds besides its per-segment entries (kind, v, spec_hash, the arrays list)
BATCH_HEADER_OVERHEAD = 4096
#: bytes a segment adds to a batch header beyond what its own header held: its key (a msgpack int)
BATCH_KEY_BYTES = 9
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
