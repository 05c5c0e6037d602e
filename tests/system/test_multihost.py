"""Multi-host over real TCP: bin/netns-cluster puts two broker shards, two learner ranks (each on its own
host, meeting over the bridge) and three workers of 2, 4 and 8 envs in their own network namespaces on a
bridged 10.77.0.0/24 (no default route), CURVE on, and trains until every worker's segments reached its
shard, no shard dropped a segment as bad_shape, rank 0 published a version > 0 and both ranks made updates;
then every role stops on SIGTERM with exit code 0."""
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
BROKERS = ["10.77.0.11", "10.77.0.12"]
LEARNERS = ["10.77.0.21", "10.77.0.22"]


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
@pytest.mark.timeout(240)
def test_netns_cluster_two_shards_two_ranks_unlike_workers_with_curve(tmp_path: Path) -> None:
    why = _netns_allowed()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(SCRIPT), "--time", "90", "--envs", "2,4,8", "--out", str(tmp_path),
                             "--python", sys.executable],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:  # SIGTERM first: the script's exit trap removes its namespaces
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"netns-cluster did not finish within 200 s:\n{stdout}\n{stderr}")
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if out.returncode == 3:
        pytest.skip(out.stderr.strip())
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("NETNS_CLUSTER_RESULT ")]
    assert lines, out.stdout + out.stderr
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert out.returncode == 0 and result["ok"], (result, out.stderr)
    assert all(result["checks"].values()), result["checks"]

    # every worker's segments reached its shard (worker i -> shard i mod 2), and only that one
    assert result["worker_envs"] == {"w0": 2, "w1": 4, "w2": 8}
    assert result["worker_shards"] == {"w0": [0], "w1": [1], "w2": [0]}
    assert all(result["worker_segments"][w] > 0 for w in ("w0", "w1", "w2")), result["worker_segments"]
    shards = result["shards"]
    assert [s["endpoint"] for s in shards] == [f"{h}:5555:5556" for h in BROKERS]
    assert [s["workers"] for s in shards] == [["w0", "w2"], ["w1"]]
    # unlike workers in one shard: nothing dropped for its shape, nobody refused
    assert [s["bad_shape"] for s in shards] == [0, 0]
    assert all(not s["refused"] for s in shards), shards

    # rank 0 published, both ranks trained, in step: they stopped at the same version
    assert result["learner_version"] > 0
    assert result["learner_updates"]["rank0"] > 0 and result["learner_updates"]["rank1"] > 0
    assert result["ranks"]["size"] == 2 and result["ranks"]["backend"] == "gloo"
    assert result["ranks"]["collectives"]["gradients"] > 0
    stopped = result["learner_stopped"]
    assert stopped["rank0"]["version"] == stopped["rank1"]["version"] > 0, stopped
    assert result["rendezvous"] == f"{LEARNERS[0]}:29500"

    # no role failed: every one was up to the end and exited 0 on SIGTERM
    assert result["roles_failed"] == [] and result["exited_early"] == []
    assert set(result["exit_codes"]) == {"broker0", "broker1", "learner0", "learner1", "worker0", "worker1",
                                         "worker2"}
    assert set(result["exit_codes"].values()) == {0}, result["exit_codes"]
    assert result["curve"] is True and result["default_routes"] == 0

    # the roles really were on separate addresses, with CURVE on their sockets
    logs = tmp_path / "logs"
    for i, host in enumerate(BROKERS):
        listening = [e for e in log_lines(logs / f"broker{i}.log") if e.get("event") == "broker listening"]
        assert listening and listening[0]["host"] == host and listening[0]["curve"] is True, listening
    for r in (0, 1):
        up = [e for e in log_lines(logs / f"learner{r}.log") if e.get("event") == "learner up"]
        assert up and up[0]["curve"] is True, up
        assert up[0]["brokers"] == [f"tcp://{h}:5556" for h in BROKERS]
        assert up[0]["ranks"]["rank"] == r and up[0]["ranks"]["size"] == 2
        assert (up[0]["publish"] is not None) == (r == 0), "rank 0 alone binds the learner's ports"

    # everything was torn down: no namespace of the run and no process left
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not [n for n in names if n.startswith(result["namespace_prefix"] + "-")], names
    assert str(tmp_path) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
