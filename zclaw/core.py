"""The nouns of zclaw, in one place (after Acme's ``core.py``). Roles are built from these.

Data flow::

    worker:  BatchedEnv --obs--> OptionPolicy.act --action--> BatchedEnv ... every T steps a Segment
             --PUSH--> broker
    broker:  Segment --validate--> Store (ring of segments) --RateLimiter says yes--> Batch --REP--> learner
    learner: Batch --losses--> optimiser step --version += 1--> Weights --PUB--> workers
             (a joining worker asks the learner for a snapshot: ZeroMQ guide's Clone pattern)

* **Segment** (``zclaw.wire.messages.Segment``): T steps x N envs of one worker; per step the
  policy version that acted, the option in effect and the behaviour log-probs of action and option,
  so the learner can correct for staleness. Terminations and time-limit truncations are kept apart
  (a truncation bootstraps from the real final observation, carried sparsely).
* **Batch**: B segments stacked by the broker, with their store keys (priorities come back with the
  next request) and importance weights.
* **Weights** (``zclaw.policy.weights``): a versioned snapshot of the option policy with its
  observation-normaliser statistics, the only thing workers ever receive.
* **Store** (``zclaw.broker.store``): preallocated ring; ``queue``, ``uniform`` or ``prioritized``.
* **RateLimiter** (``zclaw.broker.ratelimit``): samples-per-insert ratio; says "retry later", never
  blocks the broker loop.
* **BatchedEnv** (:class:`BatchedEnv` below): N envs stepped together, results as torch tensors.
* **OptionPolicy** (``zclaw.policy.networks``): policy over options, intra-option Gaussians,
  terminations and critic; K = 1 is plain PPO.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

try:  # Python 3.8 has Protocol in typing; keep the import tolerant for older tooling
    from typing import Protocol
except ImportError:  # pragma: no cover
    Protocol = object  # type: ignore

import torch

from .wire.messages import EnvSpec


class StepResult(NamedTuple):
    """What :meth:`BatchedEnv.step` returns, one row per env.

    ``obs`` is the observation to act on next (after an automatic reset where an episode ended);
    ``final_obs`` holds, for envs whose episode was *truncated*, the real last observation the
    reset replaced (needed to bootstrap); ``episodes`` lists the stats of episodes that ended.
    """

    obs: torch.Tensor  # [N, *obs_shape] float32
    reward: torch.Tensor  # [N] float32
    terminated: torch.Tensor  # [N] bool
    truncated: torch.Tensor  # [N] bool
    final_obs: Dict[int, torch.Tensor]  # env index -> [*obs_shape], truncated envs only
    episodes: List[Dict[str, Any]]  # {"return", "length", "success"?}


class BatchedEnv(Protocol):
    """N environments stepped together, on the backend's device; they reset themselves."""

    spec: EnvSpec
    num_envs: int
    device: torch.device

    def reset(self, seed: Optional[int] = None) -> torch.Tensor:
        """Reset every env; return obs [N, *obs_shape]."""
        ...

    def step(self, action: torch.Tensor) -> StepResult:
        """Step every env with ``action`` [N, *action_shape] (already clipped to the bounds)."""
        ...

    def close(self) -> None:
        ...
