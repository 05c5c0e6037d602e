"""Property tests of the wire's bounds: decode never allocates more than it received, and no input a
socket can deliver makes the broker's handlers count ``internal`` (a bug) instead of a named cause."""
from __future__ import annotations

from typing import Any, List

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.peers import SPEC
from support.synthetic import random_segment

from zclaw.broker.server import Broker
from zclaw.broker.store import Store
from zclaw.config import load as load_config
from zclaw.wire import Segment, WireError, decode, make, pack, parse
from zclaw.wire.limits import MAX_BATCH_SEGMENTS, MAX_EPISODES, MAX_SEGMENT_HEADER_BYTES, MAX_TEXT_CHARS
from zclaw.wire.protocol import ALLOWED_DTYPES, PROTOCOL_VERSION

DTYPES = sorted(ALLOWED_DTYPES)
dims = st.one_of(st.integers(0, 4), st.sampled_from([2 ** 20, 2 ** 39, 2 ** 40 - 1, 2 ** 40]))
entries = st.tuples(st.sampled_from(DTYPES), st.lists(dims, max_size=4), st.booleans())


@st.composite
def messages(draw: Any) -> List[bytes]:
    """A header listing arbitrary arrays (some in parts) and frames of arbitrary small lengths."""
    descr, frames = [], []
    for i, (dtype, shape, parted) in enumerate(draw(st.lists(entries, max_size=4))):
        entry: List[Any] = [f"a{i}", dtype, shape]
        count = 1
        if parted and shape and 2 <= shape[0] <= 4:  # in parts along axis 0, one row each
            entry += [0, [1] * shape[0]]
            count = shape[0]
        descr.append(entry)
        for _ in range(count + draw(st.integers(-1, 1))):
            frames.append(b"\x01" * draw(st.integers(0, 64)))
    header = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "status", "arrays": descr})
    return [header] + frames


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.booleans())
def test_decode_raises_wire_error_or_returns_no_more_than_received(frames: List[bytes], packed: bool) -> None:
    if packed:
        frames = [pack(frames)]
    size = sum(len(f) for f in frames)
    try:
        msg = decode(frames, check_finite=False)
    except WireError:
        return
    assert sum(a.nbytes for a in msg.arrays.values()) <= size


def test_the_issue_parts_shape_is_a_wire_error_in_either_form() -> None:
    header = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "status",
                            "arrays": [["x", "<f4", [2, 2 ** 39, 2 ** 39], 0, [1, 1]]]})
    for frames in ([header, b"abcd", b"abcd"], [pack([header, b"abcd", b"abcd"])]):
        with pytest.raises(WireError):
            parse(frames)


def _segment(**changes: Any) -> List[Any]:
    arrays = random_segment(SPEC, 2, 2, np.random.default_rng(0), M=1)
    fields = dict(worker="w", seq=0, spec_hash=SPEC.hash, episodes=[])
    fields.update(changes)
    return make("segment", arrays, **fields)


@pytest.mark.parametrize("changes, cause", [
    ({"worker": "w" * (MAX_TEXT_CHARS + 1)}, "oversize_field"),
    ({"episodes": [{"return": 1.0, "length": 1}] * (MAX_EPISODES + 1)}, "oversize_field"),
    ({"seq": 2 ** 64 - 1}, "oversize_field"),
    ({f"x{i}": 1 for i in range(9)}, "unknown_fields"),
    ({"x": "y" * 2000}, "unknown_fields"),
    ({"x": "y" * MAX_SEGMENT_HEADER_BYTES}, "oversize_header"),
])
def test_over_limit_segment_headers_are_refused_under_a_named_cause(changes: dict, cause: str) -> None:
    with pytest.raises(WireError) as err:
        parse(_segment(**changes))
    assert err.value.cause == cause
    assert parse(_segment(x=1)).kind == "segment"  # a few small unknown fields are fine


def test_sample_requests_beyond_the_batch_limit_are_refused() -> None:
    with pytest.raises(WireError) as err:
        parse(make("sample", batch_size=1, version=0, priority_keys=list(range(MAX_BATCH_SEGMENTS + 1)),
                   priorities=[0.0] * (MAX_BATCH_SEGMENTS + 1)))
    assert err.value.cause == "oversize_field"


def test_a_batch_that_is_not_committed_uses_no_segment_up() -> None:
    store = Store(SPEC, 4, mode="queue", max_reuse=1)
    for seq in range(2):
        arrays = random_segment(SPEC, 2, 2, np.random.default_rng(seq))
        store.insert(parse(Segment("w", seq, SPEC.hash, arrays, []).frames()))
    first = store.sample(2, 0, commit=False)
    assert first is not None and store.sampled == 0 and store.fill == 2
    again = store.sample(2, 0)
    assert again is not None and again.keys == first.keys and store.sampled == 2 and store.fill == 0


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


_header_values = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(),
                           st.text(max_size=20), st.binary(max_size=20),
                           st.lists(st.integers(-2 ** 63, 2 ** 64 - 1), max_size=70),
                           st.dictionaries(st.text(max_size=8), st.integers(-5, 5), max_size=4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["hello", "segment", "sample", "status"]),
       st.dictionaries(st.sampled_from(["identity", "host", "pid", "role", "spec", "worker", "seq",
                                        "episodes", "batch_size", "version", "priority_keys", "priorities",
                                        "spec_hash", "extra"]), _header_values, max_size=5),
       st.one_of(st.none(), st.fixed_dictionaries({
           "env_id": st.text(max_size=5), "obs_shape": st.lists(st.integers(-2, 2 ** 64 - 1), max_size=3),
           "action_shape": st.lists(st.integers(-2, 3), max_size=2),
           "action_low": st.lists(st.floats(), max_size=3),
           "action_high": st.lists(st.floats(), max_size=3)})))
def test_no_header_a_peer_sends_makes_the_broker_count_internal(kind: str, changes: dict, spec: Any) -> None:
    cfg = load_config(None, [])
    broker = Broker(cfg, _Log())
    good = {"hello": make("hello", role="worker", identity="w", host="h", pid=1, zclaw="x",
                          spec=SPEC.to_dict(), segment_length=2),
            "segment": _segment(), "status": make("status"),
            "sample": make("sample", batch_size=1, version=0, priority_keys=[], priorities=[])}
    broker.on_ingest(good["hello"])
    broker.on_ingest(good["segment"])
    header = msgpack.unpackb(bytes(good[kind][0]), raw=False)
    header.update(changes)
    if spec is not None and kind == "hello":
        header["spec"] = spec
    frames = [msgpack.packb(header, use_bin_type=True)] + list(good[kind][1:])
    broker.on_ingest(frames)
    broker.on_request([b"id", b""] + frames)
    assert "internal" not in broker.drops.counts


@given(st.binary(max_size=64), st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_header_length_reads_no_more_than_was_received(blob: bytes, extra: int) -> None:
    """``header_length`` (the broker's check before msgpack) reads a plain header's length, or a packed
    frame's length prefix capped at the bytes after it, whatever the bytes are."""
    from zclaw.wire.limits import header_length

    frames = [blob] + [b"x"] * extra
    n = header_length(frames)
    if extra == 0 and len(blob) >= 4 and blob[0] == 0:
        assert n == min(int.from_bytes(blob[:4], "big"), len(blob) - 4)
    else:
        assert n == len(blob)
    assert header_length([]) == 0
    good = make("status", report={"a": 1})
    assert header_length(good) == len(good[0]) and header_length([pack(good)]) == len(good[0])
