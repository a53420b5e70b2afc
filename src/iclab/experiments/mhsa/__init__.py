"""Figures of "Training Dynamics of Multi-Head Softmax Attention for In-Context Learning" (mhsa), one module
per figure; importing the package registers them all."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
