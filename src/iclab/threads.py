"""How many threads a process of iclab's computes with, so that runs sharing a CPU do not oversubscribe it.

Every numerical runtime iclab uses starts a pool of one thread per core by default: XLA's CPU client
(its intra-op and client pools, sized by ``PJRT_NPROC``), OpenMP and BLAS (``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ...), PyTorch (``torch.set_num_threads``) and numba's
seeds (:mod:`iclab.engines.moments_native`). When fewer cores are free than threads, their workers
spin and fight: measured on a 2-core machine beside one CPU-bound process, a quick preset's CPU time
grew more than tenfold. Sweep workers and Ray tasks multiply this, each with a full pool.

BLAS is a special case. iclab's numpy/scipy linear algebra is small (BFGS over a few weights, d × d
solves): a second BLAS thread only busy-waits for work, and beside a neighbour it takes the neighbour's
core. OpenBLAS's threads spin (``gating.optimum``'s BFGS was the tenfold above). So unless
``ICLAB_THREADS`` or the user's own variable says otherwise, ``import iclab`` gives BLAS one thread
(:data:`BLAS_VARIABLES`, where numpy has not loaded yet); XLA, which does iclab's heavy work, keeps one
thread per core.

:func:`set_threads` sets every pool's size for this process (and for the processes it starts). It must
run before JAX computes anything (XLA sizes its pools when its CPU client starts) and, for BLAS, before
numpy loads; ``ICLAB_THREADS`` is applied by ``import iclab`` itself, first thing. The CLI's
``--threads`` option sets it for one command; a local sweep gives each of its W workers ⌊cores / W⌋
threads (at least one), a Ray task the CPUs it asked for (one).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import warnings

from iclab import settings
from iclab._llvm import denormals_flushed, restore_denormals  # standard library only at import
from iclab.errors import ConfigError

__all__ = ["BLAS_VARIABLES", "POOL_VARIABLES", "available_cores", "requested_threads", "run_split", "set_threads",
           "thread_count"]

#: Environment variables that size the thread pools of XLA (PJRT_NPROC), OpenMP, BLAS and numba.
POOL_VARIABLES = ("PJRT_NPROC", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                  "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")

#: The BLAS libraries' own variables: one thread each by default (module docstring).
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; all cores where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def requested_threads() -> int | None:
    """The thread count asked for by ``ICLAB_THREADS`` (None when unset).

    Raises:
        iclab.errors.ConfigError: ``ICLAB_THREADS`` is not an integer ≥ 1 (one line; :mod:`iclab.settings`).
    """
    return settings.threads()


def thread_count() -> int:
    """The threads this process computes with: ``ICLAB_THREADS`` if set, else the available cores."""
    try:
        n = requested_threads()
    except ConfigError:
        n = None
    return n if n is not None else available_cores()


def set_threads(n: int) -> None:
    """Sizes every thread pool of this process (and of the processes it starts) to ``n`` threads.

    Sets ``ICLAB_THREADS`` and :data:`POOL_VARIABLES`, PyTorch's intra-op threads if torch is loaded, and
    the pools of BLAS and OpenMP libraries already loaded (``threadpoolctl``). XLA reads ``PJRT_NPROC`` when its CPU client starts: if JAX has already computed in this process,
    its pools keep their size (a warning says so).

    Args:
        n: threads, ≥ 1.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"threads must be an integer ≥ 1 (got {n!r})")
    os.environ["ICLAB_THREADS"] = str(n)
    for name in POOL_VARIABLES:
        os.environ[name] = str(n)
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(n)
    _limit_loaded_pools(n)
    if _jax_backend_started():
        warnings.warn(f"JAX's CPU client has started already: its thread pools keep their size (asked for {n}); set "
                      "ICLAB_THREADS before the process computes", stacklevel=2)


def _limit_loaded_pools(n: int, user_api: str | None = None) -> None:
    """Resizes the pools of BLAS / OpenMP libraries this process has loaded already (their variables are
    read once, at load)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency; without it the variables still reach new processes
        return
    threadpool_limits(limits=n, user_api=user_api)


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(getattr(xla_bridge, "_backends", None))
    except Exception:  # pragma: no cover - private API moved
        return False


def _apply_environment() -> None:
    """``import iclab`` calls this first: ICLAB_THREADS sizes the pools before any runtime loads.

    A bad value is a warning here (an import must not fail); the CLI and every entry point of the API refuse
    it in one line (:func:`iclab.settings.check_environment`)."""
    try:
        n = requested_threads()
    except ConfigError as err:
        command = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        if command != "iclab" and not sys.argv[0].endswith(os.path.join("iclab", "cli.py")):
            warnings.warn(f"{err}; the default thread pools are kept", stacklevel=3)  # the CLI says it in one line
        n = None
    if n is not None:
        for name in POOL_VARIABLES:
            os.environ[name] = str(n)
        return
    # A user's own variable wins. Where numpy loaded before iclab (a notebook), its BLAS has read its
    # variables already and keeps its pool: ``set_threads`` resizes it.
    for name in BLAS_VARIABLES:
        os.environ.setdefault(name, "1")


@functools.cache
def _kernel_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per size, kept for the process: a training step makes hundreds of kernel calls, and starting
    threads for each cost ≈ 0.1 ms a call."""
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
    Every run computes with denormals flushed to zero, as XLA's CPU code does (``iclab._llvm.denormals_flushed``):
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
