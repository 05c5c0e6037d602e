"""`zclaw status` against real broker, learner and worker processes: its figures are the roles' own."""
from __future__ import annotations

import time
import json
import socket
import subprocess
from pathlib import Path

from support.procs import ZCLAW, Roles, free_port  # the launcher the end-to-end tests use (fixture: roles)


def status(roles: Roles, *extra: str) -> subprocess.CompletedProcess:
    p = roles.ports
    return subprocess.run(
        ZCLAW + ["status", "--broker", f"127.0.0.1:{p['serve_port']}",
                 "--learner", f"127.0.0.1:{p['learner_port']}", "--timeout", "10000", *extra],
        capture_output=True, text=True, timeout=60)


def test_status_json_shows_what_the_roles_report(roles: Roles, tmp_path: Path) -> None:
    roles.start("broker")
    roles.start("learner", "--run-dir", str(tmp_path / "run"), "--set", "policy.options=2")
    worker = roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", "--set", "policy.options=2",
                         name="worker0")
    roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 3 and r.get("options"), timeout=75)
    roles.wait(roles.broker, lambda r: any((w.get("version") or 0) >= 1 for w in r["workers"].values()),
               timeout=30)

    b0, l0 = roles.broker.report(), roles.learner.report()
    out = status(roles, "--json")
    b1, l1 = roles.broker.report(), roles.learner.report()
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["answered"] == ["broker", "learner"]

    # figures are the roles' reports, taken between the two direct asks
    B, L = snap["broker"], snap["learner"]
    assert b0["inserted_steps"] <= B["inserted_steps"] <= b1["inserted_steps"]
    assert l0["version"] <= L["version"] <= l1["version"]
    assert l0["updates"] <= L["updates"] <= l1["updates"]
    assert B["spec"]["env_id"] == "gym:Reacher-v5" and B["capacity"] == b0["capacity"]
    assert sum(B["lag_hist"].values()) > 0 and isinstance(B["drops"], dict)
    assert ({"loss/policy", "loss/value"} <= set(L["losses"])
            or {"policy_loss", "value_loss"} <= set(L["losses"]))
    assert len(L["options"]["usage"]) == 2

    # the workers table: the real worker process, with its weights version and how far it lags the learner
    (w,) = snap["workers"]
    assert w["pid"] == worker.pid and w["host"] == socket.gethostname()
    assert w["id"] in B["workers"] and w["steps"] == B["workers"][w["id"]]["steps"]
    assert w["steps_per_s"] > 0 and w["last_seen_s"] >= 0 and w["version_age_s"] >= 0
    assert w["behind"] == L["version"] - w["version"] and w["behind"] >= 0

    # the text view shows the same parts
    text = status(roles, "--once")
    assert text.returncode == 0, text.stderr
    for part in ("LEARNER  version", "BROKER   fill", "lag (versions)", "options", "WORKERS  1",
                 str(worker.pid), "usage"):
        assert part in text.stdout, (part, text.stdout)


def test_status_metrics_and_tensorboard_show_each_roles_resources(roles: Roles, tmp_path: Path) -> None:
    """CPU, RSS, threads and GPU of every role process: in the broker's and the learner's reports (the
    worker's through its hello heartbeat), in `zclaw status`, metrics.jsonl and TensorBoard."""
    import psutil

    run = tmp_path / "run"
    broker = roles.start("broker")
    learner = roles.start("learner", "--run-dir", str(run), "--set", "log.metrics_s=1")
    worker = roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", name="worker0")
    L = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 2
                   and (r.get("resources") or {}).get("cpu_percent", 0) > 0, timeout=75)
    # the hello at the handshake has a CPU window of ~0 s (0.0); the heartbeat 5 s later a real one
    B = roles.wait(roles.broker, lambda r: any((w.get("resources") or {}).get("cpu_percent", 0) > 0
                                               for w in r["workers"].values()), timeout=30)
    (W,) = B["workers"].values()
    for name, res, proc in (("broker", B["resources"], broker), ("learner", L["resources"], learner),
                            ("worker", W["resources"], worker)):
        assert set(res) == {"cpu_percent", "rss_mb", "threads", "gpu"}, (name, res)
        assert res["gpu"] == "no GPU" and res["cpu_percent"] >= 0, (name, res)
        # that role's own process (not the tester's, not another role's), sampled at most a few seconds ago
        ps = psutil.Process(proc.pid)
        rss_now = ps.memory_info().rss / 2 ** 20
        assert 0.5 * rss_now < res["rss_mb"] < 2 * rss_now, (name, res, rss_now)
        assert res["threads"] >= 1 and 0.5 * ps.num_threads() <= res["threads"] <= 2 * ps.num_threads(), (
            name, res, ps.num_threads())
    assert W["pid"] == worker.pid and W["resources"]["cpu_percent"] > 0 and L["resources"]["cpu_percent"] > 0

    out = status(roles, "--once")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    res_lines = [i for i, line in enumerate(lines) if line.strip().startswith("resources: cpu ")]
    learner_at = next(i for i, line in enumerate(lines) if line.startswith("LEARNER"))
    broker_at = next(i for i, line in enumerate(lines) if line.startswith("BROKER"))
    assert len(res_lines) == 2 and learner_at < res_lines[0] < broker_at < res_lines[1], out.stdout
    assert all("% of a core  rss " in lines[i] and "MiB  threads " in lines[i] and lines[i].endswith("no GPU")
               for i in res_lines), out.stdout
    header = next(line for line in lines if line.strip().startswith("id "))
    row = next(line for line in lines if str(worker.pid) in line)
    assert "cpu %" in header and "rss MiB" in header and "threads" in header and row.endswith("no GPU"), (
        header, row)
    snap = json.loads(status(roles, "--json").stdout)
    assert snap["workers"][0]["resources"]["gpu"] == "no GPU"

    def metrics_line():
        for line in reversed((run / "metrics.jsonl").read_text().splitlines()):
            d = json.loads(line)
            if d.get("workers") and all(d["resources"].get(k) for k in ("learner", "broker")):
                return d
        return None

    deadline = time.monotonic() + 30
    while metrics_line() is None or not all(w.get("resources") for w in metrics_line()["workers"].values()):
        assert time.monotonic() < deadline, (run / "metrics.jsonl").read_text()[-2000:]
        time.sleep(0.5)
    m = metrics_line()
    assert m["resources"]["learner"]["rss_mb"] > 0 and m["resources"]["broker"]["threads"] >= 1
    assert [w["resources"]["gpu"] for w in m["workers"].values()] == ["no GPU"]

    learner.terminate()  # the writer flushes its events at exit
    assert learner.wait(60) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    wid = next(iter(m["workers"]))
    for tag in ("resources/learner/cpu_percent", "resources/learner/rss_mb", "resources/learner/threads",
                "resources/broker/cpu_percent", "resources/broker/rss_mb", f"resources/worker/{wid}/rss_mb"):
        assert tag in tags, (tag, sorted(tags))
    assert not any("gpu" in t for t in tags if t.startswith("resources/"))  # no GPU: no GPU series
    assert acc.Scalars("resources/learner/rss_mb")[-1].value > 0


def test_status_fails_clearly_when_nothing_answers() -> None:
    a, b = free_port(), free_port()
    out = subprocess.run(ZCLAW + ["status", "--once", "--timeout", "200", "--broker", f"127.0.0.1:{a}",
                                  "--learner", f"127.0.0.1:{b}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert ("nothing answers" in out.stderr and f"127.0.0.1:{a}" in out.stderr
            and f"127.0.0.1:{b}" in out.stderr)


def test_status_rejects_a_bad_endpoint() -> None:
    out = subprocess.run(ZCLAW + ["status", "--broker", "nohostport"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "--broker = 'nohostport' is not allowed: expected HOST:PORT" in out.stderr


def test_status_reads_a_run_directory_config(tmp_path: Path) -> None:
    out = subprocess.run(ZCLAW + ["status", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "no config.toml" in out.stderr


def test_loops_show_each_service_loops_last_answer_age() -> None:
    from zclaw.tools.status import build_snapshot, render

    now = time.time()
    learner = {"version": 3, "loops": {"learner-router": {"last_answer_unix": now - 2.0, "errors": 1},
                                       "learner-train": {"last_answer_unix": None}}}
    snap = build_snapshot(None, learner, {"broker": "tcp://127.0.0.1:1", "learner": "tcp://127.0.0.1:2"})
    text = render(snap)
    assert "loops: last answer learner-router 2." in text and "(1 errors)" in text
    assert "learner-train never" in text
