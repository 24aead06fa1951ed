"""Host memory on CPU runs: the per-phase peak RSS the run logs, and the heap setting that keeps
freed blocks for reuse (memory.keep_host_pages)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybridrl
from hybridrl.core import memory


@pytest.mark.fast
def test_phase_peak_rss_is_the_phase_own_peak():
    """host/<phase>/peak_gb: the high-water mark is reset as each phase begins, so a 400 MB buffer
    freed inside one phase shows in that phase's peak and not in the next one's; host/peak_gb stays
    the process's peak so far. (On CPU the heap keeps freed blocks resident for reuse,
    memory.keep_host_pages, so the buffer is handed back explicitly here.)"""
    import numpy as np

    from hybridrl.observe.progress import Phases

    phases = Phases()
    with phases("big"):
        buf = np.ones(50_000_000)  # 400 MB, touched
        del buf
        memory.trim_host_heap()
    with phases("small"):
        pass
    m = phases.memory
    assert m["host/big/peak_gb"] - m["host/small/peak_gb"] > 0.3
    assert m["host/peak_gb"] >= m["host/big/peak_gb"] - 1e-9


_REALLOC = """
import ctypes, os, resource, sys
from hybridrl.core import memory
kept = memory.keep_host_pages(os.environ)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def faults(n=64 << 20):  # a 64 MiB block written, freed: page faults of the second and later ones
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(ctypes.c_void_p(p))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
faults()
print(kept, max(faults() for _ in range(3)))
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux only")
def test_host_heap_keeps_freed_pages():
    """keep_host_pages: a freed 64 MiB block's pages are reused without page faults (glibc's default
    serves it by mmap and unmaps it on free: 16384 faults of 4 KiB each time); HYBRIDRL_HOST_HEAP=default
    leaves glibc alone."""

    def run(**env):
        out = subprocess.run(
            [sys.executable, "-c", _REALLOC],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
            cwd=Path(hybridrl.__file__).parents[1],
        ).stdout.split()
        return out[0] == "True", int(out[1])

    kept, faults = run()
    if not kept:
        pytest.skip("not glibc")
    assert faults < 100
    kept, faults = run(HYBRIDRL_HOST_HEAP="default")
    assert not kept and faults >= 16384
