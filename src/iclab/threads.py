"""How many threads a process of iclab's computes with, so that runs sharing a CPU do not oversubscribe it.

Every numerical runtime iclab uses starts a pool of one thread per core by default: XLA's CPU client (its
intra-op and client pools, sized by ``PJRT_NPROC``), OpenMP and BLAS (``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ...), PyTorch (``torch.set_num_threads``) and the compiled
kernels of :mod:`iclab.ops`. When fewer cores are free than threads, their workers spin and fight: beside one
CPU-bound process, a quick preset's CPU time can grow tenfold. Sweep workers and Ray tasks multiply this, each
with a full pool.

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

import os
import sys
import warnings

from iclab import settings
from iclab.errors import ConfigError
from iclab.ops._runtime.threads import available_cores, thread_count  # standard library only at import

__all__ = ["BLAS_VARIABLES", "POOL_VARIABLES", "available_cores", "requested_threads", "set_threads", "thread_count"]

#: Environment variables that size the thread pools of XLA (PJRT_NPROC), OpenMP, BLAS and the compiled kernels.
POOL_VARIABLES = ("PJRT_NPROC", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                  "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")

#: The BLAS libraries' own variables: one thread each by default (module docstring).
BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def requested_threads() -> int | None:
    """The thread count asked for by ``ICLAB_THREADS`` (None when unset).

    Raises:
        iclab.errors.ConfigError: ``ICLAB_THREADS`` is not an integer ≥ 1 (one line; :mod:`iclab.settings`).
    """
    return settings.threads()


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
    from iclab.ops import jax_backend_started

    return jax_backend_started()


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
