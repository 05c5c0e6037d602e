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

from typing import Any, Dict, List, NamedTuple, Optional, Union

try:  # Python 3.8 has Protocol in typing; keep the import tolerant for older tooling
    from typing import Protocol
except ImportError:  # pragma: no cover
    Protocol = object  # type: ignore

import torch

from .wire.messages import EnvSpec


class StepResult(NamedTuple):
    """What :meth:`BatchedEnv.step` returns, one row per env, every tensor on the env's device.

    ``obs`` is the observation to act on next. ``terminated`` (a real end: no bootstrap) and
    ``truncated`` (a time limit: bootstrap from the final observation) are kept apart; an env is never
    both. ``final_obs`` gives the real last observation of *truncated* envs, in one of two forms:

    * a dict ``{env index: [*obs_shape]}`` (CPU backends, which know on the host which envs ended), or
    * a tensor ``[N, *obs_shape]`` whose rows are valid where ``truncated`` (device backends: knowing
      the indices would cost a device-to-host copy every step). When it *is* the ``obs`` tensor (the
      same object), the backend defers its resets (Isaac Gym): the observation after a time-out is
      still the final one, and the worker reads it from the next row of the segment.

    ``episodes`` lists ``{"return", "length", "success"?}`` for episodes that ended this step; device
    backends leave it empty and hand the stats out once per segment through ``pop_episodes()``.
    ``info`` holds optional per-env extras ([N] tensors, e.g. a success flag), passed through untouched.
    """

    obs: torch.Tensor  # [N, *obs_shape] float32
    reward: torch.Tensor  # [N] float32
    terminated: torch.Tensor  # [N] bool
    truncated: torch.Tensor  # [N] bool
    final_obs: Union[Dict[int, torch.Tensor], torch.Tensor]  # see above
    episodes: List[Dict[str, Any]]  # {"return", "length", "success"?}
    info: Optional[Dict[str, torch.Tensor]] = None


class BatchedEnv(Protocol):
    """N environments stepped together, on the backend's device; they reset themselves.

    ``spec`` gives the observation and action shapes and bounds every role agrees on (its hash is in
    every segment). Backends whose ``StepResult.episodes`` stays empty also have ``pop_episodes() ->
    List[Dict]``, which the worker calls once per segment (see ``docs/backends.md``).
    """

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
