"""The command line: every command explains itself, and bad input fails before anything starts."""
from __future__ import annotations

import subprocess

import pytest
from support.procs import ZCLAW


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(ZCLAW + list(args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["train"], ["broker"], ["learner"], ["worker"], ["config", "show"]])
def test_help_explains_each_command(cmd: list) -> None:
    out = run(*cmd, "--help")
    assert out.returncode == 0
    assert "Usage:" in out.stdout and "--help" in out.stdout
    if cmd:
        assert "--config" in out.stdout and "--set" in out.stdout


@pytest.mark.parametrize("role", ["broker", "worker", "train"])
def test_bad_config_value_names_the_key_and_exits_2(role: str) -> None:
    out = run(role, "--set", "broker.mode=lifo", *(["--run-dir", "/nonexistent"] if role == "train" else []))
    assert out.returncode == 2
    assert ("broker.mode = 'lifo' is not allowed: expected one of 'queue', 'uniform', 'prioritized'"
            in out.stderr)


def test_train_needs_a_stopping_point() -> None:
    out = run("train", "--set", "run.steps=0")
    assert out.returncode == 2 and "--steps N or --time SECONDS" in out.stderr


def test_resume_needs_a_checkpoint(tmp_path) -> None:
    out = run("train", "--run-dir", str(tmp_path / "empty"), "--resume", "--time", "5")
    assert out.returncode == 2 and "no checkpoint" in out.stdout


def test_config_show_prints_resolved_toml() -> None:
    out = run("config", "show", "--config", "configs/pusher.toml", "--set", "learner.lr=0.001")
    assert out.returncode == 0
    assert 'env = "gym:Pusher-v5"' in out.stdout and "lr = 0.001" in out.stdout
