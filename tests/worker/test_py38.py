"""Every module a worker imports stays valid Python 3.8 (Isaac Gym Preview 4 runs only on 3.6-3.8).

The import closure is computed, not listed: a fresh interpreter imports what ``zclaw worker`` imports (the
CLI, the worker role, the env registry and the Isaac Gym adapter, which is all a 3.8 worker loads) and
reports every ``zclaw`` module it ended up with. The packages the contract names as worker-side
(``zclaw/wire``, ``zclaw/worker``, ``zclaw/envs``, ``zclaw/policy`` and the shared top-level modules) are
added whole, so a module that is imported only lazily there (a backend) is checked too. ``vermin``
checks them against 3.8: syntax, standard-library members, builtins, ``typing`` features.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Set

ROOT = Path(__file__).resolve().parents[2]
VERMIN = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]  # vermin has no __main__
ENTRY = ("zclaw.cli", "zclaw.worker.worker", "zclaw.envs.registry", "zclaw.envs.isaacgym_backend")
WORKER_SIDE = ("zclaw/wire", "zclaw/worker", "zclaw/envs", "zclaw/policy", "zclaw/config.py", "zclaw/logs.py",
               "zclaw/core.py", "zclaw/stopping.py", "zclaw/startup.py", "zclaw/security.py",
               "zclaw/__init__.py")


def worker_import_closure() -> Set[Path]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(ENTRY)!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({getattr(sys.modules[m], '__file__', None) or '' for m in list(sys.modules)"
        " if m == 'zclaw' or m.startswith('zclaw.')})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    files = {Path(f).resolve() for f in json.loads(out.stdout.strip().splitlines()[-1]) if f}
    return {f for f in files if ROOT in f.parents}


def worker_side_files() -> Set[Path]:
    files: Set[Path] = set()
    for rel in WORKER_SIDE:
        p = ROOT / rel
        files.update(p.rglob("*.py") if p.is_dir() else [p])
    return {f.resolve() for f in files}


def test_worker_import_closure_is_python38() -> None:
    closure = worker_import_closure()
    assert ROOT / "zclaw" / "worker" / "worker.py" in closure and ROOT / "zclaw" / "cli.py" in closure
    files: List[str] = sorted(str(f.relative_to(ROOT)) for f in closure | worker_side_files())
    out = subprocess.run(
        [*VERMIN, "--target=3.8-", "--violations", "--no-tips", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0 and "Target versions not met" not in report, (
        f"modules a worker imports must stay valid Python 3.8 (vermin --target=3.8- --violations):\n{report}"
    )


def test_vermin_catches_a_39_feature(tmp_path: Path) -> None:
    """The check above can fail: vermin flags a 3.9-only member and 3.10-only syntax."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nos.waitstatus_to_exitcode(0)\nmatch 1:\n    case _:\n        pass\n")
    out = subprocess.run([*VERMIN, "--target=3.8-", "--violations", "--no-tips", str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "waitstatus_to_exitcode" in out.stdout
