"""flake8 in the suite: setup.cfg's line limit and pyflakes checks are enforced, not just stated."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_flake8_finds_nothing_in_zclaw_bench_and_tests() -> None:
    out = subprocess.run([sys.executable, "-m", "flake8", "zclaw", "bench", "tests"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"flake8 (settings in setup.cfg's [flake8]):\n{out.stdout}{out.stderr}"
