"""Telemetry every role keeps: rates over a sliding window and the statistics of recent episodes.

Why one module: the broker, the learner and the worker each report a throughput and the mean return of
the last 100 episodes; written once here, the three reports mean the same thing by the same name
(``*_rate`` / ``*_per_s`` over the last :data:`RATE_WINDOW_S` seconds, ``return_mean_100``,
``success_rate_100``). Roles hand these small objects their events; they hold no sockets and no logger.
Importable on Python 3.8 (workers run there for Isaac Gym).

The resource view (:class:`ResourceMeter`) lives here for the same reason: every role reports its own CPU,
memory, threads and GPU under the same ``resources`` key, in the same units.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple, Union

import psutil

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


# ------------------------------------------------------------------------------------------- resources

#: seconds between two real samples of a :class:`ResourceMeter` (the metrics cadence, ``log.metrics_s``
#: default): a report built more often hands out the last sample
RESOURCE_INTERVAL_S = 2.0
#: shortest window ``cpu_percent`` is read over: CPU time is counted in clock ticks (10 ms), so a
#: shorter window is mostly rounding (a sample 10 us after the last read 1400%); a sample sooner keeps
#: the last figure
MIN_CPU_WINDOW_S = 0.5
#: ``Resources.gpu`` of a process that uses no GPU
NO_GPU = "no GPU"
#: characters of a GPU note (``Resources.gpu`` as text): a report stays small and fixed-size
MAX_GPU_NOTE = 80
_MIB = float(1 << 20)


class GpuResources(NamedTuple):
    """The GPU a process uses, as NVML reads it.

    ``index`` is the CUDA index the role was given (``--gpu N``, ``learner.device = "cuda:N"``), in torch's
    numbering (after ``CUDA_VISIBLE_DEVICES``). ``util_percent`` (busy time over NVML's last sample period)
    and ``mem_used_mb`` / ``mem_total_mb`` are the whole device's: NVML measures utilisation per device,
    so another process on the same GPU shows here too. ``process_mem_mb`` is this process's own memory on
    it, or None where NVML does not tell it (no CUDA context yet, a container's PID namespace hiding the
    host pid, a driver that does not count it). Memory in MiB.
    """

    index: int
    util_percent: float
    mem_used_mb: float
    mem_total_mb: float
    process_mem_mb: Optional[float]


class Resources(NamedTuple):
    """What one role process uses (one sample of :class:`ResourceMeter`).

    ``cpu_percent``: CPU time of the whole process (all threads) since the previous sample, as a percent
    of one core: 100 is one core busy, a process with several busy threads goes above 100. ``rss_mb``:
    resident memory in MiB. ``threads``: OS threads (torch's pools, ZeroMQ's I/O threads, ...). ``gpu``: a
    :class:`GpuResources`, :data:`NO_GPU` for a process that uses none, or a short note why the GPU it uses
    could not be read (e.g. nvidia-ml-py not installed).
    """

    cpu_percent: float
    rss_mb: float
    threads: int
    gpu: Union[GpuResources, str]

    def as_report(self) -> Dict[str, Any]:
        """The ``resources`` entry of a status report: four fixed keys, rounded (about 100 bytes packed)."""
        gpu: Union[Dict[str, Any], str]
        if isinstance(self.gpu, GpuResources):
            g = self.gpu
            gpu = {"index": int(g.index), "util_percent": round(float(g.util_percent), 1),
                   "mem_used_mb": round(float(g.mem_used_mb), 1),
                   "mem_total_mb": round(float(g.mem_total_mb), 1),
                   "process_mem_mb": None if g.process_mem_mb is None else round(float(g.process_mem_mb), 1)}
        else:
            gpu = str(self.gpu)[:MAX_GPU_NOTE]
        return {"cpu_percent": round(float(self.cpu_percent), 1), "rss_mb": round(float(self.rss_mb), 1),
                "threads": int(self.threads), "gpu": gpu}


def cuda_index(device: Any) -> Optional[int]:
    """The CUDA index of a torch device or device string (``"cuda"`` -> 0, ``"cuda:1"`` -> 1), None for any
    other device. Reads the text only, so telemetry needs no torch import."""
    text = str(device).strip()
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    return None


def nvml_device(index: int, environ: Optional[Mapping[str, str]] = None) -> Union[int, str]:
    """What NVML calls the CUDA device ``index``: an NVML index, or a UUID to look up.

    Why: CUDA numbers only the devices in ``CUDA_VISIBLE_DEVICES`` (``"2,3"`` makes physical GPU 3 be
    ``cuda:1``), NVML numbers all of them; a role started under it would otherwise read another GPU.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= index < len(entries):
        return index
    entry = entries[index]
    return int(entry) if entry.isdigit() else entry


class NvmlDevice:
    """One GPU read through NVML (module ``pynvml`` of nvidia-ml-py: ``pip install "zclaw[gpu]"``).

    ``pynvml`` is imported here, when a role that uses a GPU first samples it, and nowhere else: a host
    without it (or without an NVIDIA driver) runs every role, and its GPU figure says why it is missing.
    Raises what ``import pynvml`` / ``nvmlInit`` / the handle lookup raise.
    """

    def __init__(self, index: int, environ: Optional[Mapping[str, str]] = None) -> None:
        import pynvml  # optional (the gpu extra): lazily, see the class docstring

        pynvml.nvmlInit()  # reference-counted by NVML; kept for the process's lifetime
        self.nvml = pynvml
        self.index = int(index)
        which = nvml_device(self.index, environ)
        self.handle = (pynvml.nvmlDeviceGetHandleByUUID(which) if isinstance(which, str)
                       else pynvml.nvmlDeviceGetHandleByIndex(which))
        self.pid = os.getpid()

    def read(self) -> GpuResources:
        nvml, h = self.nvml, self.handle
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        own: Optional[float] = None
        try:  # not every driver / container can list processes: the device figures stand without it
            used = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
                    if p.pid == self.pid and p.usedGpuMemory is not None]
            own = sum(used) / _MIB if used else None
        except Exception:
            own = None
        return GpuResources(self.index, float(util.gpu), mem.used / _MIB, mem.total / _MIB, own)


def gpu_note(index: int, exc: BaseException) -> str:
    """Why GPU ``index`` could not be read, short enough for a report (:data:`MAX_GPU_NOTE`)."""
    if isinstance(exc, ImportError):
        text = f"GPU {index}: no NVML (pip install nvidia-ml-py)"
    else:
        text = f"GPU {index}: NVML {type(exc).__name__}: {exc}"
    return text[:MAX_GPU_NOTE]


class ResourceMeter:
    """This process's :class:`Resources`, really sampled at most once per ``min_interval_s``.

    Why cached: the broker builds a report per status request and the learner one per update; a sample
    reads a few ``/proc`` files (and NVML for a GPU role), so the meter does that work at most once per
    interval and hands out the last sample in between, and what the view costs stays far below 1% of a
    core however often reports are asked for (``bench/resources.py`` measures it). Why one
    ``psutil.Process`` kept for the process's life: ``cpu_percent(interval=None)`` is the CPU time between
    two calls *on the same object* over the wall time between them, so the meter's own samples define the
    window and nothing ever sleeps. The first sample after construction covers the time since it; a CPU
    window shorter than ``cpu_window_s`` (:data:`MIN_CPU_WINDOW_S`) keeps the last CPU figure (0.0 at first).

    ``gpu``: the CUDA index this process uses (:func:`cuda_index` of its device), None for none (the
    report says :data:`NO_GPU`). A GPU that cannot be read (no nvidia-ml-py, no driver) is said once in the
    GPU note and not retried: neither fixes itself while the process runs. Thread-safe.
    """

    def __init__(
        self, gpu: Optional[int] = None, min_interval_s: float = RESOURCE_INTERVAL_S,
        cpu_window_s: float = MIN_CPU_WINDOW_S,
    ) -> None:
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s = {min_interval_s!r} is not allowed: expected a number >= 0")
        self.gpu = gpu
        self.min_interval_s = float(min_interval_s)
        self.cpu_window_s = float(cpu_window_s)
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # starts the window (the first call of a Process returns 0.0)
        self._cpu, self._cpu_at = 0.0, time.monotonic()
        self._lock = threading.Lock()
        self._last: Optional[Resources] = None
        self._last_report: Dict[str, Any] = {}
        self._at = -math.inf
        self._nvml: Optional[NvmlDevice] = None
        self._gpu_error: Optional[str] = None
        self.samples = 0  # real samples taken (the cached answers are not counted)

    def sample(self, now: Optional[float] = None) -> Resources:
        """The current figures: a fresh sample if the last is ``min_interval_s`` old, else the last."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last is not None and now - self._at < self.min_interval_s:
                return self._last
            proc = self._proc
            with proc.oneshot():  # one read of /proc/<pid>/stat for the three figures
                t = time.monotonic()
                if t - self._cpu_at >= self.cpu_window_s:
                    self._cpu, self._cpu_at = float(proc.cpu_percent(None)), t
                rss = proc.memory_info().rss
                threads = proc.num_threads()
            self._last = Resources(self._cpu, rss / _MIB, int(threads), self._read_gpu())
            self._last_report = self._last.as_report()
            self._at = now
            self.samples += 1
            return self._last

    def report(self, now: Optional[float] = None) -> Dict[str, Any]:
        """:meth:`sample` as a status report's ``resources`` entry (:meth:`Resources.as_report`), built once
        per sample: between samples a report costs a clock read and a copy of four keys."""
        self.sample(now)
        return dict(self._last_report)

    def _read_gpu(self) -> Union[GpuResources, str]:
        if self.gpu is None:
            return NO_GPU
        if self._gpu_error is not None:
            return self._gpu_error
        try:
            if self._nvml is None:
                self._nvml = NvmlDevice(self.gpu)
        except Exception as exc:  # ImportError, NVMLError (no driver, no such device): said, not retried
            self._gpu_error = gpu_note(self.gpu, exc)
            return self._gpu_error
        try:
            return self._nvml.read()
        except Exception as exc:  # a transient NVML failure: this sample says so, the next one tries again
            return gpu_note(self.gpu, exc)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None


def resources_from_wire(value: Any) -> Optional[Dict[str, Any]]:
    """A peer's ``resources`` entry (a worker's hello), checked and rebuilt key by key, or None.

    Why: it comes off the wire, and what the broker keeps and re-reports must be the fixed, small shape of
    :meth:`Resources.as_report`, whatever a peer sent: unknown keys are left out, and a missing or
    ill-typed figure (a negative, NaN, a bool, a long string) makes the whole entry None.
    """
    if not isinstance(value, Mapping):
        return None
    cpu, rss, threads = _number(value.get("cpu_percent")), _number(value.get("rss_mb")), value.get("threads")
    if cpu is None or rss is None or isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        return None
    gpu = value.get("gpu")
    if isinstance(gpu, str):
        if len(gpu) > MAX_GPU_NOTE:
            return None
        out_gpu: Union[Dict[str, Any], str] = gpu
    elif isinstance(gpu, Mapping):
        index = gpu.get("index")
        figures = [_number(gpu.get(k)) for k in ("util_percent", "mem_used_mb", "mem_total_mb")]
        own = gpu.get("process_mem_mb")
        own_n = None if own is None else _number(own)
        if (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 16
                or any(f is None for f in figures) or (own is not None and own_n is None)):
            return None
        out_gpu = {"index": index, "util_percent": figures[0], "mem_used_mb": figures[1],
                   "mem_total_mb": figures[2], "process_mem_mb": own_n}
    else:
        return None
    return {"cpu_percent": cpu, "rss_mb": rss, "threads": min(threads, 1 << 31), "gpu": out_gpu}


def resource_scalars(resources: Any) -> Dict[str, float]:
    """A report's ``resources`` entry as flat figures for TensorBoard: ``cpu_percent``, ``rss_mb``,
    ``threads`` and, for a GPU process, ``gpu_util_percent``, ``gpu_mem_used_mb`` and ``gpu_process_mem_mb``
    (when NVML tells it). Whatever is missing or not a number is left out: it may be another role's report."""
    out: Dict[str, float] = {}
    if not isinstance(resources, Mapping):
        return out
    for key in ("cpu_percent", "rss_mb", "threads"):
        v = _number(resources.get(key))
        if v is not None:
            out[key] = v
    gpu = resources.get("gpu")
    if isinstance(gpu, Mapping):
        for key, name in (("util_percent", "gpu_util_percent"), ("mem_used_mb", "gpu_mem_used_mb"),
                          ("process_mem_mb", "gpu_process_mem_mb")):
            v = _number(gpu.get(key))
            if v is not None:
                out[name] = v
    return out
