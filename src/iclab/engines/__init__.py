"""Engines turn (task, model, optimiser schedule) into a Trajectory on t = Σ lr.

- :mod:`iclab.engines.population`: exact expected loss; gradient descent or gradient flow.
- :mod:`iclab.engines.sampled`: a fixed training set (full batch) or fresh minibatches.
"""

from iclab.engines import population, sampled
from iclab.engines._loop import Trajectory, record_steps

__all__ = ["Trajectory", "population", "record_steps", "sampled"]
