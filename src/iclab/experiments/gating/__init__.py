"""Figures of "Gating is Weighting: Understanding Gated Linear Attention through In-context Learning" (gating), one module
per figure; importing the package registers them all."""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    if not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")
