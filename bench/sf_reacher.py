"""Sample Factory APPO on Reacher: the ``sf`` column of ``bench/learning.py``.

Why a separate script: Sample Factory 2.1.1 (the newest on PyPI) pins ``gymnasium < 1.0`` and
``numpy < 2``, which zclaw's environment cannot take. So this file runs in Sample Factory's own
virtual environment (``bench/learning.py --sf-python``), imports nothing from zclaw, and is never a
zclaw dependency. ``bench/learning.py`` launches it in a new process group and kills that group at
the wall-time cap (Sample Factory spawns rollout, inference and learner processes). That venv::

    python3.11 -m venv /work/sf-venv
    /work/sf-venv/bin/pip install torch==2.13.0          # the CPU wheel; a bare torch pulls CUDA
    /work/sf-venv/bin/pip install sample-factory imageio mujoco==4.0.0 "numpy<2"
    /work/sf-venv/bin/pip install --no-deps gymnasium==1.4.0   # over SF's pin: brings Reacher-v5

The last line overrides Sample Factory's ``gymnasium < 1.0`` pin (``pip check`` reports it) so that
the task is Reacher-v5, as for the other columns: Sample Factory keeps one gymnasium env per slot
behind its own thin wrappers (``gym.make``, spaces, ``reset``, ``step``: the single-env API that
gymnasium 1.x kept) and ran cleanly with gymnasium 1.4.0 here. Without that line the
script falls back to Reacher-v4 (same model and reward; v5 drops the always-zero fingertip z from
the observation) and says so in its first line.

Settings: Sample Factory's own MuJoCo defaults (``sf_examples.mujoco.mujoco_params``, the APPO
hyperparameters of its MuJoCo example) with the sampling sized for this box: ``--workers`` rollout
workers (``bench/learning.py`` passes ``min(8, CPUs)``; Sample Factory's example uses 8) x 8 envs
each, CPU only.

Output: one JSON line about every 2 s on stdout, ``{"t": seconds since t0, "return": mean over the
last 100 episodes, "success": null, "episodes": n}``, after a first line ``{"env": id}``. ``t0`` is
the launch time that the caller passes, so startup is counted as for the other variants.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, Optional

import gymnasium as gym
import numpy as np
from sample_factory.algo.runners.runner import Runner
from sample_factory.algo.utils.misc import ExperimentStatus
from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
from sample_factory.envs.env_utils import register_env
from sample_factory.train import make_runner
from sample_factory.utils.typing import PolicyID
from sf_examples.mujoco.mujoco_params import mujoco_override_defaults

ENV_NAME = "bench_reacher"
GRACE_S = 30.0  # past cap + GRACE_S the run stops itself (Sample Factory 2.1.1 ignores --train_for_seconds)


def reacher_id() -> str:
    """The newest Reacher that this gymnasium registers (v5 from gymnasium 1.0 on, else v4)."""
    return "Reacher-v5" if "Reacher-v5" in gym.envs.registry else "Reacher-v4"


def make_env(full_env_name: str, cfg: Any, env_config: Any, render_mode: Optional[str] = None) -> gym.Env:
    """Sample Factory's env factory; module level because its worker processes are spawned (pickled)."""
    return gym.make(reacher_id(), render_mode=render_mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap", type=float, required=True, help="wall-time cap in seconds (from t0)")
    ap.add_argument("--t0", type=float, required=True, help="launch time (time.time()) of the caller")
    ap.add_argument("--train-dir", required=True,
                    help="Sample Factory's train_dir (experiment 'appo' goes in it)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--envs-per-worker", type=int, default=8)
    args = ap.parse_args()

    env_id = reacher_id()
    print(json.dumps({"env": env_id}), flush=True)

    register_env(ENV_NAME, make_env)
    argv = [f"--env={ENV_NAME}", "--experiment=appo", f"--train_dir={args.train_dir}",
            "--restart_behavior=overwrite", f"--seed={args.seed}", "--device=cpu",
            f"--num_workers={args.workers}", f"--num_envs_per_worker={args.envs_per_worker}",
            "--with_wandb=False"]
    parser, partial_cfg = parse_sf_args(argv=argv)
    mujoco_override_defaults(partial_cfg.env, parser)
    cfg = parse_full_cfg(parser, argv)

    last: Dict[str, float] = {"print": 0.0}

    def on_episode(runner: Runner, msg: Dict[str, Any], policy_id: PolicyID) -> None:
        # Called after Runner's own handler has appended this episode to policy_avg_stats (a deque of
        # the last cfg.stats_avg = 100 episodes). Reported only once that window is full: Sample
        # Factory's env decorrelation steps the start of each env's first episode with random actions
        # outside the stats, so the first few episodes are short and their returns look good (a lone
        # -4.9 at 15 s in a trial, past the -5 threshold). On Reacher the window fills in seconds.
        now = time.time()
        if now - args.t0 > args.cap + GRACE_S:
            runner._stop_training()  # only if the caller, which kills this process group at the cap, is gone
        if now - last["print"] < 2.0:
            return
        buf = runner.policy_avg_stats.get("reward", [[]])[policy_id]
        if len(buf) >= runner.cfg.stats_avg:
            last["print"] = now
            print(json.dumps({"t": now - args.t0, "return": float(np.mean(buf)), "success": None,
                              "episodes": len(buf)}), flush=True)

    cfg, runner = make_runner(cfg)
    runner.register_episodic_stats_handler(on_episode)
    status = runner.init()
    if status == ExperimentStatus.SUCCESS:
        status = runner.run()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
