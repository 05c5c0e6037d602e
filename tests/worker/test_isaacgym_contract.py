"""Contract tests of the ``isaacgym:`` adapter against a fake IsaacGymEnvs (``tests/fakes``).

Isaac Gym needs an NVIDIA GPU and Python 3.8, so these tests check what zclaw relies on against a fake that
follows the documented signatures: ``--gpu N`` becomes sim device, rl device and graphics device id N;
``extras["time_outs"]`` splits ``reset_buf`` into truncations and terminations; deferred resets; nothing is
copied to the host before a segment is encoded; and ``zclaw worker`` imports isaacgym before torch.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path
from typing import Any, Iterator, List

import numpy as np
import pytest
import torch
import zmq
from torch.overrides import TorchFunctionMode

from zclaw import config
from zclaw.envs import make_env
from zclaw.envs.isaacgym_backend import IsaacGymBatchedEnv, isaacgym_devices
from zclaw.wire import bind, make_socket, parse
from zclaw.worker import worker as worker_mod

FAKES = Path(__file__).resolve().parents[1] / "fakes"
CPU = torch.device("cpu")
TASK = "isaacgym:FakeReach"


@pytest.fixture
def fake_gym(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The fakes injected through sys.modules (torch is already imported here, so the fake isaacgym's
    import-order check would refuse to load: inject a bare module for it)."""
    monkeypatch.setitem(sys.modules, "isaacgym", types.ModuleType("isaacgym"))
    spec = importlib.util.spec_from_file_location("isaacgymenvs", FAKES / "isaacgymenvs" / "__init__.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "isaacgymenvs", mod)
    yield mod


def test_contract_gpu_flag_sets_sim_rl_and_graphics_device(
    fake_gym: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isaacgym_devices(torch.device("cuda:3")) == ("cuda:3", "cuda:3", 3)
    assert isaacgym_devices(torch.device("cuda")) == ("cuda:0", "cuda:0", 0)
    assert isaacgym_devices(CPU) == ("cpu", "cpu", -1)
    # --gpu 1 on a two-GPU machine: the worker's device, then the arguments isaacgymenvs.make receives
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = config.load(values={"worker.gpu": 1, "run.env": TASK, "worker.envs": 8})
    device = worker_mod.select_device(cfg["worker"]["gpu"])
    assert device == torch.device("cuda:1")
    # the fake records the call, then refuses: this machine has no GPU
    with pytest.raises(fake_gym.NoCudaHere):
        make_env(cfg["run"]["env"], cfg["worker"]["envs"], 7, device)
    assert fake_gym.CALLS[-1] == dict(seed=7, task="FakeReach", num_envs=8, sim_device="cuda:1",
                                      rl_device="cuda:1", graphics_device_id=1, headless=True)
    with pytest.raises(ValueError, match="NoSuchTask"):
        make_env("isaacgym:NoSuchTask", 2, 0, CPU)


def test_contract_time_outs_are_truncations_and_resets_are_deferred(fake_gym: Any) -> None:
    N = 4
    env = make_env(TASK, N, 0, CPU)
    assert isinstance(env, IsaacGymBatchedEnv)
    assert env.spec.obs_shape == (6,) and env.spec.action_shape == (3,)
    assert env.spec.action_low == (-1.0,) * 3 and env.spec.action_high == (1.0,) * 3
    task = env.task
    obs = env.reset()
    away = lambda o: torch.sign(o[:, :3] - o[:, 3:]) + (o[:, :3] == o[:, 3:]).float()  # noqa: E731
    # the fake's reset() took one step: the episode times out at progress 7, after 6 more steps
    for k in range(6):
        res = env.step(away(obs))
        if k < 5:
            assert not res.truncated.any() and not res.terminated.any()
        obs = res.obs
    assert res.truncated.all() and not res.terminated.any()
    assert res.final_obs is res.obs  # deferred resets: the obs after a time-out is the final one
    assert torch.equal(res.obs, torch.cat([task.x, task.g], -1).clamp(-5, 5))
    assert res.reward.dtype == torch.float32 and res.truncated.dtype == torch.bool
    final = res.obs.clone()
    res = env.step(torch.zeros(N, 3))  # now the task resets: a fresh episode starts
    assert not res.truncated.any() and not torch.equal(res.obs, final)
    eps = env.pop_episodes()
    assert [e["length"] for e in eps] == [6] * N and all(e["success"] is False for e in eps)
    assert env.pop_episodes() == []

    # driving towards the goal terminates with success, never truncated
    obs = res.obs
    ended = torch.zeros(N, dtype=torch.bool)
    ends = 0
    for _ in range(5):
        res = env.step((obs[:, 3:] - obs[:, :3]).mul(10).clamp(-1, 1))
        assert not (res.terminated & res.truncated).any()
        ended |= res.terminated
        ends += int(res.terminated.sum())
        obs = res.obs
    assert ended.all()
    eps = env.pop_episodes()
    assert len(eps) == int(ends) and len(eps) >= N and all(e["success"] is True for e in eps)
    returns = [e["return"] for e in eps]
    assert all(r < 0 for r in returns)  # -distance summed
    env.close()


class HostCopies(TorchFunctionMode):
    """Records every torch call that moves tensor data to the host (or synchronises on it)."""

    NAMES = {"cpu", "numpy", "tolist", "item", "__array__", "__float__", "__int__", "__index__", "__bool__"}

    def __init__(self) -> None:
        super().__init__()
        self.phase = "step"
        self.seen: List[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and any(
            (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")
            for a in list(args[1:]) + [kwargs.get("device")]
        )
        if (name in self.NAMES or to_cpu) and self.phase == "step":
            self.seen.append(name)
        return func(*args, **kwargs)


def test_contract_worker_never_copies_to_host_before_encoding(
    fake_gym: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.peers import StandInLearner  # real PUB + ROUTER sockets playing the learner

    N, T = 4, 16
    cfg = config.load(values={"run.env": TASK, "worker.envs": N, "worker.segment_length": T})
    ctx = zmq.Context()
    pull = make_socket(ctx, zmq.PULL)
    cfg["network"]["ingest_port"] = bind(pull, "127.0.0.1", 0)
    env = make_env(TASK, N, 0, CPU)
    learner = StandInLearner(ctx, env.spec, version=3)
    net = cfg["network"]
    net["publish_port"], net["learner_port"] = learner.pub_port, learner.router_port
    net["serve_port"] = learner.router_port  # the stand-in also answers the broker handshake
    mode = HostCopies()
    # encoding is the one place env data may leave the device (loading new weights is not env data): mark them
    take, pop, apply = worker_mod.SegmentBuffer.take, env.pop_episodes, worker_mod.Worker.apply

    def marked(fn: Any, phase: str) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            before, mode.phase = mode.phase, phase
            try:
                return fn(*a, **k)
            finally:
                mode.phase = before
        return run

    monkeypatch.setattr(worker_mod.SegmentBuffer, "take", marked(take, "encode"))
    monkeypatch.setattr(worker_mod.Worker, "apply", marked(apply, "weights"))
    env.pop_episodes = marked(pop, "encode")  # type: ignore[assignment]
    # inside the simulator the fake moves tensors to its rl_device, here "cpu": not zclaw's copies
    env.task.step, env.task.reset = marked(env.task.step, "sim"), marked(env.task.reset, "sim")
    stop = threading.Event()
    w = worker_mod.Worker(cfg, _Log(), 0, env, CPU, stop, ctx=ctx)
    try:
        assert w.wait_for_weights()
        with mode:
            made = w.run(max_segments=2)
        w.sender.flush(5.0)
        assert made == 2
        assert mode.seen == [], f"host copies in the step loop: {sorted(set(mode.seen))}"
        segs = []
        while len(segs) < 2 and pull.poll(5000):
            msg = parse(pull.recv_multipart(copy=False))
            if msg.kind == "segment":
                segs.append(msg)
        assert len(segs) == 2
        for seg in segs:
            a = seg.arrays
            assert a["policy_version"].tolist() == [3] * T
            trunc, term = a["truncated"], a["terminated"]
            assert not (trunc & term).any()
            at = a["final_at"]
            assert sorted(map(tuple, at.tolist())) == sorted(map(tuple, np.argwhere(trunc).tolist()))
            for (t, n), fo in zip(at, a["final_obs"]):  # deferred resets: the final obs is the next row
                np.testing.assert_array_equal(fo, a["obs"][t + 1, n])
        assert sum(len(s["episodes"]) for s in segs) > 0
        assert all(isinstance(e.get("success"), bool) for s in segs for e in s["episodes"])
        assert any(trunc.any() for trunc in (s.arrays["truncated"] for s in segs))  # 8-step episodes, T=16
    finally:
        w.close()
        learner.close()
        env.close()
        pull.close(0)
        ctx.term()


class _Log:
    """A structlog-shaped logger that drops everything (the worker logs through it)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def test_contract_zclaw_worker_imports_isaacgym_before_torch_and_trains_through_a_broker(
    tmp_path: Path
) -> None:
    from support.procs import Roles

    env = {"PYTHONPATH": str(FAKES)}
    roles = Roles(tmp_path)
    try:
        roles.start("broker")
        roles.start("learner", "--run-dir", str(tmp_path / "run"))
        roles.start("worker", "--env", TASK, "--index", "0", name="worker0", env=env)
        rep = roles.wait(roles.broker,
                         lambda r: r.get("episodes", 0) > 0 and r.get("success_rate_100") is not None,
                         timeout=180)
        assert rep["spec"]["env_id"] == TASK
        rep = roles.wait(roles.learner, lambda r: (r.get("version") or 0) >= 2, timeout=180)
    finally:
        roles.close()
    # the fake isaacgym refuses to load after torch: the worker only got there by importing it first.
    # Without the pre-import, the same fake makes the worker exit naming the cause:
    import subprocess

    p = subprocess.run(
        [sys.executable, "-c",
         "import torch, sys; from zclaw.envs.preload import preimport; preimport(sys.argv[1])",
         TASK], env={**__import__("os").environ, **env}, capture_output=True, text=True, timeout=60,
    )
    assert p.returncode != 0 and "PyTorch was imported before isaacgym" in p.stderr
    assert "torch was imported before it" in p.stderr
