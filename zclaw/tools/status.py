"""``zclaw status``: one look at a running system, from the ``status`` reports of the broker and the learner.

Nothing here keeps state of its own: every figure is a field of a role's report (see
``docs/observability.md``) or a difference of two of them, so the view shows exactly what the roles
say. The only derived figure is a worker's ``behind``: the learner's version minus the newest version
the broker has seen in that worker's segments (how many updates its weights lag).

A role that does not answer within the timeout is shown as "no answer" (a one-try Lazy Pirate through
:class:`zclaw.launch.StatusClient`, so a dead role costs one timeout, never a hang); so is a role whose
reply cannot be decoded (e.g. larger than the decoder's cap): it counts as that one try, never a retry
loop. Each role's ``loops`` (service loops and when each last answered) is shown under it.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import zmq

from ..fleet import broker_shards, broker_total
from ..launch import StatusClient
from ..wire import tcp


def endpoint(text: str, what: str) -> str:
    """``HOST:PORT`` (or a full ``tcp://HOST:PORT``) -> a ZeroMQ endpoint; ValueError naming ``what``."""
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} = {text!r} is not allowed: expected HOST:PORT, e.g. 10.0.0.5:5556")
    return tcp(host, int(port))


def endpoints_from_config(cfg: Dict[str, Dict[str, Any]]) -> Tuple[List[str], str]:
    """(every broker shard's serve endpoint, the learner's endpoint) as the roles of ``cfg`` are reached."""
    net = cfg["network"]
    return ([tcp(a.host, a.serve_port) for a in broker_shards(cfg)],
            tcp(net["learner_host"], int(net["learner_port"])))


class Poller:
    """Asks every broker shard and the learner for their reports; one instance serves a live view's
    refreshes."""

    def __init__(
        self, brokers: Union[str, Sequence[str]], learner: str, timeout_ms: int = 1000,
        curves: Optional[Dict[str, Any]] = None
    ) -> None:
        """``brokers``: one serve endpoint, or each shard's; ``curves``: role -> CurveClient for a run with
        CURVE keys (``Security.from_config(cfg, "tools")``)."""
        self.ctx = zmq.Context()
        self.brokers = [brokers] if isinstance(brokers, str) else list(brokers)
        self.endpoints = {"broker": ", ".join(self.brokers), "learner": learner}
        curves = curves or {}
        self.broker_clients = [StatusClient(self.ctx, ep, timeout_ms, curve=curves.get("broker"))
                               for ep in self.brokers]
        self.learner_client = StatusClient(self.ctx, learner, timeout_ms, curve=curves.get("learner"))

    def snapshot(self) -> Dict[str, Any]:
        """The reports plus the per-worker table; ``answered`` lists the roles that replied."""
        reports = [c.report() for c in self.broker_clients]
        learner = self.learner_client.report()
        shards = ([{"shard": i, "endpoint": ep, "report": r}
                   for i, (ep, r) in enumerate(zip(self.brokers, reports))] if len(reports) > 1 else None)
        return build_snapshot(broker_total(reports), learner, self.endpoints, shards=shards)

    def close(self) -> None:
        for c in self.broker_clients + [self.learner_client]:
            c.close()
        self.ctx.term()


def build_snapshot(
    broker: Optional[Dict[str, Any]], learner: Optional[Dict[str, Any]], endpoints: Dict[str, str],
    shards: Optional[List[Dict[str, Any]]] = None,
) -> Dict[str, Any]:
    """What ``--json`` prints: both reports verbatim (with several broker shards, ``broker`` is their total
    and ``shards`` each one's report), and the workers table derived from them."""
    learner_version = (learner or {}).get("version")
    workers: List[Dict[str, Any]] = []
    for ident, w in sorted(((broker or {}).get("workers") or {}).items()):
        v = w.get("version")
        workers.append({
            "id": ident,
            "host": w.get("host"),
            "pid": w.get("pid"),
            "steps_per_s": w.get("rate"),
            "last_seen_s": w.get("last_seen_s"),
            "version": v,
            "behind": ((learner_version - v) if isinstance(learner_version, int) and isinstance(v, int)
                       else None),
            "version_age_s": w.get("version_age_s"),
            "segments": w.get("segments"),
            "steps": w.get("steps"),
            "resources": w.get("resources"),
        })
    return {
        "time": time.time(),
        "endpoints": dict(endpoints),
        "answered": [k for k, r in (("broker", broker), ("learner", learner)) if r is not None],
        "broker": broker,
        "learner": learner,
        "workers": workers,
        "shards": shards or [],
    }


# ---------------------------------------------------------------------------------------------- text view


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 1e4:
            return f"{v / 1e3:.1f}k"
        return f"{v:.{digits}f}"
    if isinstance(v, int) and abs(v) >= 1e6:
        return f"{v / 1e6:.2f}M"
    return str(v)


def _table(header: List[str], rows: List[List[Any]], indent: str = "  ") -> List[str]:
    cells = [header] + [[_f(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in cells]


def _bar(share: float, width: int = 20) -> str:
    n = int(round(max(0.0, min(1.0, share)) * width))
    return "#" * n + "." * (width - n)


def options_lines(options: Any) -> List[str]:
    """The learner's ``options`` report (option health) as a table, whatever its exact layout.

    Accepted: ``{"usage": [..K], "duration": [..K], ...}`` (one list per figure), or
    ``{"0": {...}, "1": {...}}`` / ``[{...}, ...]`` (one map per option); other keys are listed as they are.
    """
    if not options:
        return []
    per: Dict[str, Dict[str, Any]] = {}
    scalars: Dict[str, Any] = {}
    if isinstance(options, list):
        options = {str(i): o for i, o in enumerate(options)}
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, list):
                for i, x in enumerate(v):
                    per.setdefault(str(i), {})[k] = x
            elif isinstance(v, dict):
                per.setdefault(str(k), {}).update(v)
            else:
                scalars[k] = v
    out = []
    if per:
        fields = sorted({f for d in per.values() for f in d})
        rows = [[o] + [d.get(f) for f in fields] for o, d in sorted(per.items(), key=lambda kv: str(kv[0]))]
        out += _table(["option"] + fields, rows, indent="    ")
    if scalars:
        out.append("    " + "  ".join(f"{k} {_f(v)}" for k, v in sorted(scalars.items())))
    return out


def loops_line(report: Optional[Dict[str, Any]], now: float) -> Optional[str]:
    """A role's service loops (its report's ``loops`` map) and how long ago each last answered, from
    ``last_answer_unix`` (so a frozen loop shows a growing age even in an old report)."""
    loops = (report or {}).get("loops")
    if not isinstance(loops, dict) or not loops:
        return None
    parts = []
    for name, info in sorted(loops.items()):
        info = info if isinstance(info, dict) else {}
        at = info.get("last_answer_unix")
        ago = info.get("last_answer_age_s", info.get("last_s_ago"))  # the broker reports the age itself
        if isinstance(at, (int, float)):
            age = f"{max(0.0, now - at):.1f} s ago"
        elif isinstance(ago, (int, float)):
            age = f"{ago:.1f} s ago"
        else:
            age = "never"
        errors = info.get("errors", info.get("internal"))
        parts.append(f"{name} {age}" + (f" ({errors} errors)" if errors else ""))
    return "         loops: last answer " + ", ".join(parts)


def gpu_text(gpu: Any) -> str:
    """A ``resources.gpu`` entry in a few words: "no GPU", a note why it could not be read, or the device's
    utilisation and memory (and this process's own memory when NVML tells it)."""
    if isinstance(gpu, str):
        return gpu
    if not isinstance(gpu, dict):
        return "-"
    own = gpu.get("process_mem_mb")
    used, total = gpu.get("mem_used_mb"), gpu.get("mem_total_mb")
    mem = (f"{used / 1024:.1f}/{total / 1024:.1f} GiB" if isinstance(used, (int, float))
           and isinstance(total, (int, float)) else "-")
    return (f"GPU {_f(gpu.get('index'))} util {_f(gpu.get('util_percent'), 0)}% mem {mem}"
            + (f" (this process {own:.0f} MiB)" if isinstance(own, (int, float)) else ""))


def resources_line(report: Optional[Dict[str, Any]]) -> Optional[str]:
    """A role's ``resources`` (telemetry.ResourceMeter) in one line: CPU (% of a core), RSS, threads, GPU."""
    res = (report or {}).get("resources")
    if not isinstance(res, dict):
        return None
    return (f"         resources: cpu {_f(res.get('cpu_percent'), 1)}% of a core  rss "
            f"{_f(res.get('rss_mb'), 0)} MiB  threads {_f(res.get('threads'))}  {gpu_text(res.get('gpu'))}")


def render(snap: Dict[str, Any]) -> str:
    """The text view of a snapshot (what the live view redraws)."""
    ep = snap["endpoints"]
    lines = [f"zclaw status  {time.strftime('%H:%M:%S', time.localtime(snap['time']))}"
             f"   broker {ep['broker']}   learner {ep['learner']}", ""]
    L = snap["learner"]
    if L is None:
        lines.append(f"LEARNER  no answer from {ep['learner']}")
    else:
        lines.append(
            f"LEARNER  version {_f(L.get('version'))}  updates {_f(L.get('updates'))} "
            f"({_f(L.get('updates_per_s'))}/s)  steps trained {_f(L.get('steps_consumed'))} "
            f"({_f(L.get('steps_per_s'), 0)}/s)  up {_f(L.get('uptime_s'), 0)} s"
        )
        lines.append(
            f"         return (last 100) {_f(L.get('return_mean_100'))}  success "
            f"{_f(L.get('success_rate_100'))}  episodes {_f(L.get('episodes'))}  lag mean "
            f"{_f(L.get('lag_mean'))} max {_f(L.get('lag_max'))}"
            + (f"  state: {L['state']}" if L.get("state") else "")
        )
        res = resources_line(L)
        if res:
            lines.append(res)
        loops = loops_line(L, snap["time"])
        if loops:
            lines.append(loops)
        losses = L.get("losses") or {}
        if losses:
            items = [f"{k} {_f(v, 4)}" for k, v in sorted(losses.items())]
            for i in range(0, len(items), 5):
                lines.append(("  losses " if i == 0 else "         ") + "  ".join(items[i:i + 5]))
        opt = options_lines(L.get("options"))
        if opt:
            lines.append("  options")
            lines += opt
    lines.append("")
    B = snap["broker"]
    if B is None:
        lines.append(f"BROKER   no answer from {ep['broker']}")
    else:
        drops = B.get("drops") or {}
        drop_text = ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "none"
        lines.append(
            f"BROKER   fill {_f(B.get('fill'))}/{_f(B.get('capacity'))} segments  insert "
            f"{_f(B.get('insert_rate'), 0)} steps/s  sample {_f(B.get('sample_rate'))} segments/s  stored "
            f"steps {_f(B.get('inserted_steps'))}  batches {_f(B.get('batches'))}"
        )
        lines.append(f"         return (last 100) {_f(B.get('return_mean_100'))}  success "
                     f"{_f(B.get('success_rate_100'))}  episodes {_f(B.get('episodes'))}  drops: {drop_text}")
        res = resources_line(B)
        if res:
            lines.append(res)
        loops = loops_line(B, snap["time"])
        if loops:
            lines.append(loops)
        for sh in snap.get("shards") or []:  # several brokers: B is their total, each shard on a line
            r = sh["report"]
            lines.append(f"  shard {sh['shard']} {sh['endpoint']}  " + (
                "no answer" if r is None else
                f"fill {_f(r.get('fill'))}/{_f(r.get('capacity'))}  insert {_f(r.get('insert_rate'), 0)} "
                f"steps/s  sample {_f(r.get('sample_rate'))} segments/s  workers "
                f"{_f(r.get('workers_total'))}  drops {sum((r.get('drops') or {}).values())}"))
        hist = B.get("lag_hist") or {}
        total = float(sum(hist.values()))
        if total > 0:
            lines.append("  lag (versions) of sampled steps")
            for bucket, n in hist.items():
                lines.append(f"    {bucket:>5}  {_bar(n / total)}  {100 * n / total:5.1f}%")
    lines.append("")
    W = snap["workers"]
    lines.append(f"WORKERS  {len(W)}" + ("" if B is not None else " (the broker did not answer)"))
    if W:
        rows = []
        for w in W:
            res = w.get("resources") if isinstance(w.get("resources"), dict) else {}
            rows.append([w["id"], w["host"], w["pid"], w["steps_per_s"], w["last_seen_s"], w["version"],
                         w["behind"], w["version_age_s"], res.get("cpu_percent"), res.get("rss_mb"),
                         res.get("threads"), gpu_text(res.get("gpu")) if res else None])
        lines += _table(["id", "host", "pid", "steps/s", "last seen s", "version", "behind", "weights age s",
                         "cpu %", "rss MiB", "threads", "gpu"], rows)
    return "\n".join(lines)


def run(
    broker: Union[str, Sequence[str]], learner: str, *, once: bool, as_json: bool, interval: float,
    timeout_ms: int, echo: Any, clear: bool, curves: Optional[Dict[str, Any]] = None,
) -> int:
    """The ``zclaw status`` command: 0 while some role answers, 1 when none does (message says which)."""
    import json

    poller = Poller(broker, learner, timeout_ms, curves)
    try:
        first = True
        while True:
            snap = poller.snapshot()
            if not snap["answered"]:
                if first or once or as_json:
                    echo(f"error: nothing answers: no status reply from the broker at {broker} nor the "
                         f"learner at {learner} within {timeout_ms} ms. Is the run up, and are the endpoints "
                         "right? (--broker HOST:PORT --learner HOST:PORT, or --run-dir RUN for "
                         "a `zclaw train` run)",
                         err=True)
                    return 1
            if as_json:
                echo(json.dumps(snap, indent=2, sort_keys=True, default=str))
                return 0
            text = render(snap)
            if once:
                echo(text)
                return 0
            echo(("\x1b[H\x1b[2J" if clear else "") + text
                 + "\n\n(refresh every %gs, Ctrl-C to quit)" % interval)
            first = False
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        poller.close()
