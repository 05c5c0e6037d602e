"""Fault suite: a short real Reacher run; each role is SIGKILLed and restarted, then each is SIGTERMed.

What may be lost is stated in docs/operations.md ("Faults"); these tests count segments made by the
workers (their logs), stored, sampled and dropped by the broker (its status and snapshot) and compare.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
from support.logs import events, log_lines, wait_event
from support.procs import Roles, children, sigterm

from zclaw.broker import snapshot
from zclaw.learner import checkpoint as ckpt

pytestmark = pytest.mark.fault

T, ENVS, SEND_QUEUE, SNAPSHOT_S = 16, 2, 4, 1.0
PUSH_HWM = 2  # zclaw.worker.worker.PUSH_HWM: messages ZeroMQ may hold inside a worker
STORE_CAUSES = {"evicted_unused", "stale"}


def opts(run: Path) -> List[str]:
    out: List[str] = []
    for kv in (f"worker.envs={ENVS}", f"worker.segment_length={T}", f"worker.send_queue={SEND_QUEUE}",
               f"broker.snapshot_s={SNAPSHOT_S}", "learner.checkpoint_s=2", "broker.capacity=32",
               "learner.tensorboard=false", f'run.run_dir="{run}"'):  # so every role's argv names the run
        out += ["--set", kv]
    return out


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def store_balanced(rep: Dict[str, Any]) -> bool:
    """Queue mode, max_reuse 1: every segment inserted was sampled once, is still stored, or was dropped."""
    store_drops = sum(v for k, v in rep["drops"].items() if k in STORE_CAUSES)
    return rep["inserted_segments"] == rep["sampled_segments"] + rep["fill"] + store_drops


def test_sigkill_worker_learner_and_broker_then_restart_and_the_run_goes_on(roles: Roles, tmp_path: Path) -> None:  # noqa: E501
    run = tmp_path / "run"
    o = opts(run)
    broker = roles.start("broker", "--run-dir", str(run), *o)
    learner = roles.start("learner", "--run-dir", str(run), *o)
    w0 = roles.start("worker", "--index", "0", *o, name="worker0")
    roles.start("worker", "--index", "1", *o, name="worker1")
    roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 3, timeout=120)

    # -- a worker is SIGKILLed: the run goes on; a restarted one acts on the current weights -------------
    rep = roles.wait(roles.broker, lambda r: sum(1 for k in r["workers"] if k.startswith("w0-")) == 1)
    id0 = next(k for k in rep["workers"] if k.startswith("w0-"))
    kill(w0)
    v = roles.learner.report()["version"]
    roles.wait(roles.learner, lambda r: r["version"] >= v + 2, timeout=60)  # worker1 alone keeps it going
    rep = roles.broker.report()
    status0 = events(tmp_path / "worker0.log", "status")
    if status0:  # lost at most what sat in its send queue and inside ZeroMQ (PUSH_HWM)
        assert rep["workers"][id0]["segments"] >= status0[-1]["sent"] - PUSH_HWM
    assert set(rep["drops"]) <= STORE_CAUSES, "a killed sender leaves no half message behind"
    joined_at = roles.learner.report()["version"]
    roles.start("worker", "--index", "0", *o, name="worker0b")
    acting = wait_event(tmp_path / "worker0b.log", "acting", 90)
    assert acting["version"] >= joined_at, "a restarted worker acts on the current weights"

    # -- the learner is SIGKILLed: workers go on with the last weights, the broker keeps storing, bounded ---
    # a checkpoint must exist to resume from: a fast machine reaches this point before the first one (2 s)
    before = roles.wait(roles.learner, lambda r: bool(r.get("last_checkpoint")), timeout=30)
    kill(learner)
    on_disk = ckpt.load(run / "checkpoints")["version"]  # the last checkpoint written before the kill
    stored = roles.broker.report()["inserted_segments"]
    rep = roles.wait(roles.broker, lambda r: r["inserted_segments"] >= stored + 6, timeout=60)
    assert rep["fill"] <= rep["capacity"]
    learner2 = roles.start("learner", "--run-dir", str(run), "--resume", *o, name="learner2")
    resumed = wait_event(tmp_path / "learner2.log", "resumed", 90)
    assert resumed["version"] == on_disk, "resumed from the last checkpoint on disk"
    # lost: the updates since the last checkpoint (learner.checkpoint_s = 2 s, plus the report's age; a
    # checkpoint written after the report makes this negative)
    assert before["version"] - resumed["version"] <= math.ceil(3.5 * (before["updates_per_s"] or 0)) + 3
    roles.wait(roles.learner, lambda r: (r["version"] or 0) >= resumed["version"] + 3, timeout=90)
    # worker1 acted on version >= `resumed` before; it takes the new learner's (lower) versions anyway
    switched = wait_event(tmp_path / "worker1.log", "new learner process; acting on its weights", 30)
    assert switched["version"] >= resumed["version"]

    # -- the broker is SIGKILLed: workers hold a bounded queue, the learner retries; restore the snapshot ---
    rep = roles.wait(roles.broker, lambda r: (r["snapshot"] or {}).get("written", 0) >= 2, timeout=30)
    seg_rate = rep["insert_rate"] / (T * ENVS)
    kill(broker)
    at_kill = rep["inserted_segments"]
    time.sleep(3.0)
    broker2 = roles.start("broker", "--run-dir", str(run), *o, name="broker2")
    restored = wait_event(tmp_path / "broker2.log", "restored snapshot", 60)
    lost = at_kill - restored["inserted"]
    # loss bound (docs/operations.md): the ingest of one snapshot interval plus one write. The rate is a
    # 10 s average (x2 for bursts on a loaded machine); the report is up to ~0.5 s older than the kill, and
    # a snapshot taken after it can hold a little more than the report (lost < 0)
    write_s = rep["snapshot"].get("last_seconds") or 0.0
    slack = math.ceil(seg_rate * 0.5) + 2
    bound = math.ceil(2 * seg_rate * (SNAPSHOT_S + write_s + 1.5)) + 4
    assert -slack <= lost <= bound, (lost, seg_rate, write_s)
    print(f"\nbroker SIGKILL: {lost} segments lost of {at_kill} ({seg_rate:.0f} segments/s, snapshot every "
          f"{SNAPSHOT_S} s); learner SIGKILL: {before['version'] - resumed['version']} versions lost "
          f"({before['version']} -> resumed at {resumed['version']})")
    v = roles.learner.report()["version"]
    rep = roles.wait(roles.broker, lambda r: r["inserted_segments"] >= restored["inserted"] + 6, timeout=60)
    roles.wait(roles.learner, lambda r: r["version"] >= v + 2, timeout=60)
    for name in ("worker0b", "worker1"):  # the worker's queue never grew past its bound
        assert all(e["queued"] <= SEND_QUEUE for e in events(tmp_path / f"{name}.log", "status"))
        # segments flow again as soon as PUSH reconnects; the welcome comes with the next heartbeat (5 s)
        wait_event(tmp_path / f"{name}.log", "broker welcomed us", 15, where=lambda e: e["rejoined"] is True)
    assert [e for e in log_lines(tmp_path / "learner2.log") if "Lazy Pirate" in str(e.get("event"))]
    rep = roles.broker.report()
    assert set(rep["drops"]) <= STORE_CAUSES, rep["drops"]
    assert store_balanced(rep), rep
    assert broker2.poll() is None and learner2.poll() is None


def test_sigterm_each_role_exits_promptly_with_its_final_files_and_nothing_left(
    roles: Roles, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    o = opts(run)
    broker = roles.start("broker", "--run-dir", str(run), *o)
    learner = roles.start("learner", "--run-dir", str(run), *o)
    workers = [roles.start("worker", "--index", str(i), *o, name=f"worker{i}") for i in range(2)]
    roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 3, timeout=120)
    kids = {p.pid: children(p.pid) for p in [broker, learner] + workers}

    def term(p: subprocess.Popen, within: float) -> float:
        """SIGTERM; the process must exit 0 within ``within`` s; return the wall time of the signal."""
        t0 = time.time()
        assert sigterm(p, within) == 0
        return t0

    sent = 0
    for i, w in enumerate(workers):
        term(w, 10)
        stopped = wait_event(tmp_path / f"worker{i}.log", "worker stopped", 5)
        sent += stopped["sent"]
        assert not events(tmp_path / f"worker{i}.log", "segments left unsent at exit")
    # a clean stop loses nothing: every segment the workers sent is in the broker's counts
    rep = roles.wait(roles.broker, lambda r: r["inserted_segments"] == sent, timeout=20)
    assert store_balanced(rep) and set(rep["drops"]) <= STORE_CAUSES, rep
    print(f"\nclean stop: {sent} segments sent = inserted; sampled {rep['sampled_segments']}, "
          f"stored {rep['fill']}, "
          f"dropped {rep['drops']}")

    t_learner = term(learner, 30)
    assert (run / "checkpoints" / "latest.pt").stat().st_mtime >= t_learner - 1
    final = json.loads((run / "learner_final.json").read_text())
    assert wait_event(tmp_path / "learner.log", "final checkpoint", 5)["version"] == final["version"]

    rep = roles.broker.report()
    t_broker = term(broker, 10)
    outcome = wait_event(tmp_path / "broker.log", "final snapshot", 5)["outcome"]
    assert outcome in ("written", "current")  # "current": the last periodic one already holds this state
    path = snapshot.snapshot_path(run)
    if outcome == "written":
        assert path.stat().st_mtime >= t_broker - 1
    arrays, meta = snapshot.load(path)
    assert meta["store"]["inserted"] == sent and len(arrays["slot"]) == rep["fill"]
    assert meta["store"]["sampled"] == rep["sampled_segments"]

    for pid, before in kids.items():  # every child any role had is gone, and nothing names the run any more
        for c in before:
            assert not Path(f"/proc/{c}").exists() or "zombie" in Path(f"/proc/{c}/status").read_text(), c
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(run) not in ps, ps
