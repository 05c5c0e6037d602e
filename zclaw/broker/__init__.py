"""The broker role: the store between workers and learner (ring of segments, sampling modes, rate
limiter) and the process that serves it over ZeroMQ. See ``zclaw/core.py`` for where it sits."""
from .ratelimit import SampleToInsertRatio
from .server import main
from .store import Store

__all__ = ["SampleToInsertRatio", "Store", "main"]
