"""The one door to JAX's private modules (``jax._src``), for the few things no public API does.

iclab reads three private names: ``jax._src.callback.emit_python_callback`` (host calls that hand a kernel
XLA's operand buffers without copies: :mod:`iclab.ops._runtime.host`), ``jax._src.xla_bridge._backends``
(whether JAX's CPU client has started, so that a late thread count can warn), and
``jax._src.lax.lax._convert_element_type`` (a restored checkpoint keeps its arrays' weak types). Private
modules change between releases, so every access goes through :func:`private`, which names the JAX
versions iclab is tested with (:data:`SUPPORTED_JAX`, the bounds of ``pyproject.toml``) when the name is
missing. Callers that have a public fallback use it; none needs more than one line of message.
"""

from __future__ import annotations

import importlib

__all__ = ["SUPPORTED_JAX", "convert_keeping_weak_type", "jax_backend_started", "private"]

#: The jax and jaxlib versions iclab is tested with (lowest and newest): the bounds of pyproject.toml, both ends
#: installed and run by tests/test_dependency_bounds.py.
SUPPORTED_JAX = ("0.10.0", "0.10.2")


class PrivateJaxMissing(ImportError):
    """A private JAX name iclab reads is missing: another JAX than the supported range."""


def private(module: str, name: str):
    """``jax._src.<module>.<name>``, or :class:`PrivateJaxMissing` with one line naming the supported range.

    Args:
        module: the private module under ``jax._src`` (``callback``, ``xla_bridge``, ``lax.lax``).
        name: the attribute.
    """
    import jax

    try:
        return getattr(importlib.import_module(f"jax._src.{module}"), name)
    except (ImportError, AttributeError):
        raise PrivateJaxMissing(f"jax {jax.__version__} lacks jax._src.{module}.{name}, which iclab reads; iclab is "
                                f"tested with jax {SUPPORTED_JAX[0]} to {SUPPORTED_JAX[1]}") from None


def jax_backend_started() -> bool:
    """Whether JAX has started a backend (its CPU client) in this process (False where that cannot be told)."""
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        return bool(private("xla_bridge", "_backends"))
    except PrivateJaxMissing:
        return False


def convert_keeping_weak_type(x, dtype, *, weak_type: bool):
    """``x`` as a JAX array of ``dtype`` with the given weak type (the public conversions make it strong).

    Args:
        x: an array; dtype: the result's dtype; weak_type: the result's weak type.
    """
    import jax.numpy as jnp

    try:
        convert = private("lax.lax", "_convert_element_type")
        return convert(x, dtype, weak_type=weak_type)
    except (PrivateJaxMissing, TypeError):
        return jnp.asarray(x, dtype=dtype)
