"""Running mean/variance observation normaliser whose statistics travel with the weights.

The learner updates the statistics from the batches it trains on (Chan et al.'s parallel variance
update); workers never update them, they use the ones published with the weights they act on, so a
segment's observations were normalised with the statistics of the version that produced it.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch
from torch import nn


class RunningNorm(nn.Module):
    """y = clip((x - mean) / sqrt(var + eps), -clip, clip); statistics are buffers, not parameters."""

    def __init__(self, shape: Tuple[int, ...], clip: float = 10.0, enabled: bool = True,
                 eps: float = 1e-8) -> None:
        super().__init__()
        self.clip = float(clip)
        self.enabled = bool(enabled)
        self.eps = eps
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        mean = self.mean.to(x.dtype)
        std = torch.sqrt(self.var.to(x.dtype) + self.eps)
        return torch.clamp((x - mean) / std, -self.clip, self.clip)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch ``x[..., *shape]`` into the statistics."""
        if not self.enabled:
            return
        x = x.reshape((-1,) + tuple(self.mean.shape)).to(torch.float64)
        n = x.shape[0]
        if n == 0:
            return
        b_mean = x.mean(0)
        b_var = x.var(0, unbiased=False)
        delta = b_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + b_var * n + delta**2 * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def stats(self) -> Dict[str, np.ndarray]:
        return {"mean": self.mean.cpu().numpy(), "var": self.var.cpu().numpy(),
                "count": self.count.cpu().numpy()}
