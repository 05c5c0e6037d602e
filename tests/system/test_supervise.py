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
from typing import Iterator, List

import pytest
from support.logs import wait_event
from support.procs import Train, role_pids
from support.waiting import wait_until

GRACE_S = 5.0
#: how long past the grace period a loaded 2-core machine may need to reap and write the summary
MARGIN_S = 15.0


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
    wait_until(lambda: role_pids(t.proc.pid).get("learner") not in (None, roles["learner"]), 60,
               "the learner to be restarted", interval=0.2, output=t.output)
    logs = t.run_dir / "logs"
    resumed = wait_event(logs / "learner.log", "resumed", 60, interval=0.2)
    assert resumed["version"] >= 3, "restarted with --resume from its checkpoint"
    t.wait("learner", lambda r: (r.get("version") or 0) >= resumed["version"] + 2)  # version continues

    b = t.wait("broker", lambda r: ((r.get("snapshot") or {}).get("written") or 0) >= 1)
    os.kill(role_pids(t.proc.pid)["broker"], signal.SIGKILL)
    # the broker restarted on its snapshot
    restored = wait_event(logs / "broker.log", "restored snapshot", 60, interval=0.2)
    t.wait("broker", lambda r: r["inserted_segments"] >= restored["inserted"] + 2)
    v = t.client("learner").report()["version"]
    t.wait("learner", lambda r: r["version"] >= v + 1)

    code = t.proc.wait(120)
    assert code == 0, t.output()
    summary = json.loads((t.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "time" and summary["restarts"]["learner"] == 1, summary
    assert summary["restarts"]["broker"] == 1 and summary["version"] > resumed["version"], summary
    assert b["inserted_segments"] > 0
    assert nothing_left(t.run_dir)


def test_a_role_that_cannot_start_as_configured_is_not_restarted(start_train) -> None:
    """Exit 2 (here: a worker given a CUDA device this host lacks) is a configuration that the same start
    would fail again: the run ends at once, naming the role and why, with no restart spent."""
    t = start_train("--time", "120", "--set", "worker.gpu=99")
    try:
        code = t.proc.wait(90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"train still runs with a worker that cannot start\n{t.output()}")
    assert code == 1, t.output()
    assert "worker0 exited with code 2 (cannot start as configured)" in t.output()
    assert "no such CUDA device" in t.output()  # the worker's own reason, from its log's last lines
    assert "restarting" not in t.output()
    summary = json.loads((t.run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "role_failed" and not summary["restarts"].get("worker0"), summary
