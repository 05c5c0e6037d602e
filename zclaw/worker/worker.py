"""The worker role: step a batch of envs with the newest policy, PUSH T-step segments to the broker.

Loop (see ``zclaw/core.py`` for the nouns)::

    envs = make_env(run.env, worker.envs, run.seed + 1000 * index, device)   # -> EnvSpec
    REQ  -> broker serve: hello (identity, host, pid, spec) -> welcome, or refused: log why, exit 3;
            then the same hello every 5 s as a heartbeat that never blocks (zclaw/worker/session.py)
    PUSH -> broker ingest: hello on every (re)connection, ahead of segments
    SUB  <- learner PUB (CONFLATE, subscribed before connecting)
    weights = snapshot request to the learner ROUTER (ZeroMQ guide's Clone pattern: a late SUB misses
              what was published before it joined, so a new worker asks for the current state)
    every step:  newer weights on SUB? apply them (never blocks)
                 act -> clip to the action bounds -> env.step; record the unclipped action, the option,
                 the behaviour log-probs and the policy version that acted
    every T steps: Segment -> bounded send queue (blocks only when the broker falls behind: backpressure)

Why the unclipped action is recorded: the behaviour log-prob was computed for it, and the learner's
importance ratios must use the same sample. Why the policy version is per step: weights can change in
the middle of a segment, and the learner measures and corrects staleness per step.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import zmq

from .. import __version__
from .. import logs
from ..core import BatchedEnv
from ..envs import make_env
from ..policy.networks import OptionPolicy
from ..policy.weights import header_config, load_weights, model_from_weights
from ..telemetry import EpisodeWindow, ResourceMeter, cuda_index
from ..fleet import as_shard, broker_shards, shard_of_worker
from ..wire import DropCounter, LazyPirate, Message, Segment, WireError, make, make_socket, parse, tcp
from ..wire.limits import MAX_EPISODES, MAX_SEGMENT_STEPS
from ..wire.messages import EnvSpec, max_segment_bytes
from .. import startup
from ..security import Security
from ..stopping import EXIT_OK, EXIT_REFUSED
from .sender import Sender
from .session import BrokerSession, Refused

HEARTBEAT_S = 5.0
WAIT_LOG_S = 5.0
#: PUSH socket high-water mark: small, so that segments wait in the worker's own bounded, measured queue
PUSH_HWM = 2
#: how long shutdown may spend trying to send what is still queued
FLUSH_S = 1.0


class DeviceError(ValueError):
    """``--gpu N`` names a CUDA device this machine does not have."""


def select_device(gpu: int) -> torch.device:
    """-1 -> CPU; N -> ``cuda:N``, refused with a clear message when there is no such device."""
    if gpu < 0:
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpu >= count:
        raise DeviceError(f"--gpu {gpu}: no such CUDA device (this machine has {count})")
    return torch.device(f"cuda:{gpu}")


def worker_identity(index: int) -> str:
    """``w<index>-<host>-<pid>``: unique per process, readable in the broker's per-worker report."""
    return f"w{index}-{socket.gethostname()}-{os.getpid()}"


def worker_seed(base_seed: int, index: int) -> int:
    return int(base_seed) + 1000 * int(index)


# ------------------------------------------------------------------------------------ segment buffer


class SegmentBuffer:
    """Preallocated tensors of one segment in wire layout, on the env's device, filled step by step.

    Why on the env's device: a GPU backend (Isaac Gym, MuJoCo Warp) hands out device tensors, and a
    per-step device-to-host copy would stall the simulator every step. The step loop only writes
    device tensors into device rows; :meth:`take` copies the whole segment to the host once, when it
    is encoded, and hands out fresh host arrays, so a segment still waiting in the send queue (sent
    zero-copy) is never overwritten by the next one. On a CPU backend the same code is one copy per
    step into the buffer, as before.
    """

    def __init__(self, T: int, N: int, spec: EnvSpec, device: Optional[torch.device] = None) -> None:
        self.T, self.N, self.spec = T, N, spec
        dev = torch.device("cpu") if device is None else torch.device(device)
        self.device = dev
        A = spec.action_shape

        def z(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        self.obs = z((T + 1, N) + spec.obs_shape, torch.float32)
        self.action = z((T, N) + A, torch.float32)
        self.reward = z((T, N), torch.float32)
        self.terminated = z((T, N), torch.bool)
        self.truncated = z((T, N), torch.bool)
        self.option = z((T, N), torch.int32)
        self.option_start = z((T, N), torch.bool)
        self.logp_action = z((T, N), torch.float32)
        self.logp_option = z((T, N), torch.float32)
        self.policy_version = np.zeros((T,), np.int64)  # known on the host; never touches the device
        #: sparse final observations of dict-style backends: (t, n, obs) with obs on any device
        self.finals: List[Tuple[int, int, torch.Tensor]] = []
        #: dense final observations of device backends, allocated on first use: [T, N, *obs_shape]
        self.final_dense: Optional[torch.Tensor] = None
        #: device backends whose obs after a time-out is the final one: finals come from obs[t + 1]
        self.final_from_next = False
        self.episodes: List[Dict[str, Any]] = []
        #: episodes that ended but were left out of a segment's stats (more than MAX_EPISODES in one)
        self.episodes_unreported = 0
        #: device backends: env-steps masked by ValueGuard.sanitize in this segment (read once, in take)
        self.out_of_range = torch.zeros((), dtype=torch.int64, device=dev)
        #: set by take(): the segment had blown-up envs, every episode was truncated at its end, reset them
        self.reset_needed = False

    def record_finals(self, t: int, final_obs: Any, obs: torch.Tensor) -> None:
        """Keep step ``t``'s final observations in whichever form the backend gave them (see StepResult)."""
        if isinstance(final_obs, dict):
            for n, fo in final_obs.items():
                self.finals.append((t, int(n), fo.reshape(self.spec.obs_shape)))
        elif final_obs is obs:
            if self.final_dense is not None:  # converted to dense by a forced truncation (ValueGuard)
                self.final_dense[t] = obs
            else:
                self.final_from_next = True
        else:
            if self.final_dense is None:
                self.final_dense = torch.zeros(
                    (self.T, self.N) + self.spec.obs_shape, dtype=torch.float32, device=self.device
                )
            self.final_dense[t] = final_obs

    def arrays(self) -> Dict[str, torch.Tensor]:
        return {
            "obs": self.obs, "action": self.action, "reward": self.reward, "terminated": self.terminated,
            "truncated": self.truncated, "option": self.option, "option_start": self.option_start,
            "logp_action": self.logp_action, "logp_option": self.logp_option,
        }

    def take(self) -> Tuple[Dict[str, np.ndarray], List[Dict[str, Any]]]:
        """Host copies of the filled arrays plus the sparse truncation arrays and episode stats; then reset.

        This is the one place segment data leaves the device.
        """
        masked = int(self.out_of_range)  # the one host read of the value guard on a device backend
        self.reset_needed = masked > 0
        if masked:  # blown-up envs were masked until now: end every episode here, the worker resets them
            self.out_of_range.zero_()
            ended = self.terminated[-1] | self.truncated[-1]
            if self.final_dense is not None:
                rows = (~ended).reshape((-1,) + (1,) * len(self.spec.obs_shape))
                self.final_dense[-1] = torch.where(rows, self.obs[-1], self.final_dense[-1])
            self.truncated[-1] |= ~ended
        out: Dict[str, np.ndarray] = {k: v.to("cpu", copy=True).numpy() for k, v in self.arrays().items()}
        out["policy_version"] = self.policy_version.copy()
        finals = [(t, n, fo.to("cpu").numpy()) for t, n, fo in self.finals]
        if self.final_dense is not None or self.final_from_next:
            at = np.argwhere(out["truncated"])  # row-major: ordered by step, then env
            if self.final_dense is not None:  # one host copy of all rows (a boolean mask is row-major too)
                rows = self.final_dense[torch.as_tensor(out["truncated"], device=self.device)].cpu().numpy()
            else:
                rows = out["obs"][at[:, 0] + 1, at[:, 1]]
            finals.extend((int(t), int(n), row) for (t, n), row in zip(at, rows))
            finals.sort(key=lambda f: (f[0], f[1]))
        if finals:
            out["final_obs"] = np.stack([f for _, _, f in finals]).astype(np.float32, copy=False)
            out["final_at"] = np.array([[t, n] for t, n, _ in finals], dtype=np.int32)
        else:
            out["final_obs"] = np.zeros((0,) + self.spec.obs_shape, np.float32)
            out["final_at"] = np.zeros((0, 2), np.int32)
        episodes = self.episodes
        if len(episodes) > MAX_EPISODES:
            # the wire carries at most MAX_EPISODES episode stats per segment (the broker drops more as
            # oversize_field): a worker of thousands of envs ends more than that in one segment, so it
            # reports the newest ones (return statistics are means of recent episodes) and counts the rest
            self.episodes_unreported += len(episodes) - MAX_EPISODES
            episodes = episodes[-MAX_EPISODES:]
        self.finals = []
        self.final_from_next = False
        self.episodes = []
        return out, episodes


# ------------------------------------------------------------------------------------- value bounds


class ValueGuard:
    """Ends episodes whose simulator blew up: an observation element beyond ``max_abs_obs`` or a reward
    beyond ``max_abs_reward`` (or either not finite) ends that episode at once as a *truncation*.

    Why a truncation, and what is sent instead of the offending values: the data must stay valid for
    the learner, and its observation normaliser must never see the blown-up numbers (one 1e30
    observation poisons the running variance for good). So the step that produced them is kept, with

    * its reward clamped to +-``max_abs_reward`` (NaN -> 0): the transition happened, its size is lost;
    * ``truncated`` set and ``terminated`` cleared: the episode did not reach a real end, so the
      learner bootstraps instead of assuming a value of 0;
    * as final observation (what the bootstrap value is computed from) the *previous* observation of
      that env, the last one known to be in range: an in-distribution state of the same episode,
      whereas a clipped or zeroed one would be a state the policy never saw.

    Backends reset all envs at once (``BatchedEnv.reset``; there is no per-env reset), so the other
    envs' episodes are truncated at the same step too, each with its own (valid) observation as final
    one, and the worker resets every env. Counted per cause in :attr:`drops`
    (``obs_out_of_range``, ``reward_out_of_range``: episodes that blew up) and :attr:`cut_short`
    (healthy episodes ended with them). On a host (CPU) backend the check is one reduction per step.

    A device backend (Isaac Gym, MuJoCo Warp: those with ``pop_episodes``, see :class:`zclaw.core.BatchedEnv`)
    must never be read back to the host inside the step loop (each read stalls the simulator): there
    :meth:`sanitize` does the same on the device, with no read at all.
    Each step, an env whose values are out of range gets its step truncated, its reward clamped, the last
    in-range observation as its final one, and that observation (not the blown-up one) is what the policy
    acts on next; its simulator state cannot be reset alone, so it is masked the same way every step until
    the segment ends. The segment's one host copy (:meth:`SegmentBuffer.take`) reads the device count; if
    any env blew up, every episode is truncated at the segment's last step and the worker resets all envs.
    """

    def __init__(self, max_abs_obs: float, max_abs_reward: float, log: Any) -> None:
        self.max_obs, self.max_reward = float(max_abs_obs), float(max_abs_reward)
        self.drops = DropCounter(log, "episodes (values out of range: a simulator blew up)")
        self.cut_short = 0

    def sanitize(self, buf: "SegmentBuffer", t: int, res: Any) -> torch.Tensor:
        """Device backends: rewrite step ``t`` of ``buf`` for every env out of range, on the device and
        without a host read; return the observation to act on next (see the class docstring)."""
        bad = self._bad_obs(res.obs) | ~torch.isfinite(res.reward) | (res.reward.abs() > self.max_reward)
        if not isinstance(res.final_obs, dict) and res.final_obs is not res.obs:
            bad = bad | (self._bad_obs(res.final_obs) & res.truncated)
        lim = self.max_reward
        buf.reward[t] = torch.nan_to_num(buf.reward[t], nan=0.0, posinf=lim, neginf=-lim).clamp(-lim, lim)
        buf.truncated[t] |= bad
        buf.terminated[t] &= ~bad
        if buf.final_dense is None:  # dense finals: what the backend ended keeps its own, bad envs get theirs
            dense = torch.zeros((buf.T, buf.N) + buf.spec.obs_shape, dtype=torch.float32, device=buf.device)
            if buf.final_from_next:
                dense[:t] = buf.obs[1:t + 1]
            buf.final_dense, buf.final_from_next = dense, False
            if not isinstance(res.final_obs, dict):
                dense[t] = res.final_obs
        keep = buf.obs[t]  # what the envs acted on at t: in range (sanitized the step before)
        rows = bad.reshape((-1,) + (1,) * len(buf.spec.obs_shape))
        buf.final_dense[t] = torch.where(rows, keep, buf.final_dense[t])
        buf.out_of_range += bad.sum()
        return torch.where(rows, keep, res.obs)

    def _bad_obs(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        return ~torch.isfinite(x).all(1) | (x.abs() > self.max_obs).any(1)

    def check(self, res: Any) -> Optional[Tuple[torch.Tensor, torch.Tensor, Dict[int, bool]]]:
        """None when every value of ``res`` is in range; else (bad obs [N], bad reward [N], envs whose
        recorded final observation is out of range)."""
        bad_obs = self._bad_obs(res.obs)
        r = res.reward
        bad_rew = ~torch.isfinite(r) | (r.abs() > self.max_reward)
        bad_final: Dict[int, bool] = {}
        if isinstance(res.final_obs, dict):
            for n, fo in res.final_obs.items():
                if bool(self._bad_obs(fo.reshape(1, -1)).any()):
                    bad_final[int(n)] = True
        elif res.final_obs is not res.obs:
            bad_obs = bad_obs | (self._bad_obs(res.final_obs) & res.truncated)
        if not bad_final and not bool((bad_obs | bad_rew).any()):
            return None
        return bad_obs, bad_rew, bad_final

    def truncate(
        self, buf: "SegmentBuffer", t: int, found: Tuple[torch.Tensor, torch.Tensor, Dict[int, bool]],
        res: Any,
    ) -> None:
        """Rewrite step ``t`` of ``buf`` as described in the class docstring; the caller then resets every
        env. ``buf.obs[t]`` holds the observation acted on at ``t`` (the previous, in-range one)."""
        bad_obs, bad_rew, bad_final = found
        N = buf.N
        bad = (bad_obs | bad_rew).to("cpu").tolist()
        for n in bad_final:
            bad[n] = True
        done = (buf.terminated[t] | buf.truncated[t]).to("cpu").tolist()
        # the final observation of every env ended here: the last in-range one for a blown-up env, the
        # new observation for a healthy one (an env the backend already ended keeps its own final)
        replace: Dict[int, torch.Tensor] = {}
        for n in range(N):
            if bad[n]:
                prev = torch.nan_to_num(buf.obs[t][n], nan=0.0, posinf=0.0, neginf=0.0)
                replace[n] = prev.clamp(-self.max_obs, self.max_obs)
            elif not done[n]:
                replace[n] = res.obs[n]
                self.cut_short += 1
        if bad_obs.any():
            self.drops.drop("obs_out_of_range", f"{int(bad_obs.sum())} env(s) at step {t}")
        if bad_rew.any():
            self.drops.drop("reward_out_of_range", f"{int(bad_rew.sum())} env(s) at step {t}")
        for _ in bad_final:
            self.drops.drop("obs_out_of_range", f"a final observation at step {t}")
        lim = self.max_reward
        buf.reward[t] = torch.nan_to_num(buf.reward[t], nan=0.0, posinf=lim, neginf=-lim).clamp(-lim, lim)
        for n in replace:
            buf.terminated[t, n] = False
            buf.truncated[t, n] = True
        if buf.final_from_next or (buf.final_dense is None and not isinstance(res.final_obs, dict)):
            # deferred-reset backends take finals from obs[t + 1], which the reset overwrites: switch this
            # buffer to dense finals (rows before t from the next observations, row t from this step)
            dense = torch.zeros((buf.T, N) + buf.spec.obs_shape, dtype=torch.float32, device=buf.device)
            dense[:t] = buf.obs[1:t + 1]
            dense[t] = res.obs
            buf.final_dense, buf.final_from_next = dense, False
        if buf.final_dense is not None:
            for n, fo in replace.items():
                buf.final_dense[t, n] = fo
        else:
            buf.finals = [f for f in buf.finals if not (f[0] == t and f[1] in replace)]
            buf.finals.extend((t, n, fo) for n, fo in sorted(replace.items()))

    def counts(self) -> Dict[str, int]:
        return dict(self.drops.as_dict(), cut_short=self.cut_short)


# ------------------------------------------------------------------------------------------ weights


class WeightsClient:
    """The worker's side of weight distribution: SUB for new versions, Clone-pattern snapshot on join."""

    def __init__(
        self, ctx: zmq.Context, cfg: Dict[str, Dict[str, Any]], spec: EnvSpec, log: Any,
        security: Optional[Security] = None,
    ) -> None:
        net = cfg["network"]
        self.spec = spec
        self.log = log
        sec = security if security is not None else Security.from_config(cfg, "worker", log=log)
        max_bytes = int(net["max_message_mb"]) << 20
        self.sub = make_socket(ctx, zmq.SUB, max_message_bytes=max_bytes, conflate=True,
                               curve=sec.client("learner"))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # subscribe before connecting, or the first messages are lost
        self.sub.connect(tcp(net["learner_host"], net["publish_port"]))
        self.pirate = LazyPirate(
            ctx,
            tcp(net["learner_host"], net["learner_port"]),
            timeout_ms=min(int(net["request_timeout_ms"]), 1000),
            retries=0,
            max_message_bytes=max_bytes,
            curve=sec.client("learner"),
        )
        self.drops = DropCounter(log, "weights")
        #: the learner process whose weights we act on (the ``learner`` field of its weights)
        self.learner: Optional[str] = None

    def _accept(self, msg: Message, current: int) -> Optional[Message]:
        if msg.kind != "weights":
            self.drops.drop("unexpected_kind", msg.kind)
            return None
        if msg["spec_hash"] != self.spec.hash:
            self.drops.drop("bad_spec", f"weights for spec {msg['spec_hash']}, worker runs {self.spec.hash}")
            return None
        src = msg.get("learner")
        if src is not None and self.learner is not None and src != self.learner:
            # another learner process: one resumed (--resume) from a checkpoint older than the weights we
            # act on, after a crash. Its version counter is the run's now, even if lower than ours.
            self.log.info("new learner process; acting on its weights", learner=src, previous=self.learner,
                          version=msg["version"], was=current)
            self.learner = src
            return msg
        if msg["version"] < current:  # the same learner never goes back; a stale duplicate
            self.drops.drop("older_version", f"weights version {msg['version']} < current {current}")
            return None
        if msg["version"] == current:  # the same weights again (republished, or snapshot after PUB)
            return None
        if src is not None:
            self.learner = src
        return msg

    def poll(self, current: int) -> Optional[Message]:
        """The newest weights on SUB with version > ``current``, or None; never blocks."""
        if not (self.sub.getsockopt(zmq.EVENTS) & zmq.POLLIN):
            return None
        newest: Optional[Message] = None
        while True:
            try:
                frame = self.sub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = parse([frame], kinds=("weights",))
            except WireError as exc:
                self.drops.drop(exc.cause, str(exc))
                continue
            ok = self._accept(msg, current if newest is None else newest["version"])
            if ok is not None:
                newest = ok
        return newest

    def snapshot(self, stop: Callable[[], bool], tick: Callable[[], None]) -> Optional[Message]:
        """Ask the learner for its current weights until it answers (or a PUB arrives, or ``stop()``).

        ``tick`` runs between tries (the worker sends its heartbeat there). Returns None only on stop.
        """
        request = make("snapshot", spec_hash=self.spec.hash)
        started = time.monotonic()
        last_log = 0.0
        while not stop():
            tick()
            msg = self.poll(-1)
            if msg is not None:
                return msg
            reply = self.pirate.request(request, kinds=("weights", "retry", "error", "refused"), stop=stop)
            if reply is not None and reply.kind == "refused":
                raise Refused("learner", reply["cause"], reply["reason"])
            if reply is not None and reply.kind == "weights":
                msg = self._accept(reply, -1)
                if msg is not None:
                    return msg
            now = time.monotonic()
            if now - last_log >= WAIT_LOG_S:
                reason = "no reply" if reply is None else reply.get("reason", reply.kind)
                self.log.info(
                    "waiting for learner", endpoint=self.pirate.endpoint, waited_s=round(now - started, 1),
                    reason=reason,
                )
                last_log = now
            pause = 0.2
            if reply is not None and reply.kind == "retry":
                pause = min(max(reply["retry_ms"], 10), 1000) / 1000.0
            elif reply is not None:
                pause = 1.0  # a refusal ("error") or unusable weights: do not hammer the learner
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline and not stop():
                time.sleep(0.02)
        return None

    def close(self) -> None:
        self.pirate.close()
        self.sub.close(linger=0)


# ------------------------------------------------------------------------------------------- worker


class Worker:
    """One worker process's state: envs, policy copy, sockets, segment buffer; :meth:`run` is the loop."""

    def __init__(
        self,
        cfg: Dict[str, Dict[str, Any]],
        log: Any,
        index: int,
        env: BatchedEnv,
        device: torch.device,
        stop: threading.Event,
        ctx: Optional[zmq.Context] = None,
        security: Optional[Security] = None,
    ) -> None:
        self.cfg = cfg
        self.log = log
        self.index = index
        # CURVE keys as worker<index> (None: from cfg; raises ConfigError before any socket exists)
        self.security = (security if security is not None
                         else Security.from_config(cfg, "worker", index, log=log))
        self.env = env
        self.device = device
        self.stop = stop
        self.spec = env.spec
        self.identity = worker_identity(index)
        #: this process's CPU, memory, threads and (--gpu N, a GPU simulator) GPU: sent in every hello (the
        #: heartbeat, every HEARTBEAT_S), which is how the broker's report and `zclaw status` show it
        gpu = cuda_index(device)
        self.resources = ResourceMeter(gpu=gpu if gpu is not None else cuda_index(getattr(env, "device", "")))
        self.T = int(cfg["worker"]["segment_length"])
        self.N = int(env.num_envs)
        self.ctx = ctx if ctx is not None else zmq.Context()
        self._own_ctx = ctx is None
        #: the broker shard this worker feeds (worker i: shard i mod S, zclaw.fleet); its one broker endpoint
        self.shard = shard_of_worker(index, len(broker_shards(cfg)))
        net = as_shard(cfg, self.shard)["network"]
        push = make_socket(self.ctx, zmq.PUSH, max_message_bytes=int(net["max_message_mb"]) << 20,
                           hwm=PUSH_HWM, curve=self.security.client("broker"))
        push.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing inside ZeroMQ for a broker that is not connected
        push.connect(tcp(net["broker_host"], net["ingest_port"]))
        self.push = push
        self.sender = Sender(push, int(cfg["worker"]["send_queue"]), log, hello=self._hello_frames)
        self.weights = WeightsClient(self.ctx, cfg, self.spec, log, security=self.security)
        self.session = BrokerSession(
            self.ctx, tcp(net["broker_host"], net["serve_port"]), self._hello_frames, log,
            spec_hash=self.spec.hash, timeout_ms=int(net["request_timeout_ms"]), interval_s=HEARTBEAT_S,
            curve=self.security.client("broker"),
        )
        self.model: Optional[OptionPolicy] = None
        self.version = -1
        self.seq = 0
        self._started = time.monotonic()  # reset when run() starts; join_s in the "acting" line
        self.steps = 0
        self.episodes = EpisodeWindow()  # the episodes this worker's envs ended (and sent)
        self.buf = SegmentBuffer(self.T, self.N, self.spec, getattr(env, "device", device))
        self.low = torch.tensor(self.spec.action_low, dtype=torch.float32, device=device).reshape(
            self.spec.action_shape
        )
        self.high = torch.tensor(self.spec.action_high, dtype=torch.float32, device=device).reshape(
            self.spec.action_shape
        )
        self._last_status = time.monotonic()
        self._steps_at_status = 0
        w = cfg["worker"]
        self.guard = ValueGuard(float(w["max_abs_obs"]), float(w["max_abs_reward"]), log)

    # -- messages ----------------------------------------------------------------------------------
    def _hello_frames(self) -> List[Any]:
        return make(
            "hello", role="worker", identity=self.identity, host=socket.gethostname(), pid=os.getpid(),
            zclaw=__version__, spec=self.spec.to_dict(), segment_length=self.T,
            resources=self.resources.report(),  # ~100 bytes: CPU, memory, threads, GPU (the status view)
        )

    def adopt_segment_length(self, T: Optional[int], cap: int) -> None:
        """Take the run's steps per segment from the broker's welcome (protocol v2: T is one per run, the env
        count is each worker's own), before the first step; from then on the session holds the broker to
        it (a later welcome with another T refuses this worker: its segments could not be stored).
        Checked before anything is allocated: T within the wire's bound, the segments within ``cap``."""
        T = self.T if T is None else int(T)
        if not 1 <= T <= MAX_SEGMENT_STEPS:
            raise Refused("broker", "bad_shape",
                          f"the run's segment length {T} is outside 1..{MAX_SEGMENT_STEPS}")
        self.check_fits(T, cap)
        if T != self.T:
            self.log.info("segment length set by the run", T=T, configured=self.T)
            self.T = T
            self.buf = SegmentBuffer(self.T, self.N, self.spec, self.buf.device)
        self.session.segment_length = self.T

    def check_fits(self, T: int, cap: int) -> None:
        """Stop now, saying why, when even this worker's smallest segment (T x N, no truncation) exceeds the
        broker's message cap: every segment would be dropped as ``oversize`` after the worker paid for it.
        When only a segment full of truncations could exceed it, warn (such a segment would be dropped)."""
        least = max_segment_bytes(self.spec, T, self.N, truncations=0)
        if least > cap:
            raise Refused("broker", "bad_shape",
                          f"a segment of {T} steps x {self.N} envs is at least {least} bytes, over the "
                          f"broker's {cap}-byte message cap: raise network.max_message_mb on the broker (0: "
                          "sized for worker.envs) or run fewer envs per worker")
        most = max_segment_bytes(self.spec, T, self.N)
        if most > cap:
            self.log.warning("a segment with many truncations could exceed the broker's message cap",
                             most_bytes=most, cap_bytes=cap, T=T, envs=self.N)

    def heartbeat(self) -> None:
        """The REQ heartbeat to the broker (``hello`` every :data:`HEARTBEAT_S`, answers collected without
        blocking; raises :class:`Refused`)."""
        self.session.tick()

    # -- weights -----------------------------------------------------------------------------------
    def apply(self, msg: Message) -> bool:
        """Load ``msg`` into the policy copy (build it on first weights, or if the architecture changed).

        A message that neither fits the copy nor builds a network is dropped and counted, and the copy
        already acting stays: one bad header does not leave the worker without a policy."""
        try:
            if self.model is not None and header_config(msg) == self.model.cfg:
                load_weights(self.model, msg)
            else:  # first weights, or the learner now serves another architecture: rebuild from its header
                model = model_from_weights(msg).to(self.device)
                model.eval()
                self.model = model
        except WireError as exc:
            self.weights.drops.drop(exc.cause, str(exc))
            return False
        first = self.version < 0
        self.version = int(msg["version"])
        logs.set_version(self.version)
        if first:  # join_s: from "worker starting" (envs built) to acting, the join latency operators watch
            self.log.info("acting", version=self.version, learner_step=msg["step"], envs=self.N, T=self.T,
                          join_s=round(time.monotonic() - self._started, 3))
        else:
            self.log.debug("new weights", version=self.version)
        return True

    def wait_for_weights(self) -> bool:
        while not self.stop.is_set():
            msg = self.weights.snapshot(self.stop.is_set, self.heartbeat)
            if msg is None:
                return False
            if self.apply(msg):
                return True
            # unusable weights (counted): ask again, but not in a tight loop
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not self.stop.is_set():
                time.sleep(0.02)
        return False

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, max_segments: Optional[int] = None) -> int:
        """Collect and send segments until stopped (or ``max_segments`` were produced);
        return segments made."""
        self._started = time.monotonic()
        self.log.info(
            "worker starting", identity=self.identity, env=self.spec.env_id, envs=self.N, T=self.T,
            device=str(self.device), spec_hash=self.spec.hash, shard=self.shard,
        )
        self.sender.hello()
        welcome = self.session.handshake(self.stop.is_set)  # refused: raises Refused
        if welcome is None:
            return 0
        self.adopt_segment_length(welcome["segment_length"], int(welcome["max_message_bytes"]))
        if not self.wait_for_weights():
            return 0
        stop = self.stop
        env, buf, T, N = self.env, self.buf, self.T, self.N
        obs = env.reset()
        # device backends hand out episode stats per segment
        pop_episodes = getattr(env, "pop_episodes", None)
        prev_option = torch.zeros(N, dtype=torch.long, device=self.device)
        episode_start = torch.ones(N, dtype=torch.bool, device=self.device)
        made = 0
        self._last_status = time.monotonic()
        self._steps_at_status = 0
        while not stop.is_set() and (max_segments is None or made < max_segments):
            t = 0
            while t < T:
                if stop.is_set():
                    break
                self.heartbeat()  # a clock read and a zero-timeout poll; sends every HEARTBEAT_S
                if self.sender.queued:  # the broker was slow: hand it what waits as soon as it takes it
                    self.sender.pump()
                newer = self.weights.poll(self.version)
                if newer is not None:
                    self.apply(newer)
                assert self.model is not None
                out = self.model.act(obs, prev_option, episode_start)
                action = out["action"]
                # device rows only: nothing leaves the env's device until buf.take() (see SegmentBuffer);
                # obs is copied before the step, so a backend may hand out one buffer it updates in place
                buf.obs[t] = obs
                res = env.step(torch.max(torch.min(action, self.high), self.low))
                buf.action[t] = action
                buf.reward[t] = res.reward
                buf.terminated[t] = res.terminated
                buf.truncated[t] = res.truncated
                buf.option[t] = out["option"]
                buf.option_start[t] = out["option_start"]
                buf.logp_action[t] = out["logp_action"]
                buf.logp_option[t] = out["logp_option"]
                buf.policy_version[t] = self.version
                if not isinstance(res.final_obs, dict) or res.final_obs:
                    buf.record_finals(t, res.final_obs, res.obs)
                if res.episodes:
                    buf.episodes.extend(res.episodes)
                episode_start = res.terminated | res.truncated
                prev_option = out["option"]
                obs = res.obs
                if pop_episodes is not None:  # a device backend (core.BatchedEnv): no host read per step
                    obs = self.guard.sanitize(buf, t, res)
                else:
                    found = self.guard.check(res)
                    if found is not None:  # a simulator blew up: end every episode here, send no bad value
                        self.guard.truncate(buf, t, found, res)
                        obs = env.reset()
                        episode_start = torch.ones(N, dtype=torch.bool, device=self.device)
                t += 1
            if t < T:  # stopped mid-segment: an incomplete segment is not a segment
                break
            buf.obs[T] = obs
            if pop_episodes is not None:
                buf.episodes.extend(pop_episodes())
            arrays, episodes = buf.take()
            if buf.reset_needed:  # device backend: envs blew up in this segment (ValueGuard.sanitize)
                self.guard.drops.drop("obs_out_of_range", f"segment {self.seq}: envs masked and reset")
                obs = env.reset()
                episode_start = torch.ones(N, dtype=torch.bool, device=self.device)
            self.episodes.add(episodes)
            segment = Segment(self.identity, self.seq, self.spec.hash, arrays, episodes)
            self.seq += 1
            made += 1
            self.steps += T * N
            self.sender.send(segment.frames(), stop.is_set, idle=self._idle)
            self._status()
        return made

    def _idle(self) -> None:
        """While blocked by backpressure: keep the heartbeat and the status line going."""
        self.heartbeat()
        self._status()

    def _status(self) -> None:
        """The periodic status line (every ``log.status_s``): rate, version, queue state."""
        now = time.monotonic()
        dt = now - self._last_status
        if dt < float(self.cfg["log"]["status_s"]):
            return
        steps = self.steps - self._steps_at_status
        self._last_status, self._steps_at_status = now, self.steps
        self.log.info(
            "status",
            steps_per_s=round(steps / dt, 1),
            steps=self.steps,
            segments=self.seq,
            version=self.version,
            episodes=self.episodes.total,
            return_mean_100=self.episodes.return_mean(),
            out_of_range=self.guard.counts(),
            episodes_unreported=self.buf.episodes_unreported,
            resources=self.resources.report(now),
            **self.sender.counters(),
        )

    def close(self) -> None:
        """Flush queued segments for up to :data:`FLUSH_S`, report what could not be sent, close sockets.

        Segments counted as sent may still sit in ZeroMQ's outgoing queue (up to the socket's HWM);
        the PUSH socket lingers for what is left of the budget so they reach the broker too."""
        deadline = time.monotonic() + FLUSH_S
        unsent = self.sender.flush(FLUSH_S)
        left = self.sender.close()
        if unsent:
            self.log.warning("segments left unsent at exit", unsent=len(left), sent=self.sender.sent)
        self.session.close()
        self.weights.close()
        self.push.close(linger=int(max(0.0, deadline - time.monotonic()) * 1000))
        if self._own_ctx:
            self.ctx.term()


# --------------------------------------------------------------------------------------------- main


def main(cfg: Dict[str, Dict[str, Any]], log: Any, index: int) -> int:
    """Run one worker until SIGINT/SIGTERM; return the exit code (zclaw/stopping.py): 0 on a clean stop,
    2 when it cannot start (device, keys, envs), 3 when a server refused it."""
    return startup.run_role(log, lambda stop: _run(cfg, log, index, stop))


def _run(cfg: Dict[str, Dict[str, Any]], log: Any, index: int, stop: threading.Event) -> int:
    """:func:`main`'s body, run with the stop signals installed (zclaw/startup.py)."""
    try:
        device = select_device(int(cfg["worker"]["gpu"]))
    except DeviceError as exc:
        raise startup.CannotStart(str(exc)) from None
    # before the envs are built: a missing key is found in a second, not after env start-up
    security = startup.security(cfg, "worker", log, index)
    torch.set_num_threads(int(cfg["worker"]["threads"]))
    seed = worker_seed(cfg["run"]["seed"], index)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    try:
        env = make_env(
            cfg["run"]["env"], int(cfg["worker"]["envs"]), seed, device,
            vectorize=cfg["worker"]["vectorize"], env_processes=int(cfg["worker"]["env_processes"]),
        )
    except (ValueError, ImportError) as exc:
        raise startup.CannotStart("cannot build the environments", env=cfg["run"]["env"],
                                  error=str(exc)) from None
    worker = None
    code = EXIT_OK
    try:
        worker = Worker(cfg, log, index, env, device, stop, security=security)
        worker.run()
    except Refused as exc:  # a mismatch that retrying cannot fix: say why and exit non-zero
        log.error("refused; exiting", server=exc.server, cause=exc.cause, reason=exc.reason,
                  spec_hash=env.spec.hash, exit_code=EXIT_REFUSED)
        code = EXIT_REFUSED
    finally:
        if worker is not None:
            worker.close()
        env.close()
    log.info(
        "worker stopped", segments=worker.seq if worker else 0, steps=worker.steps if worker else 0,
        sent=worker.sender.sent if worker else 0, exit_code=code,
    )
    return code
