"""The ``zclaw`` command line: one sub-command per role, ``train`` for the one-machine run, and tools."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import click

from . import __version__
from . import config as config_mod

_CONFIG_HELP = "TOML config file (defaults: configs/default.toml values built into zclaw)."
_SET_HELP = "Override one key, e.g. --set learner.lr=1e-3 (repeatable)."


def _load(
    config: Optional[str], overrides: Sequence[str], values: Optional[Dict[str, Any]] = None
) -> Dict[str, Dict[str, Any]]:
    """Resolve the config; flags given on the command line (``values``, None = not given) win over --set."""
    try:
        return config_mod.load(config, overrides, {k: v for k, v in (values or {}).items() if v is not None})
    except config_mod.ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def config_options(fn: Any) -> Any:
    fn = click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help=_SET_HELP)(fn)
    fn = click.option("--config", "config", type=click.Path(dir_okay=False), default=None, help=_CONFIG_HELP)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="zclaw")
def main() -> None:
    """zclaw: distributed asynchronous RL for robot arms, with option policies.

    Start `zclaw train` for a one-machine run, or the three roles (`broker`, `learner`, `worker`) by hand on any
    hosts; every role reads the same config file.
    """


@main.command()
@config_options
@click.option("--run-dir", type=click.Path(file_okay=False), default=None, help="Where to write broker snapshots.")
def broker(config: Optional[str], overrides: Sequence[str], run_dir: Optional[str]) -> None:
    """Run the broker: PULL segments from workers into the store, serve batches and status (ROUTER)."""
    cfg = _load(config, overrides)
    from .logs import setup
    from .broker.server import main as broker_main

    log = setup("broker", cfg["log"]["level"], cfg["log"]["format"])
    sys.exit(broker_main(cfg, log, Path(run_dir) if run_dir else None))


@main.command()
@config_options
@click.option("--run-dir", type=click.Path(file_okay=False), required=True, help="Checkpoints and TensorBoard go here.")
@click.option("--resume", is_flag=True, help="Continue from RUN_DIR's latest checkpoint (version counter continues).")
def learner(config: Optional[str], overrides: Sequence[str], run_dir: str, resume: bool) -> None:
    """Run the learner: request batches (Lazy Pirate), train, publish versioned weights (PUB + Clone snapshot)."""
    cfg = _load(config, overrides)
    from .logs import setup
    from .learner.server import main as learner_main

    log = setup("learner", cfg["log"]["level"], cfg["log"]["format"])
    sys.exit(learner_main(cfg, log, Path(run_dir), resume))


@main.command()
@config_options
@click.option("--env", default=None, help="Env id with backend prefix, e.g. gym:Reacher-v5 (run.env).")
@click.option("--envs", type=int, default=None, help="Environments in this worker (worker.envs).")
@click.option("--gpu", type=int, default=None, help="Inference on cuda:N; -1 for CPU (worker.gpu).")
@click.option("--index", type=int, default=0, show_default=True, help="Worker index: seeds and identity.")
def worker(
    config: Optional[str], overrides: Sequence[str], env: Optional[str], envs: Optional[int], gpu: Optional[int],
    index: int,
) -> None:
    """Run a worker: step envs with the newest weights, PUSH segments to the broker."""
    cfg = _load(config, overrides, {"run.env": env, "worker.envs": envs, "worker.gpu": gpu})
    from .logs import setup
    from .worker.worker import main as worker_main

    log = setup("worker", cfg["log"]["level"], cfg["log"]["format"])
    sys.exit(worker_main(cfg, log, index))


@main.command()
@config_options
@click.option("--env", default=None, help="Env id with backend prefix (run.env), e.g. gym:Pusher-v5.")
@click.option("--steps", type=int, default=None, help="Stop after this many env steps (run.steps; 0: no limit).")
@click.option("--time", "time_s", type=float, default=None, help="Stop after this many seconds (run.time).")
@click.option("--workers", type=int, default=None, help="Worker processes (run.workers).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (run.run_dir; default runs/<start time>).")
@click.option("--resume", is_flag=True,
              help="Continue the run in --run-dir from its latest checkpoint, with its config unless --config is given.")
def train(
    config: Optional[str], overrides: Sequence[str], env: Optional[str], steps: Optional[int],
    time_s: Optional[float], workers: Optional[int], run_dir: Optional[str], resume: bool,
) -> None:
    """Train on one machine: broker, learner and workers as separate processes on loopback.

    Shows a progress bar (env steps, steps/s, mean return, policy lag), stops at --steps or --time, prints a
    summary and leaves RUN_DIR with the resolved config, one log per role, checkpoints, TensorBoard events and
    summary.json. Ctrl-C stops every process.
    """
    from .launch import resolve_run_dir, train as run_train

    if resume:
        if run_dir is None:
            raise click.UsageError("--resume needs --run-dir DIR (the run to continue)")
        if config is None and (Path(run_dir) / "config.toml").exists():
            config = str(Path(run_dir) / "config.toml")
    cfg = _load(config, overrides, {"run.env": env, "run.steps": steps, "run.time": time_s,
                                    "run.workers": workers, "run.run_dir": run_dir})
    if not cfg["run"]["steps"] and not cfg["run"]["time"]:
        raise click.UsageError("give a stopping point: --steps N or --time SECONDS (run.steps / run.time)")
    sys.exit(run_train(cfg, resolve_run_dir(cfg["run"]["run_dir"]), resume=resume, echo=click.echo))


@main.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("show")
@config_options
def config_show(config: Optional[str], overrides: Sequence[str]) -> None:
    """Print the resolved config (defaults, then FILE, then --set) as TOML."""
    click.echo(config_mod.to_toml(_load(config, overrides)), nl=False)


@config_group.command("docs")
def config_docs() -> None:
    """Print the configuration reference (docs/configuration.md) generated from the schema."""
    click.echo(config_mod.reference_markdown())


if __name__ == "__main__":
    main()
