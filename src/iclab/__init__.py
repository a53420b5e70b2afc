"""iclab: a laboratory for the theory of in-context learning in attention models.

Importing iclab turns on float64 in JAX: theory and the exact engines need it, and a
sampled engine that wants float32 asks for it explicitly.

The notebook surface (each also what a CLI command does)::

    import iclab
    r = iclab.run_experiment("linattn.fig1", "quick", {"N": 63})   # iclab run linattn.fig1 --set N=63
    r.arrays["sampled_attn_m"], r.checks, r.figure()
    iclab.runs()                                                    # iclab runs (a pandas DataFrame)
    iclab.load(r.path)                                              # reopen a stored run
    iclab.run_sweep("linattn.fig1", {"w_init": [1e-6, 1e-4]})      # iclab sweep

Invalid arguments raise :class:`UserError` (:class:`ConfigError`, :class:`StoreError`,
:class:`ExperimentError`) with the one-line message the CLI prints; a user's experiment that raises is
:class:`RunFailed` (the run is recorded as failed, its traceback in the run folder's ``error.txt``).

Subpackages: :mod:`iclab.tasks`, :mod:`iclab.models`, :mod:`iclab.engines`, :mod:`iclab.theory`,
:mod:`iclab.experiments`.
"""

import importlib

from iclab.errors import ConfigError, ExperimentError, RunFailed, StoreError, UserError
from iclab.threads import _apply_environment

_apply_environment()  # ICLAB_THREADS sizes XLA's, BLAS's and OpenMP's pools before any of them loads

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

__version__ = "0.1.0"

# Loaded on first use: a reused run or `iclab list` should not pay for the launcher's imports.
_LAZY = {"run_experiment": "iclab.launch", "RunResult": "iclab.runner", "run_sweep": "iclab.sweep",
         "load": "iclab.results", "runs": "iclab.results"}
__all__ = ["ConfigError", "ExperimentError", "RunFailed", "RunResult", "StoreError", "UserError", "__version__", "load",
           "run_experiment", "run_sweep", "runs"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
