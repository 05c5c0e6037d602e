"""Identity handshake: hello -> welcome | refused on the broker's serve socket, both sides log why."""
from __future__ import annotations

import json
import subprocess
import time
from typing import Any, Dict, List, Tuple

import pytest
import structlog
from support.logs import log_lines
from support.peers import SPEC, Worker, with_header
from support.procs import ZCLAW
import zmq

from zclaw import __version__
from zclaw.stopping import EXIT_REFUSED
from zclaw.wire import EnvSpec, make
from zclaw.worker.session import BrokerSession, Refused

OTHER = EnvSpec("test:Other-v0", (3,), (1,), (-2.0,), (2.0,))


def hello(spec: Any, role: str = "worker", identity: str = "w9-test", segment_length: Any = 8) -> List[Any]:
    return make("hello", role=role, identity=identity, host="testhost", pid=4242, zclaw=__version__,
                spec=spec.to_dict() if spec is not None else None,
                segment_length=segment_length if role == "worker" else None)


def test_broker_welcomes_its_spec_and_refuses_others_with_the_reason(start_broker) -> None:
    broker = start_broker()
    w = broker.request(hello(SPEC, identity="w0-a"))
    assert w.kind == "welcome" and w["spec"] == SPEC.to_dict() and w["role"] == "broker"
    assert w["segment_length"] == 8, "the first worker's segment length becomes the run's"
    assert w["identity"].startswith("broker-") and w["pid"] == broker.proc.pid
    assert broker.status()["workers"]["w0-a"]["pid"] == 4242, "the hello registers the worker"

    r = broker.request(hello(OTHER, identity="w1-b"))
    assert r.kind == "refused" and r["cause"] == "bad_spec"
    assert OTHER.hash in r["reason"] and SPEC.hash in r["reason"]
    r = broker.request(hello(None, identity="w2-c"))
    assert r.kind == "refused" and r["cause"] == "no_spec"
    bad_spec = make("hello", role="worker", identity="w5-f", host="testhost", pid=4242, zclaw=__version__,
                    spec={"env_id": 7}, segment_length=8)  # not a spec at all: refused, so the worker stops
    r = broker.request(bad_spec)
    assert r.kind == "refused" and r["cause"] == "bad_spec" and "env spec" in r["reason"]
    r = broker.request(with_header(hello(SPEC), v=1))  # a peer of protocol v1
    assert r.kind == "refused" and r["cause"] == "bad_version" and "v2" in r["reason"]
    assert r.header["v"] == 1, "answered in the peer's own version, so that it can read why"
    other_T = broker.request(hello(SPEC, identity="w3-d", segment_length=32))
    assert other_T.kind == "welcome" and other_T["segment_length"] == 8, "a later worker is told the run's T"
    r = broker.request(hello(SPEC, identity="w4-e", segment_length=None))
    assert r.kind == "refused" and r["cause"] == "bad_shape" and "segment_length" in r["reason"]
    r = broker.request(hello(SPEC, identity="w6-g", segment_length=1 << 20))  # over MAX_SEGMENT_STEPS
    assert r.kind == "refused" and r["cause"] == "bad_shape"
    learner = broker.request(hello(None, role="learner", identity="learner-x"))
    assert learner.kind == "welcome" and learner["spec"] == SPEC.to_dict() and learner["segment_length"] == 8

    rep = broker.status()
    assert rep["refused"] == {"bad_spec": 2, "no_spec": 1, "bad_version": 1, "bad_shape": 2}
    assert "w1-b" not in rep["workers"] and "learner-x" not in rep["workers"]
    logged = [json.loads(x) for x in broker.output().splitlines() if '"refused"' in x]
    assert {e["cause"] for e in logged} == {"bad_spec", "no_spec", "bad_version", "bad_shape"}
    assert any(e["client"] == "w1-b" for e in logged)
    broker.stop()


def test_session_handshakes_heartbeats_and_learns_it_was_refused(start_broker) -> None:
    broker = start_broker()
    ctx = zmq.Context()
    log = structlog.get_logger()
    endpoint = f"tcp://127.0.0.1:{broker.serve_port}"
    good = BrokerSession(ctx, endpoint, lambda: hello(SPEC, identity="w0-s"), log, spec_hash=SPEC.hash,
                         interval_s=0.05)
    welcome = good.handshake(lambda: False)
    assert welcome is not None and welcome["spec"] == SPEC.to_dict() and good.broker == welcome["identity"]
    seen = broker.status()["workers"]["w0-s"]["last_seen_s"]
    deadline = time.monotonic() + 10
    while good.welcomes < 4:  # heartbeats go out and come back without ever blocking
        good.tick()
        time.sleep(0.01)
        assert time.monotonic() < deadline
    # heartbeats keep the broker's "last seen" age fresh (the bound leaves room for a starved status reply)
    assert broker.status()["workers"]["w0-s"]["last_seen_s"] < max(seen, 0.0) + 2.0

    bad = BrokerSession(ctx, endpoint, lambda: hello(OTHER, identity="w1-s"), log, spec_hash=OTHER.hash)
    with pytest.raises(Refused) as exc:
        bad.handshake(lambda: False)
    assert exc.value.cause == "bad_spec" and exc.value.server == "broker"

    # the broker goes away: the heartbeat gives up on the stuck REQ socket and reconnects (Lazy Pirate)
    ports = (broker.ingest_port, broker.serve_port)
    broker.kill()
    good.timeout_s = 0.2
    deadline = time.monotonic() + 10
    while good.missed < 2:
        good.tick()
        time.sleep(0.01)
        assert time.monotonic() < deadline
    good.timeout_s = 2.0  # the fresh broker is answered at the pace of a loaded machine
    again = start_broker(ports=ports)
    Worker(again.ctx, again.ingest_port).hello(OTHER)  # the fresh broker adopts another spec first
    again.wait_for(lambda r: r["spec"] is not None, "adoption")
    with pytest.raises(Refused) as exc:  # and the next heartbeat tells the running worker
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            good.tick()
            time.sleep(0.01)
    assert exc.value.cause == "bad_spec"
    for s in (good, bad):
        s.close()
    ctx.destroy(linger=0)


def test_a_session_sending_another_segment_length_than_the_runs_is_refused(start_broker) -> None:
    """A worker that already sends T-step segments cannot join a run whose T differs (a broker restarted
    on another run's snapshot): its segments could never be stored, so the session says so and stops."""
    broker = start_broker()
    assert broker.request(hello(SPEC, identity="w0-a", segment_length=8))["segment_length"] == 8
    ctx = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{broker.serve_port}"
    s = BrokerSession(ctx, endpoint, lambda: hello(SPEC, identity="w1-s", segment_length=16),
                      structlog.get_logger(), spec_hash=SPEC.hash)
    s.segment_length = 16
    with pytest.raises(Refused) as exc:
        s.handshake(lambda: False)
    assert exc.value.cause == "bad_shape" and "8" in exc.value.reason and "16" in exc.value.reason
    s.close()
    ctx.destroy(linger=0)


def run_worker(broker: Any, log: Any, *args: str) -> Tuple[int, List[Dict[str, Any]]]:
    """A real ``zclaw worker`` (Reacher) against ``broker`` until it exits: its exit code and log lines."""
    with open(log, "wb") as f:
        proc = subprocess.run(
            ZCLAW + ["worker", "--env", "gym:Reacher-v5", *args,
                     "--set", f"network.ingest_port={broker.ingest_port}",
                     "--set", f"network.serve_port={broker.serve_port}", "--set", "network.publish_port=1",
                     "--set", "network.learner_port=1", "--set", 'log.format="json"'],
            stdout=f, stderr=subprocess.STDOUT, timeout=120,
        )
    return proc.returncode, log_lines(log)


def test_a_real_worker_with_another_env_is_refused_and_exits_3(start_broker, tmp_path) -> None:
    broker = start_broker()
    Worker(broker.ctx, broker.ingest_port).hello(SPEC)  # the run's spec: test:Dummy-v0
    broker.wait_for(lambda r: r["spec"] is not None, "adoption")
    log = tmp_path / "worker.log"
    code, lines = run_worker(broker, log, "--envs", "1")
    assert code == EXIT_REFUSED, log.read_text()[-3000:]
    err = [e for e in lines if e.get("event") == "refused; exiting"]
    assert err and err[0]["cause"] == "bad_spec" and SPEC.hash in err[0]["reason"]
    assert broker.status()["refused"] == {"bad_spec": 1}
    assert broker.status()["inserted_segments"] == 0
    broker.stop()


def test_a_real_worker_whose_segments_cannot_fit_the_brokers_cap_exits_3_before_sending(start_broker,
                                                                                        tmp_path) -> None:
    """The welcome announces the broker's message cap: a worker whose every segment would be dropped as
    ``oversize`` says why and stops, instead of stepping envs for nothing."""
    broker = start_broker("network.max_message_mb=1")
    log = tmp_path / "worker.log"
    # Reacher: 4097 x 8 observations of 10 floats alone are 1.3 MB
    code, lines = run_worker(broker, log, "--envs", "8", "--set", "worker.segment_length=4096")
    assert code == EXIT_REFUSED, log.read_text()[-3000:]
    err = [e for e in lines if e.get("event") == "refused; exiting"]
    assert err and err[0]["cause"] == "bad_shape" and "max_message_mb" in err[0]["reason"]
    assert broker.status()["inserted_segments"] == 0 and "oversize" not in broker.status()["drops"]
    broker.stop()


def test_learner_refuses_a_snapshot_for_another_spec_and_counts_bad_requests() -> None:
    from zclaw.learner.server import _Service
    import threading

    ctx = zmq.Context()
    stop = threading.Event()
    svc = _Service(ctx, "127.0.0.1", 0, 1 << 20, structlog.get_logger(), stop)
    svc.start()
    assert svc.ready.wait(10) and svc.error is None
    svc.weights, svc.spec_hash = b"\x00packed weights stand-in", SPEC.hash
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{svc.bound_port}")

    def ask(frames: List[Any]) -> Any:
        req.send_multipart(frames)
        assert req.poll(5000)
        return req.recv_multipart()

    from zclaw.wire import parse

    reply = parse(ask(make("snapshot", spec_hash=OTHER.hash)))
    assert reply.kind == "refused" and reply["cause"] == "bad_spec" and OTHER.hash in reply["reason"]
    assert ask(make("snapshot", spec_hash=SPEC.hash)) == [svc.weights]
    assert parse(ask([b"\xc1"])).kind == "error"
    v1 = parse(ask(with_header(make("snapshot", spec_hash=SPEC.hash), v=1)))  # a peer of protocol v1
    assert v1.kind == "refused" and v1["cause"] == "bad_version" and v1.header["v"] == 1
    assert "v2" in v1["reason"]
    report = parse(ask(make("status")))["report"]
    assert report["request_drops"] == {"refused_bad_spec": 1, "malformed": 1, "bad_version": 1}
    assert report["requests_served"] == {"snapshot": 2, "status": 1}  # the refused one was understood
    assert report["identity"].startswith("learner-")
    req.close(0)
    stop.set()
    svc.join(5)
    ctx.term()


def test_worker_takes_a_lower_version_only_from_a_new_learner_process() -> None:
    from zclaw import config
    from zclaw.wire import parse
    from zclaw.worker.worker import WeightsClient

    ctx = zmq.Context()
    client = WeightsClient(ctx, config.load(), SPEC, structlog.get_logger())

    def weights(version: int, learner: str) -> Any:
        return parse(make("weights", version=version, step=0, spec_hash=SPEC.hash, policy={},
                          learner=learner))

    assert client._accept(weights(20, "learner-a"), -1) is not None and client.learner == "learner-a"
    assert client._accept(weights(15, "learner-a"), 20) is None, "the same learner never goes back"
    assert client.drops.as_dict() == {"older_version": 1}
    assert client._accept(weights(15, "learner-b"), 20) is not None, "a resumed learner's weights win"
    assert client.learner == "learner-b"
    assert client._accept(weights(14, "learner-b"), 15) is None
    client.close()
    ctx.term()
