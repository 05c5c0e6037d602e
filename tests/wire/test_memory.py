"""zclaw.wire.memory: freed message-sized buffers are reused, not faulted in again (glibc hosts)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A fresh process (the pytest process may already be tuned): page faults per cycle of eight 1 MiB
# buffers written and freed together, as a batch's fields are, before and after keep_freed_buffers().
SCRIPT = textwrap.dedent("""
    import resource, numpy as np
    from zclaw.wire.memory import keep_freed_buffers

    def faults(cycles=20):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(cycles):
            bufs = [np.ones(1 << 18, np.float32) for _ in range(8)]
            del bufs
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / cycles

    faults(3)
    before = faults()
    applied = keep_freed_buffers()
    again = keep_freed_buffers()  # once per process: the second call only reports
    faults(1)
    print(applied, again, before, faults())
""")


def test_keep_freed_buffers_stops_refaulting_message_sized_buffers() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    applied, again, before, after = out.stdout.split()
    if applied != "True":
        pytest.skip("the C library has no mallopt (not glibc): nothing to tune")
    assert again == "True"
    # without it glibc gives the freed 8 MiB back to the kernel each cycle: ~2048 fresh pages
    assert float(before) > 1000, before
    assert float(after) < float(before) / 20, (before, after)
