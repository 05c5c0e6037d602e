"""``zclaw train``: broker, learner and W workers as separate OS processes on loopback, watched.

The launcher is not a role: it only starts processes, asks the broker and the learner for their
``status`` (the same requests ``zclaw status`` makes), draws the progress bar and writes the summary.
Children get ``PR_SET_PDEATHSIG`` so that even a SIGKILLed launcher leaves no process behind; Ctrl-C
or SIGTERM stops the workers first, then the learner (final checkpoint), then the broker.

Supervision: a role process that exits while the run goes on is started again, up to ``run.restarts``
times per role: the broker on its latest snapshot (``--run-dir`` without ``--fresh``), the learner with
``--resume`` from its latest checkpoint (plain, if it crashed before writing one), a worker as it was.
A role refused by a server (exit 3: another env spec or protocol) or unable to start as configured (exit 2:
its device, keys or checkpoint) is not restarted: that cannot help.

Stopping is bounded: from Ctrl-C, SIGTERM, or the end of the run, every role has exited within
``run.stop_grace_s`` seconds whatever it does (a wedged or stopped process is SIGKILLed at the
deadline); a second Ctrl-C or SIGTERM kills what is left at once. ``summary.json`` says why the run
stopped (``stop_reason``: time, steps, interrupted, role_failed).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import zmq

from . import config as config_mod
from .fleet import broker_shards, broker_total
from .stopping import EXIT_CANNOT_START, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, StopSignals
from .security import Security
from .startup import RUN_CLOCK_ENV
from .wire import LazyPirate, make, tcp
from .wire.sockets import CurveClient

ROLE_ORDER = ("broker", "learner", "worker")
#: shares of run.stop_grace_s: workers first (they flush a second's worth), then the learner (final
#: checkpoint); the broker has what is left (final snapshot) before everything still alive is SIGKILLed
WORKER_STOP_SHARE, LEARNER_STOP_SHARE = 0.2, 0.5
#: what summary.json's stop_reason may say
STOP_REASONS = ("time", "steps", "interrupted", "role_failed")
#: exit codes that a restart cannot mend, and what the failure line says instead of the restarts used
NOT_RESTARTED = {EXIT_REFUSED: "refused by a server", EXIT_CANNOT_START: "cannot start as configured"}


def free_port() -> int:
    """A TCP port free on loopback right now (there is a small race; fine for a one-machine run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: Ctrl-C still reaches the whole process group
        pass


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float) -> List[Optional[int]]:
    """SIGTERM every live process at once, wait up to ``timeout`` for each, SIGKILL what is
    left; exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def stop_by(procs: Sequence[subprocess.Popen], deadline: float) -> None:
    """SIGTERM every live process in ``procs``, wait until ``deadline`` (monotonic), SIGKILL what is left.

    Never waits past the deadline, whatever a process does (a SIGSTOPped one keeps its SIGTERM pending
    for ever, SIGKILL still ends it)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Child:
    """One role process and its log file; ``restart_argv`` (None: ``argv``) is what a restart runs."""

    def __init__(
        self, name: str, argv: List[str], log_path: Path,
        restart_argv: Optional[Callable[[], List[str]]] = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.restart_argv = restart_argv
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self, restart: bool = False, started: Optional[float] = None) -> None:
        """Start (or restart) the process; ``started``: the run's start on the monotonic clock, told to the
        role (:func:`zclaw.startup.run_started`)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if started is not None:
            env[RUN_CLOCK_ENV] = repr(started)
        argv = self.restart_argv() if restart and self.restart_argv is not None else self.argv
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> Optional[int]:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; return the exit code."""
        if self.proc is None:
            return None
        return stop_processes([self.proc], timeout)[0]

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class StatusClient:
    """Asks one server for its ``status`` report (a one-try Lazy Pirate, so a dead server costs a timeout)."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, timeout_ms: int = 1000, curve: Optional[CurveClient] = None
    ) -> None:
        """``curve``: the client keys when the server uses CURVE, e.g.
        ``Security.from_config(cfg, "tools").client("broker")`` (see zclaw/security.py)."""
        self.pirate = LazyPirate(ctx, endpoint, timeout_ms=timeout_ms, retries=0, curve=curve)

    def report(self) -> Optional[Dict[str, Any]]:
        msg = self.pirate.request(make("status"), kinds=("status",))
        return None if msg is None else msg.get("report")

    def wait_until(
        self, pred: Callable[[Dict[str, Any]], bool], timeout: float, interval: float = 0.2
    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Poll the report until ``pred`` holds or ``timeout`` passes; return (reached, last report)."""
        deadline, rep = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            rep = self.report()
            if rep is not None and pred(rep):
                return True, rep
            time.sleep(interval)
        return False, rep

    def close(self) -> None:
        self.pirate.close()


class ShardsStatus:
    """Every broker shard's status as one report (:func:`zclaw.fleet.broker_total`): what the progress bar
    and the summary read."""

    def __init__(self, ctx: zmq.Context, shards: List[Any], curve: Any = None) -> None:
        self.clients = [StatusClient(ctx, tcp("127.0.0.1", a.serve_port), curve=curve) for a in shards]

    def report(self) -> Optional[Dict[str, Any]]:
        return broker_total([c.report() for c in self.clients])

    def close(self) -> None:
        for c in self.clients:
            c.close()


def resolve_run_dir(pattern: str) -> Path:
    return Path(pattern.replace("{time}", time.strftime("%Y%m%d-%H%M%S")))


def prepare(cfg: Dict[str, Dict[str, Any]], run_dir: Path) -> Path:
    """Create the run directory, choose free loopback ports, write the resolved config; return its path."""
    for sub in ("logs", "checkpoints"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    net = cfg["network"]
    net["broker_host"] = net["learner_host"] = "127.0.0.1"
    for key in ("ingest_port", "serve_port", "publish_port", "learner_port"):
        net[key] = free_port()
    shards = int(cfg["run"].get("brokers", 1))
    # several brokers: shard 0 on the ports above, each other on two more (zclaw.fleet)
    net["brokers"] = ([f"127.0.0.1:{net['ingest_port']}:{net['serve_port']}"]
                      + [f"127.0.0.1:{free_port()}:{free_port()}" for _ in range(shards - 1)]
                      if shards > 1 else [])
    cfg["run"]["run_dir"] = str(run_dir)
    path = run_dir / "config.toml"
    path.write_text(config_mod.to_toml(cfg))
    return path


def session_steps(broker: Optional[Dict[str, Any]]) -> int:
    """Env steps the broker took in during this run: its count minus what a restored snapshot brought."""
    b = broker or {}
    return int(b.get("inserted_steps", 0)) - int((b.get("restored") or {}).get("inserted_steps", 0))


def summarise(
    broker: Optional[Dict[str, Any]], learner: Optional[Dict[str, Any]], wall_s: float,
    previous: Dict[str, Any], stop_reason: Optional[str] = None, stop_detail: Optional[str] = None,
    restarts: Optional[Dict[str, int]] = None,
) -> Dict[str, Any]:
    """The figures of ``summary.json`` from the last status reports of broker and learner, and why and
    how the run ended (``stop_reason``, one of :data:`STOP_REASONS`; ``restarts`` per role process)."""
    b, L = broker or {}, learner or {}
    steps = session_steps(b)
    return {
        "stop_reason": stop_reason,
        "stop_detail": stop_detail,
        "restarts": dict(restarts or {}),
        "env_steps": steps,
        "env_steps_total": steps + int(previous.get("env_steps_total", 0)),
        "wall_s": round(wall_s, 2),
        "steps_per_s": round(steps / wall_s, 1) if wall_s > 0 else 0.0,
        "updates": L.get("updates"),
        "version": L.get("version"),
        "episodes": None if b.get("episodes") is None else b["episodes"] - int((b.get("restored") or {}).get(
            "episodes", 0)),
        "return_mean_100": b.get("return_mean_100"),
        "success_rate_100": b.get("success_rate_100"),
        "lag_mean": L.get("lag_mean_all"),
        "lag_max": L.get("lag_max_all"),
        "drops": b.get("drops", {}),
        "last_checkpoint": L.get("last_checkpoint"),
    }


def format_table(summary: Dict[str, Any]) -> str:
    restarts = {k: v for k, v in (summary.get("restarts") or {}).items() if v}
    rows = [
        ("stopped because", summary.get("stop_reason") if not summary.get("stop_detail")
         else f"{summary.get('stop_reason')} ({summary['stop_detail']})"),
        ("role restarts", ", ".join(f"{k} {v}" for k, v in sorted(restarts.items())) or "none"),
        ("env steps", summary["env_steps"]), ("wall time (s)", summary["wall_s"]),
        ("env steps / s", summary["steps_per_s"]), ("learner updates", summary["updates"]),
        ("policy version", summary["version"]), ("episodes", summary["episodes"]),
        ("mean return (last 100)", summary["return_mean_100"]),
        ("success rate (last 100)", summary["success_rate_100"]),
        ("policy lag mean / max", f"{_fmt(summary['lag_mean'])} / {_fmt(summary['lag_max'])}"),
        ("dropped segments", sum(summary["drops"].values()) if summary["drops"] else 0),
        ("checkpoint", summary["last_checkpoint"]),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k.ljust(width)}  {_fmt(v)}" for k, v in rows)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def train(
    cfg: Dict[str, Dict[str, Any]], run_dir: Path, resume: bool = False, echo: Any = print,
    progress: bool = True
) -> int:
    """Run broker, learner and workers until ``run.steps`` or ``run.time``; write ``summary.json``."""
    previous: Dict[str, Any] = {}
    if resume:
        if not (run_dir / "checkpoints" / "latest.pt").exists():
            echo(f"error: --resume: no checkpoint at {run_dir / 'checkpoints' / 'latest.pt'}")
            return EXIT_CANNOT_START
        if (run_dir / "summary.json").exists():
            previous = json.loads((run_dir / "summary.json").read_text())
    config_path = prepare(cfg, run_dir)
    base = [sys.executable, "-m", "zclaw.cli"]
    common = ["--config", str(config_path)]
    logs = run_dir / "logs"
    # --resume continues the store too (its snapshot); a fresh run into an old directory starts it empty.
    # A restarted broker always restores the snapshot this run wrote.
    broker_argv = base + ["broker"] + common + ["--run-dir", str(run_dir)]
    learner_argv = base + ["learner"] + common + ["--run-dir", str(run_dir)]
    if int(cfg["run"].get("learners", 1)) > 1:  # data-parallel ranks, one launcher process supervising them
        learner_argv += ["--nproc", str(int(cfg["run"]["learners"]))]

    def learner_restart() -> List[str]:  # --resume needs a checkpoint; without one the learner starts anew
        has_ckpt = (run_dir / "checkpoints" / "latest.pt").exists()
        return learner_argv + (["--resume"] if has_ckpt else [])

    shards = broker_shards(cfg)
    children = []
    for i in range(len(shards)):  # one broker per shard ("broker" when there is one), each on its snapshot
        name = "broker" if len(shards) == 1 else f"broker{i}"
        argv = broker_argv + (["--shard", str(i)] if len(shards) > 1 else [])
        children.append(Child(name, argv + ([] if resume else ["--fresh"]), logs / f"{name}.log",
                              restart_argv=lambda argv=argv: argv))
    children.append(Child("learner", learner_argv + (["--resume"] if resume else []), logs / "learner.log",
                          restart_argv=learner_restart))
    for i in range(cfg["run"]["workers"]):
        children.append(Child(f"worker{i}", base + ["worker"] + common + ["--index", str(i)],
                              logs / f"worker{i}.log"))

    steps_goal, time_goal = cfg["run"]["steps"], cfg["run"]["time"]
    grace = float(cfg["run"]["stop_grace_s"])
    budget = int(cfg["run"]["restarts"])
    ctx = zmq.Context()
    net = cfg["network"]
    sec = Security.from_config(cfg, "tools")  # the launcher asks for status as the "tools" client
    broker_status = ShardsStatus(ctx, shards, curve=sec.client("broker"))
    learner_status = StatusClient(ctx, tcp("127.0.0.1", net["learner_port"]), curve=sec.client("learner"))

    def kill_children() -> None:
        for c in children:
            if c.alive():
                c.proc.kill()  # type: ignore[union-attr]

    # SIGTERM and SIGINT (Ctrl-C) ask for a clean stop; a second one kills what is left at once
    signals = StopSignals(on_repeat=kill_children).install()
    stop = signals.stop
    bar = None
    t0 = time.monotonic()
    b_rep: Optional[Dict[str, Any]] = None
    l_rep: Optional[Dict[str, Any]] = None
    failure: Optional[str] = None
    reason: Optional[str] = None
    detail: Optional[str] = None
    echo(f"zclaw train: {cfg['run']['env']}, {cfg['run']['workers']} worker(s) x {cfg['worker']['envs']} "
         f"envs, run dir {run_dir}")
    try:
        for c in children:
            c.start(started=t0)
        bar = _progress_bar(steps_goal, progress)
        last_line = 0.0
        while not stop.is_set():
            time.sleep(0.5)
            for c in children:
                if stop.is_set() or c.alive():
                    continue
                code = c.proc.returncode  # type: ignore[union-attr]
                # refused (another spec or protocol) or unable to start as configured (its device, keys,
                # checkpoint): the same start would fail the same way, so a restart cannot help
                if code not in NOT_RESTARTED and c.restarts < budget:
                    c.restarts += 1
                    echo(f"warning: {c.name} exited with {code}; restarting it "
                         f"({c.restarts} of {budget})\n{c.log_tail(5)}")
                    c.start(restart=True, started=t0)
                else:
                    why = NOT_RESTARTED.get(code, f"{c.restarts} restarts used")
                    failure = (f"{c.name} exited with code {code} ({why}); last lines of {c.log_path}:\n"
                               + c.log_tail())
                    reason, detail = "role_failed", f"{c.name} exited with code {code}"
                    break
            if failure or stop.is_set():
                break
            b_rep = broker_status.report() or b_rep
            l_rep = learner_status.report() or l_rep
            elapsed = time.monotonic() - t0
            steps = session_steps(b_rep)
            _update_bar(bar, steps, elapsed, b_rep, l_rep)
            if bar is None and time.monotonic() - last_line > 10:
                last_line = time.monotonic()
                echo(_progress_line(steps, elapsed, b_rep, l_rep))
            if steps_goal and steps >= steps_goal:
                reason = "steps"
                break
            if time_goal and elapsed >= time_goal:
                reason = "time"
                break
    except KeyboardInterrupt:  # a SIGINT that came before our handler was installed
        stop.set()
        signals.name = signals.name or "SIGINT"
    finally:
        if stop.is_set() and reason is None:
            reason, detail = "interrupted", signals.name
            echo(f"\ninterrupted ({signals.name}): stopping every process within {grace:g} s")
        deadline = time.monotonic() + grace
        if bar is not None:
            bar.close()
        wall = time.monotonic() - t0
        if not stop.is_set():  # the last reports, unless the user wants out now (each is one bounded try)
            b_rep = broker_status.report() or b_rep
            l_rep = learner_status.report() or l_rep
        workers = [c.proc for c in children if c.name.startswith("worker") and c.proc is not None]
        stop_by(workers, min(deadline, time.monotonic() + WORKER_STOP_SHARE * grace))
        learner = [c.proc for c in children if c.name == "learner" and c.proc is not None]
        stop_by(learner, min(deadline, time.monotonic() + LEARNER_STOP_SHARE * grace))
        final = run_dir / "learner_final.json"
        if final.exists():
            try:
                l_rep = json.loads(final.read_text()) or l_rep
            except ValueError:
                pass
        stop_by([c.proc for c in children if c.proc is not None], deadline)
        broker_status.close()
        learner_status.close()
        ctx.term()
        signals.restore()
    summary = summarise(b_rep, l_rep, wall, previous, stop_reason=reason, stop_detail=detail,
                        restarts={c.name: c.restarts for c in children})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo("\nzclaw train summary\n" + format_table(summary) + f"\n  run dir: {run_dir}")
    if failure:
        echo("error: " + failure)
        return EXIT_FAILED
    return EXIT_OK


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total or None, unit="step", unit_scale=True, dynamic_ncols=True, desc="env steps")


def _stats(b: Optional[Dict[str, Any]], L: Optional[Dict[str, Any]]) -> Dict[str, str]:
    b, L = b or {}, L or {}
    return {
        "return": _fmt(b.get("return_mean_100")),
        "lag": _fmt(L.get("lag_mean")),
        "v": _fmt(L.get("version")),
    }


def _update_bar(bar: Any, steps: int, elapsed: float, b: Any, L: Any) -> None:
    if bar is None:
        return
    bar.n = steps
    stats = _stats(b, L)
    stats["steps/s"] = f"{steps / max(elapsed, 1e-9):.0f}"
    bar.set_postfix(stats, refresh=False)
    bar.refresh()


def _progress_line(steps: int, elapsed: float, b: Any, L: Any) -> str:
    s = _stats(b, L)
    return (f"[{elapsed:6.0f}s] env steps {steps}  steps/s {steps / max(elapsed, 1e-9):.0f}  "
            f"return {s['return']}  lag {s['lag']}  version {s['v']}")
