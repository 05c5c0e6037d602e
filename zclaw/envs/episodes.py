"""Episode returns, lengths and success of N envs, tracked on the envs' device (GPU backends).

Knowing on the host which envs ended would cost a device-to-host copy every step. So each step only
records device tensors (the done mask and the running stats at that step); :meth:`DeviceEpisodes.pop`
turns everything recorded since the last call into the ``[{"return", "length", "success"?}]`` list
of :class:`zclaw.core.StepResult` with one copy, and the worker calls it once per segment through the
backend's ``pop_episodes()``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

#: steps recorded on the device before they are compacted to host dicts (bounds memory when nobody
#: pops, e.g. a benchmark stepping the env alone)
MAX_PENDING = 1024


class DeviceEpisodes:
    """Running per-env return and length on ``device``; see the module docstring."""

    def __init__(self, num_envs: int, device: torch.device) -> None:
        self.num_envs = int(num_envs)
        self.ret = torch.zeros(self.num_envs, dtype=torch.float64, device=device)
        self.len = torch.zeros(self.num_envs, dtype=torch.int64, device=device)
        self._pending: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []
        self._host: List[Dict[str, Any]] = []

    def reset(self) -> None:
        """Every env starts a new episode (a full reset); what ended before is kept for :meth:`pop`."""
        self.ret.zero_()
        self.len.zero_()

    def step(self, reward: torch.Tensor, done: torch.Tensor, success: Optional[torch.Tensor] = None) -> None:
        """Add one step's ``reward`` [N]; envs where ``done`` [N] bool end their episode
        (with ``success``)."""
        self.ret += reward
        self.len += 1
        self._pending.append((done.clone(), self.ret.clone(), self.len.clone(),
                              None if success is None else success.clone()))
        self.ret.masked_fill_(done, 0.0)
        self.len.masked_fill_(done, 0)
        if len(self._pending) >= MAX_PENDING:
            self._host.extend(self._compact())

    def pop(self) -> List[Dict[str, Any]]:
        """Stats of the episodes that ended since the last call, ordered by step then env."""
        out = self._host + self._compact()
        self._host = []
        return out

    def _compact(self) -> List[Dict[str, Any]]:
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        done = torch.stack([p[0] for p in pending])
        idx = done.nonzero(as_tuple=True)
        rets = torch.stack([p[1] for p in pending])[idx].to("cpu").tolist()
        lens = torch.stack([p[2] for p in pending])[idx].to("cpu").tolist()
        succs = None
        if all(p[3] is not None for p in pending):
            succs = torch.stack([p[3] for p in pending])[idx].to("cpu").tolist()  # type: ignore[misc]
        episodes = []
        for i, (r, n) in enumerate(zip(rets, lens)):
            ep: Dict[str, Any] = {"return": float(r), "length": int(n)}
            if succs is not None:
                ep["success"] = bool(succs[i])
            episodes.append(ep)
        return episodes
