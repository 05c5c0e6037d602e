"""The bench scripts still run end to end on tiny settings and print their figure lines.

No figure is asserted (they are timings on a shared machine; see docs/benchmarks.md): this catches a bench
that rotted when a role changed (bench/collect.py once stopped at "the worker did not start sending
segments" after the worker learned the broker handshake, and nothing noticed).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.shell import assert_valid_shell

BENCH = Path(__file__).resolve().parents[2] / "bench"
FLOAT = r"[0-9]+\.[0-9]+"

CASES = {
    "pipeline": (["--rounds", "1", "--seconds", "1", "--when-full", "wait", "--envs", "8", "--T", "16",
                  "--batch", "4"], rf"ratio pipeline / raw, broker\.when_full = wait: median {FLOAT}"),
    "collect": (["--rounds", "1", "--window", "1.5", "--envs", "2", "--segment-length", "16"],
                rf"ratio worker / bare \(per round\) +{FLOAT}"),
    # a store big enough that each snapshot spans several of the bench's 50 ms samples; a host fast enough
    # to write it between two samples gets the bench's "n/a" line, which is still a finished run
    "snapshot": (["--seconds", "3", "--capacity", "384", "--interval", "0.5"],
                 rf"ratio during / between snapshots, thread: ({FLOAT}|n/a)"),
    "curve": (["--seconds", "1"], rf"ratio CURVE / plain: {FLOAT}"),
    # the meter's own cost: a few hundred samples and a 1-s paced run
    "resources": (["--n", "200", "--rounds", "1", "--seconds", "1"],
                  rf"cost of the resource view: {FLOAT}% of one core"),
    # two gloo ranks against one on a tiny batch: both configurations run and the ratio line prints
    "learner_ranks": (["--updates", "2", "--warmup", "1", "--segments", "2", "--envs", "4", "--T", "16"],
                      rf"ratio 2 ranks / 1 rank, update throughput: {FLOAT}"),
    # one and two broker shards fed by 4 null-env clients for 1 s each: both configurations and the ratio
    "scale": (["--seconds", "1", "--warmup", "0.5", "--clients", "4", "--envs", "4", "--T", "16"],
              rf"broker CPU-seconds per million transitions: 1 shard {FLOAT}, 2 shards {FLOAT}[\s\S]*"
              rf"ratio ingest 2 shards / 1 shard: {FLOAT}"),
    # fair eviction against the ring on one small full store: the table row and its ratio
    "eviction": (["--rounds", "1", "--inserts", "200", "--capacities", "64", "--workers", "3"],
                 rf"\| 64 \| 3 \| {FLOAT} \| {FLOAT} \| {FLOAT}x \|"),
    # a mixed (2+4+8 envs) and a same-shape Reacher run of 10 s each: both run lines and the totals
    "mixed": (["--seconds", "10", "--shapes", "2,4,8", "--set", "worker.segment_length=16"],
              r"mixed seed 0: 2\+4\+8 = 14 envs[\s\S]*same  seed 0: 3 x 5 = 15 envs[\s\S]*"
              r"bad_shape drops and refusals, all runs: 0 \(must be 0\)"),
    # zclaw only (SB3 and Sample Factory are not in the test install): one short run and its table row
    # and an arm given with --define (its own run dir and row)
    "learning": (["--tasks", "reacher", "--variants", "k1,noscale", "--seeds", "1", "--cap", "10",
                  "--define", "noscale=learner.reward_scale=off"],
                 r"\| reacher \| return >= -5\.0 \| zclaw K=1 \| [\s\S]*\| reacher \| return >= -5\.0 \| "
                 r"zclaw noscale \| "),
    # a live Reacher run and three cheap attacks of 2 s windows (no joins): the per-attack lines
    "hostile": (["--window", "2", "--attacks", "parts,blowup,oversize", "--big-mb", "8", "--joins", "0"],
                rf"attack oversize: ingest during/base ({FLOAT}|n/a) after/base ({FLOAT}|n/a), updates "
                rf"during/base ({FLOAT}|n/a) after/base ({FLOAT}|n/a), counted \S+=[0-9]+.*, internal=0, "
                r"rss_max broker [0-9]+ learner [0-9]+ MiB"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_script_runs_and_prints_its_figure(name: str) -> None:
    args, figure = CASES[name]
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *args], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert re.search(figure, out.stdout), out.stdout[-2000:]


def test_learner_ranks_with_one_rank_runs_the_one_rank_configuration_alone() -> None:
    """``--ranks 1``: what a host with one GPU can run (two NCCL ranks cannot share it)."""
    out = subprocess.run([sys.executable, str(BENCH / "learner_ranks.py"), "--ranks", "1", "--updates", "2",
                          "--warmup", "1", "--segments", "2", "--envs", "4", "--T", "16"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    assert re.search(rf"1 rank : {FLOAT} updates/s", out.stdout) and "2 ranks" not in out.stdout, out.stdout


def test_the_gpu_check_script_parses_and_passes_shellcheck() -> None:
    """bench/gpu_checks.sh runs only on a lent GPU machine: here it is at least valid, lint-clean bash."""
    assert_valid_shell(BENCH / "gpu_checks.sh")
