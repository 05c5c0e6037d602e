"""Several broker shards in one run (network.brokers, zclaw.fleet): where each worker pushes, what the
learner samples, what ``zclaw status`` shows, and that a dead shard costs only its own data."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import zmq
from support.procs import STATUS_MS, ZCLAW, Train, role_pids
from support.waiting import wait_until

from zclaw import config as config_mod
from zclaw.config import ConfigError
from zclaw.fleet import BrokerAddress, as_shard, broker_shards, merge_reports, parse_address, shard_of_worker
from zclaw.launch import StatusClient
from zclaw.wire import tcp


def test_addresses_parse_and_bad_ones_name_the_key() -> None:
    assert parse_address("10.0.0.5:7000:7001") == BrokerAddress("10.0.0.5", 7000, 7001)
    cfg = config_mod.defaults()
    assert broker_shards(cfg) == [BrokerAddress("127.0.0.1", 5555, 5556)]  # no list: the one broker
    for bad in (["h:1"], ["h:1:1"], ["h:x:2"], [5], ["h:1:2", "h:2:3"]):
        cfg["network"]["brokers"] = bad
        with pytest.raises(ConfigError, match="network.brokers"):
            config_mod._validate_brokers(cfg)
    cfg["network"]["brokers"] = ["a:1:2", "b:3:4", "c:5:6"]
    assert [shard_of_worker(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]
    net = as_shard(cfg, 2)["network"]
    assert (net["broker_host"], net["ingest_port"], net["serve_port"]) == ("c", 5, 6)
    assert cfg["network"]["broker_host"] == "127.0.0.1", "as_shard leaves the config it was given alone"
    with pytest.raises(ValueError, match="shard 3"):
        as_shard(cfg, 3)


def test_merged_report_adds_up_the_shards_and_counts_the_silent_one() -> None:
    a = {"fill": 3, "capacity": 8, "inserted_steps": 100, "insert_rate": 10.0, "drops": {"oversize": 1},
         "lag_hist": {"0": 5}, "workers": {"w0": {}}, "episodes": 10, "return_mean_100": 1.0}
    b = {"fill": 5, "capacity": 8, "inserted_steps": 50, "insert_rate": 5.0,
         "drops": {"oversize": 2, "stale": 1},
         "lag_hist": {"0": 1, "1": 2}, "workers": {"w1": {}}, "episodes": 30, "return_mean_100": 3.0}
    m = merge_reports([a, None, b])
    assert (m["shards"], m["shards_down"], m["fill"], m["capacity"]) == (3, 1, 8, 16)
    assert m["inserted_steps"] == 150 and m["insert_rate"] == 15.0
    assert m["drops"] == {"oversize": 3, "stale": 1} and m["lag_hist"] == {"0": 6, "1": 2}
    assert set(m["workers"]) == {"w0", "w1"}
    assert m["return_mean_100"] == pytest.approx((1.0 * 10 + 3.0 * 30) / 40)


@pytest.mark.timeout(300)
def test_train_with_two_shards_two_learner_ranks_samples_both_and_goes_on_while_one_is_down(
    tmp_path: Path,
) -> None:
    """``zclaw train --brokers 2 --learners 2 --workers 3`` on one machine (issue 13, item 4)."""
    run = Train(tmp_path / "run", "--env", "gym:Reacher-v5", "--brokers", "2", "--learners", "2",
                "--workers", "3", "--time", "240")
    ctx = zmq.Context()
    try:
        wait_until((run.run_dir / "config.toml").exists, 60, "config.toml", interval=0.2)
        cfg = config_mod.load(str(run.run_dir / "config.toml"), [])
        shards = broker_shards(cfg)
        assert len(shards) == 2 and len({a.serve_port for a in shards}) == 2
        status = [StatusClient(ctx, tcp("127.0.0.1", a.serve_port), STATUS_MS) for a in shards]
        for i, c in enumerate(status):  # worker i feeds shard i mod 2
            reached, rep = c.wait_until(lambda r: r["inserted_segments"] >= 2, 120)
            assert reached, (i, rep, run.output())
            assert {k[:3] for k in rep["workers"]} <= {f"w{j}-" for j in range(3) if j % 2 == i}
        L = run.wait("learner", lambda r: all(s["batches"] > 0 for s in r["shards"]) and r["version"] >= 3,
                     timeout=150)
        assert [s["up"] for s in L["shards"]] == [True, True]
        assert L["ranks"]["size"] == 2 and L["ranks"]["rank"] == 0  # rank 0 answers for the group

        out = subprocess.run(ZCLAW + ["status", "--once", "--run-dir", str(run.run_dir)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "shard 0" in out.stdout and "shard 1" in out.stdout, out.stdout

        # a dead shard costs its own data only: training goes on from the other; train restarts it and the
        # learner samples it again
        before = run.wait("learner", lambda r: True)["version"]
        os.kill(role_pids(run.proc.pid)["broker1"], signal.SIGKILL)
        run.wait("learner", lambda r: r["version"] >= before + 3, timeout=60)
        wait_until(lambda: "broker1 exited" in run.output(), 60, "train to restart broker1", interval=0.5)
        served = {s["shard"]: s["batches"] for s in run.wait("learner", lambda r: True)["shards"]}
        run.wait("learner", lambda r: r["shards"][1]["up"] and r["shards"][1]["batches"] > served[1],
                 timeout=90)
        assert run.proc.poll() is None, run.output()
        for c in status:
            c.close()
    finally:
        run.close()
        ctx.destroy(linger=0)
