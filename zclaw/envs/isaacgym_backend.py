"""The ``isaacgym:<Task>`` backend: an IsaacGymEnvs ``VecTask`` as a zclaw BatchedEnv, on the GPU.

Written against IsaacGymEnvs' public interface (Isaac Gym Preview 4, Python 3.6-3.8):

* ``isaacgymenvs.make(seed, task, num_envs, sim_device, rl_device, graphics_device_id=-1,
  headless=False, multi_gpu=False, virtual_screen_capture=False, force_render=True, cfg=None)`` builds
  the task from its Hydra config and seeds torch, numpy and the simulator with ``seed``;
* the task (a ``VecTask``) has ``num_envs``, ``observation_space`` and ``action_space`` (gym ``Box``,
  actions in [-1, 1], clipped inside ``step`` to ``clip_actions``), ``rl_device``, ``reset() ->
  obs_dict`` and ``step(actions) -> (obs_dict, rew_buf, reset_buf, extras)``: ``obs_dict["obs"]``
  [N, num_obs], ``reset_buf`` [N] (non-zero: the episode ended), ``extras["time_outs"]`` [N] (the end
  was the episode length limit), all on ``rl_device``;
* tasks reset themselves, *deferred*: the envs flagged in ``reset_buf`` are reset at the start of the
  next ``step``. So the observation returned with ``reset_buf = 1`` is still the episode's final one.

How that maps onto :class:`zclaw.core.StepResult`:

* ``truncated = reset & time_outs``, ``terminated = reset & ~time_outs``;
* ``final_obs`` is the returned ``obs`` tensor itself (the final observation of a time-out), which
  tells the worker to take a truncation's bootstrap observation from the next segment row, with no
  extra copy; the step after an end acts on that final observation and is the first step of the next
  episode (``episode_start``), exactly as rl_games treats Isaac Gym's deferred resets;
* episode returns, lengths and success (``extras["is_success"]`` or ``extras["success"]``, an [N]
  tensor, when a task provides one) are tracked on the device and handed out once per segment by
  :meth:`pop_episodes`: nothing is copied to the host per step.

Devices: ``--gpu N`` gives ``device = cuda:N`` and so ``sim_device = rl_device = "cuda:N"``,
``graphics_device_id = N`` (:func:`isaacgym_devices`); ``--gpu -1`` runs Isaac Gym's CPU pipeline.
The worker is headless. ``import isaacgym`` must come before torch; ``zclaw worker`` does it
(:mod:`zclaw.envs.preload`). Python 3.8 syntax only: this module runs where Isaac Gym runs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core import StepResult
from ..wire.messages import EnvSpec
from .episodes import DeviceEpisodes

#: keys of ``extras`` read as a per-env success flag, in this order
SUCCESS_KEYS = ("is_success", "success")


def isaacgym_devices(device: torch.device) -> Tuple[str, str, int]:
    """``cuda:N`` -> ``("cuda:N", "cuda:N", N)``; ``cpu`` -> ``("cpu", "cpu", -1)`` (no graphics device)."""
    device = torch.device(device)
    if device.type == "cuda":
        n = 0 if device.index is None else int(device.index)
        return f"cuda:{n}", f"cuda:{n}", n
    if device.type == "cpu":
        return "cpu", "cpu", -1
    raise ValueError(f"isaacgym: device {device} is not supported: expected cpu or cuda:N")


def _box_bounds(space: Any, what: str) -> Tuple[Tuple[int, ...], List[float], List[float]]:
    shape = tuple(int(d) for d in space.shape)
    low = [float(x) for x in torch.as_tensor(space.low, dtype=torch.float64).reshape(-1)]
    high = [float(x) for x in torch.as_tensor(space.high, dtype=torch.float64).reshape(-1)]
    return shape, low, high


class IsaacGymBatchedEnv:
    """One IsaacGymEnvs task with ``num_envs`` envs; see the module docstring for the mapping."""

    def __init__(self, task_name: str, num_envs: int, seed: int, device: torch.device,
                 headless: bool = True) -> None:
        import isaacgym  # noqa: F401  (gymdeps; zclaw worker has imported it before torch already)
        import isaacgymenvs

        if num_envs < 1:
            raise ValueError(f"num_envs = {num_envs} must be >= 1")
        sim_device, rl_device, graphics_id = isaacgym_devices(device)
        self.name = task_name
        self.seed = int(seed)
        try:
            self.task = isaacgymenvs.make(
                seed=int(seed), task=task_name, num_envs=int(num_envs), sim_device=sim_device,
                rl_device=rl_device, graphics_device_id=graphics_id, headless=headless,
            )
        except Exception as exc:  # Hydra: unknown task config; the task map: unknown name
            if type(exc).__name__ in ("MissingConfigException", "KeyError", "ConfigCompositionException"):
                raise ValueError(f"unknown Isaac Gym task {task_name!r}: {exc}") from exc
            raise
        self.num_envs = int(self.task.num_envs)
        if self.num_envs != int(num_envs):
            raise ValueError(f"isaacgym task {task_name!r} built {self.num_envs} envs, "
                             f"{num_envs} were asked for")
        self.device = torch.device(rl_device)
        obs_shape, _, _ = _box_bounds(self.task.observation_space, "observation")
        act_shape, low, high = _box_bounds(self.task.action_space, "action")
        self.spec = EnvSpec(
            env_id="isaacgym:" + task_name, obs_shape=obs_shape, action_shape=act_shape,
            action_low=tuple(low), action_high=tuple(high),
        )
        self._no_trunc = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        self._episodes = DeviceEpisodes(self.num_envs, self.device)
        self._started = False

    # ------------------------------------------------------------------------------------------ API
    def reset(self, seed: Optional[int] = None) -> torch.Tensor:
        """Reset every env (``seed`` is ignored: ``isaacgymenvs.make`` seeded the simulator)."""
        obs_dict = self.task.reset()
        self._episodes.reset()
        self._started = True
        return self._obs(obs_dict)

    def step(self, action: torch.Tensor) -> StepResult:
        """Step every env; every returned tensor stays on the task's ``rl_device`` (no host copy)."""
        if not self._started:
            raise RuntimeError("IsaacGymBatchedEnv.step called before reset()")
        want = (self.num_envs,) + self.spec.action_shape
        if tuple(action.shape) != want:
            raise ValueError(f"action has shape {list(action.shape)}, expected "
                             f"{list(want)} (one row per env)")
        if action.device != self.device:  # a host-side comparison: no transfer when the policy shares the GPU
            action = action.to(self.device)
        obs_dict, rew, reset, extras = self.task.step(action)
        obs = self._obs(obs_dict)
        reward = rew.reshape(self.num_envs).to(torch.float32)
        done = reset.reshape(self.num_envs) != 0
        time_outs = extras.get("time_outs") if isinstance(extras, dict) else None
        truncated = (done & (time_outs.reshape(self.num_envs) != 0) if time_outs is not None
                     else self._no_trunc)
        terminated = done & ~truncated
        success = None
        for key in SUCCESS_KEYS:
            value = extras.get(key) if isinstance(extras, dict) else None
            if torch.is_tensor(value) and value.numel() == self.num_envs:
                success = value.reshape(self.num_envs) != 0
                break
        self._episodes.step(reward, done, success)
        info = ({k: v for k, v in extras.items() if torch.is_tensor(v) and k != "time_outs"}
                if extras else None)
        return StepResult(
            obs=obs, reward=reward, terminated=terminated, truncated=truncated, final_obs=obs, episodes=[],
            info=info or None,
        )

    def pop_episodes(self) -> List[Dict[str, Any]]:
        """Stats of the episodes that ended since the last call: one device-to-host copy, once per segment."""
        return self._episodes.pop()

    def close(self) -> None:
        close = getattr(self.task, "close", None)
        if callable(close):
            close()
        self._started = False

    # ------------------------------------------------------------------------------------- helpers
    def _obs(self, obs_dict: Any) -> torch.Tensor:
        obs = obs_dict["obs"] if isinstance(obs_dict, dict) else obs_dict
        return obs.reshape((self.num_envs,) + self.spec.obs_shape).to(torch.float32)

    def __repr__(self) -> str:
        return f"IsaacGymBatchedEnv({self.name!r}, num_envs={self.num_envs}, device={self.device})"
