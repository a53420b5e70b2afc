"""Data models: key-based, batched JAX samplers of in-context prompts and their population moments.

- :mod:`iclab.tasks.linreg`: linear regression with Gaussian inputs x ~ N(0, Λ) (linattn).
- :mod:`iclab.tasks.multitask`: K correlated tasks per prompt, blocks separated by delimiters (gating).
- :mod:`iclab.tasks.drift`: a task vector drifting along the prompt as an AR(1) process (drift).
- :mod:`iclab.tasks.multitask_regression`: I tasks on orthogonal input blocks, one output each (mhsa).
- :mod:`iclab.tasks.pool`: linear regression whose tasks come from a finite pool of M (task diversity).
- :mod:`iclab.tasks.state_space`: a task drifting as a linear-Gaussian state-space process (AR(1), rotation,
  trend), with its exact autocovariance.
- :mod:`iclab.tasks.switching`: a task redrawn from its prior at random switches inside the prompt (changepoints).

Submodules load on first access (``iclab.tasks.drift``); :func:`standard_normal` and :func:`rbg_key`
are the fast Gaussian draws every sampler uses inside jitted loops.
"""

import importlib

from iclab.tasks._random import rbg_key, standard_normal

_SUBMODULES = ("drift", "linreg", "multitask", "multitask_regression", "pool", "state_space", "switching")
__all__ = ["drift", "linreg", "multitask", "multitask_regression", "pool", "rbg_key", "standard_normal", "state_space",
           "switching"]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
