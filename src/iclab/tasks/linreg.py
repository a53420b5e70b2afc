"""In-context linear regression (linattn paper, Sec 2.1, eqs 1-2).

A prompt holds N context pairs (x_n, y_n) and a query x_q, all x ~ N(0, Λ) iid, one task vector
w ~ N(0, I_D) per prompt, and noiseless labels y = wᵀx. Prompts are batched along a leading axis P.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Spectrum = Literal["linear", "inverse", "white"]


class Prompts(NamedTuple):
    """A batch of P in-context regression prompts.

    Attributes:
        x: (P, N, D) context inputs.
        y: (P, N) context labels.
        x_q: (P, D) query inputs.
        y_q: (P,) query labels (targets).
        w: (P, D) task vectors.
    """

    x: jax.Array
    y: jax.Array
    x_q: jax.Array
    y_q: jax.Array
    w: jax.Array


def spectrum_eigenvalues(spectrum: Spectrum, D: int) -> np.ndarray:
    """Eigenvalues of Λ, decreasing, normalised to trace 1.

    ``linear``: λ_d ∝ D+1−d (the reference code's spectrum; (.4, .3, .2, .1) for D = 4).
    ``inverse``: λ_d ∝ 1/d (the captions of Figs 4, 8, 12). ``white``: Λ = I/D.
    """
    if D < 1:
        raise ValueError(f"D must be >= 1 (got {D})")
    d = np.arange(1, D + 1, dtype=float)
    raw = {"linear": d[::-1].copy(), "inverse": 1.0 / d, "white": np.ones(D)}[spectrum]
    return raw / raw.sum()


def covariance(eigenvalues, rotation_key: jax.Array | None = None) -> jax.Array:
    """Λ = Q diag(λ) Qᵀ, with Q = I or a Haar-random orthogonal matrix drawn from ``rotation_key``.

    Args:
        eigenvalues: (D,) positive eigenvalues.
        rotation_key: PRNG key, or None for the eigenbasis aligned with the coordinates.
    Returns:
        (D, D) covariance, float64.
    """
    lam = jnp.asarray(eigenvalues, dtype=jnp.float64)
    if rotation_key is None:
        return jnp.diag(lam)
    D = lam.shape[0]
    # QR of a Gaussian with the sign fix on R's diagonal gives the Haar measure.
    q, r = jnp.linalg.qr(jax.random.normal(rotation_key, (D, D), dtype=jnp.float64))
    q = q * jnp.sign(jnp.diag(r))[None, :]
    return (q * lam[None, :]) @ q.T


def sample_prompts(key: jax.Array, Lam: jax.Array, N: int, P: int) -> Prompts:
    """Draws P prompts of N context pairs with x ~ N(0, Λ), w ~ N(0, I), y = wᵀx (eq 2).

    Args:
        key: PRNG key.
        Lam: (D, D) covariance.
        N: context pairs per prompt.
        P: number of prompts.
    """
    D = Lam.shape[0]
    kx, kw = jax.random.split(key)
    chol = jnp.linalg.cholesky(Lam)
    xs = jax.random.normal(kx, (P, N + 1, D), dtype=Lam.dtype) @ chol.T
    w = jax.random.normal(kw, (P, D), dtype=Lam.dtype)
    ys = jnp.einsum("pnd,pd->pn", xs, w)
    return Prompts(x=xs[:, :N], y=ys[:, :N], x_q=xs[:, N], y_q=ys[:, N], w=w)


def context_moment(prompts: Prompts) -> jax.Array:
    """β = (1/N) Σ_n y_n x_n (eq 4), shape (P, D)."""
    return jnp.einsum("pn,pnd->pd", prompts.y, prompts.x) / prompts.x.shape[1]


def prompt_matrix(prompts: Prompts) -> jax.Array:
    """The token matrix X of eq 1, tokens as columns: [[x_1..x_N x_q], [y_1..y_N 0]].

    Returns:
        (P, D+1, N+1) array.
    """
    xs = jnp.concatenate([prompts.x, prompts.x_q[:, None, :]], axis=1)
    ys = jnp.concatenate([prompts.y, jnp.zeros_like(prompts.y_q)[:, None]], axis=1)
    return jnp.concatenate([jnp.swapaxes(xs, 1, 2), ys[:, None, :]], axis=1)
