"""End to end: the three roles as real processes on loopback TCP, stepping real MuJoCo,
training a real network."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import zmq

from zclaw.launch import StatusClient, free_port, stop_processes
from zclaw.wire import tcp

ZCLAW = [sys.executable, "-m", "zclaw.cli"]
FAST = [
    "--set", "worker.envs=4", "--set", "worker.segment_length=32", "--set", "learner.batch_segments=2",
    "--set", "learner.epochs=2", "--set", "learner.minibatches=2", "--set", "log.status_s=1",
    "--set", "learner.checkpoint_s=5",
]
STATUS_MS = 10000


class Roles:
    """Start roles by their CLI with shared free ports; ask them for status; stop them all at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {k: free_port() for k in ("ingest_port", "serve_port", "publish_port", "learner_port")}
        self.procs: List[subprocess.Popen] = []
        self.ctx = zmq.Context()
        # a generous reply timeout: a loaded machine can starve a role for a second or more
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
        """``env``: variables added to this process's environment (e.g. PYTHONPATH for a fake backend)."""
        log = open(self.tmp / f"{name or role}.log", "wb")
        p = subprocess.Popen(
            ZCLAW + [role] + self.args() + list(extra), stdout=log, stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
        )
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


@pytest.fixture
def roles(tmp_path: Path):
    r = Roles(tmp_path)
    yield r
    r.close()


def log_lines(path: Path) -> List[Dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_roles_by_hand_train_together_and_a_late_worker_acts_on_current_weights(
    roles: Roles, tmp_path: Path
) -> None:
    roles.start("broker")
    roles.start("learner", "--run-dir", str(tmp_path / "run"))
    roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", name="worker0")
    rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 5, timeout=90)
    assert rep["spec"]["env_id"] == "gym:Reacher-v5"

    # weights published as version v are used by workers: later segments carry versions >= v
    v = rep["version"]
    b = roles.wait(roles.broker, lambda r: any(w["version"] >= v for w in r["workers"].values()), timeout=30)
    assert b["inserted_steps"] > 0 and b["lag_hist"]

    # a worker joining now acts on the current version within one second of having its envs
    joined_at = roles.learner.report()["version"]
    roles.start("worker", "--env", "gym:Reacher-v5", "--index", "1", name="worker1")
    b = roles.wait(roles.broker, lambda r: len(r["workers"]) == 2, timeout=60)
    deadline = time.monotonic() + 30
    acting = []
    while time.monotonic() < deadline and not acting:
        acting = [e for e in log_lines(tmp_path / "worker1.log") if e.get("event") == "acting"]
        time.sleep(0.2)
    assert acting, "worker1 never acted"
    assert acting[0]["version"] >= joined_at, (
        "a joining worker must act on the current weights, not version 0"
    )
    # measured by the worker itself: from "worker starting" (envs built) through the broker's welcome
    # and the learner's snapshot to the first action
    assert acting[0]["join_s"] < 1.0, acting[0]

    # every line of every role's log carries role, host, pid and version
    for name in ("broker", "learner", "worker0", "worker1"):
        lines = log_lines(tmp_path / f"{name}.log")
        assert lines, name
        for e in lines:
            assert {"role", "host", "pid", "version", "timestamp", "level"} <= set(e), (name, e)


def test_train_leaves_a_run_dir_that_resume_continues(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = ZCLAW + ["train", "--run-dir", str(run_dir)] + FAST
    out = subprocess.run(base + ["--time", "25"], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "zclaw train summary" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] > 0 and summary["updates"] > 0 and summary["wall_s"] >= 25
    for key in ("return_mean_100", "success_rate_100", "lag_mean", "lag_max", "episodes"):
        assert key in summary
    assert summary["return_mean_100"] is not None
    assert (run_dir / "config.toml").exists() and (run_dir / "checkpoints" / "latest.pt").exists()
    for role in ("broker", "learner", "worker0"):
        assert (run_dir / "logs" / f"{role}.log").stat().st_size > 0
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    first_version = summary["version"]

    out = subprocess.run(base + ["--resume", "--time", "20"], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["version"] > first_version, "the version counter continues after --resume"
    assert resumed["env_steps_total"] == resumed["env_steps"] + summary["env_steps_total"]
    learner_log = log_lines(run_dir / "logs" / "learner.log")
    finals = [e["version"] for e in learner_log if e.get("event") == "final checkpoint"]
    resumed_at = [e["version"] for e in learner_log if e.get("event") == "resumed"]
    assert resumed_at and resumed_at[0] == finals[0], "resume starts from the final checkpoint's version"

    # no process of the run is left behind
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps
