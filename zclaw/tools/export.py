"""``zclaw export RUN_OR_CHECKPOINT OUT.pt``: the distilled student as a self-contained TorchScript file.

The exported module maps a batch of *raw* observations ``[B, obs_dim]`` (float32, flattened by the env
backend's rule) to actions ``[B, act_dim]``: the observation normaliser with the checkpoint's statistics,
the student's mean (``OptionPolicy.student_act``), then clipping to the env's action bounds (``--no-clip``
leaves the raw mean). Nothing of zclaw is needed to run it: ``torch.jit.load(path)(obs)``.

It is made by tracing (so it follows whatever ``student_act`` computes) and then checked: the loaded
file must reproduce the eager student on a fresh batch of another size, or the export fails. The file
also carries ``zclaw.json`` (env id, spec, version, clipping) as a TorchScript extra file.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..policy.networks import OptionPolicy
from .evaluate import action_bounds

META = "zclaw.json"


class StudentModule(nn.Module):
    """Raw observation -> student action, normaliser inside; what gets traced."""

    def __init__(self, policy: OptionPolicy, low: torch.Tensor, high: torch.Tensor, clip: bool) -> None:
        super().__init__()
        self.policy = policy
        self.clip = clip
        self.register_buffer("low", low.float())
        self.register_buffer("high", high.float())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        a = self.policy.student_act(obs)
        if self.clip:
            a = torch.max(torch.min(a, self.high), self.low)
        return a


def export(
    policy: OptionPolicy, spec: Dict[str, Any], out: Path, *, clip: bool = True,
    version: Optional[int] = None, seed: int = 0,
) -> Dict[str, Any]:
    """Trace, check and save the student; return the metadata written beside it (``zclaw.json``)."""
    policy = policy.eval()
    low, high = action_bounds(spec)
    module = StudentModule(policy, low, high, clip).eval()
    obs_dim = int(policy.cfg.obs_dim)
    gen = torch.Generator().manual_seed(seed)
    example = torch.randn(8, obs_dim, generator=gen)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.x deprecates TorchScript; it still runs
        traced = torch.jit.trace(module, example, check_trace=False)
    meta = {
        "env_id": spec["env_id"], "spec": dict(spec), "version": version, "clip": clip,
        "obs_dim": obs_dim, "act_dim": int(policy.cfg.act_dim),
        "input": "raw observations [B, obs_dim] float32",
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(traced, str(out), _extra_files={META: json.dumps(meta)})
        check(out, module, obs_dim, seed)
    return meta


def check(path: Path, module: nn.Module, obs_dim: int, seed: int = 0) -> None:
    """Reload ``path`` and compare it with the eager module on batches of 1 and 37 rows;
    raise if they differ."""
    loaded = torch.jit.load(str(path))
    gen = torch.Generator().manual_seed(seed + 1)
    for rows in (1, 37):
        x = torch.randn(rows, obs_dim, generator=gen) * 3
        with torch.no_grad():
            want, got = module(x), loaded(x)
        if want.shape != got.shape or not torch.allclose(want, got, atol=1e-6, rtol=1e-5):
            raise RuntimeError(f"exported {path} does not reproduce the student on a batch of {rows}: "
                               "max difference "
                               f"{(want - got).abs().max().item() if want.shape == got.shape else 'shape'}")


def read_meta(path: Path) -> Dict[str, Any]:
    """The ``zclaw.json`` metadata of an exported file."""
    files = {META: ""}
    torch.jit.load(str(path), _extra_files=files)
    return json.loads(files[META])
