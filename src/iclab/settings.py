"""The ``ICLAB_*`` environment variables, read and validated in one place for the CLI and the Python API.

=========================  ===================================================================  ==============
variable                   meaning                                                              allowed
=========================  ===================================================================  ==============
``ICLAB_RESULTS``          the results root (default ``./iclab-results``)                        a folder path
``ICLAB_THREADS``          threads every runtime computes with (:mod:`iclab.threads`)            integer ≥ 1
``ICLAB_MALLOC``           ``retain``: freed memory stays in the process; ``system``: glibc's     retain, system
``ICLAB_MEMORY_LIMIT_GB``  the most memory a run may plan to use, in GiB (default 80 % of RAM)    number > 0
``ICLAB_CHECKPOINT_EVERY`` checkpoint every K chunks of an engine loop (0: off)                   integer ≥ 0
``ICLAB_CHECKPOINT_SECONDS`` checkpoint when this many seconds have passed since the last one    number > 0
``ICLAB_KERNEL_CACHE``     the compiled kernels' cache folder, or ``off``                         a path or off
=========================  ===================================================================  ==============

Each reader returns the parsed value (None when unset) or raises :class:`iclab.errors.ConfigError` with
one line naming the variable and what is allowed. :func:`check_environment` reads them all: the CLI calls
it before any command and every entry point of the Python API (``run_experiment``, ``run_sweep``,
``load``, ``runs``) before any work, so a bad value is refused the same way from both. ``import iclab``
itself never raises: it applies ``ICLAB_THREADS`` when it is valid and warns when it is not.

Standard library only: ``import iclab`` reads this before any numerical runtime loads.
"""

from __future__ import annotations

import math
import os

from iclab.errors import ConfigError

__all__ = ["VARIABLES", "check_environment", "checkpoint_every", "checkpoint_seconds", "kernel_cache", "malloc_mode",
           "memory_limit_gib", "results_root", "threads"]

VARIABLES = ("ICLAB_RESULTS", "ICLAB_THREADS", "ICLAB_MALLOC", "ICLAB_MEMORY_LIMIT_GB", "ICLAB_CHECKPOINT_EVERY",
             "ICLAB_CHECKPOINT_SECONDS", "ICLAB_KERNEL_CACHE")
MALLOC_MODES = ("retain", "system")


def _raw(name: str) -> str | None:
    text = os.environ.get(name)
    return None if text is None or not text.strip() else text.strip()


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:39] + "…")


def _integer(name: str, low: int) -> int | None:
    text = _raw(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer ≥ {low} (got {_shown(text)})") from None
    if value < low:
        raise ConfigError(f"{name} must be an integer ≥ {low} (got {value})")
    return value


def _positive(name: str) -> float | None:
    text = _raw(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a number > 0 (got {_shown(text)})") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a number > 0 and finite (got {_shown(text)})")
    return value


def threads() -> int | None:
    """``ICLAB_THREADS``: the threads every runtime computes with (None: one per core)."""
    return _integer("ICLAB_THREADS", 1)


def malloc_mode() -> str:
    """``ICLAB_MALLOC``: ``retain`` (the default) or ``system``."""
    text = _raw("ICLAB_MALLOC")
    mode = "retain" if text is None else text.lower()
    if mode not in MALLOC_MODES:
        raise ConfigError(f"ICLAB_MALLOC must be one of {', '.join(MALLOC_MODES)} (got {_shown(text)})")
    return mode


def memory_limit_gib() -> float | None:
    """``ICLAB_MEMORY_LIMIT_GB``: GiB a run may plan to use (None: 80 % of physical memory)."""
    return _positive("ICLAB_MEMORY_LIMIT_GB")


def checkpoint_every() -> int | None:
    """``ICLAB_CHECKPOINT_EVERY``: checkpoint every K chunks (0: off; None: by time only)."""
    return _integer("ICLAB_CHECKPOINT_EVERY", 0)


def checkpoint_seconds() -> float | None:
    """``ICLAB_CHECKPOINT_SECONDS``: seconds between checkpoints (None: the default, 60 s)."""
    return _positive("ICLAB_CHECKPOINT_SECONDS")


def results_root() -> str | None:
    """``ICLAB_RESULTS``: the results root as given (None when unset; the folder is checked where it is used).

    Raises:
        ConfigError: set but empty.
    """
    text = os.environ.get("ICLAB_RESULTS")
    if text is not None and not text.strip():
        raise ConfigError("ICLAB_RESULTS is empty: name a folder, or unset it for ./iclab-results")
    return text


def kernel_cache() -> str | None:
    """``ICLAB_KERNEL_CACHE``: a folder, or ``off`` (also ``0``, ``none``, empty); None when unset."""
    return os.environ.get("ICLAB_KERNEL_CACHE")


def check_environment() -> None:
    """Reads every ``ICLAB_*`` variable; the first bad one is a one-line ConfigError."""
    threads()
    malloc_mode()
    memory_limit_gib()
    checkpoint_every()
    checkpoint_seconds()
    results_root()
