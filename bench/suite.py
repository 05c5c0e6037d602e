"""The default config against SB3 PPO on tasks nobody tuned for: one invocation, a wall-time cap per run.

Usage::

    python bench/suite.py                                   # 7 tasks x (zclaw, sb3) x 3 seeds, 300 s each
    python bench/suite.py --tasks walker,ant --seeds 1 --cap 120
    python bench/suite.py --tasks walker --variants zclaw,k4 --seeds 1       # options with the same defaults
    python bench/suite.py --tasks walker --seeds 1 --cap 120 --variants zclaw,noscale \\
        --define noscale=learner.reward_scale=off                            # an ablation arm
    python bench/suite.py --json /tmp/suite.json            # every curve, for later tables

Variants (``--variants``, comma-separated, run in this order for every task and seed, one at a time):

* ``zclaw``: ``zclaw train --config configs/default.toml --env gym:<id> --time CAP``: the default config
  with only the env changed (one worker, its default env count).
* ``k4``: the same with ``policy.options = 4``.
* ``sb3``: SB3 PPO, 8 envs, VecNormalize, SB3's own defaults (``pip install stable-baselines3``: a bench
  dependency, not a project one), the script of ``bench/learning.py``.
* ``sf``: Sample Factory APPO where its venv exists (``--sf-python``; Reacher only, ``bench/sf_reacher.py``).
* any name given with ``--define NAME=section.key=value[;section.key=value...]``: zclaw with the
  default config plus those overrides (an ablation arm).

The statistic is the mean return over the last 100 episodes (success rate for FetchReach), sampled every
~2 s, on a clock that starts when the run's process is launched (start-up counts). For each task it prints:
the median over seeds at 60, 120 and 300 s (or at the cap); the return at equal env steps (each zclaw
variant at the number of env steps SB3 had taken at the cap); and zclaw's time to SB3's final median
(per seed, then the median). Figures are ratios measured in one invocation, so a noisy machine moves both
sides alike; run nothing else beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import (FREE_PORTS, ROOT, SF_PYTHON, parse_defines, run_sf, sb3_curve,  # noqa: E402
                      sf_missing)

#: name -> (gymnasium id, metric); arms, a hand, bodies with early termination or long horizons
TASKS: Dict[str, Tuple[str, str]] = {
    "reacher": ("Reacher-v5", "return"),
    "pusher": ("Pusher-v5", "return"),
    "fetch_reach": ("FetchReachDense-v4", "success"),
    "hand_reach": ("HandReachDense-v3", "return"),
    "walker": ("Walker2d-v5", "return"),
    "ant": ("Ant-v5", "return"),
    "idp": ("InvertedDoublePendulum-v5", "return"),
}
CHECKPOINTS = (60.0, 120.0, 300.0)
GAMMA = 0.99  # SB3's default, and configs/default.toml's learner.gamma: both optimise the same return

Curve = List[Tuple[float, Optional[int], Optional[float]]]  # (seconds since launch, env steps, statistic)


def run_zclaw(env_id: str, metric: str, seed: int, cap: float, sets: Sequence[str], run_dir: Path) -> Curve:
    """``zclaw train`` with the default config and ``sets``; its curve from ``RUN_DIR/metrics.jsonl``."""
    cmd = [sys.executable, "-m", "zclaw.cli", "train", "--config", str(ROOT / "configs" / "default.toml"),
           "--env", f"gym:{env_id}", "--time", str(cap), "--run-dir", str(run_dir),
           "--set", f"run.seed={seed}", "--set", "log.metrics_s=2.0", "--set", "learner.tensorboard=false"]
    for kv in list(FREE_PORTS) + list(sets):
        cmd += ["--set", kv]
    t0 = time.time()
    with open(f"{run_dir}.log", "w") as log:
        subprocess.run(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, timeout=cap + 240)
    key = "success_rate_100" if metric == "success" else "return_mean_100"
    curve: Curve = []
    path = run_dir / "metrics.jsonl"
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        curve.append((float(d["time"]) - t0, d.get("env_steps"), d.get(key)))
    return curve


def at_time(curve: Curve, t: float) -> Optional[float]:
    """The statistic at time t: the last value logged at or before t (None if none, or t is past the run)."""
    if not curve or curve[-1][0] < t - 5.0:
        return None
    vals = [v for s, _, v in curve if s <= t and v is not None]
    return vals[-1] if vals else None


def at_steps(curve: Curve, steps: int) -> Optional[float]:
    """The statistic when the run had taken ``steps`` env steps (None if it never did)."""
    for _, n, v in curve:
        if n is not None and n >= steps and v is not None:
            return v
    return None


def time_to(curve: Curve, value: float) -> Optional[float]:
    for t, _, v in curve:
        if v is not None and v >= value:
            return t
    return None


def final(curve: Curve) -> Optional[float]:
    return next((v for _, _, v in reversed(curve) if v is not None), None)


def last_steps(curve: Curve) -> Optional[int]:
    return next((n for _, n, _ in reversed(curve) if n is not None), None)


def median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(results: Dict[str, Dict[str, List[Curve]]], cap: float, seeds: int) -> str:
    """The markdown tables: returns at fixed times, at equal env steps, and time to SB3's final."""
    marks = [t for t in CHECKPOINTS if t <= cap] or [cap]
    if cap not in marks:
        marks.append(cap)
    out = [f"Machine: {platform.node()} ({os.cpu_count()} CPUs), {seeds} seed(s) per cell, one run at a "
           f"time, cap {cap:.0f} s; medians over seeds (the statistic: mean of the last 100 episodes).", "",
           "| task | variant | " + " | ".join(f"at {t:.0f} s" for t in marks)
           + " | env steps at cap | at SB3's env steps | vs SB3 there | time to SB3's final |",
           "|---|---|" + "---|" * (len(marks) + 4)]
    for task, by_variant in results.items():
        sb3 = by_variant.get("sb3") or []
        sb3_steps = median([last_steps(c) for c in sb3])
        sb3_final = median([final(c) for c in sb3])  # also its value at its own env steps
        for variant, curves in by_variant.items():
            cells = [fmt(median([at_time(c, t) for c in curves]), 3) for t in marks]
            steps = median([last_steps(c) for c in curves])
            eq = (median([at_steps(c, int(sb3_steps)) for c in curves])
                  if sb3_steps is not None and variant != "sb3" else None)
            ratio = "-"
            if eq is not None and sb3_final is not None:
                ratio = f"{eq - sb3_final:+.3f}" if sb3_final <= 0 else f"{eq / sb3_final:.2f}x"
            tt = "-"
            if sb3_final is not None and variant != "sb3":
                times = [time_to(c, sb3_final) for c in curves]
                reached = [t for t in times if t is not None]
                tt = (f"{statistics.median(reached):.0f} s ({len(reached)}/{len(times)} seeds)"
                      if reached else f"> {cap:.0f} s")
            out.append(f"| {task} | {variant} | " + " | ".join(cells)
                       + f" | {fmt(steps, 0)} | {fmt(eq, 3)} | {ratio} | {tt} |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help=f"comma-separated, of: {', '.join(TASKS)}, or any gymnasium id (Hopper-v5)")
    ap.add_argument("--variants", default="zclaw,sb3",
                    help="comma-separated: zclaw, k4, sb3, sf, or a name given with --define")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="an ablation arm: NAME=section.key=value[;section.key=value...] (repeatable)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cap", type=float, default=300.0, help="wall-time cap of every run, in seconds")
    ap.add_argument("--out", default="", help="directory for run dirs and logs (default: a temporary one)")
    ap.add_argument("--json", default="", help="also write every curve to this file")
    ap.add_argument("--sf-python", default=SF_PYTHON, help="python of a Sample Factory venv (variant sf)")
    args = ap.parse_args(argv)

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in tasks:  # any other gymnasium id (a task the suite does not name) is measured by its return
        if t not in TASKS and "-v" in t:
            TASKS[t] = (t, "return")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: unknown {', '.join(unknown)}; known: {', '.join(TASKS)} or any "
                         "gymnasium id (HalfCheetah-v5)")
    defines = parse_defines(args.define)
    arms: Dict[str, List[str]] = {"zclaw": [], "k4": ["policy.options=4"], **defines}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in arms and v not in ("sb3", "sf")]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: zclaw, k4, sb3, sf "
                         "and the names given with --define")
    sf_why = sf_missing(args.sf_python) if "sf" in variants else None
    if sf_why:
        print(f"sf skipped: {sf_why}", flush=True)
    out = Path(args.out or tempfile.mkdtemp(prefix="zclaw-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs and logs in {out}", flush=True)

    results: Dict[str, Dict[str, List[Curve]]] = {}
    for task in tasks:
        env_id, metric = TASKS[task]
        results[task] = {}
        for seed in range(args.seeds):
            for variant in variants:
                name = f"{variant}-{task}-s{seed}"
                started = time.time()
                if variant == "sb3":
                    curve, failed = sb3_curve(env_id, metric, seed, args.cap, GAMMA, out / f"{name}.log")
                    curve = [(t, n, v) for t, n, v in curve]
                elif variant == "sf":
                    if sf_why or task != "reacher":
                        continue
                    res = run_sf(task, seed, args.cap, out, args.sf_python)
                    curve, failed = [(args.cap, None, res["final"])], bool(res["error"])
                else:
                    curve = run_zclaw(env_id, metric, seed, args.cap, arms[variant], out / name)
                    failed = not curve
                results[task].setdefault(variant, []).append(curve)
                print(json.dumps({"run": name, "seconds": round(time.time() - started, 1),
                                  "final": final(curve), "steps": last_steps(curve),
                                  "failed": failed}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"cap": args.cap, "results": results}))
    print()
    print(report(results, args.cap, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
