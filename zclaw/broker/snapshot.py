"""Broker store snapshots: written without stopping traffic, restored when the broker starts.

A snapshot must be a consistent picture of the store (a segment half copied, or keys that disagree with
the data, would be worse than no snapshot), yet ingest must not pause while the file is written.

``thread`` (default): the broker's loop takes the state itself, between two polls, so it is consistent:
:meth:`zclaw.broker.store.Store.state` returns the slots' arrays *by reference* (the store keeps each
segment in the read-only buffer it arrived in and never writes it in place, so a reference is as good as
a copy) plus fresh copies of the small bookkeeping arrays: an O(capacity) gathering of references, no
payload copy. A thread, niced (+10, Linux applies it per thread), then serialises and fsyncs while the
loop goes on; file writes and CRCs of large rows release the GIL.

``fork``: a forked child sees the store frozen copy-on-write, writes it and exits (no ZeroMQ in the
child, garbage collector off, default SIGINT/SIGTERM, ``PR_SET_PDEATHSIG`` so it dies with the broker,
niced). The loop pays no state-taking, but after every fork each page the Python interpreter touches
(reference counts are writes) faults and is copied: ``bench/snapshot.py`` measures it as the slower mode.

File: ``<run_dir>/snapshots/store.npz``, an uncompressed numpy archive loaded with
``allow_pickle=False`` (nothing is ever unpickled): the store's arrays (occupied slots only, streamed
row by row) plus a ``meta.json`` entry (env spec, per-segment metadata, counters, RNG state, the broker's
own tallies, wall time written). It is written to a temporary file and renamed
(:func:`zclaw.fileio.atomic_write`): a crash mid-write leaves the previous snapshot intact.

What a crash loses: segments inserted (and samples served) after the last completed snapshot, at
most ``broker.snapshot_s`` seconds of ingest plus the time one write takes.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import numpy.lib.format as npy_format

from ..fileio import atomic_write, remove_stale_tmp

#: 2: segments of any env count (protocol v2): data rows flat, with each segment's ``columns``;
#: 3: keys in any slot, and each worker's sent and evicted columns (``worker_columns``, fair eviction)
FORMAT = 3
#: formats this broker reads (a format 2 snapshot restores with each worker's counts from its stored data)
READS = (2, 3)
#: niceness added to the snapshot child (the broker's own loop keeps priority)
CHILD_NICE = 10
#: how a periodic snapshot is written: from a thread (default), a forked child, or in the loop itself
MODES = ("thread", "fork", "inline")
SNAPSHOT_DIR = "snapshots"
SNAPSHOT_NAME = "store.npz"
META = "meta.json"

State = Tuple[Dict[str, np.ndarray], Dict[str, Any]]


class SnapshotError(RuntimeError):
    """A snapshot file that is unreadable or not in this format."""


def snapshot_path(run_dir: Path, shard: int = 0) -> Path:
    """Where the broker of ``shard`` keeps its snapshot (shard 0: the one broker of an unsharded run)."""
    name = SNAPSHOT_NAME if shard == 0 else SNAPSHOT_NAME.replace(".", f"-shard{shard}.", 1)
    return Path(run_dir) / SNAPSHOT_DIR / name


def write(path: Path, arrays: Dict[str, Any], meta: Dict[str, Any]) -> None:
    """Write one snapshot atomically (tmp file, fsync, rename).

    A value is an array, or a list of rows of one dtype (a store's slots by reference), which is
    streamed row by row into one ``.npy`` entry, stacked when the rows share a shape and else joined
    flat (1-D rows of different lengths: segments of different env counts): a full store is never
    copied whole, and the archive reads back with plain ``np.load``.
    """
    blob = json.dumps(dict(meta, format=FORMAT), separators=(",", ":")).encode()
    payload: Dict[str, Any] = {}
    for name, v in arrays.items():
        rows = v if isinstance(v, list) else None
        a = np.asarray(rows[0] if rows else v)
        if a.dtype.hasobject:  # would be pickled; load() refuses pickles, so refuse to write one
            raise ValueError(f"snapshot array {name!r} holds Python objects")
        if rows and any(np.asarray(r).dtype != a.dtype for r in rows):
            raise ValueError(f"snapshot rows of {name!r} differ in dtype")
        if rows and any(np.shape(r) != a.shape for r in rows) and any(np.ndim(r) != 1 for r in rows):
            raise ValueError(f"snapshot rows of {name!r} differ in shape and are not all 1-D")
        payload[name] = rows if rows else a
    payload[META] = np.frombuffer(blob, dtype=np.uint8)
    atomic_write(path, lambda f: _write_npz(f, payload))


def _write_npz(f: Any, payload: Dict[str, Any]) -> None:
    """``np.savez`` (uncompressed, no pickles), with list values streamed as stacked rows."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in payload.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as out:
                if isinstance(value, list):
                    first = np.asarray(value[0])
                    stacked = all(np.shape(r) == first.shape for r in value)
                    shape = (len(value),) + first.shape if stacked else (sum(np.size(r) for r in value),)
                    npy_format.write_array_header_1_0(out, {
                        "descr": npy_format.dtype_to_descr(first.dtype), "fortran_order": False,
                        "shape": shape})
                    for row in value:
                        out.write(memoryview(np.ascontiguousarray(row)).cast("B"))
                else:
                    npy_format.write_array(out, value, allow_pickle=False)


def load(path: Path) -> Optional[State]:
    """The snapshot at ``path`` as (arrays, meta), or None if there is none; raise :class:`SnapshotError`."""
    path = Path(path)
    remove_stale_tmp(path)
    if not path.exists():
        return None
    try:
        with np.load(str(path), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        meta = json.loads(arrays.pop(META).tobytes().decode())
    except (OSError, ValueError, KeyError) as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") not in READS:
        found = meta.get("format") if isinstance(meta, dict) else "?"
        raise SnapshotError(f"snapshot {path} is format {found}, this broker reads formats "
                            f"{', '.join(map(str, READS))}: move it away to start with an empty store")
    return arrays, meta


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _lower_priority() -> None:
    """Nice the calling thread (Linux: per thread) so that the broker's loop keeps the CPU."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHILD_NICE)
    except (AttributeError, OSError):
        pass


class Snapshotter:
    """Periodic snapshots written off the broker's loop (see the module docstring); a final in-line one.

    ``state`` builds (arrays, meta) of everything to save; ``marker`` is any value that changes when
    the store changes, so an idle broker does not rewrite the same snapshot. The loop calls
    :meth:`tick` every iteration (cheap: a clock read and a look at the running job).
    """

    def __init__(
        self, path: Path, interval_s: float, log: Any, state: Callable[[], Optional[State]],
        marker: Callable[[], Any], mode: str = "thread",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"snapshot mode = {mode!r} must be one of {', '.join(MODES)}")
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.log = log
        self.state = state
        self.marker = marker
        self.mode = "inline" if mode == "fork" and not hasattr(os, "fork") else mode
        #: the snapshot being written: (kind, pid or thread, started, marker, result box)
        self._job: Optional[Tuple[str, Any, float, Any, Dict[str, Any]]] = None
        self.written = 0
        self.failed = 0
        self.last_seconds: Optional[float] = None
        self.last_written_at: Optional[float] = None
        self._saved_marker: Any = None
        self._next = time.monotonic() + self.interval_s
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def mark_restored(self) -> None:
        """The store now equals the snapshot on disk: do not rewrite it until something changes."""
        self._saved_marker = self.marker()

    # ---------------------------------------------------------------------------------- periodic

    def tick(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        self.reap()
        if self.interval_s <= 0 or self._job is not None or now < self._next:
            return
        self._next = now + self.interval_s
        marker = self.marker()
        if marker == self._saved_marker:
            return
        if self.mode == "thread":
            self._thread(marker)
        elif self.mode == "fork":
            self._fork(marker)
        else:
            self._write_inline(marker)

    def _thread(self, marker: Any) -> None:
        """Take the state here (consistent: the loop is not running), write it from a thread."""
        t0 = time.monotonic()
        st = self.state()
        if st is None:
            return
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                _lower_priority()
                write(self.path, *st)
                box["ok"] = True
            except BaseException as exc:  # reported by reap() in the broker's loop
                box["ok"], box["err"] = False, repr(exc)

        th = threading.Thread(target=run, name="snapshot-writer", daemon=True)
        th.start()
        self._job = ("thread", th, t0, marker, box)

    def _fork(self, marker: Any) -> None:
        t0 = time.monotonic()
        try:
            pid = os.fork()
        except OSError as exc:  # no memory for page tables, process limit: write in-line instead
            self.log.warning("cannot fork for the snapshot; writing in-line", error=str(exc))
            self._write_inline(marker)
            return
        if pid == 0:  # the child: write and leave, whatever happens
            code = 1
            try:
                gc.disable()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                _die_with_parent()
                _lower_priority()  # on a busy host the broker's loop wins the CPU, the write waits
                st = self.state()
                if st is not None:
                    write(self.path, *st)
                code = 0
            except BaseException as exc:  # report on stderr; the parent logs the exit code
                try:
                    os.write(2, f"snapshot child failed: {exc!r}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(code)
        self._job = ("fork", pid, t0, marker, {})

    def reap(self, block: bool = False) -> None:
        """Collect a finished snapshot (``block``: wait for it) and log the outcome."""
        if self._job is None:
            return
        kind, handle, t0, marker, box = self._job
        if kind == "thread":
            if block:
                handle.join()
            if handle.is_alive():
                return
            self._job = None
            self._done(bool(box.get("ok")), time.monotonic() - t0, marker, box.get("err", ""))
            return
        try:
            done, status = os.waitpid(handle, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done, status = handle, 1 << 8
        if done == 0:
            return
        self._job = None
        code = os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") else status >> 8
        self._done(code == 0, time.monotonic() - t0, marker, f"child exit code {code}")

    def _write_inline(self, marker: Any) -> bool:
        t0 = time.monotonic()
        err = ""
        try:
            st = self.state()
            if st is None:
                return False
            write(self.path, *st)
            ok = True
        except Exception as exc:  # a failed snapshot is logged; it must not take the broker down
            ok, err = False, repr(exc)
        self._done(ok, time.monotonic() - t0, marker, err)
        return ok

    def _done(self, ok: bool, seconds: float, marker: Any, err: str) -> None:
        if ok:
            self.written += 1
            self.last_seconds = seconds
            self.last_written_at = time.time()
            self._saved_marker = marker
            size = self.path.stat().st_size if self.path.exists() else 0
            self.log.info("snapshot written", path=str(self.path), seconds=round(seconds, 3), bytes=size)
        else:
            self.failed += 1
            self.log.error("snapshot failed", path=str(self.path), error=err)

    # ------------------------------------------------------------------------------------- final

    def final(self) -> str:
        """On shutdown: wait for a running child, then write in-line if anything changed since.

        Returns ``"written"``, ``"current"`` (the file on disk already holds this state), ``"empty"``
        (no store yet, nothing to save) or ``"failed"``.
        """
        self.reap(block=True)
        marker = self.marker()
        if marker is None:
            return "empty"
        if marker == self._saved_marker:
            return "current"
        return "written" if self._write_inline(marker) else "failed"

    def report(self) -> Dict[str, Any]:
        return {
            "path": str(self.path), "interval_s": self.interval_s, "written": self.written,
            "failed": self.failed,
            "last_seconds": self.last_seconds,
            "age_s": round(time.time() - self.last_written_at, 3) if self.last_written_at else None,
            "in_progress": self._job is not None, "mode": self.mode,
            # the file on disk holds the store as it is now (nothing inserted or sampled since)
            "current": self._saved_marker is not None and self._saved_marker == self.marker(),
        }
