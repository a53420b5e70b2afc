"""The backend in force: ``native`` (iclab's compiled CPU kernels) or ``xla`` (pure JAX), a run option.

``auto`` (the default) is ``native`` when JAX's default device is a CPU and ``xla`` otherwise (an
accelerator runs the pure-JAX forms; the compiled kernels are CPU code). :func:`use_backend` sets it for a
block of code (the runner does, around a run); the ops and the layers above read it with :func:`backend`.
It is read when Python runs, i.e. when a jitted function is traced: a function jitted once and called again
under another backend keeps the form it was traced with (iclab's experiments build their jitted steps inside
the run, so a run computes wholly with its own backend).
Standard library only at import.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

__all__ = ["BACKENDS", "backend", "resolve_backend", "use_backend"]

#: What a run may ask for.
BACKENDS = ("auto", "native", "xla")

_BACKEND: contextvars.ContextVar[str] = contextvars.ContextVar("iclab_backend", default="auto")


@functools.cache
def _default_platform() -> str:
    import jax

    return jax.default_backend()


def resolve_backend(name: str = "auto") -> str:
    """``native`` or ``xla`` for a requested backend (``auto``: native on a CPU, xla on an accelerator).

    Args:
        name: ``auto``, ``native`` or ``xla``.
    Raises:
        ValueError: another name.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (got {name!r})")
    if name == "auto":
        return "native" if _default_platform() == "cpu" else "xla"
    return name


def backend() -> str:
    """The backend in force here, resolved: ``native`` or ``xla``."""
    return resolve_backend(_BACKEND.get())


@contextlib.contextmanager
def use_backend(name: str):
    """Runs a block of code with this backend in force (``auto``, ``native`` or ``xla``).

    Args:
        name: the backend.
    """
    resolve_backend(name)  # checks the name before anything runs
    token = _BACKEND.set(name)
    try:
        yield resolve_backend(name)
    finally:
        _BACKEND.reset(token)
