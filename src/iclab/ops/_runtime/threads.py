"""Running the compiled kernels on threads: the core count, the thread count asked for, and the job split.

Standard library only at import (``import iclab`` reads :func:`thread_count`'s variable before any numerical
runtime loads).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

from iclab.ops._runtime.llvm import denormals_flushed, restore_denormals

__all__ = ["available_cores", "run_split", "thread_count"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; all cores where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def thread_count() -> int:
    """The threads a kernel computes with: ``ICLAB_THREADS`` when it is an integer ≥ 1, else the available cores.

    (The variable is validated, with its one-line error, by ``iclab.settings``; here a bad value means the default.)
    """
    text = os.environ.get("ICLAB_THREADS", "").strip()
    try:
        n = int(text)
    except ValueError:
        n = 0
    return n if n >= 1 else available_cores()


@functools.cache
def _kernel_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per size, kept for the process: a training step makes hundreds of kernel calls, and starting
    threads for each would cost more than many of the calls."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="iclab-kernel")


def _flushed(kernel, *args) -> None:
    """``kernel(*args)`` with the calling thread's denormals flushed to zero, its mode restored after."""
    old = denormals_flushed()
    try:
        kernel(*args)
    finally:
        restore_denormals(old)


def run_split(kernel, jobs: int, *args, threads: int) -> None:
    """``kernel(*args, first, stop)`` over the jobs [0, jobs), split into contiguous runs, one per thread.

    For the compiled CPU kernels (numba ``nogil``, or ctypes) whose job ranges write disjoint outputs: each run
    is one thread's, so a result summed within a job does not depend on the thread count. ``threads`` is the
    caller's (its module's ``thread_count()``), capped at ``jobs``; the last run on the calling thread, the
    others on a pool kept for the process (several callers may share it: a pool thread never waits on another).
    Every run computes with denormals flushed to zero, as XLA's CPU code does (:func:`iclab.ops._runtime.llvm.denormals_flushed`):
    the same bits on any thread, whoever started it and in whatever mode.
    """
    threads = max(1, min(threads, jobs))
    if threads == 1:
        _flushed(kernel, *args, 0, jobs)
        return
    bounds = [jobs * i // threads for i in range(threads + 1)]
    pool = _kernel_pool(threads - 1)
    futures = [pool.submit(_flushed, kernel, *args, bounds[i], bounds[i + 1]) for i in range(threads - 1)]
    try:
        _flushed(kernel, *args, bounds[threads - 1], bounds[threads])
    finally:  # the pool's runs finish (or fail) before this returns or raises: they write the caller's arrays
        for f in futures:
            f.exception()
    for f in futures:
        f.result()
