"""The ``gym:`` backend: N gymnasium envs stepped in a plain loop, results as torch tensors.

MuJoCo tasks such as ``Reacher-v5`` step in tens of microseconds on one core, so a Python loop over N
copies (``gym.make(id)`` each, env i seeded ``seed + i`` on its first reset) costs far less than the policy
inference of the batch; subprocess vector envs would only add IPC on the 1-2 cores a worker has.

Semantics (the :class:`zclaw.core.BatchedEnv` protocol):

* Every env resets itself when its episode ends (terminated or truncated). ``StepResult.obs`` is the
  observation to act on next, i.e. the *reset* observation of envs whose episode just ended.
* ``StepResult.final_obs[i]`` is the real last observation of env i, present only when env i was
  *truncated* (time limit): the learner bootstraps a truncation from it; a termination needs none.
* ``StepResult.episodes`` has one ``{"return", "length"}`` map per ended episode, plus ``"success"``
  (bool) when the env reports ``info["is_success"]`` or ``info["success"]`` on the final step.

Observation flattening rule (every observation becomes one float32 vector, ``obs_shape = (D,)``):

* ``Box``: its values in C order (``ravel``); ``MultiBinary``: likewise.
* ``Discrete(n)``: a one-hot vector of length n; ``MultiDiscrete``: the one-hots of each entry, concatenated
  (as :func:`gymnasium.spaces.flatten`).
* ``Dict``: the flattened sub-observations in **sorted key order** (whatever order the env built the
  space or returns the dict in), concatenated; nested ``Dict`` and ``Tuple`` recurse by the same rule.
* ``Tuple``: the flattened elements in their order, concatenated.

So for ``Dict(observation=Box(10), desired_goal=Box(3), achieved_goal=Box(3))`` the vector is
``[achieved_goal(3), desired_goal(3), observation(10)]``.

Only ``Box`` action spaces with finite bounds are supported (the policy is Gaussian).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import gymnasium as gym
import gymnasium.error as gym_error
import numpy as np
import torch
from gymnasium import spaces

from ..core import StepResult
from ..wire.messages import EnvSpec
from . import robotics
from .preload import BackendUnavailable

Flattener = Callable[[Any, np.ndarray], None]  # (observation, out float32 row) -> fills the row


def flat_dim(space: spaces.Space) -> int:
    """Length of the vector :func:`flattener` writes for ``space`` (see the module's flattening rule)."""
    if isinstance(space, spaces.Dict):
        return sum(flat_dim(space.spaces[k]) for k in sorted(space.spaces))
    if isinstance(space, spaces.Tuple):
        return sum(flat_dim(s) for s in space.spaces)
    if isinstance(space, spaces.Box):
        return int(np.prod(space.shape))
    return int(spaces.flatdim(space))


def flattener(space: spaces.Space) -> Flattener:
    """A function that writes an observation of ``space`` into a float32 row by the module's rule.

    Built once per space so that a step does no type dispatch beyond what the space needs.
    """
    if isinstance(space, spaces.Box):

        def flat_box(obs: Any, out: np.ndarray) -> None:
            out[...] = np.asarray(obs).reshape(-1)

        return flat_box
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        if isinstance(space, spaces.Dict):
            keys: List[Any] = sorted(space.spaces)
            subs = [space.spaces[k] for k in keys]
        else:
            keys = list(range(len(space.spaces)))
            subs = list(space.spaces)
        parts = []
        start = 0
        for key, sub in zip(keys, subs):
            n = flat_dim(sub)
            parts.append((key, start, start + n, flattener(sub)))
            start += n

        def flat_nested(obs: Any, out: np.ndarray) -> None:
            for key, a, b, fn in parts:
                fn(obs[key], out[a:b])

        return flat_nested

    def flat_other(obs: Any, out: np.ndarray) -> None:
        out[...] = spaces.flatten(space, obs)

    return flat_other


def make_one(name: str, **kwargs: Any) -> gym.Env:
    """``gym.make(name, **kwargs)`` with robotics ids prepared and clear errors (the worker
    and the video tool)."""
    robotics.prepare(name)  # registers gymnasium-robotics ids, patches its mujoco>=3.12 enum comparison
    try:
        return gym.make(name, **kwargs)
    except gym_error.DependencyNotInstalled as exc:
        raise BackendUnavailable(
            f"gym env {name!r} needs a package that is not installed ({exc}); "
            "for MuJoCo tasks install it with: pip install 'gymnasium[mujoco]>=1.0'"
        ) from exc
    # NameNotFound, VersionNotFound, NamespaceNotFound, DeprecatedEnv, malformed
    except gym_error.Error as exc:
        raise ValueError(
            f"unknown gym env id {name!r}: {exc} (Fetch and ShadowHand ids need: pip "
            "install 'zclaw[robotics]')"
        ) from exc


class GymBatchedEnv:
    """``num_envs`` copies of gymnasium env ``name`` stepped in a loop; see the module docstring."""

    def __init__(self, name: str, num_envs: int, seed: int, device: torch.device) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs = {num_envs} must be >= 1")
        self.name = name
        self.num_envs = int(num_envs)
        self.device = torch.device(device)
        self.seed = int(seed)
        self.envs: List[gym.Env] = []
        try:
            for _ in range(self.num_envs):
                self.envs.append(make_one(name))
            env0 = self.envs[0]
            act_space = env0.action_space
            if not isinstance(act_space, spaces.Box):
                raise ValueError(
                    f"gym env {name!r} has action space {act_space}; zclaw supports only Box "
                    "(continuous) actions"
                )
            low = np.asarray(act_space.low, dtype=np.float64).reshape(-1)
            high = np.asarray(act_space.high, dtype=np.float64).reshape(-1)
            if not (np.isfinite(low).all() and np.isfinite(high).all()):
                raise ValueError(f"gym env {name!r} has unbounded actions {act_space}; "
                                 "zclaw needs finite bounds")
        except BaseException:
            self.close()
            raise
        self.obs_space = env0.observation_space
        self._flatten = flattener(self.obs_space)
        obs_dim = flat_dim(self.obs_space)
        self.spec = EnvSpec(
            env_id="gym:" + name,
            obs_shape=(obs_dim,),
            action_shape=tuple(int(d) for d in act_space.shape),
            action_low=tuple(float(x) for x in low),
            action_high=tuple(float(x) for x in high),
        )
        self._obs = np.zeros((self.num_envs, obs_dim), dtype=np.float32)
        self._final = np.zeros(obs_dim, dtype=np.float32)
        self._reward = np.zeros(self.num_envs, dtype=np.float32)
        self._terminated = np.zeros(self.num_envs, dtype=bool)
        self._truncated = np.zeros(self.num_envs, dtype=bool)
        self._ep_return = np.zeros(self.num_envs, dtype=np.float64)
        self._ep_length = np.zeros(self.num_envs, dtype=np.int64)
        self._seeded = False
        self._needs_reset = True

    # ------------------------------------------------------------------------------------------ API
    def reset(self, seed: Optional[int] = None) -> torch.Tensor:
        """Reset every env; env i is seeded ``seed + i`` (default: the constructor's seed on
        the first reset)."""
        if seed is None and not self._seeded:
            seed = self.seed
        for i, env in enumerate(self.envs):
            if seed is not None:
                obs, _ = env.reset(seed=seed + i)
                env.action_space.seed(seed + i)
            else:
                obs, _ = env.reset()
            self._flatten(obs, self._obs[i])
        self._seeded = True
        self._needs_reset = False
        self._ep_return[:] = 0.0
        self._ep_length[:] = 0
        return self._tensor(self._obs.copy())

    def step(self, action: torch.Tensor) -> StepResult:
        """Step env i with ``action[i]`` (already clipped); auto-reset ended episodes (see module doc)."""
        if self._needs_reset:
            raise RuntimeError("GymBatchedEnv.step called before reset()")
        want = (self.num_envs,) + self.spec.action_shape
        if tuple(action.shape) != want:
            raise ValueError(f"action has shape {list(action.shape)}, expected "
                             f"{list(want)} (one row per env)")
        acts = action.detach().to("cpu", torch.float32).numpy()
        final_obs: Dict[int, torch.Tensor] = {}
        episodes: List[Dict[str, Any]] = []
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, info = env.step(acts[i])
            r = float(reward)
            self._reward[i] = r
            self._terminated[i] = terminated = bool(terminated)
            self._truncated[i] = truncated = bool(truncated)
            self._ep_return[i] += r
            self._ep_length[i] += 1
            if terminated or truncated:
                ep: Dict[str, Any] = {"return": float(self._ep_return[i]), "length": int(self._ep_length[i])}
                success = info.get("is_success", info.get("success"))
                if success is not None:
                    ep["success"] = bool(success)
                episodes.append(ep)
                if truncated:
                    self._flatten(obs, self._final)
                    final_obs[i] = self._tensor(self._final.copy())
                obs, _ = env.reset()
                self._ep_return[i] = 0.0
                self._ep_length[i] = 0
            self._flatten(obs, self._obs[i])
        return StepResult(
            obs=self._tensor(self._obs.copy()),
            reward=self._tensor(self._reward.copy()),
            terminated=self._tensor(self._terminated.copy()),
            truncated=self._tensor(self._truncated.copy()),
            final_obs=final_obs,
            episodes=episodes,
        )

    def close(self) -> None:
        for env in self.envs:
            try:
                env.close()
            except Exception:  # closing is best effort; a half-built env may not close cleanly
                pass
        self.envs = []
        self._needs_reset = True

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        return t if self.device.type == "cpu" else t.to(self.device)

    def __repr__(self) -> str:
        return (f"GymBatchedEnv({self.name!r}, num_envs={self.num_envs}, seed={self.seed}, "
                f"device={self.device})")
