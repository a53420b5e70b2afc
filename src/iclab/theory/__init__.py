"""Closed-form theory, one module per paper (and per setting beyond them); nothing here trains a model.

- :mod:`iclab.theory.linattn`: linear attention training dynamics (Zhang, Singh, Latham, Saxe).
- :mod:`iclab.theory.wpgd`: gated linear attention as weighted preconditioned GD (gating).
- :mod:`iclab.theory.drift`: GLA with a forget factor under AR(1) task drift (drift).
- :mod:`iclab.theory.mhsa`: multi-head softmax attention dynamics and optimality (mhsa).
- :mod:`iclab.theory.nonstationary`: drift's exponential-weights (GLA) risk for any task autocovariance
  (rotating, trending, switching tasks; AR(1) is drift's Theorem 2).
- :mod:`iclab.theory.task_diversity`: the linear in-context predictor on a finite task pool (Raventós et al. 2023;
  the ``lab`` experiments, beyond the four papers).

Submodules load on first access (``iclab.theory.wpgd``), so importing one paper's theory does
not pay for scipy.optimize and the others.
"""

import importlib

__all__ = ["drift", "linattn", "mhsa", "nonstationary", "task_diversity", "wpgd"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
