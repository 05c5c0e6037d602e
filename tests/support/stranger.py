"""A worker written from docs/protocol.md alone: plain pyzmq, msgpack and numpy, and nothing of zclaw.

tests/wire/test_protocol_doc.py runs it against real ``zclaw broker`` and ``zclaw learner`` processes, in a
process where ``import zclaw`` fails, so whatever it needs must come from the doc; section names below are
the doc's.
It is a minimal conforming worker: it says hello, adopts the run's segment length, rebuilds the policy from
a ``weights`` message, steps a tiny env of its own and pushes segments. What a long-running worker adds
(the heartbeat, Lazy Pirate retries, a bounded send queue) is left out.

    python tests/support/stranger.py --ingest P --serve P --publish P --learner P [--envs N] [--segments S]

prints one JSON line: what it sent and which weights versions acted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import struct
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

PROTOCOL = 2

# ----------------------------------------------------------------------------------------- "Framing"


def encode(kind: str, fields: Dict[str, Any], arrays: Optional[Dict[str, np.ndarray]] = None) -> List[bytes]:
    """Frames ``[header, array bytes...]``: each array one frame, ``[name, dtype, shape]`` in the header."""
    arrays = arrays or {}
    listed = [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]
    header = dict(fields, kind=kind, v=PROTOCOL, arrays=listed)
    return [msgpack.packb(header, use_bin_type=True)] + [np.ascontiguousarray(a).tobytes()
                                                         for a in arrays.values()]


def decode(frames: List[bytes]) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """(header, arrays) of a multipart message or of the packed single frame; joins arrays sent in parts."""
    packed = len(frames) == 1 and frames[0][:1] == b"\x00"
    if packed:
        (length,) = struct.unpack(">I", frames[0][:4])
        header = msgpack.unpackb(frames[0][4:4 + length], raw=False)
        body, pos = memoryview(frames[0]), 4 + length
    else:
        header = msgpack.unpackb(frames[0], raw=False)
        rest = iter(frames[1:])
    arrays = {}
    for entry in header["arrays"]:
        name, dtype, shape = entry[0], np.dtype(entry[1]), list(entry[2])
        axis, sizes = (entry[3], entry[4]) if len(entry) == 5 else (0, None)
        shapes = [shape] if sizes is None else [shape[:axis] + [n] + shape[axis + 1:] for n in sizes]
        parts = []
        for part in shapes:
            if packed:
                size = math.prod(part) * dtype.itemsize
                buf, pos = body[pos:pos + size], pos + size
            else:
                buf = next(rest)
            parts.append(np.frombuffer(buf, dtype).reshape(part))
        arrays[name] = parts[0] if sizes is None else np.concatenate(parts, axis)
    return header, arrays


# -------------------------------------------------------------------------------- "Env spec and its hash"


def env_spec(env_id: str, obs_shape: Any, action_shape: Any, low: Any, high: Any) -> Dict[str, Any]:
    """The spec map: shapes as lists of ints, bounds flattened in row-major order as floats."""
    def flat(bound: Any) -> List[float]:
        return [float(x) for x in np.asarray(bound, np.float64).reshape(-1)]

    return {"env_id": env_id, "obs_shape": [int(d) for d in obs_shape],
            "action_shape": [int(d) for d in action_shape],
            "action_low": flat(low), "action_high": flat(high)}


def canonical(spec: Dict[str, Any]) -> bytes:
    """msgpack of the five fields in this order (Python floats pack as float64, ints as short as they fit)."""
    keys = ("env_id", "obs_shape", "action_shape", "action_low", "action_high")
    return msgpack.packb({k: spec[k] for k in keys}, use_bin_type=True)


def spec_hash(spec: Dict[str, Any]) -> str:
    return hashlib.sha256(canonical(spec)).hexdigest()[:16]


# ------------------------------------------------------------------------------- "The policy map"

ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))),
}
NORM_EPS = 1e-8


def gaussian_logp(action: np.ndarray, mean: np.ndarray, log_std: np.ndarray) -> np.ndarray:
    var = np.exp(2 * log_std)
    return (-((action - mean) ** 2) / (2 * var) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)


def call_and_return(pi: np.ndarray, beta_prev: np.ndarray, prev: np.ndarray, start: np.ndarray) -> np.ndarray:
    """pi_hat(o | s, o_prev) [N, K]: keep o_prev with 1 - beta, else pick from pi (beta = 1 at a start)."""
    beta = np.where(start, 1.0, beta_prev)[:, None]
    stay = np.eye(pi.shape[1])[prev]
    return (1 - beta) * stay + beta * pi


def array_shapes(p: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Every array a ``weights`` message of policy header ``p`` carries, with its shape (the map's table)."""
    D, A, K, H = p["obs_dim"], p["act_dim"], p["options"], list(p["hidden"])
    r = int(K > 1 and p["option_residual"])
    c = int(r == 1 and p.get("critic_residual", False))
    shapes: Dict[str, Tuple[int, ...]] = {"obs_norm.mean": (D,), "obs_norm.var": (D,), "obs_norm.count": (),
                                          "log_std": (K, A), "student_log_std": (A,)}
    if r:
        shapes["shared_log_std"] = (A,)
    last = {"actor": (K + r) * A, "critic": K + c, "master": K, "termination": K, "student": A}
    for net, out_last in last.items():
        sizes = [D] + H + [out_last]
        for i in range(len(H) + 1):
            shapes[f"{net}.{2 * i}.weight"] = (sizes[i + 1], sizes[i])
            shapes[f"{net}.{2 * i}.bias"] = (sizes[i + 1],)
    return shapes


class Policy:
    """The network of a ``weights`` message, evaluated in float64 numpy."""

    def __init__(self, header: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> None:
        self.version, self.learner, self.p = header["version"], header.get("learner"), header["policy"]
        self.w = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
        self.K, self.A = self.p["options"], self.p["act_dim"]
        self.residual = self.K > 1 and self.p["option_residual"]
        self.share = self.p.get("option_share", 0.5)  # headers from before the key: the even average

    def net(self, name: str, x: np.ndarray) -> np.ndarray:
        layers = len(self.p["hidden"])
        for i in range(layers + 1):
            x = x @ self.w[f"{name}.{2 * i}.weight"].T + self.w[f"{name}.{2 * i}.bias"]
            if i < layers:
                x = ACTIVATIONS[self.p["activation"]](x)
        return x

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        x = np.asarray(obs, np.float64).reshape(len(obs), -1)
        if not self.p["normalize_obs"]:
            return x
        std = np.sqrt(self.w["obs_norm.var"] + NORM_EPS)
        return np.clip((x - self.w["obs_norm.mean"]) / std, -self.p["obs_clip"], self.p["obs_clip"])

    def gaussians(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Means [N, K, A] and log standard deviations [K, A] of the K intra-option Gaussians."""
        heads = self.net("actor", x).reshape(len(x), self.K + self.residual, self.A)
        if self.residual:
            s, shared = self.share, self.w["shared_log_std"]
            return ((1 - s) * heads[:, :self.K] + s * heads[:, self.K:],
                    (1 - s) * self.w["log_std"] + s * shared)
        return heads, self.w["log_std"]

    def master(self, x: np.ndarray) -> np.ndarray:
        """pi_Omega(. | s) [N, K]: the epsilon-soft softmax of the master's logits."""
        z = self.net("master", x)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        eps = self.p["option_epsilon"]
        return (1 - eps) * p + eps / self.K

    def beta(self, x: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-self.net("termination", x)))

    def act(self, obs: np.ndarray, prev: np.ndarray, start: np.ndarray,
            rng: np.random.Generator) -> Dict[str, np.ndarray]:
        """One call-and-return step for N envs: what a segment records of it."""
        x, N, rows = self.normalize(obs), len(obs), np.arange(len(obs))
        if self.K == 1:
            option, option_start, logp_option = np.zeros(N, int), start.copy(), np.zeros(N)
        else:
            pi, beta = self.master(x), self.beta(x)[rows, prev]
            option_start = start | (rng.random(N) < beta)
            picked = (rng.random(N)[:, None] < np.cumsum(pi, -1)).argmax(-1)
            option = np.where(option_start, picked, prev)
            logp_option = np.log(np.maximum(call_and_return(pi, beta, prev, start)[rows, option], 1e-12))
        means, log_stds = self.gaussians(x)
        mean, log_std = means[rows, option], log_stds[option]
        action = mean + np.exp(log_std) * rng.standard_normal(mean.shape)
        return {"action": action, "logp_action": gaussian_logp(action, mean, log_std), "option": option,
                "option_start": option_start, "logp_option": logp_option}


# ---------------------------------------------------------------------------------- the stranger's env


class Reach1D:
    """N points on a line, each steered toward its own goal: done within 0.05 of it (terminated) or after
    LIMIT steps (truncated); an env that ends is reset at once (its next observation starts a new episode)."""

    SPEC = env_spec("stranger:Reach1D-v0", (3,), (1,), [-1.0], [1.0])
    LIMIT = 12

    def __init__(self, n: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pos, self.goal = np.zeros(n), np.zeros(n)
        self.t, self.ret = np.zeros(n, int), np.zeros(n)
        self.reset(np.ones(n, bool))

    def reset(self, which: np.ndarray) -> None:
        k = int(which.sum())
        self.pos[which], self.goal[which] = self.rng.uniform(-1, 1, k), self.rng.uniform(-1, 1, k)
        self.t[which], self.ret[which] = 0, 0.0

    def obs(self) -> np.ndarray:
        return np.stack([self.pos, self.goal, self.goal - self.pos], 1).astype("<f4")

    def step(self, action: np.ndarray) -> Tuple[Any, ...]:
        self.pos = np.clip(self.pos + 0.25 * action[:, 0], -1, 1)
        self.t += 1
        reward = -np.abs(self.goal - self.pos)
        self.ret += reward
        terminated = -reward < 0.05
        truncated = (self.t >= self.LIMIT) & ~terminated
        final = self.obs()
        done = terminated | truncated
        episodes = [{"return": float(self.ret[n]), "length": int(self.t[n]), "success": bool(terminated[n])}
                    for n in np.flatnonzero(done)]
        self.reset(done)
        return self.obs(), reward, terminated, truncated, final, episodes


# ------------------------------------------------------------------------------- "A worker's session"


class Refused(Exception):
    """The broker or learner turned this worker away (or it cannot match the run): stop, do not retry."""


def segment_bytes(T: int, N: int, obs: int, act: int, M: int = 0) -> int:
    """A segment's bytes with M truncations, with the 16,000-byte header allowance: the 4-byte arrays (obs,
    action, reward, option, the two log-probs), the three bool ones, policy_version, final_obs, final_at."""
    return (16_000 + 4 * ((T + 1) * N * obs + T * N * act + 4 * T * N) + 3 * T * N + 8 * T
            + M * (4 * obs + 8))


class StrangerWorker:
    """Handshake, ingest, weights, then segments of :class:`Reach1D` (see :meth:`run`)."""

    def __init__(self, host: str, ports: Dict[str, int], envs: int, segment_length: int, index: int = 0,
                 seed: int = 0, timeout_s: float = 60.0) -> None:
        self.host, self.ports, self.N, self.T = host, ports, envs, segment_length
        self.identity = f"w{index}-{socket.gethostname()}-{os.getpid()}"
        self.spec, self.hash = Reach1D.SPEC, spec_hash(Reach1D.SPEC)
        self.env, self.rng = Reach1D(envs, seed), np.random.default_rng(seed + 1)
        self.timeout_s, self.seq, self.policy = timeout_s, 0, None
        self.ctx = zmq.Context()

    def endpoint(self, port: str) -> str:
        return f"tcp://{self.host}:{self.ports[port]}"

    def hello(self) -> List[bytes]:
        return encode("hello", {"role": "worker", "identity": self.identity, "host": socket.gethostname(),
                                "pid": os.getpid(), "zclaw": "stranger-1", "spec": self.spec,
                                "segment_length": self.T})

    def request(self, port: str, frames: List[bytes]) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
        """One REQ round trip on a fresh socket (what Lazy Pirate does on every retry)."""
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint(port))
        try:
            sock.send_multipart(frames)
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"no answer on the {port} port")
            header, arrays = decode(sock.recv_multipart())
        finally:
            sock.close()
        if header["kind"] == "refused":
            raise Refused(f"{header['cause']}: {header['reason']}")
        return header, arrays

    def handshake(self) -> Dict[str, Any]:
        welcome, _ = self.request("serve_port", self.hello())
        assert welcome["kind"] == "welcome", welcome
        if spec_hash(welcome["spec"]) != self.hash:
            raise Refused("bad_spec: the run has another env spec")
        self.T = welcome["segment_length"]  # the run's T, before the first step
        if segment_bytes(self.T, self.N, obs=3, act=1) > welcome["max_message_bytes"]:
            raise Refused("bad_shape: a segment cannot fit the broker's message cap")
        return welcome

    def connect(self) -> None:
        """PUSH to ingest (a hello on every connection, ahead of segments) and SUB to the learner's PUB."""
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 5000)  # close() hands what is queued to the broker
        self.push.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        self.monitor = self.push.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.push.connect(self.endpoint("ingest_port"))
        self.push.send_multipart(self.hello())
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.CONFLATE, 1)  # before connect: only the newest weights are kept
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # the empty topic: every message
        self.sub.connect(self.endpoint("publish_port"))

    def send(self, frames: List[bytes]) -> None:
        while self.monitor.poll(0):  # a (re)connection: the broker may be new, so hello first
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_CONNECTED:
                self.push.send_multipart(self.hello())
        self.push.send_multipart(frames)

    def snapshot(self) -> Policy:
        """The learner's current weights (Clone pattern), asked until it has some."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            header, arrays = self.request("learner_port", encode("snapshot", {"spec_hash": self.hash}))
            if header["kind"] == "weights":
                return self.accept(header, arrays)
            assert header["kind"] == "retry", header
            time.sleep(header["retry_ms"] / 1000)
        raise TimeoutError("the learner had no weights")

    def accept(self, header: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> Policy:
        assert header["spec_hash"] == self.hash, header["spec_hash"]
        return Policy(header, arrays)

    def newer_weights(self) -> None:
        try:
            header, arrays = decode([self.sub.recv(zmq.NOBLOCK)])
        except zmq.Again:
            return
        if header["version"] > self.policy.version or header.get("learner") != self.policy.learner:
            self.policy = self.accept(header, arrays)

    def run(self, segments: int) -> Dict[str, Any]:
        self.handshake()
        self.connect()
        self.policy = self.snapshot()
        T, N = self.T, self.N
        obs, prev, start = self.env.obs(), np.zeros(N, int), np.ones(N, bool)
        low, high = np.array(self.spec["action_low"]), np.array(self.spec["action_high"])
        versions, finals_sent, empty_finals = [], 0, 0
        for _ in range(segments):
            a = {"obs": np.zeros((T + 1, N, 3), "<f4"), "action": np.zeros((T, N, 1), "<f4"),
                 "reward": np.zeros((T, N), "<f4"), "terminated": np.zeros((T, N), "|b1"),
                 "truncated": np.zeros((T, N), "|b1"), "option": np.zeros((T, N), "<i4"),
                 "option_start": np.zeros((T, N), "|b1"), "logp_action": np.zeros((T, N), "<f4"),
                 "logp_option": np.zeros((T, N), "<f4"), "policy_version": np.zeros(T, "<i8")}
            finals: List[Tuple[int, int, np.ndarray]] = []
            episodes: List[Dict[str, Any]] = []
            for t in range(T):
                self.newer_weights()
                out = self.policy.act(obs, prev, start, self.rng)
                a["obs"][t] = obs
                step = self.env.step(np.clip(out["action"], low, high))  # the env gets the clipped action
                obs, reward, terminated, truncated, final, ended = step
                a["action"][t], a["reward"][t] = out["action"], reward
                a["terminated"][t], a["truncated"][t] = terminated, truncated
                for k in ("option", "option_start", "logp_action", "logp_option"):
                    a[k][t] = out[k]
                a["policy_version"][t] = self.policy.version
                finals += [(t, n, final[n]) for n in np.flatnonzero(truncated)]
                episodes += ended
                prev, start = out["option"], terminated | truncated
            a["obs"][T] = obs
            a["final_obs"] = np.array([f for _, _, f in finals], "<f4").reshape(len(finals), 3)
            a["final_at"] = np.array([(t, n) for t, n, _ in finals], "<i4").reshape(len(finals), 2)
            self.send(encode("segment", {"worker": self.identity, "seq": self.seq, "spec_hash": self.hash,
                                         "episodes": episodes}, a))
            self.seq += 1
            versions.append(int(a["policy_version"].min()))
            finals_sent += len(finals)
            empty_finals += not finals
        return {"identity": self.identity, "T": T, "envs": N, "segments": self.seq, "versions": versions,
                "final_obs_rows": finals_sent, "segments_without_truncation": empty_finals,
                "spec_hash": self.hash}

    def close(self) -> None:
        if getattr(self, "push", None) is not None:
            self.push.disable_monitor()
        for sock in (getattr(self, "push", None), getattr(self, "sub", None), getattr(self, "monitor", None)):
            if sock is not None:
                sock.close()
        self.ctx.term()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    for port in ("ingest", "serve", "publish", "learner"):
        ap.add_argument(f"--{port}", type=int, required=True)
    ap.add_argument("--envs", type=int, default=2)
    ap.add_argument("--segment-length", type=int, default=8)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ports = {f"{p}_port": getattr(args, p) for p in ("ingest", "serve", "publish", "learner")}
    worker = StrangerWorker(args.host, ports, args.envs, args.segment_length, args.index, args.seed)
    try:
        print(json.dumps(worker.run(args.segments)))
    except Refused as exc:
        print(json.dumps({"refused": str(exc)}))
        return 3
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
