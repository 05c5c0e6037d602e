"""The worker role as a real process against real sockets: this test plays broker (PULL) and learner
(PUB + ROUTER answering ``snapshot``), so everything the worker does crosses TCP exactly as in a run."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from support.peers import StandInLearner
from support.procs import WorkerProcess, free_port
from support.waiting import wait_until
import torch
import zmq

from zclaw.envs import make_env
from zclaw.wire import WireError, bind, make, make_socket, parse, segment_dims
from zclaw.wire.messages import EnvSpec

ENV = "gym:Reacher-v5"
T, N = 16, 4

# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def spec() -> EnvSpec:
    env = make_env(ENV, 1, 0, torch.device("cpu"))
    try:
        return env.spec
    finally:
        env.close()


def recv(pull: zmq.Socket, timeout: float = 15.0):
    assert pull.poll(int(timeout * 1000)), "nothing arrived from the worker"
    return parse(pull.recv_multipart(copy=False))


def next_segment(pull: zmq.Socket, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = recv(pull, max(0.1, deadline - time.monotonic()))
        if msg.kind == "segment":
            return msg
    raise AssertionError("no segment arrived")


# -------------------------------------------------------------------------------------------- tests


def test_worker_hello_segments_and_versions(spec: EnvSpec) -> None:
    """hello carries the spec; segments validate; a joining worker acts on the snapshot version; a version
    published later on PUB shows up in later segments; SIGTERM exits 0 quickly."""
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL)
    ingest = bind(pull, "127.0.0.1", 0)
    learner = StandInLearner(ctx, spec, version=7)
    w = WorkerProcess(ingest, learner.pub_port, learner.router_port, env=ENV, envs=N, segment_length=T)
    try:
        first = recv(pull, 30)
        assert first.kind == "hello", first  # the spec reaches the broker before any segment
        assert first["role"] == "worker" and first["identity"].startswith("w0-")
        assert first["pid"] == w.proc.pid
        assert EnvSpec.from_dict(first["spec"]) == spec and first["spec"]["env_id"] == ENV

        seg = next_segment(pull)
        assert segment_dims(seg, spec)[:2] == (T, N)
        assert seg["worker"] == first["identity"] and seg["seq"] == 0
        assert (seg.arrays["policy_version"] == 7).all(), seg.arrays["policy_version"]  # Clone snapshot
        assert learner.snapshots >= 1
        # obs[T] of one segment is obs[0] of the next (the bootstrap row is the next state)
        seg2 = next_segment(pull)
        assert seg2["seq"] == 1
        assert (seg2.arrays["obs"][0] == seg.arrays["obs"][T]).all()

        learner.publish(9)
        learner.serve(9)
        seen_new = False
        truncations = 0
        episodes = []
        prev_seq = 1
        deadline = time.monotonic() + 60  # segments made before the publish may still be queued: wait
        while time.monotonic() < deadline:
            s = next_segment(pull)
            _, _, M = segment_dims(s, spec)
            assert s["seq"] == prev_seq + 1
            prev_seq = s["seq"]
            pv = s.arrays["policy_version"]
            assert (pv[1:] >= pv[:-1]).all()
            if seen_new:
                assert pv.min() >= 9, pv
            seen_new = seen_new or pv.max() >= 9
            trunc = s.arrays["truncated"]
            # final_obs is given exactly for the truncated steps (Reacher truncates at 50 steps)
            assert M == int(trunc.sum())
            assert (sorted(map(tuple, s.arrays["final_at"].tolist()))
                    == sorted(zip(*map(list, trunc.nonzero()))))
            assert not s.arrays["terminated"].any()
            truncations += M
            episodes += s["episodes"]
            if seen_new and truncations >= N:
                break
        assert seen_new, "published version 9 never reached the worker"
        assert truncations >= N and len(episodes) == truncations
        assert all(ep["length"] == 50 for ep in episodes)
        assert w.terminate() == 0
    finally:
        w.kill()
        learner.close()
        pull.close(0)
        ctx.term()


def test_worker_gpu_missing_exits_nonzero() -> None:
    gpu = torch.cuda.device_count()  # never a valid index
    w = WorkerProcess(free_port(), free_port(), free_port(), "--gpu", str(gpu), env=ENV, envs=N,
                      segment_length=T)
    try:
        rc = w.proc.wait(30)
        w._reader.join(5)
    finally:
        w.kill()
    assert rc != 0
    text = "".join(w.lines)
    assert f"--gpu {gpu}: no such CUDA device (this machine has {gpu})" in text, text


def test_worker_waits_then_backpressure_then_delivers_in_order(spec: EnvSpec) -> None:
    """No learner (nor broker handshake) yet: the worker waits (and says so). Learner but no broker ingest:
    it fills its bounded queue,
    blocks and logs backpressure instead of growing. Broker appears: every queued segment
    arrives, in order."""
    capacity = 3
    ingest = free_port()
    ctx = zmq.Context()
    pub_port, router_port = free_port(), free_port()
    w = WorkerProcess(
        ingest, pub_port, router_port, "--set", f"worker.send_queue={capacity}", "--set", "log.status_s=0.3",
        env=ENV, envs=N, segment_length=T,
    )
    learner = None
    pull = None
    try:
        w.wait_event("waiting for the broker", 30)
        learner = StandInLearner(ctx, spec, version=3, pub_port=pub_port, router_port=router_port)

        bp = w.wait_event("backpressure", 30)
        assert bp["queued"] <= capacity and bp["capacity"] == capacity
        # blocked: the worker must not make (and hold) more segments while two status lines go by
        wait_until(lambda: len([r for r in w.events("status") if r["blocked_s"] > 0]) >= 2, 15,
                   "two status lines while blocked", output=lambda: "".join(w.lines[-20:]))
        blocked = [r for r in w.events("status") if r["blocked_s"] > 0]
        assert len(blocked) >= 2, w.lines[-20:]
        assert all(r["queued"] <= capacity for r in w.events("status"))
        assert blocked[-1]["segments"] == blocked[0]["segments"] == capacity + 1  # queue full + one waiting
        assert blocked[-1]["blocked_s"] > blocked[0]["blocked_s"]

        pull = make_socket(ctx, zmq.PULL)
        bind(pull, "127.0.0.1", ingest)
        first = recv(pull, 10)
        assert first.kind == "hello"  # on (re)connection the hello goes ahead of queued segments
        seqs = []
        while len(seqs) < capacity + 4:
            s = next_segment(pull)
            segment_dims(s, spec)
            seqs.append(s["seq"])
        assert seqs == list(range(len(seqs))), seqs  # none lost, none reordered
        assert w.terminate() == 0
    finally:
        w.kill()
        if learner is not None:
            learner.close()
        if pull is not None:
            pull.close(0)
        ctx.term()


# ------------------------------------------------------------------------------ values out of range


def _blown_up_step(spec: EnvSpec, form: str, bad_env: int, what: str) -> Any:
    """A StepResult of N envs where env ``bad_env`` blew up (obs 1e30, reward 1e30, NaN obs, or none);
    ``form`` is how the backend hands out final observations (dict, dense, or the obs tensor itself)."""
    from zclaw.core import StepResult

    obs = torch.ones((N,) + spec.obs_shape)
    reward = torch.zeros(N)
    if what == "obs":
        obs[bad_env, 0] = 1e30
    elif what == "nan":
        obs[bad_env, -1] = float("nan")
    elif what == "reward":
        reward[bad_env] = 1e30
    truncated = torch.zeros(N, dtype=torch.bool)
    truncated[0] = True  # env 0 ended by itself this step (a time limit), with a valid final obs
    final: Any = {0: torch.full(spec.obs_shape, 3.0)} if form == "dict" else (
        obs if form == "next" else torch.full((N,) + spec.obs_shape, 3.0))
    return StepResult(obs, reward, torch.zeros(N, dtype=torch.bool), truncated, final, [])


@pytest.mark.parametrize("form", ["dict", "dense", "next"])
@pytest.mark.parametrize("what", ["obs", "reward", "nan"])
def test_a_blown_up_env_ends_as_a_truncation_and_no_bad_value_is_sent(
    spec: EnvSpec, form: str, what: str
) -> None:
    from zclaw.worker.worker import SegmentBuffer, ValueGuard

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    guard = ValueGuard(1e6, 1e6, Log())
    buf = SegmentBuffer(4, N, spec)
    t, bad_env = 2, 2
    for step in range(t):  # two healthy steps first (no env ends)
        buf.obs[step] = float(step)
        ok = _blown_up_step(spec, form, bad_env, what)._replace(truncated=torch.zeros(N, dtype=torch.bool))
        ok = ok._replace(obs=torch.full((N,) + spec.obs_shape, float(step + 1)), reward=torch.zeros(N),
                         final_obs={} if form == "dict" else ok.obs)
        if form == "next":
            ok = ok._replace(final_obs=ok.obs)
        assert guard.check(ok) is None
        if form != "dict":
            buf.record_finals(step, ok.final_obs, ok.obs)
    buf.obs[t] = 2.0  # what the envs acted on at step t: in range
    res = _blown_up_step(spec, form, bad_env, what)
    buf.reward[t] = res.reward
    buf.truncated[t] = res.truncated
    buf.record_finals(t, res.final_obs, res.obs)
    found = guard.check(res)
    assert found is not None
    guard.truncate(buf, t, found, res)
    buf.obs[t + 1] = 0.5  # the reset observation
    buf.obs[t + 2] = 0.5
    arrays, _ = buf.take()
    # every env's episode ends at t as a truncation, none as a termination
    assert arrays["truncated"][t].all() and not arrays["terminated"][t].any()
    assert not arrays["truncated"][:t].any()
    # nothing out of range goes on the wire
    for name in ("obs", "final_obs", "reward"):
        a = arrays[name]
        assert np.isfinite(a).all() and (np.abs(a) <= 1e6).all(), (name, a)
    finals = {(int(tt), int(n)): fo for (tt, n), fo in zip(arrays["final_at"], arrays["final_obs"])}
    assert set(finals) == {(t, n) for n in range(N)}
    assert (finals[(t, bad_env)] == 2.0).all(), "a blown-up env bootstraps from its last in-range obs"
    healthy = 1 if bad_env != 1 else 3
    assert (finals[(t, healthy)] == 1.0).all(), "a healthy env cut short bootstraps from its new obs"
    if form != "next":  # env 0 ended by itself: its own final observation is kept
        assert (finals[(t, 0)] == 3.0).all()
    cause = "reward_out_of_range" if what == "reward" else "obs_out_of_range"
    assert guard.counts()[cause] == 1 and guard.counts()["cut_short"] == N - 2


@pytest.mark.parametrize("form", ["dense", "next"])
@pytest.mark.parametrize("what", ["obs", "reward", "nan"])
def test_a_device_backend_masks_a_blown_up_env_on_the_device_and_ends_the_segment_with_a_reset(
    spec: EnvSpec, form: str, what: str
) -> None:
    """Device backends (no host read per step): the blown-up env's step is truncated with its last
    in-range observation as final one and as what the policy acts on next; take() ends every episode
    and asks for a reset; nothing out of range is sent."""
    from zclaw.worker.worker import SegmentBuffer, ValueGuard

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    guard = ValueGuard(1e6, 1e6, Log())
    T, t, bad_env = 4, 1, 2
    buf = SegmentBuffer(T, N, spec)
    obs = torch.zeros((N,) + spec.obs_shape)
    for step in range(T):
        buf.obs[step] = obs
        if step == t:
            res = _blown_up_step(spec, form, bad_env, what)
        else:  # a healthy step; the blown-up env stays blown up until a reset (no per-env reset)
            res = _blown_up_step(spec, form, bad_env, what if step > t else "none")
            res = res._replace(obs=res.obs + step, truncated=torch.zeros(N, dtype=torch.bool))
            if form == "next":
                res = res._replace(final_obs=res.obs)
        buf.reward[step], buf.truncated[step] = res.reward, res.truncated
        buf.terminated[step] = res.terminated
        obs = guard.sanitize(buf, step, res)
        if step == t:
            assert torch.equal(obs[bad_env], buf.obs[t][bad_env]), "the policy acts on the last good obs"
    buf.obs[T] = obs
    arrays, _ = buf.take()
    assert buf.reset_needed and int(buf.out_of_range) == 0
    assert arrays["truncated"][t:, bad_env].all() and arrays["truncated"][-1].all()
    assert not arrays["truncated"][:t, bad_env].any()
    for name in ("obs", "final_obs", "reward"):
        a = arrays[name]
        assert np.isfinite(a).all() and (np.abs(a) <= 1e6).all(), (name, a)
    finals = {(int(tt), int(n)): fo for (tt, n), fo in zip(arrays["final_at"], arrays["final_obs"])}
    assert (finals[(t, bad_env)] == arrays["obs"][t, bad_env]).all(), "bootstrap from the last good obs"
    buf.obs[:] = 0.0
    buf.take()
    assert not buf.reset_needed  # a clean segment after the reset asks for none


def test_a_segment_that_ends_more_episodes_than_the_wire_carries_reports_the_newest(spec: EnvSpec) -> None:
    """A worker of thousands of envs can end more episodes in one segment than a segment header may carry
    (MAX_EPISODES; the broker drops more as oversize_field): the newest are sent, the rest counted, and the
    segment still passes the broker's header bounds."""
    from zclaw.wire.limits import MAX_EPISODES
    from zclaw.wire.messages import Segment
    from zclaw.worker.worker import SegmentBuffer

    buf = SegmentBuffer(2, N, spec)
    buf.episodes = [{"return": float(i), "length": 10} for i in range(MAX_EPISODES + 40)]
    arrays, episodes = buf.take()
    assert len(episodes) == MAX_EPISODES and episodes[-1]["return"] == MAX_EPISODES + 39.0
    assert buf.episodes_unreported == 40 and buf.episodes == []
    seg = Segment("w0-host-1", 0, spec.hash, arrays, episodes)
    assert len(parse(seg.frames(), ("segment",))["episodes"]) == MAX_EPISODES  # within every header bound
    too_many = Segment("w0-host-1", 1, spec.hash, arrays, episodes + episodes[:1])
    with pytest.raises(WireError, match="episodes"):  # what the broker would have dropped
        parse(too_many.frames(), ("segment",))


def test_a_weights_header_no_network_fits_is_dropped_and_the_acting_policy_stays(spec: EnvSpec) -> None:
    """A ``weights`` message whose policy header names no network (``option_share`` 2, a string width) is
    dropped and counted as bad_weights; the worker keeps acting with the copy it has, and the next good
    message still loads."""
    import structlog

    from zclaw import config
    from zclaw.policy.weights import weights_message
    from zclaw.worker import worker as worker_mod

    cfg = config.load(values={"run.env": "gym:Reacher-v5", "worker.envs": 2, "worker.segment_length": 8})
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL)
    cfg["network"]["ingest_port"] = bind(pull, "127.0.0.1", 0)
    env = make_env("gym:Reacher-v5", 2, 0, torch.device("cpu"))
    learner = StandInLearner(ctx, env.spec, version=3)
    net = cfg["network"]
    net["publish_port"], net["learner_port"] = learner.pub_port, learner.router_port
    net["serve_port"] = learner.router_port
    cpu = torch.device("cpu")
    w = worker_mod.Worker(cfg, structlog.get_logger(), 0, env, cpu, threading.Event(), ctx=ctx)
    try:
        assert w.wait_for_weights()
        acting, version = w.model, w.version
        good = parse([weights_message(learner.model, 4, 0, env.spec.hash)])
        for change in ({"option_share": 2.0}, {"hidden": ["wide"]}):
            bad = parse(make("weights", good.arrays, version=5, step=0, spec_hash=env.spec.hash,
                             policy={**good["policy"], **change}))
            assert w.apply(bad) is False
            assert w.model is acting and w.version == version
        assert w.weights.drops.counts["bad_weights"] == 2
        assert w.apply(good) is True and w.model is acting and w.version == 4
        assert w.run(max_segments=1) == 1  # and it acts on
    finally:
        w.close()
        learner.close()
        env.close()
        pull.close(0)
        ctx.term()
