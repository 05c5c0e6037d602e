"""docs/protocol.md is a specification a stranger can implement a worker from.

tests/support/stranger.py is such a worker, written from the doc with plain pyzmq, msgpack and numpy. Here it
runs in a process where ``import zclaw`` fails, against real ``zclaw broker`` and ``zclaw learner`` processes,
and every definition it relies on is checked against zclaw itself (on the checking side only): the spec
hash's canonical encoding and the doc's worked example, the policy map (against golden weights of real
networks, K = 1 and K = 3), the segment's array set, the smallest-segment size, the hello on PUSH, the
answer to a v1 peer, and the doc's tables against the code's schemas and drop causes.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import msgpack
import numpy as np
import pytest
import torch
import zmq
from support import stranger
from support.procs import Roles

from zclaw.wire import EnvSpec, WireError, parse, segment_dims
from zclaw.wire.messages import SCHEMAS, max_segment_bytes

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
STRANGER = ROOT / "tests" / "support" / "stranger.py"
GOLDEN = ROOT / "tests" / "golden"
_spec = importlib.util.spec_from_file_location("golden_generate", GOLDEN / "generate.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

#: Python code after which ``import zclaw`` (and any ``zclaw.*``) raises ImportError in that process
NO_ZCLAW = "import sys; sys.modules['zclaw'] = None"
#: runs stranger.py (the first argument) as ``__main__`` in such a process
ZCLAW_BLOCKED = NO_ZCLAW + ("; import runpy; sys.argv = sys.argv[1:]; "
                            "runpy.run_path(sys.argv[0], run_name='__main__')")


def load_golden(kind: str) -> List[bytes]:
    return msgpack.unpackb((GOLDEN / f"{kind}.msg").read_bytes(), raw=False)


def doc_text() -> str:
    return DOC.read_text()


# ------------------------------------------------------------------------------------ the stranger itself


def test_the_stranger_imports_nothing_of_zclaw() -> None:
    source = STRANGER.read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "the stranger imports no sibling module either"
            imported.add((node.module or "").split(".")[0])
    assert "zclaw" not in imported, imported
    assert imported <= {"__future__", "argparse", "hashlib", "json", "math", "os", "socket", "struct", "sys",
                        "time", "typing", "msgpack", "numpy", "zmq"}, imported
    # and the process the end-to-end test runs it in cannot import zclaw at all
    out = subprocess.run([sys.executable, "-c", NO_ZCLAW + "; import zclaw"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "import of zclaw halted" in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------- the spec hash

SPECS = [
    # (env_id, obs_shape, action_shape, low, high), bounds as a backend hands them over (any nesting)
    ("gym:Reacher-v5", (10,), (2,), [-1, -1], [1, 1]),  # integer bounds: floats on the wire
    ("gym:Pendulum-v1", (3,), (1,), [-2.0], [2.0]),
    ("isaacgym:Ant", (60,), (2, 3), [[-1, -0.5, -0.25], [0, 0.1, 1e-9]], [[1, 2, 3], [4, 5, 6.5]]),
    ("mjwarp:" + "x" * 40, (84, 84, 3), (4,), [-1e300] * 4, [3.5e-310] * 4),  # str8 id, uint8 dims
    ("gym:Ωmega-v0", (70000,), (1,), [-0.0], [0.0]),  # non-ASCII id, a uint32 dimension, -0.0 != 0.0
    ("stranger:" + "y" * 300, (1,) * 8, (1,), [-1.0], [1.0]),  # str16 id, 8 dimensions
]


@pytest.mark.parametrize("env_id,obs,act,low,high", SPECS)
def test_the_docs_spec_hash_recipe_reproduces_zclaws(env_id: str, obs: tuple, act: tuple, low: Any,
                                                     high: Any) -> None:
    mine = stranger.env_spec(env_id, obs, act, low, high)
    flat = [tuple(np.asarray(b, np.float64).reshape(-1).tolist()) for b in (low, high)]  # as gym_backend does
    theirs = EnvSpec(env_id, obs, act, *flat)
    assert stranger.canonical(mine) == msgpack.packb(theirs.to_dict(), use_bin_type=True)
    assert stranger.spec_hash(mine) == theirs.hash
    assert EnvSpec.from_dict(mine).hash == theirs.hash  # the broker's reading of the stranger's map


def test_minus_zero_and_float32_width_change_the_hash() -> None:
    base = stranger.env_spec("gym:X", (1,), (1,), [0.0], [1.0])
    assert stranger.spec_hash(dict(base, action_low=[-0.0])) != stranger.spec_hash(base)
    single = msgpack.packb(base, use_bin_type=True, use_single_float=True)
    assert single != stranger.canonical(base), "floats are float64 (0xcb), never float32 (0xca)"


def doc_example() -> Dict[str, str]:
    """The worked example under ``<!-- spec-hash-example -->`` in docs/protocol.md: its spec map (JSON), the
    canonical bytes (hex) and the hash."""
    block = doc_text().split("<!-- spec-hash-example -->", 1)[1].split("```")[1]
    spec = json.loads(re.search(r"spec:\s*(\{.*\})", block).group(1))
    hexes = re.search(r"bytes:\s*([0-9a-f\s]+?)\n\s*hash", block, re.S).group(1)
    return {"spec": spec, "bytes": bytes.fromhex("".join(hexes.split())),
            "hash": re.search(r"hash:\s*([0-9a-f]{16})", block).group(1)}


def test_the_docs_worked_example_is_what_zclaw_and_a_real_reacher_compute() -> None:
    ex = doc_example()
    spec = EnvSpec.from_dict(ex["spec"])
    assert msgpack.packb(spec.to_dict(), use_bin_type=True) == ex["bytes"] == stranger.canonical(ex["spec"])
    assert spec.hash == ex["hash"] == stranger.spec_hash(ex["spec"])
    assert ex["spec"] == golden.SPEC.to_dict()  # the spec of every golden file
    # env_id carries the backend prefix: the real gym backend's Reacher is exactly this spec
    from zclaw.envs import make_env

    env = make_env("gym:Reacher-v5", 1, 0, torch.device("cpu"))
    try:
        assert env.spec.env_id == "gym:Reacher-v5" and env.spec.hash == ex["hash"]
    finally:
        env.close()


# -------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize("kind", sorted(golden.POLICIES))
@torch.no_grad()
def test_the_policy_map_rebuilt_in_numpy_computes_what_zclaws_network_does(kind: str) -> None:
    frames = load_golden(kind)
    assert golden.messages()[kind] == frames, "today's learner no longer encodes these weights so"
    header, _ = stranger.decode(frames)
    assert header["kind"] == "weights" and header["policy"]["options"] == golden.POLICIES[kind]["options"]
    assert "option_share" not in header["policy"]  # the even average is the value its absence means
    _check_policy_map(frames)


@torch.no_grad()
def test_a_policy_with_an_option_share_is_evaluated_as_the_map_says() -> None:
    """``option_share`` (not 0.5) travels in the header and the map's weighted average is what zclaw's
    network computes."""
    frames = [golden.policy_weights("weights_k3", option_share=0.8)]
    header, _ = stranger.decode(frames)
    assert header["policy"]["option_share"] == 0.8
    _check_policy_map(frames)


@torch.no_grad()
def test_a_residual_critic_adds_one_critic_output_and_changes_nothing_a_worker_computes() -> None:
    """``critic_residual`` travels in the header, the critic's last layer has K + 1 outputs as the map's
    table says, and acting is evaluated as before."""
    frames = [golden.policy_weights("weights_k3", option_share=0.75, critic_residual=True)]
    header, arrays = stranger.decode(frames)
    assert header["policy"]["critic_residual"] is True
    last = 2 * len(header["policy"]["hidden"])
    assert arrays[f"critic.{last}.weight"].shape[0] == header["policy"]["options"] + 1
    _check_policy_map(frames)


def _check_policy_map(frames: List[bytes]) -> None:
    """The numpy evaluation of docs/protocol.md ("The policy map") against the worker's own rebuild of a
    weights message: normalisation, means, log sigmas, log-probs, pi_Omega, beta, call-and-return."""
    from zclaw.policy.weights import model_from_weights

    header, arrays = stranger.decode(frames)
    # the map's array table: every array, no other, each of its shape
    assert {k: tuple(v.shape) for k, v in arrays.items()} == stranger.array_shapes(header["policy"])
    policy = stranger.Policy(header, arrays)
    model = model_from_weights(parse(frames)).double()  # the worker's own rebuild, in float64 to compare

    rng = np.random.default_rng(1)
    N, K = 64, policy.K
    obs = rng.normal(0, 30, size=(N, 10))  # many beyond obs_clip
    obs[:, 0] = arrays["obs_norm.mean"][0] + rng.uniform(-2e-4, 2e-4, N)  # var 1e-9: eps 1e-8 matters here
    x = policy.normalize(obs)
    xt = model.obs_norm(torch.from_numpy(obs))
    np.testing.assert_allclose(x, xt.numpy(), rtol=1e-12, atol=1e-12)
    assert np.abs(x[:, 0]).max() < policy.p["obs_clip"] and np.abs(x).max() == policy.p["obs_clip"]

    means, log_std = policy.gaussians(x)
    np.testing.assert_allclose(means, model.action_mean(xt).numpy(), atol=1e-12)
    np.testing.assert_allclose(log_std, model.option_log_std().numpy(), atol=1e-12)
    option = rng.integers(0, K, N)
    action = rng.normal(size=(N, 2))
    np.testing.assert_allclose(
        stranger.gaussian_logp(action, means[np.arange(N), option], log_std[option]),
        model.gaussian_logp(torch.from_numpy(action), model.option_mean(xt, torch.from_numpy(option)),
                            model.option_log_std()[torch.from_numpy(option)]).numpy(), atol=1e-10)
    np.testing.assert_allclose(policy.master(x), model.master_probs(xt).numpy(), atol=1e-12)
    np.testing.assert_allclose(policy.beta(x), model.beta(xt).numpy(), atol=1e-12)
    prev, start = rng.integers(0, K, N), rng.random(N) < 0.3
    probs = stranger.call_and_return(policy.master(x), policy.beta(x)[np.arange(N), prev], prev, start)
    logits = model.call_and_return_logits(xt, torch.from_numpy(prev), torch.from_numpy(start))
    np.testing.assert_allclose(np.log(np.maximum(probs, 1e-12)), logits.numpy(), atol=1e-9)

    out = policy.act(obs, prev, start, rng)  # and what one step records is in range and consistent
    assert out["option"].shape == (N,) and 0 <= out["option"].min() and out["option"].max() < K
    assert (out["option_start"] >= start).all() and (out["option"][~out["option_start"]] == prev[
        ~out["option_start"]]).all()
    if K == 1:
        assert not out["logp_option"].any() and (out["option_start"] == start).all()


# ---------------------------------------------------------------------------------------- segment rules


def stranger_segment(T: int = 3, N: int = 2, M: int = 0, **changes: Any) -> List[bytes]:
    """A segment of the golden spec as the stranger encodes it; ``changes``: arrays replaced (None: left
    out)."""
    a = {"obs": np.zeros((T + 1, N, 10), "<f4"), "action": np.zeros((T, N, 2), "<f4"),
         "reward": np.zeros((T, N), "<f4"), "terminated": np.zeros((T, N), "|b1"),
         "truncated": np.zeros((T, N), "|b1"), "option": np.zeros((T, N), "<i4"),
         "option_start": np.zeros((T, N), "|b1"), "logp_action": np.zeros((T, N), "<f4"),
         "logp_option": np.zeros((T, N), "<f4"), "policy_version": np.zeros(T, "<i8"),
         "final_obs": np.zeros((M, 10), "<f4"), "final_at": np.zeros((M, 2), "<i4")}
    a.update(changes)
    a = {k: v for k, v in a.items() if v is not None}
    return stranger.encode("segment", {"worker": "w0-h-1", "seq": 0, "spec_hash": golden.SPEC.hash,
                                       "episodes": []}, a)


def test_empty_final_arrays_are_sent_and_a_missing_or_extra_array_is_bad_shape() -> None:
    frames = stranger_segment()
    assert [len(f) for f in frames[-2:]] == [0, 0]  # [0, 10] and [0, 2]: zero-byte frames
    assert segment_dims(parse(frames), golden.SPEC) == (3, 2, 0)
    for change in ({"final_obs": None}, {"final_at": None}, {"final_obs": None, "final_at": None},
                   {"value": np.zeros((3, 2), "<f4")}):
        with pytest.raises(WireError) as exc:
            segment_dims(parse(stranger_segment(**change)), golden.SPEC)
        assert exc.value.cause == "bad_shape", change
    with pytest.raises(WireError) as exc:  # a present array of another dtype
        segment_dims(parse(stranger_segment(reward=np.zeros((3, 2), "<f8"))), golden.SPEC)
    assert exc.value.cause == "bad_dtype"
    assert stranger.decode(load_golden("segment"))[1]["final_at"].tolist() == [[1, 1]]


@pytest.mark.parametrize("T,N,M", [(1, 1, 0), (64, 16, 0), (32, 4096, 7), (5, 3, 15)])
def test_the_docs_segment_size_is_zclaws(T: int, N: int, M: int) -> None:
    spec = EnvSpec("x:y", (3,), (1,), (-1.0,), (1.0,))
    assert stranger.segment_bytes(T, N, obs=3, act=1, M=M) == max_segment_bytes(spec, T, N, M)


# ------------------------------------------------------------------------- the doc against the code


def test_the_doc_names_every_header_field_and_every_drop_cause() -> None:
    doc = doc_text()
    for kind, schema in SCHEMAS.items():
        section = doc.split(f"### `{kind}`", 1)
        assert len(section) == 2, f"docs/protocol.md has no '### `{kind}`' section"
        body = section[1].split("\n### ", 1)[0]
        for field in schema:
            assert f"`{field}`" in body, f"{kind}.{field} is not in its section"
    causes = set()
    for path in (ROOT / "zclaw").rglob("*.py"):
        text = path.read_text()
        causes |= set(re.findall(r'WireError\(\s*"([a-z_]+)"', text))
        causes |= set(re.findall(r'\.drop\(\s*"([a-z_]+)"', text))
        causes |= set(re.findall(r'drops(?:\.counts)?\["([a-z_]+)"\]', text))
        causes |= set(re.findall(r'self\._failed\(\s*"([a-z_]+)"', text))  # the learner service's
    drops = doc.split("## Drop causes", 1)[1].split("\n## ", 1)[0]
    missing = sorted(c for c in causes if f"`{c}`" not in drops)
    assert not missing, f"drop causes counted by zclaw but not in docs/protocol.md: {missing}"


# ------------------------------------------------------------------------------ against real processes


def run_stranger(ports: Dict[str, int], *args: str) -> Dict[str, Any]:
    cmd = [sys.executable, "-c", ZCLAW_BLOCKED, str(STRANGER), "--ingest", str(ports["ingest_port"]),
           "--serve", str(ports["serve_port"]), "--publish", str(ports["publish_port"]),
           "--learner", str(ports["learner_port"]), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_hello_on_push_tells_a_broker_without_a_spec_what_the_run_is(start_broker) -> None:
    broker = start_broker("network.max_message_mb=4")  # an explicit cap: ingest is never bound again
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(f"tcp://127.0.0.1:{broker.ingest_port}")
    try:
        push.send_multipart(stranger_segment(T=3))  # before any hello: nobody told the broker the env spec
        broker.wait_for(lambda r: r["drops"].get("no_spec") == 1, "the segment dropped as no_spec")
        hello = stranger.encode("hello", {"role": "worker", "identity": "w0-h-1", "host": "h", "pid": 1,
                                          "zclaw": "stranger-1", "spec": golden.SPEC.to_dict(),
                                          "segment_length": 3})
        push.send_multipart(hello)
        truncated = np.zeros((3, 2), "|b1")
        truncated[2, 1] = True
        final_at = np.array([[2, 1]], "<i4")
        push.send_multipart(stranger_segment(T=3, M=1, truncated=truncated, final_at=final_at))
        rep = broker.wait_for(lambda r: r["inserted_segments"] == 1, "the segment after the hello stored")
        assert rep["spec"] == golden.SPEC.to_dict() and rep["drops"] == {"no_spec": 1}
        assert rep["workers"]["w0-h-1"]["host"] == "h"  # what the hello said
        welcome = broker.request(stranger.encode("hello", {"role": "learner", "identity": "l", "host": "h",
                                                           "pid": 2, "zclaw": "x", "spec": None,
                                                           "segment_length": None}))
        assert welcome.kind == "welcome" and welcome["segment_length"] == 3  # fixed by the ingest hello
    finally:
        push.close()
        ctx.term()


def test_a_stranger_worker_from_the_doc_alone_feeds_a_real_broker_and_learner(roles: Roles,
                                                                              tmp_path: Path) -> None:
    roles.start("broker")
    roles.start("learner", "--run-dir", str(tmp_path / "run"))
    first = run_stranger(roles.ports, "--envs", "2", "--segment-length", "8", "--segments", "6")
    # the first worker's T is the run's; its weights came from the learner's snapshot, version 0 or later
    assert first["T"] == 8 and first["segments"] == 6 and min(first["versions"]) >= 0
    assert first["final_obs_rows"] > 0 and first["segments_without_truncation"] > 0  # both cases went
    rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 3, timeout=60)
    joined_at = rep["version"]

    # a second stranger with another env count and its own T = 5 adopts the run's T from the welcome
    second = run_stranger(roles.ports, "--envs", "3", "--segment-length", "5", "--segments", "4",
                          "--index", "1", "--seed", "1")
    assert second["T"] == 8 and second["envs"] == 3 and min(second["versions"]) >= joined_at

    steps = 6 * 8 * 2 + 4 * 8 * 3
    b = roles.wait(roles.broker, lambda r: r["inserted_segments"] == 10, timeout=30)
    assert b["drops"] == {} and b["refused"] == {}, (b["drops"], b["refused"])
    assert b["inserted_steps"] == steps and b["spec"]["env_id"] == "stranger:Reach1D-v0"
    mine = {w["envs"]: w for w in b["workers"].values()}
    assert mine[2]["segments"] == 6 and mine[3]["segments"] == 4, b["workers"]
    assert set(b["workers"]) == {first["identity"], second["identity"]}
    # the learner trained on every segment once (queue mode, two per batch): five updates
    rep = roles.wait(roles.learner, lambda r: r["steps_consumed"] >= steps, timeout=60)
    assert rep["steps_consumed"] == steps and rep["version"] >= 5, rep
    assert rep["drops"] == {} and rep["request_drops"] == {}, (rep["drops"], rep["request_drops"])

    # a v1 peer's hello is answered in v1: a refusal v1's decoder reads (plain msgpack here), counted
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{roles.ports['serve_port']}")
    try:
        req.send_multipart(msgpack.unpackb((GOLDEN / "v1" / "hello.msg").read_bytes(), raw=False))
        assert req.poll(10000), "no answer to a v1 hello"
        reply = req.recv_multipart()
    finally:
        req.close()
        ctx.term()
    header = msgpack.unpackb(reply[0], raw=False)
    assert len(reply) == 1 and header["v"] == 1 and header["kind"] == "refused" and header["arrays"] == []
    assert header["cause"] == "bad_version", header
    deadline = time.monotonic() + 10
    b = roles.broker.report()
    while b["refused"] != {"bad_version": 1} and time.monotonic() < deadline:
        time.sleep(0.1)
        b = roles.broker.report()
    assert b["refused"] == {"bad_version": 1} and b["drops"] == {"bad_version": 1}, (b["refused"], b["drops"])
