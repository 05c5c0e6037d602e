"""The roles as real processes: how every test starts, asks, stops and inspects them.

Every launcher runs ``python -m zclaw.cli ...`` (:data:`ZCLAW`) through :func:`spawn`, on ports from
:func:`free_port`, with its output in a file (or pipe) the test reads back (:mod:`support.logs`), and
each one's ``close``/``kill`` stops what it started even when the test fails (the fixtures in
tests/conftest.py call it):

* :class:`Roles`: broker, learner and workers by their own commands on shared ports, and status clients;
* :class:`BrokerProc`: one ``zclaw broker``, the test playing its learner (REQ) and workers (PUSH);
* :class:`WorkerProcess`: one ``zclaw worker``, its JSON lines collected from stderr as they come;
* :class:`Train`: one ``zclaw train`` (the launcher), its roles found by their command lines
  (:func:`role_pids`).

Process inspection on Linux: :func:`children` (a role's child processes), :func:`rss_mib` (resident
memory), :func:`sigterm` (a clean stop that must come within a bound).

:func:`free_port` is ``zclaw.launch.free_port``: tests pick ports the way ``zclaw train`` does (a free
loopback port now, with the same small race), so there is one copy of it in the project.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import zmq

from zclaw import config as config_mod
from zclaw.launch import StatusClient, free_port, stop_processes
from zclaw.wire import tcp
from zclaw.wire.messages import make, parse
from zclaw.wire.protocol import Message

from .logs import Event, parse_lines
from .waiting import Output, shown, wait_until

__all__ = [
    "ZCLAW", "FAST", "STATUS_MS", "free_port", "spawn", "sigterm", "children", "rss_mib", "Roles",
    "BrokerProc", "WorkerProcess", "Train", "role_pids",
]

#: the command line as ``zclaw train`` starts its roles: this interpreter, so roles run the code under test
ZCLAW = [sys.executable, "-m", "zclaw.cli"]
#: a short run's settings: small segments and batches, a status line every second, checkpoints every 5 s
FAST = [
    "--set", "worker.envs=4", "--set", "worker.segment_length=32", "--set", "learner.batch_segments=2",
    "--set", "learner.epochs=2", "--set", "learner.minibatches=2", "--set", "log.status_s=1",
    "--set", "learner.checkpoint_s=5",
]
#: status clients' reply timeout (ms): generous, a loaded machine can starve a role for a second or more
STATUS_MS = 10000


def spawn(
    args: List[str], stdout: Any, stderr: Any = subprocess.STDOUT, env: Optional[Dict[str, str]] = None,
    **popen: Any,
) -> subprocess.Popen:
    """``zclaw ARGS`` as a child process; output into ``stdout`` (a file, or ``subprocess.PIPE``), stderr
    with it unless told otherwise; ``env``: variables added to this process's environment."""
    return subprocess.Popen(ZCLAW + list(args), stdout=stdout, stderr=stderr,
                            env=None if env is None else {**os.environ, **env}, **popen)


def sigterm(proc: subprocess.Popen, within: float, what: str = "the process", output: Output = None) -> int:
    """SIGTERM ``proc``; it must exit within ``within`` s (else it is killed and the test fails, showing
    ``output``); return its exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not exit within {within} s of SIGTERM{shown(output)}") from None


def children(pid: int) -> List[int]:
    """The pids of ``pid``'s live child processes."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Roles:
    """Start roles by their CLI with shared free ports; ask them for status; stop them all at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {k: free_port() for k in ("ingest_port", "serve_port", "publish_port", "learner_port")}
        self.procs: List[subprocess.Popen] = []
        self.ctx = zmq.Context()
        self.broker = StatusClient(self.ctx, tcp("127.0.0.1", self.ports["serve_port"]), STATUS_MS)
        self.learner = StatusClient(self.ctx, tcp("127.0.0.1", self.ports["learner_port"]), STATUS_MS)

    def args(self) -> List[str]:
        out = list(FAST)
        for k, v in self.ports.items():
            out += ["--set", f"network.{k}={v}"]
        return out

    def start(
        self, role: str, *extra: str, name: Optional[str] = None, env: Optional[Dict[str, str]] = None
    ) -> subprocess.Popen:
        """Its output goes to ``TMP/<name or role>.log``; ``env``: variables added to this process's
        environment (e.g. PYTHONPATH for a fake backend)."""
        log = open(self.tmp / f"{name or role}.log", "wb")
        p = spawn([role] + self.args() + list(extra), stdout=log, env=env)
        self.procs.append(p)
        return p

    def wait(self, client: StatusClient, pred: Any, timeout: float = 60) -> Dict[str, Any]:
        reached, rep = client.wait_until(pred, timeout)
        if not reached:
            raise AssertionError(f"condition not reached in {timeout}s; last report {rep}")
        return rep

    def close(self) -> None:
        stop_processes(self.procs, 15)
        self.broker.close()
        self.learner.close()
        self.ctx.destroy(linger=0)  # also closes a socket a failed test left open (term() would wait on it)


class BrokerProc:
    """``zclaw broker`` in a subprocess (JSON logs in a temporary file), with the test as its learner (REQ);
    up once it answers ``status``."""

    def __init__(self, *overrides: str, ports: Optional[tuple] = None, extra_args: tuple = ()) -> None:
        self.ingest_port, self.serve_port = ports or (free_port(), free_port())
        args = ["broker", *extra_args,
                "--set", f"network.ingest_port={self.ingest_port}",
                "--set", f"network.serve_port={self.serve_port}",
                "--set", 'log.format="json"', "--set", "log.status_s=1"]
        for o in overrides:
            args += ["--set", o]
        self.log = tempfile.TemporaryFile()
        self.proc = spawn(args, stdout=self.log)
        self.ctx = zmq.Context()
        try:  # a broker that fails to come up is killed here: no fixture holds it yet
            wait_until(lambda: self.request(make("status"), timeout_s=0.5, check=False) is not None, 60,
                       "the broker to answer status", interval=0, proc=self.proc, output=self.output)
        except BaseException:
            self.kill()
            raise

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-5000:]

    def request(self, frames: List[Any], timeout_s: float = 5.0, check: bool = True) -> Optional[Message]:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.serve_port}")
        try:
            sock.send_multipart(frames, copy=False)
            if not sock.poll(int(timeout_s * 1000)):
                assert not check, f"no reply from broker:\n{self.output()}"
                return None
            return parse(sock.recv_multipart())
        finally:
            sock.close()

    def status(self) -> Dict[str, Any]:
        reply = self.request(make("status"))
        assert reply.kind == "status" and reply["role"] == "broker"
        return reply["report"]

    def sample(
        self, n: int, version: int = 0, keys: Optional[list] = None, prios: Optional[list] = None,
        columns: int = 0,
    ) -> Message:
        return self.request(make("sample", batch_size=n, version=version, priority_keys=keys or [],
                                 priorities=prios or [], columns=columns))

    def wait_for(
        self, pred: Callable[[Dict[str, Any]], bool], what: str, timeout_s: float = 10.0
    ) -> Dict[str, Any]:
        """The first status report for which ``pred`` holds (asked every 20 ms)."""
        last: List[Dict[str, Any]] = [{}]

        def reached() -> Optional[Dict[str, Any]]:
            last[0] = self.status()
            return last[0] if pred(last[0]) else None

        return wait_until(reached, timeout_s, what, interval=0.02, output=lambda: f"last report: {last[0]}")

    def stop(self, within: float = 15.0) -> None:
        """SIGTERM must make it exit 0 within ``within`` s (a final snapshot, if configured, included;
        slow on a loaded machine)."""
        rc = sigterm(self.proc, within, "broker", self.output)
        self.ctx.destroy(linger=0)
        assert rc == 0, f"broker exit code {rc}:\n{self.output()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.ctx.destroy(linger=0)


class WorkerProcess:
    """``zclaw worker`` on the given ports, with its JSON log lines collected from stderr by a thread.

    ``env``, ``envs``, ``segment_length``: ``--env``, ``--envs`` and ``worker.segment_length``; ``extra``:
    more arguments. The serve port is the learner's: the tests' stand-in learner also answers the broker
    handshake (``support.peers.StandInLearner``)."""

    def __init__(self, ingest: int, publish: int, learner: int, *extra: str, env: str, envs: int,
                 segment_length: int) -> None:
        args = [
            "worker", "--env", env, "--envs", str(envs),
            "--set", f"worker.segment_length={segment_length}", "--set", f"network.ingest_port={ingest}",
            "--set", f"network.publish_port={publish}", "--set", f"network.learner_port={learner}",
            "--set", f"network.serve_port={learner}",
            "--set", "log.format=json", *extra,
        ]
        self.proc = spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: List[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def events(self, name: str) -> List[Event]:
        return [e for e in parse_lines("".join(list(self.lines))) if e.get("event") == name]

    def wait_event(self, name: str, timeout: float) -> Event:
        found = wait_until(lambda: self.events(name), timeout, f"a {name!r} log line", proc=self.proc,
                           output=lambda: "".join(self.lines[-30:]))
        return found[0]

    def terminate(self, within: float = 10.0) -> int:
        """SIGTERM; the worker must exit within ``within`` s (its flush is bounded by 1 s; the rest is
        interpreter and env teardown, slow on a loaded machine); returns its exit code."""
        rc = sigterm(self.proc, within, "worker")
        self._reader.join(2)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def role_pids(train_pid: int) -> Dict[str, int]:
    """role name (broker, learner, worker0, ...; broker0, broker1, ... with several shards) -> pid of
    ``train``'s live children."""
    roles: Dict[str, int] = {}
    for pid in children(train_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv]
        for role in ("broker", "learner", "worker"):
            if role in args:
                name = role + (args[args.index("--index") + 1] if role == "worker" else
                               args[args.index("--shard") + 1] if role == "broker" and "--shard" in args
                               else "")
                roles[name] = pid
    return roles


class Train:
    """One ``zclaw train`` process in ``run_dir`` (with :data:`FAST`); status clients once its config.toml
    names the ports."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.out = open(run_dir.parent / "train.out", "wb")
        self.proc = spawn(["train", "--run-dir", str(run_dir)] + FAST + list(args), stdout=self.out)
        self.ctx = zmq.Context()
        self.clients: Dict[str, StatusClient] = {}

    def client(self, role: str) -> StatusClient:
        if role not in self.clients:
            wait_until((self.run_dir / "config.toml").exists, 60, "train to write config.toml", interval=0.2)
            net = config_mod.load(str(self.run_dir / "config.toml"), [])["network"]
            port = net["serve_port"] if role == "broker" else net["learner_port"]
            self.clients[role] = StatusClient(self.ctx, tcp("127.0.0.1", port), STATUS_MS)
        return self.clients[role]

    def wait(self, role: str, pred: Callable[[Dict[str, Any]], bool], timeout: float = 90) -> dict:
        reached, rep = self.client(role).wait_until(pred, timeout)
        assert reached, f"{role}: condition not reached in {timeout} s; last report {rep}\n{self.output()}"
        return rep  # type: ignore[return-value]

    def output(self) -> str:
        return (self.run_dir.parent / "train.out").read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            for pid in role_pids(self.proc.pid).values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()
        for c in self.clients.values():
            c.close()
        self.ctx.destroy(linger=0)
        self.out.close()
