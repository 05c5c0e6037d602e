"""The ``mjwarp:<Task>`` backend: MuJoCo Warp, thousands of worlds batched on one GPU,
torch tensors zero-copy.

One ``mujoco_warp`` model with ``nworld = N`` steps every world in the same kernels. The simulator's
arrays (``qpos``, ``qvel``, ``ctrl``, ``site_xpos``) are viewed as torch tensors through
``warp.to_torch`` (same memory, no copy), so actions go in and observations come out without leaving
the device; rewards, resets and time limits are torch ops on those views. On CUDA the physics of one
env step (``frame_skip`` MuJoCo steps) is captured once as a CUDA graph and replayed, on torch's
current stream, so torch and Warp work stay ordered without a synchronisation.

Tasks (``TASKS``): ``Reach``, a 3-DoF arm (base yaw, shoulder and elbow pitch, two 0.2 m links, no
gravity or contacts: a 3-D Reacher) whose fingertip must reach a random target within 0.35 m;
obs = [cos q, sin q, qdot, target, tip - target] (15); reward = -|tip - target| - 0.01 |a|^2;
success = the tip is within 5 cm of the target when the 100-step episode is truncated.

Episodes reset immediately, in place, for the worlds that ended (a masked write into the views, then
one ``kinematics`` pass so the observation reflects the new pose). ``StepResult.final_obs`` is a dense
[N, obs] tensor (valid where truncated) and episode stats come out once per segment
(``pop_episodes``). Runs on the CPU too (Warp's CPU backend): slowly, and the first step compiles the
kernels (about a minute; cached in ``~/.cache/warp`` afterwards). Needs ``pip install 'zclaw[mjwarp]'``
(Python >= 3.11); this file itself stays Python 3.8 syntax like the rest of ``zclaw/envs``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch

from ..core import StepResult
from ..wire.messages import EnvSpec
from .episodes import DeviceEpisodes

REACH_XML = """
<mujoco model="zclaw_reach">
  <option timestep="0.01" gravity="0 0 0" integrator="implicitfast"/>
  <default>
    <joint type="hinge" damping="0.3" armature="0.01" limited="false"/>
    <geom contype="0" conaffinity="0" density="500" rgba="0.7 0.7 0.7 1"/>
    <motor ctrlrange="-1 1" ctrllimited="true" gear="1"/>
  </default>
  <worldbody>
    <body name="base" pos="0 0 0.1">
      <joint name="yaw" axis="0 0 1"/>
      <geom type="cylinder" size="0.03 0.03"/>
      <body name="upper" pos="0 0 0.03">
        <joint name="shoulder" axis="0 1 0"/>
        <geom type="capsule" fromto="0 0 0 0.2 0 0" size="0.02"/>
        <body name="fore" pos="0.2 0 0">
          <joint name="elbow" axis="0 1 0"/>
          <geom type="capsule" fromto="0 0 0 0.2 0 0" size="0.015"/>
          <site name="tip" pos="0.2 0 0" size="0.01"/>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor joint="yaw"/>
    <motor joint="shoulder"/>
    <motor joint="elbow"/>
  </actuator>
</mujoco>
"""


class ReachTask:
    """Reward, reset and observation of the ``Reach`` task, all torch ops on the simulator's views."""

    xml = REACH_XML
    frame_skip = 2
    max_steps = 100
    success_dist = 0.05
    shoulder = (0.0, 0.0, 0.13)
    obs_dim = 15

    def __init__(self, num_envs: int, device: torch.device, gen: torch.Generator) -> None:
        self.N, self.device, self.gen = num_envs, device, gen
        self.target = torch.zeros(num_envs, 3, device=device)
        self.origin = torch.tensor(self.shoulder, device=device)

    def _uniform(self, n: int, k: int, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(n, k, generator=self.gen, device=self.device) * (hi - lo) + lo

    def reset(self, mask: torch.Tensor, qpos: torch.Tensor, qvel: torch.Tensor) -> None:
        """Re-draw pose, velocity and target of the worlds in ``mask`` ([N] bool), in
        place, without a sync."""
        n = self.N
        new_q = self._uniform(n, 3, -0.1, 0.1)
        new_q[:, 1] -= 0.3  # shoulder raised a little, so the arm does not start folded flat
        new_v = self._uniform(n, 3, -0.005, 0.005)
        r = self._uniform(n, 1, 0.1, 0.35)
        yaw = self._uniform(n, 1, -math.pi, math.pi)
        pitch = self._uniform(n, 1, -math.pi / 3, math.pi / 3)
        d = torch.cat([torch.cos(pitch) * torch.cos(yaw), torch.cos(pitch) * torch.sin(yaw),
                       torch.sin(pitch)], -1)
        new_t = self.origin + r * d
        m = mask.unsqueeze(-1)
        qpos.copy_(torch.where(m, new_q, qpos))
        qvel.copy_(torch.where(m, new_v, qvel))
        self.target.copy_(torch.where(m, new_t, self.target))

    def observe(self, qpos: torch.Tensor, qvel: torch.Tensor, tip: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.cos(qpos), torch.sin(qpos), qvel, self.target, tip - self.target], -1)

    def reward(self, tip: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return -torch.linalg.norm(tip - self.target, dim=-1) - 0.01 * (action * action).sum(-1)

    def success(self, tip: torch.Tensor) -> torch.Tensor:
        return torch.linalg.norm(tip - self.target, dim=-1) < self.success_dist


TASKS = {"Reach": ReachTask}


def warp_device(device: torch.device) -> str:
    """torch ``cuda:N`` -> Warp ``"cuda:N"``; ``cpu`` -> ``"cpu"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{0 if device.index is None else device.index}"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(f"mjwarp: device {device} is not supported: expected cpu or cuda:N")


class MjWarpBatchedEnv:
    """``num_envs`` worlds of one MuJoCo Warp task on ``device``; see the module docstring."""

    def __init__(self, task_name: str, num_envs: int, seed: int, device: torch.device,
                 graph: bool = True) -> None:
        if task_name not in TASKS:
            raise ValueError(f"unknown mjwarp task {task_name!r}; known tasks: {', '.join(sorted(TASKS))}")
        if num_envs < 1:
            raise ValueError(f"num_envs = {num_envs} must be >= 1")
        import mujoco
        import warp as wp

        wp.config.quiet = True  # before mujoco_warp initialises Warp: no banner on the worker's stdout
        import mujoco_warp as mjw

        self._wp, self._mjw = wp, mjw
        wp.init()
        self.name, self.num_envs, self.seed = task_name, int(num_envs), int(seed)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda:0")
        self.wp_device = warp_device(self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(int(seed))
        self.task = TASKS[task_name](self.num_envs, self.device, self.gen)
        mjm = mujoco.MjModel.from_xml_string(self.task.xml)
        mjd = mujoco.MjData(mjm)
        mujoco.mj_forward(mjm, mjd)
        with wp.ScopedDevice(self.wp_device):
            self.model = mjw.put_model(mjm)
            self.data = mjw.put_data(mjm, mjd, nworld=self.num_envs)
        # zero-copy torch views of the simulator state
        self.qpos = wp.to_torch(self.data.qpos)
        self.qvel = wp.to_torch(self.data.qvel)
        self.ctrl = wp.to_torch(self.data.ctrl)
        self._site = wp.to_torch(self.data.site_xpos)  # [N, nsite, 3]
        tip_id = mujoco.mj_name2id(mjm, mujoco.mjtObj.mjOBJ_SITE, "tip")
        self._tip_id = int(tip_id)
        self.spec = EnvSpec(
            env_id="mjwarp:" + task_name, obs_shape=(self.task.obs_dim,), action_shape=(mjm.nu,),
            action_low=tuple(float(x) for x in mjm.actuator_ctrlrange[:, 0]),
            action_high=tuple(float(x) for x in mjm.actuator_ctrlrange[:, 1]),
        )
        self._t = torch.zeros(self.num_envs, dtype=torch.int64, device=self.device)
        self._all = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        self._no = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        self._episodes = DeviceEpisodes(self.num_envs, self.device)
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = wp.stream_from_torch(torch.cuda.current_stream(self.device))
        self._use_graph = bool(graph) and self.device.type == "cuda"
        self._physics_graph: Any = None
        self._kin_graph: Any = None
        self._started = False

    # ------------------------------------------------------------------------------------ physics
    def _launch(self, fn: Any) -> None:
        """Run ``fn`` (Warp launches) on torch's stream; on CUDA as a graph captured on first use."""
        wp = self._wp
        if self._stream is None:
            with wp.ScopedDevice(self.wp_device):
                fn()
            return
        with wp.ScopedDevice(self.wp_device), wp.ScopedStream(self._stream):
            if not self._use_graph:
                fn()
                return
            attr = "_physics_graph" if fn == self._physics else "_kin_graph"
            graph = getattr(self, attr)
            if graph is None:
                fn()  # compile the kernels outside the capture (module loads cannot be captured)
                with wp.ScopedCapture(stream=self._stream) as cap:
                    fn()
                graph = cap.graph
                setattr(self, attr, graph)
            wp.capture_launch(graph)

    def _physics(self) -> None:
        for _ in range(self.task.frame_skip):
            self._mjw.step(self.model, self.data)

    def _kinematics(self) -> None:
        self._mjw.kinematics(self.model, self.data)

    def _tip(self) -> torch.Tensor:
        return self._site[:, self._tip_id, :]

    # ------------------------------------------------------------------------------------------ API
    def reset(self, seed: Optional[int] = None) -> torch.Tensor:
        """Reset every world (``seed``: re-seed the reset sampler first)."""
        if seed is not None:
            self.gen.manual_seed(int(seed))
        self.task.reset(self._all, self.qpos, self.qvel)
        self.ctrl.zero_()
        self._launch(self._kinematics)
        self._t.zero_()
        self._episodes.reset()
        self._started = True
        return self.task.observe(self.qpos, self.qvel, self._tip())

    def step(self, action: torch.Tensor) -> StepResult:
        """Step every world; every tensor stays on the device (no host copy, no synchronisation)."""
        if not self._started:
            raise RuntimeError("MjWarpBatchedEnv.step called before reset()")
        want = (self.num_envs,) + self.spec.action_shape
        if tuple(action.shape) != want:
            raise ValueError(f"action has shape {list(action.shape)}, expected "
                             f"{list(want)} (one row per env)")
        self.ctrl.copy_(action)
        self._launch(self._physics)
        tip = self._tip()
        reward = self.task.reward(tip, self.ctrl).to(torch.float32)
        self._t += 1
        truncated = self._t >= self.task.max_steps
        success = self.task.success(tip)
        final = self.task.observe(self.qpos, self.qvel, tip)  # before any reset: the real last observation
        self._episodes.step(reward, truncated, success)
        # immediate, masked resets (a no-op write for worlds that go on), then kinematics for the new poses
        self.task.reset(truncated, self.qpos, self.qvel)
        self._t.masked_fill_(truncated, 0)
        self._launch(self._kinematics)
        obs = self.task.observe(self.qpos, self.qvel, self._tip())
        return StepResult(
            obs=obs, reward=reward, terminated=self._no.clone(), truncated=truncated, final_obs=final,
            episodes=[], info={"success": success},
        )

    def pop_episodes(self) -> List[Dict[str, Any]]:
        """Stats of the episodes that ended since the last call (one device-to-host copy)."""
        return self._episodes.pop()

    def close(self) -> None:
        self._physics_graph = self._kin_graph = None
        self._started = False

    def __repr__(self) -> str:
        return f"MjWarpBatchedEnv({self.name!r}, num_envs={self.num_envs}, device={self.device})"
