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


def _load(config: Optional[str], overrides: Sequence[str], extra: Sequence[str] = ()) -> Dict[str, Dict[str, Any]]:
    try:
        return config_mod.load(config, list(overrides) + list(extra))
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
    extra = []
    if env is not None:
        extra.append(f'run.env="{env}"')
    if envs is not None:
        extra.append(f"worker.envs={envs}")
    if gpu is not None:
        extra.append(f"worker.gpu={gpu}")
    cfg = _load(config, overrides, extra)
    from .logs import setup
    from .worker.worker import main as worker_main

    log = setup("worker", cfg["log"]["level"], cfg["log"]["format"])
    sys.exit(worker_main(cfg, log, index))


@main.group("config")
def config_group() -> None:
    """Inspect configuration."""


@config_group.command("show")
@config_options
def config_show(config: Optional[str], overrides: Sequence[str]) -> None:
    """Print the resolved config (defaults, then FILE, then --set) as TOML."""
    click.echo(config_mod.to_toml(_load(config, overrides)), nl=False)


if __name__ == "__main__":
    main()
