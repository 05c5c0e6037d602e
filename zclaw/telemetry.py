"""Telemetry every role keeps: rates over a sliding window and the statistics of recent episodes.

Why one module: the broker, the learner and the worker each report a throughput and the mean return of
the last 100 episodes; written once here, the three reports mean the same thing by the same name
(``*_rate`` / ``*_per_s`` over the last :data:`RATE_WINDOW_S` seconds, ``return_mean_100``,
``success_rate_100``). Roles hand these small objects their events; they hold no sockets and no logger.
Importable on Python 3.8 (workers run there for Isaac Gym).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Deque, Dict, Iterable, Mapping, Optional, Tuple

#: window of the recent rates in every report, seconds
RATE_WINDOW_S = 10.0
#: episodes the ``*_100`` statistics are taken over
EPISODE_WINDOW = 100


class RateMeter:
    """Events per second over the last ``window_s`` seconds (or since start, if younger)::

        rate(now) = sum of n over the events added in (now - window_s, now] / min(window_s, now - t0)
    """

    def __init__(self, window_s: float = RATE_WINDOW_S, now: Optional[float] = None) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s = {window_s!r} is not allowed: expected a number > 0")
        self.window_s = float(window_s)
        self.t0 = time.monotonic() if now is None else now
        self._events: Deque[Tuple[float, float]] = deque()
        self._sum = 0.0

    def add(self, n: float, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, float(n)))
        self._sum += n
        self._trim(now)

    def _trim(self, now: float) -> None:
        limit = now - self.window_s
        while self._events and self._events[0][0] < limit:
            self._sum -= self._events.popleft()[1]

    def rate(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        span = min(self.window_s, now - self.t0)
        return self._sum / span if span > 1e-3 else 0.0


class EpisodeWindow:
    """The returns and successes of the last ``size`` episodes, and how many episodes ended in all.

    Episodes come as the ``episodes`` entries of segments and batches (maps with ``return``, ``length``
    and, where the env reports one, ``success``); :meth:`add` takes the well-formed ones and skips the
    rest, so a report never fails on what a peer sent.
    """

    def __init__(self, size: int = EPISODE_WINDOW) -> None:
        self.returns: Deque[float] = deque(maxlen=size)
        self.successes: Deque[bool] = deque(maxlen=size)
        self.total = 0

    def add(self, episodes: Iterable[Any]) -> Dict[str, list]:
        """Fold episode maps in; returns the batch's own ``returns``, ``lengths`` and ``successes``."""
        out: Dict[str, list] = {"returns": [], "lengths": [], "successes": []}
        for ep in episodes:
            if not isinstance(ep, Mapping):
                continue
            r = ep.get("return")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                continue
            out["returns"].append(float(r))
            if isinstance(ep.get("length"), int) and not isinstance(ep.get("length"), bool):
                out["lengths"].append(ep["length"])
            if isinstance(ep.get("success"), bool):
                out["successes"].append(ep["success"])
        self.total += len(out["returns"])
        self.returns.extend(out["returns"])
        self.successes.extend(out["successes"])
        return out

    def return_mean(self) -> Optional[float]:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def success_rate(self) -> Optional[float]:
        return sum(1 for s in self.successes if s) / len(self.successes) if self.successes else None

    def state(self) -> Dict[str, Any]:
        """What a snapshot or checkpoint keeps (see :meth:`restore`)."""
        return {"episodes_total": self.total, "returns": list(self.returns),
                "successes": list(self.successes)}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.total = int(state.get("episodes_total", 0))
        self.returns.extend(float(r) for r in state.get("returns", []))
        self.successes.extend(bool(s) for s in state.get("successes", []) if isinstance(s, bool))
