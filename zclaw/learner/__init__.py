"""The learner role: V-trace + PPO-clip updates on broker batches, versioned weights on PUB, checkpoints.

* :mod:`zclaw.learner.trainer` -- :class:`Trainer`, one update per batch
  (the losses are in :mod:`zclaw.policy.losses`);
* :mod:`zclaw.learner.checkpoint` -- atomic save / load / resume checks;
* :mod:`zclaw.learner.server` -- the process: Lazy Pirate to the broker, PUB + Clone snapshot to workers;
* :mod:`zclaw.learner.distributed` -- data-parallel ranks on torch.distributed (what the ranks agree on);
* :mod:`zclaw.learner.ranks` -- ``zclaw learner --nproc N``: start and watch N ranks on one machine.
"""
from .checkpoint import CheckpointError
from .trainer import Trainer

__all__ = ["CheckpointError", "Trainer"]
