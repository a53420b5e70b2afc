"""Engines turn (task, model, optimiser, learning rate) into a Trajectory on t = Σ lr; they own all training.

- :mod:`iclab.engines.population`: exact expected loss; gradient descent or gradient flow.
- :mod:`iclab.engines.sampled`: a fixed training set (full batch) or fresh minibatches.
- :mod:`iclab.engines.moments`: exact full-batch GD from sufficient statistics, for predictions
  linear in a fixed feature of the prompt; O(dim φ²) per step, independent of P and N.
- :mod:`iclab.engines.moments_native`: the same GD for the reduced linattn models in compiled
  kernels (plain GD, CPU), faster per step than XLA there (no fixed cost per operation).
- :mod:`iclab.engines.joint`: a grid of independent models trained jointly on shared minibatches,
  keys depending only on (seed, member, step); :func:`family_members` makes a group of any registered model
  family (:mod:`iclab.models`), and :func:`train_family` trains one family on a task's sampler in one call.
- :mod:`iclab.engines.linreg`: any registered in-context linear-regression model family
  (:mod:`iclab.models`) trained by the population, moments or sampled engine.

Every engine takes the optimiser as an optax ``GradientTransformation`` without learning rate and
the learning rate (a float or a schedule) apart: see :mod:`iclab.engines._descent`.

:func:`backend` says which backend a run computes with, ``native`` (the compiled kernels of :mod:`iclab.ops`)
or ``xla``: a run option (``iclab run --backend``), never a paper setting.
"""

from iclab.engines import joint, moments, moments_native, population, sampled
from iclab.engines._descent import Schedule, as_schedule, with_learning_rate
from iclab.engines._loop import Diverged, Trajectory, record_steps
from iclab.engines.joint import (
    Members,
    each_member,
    family_members,
    init_members,
    seed_keys,
    train_family,
    train_members,
)
from iclab.ops import backend

__all__ = ["Diverged", "Members", "Schedule", "Trajectory", "as_schedule", "backend", "each_member", "family_members",
           "init_members", "joint", "moments", "moments_native", "population", "record_steps", "sampled", "seed_keys",
           "train_family", "train_members", "with_learning_rate"]
