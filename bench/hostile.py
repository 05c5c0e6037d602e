"""Benchmark: what one hostile or broken peer costs a live Reacher run (issue 14's attacks, as measured).

A real ``zclaw train`` run (broker, learner, one worker; ``configs/reacher.toml``) is started once; the bench
reads its endpoints from the resolved ``config.toml`` the run writes (``zclaw train`` picks free loopback
ports itself). Then, one attack at a time, three windows of ``--window`` seconds each:

- *baseline*: the run alone;
- *attack*: one attacker (a thread of this process, its own sockets, loopback only, bounded in count and
  stopped at the window's end) beside the run;
- *after*: the run alone again, still paying for whatever the attack left behind.

The first attack, ``none``, does nothing: its ratios are the noise floor of the others (a 2-core host's
10 s windows differ by about +-10% with nothing happening).

Real traffic is read from the roles' own ``status`` reports (the requests ``zclaw status`` makes, through
:class:`zclaw.launch.StatusClient`), every ``--poll`` seconds in a monitor thread: the real worker's
``segments`` in the broker's ``workers`` table (its ingest: attackers send under other identities) and
the learner's ``updates``. Each window's rate is the counter's difference over the time between the first
and the last report inside the window, so a role that answers late costs precision, not correctness.
Printed per attack: during / baseline and after / baseline of both, the drop counters that grew (broker
``drops``, learner ``request_drops`` and batch ``drops``, by cause), ``internal`` (broker ``internal``
plus the learner service's ``handler_error`` and ``service_error``: input nothing foresaw; must stay 0),
the largest RSS of broker and learner over attack and after (``/proc``, pids found among the run's
children), the cores each used during the attack, and how many status questions went unanswered.

The snapshot+status flood also times joins: a fresh ``zclaw worker --index 5`` started against the run,
its ``join_s`` read from its ``acting`` log line (from envs built to the first action: handshake and
weights), ``--joins`` times with the learner otherwise idle and as many times during a flood,
alternating; the medians and their ratio are printed (target <= 1.5).

Targets (issue 14): during / baseline >= 0.7 and after / baseline >= 0.9 for ingest and updates, no
``internal``, every role up. A missed ratio is printed, not an error: the exit status is non-zero only
when the run itself failed (a role exited or was restarted, or the run never started training).

    python bench/hostile.py [--window 10] [--attacks none,hellos,...] [--big-mb 400] [--joins 5] [--list]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack
import numpy as np
import zmq

from zclaw import __version__
from zclaw import config as config_mod
from zclaw.launch import StatusClient
from zclaw.security import Security
from zclaw.wire import EnvSpec, Segment, make, tcp
from zclaw.wire.protocol import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: the issue's figures for the hello attack: two huge hellos, then 1,100 more, each ~1 MiB identity + host
HUGE_HELLOS = (2, 1100)
#: segments per second of the 1 MB worker-id and 1 MB unknown-field attacks
BAD_SEGMENT_RATE = 3.0


# ---------------------------------------------------------------------------------------- /proc figures


def children(pid: int) -> List[int]:
    """Pids whose parent is ``pid`` (the kernel's children list, else a scan of /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(x) for x in path.read_text().split()]
    except OSError:
        pass
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def role_pids(train_pid: int) -> Dict[str, int]:
    """role (broker, learner, worker0, ...) -> pid, from the command lines of ``zclaw train``'s children."""
    out: Dict[str, int] = {}
    for pid in children(train_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "zclaw.cli" not in argv:
            continue
        rest = argv[argv.index("zclaw.cli") + 1:]
        role = rest[0] if rest else "?"
        if role == "worker" and "--index" in rest:
            role += rest[rest.index("--index") + 1]
        out[role] = pid
    return out


def rss_mib(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cpu_s(pid: int) -> Optional[float]:
    """User + system CPU seconds of ``pid`` (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------- the run


class Sample:
    """One look at the run: the figures the bench needs from both reports and /proc."""

    __slots__ = ("t", "segments", "updates", "version", "drops", "internal", "rss", "cpu", "pids")

    def __init__(self, t: float) -> None:
        self.t = t
        self.segments: Optional[int] = None  # the real worker's segments, from the broker's workers table
        self.updates: Optional[int] = None
        self.version: Optional[int] = None
        self.drops: Dict[str, int] = {}  # "broker:<cause>", "learner:<cause>", "learner-batch:<cause>"
        self.internal: Optional[int] = None
        self.rss: Dict[str, Optional[float]] = {}
        self.cpu: Dict[str, Optional[float]] = {}
        self.pids: Dict[str, int] = {}


class LiveRun:
    """``zclaw train`` on configs/reacher.toml, its endpoints, and a monitor thread sampling its status."""

    def __init__(self, run_dir: Path, seconds: float, poll: float, extra: List[str]) -> None:
        self.run_dir = run_dir
        self.poll = poll
        self.out_path = run_dir.parent / (run_dir.name + ".train.out")
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zclaw.cli", "train",
                 "--config", str(ROOT / "configs" / "reacher.toml"), "--time", str(int(seconds)),
                 "--run-dir", str(run_dir), "--set", "learner.tensorboard=false", *extra],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            self.cfg = self._read_config(time.monotonic() + 60)
        except BaseException:  # nobody holds the run yet: stop it here (train stops its roles on SIGTERM)
            self.proc.terminate()
            self.proc.wait(60)
            raise
        net = self.cfg["network"]
        self.ingest = tcp("127.0.0.1", int(net["ingest_port"]))
        self.serve = tcp("127.0.0.1", int(net["serve_port"]))
        self.learner = tcp("127.0.0.1", int(net["learner_port"]))
        self.ctx = zmq.Context()
        sec = Security.from_config(self.cfg, "tools")
        self.broker_status = StatusClient(self.ctx, self.serve, timeout_ms=2000, curve=sec.client("broker"))
        self.learner_status = StatusClient(self.ctx, self.learner, timeout_ms=2000,
                                           curve=sec.client("learner"))
        self.samples: List[Sample] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.worker_id: Optional[str] = None
        self.spec: Optional[EnvSpec] = None
        self.pids: Dict[str, int] = {}
        self.seen_pids: Dict[str, set] = {}
        self.monitor = threading.Thread(target=self._monitor, name="monitor", daemon=True)

    def _read_config(self, deadline: float) -> Dict[str, Dict[str, Any]]:
        path = self.run_dir / "config.toml"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zclaw train exited with {self.proc.returncode}:\n{self.tail()}")
            if path.exists():
                try:
                    return config_mod.load(str(path))
                except config_mod.ConfigError:  # still being written
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"zclaw train wrote no {path} within 60 s")

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.out_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, timeout: float) -> None:
        """Wait until the learner has trained a few updates on the real worker's segments; find that
        worker's identity and the run's env spec in the broker's report."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zclaw train exited with {self.proc.returncode}:\n{self.tail()}")
            self.pids = role_pids(self.proc.pid)
            b, L = self.broker_status.report(), self.learner_status.report()
            if b and L and b.get("spec") and (L.get("updates") or 0) >= 3 and "worker0" in self.pids:
                ids = [k for k, w in (b.get("workers") or {}).items()
                       if k.startswith("w0-") and w.get("pid") == self.pids["worker0"]]
                if ids:
                    self.worker_id, self.spec = ids[0], EnvSpec.from_dict(b["spec"])
                    self.seen_pids = {k: {v} for k, v in self.pids.items()}
                    self.monitor.start()
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the run did not start training within {timeout:.0f} s:\n{self.tail()}")

    def _monitor(self) -> None:
        while not self.stop_event.is_set():
            t_next = time.monotonic() + self.poll
            s = self.look()
            with self.lock:
                self.samples.append(s)
            self.stop_event.wait(max(0.0, t_next - time.monotonic()))

    def look(self) -> Sample:
        s = Sample(time.monotonic())
        pids = role_pids(self.proc.pid)
        for role, pid in pids.items():
            self.seen_pids.setdefault(role, set()).add(pid)
        s.pids = pids
        for role in ("broker", "learner", "worker0"):
            if role in pids:
                s.rss[role], s.cpu[role] = rss_mib(pids[role]), cpu_s(pids[role])
        s.cpu["bench"] = cpu_s(os.getpid())
        b = self.broker_status.report()
        L = self.learner_status.report()
        if b is not None:
            w = (b.get("workers") or {}).get(self.worker_id) or {}
            s.segments = w.get("segments")
            s.drops.update({f"broker:{k}": int(v) for k, v in (b.get("drops") or {}).items()})
        if L is not None:
            s.updates, s.version = L.get("updates"), L.get("version")
            s.drops.update({f"learner:{k}": int(v) for k, v in (L.get("request_drops") or {}).items()})
            s.drops.update({f"learner-batch:{k}": int(v) for k, v in (L.get("drops") or {}).items()})
        if b is not None and L is not None:
            s.internal = sum(s.drops.get(k, 0) for k in (
                "broker:internal", "learner:handler_error", "learner:service_error", "learner:internal"))
        return s

    def between(self, t0: float, t1: float) -> List[Sample]:
        with self.lock:
            return [s for s in self.samples if t0 <= s.t <= t1]

    def last_before(self, t: float) -> Optional[Sample]:
        with self.lock:
            older = [s for s in self.samples if s.t <= t and s.internal is not None]
        return older[-1] if older else None

    def failure(self) -> Optional[str]:
        """Why the run no longer counts as up, or None: train exited, or a role was restarted."""
        if self.proc.poll() is not None:
            return f"zclaw train exited with {self.proc.returncode}"
        restarted = sorted(r for r, p in self.seen_pids.items() if len(p) > 1)
        if restarted:
            return f"restarted: {', '.join(restarted)}"
        missing = [r for r in ("broker", "learner", "worker0") if r not in role_pids(self.proc.pid)]
        return f"not running: {', '.join(missing)}" if missing else None

    def close(self, grace: float) -> Optional[int]:
        self.stop_event.set()
        if self.monitor.is_alive():
            self.monitor.join(10)
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        self.broker_status.close()
        self.learner_status.close()
        self.ctx.destroy(linger=0)
        return code

    # ------------------------------------------------------------------------------------ segments

    def segment_frames(
        self, ident: str, seq: int, rng: np.random.Generator, obs_fill: Optional[float] = None, **header: Any
    ) -> List[Any]:
        """A well-formed segment of the run's spec and shape (``worker.segment_length`` x ``worker.envs``),
        small in-range values (every observation ``obs_fill`` if given), the learner's current version;
        ``header`` fields replaced or added after encoding."""
        assert self.spec is not None
        spec = self.spec
        T, N = int(self.cfg["worker"]["segment_length"]), int(self.cfg["worker"]["envs"])
        low, high = np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32)
        version = 0
        last = self.last_before(time.monotonic())
        if last is not None and last.version is not None:
            version = int(last.version)
        arrays = {
            "obs": (0.1 * rng.standard_normal((T + 1, N) + spec.obs_shape)).astype("<f4"),
            "action": np.broadcast_to((low + high) / 2, (T, N) + spec.action_shape).astype("<f4"),
            "reward": (-0.1 * rng.random((T, N))).astype("<f4"),
            "terminated": np.zeros((T, N), bool),
            "truncated": np.zeros((T, N), bool),
            "option": np.zeros((T, N), "<i4"),
            "option_start": np.zeros((T, N), bool),
            "logp_action": np.zeros((T, N), "<f4"),
            "logp_option": np.zeros((T, N), "<f4"),
            "policy_version": np.full((T,), version, "<i8"),
            "final_obs": np.zeros((0,) + spec.obs_shape, "<f4"),
            "final_at": np.zeros((0, 2), "<i4"),
        }
        arrays["option_start"][0] = True
        if obs_fill is not None:
            arrays["obs"][:] = obs_fill
        frames = Segment(ident, seq, spec.hash, arrays, []).frames()
        if header:
            head = msgpack.unpackb(bytes(frames[0]), raw=False)
            head.update(header)
            frames = [msgpack.packb(head, use_bin_type=True)] + list(frames[1:])
        return frames

    def hello(self, identity: str, host: str = "bench-attacker") -> List[Any]:
        assert self.spec is not None
        return make("hello", role="worker", identity=identity, host=host, pid=os.getpid(), zclaw=__version__,
                    spec=self.spec.to_dict(), segment_length=None)


# ---------------------------------------------------------------------------------------------- attacks


def _push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 8)  # the attacker's own memory stays bounded too
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _hold(sock: zmq.Socket, deadline: float) -> None:
    """Keep ``sock`` open until the attack window ends (what is queued still crosses), then drop the rest."""
    time.sleep(max(0.0, deadline - time.monotonic()))
    sock.close(linger=0)


def _send_until(sock: zmq.Socket, frames: List[Any], deadline: float) -> bool:
    """Send one message, waiting for room until ``deadline``; False if it did not go."""
    while time.monotonic() < deadline:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            sock.poll(20, zmq.POLLOUT)
    return False


def attack_none(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """No attack: the control row (what the windows' ratios are when nothing happens; their noise)."""
    time.sleep(max(0.0, deadline - time.monotonic()))
    return {}


def attack_hellos(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """Hellos whose identity and host are ~1 MiB strings, to the broker's ingest and its serve socket:
    two of each, then 1,100 of each (distinct identities), until the window ends. The serve side does not
    wait for answers (the broker's serve socket refuses a 2 MiB request at its size prefix and drops the
    connection, so none come): a hello its full queue cannot take is counted ``serve_full`` and the
    ingest side goes on."""
    push = _push(ctx, run.ingest)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 8)  # the attacker's own memory stays bounded too
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(run.serve)
    sent = {"ingest": 0, "serve": 0, "serve_full": 0, "serve_replies": 0}
    big = "i" * MIB
    try:
        k = 0
        for n in HUGE_HELLOS:
            for _ in range(n):
                if time.monotonic() >= deadline:
                    return sent
                frames = run.hello(big + str(k), host="h" * MIB)
                k += 1
                sent["ingest"] += _send_until(push, frames, deadline)
                try:
                    dealer.send_multipart([b""] + list(frames), zmq.NOBLOCK, copy=False)
                    sent["serve"] += 1
                except zmq.Again:
                    sent["serve_full"] += 1
                while dealer.poll(0):
                    dealer.recv_multipart()
                    sent["serve_replies"] += 1
        return sent
    finally:
        dealer.close(linger=0)
        _hold(push, deadline)


def huge_parts(kind: str) -> List[bytes]:
    """ONE message whose header lists parts of shape [2, 2**39, 2**39], with two 4-byte frames."""
    header = {"kind": kind, "v": PROTOCOL_VERSION, "arrays": [["x", "<f4", [2, 1 << 39, 1 << 39], 0, [1, 1]]]}
    return [msgpack.packb(header, use_bin_type=True), b"\x00" * 4, b"\x00" * 4]


def attack_parts(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """One ``status`` request with a huge ``parts`` shape to the learner's ROUTER, and one to the broker."""
    out: Dict[str, Any] = {}
    for name, endpoint in (("learner", run.learner), ("broker", run.serve)):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send_multipart(huge_parts("status"))
        wait_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        if sock.poll(wait_ms):
            reply = sock.recv_multipart()
            out[name] = msgpack.unpackb(reply[0], raw=False).get("kind")
        else:
            out[name] = "no answer"
        sock.close(linger=0)
    return out


def attack_blowup(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """One well-formed segment whose observations are finite but 1e30 (a simulator that blew up), from an
    identity that said hello first."""
    push = _push(ctx, run.ingest)
    ident = "w9-blownup"
    try:
        ok = _send_until(push, run.hello(ident), deadline)
        frames = run.segment_frames(ident, 0, np.random.default_rng(3), obs_fill=1e30)
        ok = _send_until(push, frames, deadline) and ok
        return {"sent": int(ok)}
    finally:
        _hold(push, deadline)


def _paced_segments(run: LiveRun, ctx: zmq.Context, deadline: float, **header: Any) -> Dict[str, Any]:
    push = _push(ctx, run.ingest)
    rng = np.random.default_rng(4)
    sent, seq = 0, 0
    try:
        t_next = time.monotonic()
        while time.monotonic() < deadline:
            frames = run.segment_frames("w8-attacker", seq, rng, **header)
            sent += _send_until(push, frames, deadline)
            seq += 1
            t_next += 1.0 / BAD_SEGMENT_RATE
            time.sleep(max(0.0, min(t_next, deadline) - time.monotonic()))
        return {"sent": sent}
    finally:
        _hold(push, deadline)


def attack_worker_id(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """Segments whose worker id is a ~1 MB string (under the segment cap), 3 per second."""
    return _paced_segments(run, ctx, deadline, worker="w" * 1_000_000)


def attack_unknown_fields(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """Valid segments carrying 1 MB of unknown header fields, 3 per second."""
    return _paced_segments(run, ctx, deadline, junk="u" * 1_000_000)


def attack_oversize(run: LiveRun, ctx: zmq.Context, deadline: float, big_mb: int = 400) -> Dict[str, Any]:
    """Six messages of ``--big-mb`` MB (decimal) each to the broker's ingest."""
    push = _push(ctx, run.ingest)
    blob = zmq.Frame(b"\x00" * (big_mb * 1_000_000))
    sent = 0
    try:
        for _ in range(6):
            sent += _send_until(push, [blob], deadline)
        return {"sent": sent, "mb": big_mb}
    finally:
        _hold(push, deadline)


class Flood(threading.Thread):
    """One client sending ``snapshot`` and ``status`` requests to the learner's ROUTER as fast as it can
    (a DEALER with 32 in flight), until stopped; replies counted by kind."""

    def __init__(self, ctx: zmq.Context, endpoint: str, spec_hash: Optional[str]) -> None:
        super().__init__(name="flood", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.stop_event = threading.Event()
        self.spec_hash = spec_hash
        self.replies: Dict[str, int] = {}
        self.sent = 0

    def run(self) -> None:
        reqs = [[b""] + make("snapshot", spec_hash=self.spec_hash), [b""] + make("status")]
        in_flight = 0
        try:
            while not self.stop_event.is_set():
                while in_flight < 32:
                    self.sock.send_multipart(reqs[self.sent % 2], copy=False)
                    in_flight, self.sent = in_flight + 1, self.sent + 1
                if self.sock.poll(100):
                    frames = self.sock.recv_multipart()
                    in_flight -= 1
                    kind = "weights" if len(frames[1]) > 64 << 10 else _kind(frames[1])
                    self.replies[kind] = self.replies.get(kind, 0) + 1
        finally:
            self.sock.close(linger=0)


def _kind(header: bytes) -> str:
    try:
        return str(msgpack.unpackb(header, raw=False).get("kind"))
    except Exception:  # a weights message's packed form, or anything else
        return "other"


def attack_flood(run: LiveRun, ctx: zmq.Context, deadline: float) -> Dict[str, Any]:
    """``snapshot`` and ``status`` requests to the learner as fast as one client can send."""
    flood = Flood(ctx, run.learner, run.spec.hash if run.spec else None)
    flood.start()
    time.sleep(max(0.0, deadline - time.monotonic()))
    flood.stop_event.set()
    flood.join(10)
    return {"sent": flood.sent, **flood.replies}


ATTACKS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "none": attack_none,
    "hellos": attack_hellos,
    "parts": attack_parts,
    "blowup": attack_blowup,
    "worker_id": attack_worker_id,
    "unknown_fields": attack_unknown_fields,
    "oversize": attack_oversize,
    "flood": attack_flood,
}


# ------------------------------------------------------------------------------------------- measuring


def window_rate(samples: List[Sample], key: str) -> Optional[float]:
    """Per second over the window: the counter's difference between the first and the last sample that
    has it, over the time between them (None with fewer than two such samples)."""
    have = [s for s in samples if getattr(s, key) is not None]
    if len(have) < 2 or have[-1].t - have[0].t <= 0:
        return None
    return (getattr(have[-1], key) - getattr(have[0], key)) / (have[-1].t - have[0].t)


def ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or b <= 0:
        return "n/a"
    return f"{a / b:.2f}"


def cores(samples: List[Sample], role: str) -> Optional[float]:
    have = [s for s in samples if s.cpu.get(role) is not None]
    if len(have) < 2 or have[-1].t - have[0].t <= 0:
        return None
    return (have[-1].cpu[role] - have[0].cpu[role]) / (have[-1].t - have[0].t)


def _f(v: Optional[float], fmt: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def measure(run: LiveRun, name: str, window: float, big_mb: int) -> Tuple[str, Dict[str, Any]]:
    """Baseline, attack and after windows of one attack; its printed line and the figures in it."""
    ctx = zmq.Context()
    t0 = time.monotonic()
    time.sleep(window)
    t1 = time.monotonic()
    before = run.last_before(t1)
    kwargs = {"big_mb": big_mb} if name == "oversize" else {}
    info: Dict[str, Any] = {}

    def attacker() -> None:
        try:
            info.update(ATTACKS[name](run, ctx, t1 + window, **kwargs))
        except Exception as exc:  # the attacker's own failure is reported, it is not the run's
            info["attacker_error"] = repr(exc)[:200]

    th = threading.Thread(target=attacker, name=f"attack-{name}", daemon=True)
    th.start()
    time.sleep(max(0.0, t1 + window - time.monotonic()))
    th.join(30)
    t2 = time.monotonic()
    time.sleep(window)
    t3 = time.monotonic()
    ctx.destroy(linger=0)
    base, during, after = run.between(t0, t1), run.between(t1, t2), run.between(t2, t3)
    rates = {f"{k}_{w}": window_rate(s, k) for k in ("segments", "updates")
             for w, s in (("base", base), ("during", during), ("after", after))}
    end = next((s for s in reversed(during + after) if s.internal is not None), None)
    counted: Dict[str, int] = {}
    if before is not None and end is not None:
        for cause, n in end.drops.items():
            if n - before.drops.get(cause, 0) > 0:
                counted[cause] = n - before.drops.get(cause, 0)
    internal = end.internal if end is not None else None
    rss = {r: max((s.rss.get(r) or 0.0 for s in during + after), default=0.0) for r in ("broker", "learner")}
    rss_base = {r: max((s.rss.get(r) or 0.0 for s in base), default=0.0) for r in ("broker", "learner")}
    rss_end = {r: next((s.rss[r] for s in reversed(after) if s.rss.get(r)), 0.0)
               for r in ("broker", "learner")}
    unanswered = sum(1 for s in during + after if s.internal is None)
    counted_text = " ".join(f"{k}={v}" for k, v in sorted(counted.items())) or "none=0"
    line = (f"attack {name}: ingest during/base {ratio(rates['segments_during'], rates['segments_base'])} "
            f"after/base {ratio(rates['segments_after'], rates['segments_base'])}, "
            f"updates during/base {ratio(rates['updates_during'], rates['updates_base'])} "
            f"after/base {ratio(rates['updates_after'], rates['updates_base'])}, "
            f"counted {counted_text}, internal={'n/a' if internal is None else internal}, "
            f"rss_max broker {rss['broker']:.0f} learner {rss['learner']:.0f} MiB "
            f"(baseline {rss_base['broker']:.0f} / {rss_base['learner']:.0f}, "
            f"end {rss_end['broker']:.0f} / {rss_end['learner']:.0f})")
    core_text = ", ".join(
        f"{label} " + "/".join(_f(cores(w, role)) for w in (base, during, after))
        for label, role in (("broker", "broker"), ("learner", "learner"), ("worker", "worker0"),
                            ("bench", "bench")))
    detail = (f"    base {_f(rates['segments_base'])} segments/s {_f(rates['updates_base'])} updates/s; "
              f"cores base/during/after: {core_text}; status unanswered {unanswered} of "
              f"{len(during + after)}; attack {t2 - t1:.1f} s, sent {json.dumps(info, sort_keys=True)}")
    return line + "\n" + detail, {"rates": rates, "counted": counted, "internal": internal, "rss": rss}


def acting_join_s(path: Path) -> Optional[float]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "acting":
            return float(event["join_s"])
    return None


def join_once(run: LiveRun, log_dir: Path, k: int, flood: bool) -> Optional[float]:
    """Start ``zclaw worker --index 5`` against the run (during a flood or not); its join_s, then stop it."""
    ctx = zmq.Context()
    fl = Flood(ctx, run.learner, run.spec.hash if run.spec else None) if flood else None
    if fl is not None:
        fl.start()
        time.sleep(1.0)  # the flood is at full rate before the worker starts
    path = log_dir / f"join{k}-{'flood' if flood else 'idle'}.log"
    with open(path, "wb") as out:
        p = subprocess.Popen([sys.executable, "-m", "zclaw.cli", "worker", "--config",
                              str(run.run_dir / "config.toml"), "--index", "5", "--set", 'log.format="json"'],
                             stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        join = None
        while join is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            join = acting_join_s(path)
        return join
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if fl is not None:
            fl.stop_event.set()
            fl.join(10)
        ctx.destroy(linger=0)


def measure_joins(run: LiveRun, log_dir: Path, n: int) -> str:
    idle: List[float] = []
    flooded: List[float] = []
    for k in range(n):  # alternating, so a drift of the machine's load hits both alike
        for flood, into in ((False, idle), (True, flooded)):
            j = join_once(run, log_dir, k, flood)
            if j is not None:
                into.append(j)
    mi = statistics.median(idle) if idle else None
    mf = statistics.median(flooded) if flooded else None
    r = "n/a" if mi is None or mf is None or mi <= 0 else f"{mf / mi:.2f}"
    return (f"join idle {_f(mi, '.3f')} (median of {len(idle)}) flood {_f(mf, '.3f')} ratio {r}\n"
            f"    join_s idle {idle} flood {flooded} (target: flood <= 1.5 x idle)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=10.0, help="seconds of baseline, attack and after each")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, from --list")
    ap.add_argument("--big-mb", type=int, default=400, help="MB of each of the six oversize messages")
    ap.add_argument("--joins", type=int, default=5,
                    help="joins timed idle and as many during a flood (with the flood attack; 0: none)")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between status looks")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary directory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="SECTION.KEY=VALUE passed to zclaw train")
    ap.add_argument("--list", action="store_true", help="list the attacks and exit")
    a = ap.parse_args()
    if a.list:
        for name, fn in ATTACKS.items():
            print(f"{name:15s} {' '.join((fn.__doc__ or '').split())}")
        return 0
    names = [n for n in a.attacks.split(",") if n]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attack(s) {unknown}; --list shows them")
    joins = a.joins if "flood" in names else 0
    seconds = a.start_timeout + len(names) * (3 * a.window + 60) + joins * 2 * 150 + 120
    extra = [x for o in a.overrides for x in ("--set", o)]
    with tempfile.TemporaryDirectory(prefix="zclaw-hostile-") as tmp:
        run_dir = Path(a.run_dir) if a.run_dir else Path(tmp) / "run"
        run = LiveRun(run_dir, seconds, a.poll, extra)
        failure: Optional[str] = None
        try:
            t_start = time.monotonic()
            run.start(a.start_timeout)
            print(f"run up in {time.monotonic() - t_start:.0f} s: {run.run_dir}, real worker "
                  f"{run.worker_id}, spec {run.spec.hash if run.spec else '?'}, pids {run.pids}; "
                  f"window {a.window:g} s",
                  flush=True)
            for name in names:
                line, _ = measure(run, name, a.window, a.big_mb)
                print(line, flush=True)
                failure = run.failure()
                if failure:
                    break
            if joins and not failure:
                print(measure_joins(run, Path(tmp), joins), flush=True)
                failure = run.failure()
        except RuntimeError as exc:
            failure = str(exc)
        finally:
            code = run.close(float(run.cfg["run"]["stop_grace_s"]) + 15)
        print(f"run: {'FAILED: ' + failure if failure else 'every role stayed up'}; zclaw train exit {code}")
        if failure:
            print(run.tail(), file=sys.stderr)
        return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
