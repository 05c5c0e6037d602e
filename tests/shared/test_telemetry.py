"""The telemetry every role shares: windowed rates, the last-100 episode statistics and the resource
view (CPU, memory, threads, GPU of a process)."""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, List, Optional

import msgpack
import pytest

from zclaw.telemetry import (NO_GPU, EpisodeWindow, GpuResources, RateMeter, ResourceMeter, Resources,
                             cuda_index, nvml_device, resource_scalars, resources_from_wire)


def test_rate_meter_counts_the_window_only() -> None:
    m = RateMeter(window_s=10.0, now=0.0)
    m.add(50, now=1.0)
    assert m.rate(now=5.0) == pytest.approx(10.0)  # younger than the window: over its age
    m.add(100, now=12.0)
    assert m.rate(now=12.0) == pytest.approx(10.0)  # the event at t=1 left the window (2, 12]
    assert m.rate(now=30.0) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        RateMeter(window_s=0.0)


def test_episode_window_keeps_the_last_hundred_and_skips_what_is_malformed() -> None:
    w = EpisodeWindow(size=100)
    batch = w.add([{"return": 1.0, "length": 5, "success": True}, {"return": 3, "length": 7},
                   {"return": "x"}, {"return": math.nan}, "not a map", {"return": True}, {"length": 2}])
    assert batch == {"returns": [1.0, 3.0], "lengths": [5, 7], "successes": [True]}
    assert w.total == 2 and w.return_mean() == 2.0 and w.success_rate() == 1.0
    w.add({"return": float(i), "success": i % 4 == 0} for i in range(200))
    assert w.total == 202 and len(w.returns) == 100
    assert w.return_mean() == pytest.approx(sum(range(100, 200)) / 100)
    assert w.success_rate() == pytest.approx(0.25)


def test_episode_window_state_round_trips() -> None:
    w = EpisodeWindow()
    w.add([{"return": -4.5, "success": False}, {"return": -3.0}])
    again = EpisodeWindow()
    again.restore(w.state())
    assert (again.total, list(again.returns), list(again.successes)) == (2, [-4.5, -3.0], [False])
    empty = EpisodeWindow()
    empty.restore({})
    assert empty.total == 0 and empty.return_mean() is None and empty.success_rate() is None


# ------------------------------------------------------------------------------------------- resources


def _rss_mb_of_this_process() -> float:
    """VmRSS from /proc, read apart from psutil: the meter's figure is checked against another reader."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS in /proc/self/status")


def test_resource_meter_reads_this_process() -> None:
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait, daemon=True)  # one more OS thread than the main one
    extra.start()
    try:
        meter = ResourceMeter(min_interval_s=0.0)
        cpu0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < 0.8:  # busy: about one core for 0.8 s
            pass
        r = meter.sample()
        busy = 100.0 * (time.process_time() - cpu0) / (time.monotonic() - t0)
        assert isinstance(r, Resources) and r.gpu == NO_GPU
        # the CPU time of this process over the window, as % of one core (clock ticks are 10 ms: +-15 points)
        assert r.cpu_percent >= 0 and abs(r.cpu_percent - busy) < 15, (r.cpu_percent, busy)
        assert r.rss_mb > 0 and abs(r.rss_mb - _rss_mb_of_this_process()) < 0.1 * r.rss_mb + 5
        assert r.threads == len(os.listdir("/proc/self/task")) and r.threads >= 2
        rep = r.as_report()
        assert set(rep) == {"cpu_percent", "rss_mb", "threads", "gpu"} and rep["gpu"] == "no GPU"
        assert resources_from_wire(rep) == rep  # what a worker sends, the broker keeps as it is
    finally:
        stop.set()


def test_resource_meter_samples_once_per_interval_and_skips_short_cpu_windows() -> None:
    meter = ResourceMeter(min_interval_s=2.0)
    first = meter.sample(now=100.0)
    assert meter.sample(now=101.9) is first and meter.samples == 1  # a report per update costs no sample
    assert meter.sample(now=102.0) is not first and meter.samples == 2
    # a CPU window shorter than MIN_CPU_WINDOW_S is mostly clock-tick rounding (1000s of %): kept, not read
    quick = ResourceMeter(min_interval_s=0.0)
    assert [quick.sample().cpu_percent for _ in range(20)] == [0.0] * 20 and quick.samples == 20
    with pytest.raises(ValueError, match="min_interval_s"):
        ResourceMeter(min_interval_s=-1.0)


def test_a_gpu_role_without_nvml_says_why_and_does_not_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError: no gpu extra
    meter = ResourceMeter(gpu=0, min_interval_s=0.0)
    note = meter.sample().gpu
    assert note == "GPU 0: no NVML (pip install nvidia-ml-py)"
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())  # installed now: not tried again
    assert meter.sample().gpu == note
    assert ResourceMeter(gpu=None).sample().gpu == NO_GPU  # a CPU role never touches NVML


def _fake_pynvml(visible: Optional[List[Any]] = None, fail_read: Optional[List[bool]] = None) -> Any:
    """A stand-in for nvidia-ml-py's ``pynvml`` with the documented calls and result fields only.

    Allowed because this machine has no GPU: the NVML path is otherwise untested. Its names and fields are
    checked against the real module where that is installed
    (:func:`test_nvml_contract_fake_matches_pynvml`).
    """
    mod = types.ModuleType("pynvml")
    calls: List[Any] = [] if visible is None else visible
    mib = 1 << 20

    class NVMLError(Exception):
        pass

    def init() -> None:
        calls.append("init")

    def by_index(i: int) -> Any:
        calls.append(("index", i))
        return ("handle", i)

    def by_uuid(u: str) -> Any:
        calls.append(("uuid", u))
        return ("handle", u)

    def util(h: Any) -> Any:
        if fail_read and fail_read.pop(0):
            raise NVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=37, memory=12)

    def memory(h: Any) -> Any:
        return types.SimpleNamespace(total=80 * 1024 * mib, free=60 * 1024 * mib, used=20 * 1024 * mib)

    def procs(h: Any) -> Any:
        return [types.SimpleNamespace(pid=1, usedGpuMemory=5000 * mib, gpuInstanceId=0, computeInstanceId=0),
                types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=3072 * mib, gpuInstanceId=0,
                                      computeInstanceId=0)]

    mod.NVMLError = NVMLError  # type: ignore[attr-defined]
    mod.nvmlInit = init  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = by_index  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByUUID = by_uuid  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUtilizationRates = util  # type: ignore[attr-defined]
    mod.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    mod.nvmlDeviceGetComputeRunningProcesses = procs  # type: ignore[attr-defined]
    return mod


NVML_CALLS = ("nvmlInit", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID",
              "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
              "nvmlDeviceGetComputeRunningProcesses")


def test_nvml_contract_fake_matches_pynvml() -> None:
    """The fake's calls and fields are nvidia-ml-py's (checked where it is installed; skipped elsewhere)."""
    real = pytest.importorskip("pynvml")
    for name in NVML_CALLS:
        assert callable(getattr(real, name)), name
    fields = lambda struct: {f[0] for f in struct._fields_}  # noqa: E731
    assert {"gpu", "memory"} <= fields(real.c_nvmlUtilization_t)
    assert {"total", "used", "free"} <= fields(real.c_nvmlMemory_t)
    assert {"pid", "usedGpuMemory"} <= fields(real.c_nvmlProcessInfo_t)


def test_nvml_contract_gpu_figures_through_a_fake_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Any] = []
    fail: List[bool] = [False, True, False]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls, fail))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    meter = ResourceMeter(gpu=1, min_interval_s=0.0)
    g = meter.sample().gpu
    assert calls == ["init", ("index", 1)]  # the handle once, at the first sample that needs it
    assert g == GpuResources(index=1, util_percent=37.0, mem_used_mb=20480.0, mem_total_mb=81920.0,
                             process_mem_mb=3072.0)  # this process's entry, not pid 1's
    rep = meter.sample().as_report()
    assert rep["gpu"] == "GPU 1: NVML NVMLError: GPU is lost"  # a failed read is said for this sample ...
    assert isinstance(meter.sample().gpu, GpuResources) and calls == ["init", ("index", 1)]  # ... not kept
    g_rep = meter.sample().as_report()
    assert resources_from_wire(g_rep) == g_rep and len(msgpack.packb({"resources": g_rep})) < 256
    assert resource_scalars(g_rep)["gpu_process_mem_mb"] == 3072.0


def test_nvml_contract_maps_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Any] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # cuda:1 is NVML's device 3
    ResourceMeter(gpu=1).sample()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3a,GPU-11c2")
    ResourceMeter(gpu=0).sample()
    assert calls == ["init", ("index", 3), "init", ("uuid", "GPU-8f3a")]
    assert nvml_device(4, {"CUDA_VISIBLE_DEVICES": "0,1"}) == 4 and nvml_device(0, {}) == 0


def test_cuda_index_of_a_role_device() -> None:
    devices = ("cuda", "cuda:2", "cpu", "mps", "cuda:x", " cuda:0 ")
    assert [cuda_index(d) for d in devices] == [0, 2, None, None, None, 0]


def test_resources_from_a_peer_are_checked_and_rebuilt() -> None:
    good = {"cpu_percent": 12.5, "rss_mb": 300.0, "threads": 9, "gpu": "no GPU", "extra": "x" * 100}
    assert resources_from_wire(good) == {"cpu_percent": 12.5, "rss_mb": 300.0, "threads": 9, "gpu": "no GPU"}
    gpu = {"index": 0, "util_percent": 50, "mem_used_mb": 1.0, "mem_total_mb": 2.0, "process_mem_mb": None}
    assert resources_from_wire(dict(good, gpu=gpu))["gpu"] == dict(gpu, util_percent=50.0)
    for bad in ({**good, "cpu_percent": math.nan}, {**good, "rss_mb": -1.0}, {**good, "threads": True},
                {**good, "threads": 2.5}, {**good, "gpu": "x" * 81}, {**good, "gpu": 3},
                {**good, "gpu": dict(gpu, index=-1)}, {**good, "gpu": dict(gpu, process_mem_mb="a lot")},
                {k: v for k, v in good.items() if k != "rss_mb"}, [1, 2], None):
        assert resources_from_wire(bad) is None, bad
    assert resource_scalars(good) == {"cpu_percent": 12.5, "rss_mb": 300.0, "threads": 9.0}
    assert resource_scalars(None) == {} and resource_scalars({"cpu_percent": "high"}) == {}
