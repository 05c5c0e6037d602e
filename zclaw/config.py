"""Configuration: one schema, TOML files, ``--set section.key=value`` overrides, strict validation.

The schema below is the single source of truth: defaults, types, allowed values and the one-line
documentation of every key (``docs/configuration.md`` is generated from it). Unknown keys and bad
values are rejected with the key named and what is allowed, before any process starts.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .fleet import parse_address
from .wire.messages import MAX_OPTIONS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.8-3.10 (Isaac Gym workers run on 3.8)
    import tomli as tomllib


class ConfigError(ValueError):
    """A config key that does not exist or a value that is not allowed; the message says which."""


@dataclass(frozen=True)
class Key:
    """One config key: its default, type, an optional check and the text users read."""

    default: Any
    doc: str
    type: type = type(None)
    choices: Optional[Tuple[Any, ...]] = None
    min: Optional[float] = None
    max: Optional[float] = None
    below: Optional[float] = None  # exclusive upper bound (value < below)

    @property
    def kind(self) -> type:
        return self.type if self.type is not type(None) else type(self.default)

    def allowed(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        text = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
        s = text.get(self.kind, self.kind.__name__)
        if self.min is not None and self.max is not None:
            s += f" in [{self.min}, {self.max}]"
        elif self.min is not None and self.below is not None:
            s += f" in [{self.min}, {self.below})"
        elif self.below is not None:
            s += f" < {self.below}"
        elif self.min is not None:
            s += f" >= {self.min}"
        elif self.max is not None:
            s += f" <= {self.max}"
        return s

    def check(self, name: str, value: Any) -> Any:
        kind = self.kind
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is list and isinstance(value, tuple):
            value = list(value)
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.min is not None:
            ok = value >= self.min
        if ok and self.max is not None:
            ok = value <= self.max
        if ok and self.below is not None:
            ok = value < self.below
        if not ok:
            raise ConfigError(f"config key {name} = {value!r} is not allowed: expected {self.allowed()}")
        return value


SCHEMA: Dict[str, Dict[str, Key]] = {
    "run": {
        "env": Key("gym:Reacher-v5", "environment id, prefixed by its backend (gym:<id>)"),
        "seed": Key(0, "base random seed; worker i uses seed + 1000 * i", min=0),
        "steps": Key(1_000_000, "stop `zclaw train` after this many env steps (0: no limit)", min=0),
        "time": Key(0.0, "stop `zclaw train` after this many seconds of wall time (0: no limit)", min=0),
        "workers": Key(1, "worker processes `zclaw train` starts", min=1, max=256),
        "learners": Key(1, "learner ranks `zclaw train` starts (zclaw learner --nproc N: data-parallel on "
                        "torch.distributed, gloo on CPU)", min=1, max=64),
        "brokers": Key(1, "broker processes (shards) `zclaw train` starts on loopback (network.brokers is "
                       "filled with their ports); worker i feeds shard i mod brokers", min=1, max=16),
        "run_dir": Key("runs/{time}", "run directory; {time} is replaced by the start time"),
        "stop_grace_s": Key(60.0, "`zclaw train`: seconds from Ctrl-C/SIGTERM (or the end of the run) until "
                            "every role has exited; what still runs then is SIGKILLed", min=5),
        "restarts": Key(3, "`zclaw train`: restarts allowed per role process (broker on its snapshot, "
                        "learner with --resume, workers) before a crash ends the run", min=0),
    },
    "network": {
        "broker_host": Key("127.0.0.1", "host the broker binds, and that others connect to"),
        "ingest_port": Key(5555, "broker PULL port for worker segments and hellos (0: any free port)",
                           min=0, max=65535),
        "serve_port": Key(5556, "broker ROUTER port for batch and status requests", min=0, max=65535),
        "learner_host": Key("127.0.0.1", "host the learner binds, and that workers connect to"),
        "publish_port": Key(5557, "learner PUB port for weights", min=0, max=65535),
        "learner_port": Key(5558, "learner ROUTER port for snapshot (Clone) and status requests",
                            min=0, max=65535),
        "max_message_mb": Key(0, "receive size cap of the data sockets, in MiB (ZMQ_MAXMSGSIZE; the request "
                              "sockets, broker serve and learner ROUTER, take 256 KiB whatever it says); 0: "
                              "auto (the broker's ingest cap is 2 x the largest legal segment of "
                              "worker.envs x worker.segment_length once the env spec is known, at least "
                              "1 MiB; clients 256 MiB; see docs/operations.md)", min=0),
        "request_timeout_ms": Key(3000, "Lazy Pirate: wait this long for a reply before reconnecting",
                                  min=10),
        "bind_host": Key("", "address servers bind (empty: the host they are reached at)"),
        "brokers": Key([], "broker shards as \"host:ingest_port:serve_port\" strings (empty: the one "
                       "broker at broker_host, ingest_port, serve_port); worker i feeds shard i mod len, the "
                       "learner samples every shard, `zclaw broker --shard N` binds entry N", type=list),
    },
    "worker": {
        "envs": Key(16, "environments stepped by each worker", min=1),
        "segment_length": Key(64, "steps T per segment (a segment holds T x envs transitions)", min=1),
        "send_queue": Key(8, "segments a worker holds while the broker is slow or gone (backpressure)",
                          min=1),
        "gpu": Key(-1, "device of inference and of GPU simulators: -1 for CPU, N for cuda:N (isaacgym: sim "
                   "device, rl device and graphics device id N)", min=-1),
        "threads": Key(1, "torch CPU threads per worker", min=1),
        "vectorize": Key(
            "loop", "gym: backend: step the envs in a loop in the worker, or in subprocesses (slow envs such "
            "as Fetch and ShadowHand, ~1k steps/s per core)", choices=("loop", "subprocess"),
        ),
        "env_processes": Key(0, "subprocesses for worker.vectorize = subprocess (0: one per "
                             "CPU core, at most envs)",
                             min=0),
        "max_abs_obs": Key(1e6, "an episode whose observation has an element beyond +-this (or not finite) "
                           "is ended as a truncation and counted (a simulator that blew up); the broker "
                           "drops a segment beyond it (out_of_range: a worker may be old or foreign) and "
                           "the learner's normaliser leaves such rows out. MuJoCo velocities reach "
                           "hundreds, so 1e6 leaves real tasks alone", min=1),
        "max_abs_reward": Key(1e6, "an episode whose reward is beyond +-this (or not finite) is ended as a "
                              "truncation and counted; the broker drops a segment beyond it (out_of_range); "
                              "task rewards are O(1)-O(1e3) per step", min=1),
    },
    "broker": {
        "capacity": Key(64, "segments the store holds (each of its worker's T x N; broker.eviction picks "
                        "which one a full store overwrites)", min=1),
        "mode": Key("queue", "sampling mode", choices=("queue", "uniform", "prioritized")),
        "min_size": Key(1, "segments stored before the first batch is served", min=1),
        "max_reuse": Key(1, "times a segment may be sampled (0: unlimited; queue needs >= 1)", min=0),
        "when_full": Key(
            "evict", "what a full store does when the next segment would overwrite one never sampled: evict "
            "it (counted as evicted_unused; the learner always gets the freshest data, workers never wait) "
            "or wait (stop reading segments until the learner samples: workers' send queues fill and they "
            "block, no env step is thrown away and no broker CPU is spent on data nobody uses; the broker "
            "keeps reading while the rate limiter would refuse the learner, so the two never "
            "wait for each other)",
            choices=("evict", "wait"),
        ),
        "eviction": Key(
            "fair", "which segment a full store overwrites (when_full = evict): fair, the oldest of the "
            "worker whose data was evicted unused the least in proportion to what it sent, so every "
            "worker's data reaches the learner in proportion to what it sent whatever its env count; or "
            "oldest, the oldest stored (a plain ring: with workers of unlike env counts and column-sized "
            "batches it evicts the narrow workers' data first)",
            choices=("fair", "oldest"),
        ),
        "samples_per_insert": Key(0.0, "rate limit: segments sampled per segment inserted (0: off)", min=0),
        "spi_error_buffer": Key(8.0, "rate limit slack, in segments, around samples_per_insert", min=0),
        "max_staleness": Key(-1, "drop segments older than this many policy versions at "
                             "sample time (-1: off)", min=-1),
        "priority_alpha": Key(0.6, "prioritized mode: priority exponent alpha", min=0, max=1),
        "priority_beta": Key(0.4, "prioritized mode: importance-weight exponent beta", min=0, max=1),
        "retry_ms": Key(20, "how long the broker tells a learner to wait when no batch is ready", min=1),
        "snapshot_s": Key(30.0, "seconds between store snapshots in RUN_DIR/snapshots (written off the "
                          "broker's loop, see snapshot_mode, so ingest goes on; also on SIGTERM; needs "
                          "--run-dir; 0: off). A broker crash loses at most this much ingest", min=0),
        "snapshot_mode": Key("thread", "how periodic snapshots are written without stopping ingest: from a "
                             "thread (the store's state is taken in the loop, by reference), or a forked "
                             "child (copy-on-write)", choices=("thread", "fork")),
        "option_balanced": Key(False, "queue/uniform modes: draw segments with weight sum_o n_o(seg) / "
                               "n_o(store), so segments rich in rarely used options are sampled more"),
        "request_rate": Key(5000.0, "requests per second each client may make of the broker's serve socket "
                            "on average (token bucket; beyond it the answer is retry); a learner asks "
                            "<= ~100/s", min=0.1),
        "request_burst": Key(1000.0, "requests a client may make at once before broker.request_rate applies",
                             min=1),
        "status_rate": Key(20.0, "status requests per second each client may make of the broker (a report "
                           "costs ~50 sample retries)", min=0.1),
        "status_burst": Key(40.0, "status requests a client may make at once before broker.status_rate",
                            min=1),
    },
    "learner": {
        "batch_segments": Key(4, "segments per batch request (the broker serves at most 64 per request); "
                              "see batch_columns", min=1, max=64),
        "batch_columns": Key(0, "env columns per batch (T steps of one env each): the broker serves whole "
                             "segments until their columns reach this, at most 64 segments, so workers of "
                             "different env counts make batches of one size. 0: off, batch_segments segments",
                             min=0, max=1 << 20),
        "prefetch": Key(2, "batch requests kept in flight, so the next batch arrives while "
                        "one trains (1: none)",
                        min=1, max=16),
        "epochs": Key(4, "passes over each batch", min=1),
        "minibatches": Key(16, "minibatches per pass (16: 256-sample minibatches of a default batch)", min=1),
        "lr": Key(5e-4, "Adam learning rate (docs/learning.md, Defaults: 5e-4 sits between 3e-4's slowness "
                  "and 1e-3's dips)", min=0),
        "lr_anneal": Key("off", "linear: the learning rate falls linearly from lr to 0 over the run's budget "
                         "(the larger of the fractions of run.time and run.steps gone; a run with neither "
                         "does not anneal), as CleanRL's anneal_lr; off: lr throughout",
                         choices=("off", "linear")),
        "gamma": Key(0.99, "discount", min=0, max=1),
        "lam": Key(0.95, "GAE/V-trace lambda", min=0, max=1),
        "clip": Key(0.2, "PPO clip range epsilon", min=0),
        "rho_bar": Key(1.0, "truncation of importance weights in the V-trace targets (rho bar)", min=0),
        "c_bar": Key(1.0, "truncation of trace-cutting weights (c bar)", min=0),
        "vf_coef": Key(0.5, "value loss coefficient", min=0),
        "ent_coef": Key(0.0, "entropy bonus coefficient", min=0),
        "log_std_min": Key(-2.3, "floor on the option policies' log standard deviations, applied after "
                           "every optimiser step and to fresh or resumed weights (a projection; -2.3: "
                           "sigma >= 0.1 on a [-1, 1] action): a policy whose sigma collapses makes "
                           "each log-probability ratio so sensitive to its mean that updates turn "
                           "erratic; a policy.init_log_std below it starts at the floor; the noise it "
                           "keeps costs training return on a task that charges for |a|^2 (Reacher: "
                           "-3.0 there); -20: no floor in practice", max=0),
        "adv_norm": Key("std", "per-minibatch advantage normalisation: subtract the mean and divide by the "
                        "std, as PPO implementations do (std); or subtract the mean only (center), so the "
                        "advantages keep the scaled reward's units and an update shrinks as they do",
                        choices=("std", "center")),
        "reward_scale": Key("return", "how the learner scales rewards inside the loss (workers send them "
                            "raw): "
                            "divide by the running std of the discounted return, as SB3's VecNormalize "
                            "(return), not at all (off), or keep rewards raw and normalise the critic's "
                            "values instead, its output layer rescaled on every statistics update "
                            "(popart; docs/learning.md)", choices=("return", "off", "popart")),
        "reward_clip": Key(10.0, "clip scaled rewards to +-reward_clip (reward_scale = return; popart does "
                           "not clip)", min=0.01),
        "popart_beta": Key(3e-4, "reward_scale = popart: step of the debiased moving averages of the value "
                           "targets' mean and second moment, per update (Hessel et al. 2019: 3e-4)",
                           min=1e-9, max=1.0),
        "max_grad_norm": Key(0.5, "gradient norm clip", min=0),
        "target_kl": Key(0.05, "stop a batch's epochs once a minibatch's KL from the behaviour policy "
                         "exceeds 1.5 x this (0: off)", min=0),
        "checkpoint_s": Key(30.0, "seconds between checkpoints", min=1),
        "threads": Key(1, "torch CPU threads of the learner", min=1),
        "request_rate": Key(20.0, "snapshot and status requests per second each client may make of the "
                            "learner ROUTER on average (a token bucket; beyond it the answer is retry)",
                            min=0.1),
        "request_burst": Key(40.0, "requests a client may make at once before learner.request_rate applies",
                             min=1),
        "device": Key("cpu", "torch device of the learner (cpu, cuda, cuda:N)"),
        "tensorboard": Key(True, "write TensorBoard scalars under the run directory"),
        "mode": Key("dac", "option learning rule for K > 1: dac (PPO-clip on the call-and-return policy) or "
                    "ppoc (master policy gradient + termination loss)", choices=("dac", "ppoc")),
        "master_coef": Key(1.0, "coefficient of the option-level policy loss (DAC high MDP, PPOC master)",
                           min=0),
        "master_ent_coef": Key(0.01, "entropy bonus on the policy over options pi_Omega", min=0),
        "termination_coef": Key(0.5, "ppoc: coefficient of the termination loss", min=0),
        "termination_prior": Key(0.05, "K > 1: the termination rate beta_0 the prior pulls every termination "
                                 "logit toward (mean option duration ~ 1 / beta_0 steps)", min=1e-3, below=1),
        "termination_prior_coef": Key(0.5, "K > 1: coefficient of the termination prior "
                                      "1/2 (logit beta_o(s) - logit beta_0)^2 (dac and ppoc); keeps one "
                                      "option from never terminating while the others hand "
                                      "over at once; 0: off", min=0),
        "option_pull_coef": Key(0.0, "K > 1 with residual options: coefficient of 1/K sum_o KL(option o's "
                                "own Gaussian || the shared one), the shared head held fixed, so each "
                                "option's own head departs from the shared one only where its advantage pays "
                                "(Distral); 0: off", min=0),
        "xi": Key(0.01, "ppoc: termination regulariser added to Q(s', o) - V(s') (favours longer options)"),
        "deliberation_cost": Key(0.0, "reward subtracted at every option switch that is not an episode start "
                                 "(Harb et al. 2018; K > 1)", min=0),
        "option_weights": Key(False, "weight intra-option loss terms so every option present in a batch has "
                              "equal total weight (from each option's share of the data)"),
        "option_max_weight": Key(10.0, "cap on a sample's per-option loss weight", min=1),
        "student_lr": Key(1e-3, "Adam learning rate of the distilled student (its own optimiser; 0: off)",
                          min=0),
        "health_collapse_duration": Key(1.5, "warn when the mean option duration falls below this many steps "
                                        "(options terminating every step)", min=1),
        "health_dominant_share": Key(0.95, "warn when one option takes more than this share of the steps",
                                     min=0, max=1),
        "health_identical_spread": Key(0.05, "warn when two options' action means differ by less than this "
                                       "share of the action range (RMS over action dimensions, on the "
                                       "probe batch; options that act alike); with residual options "
                                       "scaled by 2 (1 - policy.option_share), since the shared head brings "
                                       "the means closer by construction; 0: off", min=0, max=1),
        "health_warmup_updates": Key(50, "updates before the 'options act alike' warning may fire (options "
                                     "start alike)", min=0),
    },
    "policy": {
        "hidden": Key([64, 64], "hidden layer sizes of the actor and critic MLPs", type=list),
        "activation": Key("tanh", "hidden activation", choices=("tanh", "relu", "elu")),
        "options": Key(1, "number of options K (1: flat PPO)", min=1, max=MAX_OPTIONS),
        "init_log_std": Key(-0.5, "initial log standard deviation of the Gaussian policies"),
        "normalize_obs": Key(True, "running mean/variance observation normalisation"),
        "obs_clip": Key(10.0, "clip normalised observations to +-obs_clip", min=0),
        "option_epsilon": Key(0.3, "K > 1: epsilon of the epsilon-soft policy over options, "
                              "pi_Omega(o|s) = (1 - eps) softmax(z(s))_o + eps / K, so every option is "
                              "picked on at least eps / K of option choices and none is starved of data "
                              "(Bacon et al. 2017's epsilon-greedy master, differentiable); workers sample "
                              "from it and the learner trains it; 0: plain softmax; ignored for K = 1",
                              min=0, below=1),
        "option_residual": Key(True, "K > 1: each intra-option Gaussian averages a shared head and the "
                               "option's own, mu_o(s) = s mu(s) + (1 - s) m_o(s) and log sigma_o = s log "
                               "sigma + (1 - s) l_o (s: option_share), so every step trains the shared part "
                               "and an option picked rarely still acts as well as the others instead of "
                               "being abandoned untrained; false: K independent heads; ignored for K = 1"),
        "option_share": Key(0.9, "K > 1 with option_residual: the shared head's weight s; larger s, more "
                            "of every option learns from every step and options differ less (on Ant-v5 "
                            "K = 4 was 44 % under K = 1 at 0.5, 38 % at 0.75, 8.6 % at 0.9; on Pusher-v5 0.9 "
                            "matched 0.75 with the options still distinct; docs/learning.md)",
                            min=0.01, below=1),
        "critic_residual": Key(True, "K > 1 with option_residual: the option values too average a shared "
                               "value and the option's own, Q(s, o) = s V(s) + (1 - s) q_o(s) (s: "
                               "option_share), so every step trains the shared value (Ant-v5 K = 4 at 300 s: "
                               "median 1,906 against 1,462 without, 3 seeds; docs/learning.md); false: K "
                               "independent value outputs"),
    },
    "log": {
        "level": Key("info", "log level", choices=("debug", "info", "warning", "error")),
        "format": Key("auto", "console on a TTY, JSON lines otherwise", choices=("auto", "console", "json")),
        "status_s": Key(10.0, "seconds between status log lines of each role", min=0.1),
        "metrics_s": Key(2.0, "seconds between the learner's lines in RUN_DIR/metrics.jsonl and its "
                         "broker/worker TensorBoard scalars (0: off); `zclaw plot` reads metrics.jsonl",
                         min=0),
    },
    "security": {  # resolved per role by zclaw/security.py; docs/multihost.md explains the layout
        "keys_dir": Key("", "directory made by `zclaw keys generate`; set: CURVE encryption and the client "
                        "allowlist on every socket (each role picks its files by name)"),
        "name": Key("", "name of this process's client key pair (empty: learner, worker<index>, or tools for "
                    "status tools and the launcher)"),
        "server_secret": Key("", "secret cert of this server (empty: "
                             "KEYS_DIR/private/<broker|learner>.key_secret)"),
        "client_secret": Key("", "secret cert this process connects with (empty: "
                             "KEYS_DIR/private/<name>.key_secret)"),
        "broker_public": Key("", "public cert of the broker (empty: KEYS_DIR/servers/broker.key)"),
        "learner_public": Key("", "public cert of the learner (empty: KEYS_DIR/servers/learner.key)"),
        "allowed_clients": Key("", "directory of client public certs the servers admit (empty: "
                               "KEYS_DIR/allowed); read at start"),
        "insecure": Key(False, "allow binding beyond loopback without CURVE (`--insecure`); logs a warning"),
    },
}


def _validate_hidden(cfg: Dict[str, Dict[str, Any]]) -> None:
    hidden = cfg["policy"]["hidden"]
    if not hidden or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hidden):
        raise ConfigError(f"config key policy.hidden = {hidden!r} is not allowed: expected a list "
                          "of positive integers")


def _validate_cross(cfg: Dict[str, Dict[str, Any]]) -> None:
    """Refuse configurations that can never serve a batch (they would deadlock, not fail)."""
    b, L = cfg["broker"], cfg["learner"]
    if b["min_size"] > b["capacity"]:
        raise ConfigError(f"broker.min_size = {b['min_size']} exceeds broker.capacity = "
                          f"{b['capacity']}: never serves")
    if L["batch_columns"] == 0 and L["batch_segments"] > b["capacity"]:
        raise ConfigError(
            f"learner.batch_segments = {L['batch_segments']} exceeds broker.capacity = "
            f"{b['capacity']}: never serves"
        )
    if b["mode"] == "queue" and b["max_reuse"] == 0:
        raise ConfigError("broker.max_reuse = 0 (unlimited) is not allowed in queue mode: expected >= 1")
    if b["samples_per_insert"] > 0 and b["spi_error_buffer"] < 1:
        raise ConfigError("broker.spi_error_buffer must be >= 1 when samples_per_insert is on, "
                          "or nothing is served")
    env = cfg["run"]["env"]
    if ":" not in env:
        raise ConfigError(f"config key run.env = {env!r} is not allowed: expected "
                          "<backend>:<id>, e.g. gym:Reacher-v5")


def _validate_brokers(cfg: Dict[str, Dict[str, Any]]) -> None:
    seen = set()
    for entry in cfg["network"]["brokers"]:
        try:
            a = parse_address(entry) if isinstance(entry, str) else None
        except ValueError as exc:
            a, why = None, str(exc)
        else:
            why = "expected a string"
        if a is None:
            raise ConfigError(f"config key network.brokers = {cfg['network']['brokers']!r} is not allowed: "
                              f"{why}; expected a list of \"host:ingest_port:serve_port\" strings")
        for port in (a.ingest_port, a.serve_port):
            if (a.host, port) in seen:
                raise ConfigError(f"config key network.brokers lists {a.host}:{port} twice")
            seen.add((a.host, port))


VALIDATORS: List[Callable[[Dict[str, Dict[str, Any]]], None]] = [
    _validate_hidden, _validate_cross, _validate_brokers]


def defaults() -> Dict[str, Dict[str, Any]]:
    return {sec: {k: copy.deepcopy(key.default) for k, key in keys.items()} for sec, keys in SCHEMA.items()}


def _merge(cfg: Dict[str, Dict[str, Any]], data: Mapping[str, Any], origin: str) -> None:
    for sec, values in data.items():
        if sec not in SCHEMA:
            raise ConfigError(f"{origin}: unknown section [{sec}]; known sections: {', '.join(SCHEMA)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: [{sec}] must be a table")
        for k, v in values.items():
            if k not in SCHEMA[sec]:
                raise ConfigError(f"{origin}: unknown key {sec}.{k}; keys of [{sec}]: "
                                  f"{', '.join(SCHEMA[sec])}")
            cfg[sec][k] = SCHEMA[sec][k].check(f"{sec}.{k}", v)


def parse_override(text: str) -> Tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as a TOML value, or as a bare string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    sec, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"x = {raw}")["x"]
    except tomllib.TOMLDecodeError:
        value = raw
    return sec, key, value


def load(
    path: Optional[str] = None, overrides: Sequence[str] = (), values: Optional[Mapping[str, Any]] = None
) -> Dict[str, Dict[str, Any]]:
    """Defaults, then the TOML file at ``path``, then ``--set`` overrides, then ``values`` (``"sec.key"`` ->
    value, from command-line flags); validated as a whole."""
    cfg = defaults()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        _merge(cfg, data, str(path))
    for text in overrides:
        sec, key, value = parse_override(text)
        _merge(cfg, {sec: {key: value}}, "--set")
    for dotted, value in (values or {}).items():
        sec, key = dotted.split(".", 1)
        _merge(cfg, {sec: {key: value}}, "option")
    for check in VALIDATORS:
        check(cfg)
    return cfg


def from_mapping(data: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """A validated config from a mapping (a resolved config read back from a run directory)."""
    cfg = defaults()
    _merge(cfg, data, "config")
    for check in VALIDATORS:
        check(cfg)
    return cfg


def to_toml(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """Render a config as TOML (the subset of types the schema uses)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    lines = []
    for sec, values in cfg.items():
        lines.append(f"[{sec}]")
        lines.extend(f"{k} = {fmt(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)


def reference_markdown() -> str:
    """``docs/configuration.md``: every key of the schema with its default, what is
    allowed and its meaning."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `zclaw/config.py` by `zclaw config docs > docs/configuration.md`;",
        "a test fails when this file and the schema disagree. Values come from the defaults below,",
        "then `--config FILE` (TOML), then `--set section.key=value` (repeatable), then a command's",
        "own flags. Unknown keys and values that are not allowed are rejected with the key named.",
        "",
    ]
    for sec, keys in SCHEMA.items():
        out += [f"## [{sec}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for name, key in keys.items():
            default = to_toml({"x": {"v": key.default}}).splitlines()[1][4:]
            out.append(f"| `{name}` | `{default}` | {key.allowed()} | {key.doc} |")
        out.append("")
    return "\n".join(out)
