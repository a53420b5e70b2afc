"""Gaussian conditioning through the SVD of the design: the shared kernel of the Bayes baselines.

Every Gaussian data model here is, per prompt, a standard Gaussian vector g ~ N(0, I_m) seen through
a linear design, y = M g + σε (M: (n, m)), with a target hᵀg. With M = U diag(s) Vᵀ (thin SVD),

    E[g | y] = V diag(s/(s² + σ²)) Uᵀ y,     Cov[g | y] = I − V diag(s²/(s² + σ²)) Vᵀ.

Working with the SVD of M (never with the Gram MMᵀ or MᵀM) keeps the noiseless case σ² = 0 exact:
the factor s/(s² + σ²) becomes 1/s on the singular values above ``rtol``·s_max and 0 below (they are
roundoff of exact zeros), so E[g | y] = M⁺y, the limit σ² → 0, with the conditioning of M, not M².
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__: list[str] = []


class _Posterior(NamedTuple):
    U: jax.Array  # (..., n, k)
    Vh: jax.Array  # (..., k, m)
    f_mean: jax.Array  # (..., k) s/(s² + σ²), 0 on dropped singular values
    f_var: jax.Array  # (..., k) s²/(s² + σ²), 0 on dropped singular values


def _rtol(dtype, n: int, m: int) -> float:
    # numpy's matrix_rank convention (max(n, m)·eps), ×10: roundoff of an exact zero singular value
    # of a Gaussian design stays well below it, genuine ones of random designs far above.
    return 10.0 * max(n, m) * float(jnp.finfo(dtype).eps)


def _posterior(M: jax.Array, sigma2) -> _Posterior:
    n, m = M.shape[-2:]
    U, s, Vh = jnp.linalg.svd(M, full_matrices=False)
    keep = s > _rtol(M.dtype, n, m) * s[..., :1]
    s_safe = jnp.where(keep, s, 1.0)  # the double where keeps a zero design free of 0/0
    denom = s_safe * s_safe + sigma2
    return _Posterior(U, Vh, jnp.where(keep, s_safe / denom, 0.0), jnp.where(keep, s_safe * s_safe / denom, 0.0))


def _posterior_mean_g(post: _Posterior, y: jax.Array) -> jax.Array:
    """E[g | y]: (..., m)."""
    coef = post.f_mean * jnp.einsum("...nk,...n->...k", post.U, y)
    return jnp.einsum("...km,...k->...m", post.Vh, coef)


def _posterior_quadratic(post: _Posterior, Q: jax.Array) -> jax.Array:
    """tr(Q Cov[g | y]) = tr Q − Σ_k f_var,k (V_kᵀ Q V_k): (...,). Q: (..., m, m) symmetric."""
    VQV = jnp.sum((post.Vh @ Q) * post.Vh, axis=-1)
    return jnp.trace(Q, axis1=-2, axis2=-1) - jnp.sum(post.f_var * VQV, axis=-1)


def _jit(*static: str):
    """jax.jit behind a plain Python function (so docstring, signature and ``inspect.isfunction`` survive).

    Static arguments (keyword-only in this package) given as lists are made tuples, so that they hash.
    Compiling the whole baseline once per shape costs a fraction of dispatching it op by op.
    """
    def decorate(fn):
        jitted = jax.jit(fn, static_argnames=static)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for name in static:
                if isinstance(kwargs.get(name), list):
                    kwargs[name] = tuple(kwargs[name])
            return jitted(*args, **kwargs)

        return wrapper

    return decorate
