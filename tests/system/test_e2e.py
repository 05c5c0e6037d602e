"""End to end: the three roles as real processes on loopback TCP, stepping real MuJoCo,
training a real network."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from support.logs import log_lines, wait_event
from support.procs import FAST, ZCLAW, Roles


def test_roles_by_hand_train_together_and_a_late_worker_acts_on_current_weights(
    roles: Roles, tmp_path: Path
) -> None:
    roles.start("broker")
    # batches sized in env columns (learner.batch_columns): 12 or more, never past a segment over 12
    roles.start("learner", "--run-dir", str(tmp_path / "run"), "--set", "learner.batch_columns=12")
    roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", name="worker0")
    rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 5, timeout=90)
    assert rep["spec"]["env_id"] == "gym:Reacher-v5"

    # weights published as version v are used by workers: later segments carry versions >= v
    v = rep["version"]
    b = roles.wait(roles.broker, lambda r: any(w["version"] >= v for w in r["workers"].values()), timeout=30)
    assert b["inserted_steps"] > 0 and b["lag_hist"]

    # a worker of another shape joining now (2 envs where worker0 has 4, configured for 16-step segments
    # where the run has 32) acts on the current version within one second of having its envs, takes the
    # run's segment length from the welcome, and every segment it sends is stored and trained on
    joined_at = roles.learner.report()["version"]
    roles.start("worker", "--env", "gym:Reacher-v5", "--index", "1", "--envs", "2",
                "--set", "worker.segment_length=16", name="worker1")
    b = roles.wait(roles.broker, lambda r: len(r["workers"]) == 2, timeout=60)
    acting = wait_event(tmp_path / "worker1.log", "acting", 30, interval=0.2)  # worker1 acts
    assert acting["version"] >= joined_at, (
        "a joining worker must act on the current weights, not version 0"
    )
    assert acting["T"] == 32 and acting["envs"] == 2
    w1 = [k for k in b["workers"] if k.startswith("w1-")][0]
    b = roles.wait(roles.broker, lambda r: r["workers"][w1]["segments"] >= 3, timeout=60)
    mine = b["workers"][w1]
    assert mine["envs"] == 2 and mine["steps"] == mine["segments"] * 32 * 2
    assert not {"bad_shape", "oversize"} & set(b["drops"]), b["drops"]
    rep = roles.wait(roles.learner, lambda r: r["version"] >= joined_at + 3, timeout=60)  # trains on the mix
    # 4 + 4 + 4, 4 + 2 + 2 + 4, 2 x 6, ...: every batch 12 to 15 columns of 32 steps, whatever the mix
    assert 12 * 32 <= rep["steps_consumed"] / rep["updates"] <= 15 * 32, rep
    # measured by the worker itself: from "worker starting" (envs built) through the broker's welcome
    # and the learner's snapshot to the first action
    assert acting["join_s"] < 1.0, acting

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
