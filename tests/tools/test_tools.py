"""The tools on a short real run: the run's records, TensorBoard, `zclaw plot`,
`zclaw eval`, `zclaw export`."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from support.procs import FAST, ZCLAW
from zclaw.tools import plot as plot_mod
from zclaw.tools.evaluate import load_policy


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20-second `zclaw train` run (start-up included) on Reacher with K = 2 options and a metrics line
    every second."""
    run = tmp_path_factory.mktemp("tools") / "run"
    out = subprocess.run(
        ZCLAW + ["train", "--run-dir", str(run), "--time", "20", "--set", "policy.options=2",
                 "--set", "log.metrics_s=1"] + FAST, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    return run


def records(run: Path) -> list:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_metrics_record_has_every_role(run_dir: Path) -> None:
    lines = records(run_dir)
    assert len(lines) >= 5
    last = lines[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert last["version"] == summary["version"]  # the final line is written at the learner's exit
    steps = [d["env_steps"] for d in lines if d["env_steps"] is not None]
    assert steps == sorted(steps) and steps[-1] > 0
    assert last["return_mean_100"] is not None and last["lag_mean"] is not None
    assert len(last["options"]["usage"]) == 2
    assert last["broker"]["insert_rate"] > 0 and sum(last["broker"]["lag_hist"].values()) > 0
    assert last["workers"] and all(w["rate"] is not None for w in last["workers"].values())


def test_tensorboard_has_returns_lag_throughput_per_role(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("episode/return", "episode/return_mean_100", "lag/mean", "lag/max",
                "throughput/env_steps_per_s", "throughput/updates_per_s",
                "throughput/broker_insert_steps_per_s", "throughput/broker_sample_segments_per_s",
                "broker/fill"):
        assert tag in tags, (tag, sorted(tags))
    assert any(t.startswith("throughput/worker/") for t in tags)
    assert any(t.startswith("lag/share/") for t in tags)
    assert any("loss" in t for t in tags)


def test_plot_figures_hold_the_recorded_series(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "second"
    other.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", other / "metrics.jsonl")
    runs = [plot_mod.read_run(run_dir), plot_mod.read_run(other)]
    figs = plot_mod.figures(runs)
    assert set(figs) == {"returns", "options", "lag"}

    lines = [d for d in records(run_dir) if d["env_steps"] is not None]
    want_x = [float(d["env_steps"]) for d in lines if d["return_mean_100"] is not None]
    want_y = [d["return_mean_100"] for d in lines if d["return_mean_100"] is not None]
    ax_steps, ax_wall = figs["returns"].axes[:2]
    assert ax_steps.get_xlabel() == "env steps" and ax_wall.get_xlabel() == "wall time (s)"
    assert "return" in ax_steps.get_ylabel()
    assert [ln.get_label() for ln in ax_steps.lines] == ["run", "second"]  # two runs overlaid
    assert list(ax_steps.lines[0].get_xdata()) == want_x
    assert list(ax_steps.lines[0].get_ydata()) == pytest.approx(want_y)
    walls = list(ax_wall.lines[0].get_xdata())
    assert walls == sorted(walls) and walls[-1] > 5

    opt_axes = figs["options"].axes
    assert len(opt_axes) == 2 and [ln.get_label() for ln in opt_axes[0].lines] == ["option 0", "option 1"]
    u0, u1 = (list(ln.get_ydata()) for ln in opt_axes[0].lines)
    assert all(abs(a + b - 1) < 1e-6 for a, b in zip(u0, u1))  # usage shares of K = 2 add up to 1

    lag_ax = figs["lag"].axes[0]
    assert lag_ax.get_ylabel() == "lag (versions)" and len(lag_ax.lines) == 4  # mean and max of two runs

    out = subprocess.run(ZCLAW + ["plot", str(run_dir), str(other), "--out", str(tmp_path / "png")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from PIL import Image

    for name in ("returns", "options", "lag"):
        with Image.open(tmp_path / "png" / f"{name}.png") as img:
            assert img.format == "PNG" and img.size[0] > 300


def test_plot_refuses_a_directory_without_records(tmp_path: Path) -> None:
    out = subprocess.run(ZCLAW + ["plot", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no metrics.jsonl" in out.stderr


def test_plot_joins_a_resumed_run_into_one_curve() -> None:
    assert plot_mod._monotone([0.0, 5.0, 10.0, 2.0, 4.0]) == [0.0, 5.0, 10.0, 12.0, 14.0]


def test_eval_json_reports_teacher_student_and_options(run_dir: Path) -> None:
    out = subprocess.run(ZCLAW + ["eval", str(run_dir), "--episodes", "4", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert rep["version"] == summary["version"] and rep["env"] == "gym:Reacher-v5" and rep["options"] == 2
    for who in ("teacher", "student"):
        r = rep[who]
        assert r["episodes"] == 4 and r["length_mean"] == 50.0  # Reacher-v5 truncates at 50 steps
        assert r["return_min"] <= r["return_mean"] <= r["return_max"] < 0
        assert r["success_rate"] is None  # Reacher reports no success
    o = rep["teacher"]["options"]
    assert len(o["usage"]) == 2 and abs(sum(o["usage"]) - 1) < 1e-9
    assert o["picks_per_episode"] >= 1 and o["duration_mean"] >= 1
    assert abs(o["duration_mean"] * o["picks_per_episode"] - 50) < 1e-6  # the stretches cover each episode
    assert rep["student_minus_teacher"] == pytest.approx(rep["student"]["return_mean"]
                                                         - rep["teacher"]["return_mean"])

    # the same seeds give the same teacher figures (deterministic acting)
    again = json.loads(subprocess.run(ZCLAW + ["eval", str(run_dir), "-n", "4", "--json",
                                               "--policy", "teacher"],
                                      capture_output=True, text=True, timeout=120).stdout)
    assert again["teacher"]["return_mean"] == pytest.approx(rep["teacher"]["return_mean"])
    assert "student" not in again


def test_export_round_trip_equals_student_act(run_dir: Path, tmp_path: Path) -> None:
    out_path = tmp_path / "student.pt"
    out = subprocess.run(ZCLAW + ["export", str(run_dir), str(out_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    model, state = load_policy(run_dir)
    exported = torch.jit.load(str(out_path))
    obs = torch.randn(33, model.cfg.obs_dim) * 2
    low, high = torch.tensor(state["spec"]["action_low"]), torch.tensor(state["spec"]["action_high"])
    with torch.no_grad():
        want = torch.max(torch.min(model.student_act(obs).float(), high), low)
        got = exported(obs)
    assert got.shape == (33, model.cfg.act_dim)
    assert torch.allclose(got, want, atol=1e-6)
    # the normaliser is inside: shifting the raw input changes the output the same way as for the student
    with torch.no_grad():
        assert torch.allclose(exported(obs + 5), torch.max(torch.min(model.student_act(obs + 5), high), low),
                              atol=1e-6)

    from zclaw.tools.export import read_meta

    meta = read_meta(out_path)
    assert meta["env_id"] == "gym:Reacher-v5" and meta["version"] == state["version"] and meta["clip"] is True

    raw = tmp_path / "raw.pt"
    assert subprocess.run(ZCLAW + ["export", str(run_dir), str(raw), "--no-clip"], capture_output=True,
                          timeout=120).returncode == 0
    with torch.no_grad():
        assert torch.allclose(torch.jit.load(str(raw))(obs * 50), model.student_act(obs * 50), atol=1e-6)


def test_export_of_a_missing_checkpoint_fails_clearly(tmp_path: Path) -> None:
    out = subprocess.run(ZCLAW + ["export", str(tmp_path), str(tmp_path / "x.pt")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "no checkpoint" in out.stderr


def test_the_quickstart_example_runs_the_exported_student(run_dir: Path, tmp_path: Path) -> None:
    """The ten-line example in docs/quickstart.md, run as written against a fresh export."""
    import re

    out_path = tmp_path / "student.pt"
    assert subprocess.run(ZCLAW + ["export", str(run_dir), str(out_path)], capture_output=True,
                          timeout=120).returncode == 0
    text = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "torch.jit.load" in b]
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 10
    scope: dict = {}
    exec(compile(code.replace('"student.pt"', repr(str(out_path))), "quickstart.md", "exec"), scope)
    assert scope["action"].shape == (2,) and abs(scope["action"]).max() <= 1.0


def test_plot_falls_back_to_tensorboard_events(run_dir: Path, tmp_path: Path) -> None:
    tb_only = tmp_path / "tb_only"
    shutil.copytree(run_dir / "tb", tb_only / "tb")
    run = plot_mod.read_run(tb_only)
    assert run.source.endswith("tb") and run.env_steps == sorted(run.env_steps) and len(run.env_steps) > 3
    assert run.has("return") and run.has("lag_mean") and not run.wall_s
    figs = plot_mod.figures([run])
    assert figs["returns"].axes[0].lines and not figs["returns"].axes[1].lines  # no wall time in TB scalars
