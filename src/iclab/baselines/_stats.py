"""A Monte Carlo estimate with its standard error, the currency of every baseline comparison."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Estimate", "mean_and_se"]


class Estimate(NamedTuple):
    """The mean of per-prompt values and its standard error.

    Attributes:
        mean: () the sample mean.
        se: () its standard error, std(ddof=1)/√P (nan for a single value).
    """

    mean: jax.Array
    se: jax.Array


def mean_and_se(values) -> Estimate:
    """Sample mean and standard error of independent per-prompt values: v̄ and s/√P.

    Args:
        values: (P,) or any shape; every entry counts as one independent draw.
    Returns:
        :class:`Estimate` of () arrays in the values' dtype.
    """
    v = jnp.ravel(jnp.asarray(values))
    P = v.shape[0]
    se = jnp.std(v, ddof=1) / jnp.sqrt(P) if P > 1 else jnp.asarray(jnp.nan, v.dtype)
    return Estimate(jnp.mean(v), se)
