"""The worker role: batched envs + a copy of the policy -> segments PUSHed to the broker.

``zclaw worker`` runs :func:`zclaw.worker.worker.main`; :class:`zclaw.worker.sender.Sender` is its bounded
send queue (backpressure). Everything here stays valid Python 3.8 (Isaac Gym workers).
"""
from __future__ import annotations

from .sender import Sender
from .worker import DeviceError, SegmentBuffer, Worker, main, select_device, worker_identity, worker_seed

__all__ = ["DeviceError", "SegmentBuffer", "Sender", "Worker", "main", "select_device", "worker_identity",
           "worker_seed"]
