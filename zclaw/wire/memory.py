"""Keep freed message buffers in the process heap, so the next message reuses their pages.

Why: every role allocates and frees buffers of a few hundred KiB to a few MiB per message (ZeroMQ's
receive buffers, a batch's stacked fields, the learner's stacked batch). glibc serves an allocation
above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and gives the top of its heap back to the kernel
once more than ``M_TRIM_THRESHOLD`` is free there, so each new buffer of the same size faults its
pages in again, one page fault and one zeroed 4 KiB page at a time. Measured on the pipeline bench
(64 x 64 segments), that is about 50 faults per segment across the three processes, and the
broker's batch stacking ran 13x slower with fresh pages than with reused ones. Raising both
thresholds lets the allocator reuse the pages it already has.

What it costs: a process keeps freed memory up to :data:`TRIM_THRESHOLD_BYTES` instead of returning
it at once; the broker's store capacity and the sockets' high-water marks bound what is in use anyway.
Other C libraries (musl, macOS) have no ``mallopt``: there this does nothing and says so.
"""
from __future__ import annotations

import ctypes
from typing import Optional

#: glibc ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: allocations below this come from the heap and are reused; glibc's upper limit on 64-bit hosts
MMAP_THRESHOLD_BYTES = 32 << 20
#: free memory the heap may keep at its top before giving it back to the kernel
TRIM_THRESHOLD_BYTES = 256 << 20

_applied: Optional[bool] = None


def keep_freed_buffers() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); True if the C library took them.

    Call at the start of a role's process, before the first message. Child processes forked later
    inherit the setting; spawned ones call this themselves.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the symbols already loaded: the C library's among them
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, as setting it also fixes the trim
    # threshold glibc would otherwise keep adjusting on its own
    _applied = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    return _applied
