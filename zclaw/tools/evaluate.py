"""``zclaw eval RUN_OR_CHECKPOINT``: the teacher (option policy) and the distilled student on M episodes.

Both act deterministically: the teacher with ``OptionPolicy.act(..., deterministic=True)`` (mean
action of the option in effect; call-and-return with "terminate when beta > 1/2" and the master's
arg-max option), the student with ``OptionPolicy.student_act(obs)`` (its mean). Actions are clipped to
the env's bounds, as a worker clips them.

Episodes are unbiased by length: M episodes run as rounds of N = min(M, 16) envs, env i of round r
seeded ``seed + r * N + i``, and each env contributes its *first* episode of the round only (taking
the first M episodes to finish would favour short ones). Teacher and student see the same seeds.

Reported per policy: return (mean, std, min, max), episode length, success rate (None where the env
reports no success), and for the teacher the options: each option's usage share of steps, its mean
duration (steps from a pick to the next pick or the episode's end) and picks per episode.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..policy.networks import OptionPolicy, PolicyConfig

MAX_ENVS = 16


def load_policy(path: Path) -> Tuple[OptionPolicy, Dict[str, Any]]:
    """The policy of a run directory (its latest checkpoint), a checkpoints folder, or one ``.pt`` file."""
    from ..learner import checkpoint as ckpt

    path = Path(path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    state = ckpt.load(path)  # CheckpointError with a message naming the path
    model = OptionPolicy(PolicyConfig.from_dict(state["policy"]))
    model.load_state_dict(state["model"])
    model.eval()
    return model, state


def action_bounds(spec: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The env spec's action bounds as float32 tensors (every tool clips to them the same way)."""
    return (torch.tensor(spec["action_low"], dtype=torch.float32),
            torch.tensor(spec["action_high"], dtype=torch.float32))


class Episode:
    """Steps of one episode as the teacher ran it: options and picks, for usage and durations."""

    def __init__(self) -> None:
        self.options: List[int] = []
        self.starts: List[bool] = []

    def durations(self) -> List[Tuple[int, int]]:
        """(option, steps) for every stretch from a pick to the next pick or the episode's end."""
        out: List[Tuple[int, int]] = []
        for o, s in zip(self.options, self.starts):
            if s or not out:
                out.append((o, 1))
            else:
                out[-1] = (out[-1][0], out[-1][1] + 1)
        return out


def run_episodes(
    model: OptionPolicy, spec: Dict[str, Any], env_id: str, episodes: int, seed: int, who: str,
    tick: Callable[[int], None] = lambda n: None,
) -> Dict[str, Any]:
    """Run ``episodes`` episodes of ``who`` ("teacher" or "student"); return the figures (module doc)."""
    from ..envs.registry import make_env

    if who not in ("teacher", "student"):
        raise ValueError(f"who = {who!r} is not allowed: expected 'teacher' or 'student'")
    low, high = action_bounds(spec)
    n_envs = max(1, min(episodes, MAX_ENVS))
    env = make_env(env_id, n_envs, seed, torch.device("cpu"))
    stats: List[Dict[str, Any]] = []
    runs: List[Episode] = []
    try:
        rnd = 0
        while len(stats) < episodes:
            want = min(n_envs, episodes - len(stats))
            obs = env.reset(seed=seed + rnd * n_envs)
            rnd += 1
            prev = torch.zeros(n_envs, dtype=torch.long)
            start = torch.ones(n_envs, dtype=torch.bool)
            done: Dict[int, Dict[str, Any]] = {}
            eps = [Episode() for _ in range(n_envs)]
            while len(done) < want:
                with torch.no_grad():
                    if who == "teacher":
                        out = model.act(obs, prev, start, deterministic=True)
                        action, option = out["action"], out["option"]
                        for i in range(n_envs):
                            if i not in done:
                                eps[i].options.append(int(option[i]))
                                eps[i].starts.append(bool(out["option_start"][i]))
                        prev = option
                    else:
                        action = model.student_act(obs)
                action = torch.max(torch.min(action.float(), high), low)
                res = env.step(action)
                ended = (res.terminated | res.truncated).to(torch.bool)
                start = ended.clone()
                k = 0  # res.episodes lists the ended envs' stats in env order
                for i in range(n_envs):
                    if bool(ended[i]):
                        ep = res.episodes[k]
                        k += 1
                        if i < want and i not in done:
                            done[i] = ep
                            tick(1)
                obs = res.obs
            for i in range(want):
                stats.append(done[i])
                runs.append(eps[i])
    finally:
        env.close()
    return summarise(stats, runs if who == "teacher" else [], model.K)


def summarise(stats: List[Dict[str, Any]], runs: List[Episode], K: int) -> Dict[str, Any]:
    """The figures of one policy's episodes (see the module doc)."""
    rets = np.array([float(s["return"]) for s in stats])
    succ = [bool(s["success"]) for s in stats if "success" in s]
    out: Dict[str, Any] = {
        "episodes": len(stats),
        "return_mean": float(rets.mean()),
        "return_std": float(rets.std()),
        "return_min": float(rets.min()),
        "return_max": float(rets.max()),
        "length_mean": float(np.mean([s["length"] for s in stats])),
        "success_rate": (sum(succ) / len(succ)) if succ else None,
    }
    if runs:
        steps = np.zeros(K)
        durations: List[List[int]] = [[] for _ in range(K)]
        picks = 0
        for ep in runs:
            for o in ep.options:
                steps[o] += 1
            for o, d in ep.durations():
                durations[o].append(d)
                picks += 1
        total = steps.sum()
        out["options"] = {
            "usage": [float(x / total) if total else 0.0 for x in steps],
            "mean_duration": [float(np.mean(d)) if d else None for d in durations],
            "duration_mean": float(np.mean([d for ds in durations for d in ds])) if picks else None,
            "picks_per_episode": picks / len(runs),
        }
    return out


def evaluate(
    path: Path, episodes: int = 10, seed: int = 12345, env_id: Optional[str] = None,
    policies: Tuple[str, ...] = ("teacher", "student"), progress: bool = False,
    loaded: Optional[Tuple[OptionPolicy, Dict[str, Any]]] = None,
) -> Dict[str, Any]:
    """The ``zclaw eval`` report: checkpoint facts, then one figures map per policy.

    ``loaded``: what :func:`load_policy` returned for ``path``, when the caller has it already."""
    if episodes < 1:
        raise ValueError(f"--episodes = {episodes} is not allowed: expected >= 1")
    model, state = loaded if loaded is not None else load_policy(path)
    spec = dict(state["spec"])
    env_id = env_id or spec["env_id"]
    report: Dict[str, Any] = {
        "checkpoint": state.get("path"), "env": env_id, "version": state.get("version"),
        "steps_consumed": state.get("steps_consumed"), "options": model.K, "episodes": episodes, "seed": seed,
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=episodes * len(policies), unit="episode", desc="eval", dynamic_ncols=True)
    try:
        for who in policies:
            if bar is not None:
                bar.set_description(f"eval {who}")
            report[who] = run_episodes(model, spec, env_id, episodes, seed, who,
                                       tick=bar.update if bar is not None else (lambda n: None))
    finally:
        if bar is not None:
            bar.close()
    t, s = report.get("teacher"), report.get("student")
    if isinstance(t, dict) and isinstance(s, dict) and "return_mean" in t and "return_mean" in s:
        gap = s["return_mean"] - t["return_mean"]
        report["student_minus_teacher"] = gap
        report["student_within_10pct"] = abs(gap) <= 0.1 * abs(t["return_mean"]) if t["return_mean"] else None
    return report


def format_report(rep: Dict[str, Any]) -> str:
    """The human-readable table of :func:`evaluate`'s report."""
    lines = [f"zclaw eval: {rep['env']}, checkpoint {rep['checkpoint']} (version {rep['version']}, "
             f"K = {rep['options']}), {rep['episodes']} episodes, seed {rep['seed']}"]
    for who in ("teacher", "student"):
        r = rep.get(who)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"  {who:8s} {r['error']}")
            continue
        sr = "-" if r["success_rate"] is None else f"{r['success_rate']:.2f}"
        lines.append(f"  {who:8s} return {r['return_mean']:9.3f} +- {r['return_std']:.3f}  "
                     f"[{r['return_min']:.3f}, {r['return_max']:.3f}]  length "
                     f"{r['length_mean']:.1f}  success {sr}")
        o = r.get("options")
        if o:
            usage = " ".join(f"{u:.2f}" for u in o["usage"])
            dur = " ".join("-" if d is None else f"{d:.1f}" for d in o["mean_duration"])
            lines.append(f"           option usage [{usage}]  mean duration [{dur}] steps  "
                         f"picks/episode {o['picks_per_episode']:.1f}")
    if "student_minus_teacher" in rep:
        lines.append(f"  student - teacher return: {rep['student_minus_teacher']:.3f}")
    return "\n".join(lines)
