"""``zclaw train``: broker, learner and W workers as separate OS processes on loopback, watched.

The launcher is not a role: it only starts processes, asks the broker and the learner for their
``status`` (the same requests ``zclaw status`` makes), draws the progress bar and writes the summary.
Children get ``PR_SET_PDEATHSIG`` so that even a SIGKILLed launcher leaves no process behind; Ctrl-C
or SIGTERM stops the workers first, then the learner (final checkpoint), then the broker.
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
from .stopping import EXIT_REFUSED
from .security import Security
from .wire import LazyPirate, make, tcp
from .wire.sockets import CurveClient

ROLE_ORDER = ("broker", "learner", "worker")


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


class Child:
    """One role process and its log file."""

    def __init__(self, name: str, argv: List[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
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
    previous: Dict[str, Any]
) -> Dict[str, Any]:
    """The figures of ``summary.json`` from the last status reports of broker and learner."""
    b, L = broker or {}, learner or {}
    steps = session_steps(b)
    return {
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
    rows = [
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
            return 2
        if (run_dir / "summary.json").exists():
            previous = json.loads((run_dir / "summary.json").read_text())
    config_path = prepare(cfg, run_dir)
    base = [sys.executable, "-m", "zclaw.cli"]
    common = ["--config", str(config_path)]
    logs = run_dir / "logs"
    # --resume continues the store too (its snapshot); a fresh run into an old directory starts it empty
    broker_args = ["--run-dir", str(run_dir)] + ([] if resume else ["--fresh"])
    children = [Child("broker", base + ["broker"] + common + broker_args, logs / "broker.log")]
    children.append(
        Child("learner",
              base + ["learner"] + common + ["--run-dir", str(run_dir)] + (["--resume"] if resume else []),
              logs / "learner.log")
    )
    for i in range(cfg["run"]["workers"]):
        children.append(Child(f"worker{i}", base + ["worker"] + common + ["--index", str(i)],
                              logs / f"worker{i}.log"))

    steps_goal, time_goal = cfg["run"]["steps"], cfg["run"]["time"]
    ctx = zmq.Context()
    net = cfg["network"]
    sec = Security.from_config(cfg, "tools")  # the launcher asks for status as the "tools" client
    broker_status = StatusClient(ctx, tcp("127.0.0.1", net["serve_port"]), curve=sec.client("broker"))
    learner_status = StatusClient(ctx, tcp("127.0.0.1", net["learner_port"]), curve=sec.client("learner"))
    stop = {"flag": False}
    old_term = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    bar = None
    t0 = time.monotonic()
    b_rep: Optional[Dict[str, Any]] = None
    l_rep: Optional[Dict[str, Any]] = None
    failure: Optional[str] = None
    echo(f"zclaw train: {cfg['run']['env']}, {cfg['run']['workers']} worker(s) x {cfg['worker']['envs']} "
         f"envs, run dir {run_dir}")
    try:
        for c in children:
            c.start()
        bar = _progress_bar(steps_goal, progress)
        last_line = 0.0
        while not stop["flag"]:
            time.sleep(0.5)
            for c in children:
                if not c.alive():
                    # another spec/protocol: a restart cannot help
                    refused = c.proc.returncode == EXIT_REFUSED
                    if c.name.startswith("worker") and c.restarts < 3 and not refused:
                        echo(f"warning: {c.name} exited with {c.proc.returncode}; "
                             f"restarting it\n{c.log_tail(5)}")
                        c.restarts += 1
                        c.start()
                    else:
                        failure = (f"{c.name} exited with code {c.proc.returncode}; "
                                   f"last lines of {c.log_path}:\n" + c.log_tail())
                        break
            if failure:
                break
            b_rep = broker_status.report() or b_rep
            l_rep = learner_status.report() or l_rep
            elapsed = time.monotonic() - t0
            steps = session_steps(b_rep)
            _update_bar(bar, steps, elapsed, b_rep, l_rep)
            if bar is None and time.monotonic() - last_line > 10:
                last_line = time.monotonic()
                echo(_progress_line(steps, elapsed, b_rep, l_rep))
            if (steps_goal and steps >= steps_goal) or (time_goal and elapsed >= time_goal):
                break
    except KeyboardInterrupt:
        echo("\ninterrupted: stopping every process")
    finally:
        if bar is not None:
            bar.close()
        b_rep = broker_status.report() or b_rep
        l_rep = learner_status.report() or l_rep
        wall = time.monotonic() - t0
        for c in children:
            if c.name.startswith("worker"):
                c.stop(timeout=10)
        for c in children:
            if c.name == "learner":
                c.stop(timeout=60)
        final = run_dir / "learner_final.json"
        if final.exists():
            try:
                l_rep = json.loads(final.read_text()) or l_rep
            except ValueError:
                pass
        for c in children:
            c.stop(timeout=20)
        broker_status.close()
        learner_status.close()
        ctx.term()
        signal.signal(signal.SIGTERM, old_term)
    summary = summarise(b_rep, l_rep, wall, previous)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    echo("\nzclaw train summary\n" + format_table(summary) + f"\n  run dir: {run_dir}")
    if failure:
        echo("error: " + failure)
        return 1
    return 0


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
