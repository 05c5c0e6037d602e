"""Weights messages: the learner publishes them, workers apply them; one codec serves both sides.

A ``weights`` message carries the version, the env steps the learner has consumed, the env spec hash,
the architecture (so a worker can build the network before it has ever seen the learner) and every
parameter and normaliser buffer as an array. It is always sent packed (one frame) because workers
subscribe with ``CONFLATE`` and a conflated socket keeps only the last frame of a multipart message.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from ..wire import EnvSpec, Message, WireError, make, pack
from .networks import OptionPolicy, PolicyConfig


def policy_config(policy_section: Mapping[str, Any], spec: EnvSpec) -> PolicyConfig:
    """The architecture from the run config's ``[policy]`` section and the env spec.

    ``option_epsilon`` is stored as 0 for K = 1, where the master is inert and it means nothing: a flat
    run's architecture does not depend on it (and matches checkpoints written before it existed); likewise
    ``option_share`` is stored as 0.5 (and so left out of the weights header) unless options are residual,
    and ``critic_residual`` as false.
    """
    options = int(policy_section["options"])
    residual = bool(policy_section.get("option_residual", False)) and options > 1
    return PolicyConfig(
        obs_dim=int(np.prod(spec.obs_shape)),
        act_dim=int(np.prod(spec.action_shape)),
        hidden=tuple(policy_section["hidden"]),
        activation=policy_section["activation"],
        options=options,
        init_log_std=float(policy_section["init_log_std"]),
        normalize_obs=bool(policy_section["normalize_obs"]),
        obs_clip=float(policy_section["obs_clip"]),
        option_epsilon=float(policy_section.get("option_epsilon", 0.0)) if options > 1 else 0.0,
        option_residual=residual,
        option_share=float(policy_section.get("option_share", 0.5)) if residual else 0.5,
        critic_residual=bool(policy_section.get("critic_residual", False)) and residual,
    )


def weights_message(
    model: OptionPolicy, version: int, step: int, spec_hash: str, learner: Optional[str] = None
) -> bytes:
    """The packed single-frame ``weights`` message for ``model`` at ``version``.

    ``learner`` names the publishing process: workers accept a *lower* version from a new learner
    (one resumed from an older checkpoint after a crash), never from the same one.
    """
    arrays = model.weight_arrays()
    extra = {} if learner is None else {"learner": learner}
    return pack(make("weights", arrays, version=int(version), step=int(step), spec_hash=spec_hash,
                     policy=model.cfg.to_dict(), **extra))


def model_from_weights(msg: Message) -> OptionPolicy:
    """Build a network from a ``weights`` message and load it (workers do this on join)."""
    cfg = header_config(msg)
    try:
        model = OptionPolicy(cfg)
    except (TypeError, KeyError, ValueError) as exc:
        raise WireError("bad_weights", f"cannot build the network from the weights header ({exc})") from None
    load_weights(model, msg)
    return model


def header_config(msg: Message) -> PolicyConfig:
    """The architecture a ``weights`` message's ``policy`` header names; a header that is not one (a missing
    key, a wrong type, a value out of range such as ``option_share`` 2) is :class:`WireError` ``bad_weights``,
    so a worker drops and counts it instead of failing."""
    try:
        return PolicyConfig.from_dict(msg["policy"])
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise WireError("bad_weights", f"cannot build the network from the weights header ({exc})") from None


def load_weights(model: OptionPolicy, msg: Message) -> None:
    """Load a ``weights`` message into ``model``; raise :class:`WireError` if it does not fit."""
    if header_config(msg) != model.cfg:
        raise WireError("bad_weights", "weights are for a different architecture")
    try:
        model.load_weight_arrays(msg.arrays)
    except ValueError as exc:
        raise WireError("bad_weights", str(exc)) from None
