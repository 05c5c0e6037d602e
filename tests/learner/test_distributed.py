"""Data-parallel learner ranks (zclaw/learner/distributed.py), as real gloo processes on this CPU.

The central claim: N ranks, each updating on its own part of a batch, end exactly where one learner updating
on the whole batch ends (parameters, the observation normaliser, the reward scale or PopArt's statistics, the
priorities), so adding ranks changes how fast a run learns, never what one update does. The reference is a
plain single-process :class:`Trainer`, which runs none of the distributed code; the parts are uneven (3 and 5
env columns), carry different importance weights, and each alone moves the parameters elsewhere (checked), so
the equality is the gradient weighting, the merged statistics and the shared advantage normalisation doing
their work.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Set

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
from support.batches import learner_cfg, make_model
from support.logs import events, wait_event
from support.procs import Roles, sigterm
from support.ranks import random_batch, run_ranks, split_batch
from support.waiting import wait_until

from zclaw.learner import checkpoint as ckpt
from zclaw.learner import distributed
from zclaw.learner.trainer import Trainer
from zclaw.policy.normalizer import Moments, RewardScaler, RunningNorm
from zclaw.wire import EnvSpec

SPEC = EnvSpec("test:Synthetic-v0", (5,), (2,), (-1.0, -1.0), (1.0, 1.0))
T = 16
COLUMNS = [3, 2, 1, 2]  # four segments; rank 0 gets segment 0 (3 columns), rank 1 segments 1-3 (5 columns)
PARTS = ([0], [1, 2, 3])
SEEDS = (11, 12)  # two batches: the second update starts from statistics the first one merged


def build(sync: Any = None, K: int = 1, **over: Any) -> Trainer:
    torch.manual_seed(0)
    model = make_model(SPEC, options=K, hidden=[32, 32]) if K > 1 else make_model(SPEC, hidden=[32, 32])
    return Trainer(model, learner_cfg(**over), "cpu", action_low=SPEC.action_low,
                   action_high=SPEC.action_high, sync=sync)


def outcome(trainer: Trainer, metrics: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "scaler": trainer.reward_scaler.state_dict() if trainer.reward_scaler is not None else None,
        "popart": trainer.popart.state_dict() if trainer.popart is not None else None,
        "sgd_steps": [m["sgd_steps"] for m in metrics],
        "kl_stopped": [m["kl_stopped"] for m in metrics],
        "priorities": [m["priorities"] for m in metrics],
        "steps_all": [m["steps_all"] for m in metrics],
        "skipped": trainer.skipped_steps,
    }


def train(trainer: Trainer, segments: Sequence[int] = ()) -> Dict[str, Any]:
    """Update on each of SEEDS' batches (only ``segments`` of each, if given)."""
    metrics = []
    for v, seed in enumerate(SEEDS):
        batch = random_batch(SPEC, COLUMNS, T, np.random.default_rng(seed), version=v)
        if segments:
            batch = split_batch(batch, SPEC, segments)
        metrics.append(trainer.update(batch, v))
    return outcome(trainer, metrics)


def rank_on_its_part(sync: distributed.Sync, over: Dict[str, Any]) -> Dict[str, Any]:
    return train(build(sync, **over), PARTS[sync.world.rank])


CASES = {
    # three passes over each batch as one minibatch: the ranks' union is the whole batch at every step
    "epochs": dict(epochs=3, minibatches=1, target_kl=0.0),
    # the KL stop fires after the first step, decided on the KL over both ranks
    "kl_stop": dict(epochs=3, minibatches=1, target_kl=1e-6),
    # PopArt: the value targets' moments merged over the ranks, the critic's last layer rescaled alike
    "popart": dict(epochs=3, minibatches=1, target_kl=0.0, reward_scale="popart"),
}


def test_two_ranks_on_the_parts_of_a_batch_end_where_one_learner_on_the_whole_ends() -> None:
    got = {name: run_ranks(rank_on_its_part, 2, over) for name, over in CASES.items()}
    for name, over in CASES.items():
        ref = train(build(**over))
        ranks = got[name]
        for r, out in enumerate(ranks):
            for k, v in ref["state"].items():  # parameters and the normaliser's mean, var and count
                assert torch.allclose(out["state"][k].double(), v.double(), rtol=0, atol=1e-6), (name, r, k)
            # whichever statistics the case keeps: the reward scale's come from the rewards themselves (to
            # 1e-9), PopArt's from float32 targets that a batch of another shape rounds apart (to 1e-6)
            for kind, rel in (("scaler", 1e-9), ("popart", 1e-6)):
                assert (out[kind] is None) == (ref[kind] is None), (name, kind)
                for k, v in (ref[kind] or {}).items():
                    assert out[kind][k] == pytest.approx(v, rel=rel, abs=1e-12), (name, r, kind, k)
            assert out["sgd_steps"] == ref["sgd_steps"] and out["kl_stopped"] == ref["kl_stopped"], name
            assert out["steps_all"] == [T * sum(COLUMNS)] * len(SEEDS)
        # every rank holds the same statistics and the same (rescaled) critic, bit for bit
        assert ranks[0]["popart"] == ranks[1]["popart"], name
        assert all(torch.equal(v, ranks[1]["state"][k]) for k, v in ranks[0]["state"].items()), name
        # each rank's priorities are the whole batch's for its segments
        for i in range(len(SEEDS)):
            joined = ranks[0]["priorities"][i] + ranks[1]["priorities"][i]
            assert joined == pytest.approx(ref["priorities"][i], rel=1e-5, abs=1e-6), name
    assert got["kl_stop"][0]["sgd_steps"] == [1.0, 1.0] and got["epochs"][0]["sgd_steps"] == [3.0, 3.0]
    # not a tautology: either part alone moves the parameters somewhere else
    for segments in PARTS:
        alone = train(build(**CASES["epochs"]), segments)
        ref = train(build(**CASES["epochs"]))
        diff = max(float((alone["state"][k] - v).abs().max()) for k, v in ref["state"].items())
        assert diff > 1e-3, segments


def rank_with_options(sync: distributed.Sync) -> Dict[str, Any]:
    """K = 3 (DAC), 4 minibatches, each rank on batches of its own shape; rank 1's second batch has a
    not-finite behaviour log-prob. Then rank 1 leaves, and rank 0 times how long a collective takes to
    fail."""
    # no KL stop: the random behaviour log-probs are far from the policy, and a stop before the poisoned
    # minibatch would leave nothing to skip
    trainer = build(sync, K=3, epochs=2, minibatches=4, target_kl=0.0)
    rank = sync.world.rank
    metrics = []
    for i in range(3):
        columns = [2, 2] if rank == 0 else [3, 1, 1]
        batch = random_batch(SPEC, columns, T, np.random.default_rng(100 * i + rank), K=3, version=i)
        if rank == 1 and i == 1:
            poisoned = np.array(batch.arrays["logp_action"])
            poisoned[3, 1] = np.nan
            batch.arrays["logp_action"] = poisoned
        metrics.append(trainer.update(batch, i))
    out = outcome(trainer, metrics)
    out["vote"] = sync.vote(rank == 1, (0.25, 0.5)[rank])  # the stop and the lr schedule's progress
    if rank == 0:
        t0 = time.monotonic()
        try:
            sync.any(False)  # rank 1 is gone by now, or about to be
            out["broken"] = None
        except distributed.GroupBroken as exc:
            out["broken"] = (time.monotonic() - t0, str(exc))
    return out


def test_ranks_stay_identical_with_options_uneven_batches_and_a_poisoned_minibatch() -> None:
    r0, r1 = run_ranks(rank_with_options, 2)
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k  # bit for bit: every rank applies the same reduced step
    assert r0["sgd_steps"] == r1["sgd_steps"] and r0["skipped"] == r1["skipped"]
    assert r0["skipped"] > 0, "rank 1's poisoned minibatches are skipped on both ranks"
    assert r0["sgd_steps"][0] > 0 and r0["sgd_steps"][2] > 0, "the other updates step as usual"
    assert r0["scaler"] == r1["scaler"]
    assert r0["vote"] == r1["vote"] == (True, 0.5), "one rank stopping stops all; the most progress counts"
    # a rank that is gone breaks the next collective, at once: no rank hangs
    assert r0["broken"] is not None, "a collective with a departed rank must fail"
    assert r0["broken"][0] < 30, r0["broken"]


def test_alone_sync_calls_no_collective_and_returns_what_it_is_given() -> None:
    sync = distributed.Sync()
    m = Moments(3.0, torch.ones(2), torch.ones(2))
    share = sync.batch(m, None, 12)
    assert share.obs is m and share.returns is None and share.samples == (12,)
    targets = Moments(4.0, 1.0, 2.0)
    assert sync.merge(targets) is targets
    assert sync.normalizers([[(torch.ones(3), None)]] * 2) == [None, None]
    assert sync.gradients([], 5, False, 0.1, 0.2) == (False, 0.1, 0.2)
    assert sync.any(True) is True and sync.share(b"x") == b"x"
    assert not dist.is_initialized() and not sync.calls


def test_world_from_env() -> None:
    assert distributed.world_from_env({}) == distributed.ALONE
    assert distributed.world_from_env({"WORLD_SIZE": "1", "RANK": "0"}) == distributed.ALONE
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    w = distributed.world_from_env(env)
    assert (w.rank, w.size, w.local_rank, w.main, w.parallel) == (3, 4, 1, False, True)
    for broken, says in ((dict(env, RANK="4"), "RANK = 4"), (dict(env, MASTER_PORT=""), "MASTER_PORT"),
                         ({k: v for k, v in env.items() if k != "RANK"}, "RANK is not set"),
                         (dict(env, WORLD_SIZE="two"), "WORLD_SIZE = 'two'")):
        with pytest.raises(ValueError, match=says):
            distributed.world_from_env(broken)


def test_moments_merge_as_one_set_and_fold_as_update_did() -> None:
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(3.0, 2.0, size=(50, 4)))
    norm = RunningNorm((4,))
    a, _ = norm.measure(x[:20])
    b, _ = norm.measure(x[20:])
    whole, _ = norm.measure(x)
    ab = a.merge(b)
    assert ab.count == whole.count == 50
    assert torch.allclose(ab.mean, whole.mean, atol=1e-12) and torch.allclose(ab.var, whole.var, atol=1e-12)
    assert a.merge(Moments(0.0, torch.zeros(4), torch.zeros(4))) is a
    # fold(measure(x)) is update(x), to the bit
    u, f = RunningNorm((4,)), RunningNorm((4,))
    u.update(x[:20])
    u.update(x[20:])
    f.fold(f.measure(x[:20])[0])
    f.fold(f.measure(x[20:])[0])
    assert all(torch.equal(u.state_dict()[k], f.state_dict()[k]) for k in ("mean", "var", "count"))
    s = RewardScaler(0.9)
    r = rng.normal(size=(8, 3))
    d = np.zeros((8, 3), bool)
    s.update(r, d, [3], ["w"], [0])
    t = RewardScaler(0.9)
    t.fold(t.measure(r, d, [3], ["w"], [0]))
    assert s.state_dict() == t.state_dict()


# ------------------------------------------------------------------------- zclaw learner --nproc, end to end


def listening(pid: int) -> Set[int]:
    """The TCP ports process ``pid`` listens on."""
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def rank_pids(log: Path) -> Dict[int, int]:
    """rank -> pid, from each rank's "learner up" line."""
    return {e["rank"]: e["pid"] for e in events(log, "learner up") if "rank" in e}


@pytest.mark.fault
def test_learner_ranks_train_as_one_a_killed_rank_stops_the_group_and_resume_goes_on(
    roles: Roles, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    roles.start("broker")
    launcher = roles.start("learner", "--run-dir", str(run), "--nproc", "2")
    roles.start("worker", "--env", "gym:Reacher-v5", "--index", "0", name="worker0")
    log = tmp_path / "learner.log"
    rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 5 and bool(r.get("last_checkpoint")),
                     timeout=120)
    assert rep["ranks"]["size"] == 2 and rep["ranks"]["rank"] == 0 and rep["ranks"]["backend"] == "gloo"
    assert rep["updates"] == rep["version"], "one version per update: one sequence for both ranks"
    pids = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(rank_pids(log)), 30, "both ranks up")
    assert set(psutil.Process(launcher.pid).children()) == {psutil.Process(pid) for pid in pids.values()}
    # rank 0 alone publishes and answers snapshots and status; rank 1 binds neither port
    ports = {roles.ports["publish_port"], roles.ports["learner_port"]}
    assert ports <= listening(pids[0]) and not ports & listening(pids[1])
    assert f"-{pids[0]}-" in rep["identity"]
    # rank 1 trains in the same sequence: its status lines count the versions rank 0 publishes
    line = wait_event(log, "learner status", 30, where=lambda e: e.get("rank") == 1 and e["updates"] >= 3)
    assert line["version"] == line["updates"]
    # every step both ranks trained is counted once, by rank 0: twice what its own batches hold
    assert rep["steps_consumed"] == rep["updates"] * 2 * 2 * 32 * 4  # ranks x batch_segments x T x envs

    # SIGKILL one rank: the group stops within a bound, no rank is left, the launcher's exit code says so
    os.kill(pids[1], signal.SIGKILL)
    try:
        code = launcher.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the launcher did not stop the group within 30 s of a rank's death") from None
    assert code != 0
    for pid in pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    failed = events(log, "learner rank failed")
    assert failed and failed[0]["rank"] == 1 and failed[0]["exit_code"] == -signal.SIGKILL
    assert events(log, "learner ranks out of step: stopping"), "rank 0 saw its peer go"
    last = ckpt.load(run / "checkpoints")["version"]

    # --resume: both ranks start from rank 0's last checkpoint, and the version goes on from it
    resumed = roles.start("learner", "--run-dir", str(run), "--nproc", "2", "--resume", name="resumed")
    log2 = tmp_path / "resumed.log"
    roles.wait(roles.learner, lambda r: (r.get("ranks") or {}).get("size") == 2
               and (r.get("version") or 0) >= last + 3, timeout=120)
    starts = wait_until(lambda: (lambda e: e if len(e) == 2 else None)(events(log2, "resumed")), 30,
                        "both ranks resumed")
    assert sorted(e["rank"] for e in starts) == [0, 1] and {e["version"] for e in starts} == {last}
    assert sigterm(resumed, 60, "the launcher", log2) == 0  # a clean stop: both ranks, final checkpoint
    final = events(log2, "final checkpoint")
    assert final and final[0]["rank"] == 0
    assert ckpt.load(run / "checkpoints")["version"] == final[0]["version"] > last
