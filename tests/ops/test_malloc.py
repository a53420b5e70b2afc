"""iclab.ops.retain_freed_memory: with freed memory retained, a large block comes from the heap and stays there when freed."""

import os
import platform
import subprocess
import sys

import pytest

from iclab.ops._runtime.malloc import retain_freed_memory
from iclab.errors import ConfigError

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Allocates a 96 MiB block (above glibc's largest mmap threshold, 32 MiB) and frees it, reading glibc's
# statistics (mallinfo2) while it lives and after: bytes in mmapped blocks, then the heap's size.
_PROBE = """
import ctypes, numpy as np
from iclab.ops._runtime.malloc import retain_freed_memory
from iclab.settings import malloc_mode
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
print(retain_freed_memory(malloc_mode()))
a = np.ones(96 << 17)
print(mallinfo2().hblkhd)
del a
print(mallinfo2().arena)
"""
MIB = 1 << 20


def _probe(mode: str) -> tuple[str, int, int]:
    env = {**os.environ, "ICLAB_MALLOC": mode}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    accepted, mmapped, heap_after_free = out.stdout.split()
    return accepted, int(mmapped), int(heap_after_free)


@glibc
def test_large_block_comes_from_the_heap_and_stays():
    accepted, mmapped, heap = _probe("system")
    assert accepted == "False"
    assert mmapped >= 96 * MIB  # glibc's default: mapped afresh, and unmapped on free
    assert heap < 96 * MIB
    accepted, mmapped, heap = _probe("retain")
    assert accepted == "True"
    assert mmapped < 96 * MIB
    assert heap >= 96 * MIB  # freed, kept for the next step's block


def test_bad_setting_is_named(monkeypatch):
    from iclab.settings import malloc_mode

    monkeypatch.setenv("ICLAB_MALLOC", "sometimes")
    with pytest.raises(ConfigError, match="ICLAB_MALLOC must be one of retain, system"):
        malloc_mode()
    with pytest.raises(ValueError, match="mode must be 'retain' or 'system'"):
        retain_freed_memory("sometimes")
