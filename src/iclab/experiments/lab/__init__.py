"""Settings beyond the four papers ("lab"): experiments on the models and theory of iclab that none of the papers
runs, one module each; importing the package registers them all.

- :mod:`~iclab.experiments.lab.task_diversity`: pretraining task diversity (Raventós et al. 2023): a transformer,
  linear attention and one-layer softmax attention trained on a pool of M tasks, against dMMSE, ridge and the
  linear predictor's closed form (:mod:`iclab.theory.task_diversity`).
"""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
