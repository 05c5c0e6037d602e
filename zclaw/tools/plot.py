"""``zclaw plot RUN_DIR [RUN_DIR...]``: PNG figures of runs, from their own records.

The record is ``RUN_DIR/metrics.jsonl``, one JSON line every ``log.metrics_s`` written by the learner
(its report plus the broker's, see :meth:`zclaw.learner.server.Learner.write_metrics`). A run without
it (``log.metrics_s = 0``) is read from its TensorBoard events instead (``episode/return_mean_100``,
``lag/mean``, ``lag/max``, against the learner's env steps; no wall time, no option usage there).

Env steps and wall time restart from 0 when a run is resumed (new broker, new learner process); the
reader makes both monotone by adding the value reached before the restart, so a resumed run is one curve.

Figures (each a PNG in the output directory, each run a labelled series):

* ``returns.png``: mean return of the last 100 episodes against env steps and against wall time;
  with a second row for the success rate when any run reports one.
* ``options.png``: per run, each option's usage share over env steps (runs whose learner reports
  ``options`` with a ``usage`` list; K = 1 runs have a single option at 100 %).
* ``lag.png``: mean and max policy lag (versions) of the trained batches against env steps.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

METRICS = "metrics.jsonl"


class Run:
    """The series of one run directory, aligned on its record lines."""

    def __init__(self, path: Path, label: str) -> None:
        self.path = path
        self.label = label
        self.env_steps: List[float] = []
        self.wall_s: List[float] = []
        self.series: Dict[str, List[Optional[float]]] = {}
        self.option_usage: List[Optional[List[float]]] = []
        self.source = ""

    def add(self, name: str, value: Any) -> None:
        self.series.setdefault(name, [None] * (len(self.env_steps) - 1)).append(
            float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None)

    def pad(self) -> None:
        for v in self.series.values():
            v.extend([None] * (len(self.env_steps) - len(v)))

    def has(self, name: str) -> bool:
        return any(v is not None for v in self.series.get(name, []))


def _monotone(values: List[float]) -> List[float]:
    """Undo restarts from 0: when a value drops, add what was reached before it."""
    out, offset, prev = [], 0.0, None
    for v in values:
        if prev is not None and v < prev:
            offset += prev
        out.append(v + offset)
        prev = v
    return out


def _usage(options: Any) -> Optional[List[float]]:
    if isinstance(options, dict):
        u = options.get("usage", options.get("usage_share"))
        if isinstance(u, list) and all(isinstance(x, (int, float)) for x in u):
            return [float(x) for x in u]
        if isinstance(u, dict):
            return [float(u[k]) for k in sorted(u, key=lambda s: int(s) if str(s).isdigit() else str(s))]
    return None


def read_run(path: Path, label: Optional[str] = None) -> Run:
    """Load one run directory (``metrics.jsonl``, else TensorBoard events); ValueError if it has neither."""
    path = Path(path)
    run = Run(path, label or path.name)
    metrics = path / METRICS
    if metrics.is_file():
        run.source = str(metrics)
        steps, walls = [], []
        lines = []
        for line in metrics.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue  # a blank line, or one cut by a crash mid-write
        # collected env steps (the broker's count) where the broker answered; the learner's count otherwise
        key = ("env_steps" if any(isinstance(d.get("env_steps"), (int, float)) for d in lines)
               else "steps_consumed")
        for d in lines:
            x = d.get(key)
            if not isinstance(x, (int, float)):
                continue
            steps.append(float(x))
            walls.append(float(d.get("wall_s") or 0.0))
            run.env_steps.append(0.0)
            run.add("return", d.get("return_mean_100"))
            run.add("success", d.get("success_rate_100"))
            run.add("lag_mean", d.get("lag_mean"))
            run.add("lag_max", d.get("lag_max"))
            run.option_usage.append(_usage(d.get("options")))
        run.env_steps = _monotone(steps)
        run.wall_s = _monotone(walls)
        run.pad()
        return run
    events = sorted((path / "tb").glob("events.out.tfevents.*")) if (path / "tb").is_dir() else []
    if events:
        return _read_tb(run, path / "tb")
    raise ValueError(f"{path} has no {METRICS} and no TensorBoard events under tb/: is it a "
                     "zclaw run directory?")


def _read_tb(run: Run, tb_dir: Path) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    run.source = str(tb_dir)
    base = "episode/return_mean_100" if "episode/return_mean_100" in tags else "lag/mean"
    if base not in tags:
        raise ValueError(f"{tb_dir} has no zclaw learner scalars")
    by_step: Dict[str, Dict[int, float]] = {}
    for tag in ("episode/return_mean_100", "episode/success", "lag/mean", "lag/max"):
        if tag in tags:
            by_step[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    steps = sorted(by_step[base])
    run.env_steps = [float(s) for s in steps]
    run.wall_s = []
    for name, tag in (("return", "episode/return_mean_100"), ("success", "episode/success"),
                      ("lag_mean", "lag/mean"), ("lag_max", "lag/max")):
        run.series[name] = [by_step.get(tag, {}).get(s) for s in steps]
    run.option_usage = [None] * len(steps)
    return run


def _xy(xs: Sequence[float], ys: Sequence[Optional[float]]) -> Any:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def figures(runs: Sequence[Run]) -> Dict[str, Any]:
    """Build the matplotlib figures (name -> Figure); nothing is written (tests inspect them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: Dict[str, Any] = {}
    success = any(r.has("success") for r in runs)
    rows = 2 if success else 1
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    for r in runs:
        axes[0][0].plot(*_xy(r.env_steps, r.series.get("return", [])), label=r.label)
        if r.wall_s:
            axes[0][1].plot(*_xy(r.wall_s, r.series.get("return", [])), label=r.label)
        if success:
            axes[1][0].plot(*_xy(r.env_steps, r.series.get("success", [])), label=r.label)
            if r.wall_s:
                axes[1][1].plot(*_xy(r.wall_s, r.series.get("success", [])), label=r.label)
    for row, what in enumerate(["mean return (last 100 episodes)",
                                "success rate (last 100 episodes)"][:rows]):
        for col, xlabel in enumerate(["env steps", "wall time (s)"]):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(what)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    axes[0][0].set_title("return vs env steps")
    axes[0][1].set_title("return vs wall time")
    fig.tight_layout()
    figs["returns"] = fig

    with_options = [r for r in runs if any(u for u in r.option_usage)]
    if with_options:
        fig, axes = plt.subplots(len(with_options), 1, figsize=(8, 3.2 * len(with_options)), squeeze=False)
        for ax, r in zip(axes[:, 0], with_options):
            K = max(len(u) for u in r.option_usage if u)
            for k in range(K):
                ys = [u[k] if u and k < len(u) else None for u in r.option_usage]
                ax.plot(*_xy(r.env_steps, ys), label=f"option {k}")
            ax.set_title(f"option usage: {r.label}")
            ax.set_xlabel("env steps")
            ax.set_ylabel("usage share")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        figs["options"] = fig

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in runs:
        line, = ax.plot(*_xy(r.env_steps, r.series.get("lag_mean", [])), label=f"{r.label} mean")
        ax.plot(*_xy(r.env_steps, r.series.get("lag_max", [])), linestyle="--", color=line.get_color(),
                label=f"{r.label} max")
    ax.set_title("policy lag of trained batches")
    ax.set_xlabel("env steps")
    ax.set_ylabel("lag (versions)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    figs["lag"] = fig
    return figs


def labels_for(paths: Sequence[Path]) -> List[str]:
    """Run labels: directory names, made unique with their parent when two runs share a name."""
    names = [p.name or str(p) for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else n for p, n in zip(paths, names)]


def plot(run_dirs: Sequence[Path], out_dir: Path, dpi: int = 100) -> Dict[str, Path]:
    """Write the PNGs for ``run_dirs`` into ``out_dir``; return name -> path."""
    import matplotlib.pyplot as plt

    paths = [Path(p) for p in run_dirs]
    runs = [read_run(p, lab) for p, lab in zip(paths, labels_for(paths))]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, fig in figures(runs).items():
        path = out_dir / f"{name}.png"
        fig.savefig(str(path), dpi=dpi)
        plt.close(fig)
        written[name] = path
    return written
