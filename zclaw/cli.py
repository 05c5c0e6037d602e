"""The ``zclaw`` command line: one sub-command per role, ``train`` for the one-machine run, and tools."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import click

from . import __version__
from . import config as config_mod
from .stopping import EXIT_CANNOT_START

_CONFIG_HELP = "TOML config file (defaults: configs/default.toml values built into zclaw)."
_SET_HELP = "Override one key, e.g. --set learner.lr=1e-3 (repeatable)."
_INSECURE_HELP = "Allow binding beyond loopback without CURVE keys (security.insecure); a warning is logged."


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
    fn = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                      help=_CONFIG_HELP)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="zclaw")
def main() -> None:
    """zclaw: distributed asynchronous RL for robot arms, with option policies.

    Start `zclaw train` for a one-machine run, or the three roles (`broker`, `learner`, `worker`) by hand on
    any hosts; every role reads the same config file.
    """


@main.command()
@config_options
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Store snapshots go here (RUN_DIR/snapshots); the latest is restored at start.")
@click.option("--fresh", is_flag=True, help="Start with an empty store even if RUN_DIR holds a snapshot.")
@click.option("--shard", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which entry of network.brokers this broker is: it binds that entry's ports and keeps its "
                   "own snapshot (RUN_DIR/snapshots/store-shardN.npz). Ignored without network.brokers.")
@click.option("--insecure", is_flag=True, default=None, help=_INSECURE_HELP)
def broker(
    config: Optional[str], overrides: Sequence[str], run_dir: Optional[str], fresh: bool, shard: int,
    insecure: Optional[bool]
) -> None:
    """Run the broker: PULL segments from workers into the store, serve batches and status (ROUTER).

    A run may have several brokers (shards, network.brokers): start one per entry with --shard N."""
    cfg = _load(config, overrides, {"security.insecure": insecure})
    from .broker.server import main as broker_main
    from .fleet import as_shard
    from .startup import start_process

    try:
        cfg = as_shard(cfg, shard)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--shard") from None
    log = start_process("broker", cfg)
    sys.exit(broker_main(cfg, log, Path(run_dir) if run_dir else None, restore=not fresh, shard=shard))


@main.command()
@config_options
@click.option("--run-dir", type=click.Path(file_okay=False), required=True,
              help="Checkpoints and TensorBoard go here.")
@click.option("--resume", is_flag=True,
              help="Continue from RUN_DIR's latest checkpoint (version counter continues).")
@click.option("--insecure", is_flag=True, default=None, help=_INSECURE_HELP)
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Start this many data-parallel learner ranks on this machine and watch them (one process "
                   "each; gloo on CPU, NCCL and one GPU per rank with learner.device = cuda). A rank that "
                   "dies stops the others; the exit code is non-zero then.")
def learner(
    config: Optional[str], overrides: Sequence[str], run_dir: str, resume: bool, insecure: Optional[bool],
    nproc: Optional[int],
) -> None:
    """Run the learner: request batches (Lazy Pirate), train, publish versioned weights
    (PUB + Clone snapshot).

    Data-parallel ranks (torch.distributed; docs/cluster.md): --nproc N starts N ranks here. On several
    machines start them with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT:

    \b
      torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
          -m zclaw.cli learner --config run.toml --run-dir RUN_DIR

    Each rank asks the broker for its own batches; gradients are averaged and the observation and reward
    statistics merged across the ranks, so they train one policy; rank 0 alone publishes weights, answers
    snapshots and `zclaw status`, and writes checkpoints and metrics (network.learner_host names its
    machine). --resume: rank 0 loads the checkpoint and every rank starts from it."""
    cfg = _load(config, overrides, {"security.insecure": insecure})
    from .startup import start_process

    if nproc is not None and nproc > 1:
        import os

        if os.environ.get("WORLD_SIZE") not in (None, "", "1"):
            raise click.UsageError("--nproc starts its own ranks, but this process is already a rank of a "
                                   "group (WORLD_SIZE is set, e.g. by torchrun): drop --nproc")
        from .learner.ranks import rank_argv, run as run_ranks

        log = start_process("learner", cfg)
        sys.exit(run_ranks(rank_argv(config, overrides, run_dir, resume, insecure), nproc,
                           float(cfg["run"]["stop_grace_s"]), log))
    from .learner.server import main as learner_main

    log = start_process("learner", cfg)
    sys.exit(learner_main(cfg, log, Path(run_dir), resume))


@main.command()
@config_options
@click.option("--env", default=None, help="Env id with backend prefix, e.g. gym:Reacher-v5 (run.env).")
@click.option("--envs", type=int, default=None, help="Environments in this worker (worker.envs).")
@click.option("--gpu", type=int, default=None,
              help="Inference and GPU simulation on cuda:N; -1 for CPU (worker.gpu).")
@click.option("--index", type=int, default=0, show_default=True, help="Worker index: seeds and identity.")
def worker(
    config: Optional[str], overrides: Sequence[str], env: Optional[str], envs: Optional[int],
    gpu: Optional[int], index: int,
) -> None:
    """Run a worker: step envs with the newest weights, PUSH segments to the broker."""
    cfg = _load(config, overrides, {"run.env": env, "worker.envs": envs, "worker.gpu": gpu})
    from .envs.preload import BackendUnavailable, preimport

    try:  # before torch: Isaac Gym refuses to load after it (zclaw/envs/preload.py)
        preimport(cfg["run"]["env"])
    except BackendUnavailable as exc:
        click.echo(f"zclaw worker: {exc}", err=True)
        sys.exit(EXIT_CANNOT_START)
    from .worker.worker import main as worker_main
    from .startup import start_process

    log = start_process("worker", cfg)
    sys.exit(worker_main(cfg, log, index))


@main.command()
@config_options
@click.option("--env", default=None, help="Env id with backend prefix (run.env), e.g. gym:Pusher-v5.")
@click.option("--steps", type=int, default=None,
              help="Stop after this many env steps (run.steps; 0: no limit).")
@click.option("--time", "time_s", type=float, default=None,
              help="Stop after this many seconds (run.time). Without --steps, no step limit applies: "
                   "the run lasts this long whatever run.steps says.")
@click.option("--workers", type=int, default=None, help="Worker processes (run.workers).")
@click.option("--brokers", type=int, default=None,
              help="Broker processes, each a shard of the store (run.brokers); worker i feeds shard i mod N, "
                   "the learner samples every shard.")
@click.option("--learners", type=int, default=None,
              help="Learner ranks (run.learners): zclaw learner --nproc N, data-parallel on "
                   "torch.distributed.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (run.run_dir; default runs/<start time>).")
@click.option("--resume", is_flag=True,
              help="Continue the run in --run-dir from its latest checkpoint, with its config "
                   "unless --config is given.")
@click.option("--insecure", is_flag=True, default=None,
              help=_INSECURE_HELP + " Only matters with network.bind_host.")
def train(
    config: Optional[str], overrides: Sequence[str], env: Optional[str], steps: Optional[int],
    time_s: Optional[float], workers: Optional[int], brokers: Optional[int], learners: Optional[int],
    run_dir: Optional[str], resume: bool, insecure: Optional[bool],
) -> None:
    """Train on one machine: broker, learner and workers as separate processes on loopback.

    Shows a progress bar (env steps, steps/s, mean return, policy lag), stops at --steps or --time (whichever
    comes first), prints a summary that says why the run stopped and leaves RUN_DIR with the resolved config,
    one log per role, checkpoints, TensorBoard events and summary.json.

    A role that crashes is restarted, up to run.restarts times each: the broker on its snapshot, the learner
    with --resume, workers as they were. Ctrl-C or SIGTERM stops every process within run.stop_grace_s seconds
    (what has not exited by then is killed); a second Ctrl-C kills at once.
    """
    from .launch import resolve_run_dir, train as run_train

    if resume:
        if run_dir is None:
            raise click.UsageError("--resume needs --run-dir DIR (the run to continue)")
        if config is None and (Path(run_dir) / "config.toml").exists():
            config = str(Path(run_dir) / "config.toml")
    if time_s is not None and steps is None:
        steps = 0  # --time alone means what it says: no step cap (run.steps) ends the run earlier
    cfg = _load(config, overrides, {"run.env": env, "run.steps": steps, "run.time": time_s,
                                    "run.workers": workers, "run.brokers": brokers,
                                    "run.learners": learners, "run.run_dir": run_dir,
                                    "security.insecure": insecure})
    if not cfg["run"]["steps"] and not cfg["run"]["time"]:
        raise click.UsageError("give a stopping point: --steps N or --time SECONDS (run.steps / run.time)")
    from .security import Security

    try:  # refuse before any process starts: keys that do not load, or an unprotected non-loopback bind
        Security.from_config(cfg, "broker").check_bind(cfg["network"]["bind_host"] or "127.0.0.1")
        for role, index in ([("learner", 0), ("tools", 0)]
                            + [("worker", i) for i in range(cfg["run"]["workers"])]):
            Security.from_config(cfg, role, index)
    except config_mod.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
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


@main.group("keys")
def keys_group() -> None:
    """CURVE keys for encrypted, allowlisted multi-host runs (docs/multihost.md)."""


@keys_group.command("generate")
@click.argument("keys_dir", type=click.Path(file_okay=False))
@click.option("--workers", type=int, default=2, show_default=True,
              help="Worker key pairs worker0..worker<N-1>.")
@click.option("--client", "clients", multiple=True, metavar="NAME",
              help="An extra client key pair (repeatable).")
@click.option("--force", is_flag=True,
              help="Replace keys that exist (hosts holding the old ones are locked out).")
def keys_generate(keys_dir: str, workers: int, clients: Sequence[str], force: bool) -> None:
    """Make key pairs for broker, learner, tools, the workers and extra clients in KEYS_DIR."""
    from .tools.keys import KeysError, default_names, describe, generate

    if workers < 0:
        raise click.UsageError(f"--workers {workers}: expected >= 0")
    try:
        written = generate(Path(keys_dir), default_names(workers, clients), force=force)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(describe(Path(keys_dir), written))


@keys_group.command("add")
@click.argument("keys_dir", type=click.Path(file_okay=False, exists=True))
@click.argument("names", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Replace keys that exist.")
def keys_add(keys_dir: str, names: Sequence[str], force: bool) -> None:
    """Add client key pairs NAMES (e.g. worker7) to KEYS_DIR; restart the servers to admit them."""
    from .tools.keys import KeysError, describe, generate

    try:
        written = generate(Path(keys_dir), list(names), force=force)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(describe(Path(keys_dir), written))


# ---------------------------------------------------------------------------------------------- tools


@main.command()
@config_options
@click.option("--broker", "broker_ep", default=None, metavar="HOST:PORT",
              help="Broker serve endpoint (default: network.broker_host:network.serve_port).")
@click.option("--learner", "learner_ep", default=None, metavar="HOST:PORT",
              help="Learner endpoint (default: network.learner_host:network.learner_port).")
@click.option("--run-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Read the endpoints from RUN_DIR/config.toml (a `zclaw train` run picks free ports).")
@click.option("--once", is_flag=True, help="Print the view once and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print both reports and the workers table as JSON, once.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--timeout", "timeout_ms", type=int, default=1500, show_default=True,
              help="Milliseconds to wait for each role's reply.")
def status(
    config: Optional[str], overrides: Sequence[str], broker_ep: Optional[str], learner_ep: Optional[str],
    run_dir: Optional[str], once: bool, as_json: bool, interval: float, timeout_ms: int,
) -> None:
    """Live view of a run: every worker, the broker and the learner, from their status reports.

    Exits 1 with a message when neither the broker nor the learner answers.
    """
    from .tools import status as status_mod

    if run_dir is not None and config is None:
        if not (Path(run_dir) / "config.toml").exists():
            raise click.UsageError(f"--run-dir {run_dir}: no config.toml there "
                                   "(is it a zclaw run directory?)")
        config = str(Path(run_dir) / "config.toml")
    cfg = _load(config, overrides)
    b_default, l_default = status_mod.endpoints_from_config(cfg)
    from .security import Security

    try:
        sec = Security.from_config(cfg, "tools")  # CURVE client keys when the run uses them
        curves = {"broker": sec.client("broker"), "learner": sec.client("learner")}
    except config_mod.ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        b = [status_mod.endpoint(broker_ep, "--broker")] if broker_ep else b_default
        L = status_mod.endpoint(learner_ep, "--learner") if learner_ep else l_default
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if interval <= 0:
        raise click.UsageError(f"--interval = {interval} is not allowed: expected > 0")
    sys.exit(status_mod.run(b, L, once=once, as_json=as_json, interval=interval, timeout_ms=timeout_ms,
                            echo=click.echo, clear=sys.stdout.isatty(), curves=curves))


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where the PNGs go (default: FIRST_RUN_DIR/plots).")
def plot(run_dirs: Sequence[str], out_dir: Optional[str]) -> None:
    """PNG figures of one or more runs (return vs env steps and wall time, option usage, lag), overlaid."""
    from .tools.plot import plot as make_plots

    out = Path(out_dir) if out_dir else Path(run_dirs[0]) / "plots"
    try:
        written = make_plots([Path(p) for p in run_dirs], out)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for name, path in written.items():
        click.echo(f"{name}: {path}")


def _progress_enabled() -> bool:
    return sys.stderr.isatty()


@main.command("eval")
@click.argument("path", type=click.Path(exists=True))
@click.option("--episodes", "-n", type=int, default=10, show_default=True, help="Episodes per policy (M).")
@click.option("--seed", type=int, default=12345, show_default=True, help="Env seed of the first episode.")
@click.option("--env", "env_id", default=None,
              help="Env id (default: the one the checkpoint was trained on).")
@click.option("--policy", "which", type=click.Choice(["both", "teacher", "student"]), default="both",
              show_default=True, help="Which policies to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--video", type=click.Path(dir_okay=False), default=None,
              help="Also render an MP4 (GIF without ffmpeg) of the teacher, option colour-coded.")
@click.option("--video-policy", type=click.Choice(["teacher", "student"]), default="teacher",
              show_default=True)
@click.option("--frames", type=int, default=200, show_default=True, help="Frames in the video.")
@click.option("--size", default="320x240", show_default=True, help="Video WIDTHxHEIGHT (even numbers).")
@click.option("--fps", type=int, default=30, show_default=True)
def eval_cmd(
    path: str, episodes: int, seed: int, env_id: Optional[str], which: str, as_json: bool,
    video: Optional[str], video_policy: str, frames: int, size: str, fps: int,
) -> None:
    """Run the teacher (option policy) and the distilled student of RUN_DIR or CHECKPOINT.pt for M episodes.

    Reports return, success rate (where the env reports one), option usage and mean option durations.
    With --video, MuJoCo renders offscreen (MUJOCO_GL=osmesa unless set: apt-get install libosmesa6).
    """
    import json
    import os

    if video is not None:
        from .tools.video import default_gl

        os.environ.update(default_gl())  # before anything imports mujoco
        try:
            width, height = (int(v) for v in size.lower().split("x"))
            if width < 16 or height < 16 or width % 2 or height % 2:
                raise ValueError
        except ValueError:
            raise click.UsageError(f"--size = {size!r} is not allowed: expected "
                                   "WIDTHxHEIGHT, even, >= 16") from None
    from .fileio import finite_json
    from .learner.checkpoint import CheckpointError
    from .tools import evaluate as ev

    policies = ("teacher", "student") if which == "both" else (which,)
    try:
        model, state = ev.load_policy(Path(path))
        rep = ev.evaluate(Path(path), episodes, seed, env_id, policies, progress=_progress_enabled(),
                          loaded=(model, state))
        if video is not None:
            from .tools.video import record

            spec = dict(state["spec"], env_id=env_id or state["spec"]["env_id"])
            out, n = record(model, spec, Path(video), frames=frames, who=video_policy, seed=seed, width=width,
                            height=height, fps=fps)
            rep["video"] = {"path": str(out), "frames": n, "policy": video_policy}
    except (CheckpointError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(finite_json(rep), indent=2, sort_keys=True))
    else:
        click.echo(ev.format_report(rep))
        if "video" in rep:
            v = rep["video"]
            click.echo(f"  video: {v['path']} ({v['frames']} frames, {v['policy']})")


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--no-clip", is_flag=True,
              help="Leave the student's mean unclipped (default: clip to action bounds).")
def export(path: str, out: str, no_clip: bool) -> None:
    """Write the distilled student of RUN_DIR or CHECKPOINT.pt as TorchScript (normaliser inside) to OUT."""
    from .learner.checkpoint import CheckpointError
    from .tools.evaluate import load_policy
    from .tools.export import export as do_export

    try:
        model, state = load_policy(Path(path))
        meta = do_export(model, dict(state["spec"]), Path(out), clip=not no_clip,
                         version=state.get("version"))
    except (CheckpointError, ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"exported the student of {state.get('path')} (version {meta['version']}, {meta['env_id']}) "
               f"to {out}: obs [B, {meta['obs_dim']}] -> action [B, {meta['act_dim']}]")


@main.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script, e.g.  eval "$(zclaw completion bash)"  in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - click ships all three
        raise click.UsageError(f"no completion for {shell}")
    click.echo(cls(main, {}, "zclaw", "_ZCLAW_COMPLETE").source())


if __name__ == "__main__":
    main()
