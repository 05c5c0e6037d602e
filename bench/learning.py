"""Wall time to a solved arm task: zclaw K = 1, zclaw K = 4, SB3 PPO and (Reacher) Sample Factory APPO.

Usage::

    python bench/learning.py                                   # 3 tasks x 4 variants x 3 seeds, 600 s each
    python bench/learning.py --tasks reacher --seeds 1 --cap 180 --md /tmp/table.md
    python bench/learning.py --cap reacher=180,pusher=240,fetch_reach=100  # a cap per task
    python bench/learning.py --tasks reacher --variants k1,sb3,sf --sf-python /work/sf-venv/bin/python
    python bench/learning.py --tasks reacher --variants k1,noscale --define noscale=learner.reward_scale=off

Each run is its own process tree with the same CPU budget (the whole machine, one run at a time) and
a wall-time cap; a run that misses a threshold reports "> cap". Thresholds (the mean over the last
100 episodes): Reacher-v5 return >= -5, Pusher-v5 return >= -30, FetchReachDense-v4 success >= 0.9.

* zclaw: ``zclaw train --config configs/<task>.toml --time CAP`` with ``policy.options = K``; the
  time to threshold is read from ``RUN_DIR/metrics.jsonl`` (one line per ``log.metrics_s``) relative
  to the launch of ``zclaw train`` (startup included). Option usage and duration come from
  ``learner_final.json``; teacher vs student evaluation from ``zclaw eval RUN --json``.
* SB3 PPO (``pip install stable-baselines3``; a bench dependency, not a project one): 8 envs,
  VecNormalize, SB3's defaults except the discount, which is the task's zclaw config's
  ``learner.gamma`` (Reacher 0.95, the others 0.99: both learners optimise the same return); the
  same clock (from process launch), the same last-100 statistic.
* Sample Factory APPO (variant ``sf``, Reacher only; the other tasks skip it): ``bench/sf_reacher.py``
  run by ``--sf-python``, the python of a separate venv that has Sample Factory (it pins gymnasium
  < 1.0 and numpy < 2, so it is neither a project nor a bench dependency; that file's docstring
  has the recipe). Sample Factory's MuJoCo defaults (APPO hyperparameters of its MuJoCo example),
  min(8, CPUs) rollout workers x 8 envs, CPU; the same clock, the same last-100 statistic (logged
  every ~2 s), and its process group is killed at the cap. The env id it ran (Reacher-v5, or v4
  with Sample Factory's own gymnasium) is noted under the table. Skipped, with the reason printed,
  when that python cannot import Sample Factory.

Prints a markdown table (median and range of the time to threshold, ratio to SB3's median, final
value) ready for ``docs/benchmarks.md``, plus K = 4 vs K = 1, option figures and student vs teacher.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from zclaw.config import load as load_config

ROOT = Path(__file__).resolve().parents[1]

TASKS: Dict[str, Dict[str, Any]] = {
    "reacher": {"env": "Reacher-v5", "config": "configs/reacher.toml", "metric": "return", "threshold": -5.0},
    "pusher": {"env": "Pusher-v5", "config": "configs/pusher.toml", "metric": "return", "threshold": -30.0},
    "fetch_reach": {"env": "FetchReachDense-v4", "config": "configs/fetch_reach.toml", "metric": "success",
                    "threshold": 0.9},
}

SF_NAME = "sample factory appo"
NAMES: Dict[str, str] = {"k1": "zclaw K=1", "k4": "zclaw K=4", "sb3": "sb3 ppo", "sf": SF_NAME}

FREE_PORTS = ["network.ingest_port=0", "network.serve_port=0", "network.publish_port=0",
              "network.learner_port=0"]


def first_crossing(points: List[Tuple[float, Optional[float]]], threshold: float) -> Optional[float]:
    """The first time at which the value reaches the threshold, or None."""
    for t, v in points:
        if v is not None and v >= threshold:
            return t
    return None


# -- zclaw ----------------------------------------------------------------------------------------

def parse_defines(items: List[str]) -> Dict[str, List[str]]:
    """``--define NAME=section.key=value;section.key=value`` -> {NAME: [overrides]} (here and in
    bench/suite.py: an ablation arm is zclaw with those overrides)."""
    out: Dict[str, List[str]] = {}
    for item in items:
        name, _, sets = item.partition("=")
        if not name or not sets:
            raise SystemExit(f"--define {item!r}: expected NAME=section.key=value[;section.key=value...]")
        out[name] = [s.strip() for s in sets.split(";") if s.strip()]
    return out


def run_zclaw(task: str, arm: str, overrides: List[str], seed: int, cap: float, out: Path,
              eval_episodes: int = 20) -> Dict[str, Any]:
    """One ``zclaw train`` of the task's config plus ``overrides`` (the arm ``arm``), capped at ``cap``."""
    spec = TASKS[task]
    run_dir = out / f"zclaw-{task}-{arm}-s{seed}"
    cmd = [sys.executable, "-m", "zclaw.cli", "train", "--config", str(ROOT / spec["config"]), "--time",
           str(cap), "--run-dir", str(run_dir), "--set", f"run.seed={seed}", "--set", "log.metrics_s=2.0"]
    for o in overrides:
        cmd += ["--set", o]
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
    res: Dict[str, Any] = {"time": first_crossing(points, spec["threshold"]), "final": final,
                           "run_dir": str(run_dir)}
    fpath = run_dir / "learner_final.json"
    if fpath.is_file():
        rep = json.loads(fpath.read_text())
        res["options"] = rep.get("options")
        if res["final"] is None:
            res["final"] = rep.get(key)
    res["eval"] = zclaw_eval(run_dir, eval_episodes)
    return res


def zclaw_eval(run_dir: Path, episodes: int) -> Optional[Dict[str, Any]]:
    """``zclaw eval RUN --json``: teacher and student returns (None if the command fails)."""
    try:
        p = subprocess.run([sys.executable, "-m", "zclaw.cli", "eval", str(run_dir),
                            "-n", str(episodes), "--json"],
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
env_id, seed, cap, gamma = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[5])
probe = gym.make(env_id)
dict_obs = isinstance(probe.observation_space, gym.spaces.Dict)  # Fetch, hands: flattened as zclaw does
probe.close()
wrap = gym.wrappers.FlattenObservation if dict_obs else None
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
                print(json.dumps({"t": now - t0, "steps": self.num_timesteps, "return": r,
                                  "success": (sum(s) / len(s)) if s else None}), flush=True)
        return now - t0 < cap
PPO("MlpPolicy", venv, seed=seed, gamma=gamma, verbose=0, device="cpu").learn(10**9, callback=Log())
"""


def zclaw_config(task: str) -> Dict[str, Dict[str, Any]]:
    """The resolved zclaw config of a task (SB3 gets its discount: the same return to optimise)."""
    return load_config(str(ROOT / TASKS[task]["config"]))


def sb3_curve(env_id: str, metric: str, seed: int, cap: float, gamma: float,
              log_path: Path) -> Tuple[List[Tuple[float, int, Optional[float]]], bool]:
    """One SB3 PPO run (8 envs, VecNormalize, SB3's defaults but ``gamma``) for ``cap`` s; returns its
    curve, (seconds since launch, env steps, last-100 ``metric``) every ~2 s, and whether it failed."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", SB3_SCRIPT, env_id, str(seed), str(cap), repr(t0),
                        str(gamma)], capture_output=True, text=True, timeout=cap + 300)
    log_path.write_text(p.stdout + p.stderr)
    points = []
    for line in p.stdout.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        points.append((d["t"], int(d["steps"]), d.get(metric)))
    return points, p.returncode != 0


def run_sb3(task: str, seed: int, cap: float, out: Path) -> Dict[str, Any]:
    spec = TASKS[task]
    gamma = zclaw_config(task)["learner"]["gamma"]
    curve, failed = sb3_curve(spec["env"], spec["metric"], seed, cap, gamma, out / f"sb3-{task}-s{seed}.log")
    points = [(t, v) for t, _, v in curve]
    final = next((v for _, v in reversed(points) if v is not None), None)
    return {"time": first_crossing(points, spec["threshold"]), "final": final, "error": failed}


# -- Sample Factory APPO (Reacher) ------------------------------------------------------------------

SF_PYTHON = "/work/sf-venv/bin/python"
SF_TASKS = ("reacher",)


def sf_missing(sf_python: str) -> Optional[str]:
    """Why the ``sf`` variant cannot run with this python, or None when it can."""
    if not Path(sf_python).is_file():
        return f"{sf_python} does not exist (see bench/sf_reacher.py for the venv recipe)"
    try:
        p = subprocess.run([sf_python, "-c",
                            "import sample_factory, sf_examples.mujoco.mujoco_params, mujoco"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{sf_python} failed to start: {e}"
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        return (f"{sf_python} cannot import Sample Factory: "
                f"{lines[-1] if lines else 'exit ' + str(p.returncode)}")
    return None


def kill_group(p: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """SIGTERM the process group that ``p`` leads (workers too, even if ``p`` already exited), then
    SIGKILL whatever is left after ``grace`` s. Waiting for the whole group matters: Python's
    multiprocessing resource tracker ignores SIGTERM and removes the run's semaphores from /dev/shm
    once the others are gone, unless a SIGKILL gets it first."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        end = time.time() + grace
        try:
            os.killpg(p.pid, sig)
            while time.time() < end:
                p.poll()  # reap the leader, or the group never empties
                os.killpg(p.pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            return


def run_sf(task: str, seed: int, cap: float, out: Path, sf_python: str) -> Dict[str, Any]:
    """``bench/sf_reacher.py`` in its own process group, killed (TERM, then KILL) at the cap."""
    spec = TASKS[task]
    log_path = out / f"sf-{task}-s{seed}.log"
    workers = min(8, os.cpu_count() or 1)
    t0 = time.time()
    cmd = [sf_python, str(ROOT / "bench" / "sf_reacher.py"), "--seed", str(seed), "--cap", str(cap),
           "--t0", repr(t0), "--train-dir", str(out / f"sf-{task}-s{seed}"), "--workers", str(workers),
           "--envs-per-worker", "8"]
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             start_new_session=True)
        killed = False
        try:
            p.wait(timeout=max(0.0, t0 + cap - time.time()))
        except subprocess.TimeoutExpired:
            killed = True
        finally:  # also on Ctrl-C: the group is in its own session, so a terminal's SIGINT misses it
            kill_group(p)
    env_id, points = None, []
    for line in log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "env" in d:
            env_id = d["env"]
        elif "t" in d and d["t"] <= cap:
            points.append((d["t"], d.get(spec["metric"])))
    final = next((v for _, v in reversed(points) if v is not None), None)
    return {"time": first_crossing(points, spec["threshold"]), "final": final, "env": env_id,
            "error": (not killed and p.returncode != 0) or not points}


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


def parse_caps(text: str, tasks: List[str]) -> Dict[str, float]:
    """``--cap``: one number of seconds for every task, or ``task=seconds`` pairs naming each task."""
    try:
        if "=" not in text:
            return {t: float(text) for t in tasks}
        caps = {k.strip(): float(v) for k, v in (item.split("=", 1) for item in text.split(","))}
    except ValueError:
        raise SystemExit(f"--cap {text!r}: expected seconds (600) or task=seconds pairs "
                         "(reacher=180,pusher=240)")
    missing = [t for t in tasks if t not in caps]
    if missing:
        raise SystemExit(f"--cap {text!r} names no cap for {', '.join(missing)}")
    return caps


def table(results: Dict[str, Dict[str, List[Dict[str, Any]]]], caps: Dict[str, float], seeds: int) -> str:
    lines = [f"Machine: {platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} "
             f"CPUs), {seeds} seed(s), one run at a time; cap per run: "
             + ", ".join(f"{t} {c:.0f} s" for t, c in caps.items() if t in results) + ".", "",
             "| task | threshold | variant | time to threshold, median (range) "
             "| vs SB3 median | final (median) |",
             "|---|---|---|---|---|---|"]
    for task, by_variant in results.items():
        spec, cap = TASKS[task], caps[task]
        thr = f"{spec['metric']} >= {spec['threshold']}"
        sb3 = by_variant.get("sb3 ppo")
        _, sb3_med = fmt_times([r["time"] for r in sb3], cap) if sb3 else ("-", None)
        for variant, runs in by_variant.items():
            text, med = fmt_times([r["time"] for r in runs], cap)
            if med is not None and sb3_med:
                ratio = f"{med / sb3_med:.2f}x"
            elif med is not None and sb3:  # SB3's median missed the cap: the ratio is at most med / cap
                ratio = f"< {med / cap:.2f}x"
            else:
                ratio = "-"
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
                lines.append(f"- {task}: final K=4 {statistics.median(f4):.3f} vs K=1 "
                             f"{statistics.median(f1):.3f}")
        envs = sorted({str(r.get("env")) for r in by_variant.get(SF_NAME, [])})
        if envs:
            lines.append(f"- {task} {SF_NAME}: env {', '.join(envs)} (the other variants: "
                         f"{TASKS[task]['env']})")
        for variant in ("zclaw K=1", "zclaw K=4"):
            for r in by_variant.get(variant, []):
                o = r.get("options") or {}
                if variant == "zclaw K=4" and o:
                    usage = [round(u, 3) for u in o.get("usage", [])]
                    lines.append(f"- {task} {variant}: option usage {usage}, mean duration "
                                 f"{_round(o.get('duration_mean'), 2)} steps, distance of the option means "
                                 f"min {_round(o.get('distance_min'), 3)} mean "
                                 f"{_round(o.get('distance_mean'), 3)}, spread min "
                                 f"{_round(o.get('spread_min'), 3)} of the action range")
                ev = r.get("eval")
                if ev:
                    lines.append(f"- {task} {variant}: eval {json.dumps(summarise_eval(ev))}")
    return "\n".join(lines)


def _round(v: Optional[float], digits: int) -> Optional[float]:
    return None if v is None else round(float(v), digits)


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
    ap.add_argument("--cap", default="600", help="seconds per run: one number, or task=seconds pairs")
    ap.add_argument("--variants", default="k1,k4,sb3,sf",
                    help="comma list of k1, k4, sb3, sf (Sample Factory APPO, Reacher only; needs "
                         "--sf-python), or a name given with --define")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="a zclaw arm: the task's config (K = 1) plus NAME=section.key=value[;...] "
                         "(repeatable), e.g. noscale=learner.reward_scale=off")
    ap.add_argument("--sf-python", default=SF_PYTHON,
                    help="python of the venv with Sample Factory, for the sf variant (default: %(default)s)")
    ap.add_argument("--out", default=None, help="directory for run dirs and logs (default: a temp dir)")
    ap.add_argument("--md", default=None, help="also write the markdown table to this file")
    ap.add_argument("--eval-episodes", type=int, default=20,
                    help="episodes of each zclaw eval, teacher and student (default: %(default)s)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="zclaw-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    arms: Dict[str, List[str]] = {"k1": ["policy.options=1"], "k4": ["policy.options=4"]}
    for arm, sets in parse_defines(args.define).items():
        arms[arm] = ["policy.options=1", *sets]
        NAMES[arm] = f"zclaw {arm}"
    unknown = [v for v in variants if v not in NAMES]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(NAMES)} and the names "
                         "given with --define")
    tasks = args.tasks.split(",")
    caps = parse_caps(args.cap, tasks)
    sf_skip = sf_missing(args.sf_python) if "sf" in variants and set(tasks) & set(SF_TASKS) else None
    results: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    for task in tasks:
        if task not in TASKS:
            raise SystemExit(f"--tasks: unknown task {task!r}; known: {', '.join(TASKS)}")
        results[task] = {}
        for variant in variants:
            name = NAMES[variant]
            if variant == "sf" and (task not in SF_TASKS or sf_skip):
                why = sf_skip or f"only on {', '.join(SF_TASKS)}"
                print(f"[bench] {task} {name}: skipped ({why})", flush=True)
                continue
            runs = []
            for seed in range(args.seeds):
                cap = caps[task]
                print(f"[bench] {task} {name} seed {seed} (cap {cap:.0f} s)", flush=True)
                if variant == "sb3":
                    r = run_sb3(task, seed, cap, out)
                elif variant == "sf":
                    r = run_sf(task, seed, cap, out, args.sf_python)
                else:
                    r = run_zclaw(task, variant, arms[variant], seed, cap, out, args.eval_episodes)
                print(f"[bench]   time to threshold {r['time']}, final {r['final']}", flush=True)
                runs.append(r)
            results[task][name] = runs
            # after every variant: what is done so far survives an interrupted invocation
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
            if args.md:
                Path(args.md).write_text(table(results, caps, args.seeds) + "\n")
    print(table(results, caps, args.seeds))


if __name__ == "__main__":
    main()
