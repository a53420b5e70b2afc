"""Freed memory stays in the process: glibc's malloc told not to hand large blocks back to the kernel.

A training step allocates and frees the same large buffers every step (drift.fig1's token tensor is 5 × 5000 ×
101 × 11 float32 = 111 MB, its read-out residuals 20 MB each). glibc serves any block above its mmap threshold
(adaptive, at most 32 MiB) with a fresh ``mmap`` and unmaps it on ``free``, and trims the top of the heap
above 128 KiB, so every step faults in tens of thousands of zeroed pages again, which can cost more than the
arithmetic (drift.fig1's sampler inside jitted code would spend about as long in those faults as in its
kernel).

:func:`retain_freed_memory` sets ``M_MMAP_MAX = 0`` (every block comes from the heap, where a freed block
is reused) and ``M_TRIM_THRESHOLD`` to its maximum (the heap is not trimmed). The price: the process keeps
its peak heap size until it exits, which a training process reaches in its first step anyway. The training
loop (:func:`iclab.engines._loop.run_loop`) and the benches call it; ``ICLAB_MALLOC=system`` leaves glibc's
defaults. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["retain_freed_memory"]

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.cache
def retain_freed_memory(mode: str = "retain") -> bool:
    """Keeps freed blocks in this process's heap (module docstring); idempotent.

    Args:
        mode: ``retain`` (keep freed memory) or ``system`` (glibc's defaults: nothing is set); the caller reads it
            from ``ICLAB_MALLOC`` (:func:`iclab.settings.malloc_mode`).
    Returns:
        True if glibc accepted the settings; False for ``system``, or where the C library is not glibc.
    """
    if mode not in ("retain", "system"):
        raise ValueError(f"mode must be 'retain' or 'system' (got {mode!r})")
    if mode == "system":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) & bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
