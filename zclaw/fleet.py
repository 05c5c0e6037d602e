"""Where a run's broker shards are, which one a worker feeds, and what they hold together.

A run may have several brokers (``network.brokers``: ``"host:ingest_port:serve_port"`` each, or empty for the
one broker at ``network.broker_host``, ``ingest_port`` and ``serve_port``). Why shards: one broker process
is one core's worth of ingest; several spread the workers' segments over several cores or hosts, each
shard holding its own store. Worker ``i`` feeds shard ``i mod S`` (its hello, heartbeats and segments), so a
dead shard costs the segments of its own workers only. The learner samples every shard, each in proportion
to what it holds (``zclaw.learner.shards``); ``zclaw status`` and the learner's metrics show every shard and
their total (:func:`merge_reports`).

Every role and tool reads the shards from here, so the config is parsed once, the same way everywhere.
Worker-side: keep this module importable on Python 3.8.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence


class BrokerAddress(NamedTuple):
    """One broker shard: the host its clients connect to and its two ports."""

    host: str
    ingest_port: int
    serve_port: int


def parse_address(text: str) -> BrokerAddress:
    """``"host:ingest_port:serve_port"``; ``ValueError`` naming what is wrong."""
    parts = str(text).rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise ValueError(f"{text!r} is not host:ingest_port:serve_port")
    try:
        ingest, serve = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"{text!r}: the ports must be integers") from None
    if not (0 < ingest < 65536 and 0 < serve < 65536) or ingest == serve:
        raise ValueError(f"{text!r}: two different ports in 1..65535 are needed")
    return BrokerAddress(parts[0], ingest, serve)


def format_address(a: BrokerAddress) -> str:
    return f"{a.host}:{a.ingest_port}:{a.serve_port}"


def broker_shards(cfg: Mapping[str, Mapping[str, Any]]) -> List[BrokerAddress]:
    """The run's broker shards, in order (shard 0 first); at least one."""
    net = cfg["network"]
    listed = net.get("brokers") or []
    if not listed:
        return [BrokerAddress(str(net["broker_host"]), int(net["ingest_port"]), int(net["serve_port"]))]
    return [parse_address(x) for x in listed]


def shard_of_worker(index: int, shards: int) -> int:
    """The shard worker ``index`` feeds: ``index mod shards`` (workers spread evenly, in index order)."""
    return int(index) % max(1, int(shards))


def as_shard(cfg: Dict[str, Dict[str, Any]], shard: int) -> Dict[str, Dict[str, Any]]:
    """``cfg`` with ``network.broker_host``/``ingest_port``/``serve_port`` set to ``shard``'s (what a broker
    started with ``--shard`` binds, and the one endpoint a worker of that shard talks to); ``ValueError``
    if there is no such shard."""
    shards = broker_shards(cfg)
    if not 0 <= shard < len(shards):
        raise ValueError(f"shard {shard} does not exist: network.brokers lists {len(shards)} shard(s)")
    a = shards[shard]
    out = {sec: dict(values) for sec, values in cfg.items()}
    out["network"].update(broker_host=a.host, ingest_port=a.ingest_port, serve_port=a.serve_port)
    return out


#: report counters that add up across shards
_SUMMED = ("fill", "capacity", "inserted_segments", "inserted_steps", "sampled_segments", "batches",
           "insert_rate", "sample_rate", "episodes", "workers_total", "out_of_range")


def broker_total(reports: Sequence[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """What the run's brokers report together: the one broker's own report, or the shards' total
    (:func:`merge_reports`); None when none answered."""
    if len(reports) == 1:
        return reports[0]
    return merge_reports(reports) if any(reports) else None


def merge_reports(reports: Sequence[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """The total of the shards' status reports (a shard that did not answer is None: counted in
    ``shards_down``): counters and rates summed, drops, retries and lag histograms added key by key,
    workers joined, the return and success rate averaged over the shards' windows weighted by episodes."""
    up = [r for r in reports if r]
    total: Dict[str, Any] = {"role": "broker", "shards": len(reports), "shards_down": len(reports) - len(up)}
    for key in _SUMMED:
        total[key] = sum((r.get(key) or 0) for r in up)
    for key in ("drops", "retries", "lag_hist", "refused"):
        merged: Dict[str, int] = {}
        for r in up:
            for k, v in (r.get(key) or {}).items():
                merged[k] = merged.get(k, 0) + int(v)
        total[key] = merged
    total["workers"] = {k: v for r in up for k, v in (r.get("workers") or {}).items()}
    total["spec"] = next((r.get("spec") for r in up if r.get("spec")), None)
    for key in ("return_mean_100", "success_rate_100"):
        pairs = [(r[key], min(int(r.get("episodes") or 0), 100)) for r in up if r.get(key) is not None]
        weight = sum(w for _, w in pairs)
        total[key] = sum(v * w for v, w in pairs) / weight if weight else None
    restored = [r.get("restored") for r in up if r.get("restored")]
    total["restored"] = ({k: sum(int(x.get(k, 0)) for x in restored) for k in ("inserted_steps", "episodes")}
                         if restored else None)
    return total
