"""CURVE and the ZAP allowlist: allowed roles train together, strangers get nothing through any socket.

Real processes and real sockets on loopback TCP (CURVE works the same on loopback as across hosts); the
strangers are a client without keys and a client with a valid key pair that is not on the allowlist.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import zmq
import zmq.auth

from support.logs import log_lines
from support.procs import FAST, STATUS_MS, ZCLAW, Roles, free_port, sigterm, spawn
from support.waiting import wait_until
from support.synthetic import random_segment
from zclaw import config as config_mod
from zclaw.config import ConfigError
from zclaw.launch import StatusClient
from zclaw.logs import setup as log_setup
from zclaw.security import Security, is_loopback
from zclaw.tools.keys import KeysError, default_names, generate
from zclaw.wire import EnvSpec, LazyPirate, make, make_socket, parse, tcp
from zclaw.wire.sockets import CurveClient, term_context


def keys_cfg(keys: Path, **security: Any) -> Dict[str, Dict[str, Any]]:
    values = {"security.keys_dir": str(keys)}
    values.update({f"security.{k}": v for k, v in security.items()})
    return config_mod.load(values=values)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    generate(d, default_names(1, ["spare"]))
    return d


# ------------------------------------------------------------------------------------------ keys tool


def test_keys_generate_writes_the_layout_refuses_overwrite_and_force_replaces(tmp_path: Path) -> None:
    d = tmp_path / "k"
    out = subprocess.run(ZCLAW + ["keys", "generate", str(d), "--workers", "2", "--client", "ops"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names = ["broker", "learner", "tools", "worker0", "worker1", "ops"]
    assert sorted(p.name for p in (d / "private").iterdir()) == sorted(f"{n}.key_secret" for n in names)
    assert sorted(p.name for p in (d / "servers").iterdir()) == ["broker.key", "learner.key"]
    assert (sorted(p.name for p in (d / "allowed").iterdir())
            == sorted(f"{n}.key" for n in names if n != "broker"))
    assert stat.S_IMODE((d / "private").stat().st_mode) == 0o700
    for n in names:
        secret_file = d / "private" / f"{n}.key_secret"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600, n
        public, secret = zmq.auth.load_certificate(str(secret_file))
        assert secret is not None and len(secret) == 40
        listed = d / ("servers" if n == "broker" else "allowed") / f"{n}.key"
        assert zmq.auth.load_certificate(str(listed)) == (public, None), "public cert of the same pair"
    assert zmq.auth.load_certificate(str(d / "servers" / "learner.key"))[0] == \
        zmq.auth.load_certificate(str(d / "allowed" / "learner.key"))[0]

    before = (d / "private" / "broker.key_secret").read_bytes()
    again = subprocess.run(ZCLAW + ["keys", "generate", str(d)], capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "--force" in again.stderr and "broker" in again.stderr
    assert (d / "private" / "broker.key_secret").read_bytes() == before, "refused means nothing was written"
    forced = subprocess.run(ZCLAW + ["keys", "generate", str(d), "--force"], capture_output=True, text=True,
                            timeout=60)
    assert forced.returncode == 0, forced.stderr
    assert (d / "private" / "broker.key_secret").read_bytes() != before

    added = subprocess.run(ZCLAW + ["keys", "add", str(d), "worker7"], capture_output=True, text=True,
                           timeout=60)
    assert added.returncode == 0, added.stderr
    assert (d / "allowed" / "worker7.key").is_file() and (d / "private" / "worker7.key_secret").is_file()
    with pytest.raises(KeysError, match="worker7"):
        generate(d, ["worker7"])
    with pytest.raises(KeysError, match="not allowed"):
        generate(d, ["../escape"])


# ----------------------------------------------------------------------------------- config and errors


def test_missing_or_bad_key_files_are_config_errors_naming_the_key(keys: Path, tmp_path: Path) -> None:
    assert not Security.from_config(config_mod.load(), "worker").enabled
    ok = Security.from_config(keys_cfg(keys), "learner")
    assert ok.server() is not None and ok.client("broker") is not None

    with pytest.raises(ConfigError, match=r"security\.client_secret: .*worker5\.key_secret does not exist"):
        Security.from_config(keys_cfg(keys), "worker", index=5)
    with pytest.raises(ConfigError, match=r"security\.server_secret: .*does not exist"):
        Security.from_config(keys_cfg(tmp_path / "nowhere"), "broker")
    bad = tmp_path / "bad.key_secret"
    bad.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"security\.server_secret: .*bad\.key_secret"):
        Security.from_config(keys_cfg(keys, server_secret=str(bad)), "broker")
    with pytest.raises(ConfigError, match=r"security\.client_secret: .*holds no secret key"):
        Security.from_config(keys_cfg(keys, client_secret=str(keys / "allowed" / "worker0.key")), "worker")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"security\.allowed_clients: .*holds no \*\.key"):
        Security.from_config(keys_cfg(keys, allowed_clients=str(empty)), "broker")
    only_explicit = config_mod.load(
        values={"security.client_secret": str(keys / "private" / "worker0.key_secret")}
    )
    with pytest.raises(ConfigError,
                       match=r"security\.broker_public is not set and security\.keys_dir is empty"):
        Security.from_config(only_explicit, "worker")

    # a worker refuses to start (exit code 2) before it builds its envs
    from zclaw.worker.worker import main as worker_main

    assert worker_main(keys_cfg(keys), log_setup("worker", fmt="json", stream=open(os.devnull, "w")), 5) == 2


def test_loopback_detection() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "*", "", "10.77.0.1", "192.168.1.5", "eth0", "no-such-host.invalid", "::"):
        assert not is_loopback(host), host
    sec = Security.from_config(config_mod.load(), "broker")
    sec.check_bind("127.0.0.1")
    with pytest.raises(ConfigError, match="--insecure"):
        sec.check_bind("0.0.0.0")
    Security.from_config(config_mod.load(values={"security.insecure": True}), "broker").check_bind("0.0.0.0")


# ------------------------------------------------------------------------------ make_socket, in process


def test_curve_server_socket_admits_only_allowlisted_keys(keys: Path, tmp_path: Path) -> None:
    stranger_dir = tmp_path / "stranger"
    generate(stranger_dir, ["worker0"])
    sec = Security.from_config(keys_cfg(keys), "broker")
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.PULL, curve=sec.server())
    port = server.bind_to_random_port("tcp://127.0.0.1")
    allowed = Security.from_config(keys_cfg(keys), "worker").client("broker")
    assert allowed is not None
    pub, secret = zmq.auth.load_certificate(str(stranger_dir / "private" / "worker0.key_secret"))
    stranger = CurveClient(pub, secret, allowed.server_public)
    received: List[bytes] = []
    try:
        for label, curve in (("plain", None), ("stranger", stranger), ("allowed", allowed)):
            c = make_socket(ctx, zmq.PUSH, curve=curve)
            c.connect(tcp("127.0.0.1", port))
            c.send(label.encode())
            if server.poll(10000 if label == "allowed" else 1500):  # the key check runs in this process
                received.append(server.recv())
            c.close(linger=0)
    finally:
        server.close(linger=0)
        term_context(ctx)  # stops the authenticator; a bare ctx.term() would hang on its socket
    assert received == [b"allowed"]
    assert "secret" not in repr(allowed) and allowed.secret.decode() not in repr(allowed)


# ------------------------------------------------------------------------- real roles, real strangers


def _curve_of(keys_dir: Path, name: str, server_public: bytes) -> CurveClient:
    pub, secret = zmq.auth.load_certificate(str(keys_dir / "private" / f"{name}.key_secret"))
    return CurveClient(pub, secret, server_public)


def _request(
    ctx: zmq.Context, endpoint: str, frames: List[Any], curve: Optional[CurveClient], timeout_ms: int = 1500
) -> Any:
    pirate = LazyPirate(ctx, endpoint, timeout_ms=timeout_ms, retries=0, curve=curve)
    try:
        return pirate.request(frames)
    finally:
        pirate.close()


@pytest.mark.slow
def test_allowed_roles_train_and_strangers_get_nothing_through_any_socket(
    keys: Path, tmp_path: Path
) -> None:
    stranger_dir = tmp_path / "stranger"
    generate(stranger_dir, ["tools"])  # a well-formed key pair that is simply not on the allowlist
    roles = Roles(tmp_path)
    sec_args = ["--set", f"security.keys_dir={keys}"]
    cfg = keys_cfg(keys)
    tools = Security.from_config(cfg, "tools")
    b_pub = tools.client("broker").server_public
    l_pub = tools.client("learner").server_public
    p = roles.ports
    ep = {"ingest": tcp("127.0.0.1", p["ingest_port"]), "serve": tcp("127.0.0.1", p["serve_port"]),
          "pub": tcp("127.0.0.1", p["publish_port"]), "learner": tcp("127.0.0.1", p["learner_port"])}
    strangers = {
        "plain": (None, None),
        "stranger": (_curve_of(stranger_dir, "tools", b_pub), _curve_of(stranger_dir, "tools", l_pub)),
    }
    ctx = roles.ctx
    subs: Dict[str, zmq.Socket] = {}
    pushers: List[zmq.Socket] = []
    try:
        roles.broker.close()
        roles.learner.close()
        roles.broker = StatusClient(ctx, ep["serve"], STATUS_MS, curve=tools.client("broker"))
        roles.learner = StatusClient(ctx, ep["learner"], STATUS_MS, curve=tools.client("learner"))
        roles.start("broker", *sec_args)
        roles.start("learner", "--run-dir", str(tmp_path / "run"), *sec_args)
        roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", *sec_args, name="worker0")

        # the allowed roles work end to end: segments stored, weights received and acted on
        rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 2, timeout=90)
        spec = EnvSpec.from_dict(rep["spec"])
        b = roles.wait(roles.broker, lambda r: any(
            k.startswith("w0-") and w["segments"] > 0 and (w["version"] or 0) >= 1
            for k, w in r["workers"].items()
        ), timeout=30)
        assert b["inserted_segments"] > 0

        # every stranger (and, as the control, the allowed tools key) opens a SUB and pushes a hello and a
        # segment under its own identity; all sockets stay open while the requests below run
        rng = np.random.default_rng(0)
        clients = dict(strangers)
        clients["tools"] = (tools.client("broker"), tools.client("learner"))
        for label, (to_broker, to_learner) in clients.items():
            sub = make_socket(ctx, zmq.SUB, conflate=True, curve=to_learner)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(ep["pub"])
            subs[label] = sub
            push = make_socket(ctx, zmq.PUSH, curve=to_broker)
            # a refused handshake can take the PUSH's only pipe with it, and a PUSH with no pipe blocks in
            # send: a stranger's send may time out (nothing got through), the control's must not
            push.setsockopt(zmq.SNDTIMEO, 5000)
            push.connect(ep["ingest"])
            pushers.append(push)
            ident = f"intruder-{label}"
            arrays = random_segment(spec, 32, 4, rng, version=0)
            try:
                push.send_multipart(make("hello", role="worker", identity=ident, host="x", pid=1, zclaw="0",
                                         spec=spec.to_dict(), segment_length=32))
                push.send_multipart(make("segment", arrays, worker=ident, seq=0, spec_hash=spec.hash,
                                         episodes=[]))
            except zmq.Again:
                assert label != "tools", "control: an allowed push is never refused"

        snapshot = make("snapshot", spec_hash=spec.hash)
        sample = make("sample", batch_size=1, version=0, priority_keys=[], priorities=[])
        for label, (to_broker, to_learner) in strangers.items():
            assert StatusClient(ctx, ep["serve"], 1500, curve=to_broker).report() is None, label
            assert StatusClient(ctx, ep["learner"], 1500, curve=to_learner).report() is None, label
            assert _request(ctx, ep["learner"], snapshot, to_learner) is None, label
            assert _request(ctx, ep["serve"], sample, to_broker) is None, label
        # control: the same requests with an allowed key are answered
        assert _request(ctx, ep["learner"], snapshot, tools.client("learner"), 10000).kind == "weights"
        assert _request(ctx, ep["serve"], make("status"), tools.client("broker"), 10000).kind == "status"

        # watch the SUBs for at least 3 s, and until the control has seen weights (30 s at most)
        started = time.monotonic()
        got = {label: 0 for label in subs}
        while time.monotonic() - started < 3.0 or (got["tools"] == 0 and time.monotonic() - started < 30):
            for label, sub in subs.items():
                while sub.poll(0):
                    msg = parse([sub.recv()])
                    assert msg.kind == "weights"
                    got[label] += 1
            time.sleep(0.05)
        assert got["tools"] > 0, "control: an allowed SUB receives the weights being published"
        assert got["plain"] == 0 and got["stranger"] == 0, got

        b = roles.wait(roles.broker, lambda r: r["workers"].get("intruder-tools", {}).get("segments", 0) >= 1,
                       timeout=30)
        assert b["workers"]["intruder-tools"]["segments"] == 1, "control: an allowed push is stored"
        assert "intruder-plain" not in b["workers"] and "intruder-stranger" not in b["workers"], b["workers"]

        events = [e for e in log_lines(tmp_path / "broker.log")
                  if "refused by the CURVE allowlist" in str(e.get("event"))]
        assert events, "the broker logs the connections its allowlist refused"
        listening = [e for e in log_lines(tmp_path / "broker.log") if e.get("event") == "broker listening"]
        assert listening and listening[0]["curve"] is True
    finally:
        for sock in list(subs.values()) + pushers:
            sock.close(linger=0)
        roles.close()


# ----------------------------------------------------------------------------- binding beyond loopback


def _ports_args() -> List[str]:
    out = []
    for k in ("ingest_port", "serve_port", "publish_port", "learner_port"):
        out += ["--set", f"network.{k}={free_port()}"]
    return out


def test_non_loopback_bind_is_refused_without_keys_unless_insecure(keys: Path, tmp_path: Path) -> None:
    wide = ["--set", "network.bind_host=0.0.0.0", "--set", "log.format=json"]
    for role, extra in (("broker", []), ("learner", ["--run-dir", str(tmp_path / "lrun")])):
        out = subprocess.run(ZCLAW + [role] + wide + _ports_args() + extra, capture_output=True, text=True,
                             timeout=90)
        assert out.returncode == 2, (role, out.stderr)
        assert "refusing to bind" in out.stderr and "--insecure" in out.stderr, out.stderr

    run_dir = tmp_path / "trun"
    out = subprocess.run(ZCLAW + ["train", "--time", "5", "--run-dir", str(run_dir)] + wide,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr, out.stderr
    assert not run_dir.exists(), "refused before any process started"

    def serve(extra: List[str], curve: Optional[CurveClient], log_name: str) -> Dict[str, Any]:
        ports = _ports_args()
        serve_port = int(ports[3].split("=")[1])
        log = open(tmp_path / log_name, "wb")
        proc = spawn(["broker"] + wide + ports + extra, stdout=log)
        ctx = zmq.Context()
        client = StatusClient(ctx, tcp("127.0.0.1", serve_port), curve=curve)
        try:
            rep = wait_until(client.report, 30, "the broker's status report", interval=0, proc=proc,
                             output=tmp_path / log_name)
            assert rep["role"] == "broker", (tmp_path / log_name).read_text()
            assert sigterm(proc, 20) == 0
            return rep
        finally:
            if proc.poll() is None:
                proc.kill()
            client.close()
            ctx.term()

    serve(["--insecure"], None, "insecure.log")
    warned = [e for e in log_lines(tmp_path / "insecure.log") if "WITHOUT encryption" in str(e.get("event"))]
    assert warned and warned[0]["level"] == "warning" and warned[0]["bind_host"] == "0.0.0.0"

    # with keys, binding beyond loopback needs no flag, and plain clients are shut out
    serve(["--set", f"security.keys_dir={keys}"],
          Security.from_config(keys_cfg(keys), "tools").client("broker"), "curve.log")
    assert not [e for e in log_lines(tmp_path / "curve.log") if "WITHOUT encryption" in str(e.get("event"))]


@pytest.mark.slow
def test_train_with_keys_runs_encrypted_and_checks_every_key_first(keys: Path, tmp_path: Path) -> None:
    base = ZCLAW + ["train", "--set", f"security.keys_dir={keys}"] + FAST
    out = subprocess.run(base + ["--workers", "2", "--time", "5", "--run-dir", str(tmp_path / "r2")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "worker1.key_secret" in out.stderr, out.stderr  # keys made for 1 worker
    assert not (tmp_path / "r2").exists()

    run_dir = tmp_path / "run"
    # 20 s of wall time, start-up included: enough for updates on a loaded machine
    out = subprocess.run(base + ["--time", "20", "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] > 0 and summary["updates"], (
        "the launcher's status client got through as tools"
    )
    listening = [e for e in log_lines(run_dir / "logs" / "broker.log")
                 if e.get("event") == "broker listening"]
    assert listening[0]["curve"] is True
