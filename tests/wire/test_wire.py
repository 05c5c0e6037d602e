"""Protocol v2: golden messages pin the bytes; every malformed input is a WireError, never a crash."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zclaw.wire import EnvSpec, WireError, decode, encode, make, pack, parse, segment_dims, unpack
from zclaw.wire.messages import SCHEMAS, batch_dims
from zclaw.wire.protocol import PROTOCOL_VERSION, Parts, peer_version

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_spec = importlib.util.spec_from_file_location("golden_generate", GOLDEN / "generate.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


def load_golden(kind: str) -> list:
    return msgpack.unpackb((GOLDEN / f"{kind}.msg").read_bytes(), raw=False)


@pytest.mark.parametrize("kind", sorted(SCHEMAS) + ["refused_v1"])
def test_golden_files_decode_and_encoder_reproduces_them(kind: str) -> None:
    frames = load_golden(kind)
    msg = parse(frames)
    assert msg.kind == kind.split("_")[0]
    assert golden.messages()[kind] == frames, (
        "today's encoder no longer produces the pinned bytes of protocol v2"
    )


def test_golden_segment_contents_and_layout() -> None:
    msg = parse(load_golden("segment"))
    assert segment_dims(msg, golden.SPEC) == (3, 2, 1)
    for name, arr in golden.segment_arrays().items():
        np.testing.assert_array_equal(msg.arrays[name], arr)
        assert msg.arrays[name].dtype == arr.dtype
    assert msg["seq"] == 12 and msg["episodes"][0]["length"] == 50


def test_golden_batch_layout_joins_segments_of_different_env_counts_along_the_env_axis() -> None:
    msg = parse(load_golden("batch"))
    assert batch_dims(msg, golden.SPEC) == (2, 3, 3, 2)  # B, T, C (2 + 1 columns), M
    assert msg["columns"] == [2, 1]
    seg = golden.segment_arrays()
    for name, arr in seg.items():
        if name in ("final_obs", "final_at"):
            continue
        got = msg.arrays[name]
        if name == "policy_version":  # per segment, stacked
            np.testing.assert_array_equal(got, np.stack([arr, arr]))
            continue
        # columns 0-1: segment 0's two envs; column 2: segment 1, which is env 1 of the same data
        np.testing.assert_array_equal(got[:, :2], arr)
        np.testing.assert_array_equal(got[:, 2], arr[:, 1])
        assert got.flags.c_contiguous
    np.testing.assert_array_equal(msg.arrays["final_at"], [[1, 1], [1, 2]])


def test_v1_messages_are_refused_as_bad_version_and_the_refusal_is_readable_in_v1() -> None:
    for f in sorted((GOLDEN / "v1").glob("*.msg")):
        frames = msgpack.unpackb(f.read_bytes(), raw=False)
        if f.stem == "refused":  # its fields never change: readable at any version
            assert parse(frames).kind == "refused"
            continue
        with pytest.raises(WireError) as exc:
            parse(frames)
        assert exc.value.cause == "bad_version", f.stem
        assert peer_version(frames) == 1
    header = msgpack.unpackb(load_golden("refused_v1")[0], raw=False)
    assert header["v"] == 1 and set(header) == {"v", "kind", "reason", "cause", "arrays"}
    v1_refused = msgpack.unpackb(msgpack.unpackb((GOLDEN / "v1" / "refused.msg").read_bytes(), raw=False)[0],
                                 raw=False)
    assert set(header) == set(v1_refused)  # the same map v1's own refusal was


def test_parts_travel_one_frame_each_and_decode_joined_along_their_axis() -> None:
    parts = [np.full((3, i + 1, 2), i, np.float32) for i in range(4)]  # env counts 1..4
    frames = encode({"kind": "x"}, {"a": Parts(parts, axis=1), "b": np.arange(3)})
    assert len(frames) == 1 + 4 + 1
    assert all(np.shares_memory(np.frombuffer(f, np.float32), p)
               for f, p in zip(frames[1:5], parts))  # no copy
    joined = np.concatenate(parts, axis=1)
    msg = decode(frames)
    np.testing.assert_array_equal(msg.arrays["a"], joined)
    np.testing.assert_array_equal(decode(unpack(pack(frames))).arrays["a"], joined)
    lead = [np.full((i + 1, 2), i, np.float32) for i in range(3)]  # axis 0 too
    np.testing.assert_array_equal(decode(encode({"kind": "x"}, {"a": Parts(lead, 0)})).arrays["a"],
                                  np.concatenate(lead))
    with pytest.raises(ValueError):  # parts must agree outside the axis
        encode({"kind": "x"}, {"a": Parts([np.zeros((2, 1), np.float32), np.zeros((3, 1), np.float32)], 1)})
    with pytest.raises(ValueError):  # a bare list is ambiguous: Parts says how to join
        encode({"kind": "x"}, {"a": [np.zeros(2, np.float32)] * 2})
    one = encode({"kind": "x"}, {"a": Parts(parts[:1], 1)})  # a single part is sent as a plain array
    assert len(one) == 2 and decode(one).arrays["a"].shape == (3, 1, 2)


@pytest.mark.parametrize("entry, cause", [
    (["a", "<f4", [3, 2], 0, [1, 1]], "bad_shape"),  # sizes must add up to the axis's dimension
    (["a", "<f4", [2, 2], 0, [2]], "bad_shape"),  # an explicit split has 2 parts or more
    (["a", "<f4", [2, 2], 2, [1, 1]], "bad_shape"),  # the axis must exist
    (["a", "<f4", [2, 2], 0, [2, 0]], "bad_shape"),  # no empty part
    (["a", "<f4", [2, 2], 0, [True, 1]], "bad_shape"),  # sizes are ints
    (["a", "<f4", [5000, 2], 0, [1] * 5000], "bad_shape"),  # over MAX_PARTS
    (["a", "<f4", [2, 1 << 30], 0, [1, 1]], "bad_length"),  # lengths are checked before any allocation
    (["a", "<f4", [2, 2], 0], "malformed"),  # v1's 4-entry form is not v2
])
def test_bad_part_entries_are_wire_errors(entry: list, cause: str) -> None:
    header = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "x", "arrays": [entry]}, use_bin_type=True)
    with pytest.raises(WireError) as exc:
        decode([header, b"\0" * 8, b"\0" * 8])
    assert exc.value.cause == cause


def test_roundtrip_multipart_and_packed_are_equal() -> None:
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([True, False]),
              "e": np.zeros((0, 3))}
    frames = encode({"kind": "status"}, arrays)
    for form in (frames, [pack(frames)]):
        msg = decode(form)
        assert set(msg.arrays) == {"a", "b", "e"}
        np.testing.assert_array_equal(msg.arrays["a"], arrays["a"])
        np.testing.assert_array_equal(msg.arrays["b"], arrays["b"])
        assert msg.arrays["e"].shape == (0, 3)


def test_non_contiguous_and_big_endian_arrays_are_normalised() -> None:
    a = np.arange(20, dtype=">f4").reshape(4, 5)[:, ::2]
    msg = decode(encode({"kind": "status"}, {"a": a}))
    assert msg.arrays["a"].dtype.str == "<f4"
    np.testing.assert_array_equal(msg.arrays["a"], a.astype("<f4"))


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames: list, **changes: object) -> list:
    h = _header(frames)
    h.update(changes)
    return [msgpack.packb(h, use_bin_type=True)] + frames[1:]


@pytest.mark.parametrize(
    "mutate, cause",
    [
        (lambda f: [b"\xc1garbage"], "malformed"),
        (lambda f: [], "malformed"),
        (lambda f: _with_header(f, v=1), "bad_version"),
        (lambda f: _with_header(f, v=3), "bad_version"),
        (lambda f: _with_header(f, kind="launch_missiles"), "unknown_kind"),
        (lambda f: _with_header(f, seq="twelve"), "malformed"),
        (lambda f: f[:-1], "bad_length"),
        (lambda f: f[:1] + [f[1][:-4]] + f[2:], "bad_length"),
        (lambda f: _with_header(f, arrays=[[a[0], "|O", a[2]] for a in _header(f)["arrays"]]), "bad_dtype"),
        (lambda f: _with_header(f, arrays=[[a[0], a[1], [-1]] for a in _header(f)["arrays"]]), "bad_shape"),
        (lambda f: _with_header(f, arrays=[[a[0], a[1], [True] + a[2][1:]] for a in _header(f)["arrays"]]),
         "bad_shape"),
        (lambda f: _with_header(f, arrays=[[a[0], a[1], [2.0] + a[2][1:]] for a in _header(f)["arrays"]]),
         "bad_shape"),
        (lambda f: _with_header(f, arrays=[[a[0], a[1], [1 << 40]] for a in _header(f)["arrays"]]),
         "bad_shape"),
        (lambda f: _with_header(f, arrays=[[a[0], a[1], [1] * 9] for a in _header(f)["arrays"]]),
         "bad_shape"),
    ],
)
def test_malformed_messages_raise_wire_error_with_cause(mutate, cause: str) -> None:
    with pytest.raises(WireError) as info:
        parse(mutate(load_golden("segment")))
    assert info.value.cause == cause


def test_non_finite_and_spec_checks() -> None:
    arrays = golden.segment_arrays()
    arrays["reward"][1, 0] = np.nan
    frames = make("segment", arrays, worker="w", seq=1, spec_hash=golden.SPEC.hash, episodes=[])
    with pytest.raises(WireError) as info:
        parse(frames)
    assert info.value.cause == "non_finite"

    arrays = golden.segment_arrays()
    arrays["action"] = arrays["action"].astype(np.float64)
    msg = parse(make("segment", arrays, worker="w", seq=1, spec_hash=golden.SPEC.hash, episodes=[]))
    with pytest.raises(WireError) as info:
        segment_dims(msg, golden.SPEC)
    assert info.value.cause == "bad_dtype"

    other = EnvSpec("gym:Pusher-v5", (23,), (7,), (-2.0,) * 7, (2.0,) * 7)
    with pytest.raises(WireError) as info:
        segment_dims(parse(load_golden("segment")), other)
    assert info.value.cause == "bad_spec"


def test_segment_shape_mismatch_is_bad_shape() -> None:
    arrays = golden.segment_arrays()
    arrays["obs"] = arrays["obs"][:-1]  # T rows instead of T + 1
    msg = parse(make("segment", arrays, worker="w", seq=1, spec_hash=golden.SPEC.hash, episodes=[]))
    with pytest.raises(WireError) as info:
        segment_dims(msg, golden.SPEC)
    assert info.value.cause == "bad_shape"


def test_option_indices_are_bounded_by_the_most_options_a_policy_may_have() -> None:
    """Option indices are refused from MAX_OPTIONS (= config's policy.options limit) on: this bounds what a
    receiver keeps per option (the broker's option-balanced count table is capacity x options)."""
    from zclaw.config import SCHEMA
    from zclaw.wire.messages import MAX_OPTIONS

    assert SCHEMA["policy"]["options"].max == MAX_OPTIONS
    for option, ok in ((0, True), (MAX_OPTIONS - 1, True), (MAX_OPTIONS, False), (1 << 15, False),
                       (-1, False), (-(1 << 31), False)):
        arrays = golden.segment_arrays()
        arrays["option"] = np.full_like(arrays["option"], option)
        msg = parse(make("segment", arrays, worker="w", seq=1, spec_hash=golden.SPEC.hash, episodes=[]))
        if ok:
            assert segment_dims(msg, golden.SPEC) == (3, 2, 1)
        else:
            with pytest.raises(WireError) as info:
                segment_dims(msg, golden.SPEC)
            assert info.value.cause == "bad_value"


def test_make_refuses_headers_that_break_the_schema() -> None:
    with pytest.raises(WireError):
        make("retry", reason="x")  # retry_ms missing
    with pytest.raises(WireError):
        make("nonsense")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_frames_only_ever_raise_wire_error(frames: list) -> None:
    try:
        parse(frames)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_golden_messages_only_ever_raise_wire_error(data: st.DataObject) -> None:
    frames = [bytearray(f)
              for f in load_golden(data.draw(st.sampled_from(["segment", "batch", "weights", "hello"])))]
    i = data.draw(st.integers(0, len(frames) - 1))
    if frames[i]:
        j = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][j] = data.draw(st.integers(0, 255))
    try:
        msg = parse([bytes(f) for f in frames])
        if msg.kind == "segment":
            segment_dims(msg, golden.SPEC)
    except WireError:
        pass


def test_unpack_rejects_truncated_packed_frame() -> None:
    packed = load_golden("weights")[0]
    with pytest.raises(WireError):
        unpack(packed[:-3])
    with pytest.raises(WireError):
        unpack(packed + b"x")


@pytest.fixture()
def tcp_pair():
    """A real PUSH -> PULL pair on loopback TCP."""
    import zmq

    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0), pull.close(0)
    ctx.term()


def test_recv_frames_is_recv_multipart_and_raises_again_when_empty(tcp_pair) -> None:
    import zmq

    from zclaw.wire import recv_frames

    push, pull = tcp_pair
    frames = load_golden("segment")
    push.send_multipart(frames)
    push.send_multipart([b"one"])
    got = recv_frames(pull)
    assert [f.bytes for f in got] == list(frames)
    assert [f.bytes for f in recv_frames(pull)] == [b"one"]
    with pytest.raises(zmq.Again):
        recv_frames(pull, zmq.NOBLOCK)


def test_received_arrays_are_sent_on_as_their_frames(tcp_pair) -> None:
    """A decoded array is a view of its frame; encoding it again (as the broker's store does, through a
    read-only view) hands ZeroMQ that same frame, shared by reference count, while arrays that are part
    of a frame, or made here, go as bytes."""
    import zmq

    from zclaw.wire import recv_frames

    push, pull = tcp_pair
    big = np.arange(20000, dtype=np.float32).reshape(100, 200)
    push.send_multipart(encode({"kind": "status"}, {"big": big, "small": np.ones(3, np.int32)}), copy=False)
    received = recv_frames(pull)
    msg = decode(received)
    stored = msg.arrays["big"].view()
    stored.flags.writeable = False
    frames = encode({"kind": "status"}, {"big": stored, "row": msg.arrays["big"][3],
                                         "mine": big,
                                         "parts": Parts([msg.arrays["big"], msg.arrays["big"]], 1)})
    assert frames[1] is received[1]  # the received frame itself
    assert not isinstance(frames[2], zmq.Frame) and not isinstance(frames[3], zmq.Frame)
    assert frames[4] is received[1] and frames[5] is received[1]
    push.send_multipart(frames, copy=False)
    back = decode(recv_frames(pull))
    np.testing.assert_array_equal(back.arrays["big"], big)
    np.testing.assert_array_equal(back.arrays["row"], big[3])
    np.testing.assert_array_equal(back.arrays["mine"], big)
    np.testing.assert_array_equal(back.arrays["parts"], np.concatenate([big, big], axis=1))
