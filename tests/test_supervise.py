"""``zclaw train`` as a supervisor: it restarts crashed roles (broker on its snapshot, learner with --resume),
stops within run.stop_grace_s whatever its children do, and --time means what it says.

Each test drives a real ``zclaw train`` process (real roles, Reacher) and finds its role processes by
their command lines.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import zmq
from test_e2e import FAST, ZCLAW, log_lines

from zclaw import config as config_mod
from zclaw.launch import StatusClient
from zclaw.wire import tcp

GRACE_S = 5.0
#: how long past the grace period a loaded 2-core machine may need to reap and write the summary
MARGIN_S = 15.0


def role_pids(train_pid: int) -> Dict[str, int]:
    """role name (broker, learner, worker0, ...) -> pid of ``train``'s live children."""
    ps = ["ps", "-o", "pid=", "--ppid", str(train_pid)]
    out = subprocess.run(ps, capture_output=True, text=True).stdout
    roles: Dict[str, int] = {}
    for pid in (int(x) for x in out.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in argv]
        for role in ("broker", "learner", "worker"):
            if role in args:
                name = role + (args[args.index("--index") + 1] if role == "worker" else "")
                roles[name] = pid
    return roles


class Train:
    """One ``zclaw train`` process in ``run_dir``; status clients once its config.toml names the ports."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.out = open(run_dir.parent / "train.out", "wb")
        self.proc = subprocess.Popen(ZCLAW + ["train", "--run-dir", str(run_dir)] + FAST + list(args),
                                     stdout=self.out, stderr=subprocess.STDOUT)
        self.ctx = zmq.Context()
        self.clients: Dict[str, StatusClient] = {}

    def client(self, role: str) -> StatusClient:
        if role not in self.clients:
            deadline = time.monotonic() + 60
            while not (self.run_dir / "config.toml").exists():
                assert time.monotonic() < deadline, "train wrote no config.toml"
                time.sleep(0.2)
            net = config_mod.load(str(self.run_dir / "config.toml"), [])["network"]
            port = net["serve_port"] if role == "broker" else net["learner_port"]
            self.clients[role] = StatusClient(self.ctx, tcp("127.0.0.1", port), 10000)
        return self.clients[role]

    def wait(self, role: str, pred, timeout: float = 90) -> dict:
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


@pytest.fixture
def start_train(tmp_path: Path) -> Iterator:
    runs: List[Train] = []

    def start(*args: str) -> Train:
        t = Train(tmp_path / "run", *args)
        runs.append(t)
        return t

    yield start
    for t in runs:
        t.close()


def nothing_left(run_dir: Path) -> bool:
    ps = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
    return not [ln for ln in ps.splitlines() if str(run_dir) in ln and not ln.startswith("Z")]


def test_sigterm_stops_train_within_its_grace_while_a_role_is_wedged(start_train, tmp_path: Path) -> None:
    t = start_train("--time", "600", "--set", f"run.stop_grace_s={GRACE_S}")
    t.wait("learner", lambda r: (r.get("version") or 0) >= 1)
    roles = role_pids(t.proc.pid)
    assert {"broker", "learner", "worker0"} <= set(roles), roles
    os.kill(roles["learner"], signal.SIGSTOP)  # wedged: ignores SIGTERM until killed
    os.kill(roles["worker0"], signal.SIGSTOP)
    t0 = time.monotonic()
    t.proc.send_signal(signal.SIGTERM)
    try:
        code = t.proc.wait(GRACE_S + MARGIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"train still runs {GRACE_S + MARGIN_S} s after SIGTERM\n{t.output()}")
    took = time.monotonic() - t0
    print(f"\ntrain stopped {took:.1f} s after SIGTERM with two SIGSTOPped roles (grace {GRACE_S} s)")
    assert code == 0, t.output()
    for pid in roles.values():
        assert not Path(f"/proc/{pid}").exists(), f"role process {pid} left behind"
    assert nothing_left(t.run_dir)
    summary = json.loads((t.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["stop_detail"] == "SIGTERM", summary
    assert "stopped because" in t.output()


def test_time_alone_runs_to_its_time_whatever_run_steps_says(start_train, tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[run]\nsteps = 10\n")
    t = start_train("--config", str(cfg), "--time", "12")
    try:
        code = t.proc.wait(120)
    except subprocess.TimeoutExpired:
        raise AssertionError(t.output())
    assert code == 0, t.output()
    summary = json.loads((t.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "time", summary
    assert summary["wall_s"] >= 12 and summary["env_steps"] > 10, summary
    assert "stopped because" in t.output() and "time" in t.output()


def test_train_restarts_a_killed_learner_and_broker_and_the_run_ends_well(start_train) -> None:
    t = start_train("--time", "40", "--set", "broker.snapshot_s=1", "--set", "learner.checkpoint_s=1",
                    "--set", "learner.tensorboard=false")
    t.wait("learner", lambda r: (r.get("version") or 0) >= 3 and r.get("last_checkpoint"))
    roles = role_pids(t.proc.pid)

    os.kill(roles["learner"], signal.SIGKILL)
    new: Optional[int] = None
    deadline = time.monotonic() + 60
    while new is None and time.monotonic() < deadline:
        new = role_pids(t.proc.pid).get("learner")
        new = None if new == roles["learner"] else new
        time.sleep(0.2)
    assert new is not None, "the learner was not restarted\n" + t.output()
    logs = t.run_dir / "logs"
    deadline = time.monotonic() + 60
    resumed: List[dict] = []
    while not resumed and time.monotonic() < deadline:
        resumed = [e for e in log_lines(logs / "learner.log") if e.get("event") == "resumed"]
        time.sleep(0.2)
    assert resumed and resumed[0]["version"] >= 3, "restarted with --resume from its checkpoint"
    t.wait("learner", lambda r: (r.get("version") or 0) >= resumed[0]["version"] + 2)  # version continues

    b = t.wait("broker", lambda r: ((r.get("snapshot") or {}).get("written") or 0) >= 1)
    os.kill(role_pids(t.proc.pid)["broker"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    restored: List[dict] = []
    while not restored and time.monotonic() < deadline:
        restored = [e for e in log_lines(logs / "broker.log") if e.get("event") == "restored snapshot"]
        time.sleep(0.2)
    assert restored, "the broker was not restarted on its snapshot\n" + t.output()
    t.wait("broker", lambda r: r["inserted_segments"] >= restored[-1]["inserted"] + 2)
    v = t.client("learner").report()["version"]
    t.wait("learner", lambda r: r["version"] >= v + 1)

    code = t.proc.wait(120)
    assert code == 0, t.output()
    summary = json.loads((t.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "time" and summary["restarts"]["learner"] == 1, summary
    assert summary["restarts"]["broker"] == 1 and summary["version"] > resumed[0]["version"], summary
    assert b["inserted_segments"] > 0
    assert nothing_left(t.run_dir)
