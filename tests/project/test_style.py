"""flake8 in the suite: setup.cfg's line limit and pyflakes checks are enforced, not just stated. And the
tests' own layout: no test module imports another (what they share is in tests/support)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def test_flake8_finds_nothing_in_zclaw_bench_and_tests() -> None:
    out = subprocess.run([sys.executable, "-m", "flake8", "zclaw", "bench", "tests"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"flake8 (settings in setup.cfg's [flake8]):\n{out.stdout}{out.stderr}"


def imports_of_test_modules(root: Path) -> List[str]:
    """``file:line: module`` for every import of a test module (``test_*``) in the Python files under
    ``root``, at any depth in the file (a function-level import counts too)."""
    found: List[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/support, never in a test module: importing
    one runs its module-level code and fixtures under another module's name, and ties the two together."""
    found = imports_of_test_modules(TESTS)
    assert not found, "import these from tests/support instead:\n" + "\n".join(found)


def test_the_import_check_sees_every_form(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("import os\nfrom support.procs import ZCLAW\nimport synthetic\n")
    (tmp_path / "test_b.py").write_text("def f():\n    from test_a import x\n    import test_c.d as e\n")
    (tmp_path / "conftest.py").write_text("import test_a\n")
    assert imports_of_test_modules(tmp_path) == ["conftest.py:1: test_a", "test_b.py:2: test_a",
                                                 "test_b.py:3: test_c.d"]


def test_every_test_module_sits_in_a_group_the_readme_names() -> None:
    """A newcomer finds a thing's tests by folder: each test module is in one of the groups tests/README.md
    lists, and every group listed exists."""
    readme = (TESTS / "README.md").read_text()
    groups = {line.split("`")[1].rstrip("/") for line in readme.splitlines() if line.startswith("| `")}
    placed = {p.parent.name for p in TESTS.rglob("test_*.py")}
    loose = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                   if p.parent.name not in groups or p.parent.parent != TESTS)
    assert not loose, f"test modules outside the groups of tests/README.md ({sorted(groups)}): {loose}"
    assert groups <= placed, f"groups named in tests/README.md with no tests: {sorted(groups - placed)}"
