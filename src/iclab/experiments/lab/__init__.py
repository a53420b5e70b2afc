"""Experiments beyond the four papers ("lab"): settings none of them runs, built from the same tasks, models,
engines, theory and baselines; one module per experiment; importing the package registers them all.

- :mod:`~iclab.experiments.lab.task_diversity`: pretraining task diversity (Raventós et al. 2023): a transformer,
  linear attention and one-layer softmax attention trained on a pool of M tasks, against dMMSE, ridge and the
  linear predictor's closed form (:mod:`iclab.theory.task_diversity`).
- :mod:`~iclab.experiments.lab.drift_families`: task drift beyond AR(1) (rotating, trending, switching tasks):
  GLA with one forget factor against its closed-form optimum (:mod:`iclab.theory.nonstationary`), a standard
  transformer, LMS and RLS, and each drift's exact Bayes predictor.
"""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
