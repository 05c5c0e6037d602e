"""Per-identity token buckets: fair request service for every role's request socket.

Why: a ROUTER socket answers whoever asks, in arrival order. One client that sends requests as fast as
it can (a buggy retry loop, or a hostile peer) then takes most of the service thread's time, and a
worker that joins meanwhile waits behind it. A token bucket per identity bounds what any one client
can cost (``rate`` requests per second on average, ``burst`` at once) while leaving clients that ask
at a normal pace untouched; refused requests are answered ``retry`` (cheap: no payload), so a
well-behaved client simply asks again later.

The bucket itself is the textbook one (as in Reverb's and Envoy's rate limiters): arithmetic only, no
thread, no timer. The caller supplies ``now`` (any monotonic clock, in seconds), which keeps the class
deterministic and testable.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional, Tuple

__all__ = ["TokenBucket"]


def _positive_finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} = {value!r} must be a finite number > 0")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} = {value!r} must be a finite number > 0")
    return float(value)


class TokenBucket:
    """One token bucket per identity, for a bounded number of identities.

    Each identity ``i`` has ``tokens_i``, starting full at ``burst``. A request from ``i`` at time
    ``now`` first refills, then takes one token if it can::

        tokens_i = min(burst, tokens_i + (now - last_i) * rate)      (refill; last_i = now)
        allowed  iff tokens_i >= 1                                   (then tokens_i -= 1)
        wait     = (1 - tokens_i) / rate                             (seconds, when refused)

    So over any window of ``T`` seconds an identity is allowed at most ``burst + rate * T`` requests.
    A refused request costs no token (a client that keeps asking while refused is not punished
    further, and is not allowed sooner either). A clock that goes backwards refills nothing.

    At most ``max_identities`` identities are tracked; a new identity beyond that evicts the one that
    asked least recently (LRU). An evicted identity comes back with a full bucket, which is the
    cost of bounded memory: a client that cycles through more than ``max_identities`` identities can
    get ``burst`` requests per identity. ZeroMQ ROUTER identities are chosen by the peer, so this
    bound is what keeps a peer from growing the table without limit; the per-connection cost of
    new identities is what bounds the rest.

    Refused up front (``ValueError`` quoting the value): ``rate`` or ``burst`` not a finite number
    > 0, ``burst < 1`` (no request could ever be allowed), ``max_identities`` not an integer >= 1.
    """

    def __init__(self, rate: float, burst: float, max_identities: int = 4096) -> None:
        self.rate = _positive_finite("rate", rate)
        self.burst = _positive_finite("burst", burst)
        if self.burst < 1:
            raise ValueError(f"burst = {burst!r} must be >= 1, or no request is ever allowed")
        if isinstance(max_identities, bool) or not isinstance(max_identities, int) or max_identities < 1:
            raise ValueError(f"max_identities = {max_identities!r} must be an integer >= 1")
        self.max_identities = max_identities
        # identity -> (tokens, last refill time); order = least recently asked first
        self._buckets: "OrderedDict[bytes, Tuple[float, float]]" = OrderedDict()
        #: requests allowed / refused so far, and identities evicted to keep the table bounded
        self.allowed = 0
        self.refused = 0
        self.evicted = 0

    def take(self, identity: bytes, now: float) -> Optional[float]:
        """None if ``identity`` may be served now (one token taken), else the seconds until it may."""
        entry = self._buckets.get(identity)
        if entry is None:
            if len(self._buckets) >= self.max_identities:
                self._buckets.popitem(last=False)
                self.evicted += 1
            tokens = self.burst
        else:
            tokens, last = entry
            if now > last:
                tokens = min(self.burst, tokens + (now - last) * self.rate)
            self._buckets.move_to_end(identity)
        if tokens >= 1.0:
            self._buckets[identity] = (tokens - 1.0, now)
            self.allowed += 1
            return None
        self._buckets[identity] = (tokens, now)
        self.refused += 1
        return (1.0 - tokens) / self.rate

    def tokens(self, identity: bytes, now: float) -> float:
        """The tokens ``identity`` would have at ``now`` (``burst`` for an unknown one); changes nothing."""
        entry = self._buckets.get(identity)
        if entry is None:
            return self.burst
        tokens, last = entry
        return min(self.burst, tokens + max(0.0, now - last) * self.rate)

    def __len__(self) -> int:
        return len(self._buckets)

    def __repr__(self) -> str:
        return (
            f"TokenBucket(rate={self.rate}, burst={self.burst}, max_identities={self.max_identities}, "
            f"tracked={len(self._buckets)}, allowed={self.allowed}, refused={self.refused})"
        )
