"""Figures of "Learning to Adapt: In-Context Learning Beyond Stationarity" (drift), one module
per figure; importing the package registers them all."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
