"""Multi-host over real TCP: bin/netns-cluster puts broker, learner and two workers in their own network
namespaces on a bridged 10.77.0.0/24 (no default route), CURVE on, and trains until segments came from both
workers and the learner published a version > 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.logs import log_lines

SCRIPT = Path(__file__).resolve().parents[2] / "bin" / "netns-cluster"


def _netns_allowed() -> str:
    """'' if ``ip netns add`` works here, else why not."""
    name = f"zcprobe-{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns unavailable: {exc}"
    if out.returncode != 0:
        return f"ip netns add refused: {out.stderr.strip()} (needs root / CAP_SYS_ADMIN)"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return ""


@pytest.mark.slow
def test_netns_cluster_trains_across_namespaces_with_curve(tmp_path: Path) -> None:
    why = _netns_allowed()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(SCRIPT), "--time", "50", "--out", str(tmp_path), "--python", sys.executable],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # SIGTERM first: the script's exit trap removes its namespaces
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"netns-cluster did not finish within 240 s:\n{stdout}\n{stderr}")
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if out.returncode == 3:
        pytest.skip(out.stderr.strip())
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("NETNS_CLUSTER_RESULT ")]
    assert lines, out.stdout + out.stderr
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert out.returncode == 0 and result["ok"], out.stderr
    assert result["worker_segments"]["w0"] > 0 and result["worker_segments"]["w1"] > 0
    assert result["learner_version"] > 0
    assert result["curve"] is True and result["default_routes"] == 0

    # the roles really were on separate addresses, with CURVE on their sockets
    logs = tmp_path / "logs"
    events = [e for f in ("broker.log", "learner.log") for e in log_lines(logs / f)]
    listening = [e for e in events if e.get("event") == "broker listening"]
    assert listening and listening[0]["host"] == "10.77.0.1" and listening[0]["curve"] is True
    up = [e for e in events if e.get("event") == "learner up"]
    assert up and up[0]["brokers"] == ["tcp://10.77.0.1:5556"] and up[0]["curve"] is True

    # everything was torn down: no namespace of the run and no process left
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in names if n.startswith(result["namespace_prefix"] + "-")], names
    assert str(tmp_path) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
