"""The learner's side of a sharded run: every broker shard sampled, each in proportion to what it holds.

A run may spread its workers over several brokers (``network.brokers``, :mod:`zclaw.fleet`). The learner
keeps, per shard, its own clients (a Lazy Pirate for the handshake, a Credit Pirate for batches, one for
status) and what it last learnt of the shard: how many segments it holds (``fill``, from every batch
header and status report), when it may be asked again (a ``retry`` answer), whether it answers at all.
Each request goes to a shard drawn, among those that may be asked now, with probability proportional to
the rate it takes data in (``insert_rate`` of its last status report): a shard's data is trained on at
the pace it arrives, so a shard fed by more workers is asked more often and none evicts data nobody
sampled while another idles. Before any shard reports a rate, or when none takes data in, the weight is
what each holds, ``fill + 1`` (the ``+ 1`` keeps an empty shard probed). Measured on 2 shards fed by 2
and 1 workers: weighting by fill alone sampled both alike once both stores were full, and only the
busier shard evicted unused data.

A dead shard costs its own data only: a request it does not answer within ``network.request_timeout_ms``
marks it down, the other shards go on serving, and the status watcher (:class:`ShardWatch`, a thread of
its own, so that a status question never stalls training) marks it up again once it answers, e.g. after
``zclaw train`` restarted it on its snapshot. With one shard nothing of this applies: the one broker is
asked every time and retried for ever, exactly as an unsharded learner always did.

Priorities (prioritized replay) are keys of one shard's store, so each shard gets back the priorities of
the batches it served, with its next request.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import zmq

from ..fleet import BrokerAddress, format_address
from ..wire import CreditPirate, LazyPirate, Message, make, tcp

#: how long a shard that did not answer a batch request stays out of the draw before the watcher's next try
DOWN_S = 5.0


class Shard:
    """One broker shard as the learner sees it."""

    def __init__(self, index: int, address: BrokerAddress, ctx: zmq.Context, client: Dict[str, Any],
                 credit: int, status_timeout_ms: int, sharded: bool) -> None:
        self.index = index
        self.address = address
        at = tcp(address.host, address.serve_port)
        self.endpoint = at
        # sharded: one timeout marks a batch shard down instead of retrying it for ever (others go on)
        self.hello = LazyPirate(ctx, at, **dict(client, retries=0 if sharded else None))
        self.batches = CreditPirate(ctx, at, credit=credit, **dict(client, retries=0 if sharded else None))
        self.status = LazyPirate(ctx, at, **dict(client, retries=0, timeout_ms=status_timeout_ms))
        self.fill = 0
        self.rate = 0.0  # env steps/s it takes in (its last status)
        self.ready_at = 0.0  # asked to retry: not before this
        self.up = True
        self.report: Optional[Dict[str, Any]] = None
        self.prio_keys: List[Any] = []
        self.prios: List[float] = []
        self.batches_served = 0

    @property
    def name(self) -> str:
        return format_address(self.address)

    def close(self) -> None:
        for c in (self.hello, self.batches, self.status):
            c.close()


class ShardSampler:
    """Batches from every shard (see the module docstring); used by the learner's training loop only."""

    def __init__(self, ctx: zmq.Context, addresses: Sequence[BrokerAddress], client: Dict[str, Any],
                 credit: int, status_timeout_ms: int, log: Any, seed: int = 0) -> None:
        """``client``: the keyword arguments of every shard's pirates (timeout, size cap, log, CURVE)."""
        sharded = len(addresses) > 1
        self.shards = [Shard(i, a, ctx, client, credit, status_timeout_ms, sharded)
                       for i, a in enumerate(addresses)]
        self.log = log
        self._rng = random.Random(seed)
        self.lock = threading.Lock()  # fill / up / report: written by the watcher and the loop

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def welcome(self, hello: List[Any], stop: Callable[[], bool]) -> Optional[Message]:
        """Say ``hello`` to the shards in turn until one's ``welcome`` names the env spec (or one refuses
        us); None if stopped. Shards that do not answer are passed over (their pirate gives up once)."""
        while not stop():
            for s in self.shards:
                reply = s.hello.request(hello, ("welcome", "refused"), stop=stop)
                if reply is not None and (reply.kind == "refused" or reply["spec"]):
                    return reply
            if not stop():
                time.sleep(0.25)
        return None

    def pick(self) -> Tuple[Optional[Shard], float]:
        """The shard to ask next (weighted by fill + 1 among those up and not waiting), or None and how long
        to wait for one."""
        now = time.monotonic()
        with self.lock:
            ready = [s for s in self.shards if s.up and s.ready_at <= now]
            if not ready:
                waits = [s.ready_at - now for s in self.shards if s.up]
                return None, max(0.01, min(waits) if waits else DOWN_S / 10)
            if len(ready) == 1:
                return ready[0], 0.0
            weights = [s.rate for s in ready]
            if not sum(weights) > 0:
                weights = [s.fill + 1 for s in ready]
        return self._rng.choices(ready, weights=weights)[0], 0.0

    def request(self, shard: Shard, make_request: Callable[[List[Any], List[float]], List[Any]],
                stop: Callable[[], bool]) -> Optional[Message]:
        """One exchange with ``shard`` (its pending priorities go with it); None when stopped or, sharded,
        when the shard did not answer (it is marked down until the watcher hears from it again)."""
        request = make_request(shard.prio_keys, shard.prios)
        shard.prio_keys, shard.prios = [], []  # each batch's priorities travel once
        reply = shard.batches.exchange(request, ("batch", "retry", "error"), stop=stop)
        if reply is None:
            if not stop() and self.sharded:
                with self.lock:
                    shard.up = False
                self.log.warning("broker shard not answering: sampling the others", shard=shard.index,
                                 endpoint=shard.endpoint)
            return None
        with self.lock:
            if reply.kind == "batch":
                shard.batches_served += 1
                if isinstance(reply.get("fill"), int):
                    shard.fill = reply["fill"]
            elif reply.kind == "retry":
                shard.ready_at = time.monotonic() + min(max(int(reply["retry_ms"]), 1), 5000) / 1000.0
                if reply["reason"] == "not_enough_data":
                    shard.fill = 0
        return reply

    def trained(self, shard: Shard, keys: List[Any], prios: List[float]) -> None:
        """The priorities of a batch ``shard`` served, for its next request."""
        shard.prio_keys, shard.prios = list(keys), list(prios)

    def poll_status(self, stop: Callable[[], bool]) -> List[Optional[Dict[str, Any]]]:
        """Ask every shard for its status once (bounded: one try each); update fill and up; return the
        reports (None for a shard that did not answer)."""
        out: List[Optional[Dict[str, Any]]] = []
        for s in self.shards:
            reply = s.status.request(make("status"), ("status",), stop=stop)
            rep = reply["report"] if reply is not None and isinstance(reply.get("report"), dict) else None
            with self.lock:
                if rep is not None:
                    s.report = rep
                    s.fill = int(rep.get("fill") or 0)
                    rate = rep.get("insert_rate")
                    s.rate = float(rate) if isinstance(rate, (int, float)) and rate > 0 else 0.0
                    if not s.up:
                        self.log.info("broker shard answers again", shard=s.index, endpoint=s.endpoint)
                    s.up = True
            out.append(rep)
        return out

    def reports(self) -> List[Optional[Dict[str, Any]]]:
        """The last report of each shard (None where none came yet)."""
        with self.lock:
            return [s.report for s in self.shards]

    def summary(self) -> List[Dict[str, Any]]:
        """Per shard: endpoint, up, fill, batches served (the learner's status report)."""
        with self.lock:
            return [{"shard": s.index, "endpoint": s.name, "up": s.up, "fill": s.fill,
                     "batches": s.batches_served} for s in self.shards]

    def close(self) -> None:
        for s in self.shards:
            s.close()


class ShardWatch(threading.Thread):
    """Asks every shard for its status every ``interval_s`` in a thread of its own: the reports for metrics
    and status, the fills for the draw, and a down shard's return, without the training loop ever
    waiting on a status answer."""

    def __init__(self, sampler: ShardSampler, interval_s: float, stop: threading.Event) -> None:
        super().__init__(name="shard-watch", daemon=True)
        self.sampler, self.interval_s, self.stop_event = sampler, max(0.2, float(interval_s)), stop

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.sampler.poll_status(self.stop_event.is_set)
            except Exception as exc:  # a broken report must not end the watcher
                self.sampler.log.warning("shard status failed", error=repr(exc)[:200])
            self.stop_event.wait(self.interval_s)
