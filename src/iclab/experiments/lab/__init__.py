"""Experiments beyond the four papers ("lab"): settings none of them runs, built from the same tasks, models,
engines, theory and baselines; one module per experiment; importing the package registers them all."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
