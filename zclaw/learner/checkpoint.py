"""Atomic learner checkpoints: everything needed to continue a run with the version counter intact.

A checkpoint holds the model state (parameters and observation-normaliser statistics), the optimiser
state, the version / update / env-step counters, the RNG states (torch, numpy, python), the resolved
config and the env spec. It is written to a temporary file in the same directory, fsynced and then
``os.replace``-d over its final name, so a crash mid-write leaves the previous checkpoint intact and a
reader never sees half a file. ``latest.pt`` is always the newest; the last :data:`KEEP` numbered ones
(``ckpt-<version>.pt``) are kept besides.

Everything is stored in types ``torch.load(weights_only=True)`` accepts (tensors, numbers, strings,
lists, dicts), so loading never runs arbitrary pickled code.
"""
from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import numpy as np
import torch

from ..fileio import atomic_write
from ..policy.networks import OptionPolicy, PolicyConfig

KEEP = 3
LATEST = "latest.pt"
FORMAT = 1
#: optimiser param-group keys that say how this machine runs the update, not what it is (restore keeps them)
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, or made for another env or architecture."""


def rng_state() -> Dict[str, Any]:
    """The torch, numpy and python RNG states, in weights_only-loadable types."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4]),
        },
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the RNG states saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def save(
    directory: Union[str, Path], model: OptionPolicy, optimizer: Optional[torch.optim.Optimizer],
    **fields: Any,
) -> Path:
    """Write ``ckpt-<version>.pt`` and ``latest.pt`` atomically into ``directory``; return the first.
    ``fields``: :func:`snapshot`'s keywords (version, updates, steps_consumed, config, spec, extra,
    trainer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = encode(snapshot(model, optimizer, **fields))
    numbered = directory / f"ckpt-{int(fields['version']):08d}.pt"
    atomic_write(numbered, lambda f: f.write(data))
    atomic_write(directory / LATEST, lambda f: f.write(data))
    old = sorted(directory.glob("ckpt-*.pt"))
    for p in old[:-KEEP]:
        try:
            p.unlink()
        except OSError:
            pass
    return numbered


def snapshot(
    model: OptionPolicy,
    optimizer: Optional[torch.optim.Optimizer],
    *,
    version: int,
    updates: int,
    steps_consumed: int,
    config: Mapping[str, Any],
    spec: Mapping[str, Any],
    extra: Optional[Mapping[str, Any]] = None,
    trainer: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """The state :func:`save` writes, in memory (data-parallel ranks start from rank 0's: :func:`encode`d
    and sent to every rank, zclaw/learner/distributed.py)."""
    return {
        "format": FORMAT,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "policy": model.cfg.to_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "version": int(version),
        "updates": int(updates),
        "steps_consumed": int(steps_consumed),
        "rng": rng_state(),
        "config": {k: dict(v) for k, v in config.items()},
        "spec": dict(spec),
        "extra": dict(extra or {}),
        # the trainer's own statistics (Trainer.state_dict: the reward scale); absent in older checkpoints
        "trainer": dict(trainer or {}),
    }


def encode(state: Mapping[str, Any]) -> bytes:
    """A checkpoint state as the bytes of a checkpoint file."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def decode(data: bytes, map_location: Any = "cpu") -> Dict[str, Any]:
    """:func:`encode`'s bytes back as a state (``weights_only``: no pickled code runs)."""
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def find(path_or_dir: Union[str, Path]) -> Optional[Path]:
    """The checkpoint file a path names: the file itself, or ``latest.pt`` in a directory; None if absent."""
    p = Path(path_or_dir)
    if p.is_dir():
        p = p / LATEST
    return p if p.is_file() else None


def load(path_or_dir: Union[str, Path], map_location: Any = "cpu") -> Dict[str, Any]:
    """Read a checkpoint (a file, or a directory's ``latest.pt``); :class:`CheckpointError` if unusable."""
    p = find(path_or_dir)
    if p is None:
        raise CheckpointError(f"no checkpoint at {path_or_dir} (expected a .pt file or a directory with "
                              f"{LATEST})")
    try:
        state = torch.load(str(p), map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types on a truncated or foreign file
        raise CheckpointError(f"checkpoint {p} cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {p} is not a zclaw learner checkpoint of format {FORMAT}")
    state["path"] = str(p)
    return state


def check_compatible(state: Mapping[str, Any], spec: Mapping[str, Any], policy: PolicyConfig) -> None:
    """Refuse to resume a run whose env spec or network architecture differs from the checkpoint's."""
    where = state.get("path", "checkpoint")
    if dict(state["spec"]) != dict(spec):
        diff = {k: (state["spec"].get(k), spec.get(k)) for k in set(state["spec"]) | set(spec)
                if state["spec"].get(k) != spec.get(k)}
        raise CheckpointError(
            f"{where} was made for another env spec; (checkpoint, this run) differ in {diff}. "
            "Resume with the same env, or start a new run directory."
        )
    want = policy.to_dict()
    try:  # through PolicyConfig: keys added since the checkpoint was written take their old meaning
        have = PolicyConfig.from_dict(state["policy"]).to_dict()
    except (TypeError, KeyError, ValueError):
        have = dict(state["policy"])
    if have != want:
        diff = {k: (have.get(k), want.get(k)) for k in set(have) | set(want) if have.get(k) != want.get(k)}
        raise CheckpointError(
            f"{where} was made for another network architecture; (checkpoint, this run) differ in {diff}. "
            "Use the checkpoint's [policy] settings, or start a new run directory."
        )


def restore(
    state: Mapping[str, Any],
    model: OptionPolicy,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    rng: bool = True,
) -> None:
    """Load a checkpoint's model (and optimiser, and RNG) state; call :func:`check_compatible` first."""
    model.load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        # how this machine runs Adam (fused, foreach) stays this machine's: torch would take the saver's
        # choice from the checkpoint, which a learner on another device or torch may not have
        kernels = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(optimizer.param_groups, kernels):
            group.update(own)
    if rng:
        set_rng_state(state["rng"])
