"""Fake IsaacGymEnvs: ``make`` with the real signature, and one ``VecTask``-shaped task, ``FakeReach``.

FakeReach: a point x in R^3 moves by 0.1 * action towards a goal g; obs = [x, g] (6); reward = -|x - g|;
the episode terminates when |x - g| < 0.15 (``extras["is_success"]`` = 1) and times out after
``max_episode_length`` steps (``reset_buf`` set at ``progress_buf >= max_episode_length - 1``, as every
IsaacGymEnvs task does). Resets are deferred to the next ``pre_physics_step``, as in IsaacGymEnvs' Ant.
``CALLS`` records every ``make`` call's arguments.
"""
import torch  # isaacgymenvs itself imports torch after isaacgym

CALLS = []
TASKS = ("FakeReach",)


class NoCudaHere(RuntimeError):
    """Raised after the call was recorded when a CUDA device is asked for on a machine without CUDA."""


class Box:
    """The part of gym.spaces.Box that VecTask users read."""

    def __init__(self, low, high, shape):
        self.low = torch.full(shape, float(low)).numpy()
        self.high = torch.full(shape, float(high)).numpy()
        self.shape = shape


class FakeReach:
    """The VecTask attributes and step/reset semantics zclaw relies on."""

    def __init__(self, seed, num_envs, rl_device, sim_device, max_episode_length=8):
        self.num_envs = num_envs
        self.num_obs = 6
        self.num_actions = 3
        self.device = sim_device
        self.rl_device = rl_device
        self.max_episode_length = max_episode_length
        self.clip_actions = 1.0
        self.clip_obs = 5.0
        self.observation_space = Box(-float("inf"), float("inf"), (self.num_obs,))
        self.action_space = Box(-1.0, 1.0, (self.num_actions,))
        self.gen = torch.Generator(device=sim_device).manual_seed(seed)
        z = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=sim_device)  # noqa: E731
        self.x = z(num_envs, 3)
        self.g = z(num_envs, 3)
        self.obs_buf = z(num_envs, self.num_obs)
        self.rew_buf = z(num_envs)
        self.reset_buf = torch.ones(num_envs, dtype=torch.long, device=sim_device)
        self.timeout_buf = z(num_envs, dtype=torch.long)
        self.progress_buf = z(num_envs, dtype=torch.long)
        self.success_buf = z(num_envs, dtype=torch.long)
        self.extras = {}
        self.obs_dict = {}
        self.steps = 0

    def reset_idx(self, env_ids):
        n = len(env_ids)
        self.x[env_ids] = torch.rand(n, 3, generator=self.gen, device=self.device) * 0.4 - 0.2
        self.g[env_ids] = torch.rand(n, 3, generator=self.gen, device=self.device) * 0.4 - 0.2
        self.progress_buf[env_ids] = 0
        self.reset_buf[env_ids] = 0
        self.success_buf[env_ids] = 0

    def pre_physics_step(self, actions):
        env_ids = self.reset_buf.nonzero(as_tuple=False).squeeze(-1)
        if len(env_ids) > 0:
            self.reset_idx(env_ids)
        self.x += 0.1 * actions.to(self.device)

    def post_physics_step(self):
        self.progress_buf += 1
        dist = torch.linalg.norm(self.x - self.g, dim=-1)
        self.obs_buf[:] = torch.cat([self.x, self.g], dim=-1)
        self.rew_buf[:] = -dist
        hit = dist < 0.15
        self.success_buf[:] = hit.long()
        reset = torch.where(hit, torch.ones_like(self.reset_buf), torch.zeros_like(self.reset_buf))
        self.reset_buf[:] = torch.where(self.progress_buf >= self.max_episode_length - 1,
                                        torch.ones_like(self.reset_buf), reset)

    def step(self, actions):
        self.steps += 1
        action_tensor = torch.clamp(actions, -self.clip_actions, self.clip_actions)
        self.pre_physics_step(action_tensor)
        self.post_physics_step()
        self.timeout_buf = (self.progress_buf >= self.max_episode_length - 1) & (self.reset_buf != 0)
        self.extras["time_outs"] = self.timeout_buf.to(self.rl_device)
        self.extras["is_success"] = self.success_buf.to(self.rl_device)
        self.obs_dict["obs"] = torch.clamp(self.obs_buf, -self.clip_obs, self.clip_obs).to(self.rl_device)
        return self.obs_dict, self.rew_buf.to(self.rl_device), self.reset_buf.to(self.rl_device), self.extras

    def zero_actions(self):
        return torch.zeros([self.num_envs, self.num_actions], dtype=torch.float32, device=self.rl_device)

    def reset(self):
        """As VecTask.reset in IsaacGymEnvs 1.5: one step with zero actions, which resets
        every flagged env."""
        self.step(self.zero_actions())
        return self.obs_dict


def make(
    seed,
    task,
    num_envs,
    sim_device,
    rl_device,
    graphics_device_id=-1,
    headless=False,
    multi_gpu=False,
    virtual_screen_capture=False,
    force_render=True,
    cfg=None,
):
    CALLS.append(dict(seed=seed, task=task, num_envs=num_envs, sim_device=sim_device, rl_device=rl_device,
                      graphics_device_id=graphics_device_id, headless=headless))
    if task not in TASKS:
        raise KeyError(task)
    try:
        torch.zeros(1, device=sim_device)
    except (RuntimeError, AssertionError) as exc:
        raise NoCudaHere(f"fake isaacgymenvs: {sim_device} asked for, and this "
                         "machine cannot use it") from exc
    torch.manual_seed(seed)
    return FakeReach(seed, num_envs, rl_device, sim_device)
