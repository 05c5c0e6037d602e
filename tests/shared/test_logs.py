"""Log lines stay whole when several processes write one file (data-parallel ranks under one launcher)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WRITER = """
import sys
from zclaw import logs
log = logs.setup("learner", stream=sys.stderr)
for i in range(int(sys.argv[1])):
    log.info("resumed", checkpoint="/run/checkpoints/latest.pt" * 8, step=i)
"""


def test_processes_sharing_an_unbuffered_log_file_never_splice_lines(tmp_path: Path) -> None:
    """``zclaw train`` runs its roles unbuffered (PYTHONUNBUFFERED), so a line written in two pieces (the
    message, then its newline) can take another process's line between them: every line must parse."""
    path = tmp_path / "shared.log"
    lines, procs = 3000, 4
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(path, "ab") as f:  # as the launcher opens a role's log: append mode, shared by the ranks
        running = [subprocess.Popen([sys.executable, "-c", WRITER, str(lines)], stderr=f, env=env)
                   for _ in range(procs)]
        assert all(p.wait(120) == 0 for p in running)
    text = path.read_text().splitlines()
    assert len(text) == lines * procs
    assert all(json.loads(line)["event"] == "resumed" for line in text)
