"""Wall time to a solved arm task: zclaw K = 1, zclaw K = 4 and SB3 PPO, one after another on this machine.

Usage::

    python bench/learning.py                                   # 3 tasks x 3 variants x 3 seeds, 600 s each
    python bench/learning.py --tasks reacher --seeds 1 --cap 180 --md /tmp/table.md

Each run is its own process tree with the same CPU budget (the whole machine, one run at a time) and
a wall-time cap; a run that misses a threshold reports "> cap". Thresholds (the mean over the last
100 episodes): Reacher-v5 return >= -5, Pusher-v5 return >= -30, FetchReachDense-v4 success >= 0.9.

* zclaw: ``zclaw train --config configs/<task>.toml --time CAP`` with ``policy.options = K``; the
  time to threshold is read from ``RUN_DIR/metrics.jsonl`` (one line per ``log.metrics_s``) relative
  to the launch of ``zclaw train`` (startup included). Option usage and duration come from
  ``learner_final.json``; teacher vs student evaluation from ``zclaw eval RUN --json``.
* SB3 PPO (``pip install stable-baselines3``; a bench dependency, not a project one): 8 envs,
  VecNormalize, SB3's defaults, the same clock (from process launch), the same last-100 statistic.
* Sample Factory APPO on Reacher is added when ``import sample_factory`` works (``--sf``).

Prints a markdown table (median and range of the time to threshold, ratio to SB3's median, final
value) ready for ``docs/benchmarks.md``, plus K = 4 vs K = 1, option figures and student vs teacher.
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
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]

TASKS: Dict[str, Dict[str, Any]] = {
    "reacher": {"env": "Reacher-v5", "config": "configs/reacher.toml", "metric": "return", "threshold": -5.0},
    "pusher": {"env": "Pusher-v5", "config": "configs/pusher.toml", "metric": "return", "threshold": -30.0},
    "fetch_reach": {"env": "FetchReachDense-v4", "config": "configs/fetch_reach.toml", "metric": "success",
                    "threshold": 0.9},
}

FREE_PORTS = ["network.ingest_port=0", "network.serve_port=0", "network.publish_port=0", "network.learner_port=0"]


def first_crossing(points: List[Tuple[float, Optional[float]]], threshold: float) -> Optional[float]:
    """The first time at which the value reaches the threshold, or None."""
    for t, v in points:
        if v is not None and v >= threshold:
            return t
    return None


# -- zclaw ----------------------------------------------------------------------------------------

def run_zclaw(task: str, K: int, seed: int, cap: float, out: Path) -> Dict[str, Any]:
    spec = TASKS[task]
    run_dir = out / f"zclaw-{task}-k{K}-s{seed}"
    cmd = [sys.executable, "-m", "zclaw.cli", "train", "--config", str(ROOT / spec["config"]), "--time", str(cap),
           "--run-dir", str(run_dir), "--set", f"policy.options={K}", "--set", f"run.seed={seed}",
           "--set", "log.metrics_s=2.0"]
    for p in FREE_PORTS:
        cmd += ["--set", p]
    t0 = time.time()
    with open(out / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT, timeout=cap + 180)
    key = "return_mean_100" if spec["metric"] == "return" else "success_rate_100"
    points: List[Tuple[float, Optional[float]]] = []
    mpath = run_dir / "metrics.jsonl"
    if mpath.is_file():
        for line in mpath.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            points.append((float(d["time"]) - t0, d.get(key)))
    final = next((v for _, v in reversed(points) if v is not None), None)
    res: Dict[str, Any] = {"time": first_crossing(points, spec["threshold"]), "final": final, "run_dir": str(run_dir)}
    fpath = run_dir / "learner_final.json"
    if fpath.is_file():
        rep = json.loads(fpath.read_text())
        res["options"] = rep.get("options")
        if res["final"] is None:
            res["final"] = rep.get(key)
    res["eval"] = zclaw_eval(run_dir)
    return res


def zclaw_eval(run_dir: Path, episodes: int = 20) -> Optional[Dict[str, Any]]:
    """``zclaw eval RUN --json``: teacher and student returns (None if the command fails)."""
    try:
        p = subprocess.run([sys.executable, "-m", "zclaw.cli", "eval", str(run_dir), "-n", str(episodes), "--json"],
                           cwd=str(ROOT), capture_output=True, text=True, timeout=600)
        return json.loads(p.stdout) if p.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        return None


# -- SB3 PPO ----------------------------------------------------------------------------------------

SB3_SCRIPT = r"""
import json, sys, time
t0 = float(sys.argv[4])
import gymnasium as gym
from zclaw.envs.robotics import prepare  # registers Fetch/hand ids and patches the mujoco>=3.12 comparison
prepare(sys.argv[1])
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize
env_id, seed, cap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
wrap = gym.wrappers.FlattenObservation if env_id.startswith("Fetch") else None
venv = VecNormalize(make_vec_env(env_id, n_envs=8, seed=seed, wrapper_class=wrap,
                                 monitor_kwargs={"info_keywords": ("is_success",)} if wrap else None))
class Log(BaseCallback):
    last = 0.0
    def _on_step(self):
        now = time.time()
        if now - self.last >= 2.0:
            self.last = now
            buf = list(self.model.ep_info_buffer)
            if buf:
                r = float(sum(e["r"] for e in buf) / len(buf))
                s = [float(e["is_success"]) for e in buf if "is_success" in e]
                print(json.dumps({"t": now - t0, "return": r, "success": (sum(s) / len(s)) if s else None}), flush=True)
        return now - t0 < cap
PPO("MlpPolicy", venv, seed=seed, verbose=0, device="cpu").learn(10**9, callback=Log())
"""


def run_sb3(task: str, seed: int, cap: float, out: Path) -> Dict[str, Any]:
    spec = TASKS[task]
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", SB3_SCRIPT, spec["env"], str(seed), str(cap), repr(t0)],
                       capture_output=True, text=True, timeout=cap + 300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    (out / f"sb3-{task}-s{seed}.log").write_text(p.stdout + p.stderr)
    points = []
    for line in p.stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        points.append((d["t"], d.get(spec["metric"])))
    final = next((v for _, v in reversed(points) if v is not None), None)
    return {"time": first_crossing(points, spec["threshold"]), "final": final, "error": p.returncode != 0}


# -- table ----------------------------------------------------------------------------------------

def fmt_times(times: List[Optional[float]], cap: float) -> Tuple[str, Optional[float]]:
    """'median (min-max)' over seeds; a missed threshold counts as > cap (and the median may be '> cap')."""
    vals = [t if t is not None else float("inf") for t in times]
    if not vals:
        return "-", None
    med = statistics.median(vals)
    lo, hi = min(vals), max(vals)
    f = lambda v: f"> {cap:.0f}" if v == float("inf") else f"{v:.0f}"  # noqa: E731
    rng = f(lo) if lo == hi else f"{f(lo)} to {f(hi)}"
    return f"{f(med)} s ({rng})", (med if med != float("inf") else None)


def table(results: Dict[str, Dict[str, List[Dict[str, Any]]]], cap: float, seeds: int) -> str:
    lines = [f"Machine: {platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs), "
             f"{seeds} seed(s), cap {cap:.0f} s per run, one run at a time.", "",
             "| task | threshold | variant | time to threshold, median (range) | vs SB3 median | final (median) |",
             "|---|---|---|---|---|---|"]
    for task, by_variant in results.items():
        spec = TASKS[task]
        thr = f"{spec['metric']} >= {spec['threshold']}"
        sb3 = by_variant.get("sb3 ppo")
        _, sb3_med = fmt_times([r["time"] for r in sb3], cap) if sb3 else ("-", None)
        for variant, runs in by_variant.items():
            text, med = fmt_times([r["time"] for r in runs], cap)
            ratio = f"{med / sb3_med:.2f}x" if (med is not None and sb3_med) else "-"
            finals = [r["final"] for r in runs if r.get("final") is not None]
            fin = f"{statistics.median(finals):.3f}" if finals else "-"
            lines.append(f"| {task} | {thr} | {variant} | {text} | {ratio} | {fin} |")
    lines.append("")
    for task, by_variant in results.items():
        k1, k4 = by_variant.get("zclaw K=1"), by_variant.get("zclaw K=4")
        if k1 and k4:
            f1 = [r["final"] for r in k1 if r.get("final") is not None]
            f4 = [r["final"] for r in k4 if r.get("final") is not None]
            if f1 and f4:
                lines.append(f"- {task}: final K=4 {statistics.median(f4):.3f} vs K=1 {statistics.median(f1):.3f}")
        for variant in ("zclaw K=1", "zclaw K=4"):
            for r in by_variant.get(variant, []):
                o = r.get("options") or {}
                if variant == "zclaw K=4" and o:
                    lines.append(f"- {task} {variant}: option usage {[round(u, 3) for u in o.get('usage', [])]}, "
                                 f"mean duration {o.get('duration_mean') and round(o['duration_mean'], 2)} steps")
                ev = r.get("eval")
                if ev:
                    lines.append(f"- {task} {variant}: eval {json.dumps(summarise_eval(ev))}")
    return "\n".join(lines)


def summarise_eval(ev: Dict[str, Any]) -> Dict[str, Any]:
    """Teacher and student return / success from ``zclaw eval --json`` (whatever keys it has)."""
    out: Dict[str, Any] = {}
    for who in ("teacher", "student"):
        d = ev.get(who) or {}
        out[who] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()
                    if k in ("return_mean", "success_rate", "return")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="reacher,pusher,fetch_reach")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--cap", type=float, default=600.0)
    ap.add_argument("--variants", default="k1,k4,sb3", help="comma list of k1, k4, sb3")
    ap.add_argument("--out", default=None, help="directory for run dirs and logs (default: a temp dir)")
    ap.add_argument("--md", default=None, help="also write the markdown table to this file")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="zclaw-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for task in args.tasks.split(","):
        if task not in TASKS:
            raise SystemExit(f"--tasks: unknown task {task!r}; known: {', '.join(TASKS)}")
        results[task] = {}
        for variant in variants:
            name = {"k1": "zclaw K=1", "k4": "zclaw K=4", "sb3": "sb3 ppo"}[variant]
            runs = []
            for seed in range(args.seeds):
                print(f"[bench] {task} {name} seed {seed} (cap {args.cap:.0f} s)", flush=True)
                if variant == "sb3":
                    r = run_sb3(task, seed, args.cap, out)
                else:
                    r = run_zclaw(task, 1 if variant == "k1" else 4, seed, args.cap, out)
                print(f"[bench]   time to threshold {r['time']}, final {r['final']}", flush=True)
                runs.append(r)
            results[task][name] = runs
    md = table(results, args.cap, args.seeds)
    print(md)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if args.md:
        Path(args.md).write_text(md + "\n")


if __name__ == "__main__":
    main()
