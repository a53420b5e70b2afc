"""Engines turn (task, model, optimiser schedule) into a Trajectory on t = Σ lr.

- :mod:`iclab.engines.population`: exact expected loss; gradient descent or gradient flow.
- :mod:`iclab.engines.sampled`: a fixed training set (full batch) or fresh minibatches.
- :mod:`iclab.engines.moments`: exact full-batch GD from sufficient statistics, for predictions
  linear in a fixed feature of the prompt; O(dim φ²) per step, independent of P and N.
- :mod:`iclab.engines.moments_native`: the same GD for the reduced linattn models in compiled
  numba kernels (plain GD, CPU), ~4× faster per step than XLA there.
"""

from iclab.engines import moments, moments_native, population, sampled
from iclab.engines._loop import Trajectory, record_steps

__all__ = ["Trajectory", "moments", "moments_native", "population", "record_steps", "sampled"]
