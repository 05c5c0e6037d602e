"""``zclaw learner --nproc N``: N data-parallel learner ranks on this machine, started and watched.

It does for one machine what ``torchrun --nproc-per-node N`` does, without torchrun's agent: rank r is
``python -m zclaw.cli learner ARGS`` (the launcher's own arguments, without ``--nproc``) with ``RANK`` =
``LOCAL_RANK`` = r, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = N, ``MASTER_ADDR`` = 127.0.0.1 and
``MASTER_PORT`` (the environment's, or a free port) set; zclaw/learner/distributed.py makes a process group of
them. On several machines start the ranks with torchrun instead (docs/cluster.md).

Supervision, so that a group never half-lives (a rank alone waits for the others in its next collective):

* a rank that exits while others run (a crash, SIGKILL, a refusal) stops the others: SIGTERM, then SIGKILL
  at ``run.stop_grace_s`` (a rank blocked in a collective with a dead one fails at once anyway: gloo sees its
  connections close);
* SIGINT or SIGTERM to the launcher goes to every rank: a clean stop (the ranks vote to stop together and
  rank 0 writes the final checkpoint), SIGKILL at the same grace; a second signal kills every rank at once;
* every rank has ``PR_SET_PDEATHSIG``: a SIGKILLed launcher still leaves no rank behind.

Exit code: 0 when every rank exited 0, else the first failure seen (a rank killed by a signal counts as
:data:`~zclaw.stopping.EXIT_FAILED`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from ..launch import _set_pdeathsig, free_port
from ..stopping import EXIT_FAILED, EXIT_OK, StopSignals

#: how often the launcher looks at its ranks (a dead rank's peers are told within this)
POLL_S = 0.1


def rank_argv(config: Optional[str], overrides: Sequence[str], run_dir: str, resume: bool,
              insecure: Optional[bool]) -> List[str]:
    """One rank's command line: ``zclaw learner`` with the launcher's options, without ``--nproc``."""
    argv = [sys.executable, "-m", "zclaw.cli", "learner", "--run-dir", str(run_dir)]
    if config:
        argv += ["--config", str(config)]
    for o in overrides:
        argv += ["--set", o]
    if resume:
        argv.append("--resume")
    if insecure:
        argv.append("--insecure")
    return argv


def rank_env(rank: int, size: int, port: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of rank ``rank`` of ``size`` on this machine (torchrun's variables)."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def run(argv: List[str], nproc: int, grace_s: float, log: Any) -> int:
    """Start ``nproc`` ranks running ``argv`` and watch them until every one has exited; the exit code."""
    port = int(os.environ.get("MASTER_PORT") or free_port())
    procs: List[subprocess.Popen] = []

    def kill_all() -> None:  # a second signal: no more waiting
        for p in procs:
            if p.poll() is None:
                p.kill()

    first_failure: Optional[int] = None
    with StopSignals(on_repeat=kill_all) as signals:
        for r in range(nproc):
            procs.append(subprocess.Popen(
                argv, env=rank_env(r, nproc, port), stdin=subprocess.DEVNULL,
                preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None))
        log.info("learner ranks started", ranks=nproc, pids=[p.pid for p in procs],
                 master=f"127.0.0.1:{port}")
        deadline: Optional[float] = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            for r, c in enumerate(codes):
                if c is not None and c != EXIT_OK and first_failure is None:
                    first_failure = c if c > 0 else EXIT_FAILED
                    log.error("learner rank failed", rank=r, pid=procs[r].pid, exit_code=c)
            ended = any(c is not None for c in codes)
            if deadline is None and (ended or signals.stop.is_set()):
                why = "a rank exited" if ended else f"{signals.name or 'stop'} received"
                log.info("stopping the learner ranks", why=why, grace_s=grace_s)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                log.error("learner ranks still running after the grace period: killed", grace_s=grace_s)
                kill_all()
                deadline = float("inf")
            if deadline is None:
                signals.stop.wait(POLL_S)  # wakes at once on a signal
            else:
                time.sleep(POLL_S)
    codes = [p.wait() for p in procs]
    for r, c in enumerate(codes):  # what exited in the last poll
        if c != EXIT_OK and first_failure is None:
            first_failure = c if c > 0 else EXIT_FAILED
    log.info("learner ranks stopped", exit_codes=codes)
    return EXIT_OK if first_failure is None else first_failure
