"""The learner as a real process, against a broker stand-in that speaks the real protocol on a ROUTER.

The stand-in answers ``status`` with an env spec (once the test lets it) and ``sample`` with synthetic
batches built by ``make("batch", ...)``; it records every sample request, so the test can check the
version and the priorities the learner sends back. It can go away and come back on the same port, which
is what the learner's Lazy Pirate must survive.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
from support.logs import log_lines
from support.procs import free_port, sigterm, spawn
from support.waiting import wait_until
import zmq
from zmq.utils.monitor import recv_monitor_message

from support.batches import batch_layout

from zclaw.config import defaults
from zclaw.learner import checkpoint as ckpt
from zclaw.policy.weights import model_from_weights
from zclaw.wire import EnvSpec, make, parse

SPEC = EnvSpec("test:Synthetic-v0", (3,), (2,), (-1.0, -1.0), (1.0, 1.0))
B, T, N = 2, 8, 2
REPO = Path(__file__).resolve().parents[2]


def synthetic_batch(keys: List[int], rng: np.random.Generator, version: int,
                    columns: Optional[List[int]] = None) -> list:
    """B segments of N envs each, or of ``columns`` envs (summing to B x N: the same arrays, split
    otherwise)."""
    D, A = SPEC.obs_shape[0], SPEC.action_shape[0]
    arrays = {
        "obs": rng.normal(size=(B, T + 1, N, D)).astype(np.float32),
        "action": rng.uniform(-1, 1, size=(B, T, N, A)).astype(np.float32),
        "reward": rng.normal(size=(B, T, N)).astype(np.float32),
        "terminated": rng.random((B, T, N)) < 0.1,
        "truncated": np.zeros((B, T, N), bool),
        "option": np.zeros((B, T, N), np.int32),
        "option_start": np.zeros((B, T, N), bool),
        "logp_action": np.full((B, T, N), -2.0, np.float32),
        "logp_option": np.zeros((B, T, N), np.float32),
        "policy_version": np.full((B, T), max(0, version - 1), np.int64),
        "final_obs": rng.normal(size=(1, D)).astype(np.float32),
        "final_at": np.array([[1, T - 1, 0]], np.int32),
        "is_weight": np.ones(B, np.float32),
    }
    arrays["truncated"][1, T - 1, 0] = True
    return make("batch", batch_layout(arrays), keys=keys, columns=columns or [N] * B, workers=["w0"] * B,
                seqs=keys, spec_hash=SPEC.hash, episodes=[{"return": -5.0, "length": 50}])


class BrokerStandIn(threading.Thread):
    """A ROUTER on ``port`` answering hello, status and sample; ``up`` cleared = gone (socket closed)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.ctx = zmq.Context.instance()
        self.up = threading.Event()
        self.up.set()
        self.spec_ready = threading.Event()
        self.stop = threading.Event()
        self.requests: List[Dict[str, Any]] = []  # headers of sample requests, with the keys we answered
        self.lock = threading.Lock()
        self.next_key = 0
        self.rng = np.random.default_rng(0)
        self.columns: Optional[List[int]] = None  # each batch's segment env counts (None: N each)

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.up.is_set():
                time.sleep(0.02)
                continue
            sock = self.ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            for _ in range(100):
                try:
                    sock.bind(f"tcp://127.0.0.1:{self.port}")
                    break
                except zmq.ZMQError:
                    time.sleep(0.05)
            while self.up.is_set() and not self.stop.is_set():
                if sock.poll(50):
                    frames = sock.recv_multipart()
                    envelope, body = frames[:2], frames[2:]
                    sock.send_multipart(envelope + self.answer(body))
            sock.close(linger=0)

    def answer(self, body: list) -> list:
        msg = parse(body, ("status", "sample", "hello"))
        if msg.kind == "status":
            spec = SPEC.to_dict() if self.spec_ready.is_set() else None
            return make("status", report={"role": "broker", "spec": spec}, role="broker")
        if msg.kind == "hello":  # the learner's handshake: the welcome names the env spec once there is one
            spec = SPEC.to_dict() if self.spec_ready.is_set() else None
            return make("welcome", role="broker", identity="broker-standin", host="h", pid=1, zclaw="0",
                        spec=spec, segment_length=T, max_message_bytes=1 << 30)
        with self.lock:
            entry = {k: msg.get(k) for k in ("batch_size", "columns", "version", "priority_keys",
                                             "priorities")}
            self.requests.append(entry)
            if len(self.requests) % 4 == 1:  # every few requests: not yet
                entry["answered"] = None
                return make("retry", reason="min_size", retry_ms=30)
            keys = list(range(self.next_key, self.next_key + B))
            self.next_key += B
            entry["answered"] = keys
        return synthetic_batch(keys, self.rng, int(msg["version"]), self.columns)

    def sample_count(self) -> int:
        with self.lock:
            return len(self.requests)


def request(endpoint: str, frames: list, timeout_s: float) -> Optional[Any]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        if s.poll(int(timeout_s * 1000)):
            return parse(s.recv_multipart())
        return None
    finally:
        s.close(linger=0)


class Subscriber:
    """SUB to the learner's PUB that knows when its connection is up (so no version is missed)."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.versions: List[int] = []
        self.first = None  # the first weights message received, parsed

    def wait_connected(self, timeout_s: float) -> None:
        assert self.monitor.poll(int(timeout_s * 1000)), "SUB never connected to the learner PUB"
        recv_monitor_message(self.monitor)
        time.sleep(0.3)  # let the subscription reach the PUB

    def drain(self, timeout_s: float = 0.1) -> List[int]:
        while self.sock.poll(int(timeout_s * 1000)):
            msg = parse(self.sock.recv_multipart())
            self.first = self.first if self.first is not None else msg
            self.versions.append(int(msg["version"]))
            timeout_s = 0.0
        return self.versions

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


def start_learner(run_dir: Path, ports: Dict[str, int], resume: bool, log_file: Path,
                  *more: str) -> subprocess.Popen:
    sets = [
        *more,
        f"network.serve_port={ports['serve']}", f"network.publish_port={ports['pub']}",
        f"network.learner_port={ports['router']}", "network.request_timeout_ms=2000",
        "learner.batch_segments=2", "learner.epochs=1", "learner.minibatches=2", "learner.checkpoint_s=1",
        "policy.hidden=[16]", "log.status_s=1", "log.format=json",
    ]
    args = ["learner", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    if resume:
        args.append("--resume")
    return spawn(args, stdout=log_file.open("ab"), cwd=str(REPO), env={"PYTHONUNBUFFERED": "1"})


def stop_learner(proc: subprocess.Popen, log: Path) -> None:
    rc = sigterm(proc, 10, "learner")
    assert rc == 0, log.read_text()[-3000:]


@pytest.fixture
def broker():
    ports = {"serve": free_port(), "pub": free_port(), "router": free_port()}
    b = BrokerStandIn(ports["serve"])
    b.ports = ports
    b.start()
    yield b
    b.stop.set()
    b.join(5)


@pytest.mark.timeout(240)
def test_learner_process_publishes_serves_survives_broker_restart_and_resumes(tmp_path: Path, broker) -> None:
    ports, run_dir, log = broker.ports, tmp_path / "run", tmp_path / "learner.log"
    router = f"tcp://127.0.0.1:{ports['router']}"
    sub = Subscriber(ports["pub"])
    proc = start_learner(run_dir, ports, resume=False, log_file=log)
    try:
        # before the broker knows the env spec there is no model: snapshot says retry
        reply = wait_until(lambda: request(router, make("snapshot"), 1.0), 60, "learner ROUTER", proc=proc,
                           output=log)
        assert reply.kind == "retry" and reply["reason"] == "no weights yet"
        sub.wait_connected(5)
        broker.spec_ready.set()

        # versions published on PUB start at 0 and increase
        wait_until(lambda: len(sub.drain()) >= 6, 60, "6 published versions", proc=proc, output=log)
        v = sub.versions
        assert v[0] == 0 and all(b > a for a, b in zip(v, v[1:])), v

        # a snapshot request gets the current weights while training (the worker's join time is
        # pinned by test_e2e)
        snap = request(router, make("snapshot", spec_hash=SPEC.hash), 10.0)
        assert snap is not None
        assert snap.kind == "weights" and snap["version"] >= v[-1] and snap["spec_hash"] == SPEC.hash
        model = model_from_weights(snap)
        assert model.cfg.obs_dim == 3 and model.cfg.act_dim == 2 and list(model.cfg.hidden) == [16]
        wrong = request(router, make("snapshot", spec_hash="0" * 16), 10.0)
        assert wrong.kind == "refused" and wrong["cause"] == "bad_spec"  # the worker logs why and exits 3

        status = request(router, make("status"), 10.0)
        assert status.kind == "status"
        rep = status["report"]
        for key in ("role", "uptime_s", "version", "updates", "steps_consumed", "updates_per_s", "losses",
                    "lag_mean", "lag_max", "lag_mean_all", "lag_max_all", "return_mean_100",
                    "last_checkpoint", "spec"):
            assert key in rep, key
        assert rep["role"] == "learner" and rep["spec"] == SPEC.to_dict() and rep["version"] >= 5
        assert rep["updates"] >= 5 and rep["steps_consumed"] == rep["updates"] * B * T * N
        assert rep["return_mean_100"] == -5.0 and rep["lag_max"] >= 1.0 and "loss/policy" in rep["losses"]

        # the sample requests carry the version and, once, the priorities of each trained batch: with
        # learner.prefetch = c requests in flight, request j is sent after the reply to request j - c trained
        c = defaults()["learner"]["prefetch"]
        with broker.lock:
            reqs = list(broker.requests)
        assert reqs[0]["version"] == 0 and reqs[0]["batch_size"] == B and reqs[0]["priority_keys"] == []
        assert all(r["priority_keys"] == [] for r in reqs[:c])
        for j in range(c, len(reqs)):
            trained = reqs[j - c]["answered"]
            assert reqs[j]["priority_keys"] == (trained or []), j
            assert len(reqs[j]["priorities"]) == (B if trained else 0)
        versions_asked = [r["version"] for r in reqs]
        assert versions_asked == sorted(versions_asked) and versions_asked[-1] >= 5

        # Lazy Pirate: the broker goes away and comes back on the same port; batches resume
        broker.up.clear()
        time.sleep(1.5)
        n = broker.sample_count()
        broker.up.set()
        wait_until(lambda: broker.sample_count() >= n + 3, 30, "requests after the broker came back",
                   proc=proc, output=log)
        before = sub.drain()[-1]
        wait_until(lambda: sub.drain()[-1] > before, 10, "a new version after the broker came back",
                   proc=proc, output=log)

        latest = run_dir / "checkpoints" / "latest.pt"
        wait_until(latest.is_file, 5, "a periodic checkpoint", proc=proc, output=log)
        stop_learner(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        sub.close()

    state = ckpt.load(run_dir / "checkpoints")
    last = state["version"]
    final = json.loads((run_dir / "learner_final.json").read_text())
    assert final["version"] == last and final["updates"] == state["updates"] >= 6
    assert any(p.name.startswith("events") for p in (run_dir / "tb").iterdir())
    assert 1 <= len(list((run_dir / "checkpoints").glob("ckpt-*.pt"))) <= 3

    # --resume continues the version counter: the first version published is the checkpoint's
    broker.spec_ready.clear()
    with broker.lock:
        broker.requests.clear()
    sub = Subscriber(ports["pub"])
    # resumed under a log std floor above the checkpoint's (init -0.5): the checkpoint's own version is
    # published lifted to the floor, before any update
    assert float(state["model"]["log_std"].min()) < -0.2
    proc = start_learner(run_dir, ports, True, log, "learner.log_std_min=-0.2")
    try:
        sub.wait_connected(20)
        broker.spec_ready.set()
        wait_until(lambda: len(sub.drain()) >= 3, 60, "versions after resume", proc=proc, output=log)
        assert sub.versions[0] == last, (sub.versions, last)
        assert float(model_from_weights(sub.first).log_std.detach().min()) == pytest.approx(-0.2)
        assert all(b > a for a, b in zip(sub.versions, sub.versions[1:]))
        with broker.lock:
            assert broker.requests[0]["version"] == last
        status = request(router, make("status"), 10.0)
        assert status["report"]["steps_consumed"] > state["steps_consumed"]
        stop_learner(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        sub.close()
    assert ckpt.load(run_dir / "checkpoints")["version"] > last


def test_resume_without_a_checkpoint_fails_clearly(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    ports = {"serve": free_port(), "pub": free_port(), "router": free_port()}
    proc = start_learner(tmp_path / "empty", ports, resume=True, log_file=log)
    assert proc.wait(30) == 2
    assert "no checkpoint" in log.read_text()


@pytest.mark.timeout(120)
def test_a_learner_sized_in_segments_says_once_that_unlike_workers_make_batches_vary(tmp_path: Path,
                                                                                     broker) -> None:
    """Batches joining segments of 1 and 3 envs, asked for in segments: the learner trains on them and logs,
    once, that ``learner.batch_columns`` would size them alike; asked for in columns, its requests carry
    the target and the most segments a broker serves."""
    broker.columns = [1, 3]
    broker.spec_ready.set()
    log = tmp_path / "learner.log"
    proc = start_learner(tmp_path / "run", broker.ports, False, log)
    try:
        wait_until(lambda: broker.sample_count() >= 12, 60, "twelve sample requests", proc=proc, output=log)
        hints = [e for e in log_lines(log) if "learner.batch_columns" in str(e.get("event"))]
        assert len(hints) == 1 and hints[0]["columns"] == [1, 3] and hints[0]["level"] == "warning", hints
        assert all(not r["columns"] for r in broker.requests)
    finally:
        stop_learner(proc, log)
    log2 = tmp_path / "learner2.log"
    proc = start_learner(tmp_path / "run2", broker.ports, False, log2, "learner.batch_columns=6")
    try:
        n = broker.sample_count()
        wait_until(lambda: broker.sample_count() >= n + 4, 60, "requests in columns", proc=proc, output=log2)
        asked = broker.requests[n:]
        assert all(r["columns"] == 6 and r["batch_size"] == 64 for r in asked), asked
        assert not [e for e in log_lines(log2) if "learner.batch_columns" in str(e.get("event"))]
    finally:
        stop_learner(proc, log2)
