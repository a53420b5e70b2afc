"""Multi-task in-context linear regression (mhsa paper, §2.2, eq 2.4).

Tokens are columns. A prompt holds L context pairs (x_l, y_l) and a query q, with x_l, q iid
N(0, I_d), y_l = Gᵀx_l + ε_l, ε_l iid N(0, σ² I_{d_y}), and the noiseless target y_q = Gᵀq.
G = d^{-1/2} Φ blockdiag(g_1, …, g_I) Ψᵀ ∈ R^{d×d_y}: block i puts g_i ~ N(0, λ_i I_{d_i}) in the
rows J_i = {d_1+…+d_{i-1}+1, …, d_1+…+d_i} and column i (columns I+1..d_y, if any, are nominal
tasks with zero signal). Φ, Ψ are fixed orthogonal matrices (identity by default, Haar-random as an
option). G, X, ε, q are fresh per prompt; prompts are batched along a leading axis P.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MultitaskPrompts", "TaskStructure", "block_scales", "haar_orthogonal", "homogeneous", "sample_G",
           "sample_prompts", "target_second_moment", "task_structure"]


class MultitaskPrompts(NamedTuple):
    """A batch of P multi-task prompts (tokens as columns).

    Attributes:
        X: (P, d, L) context covariates.
        Y: (P, d_y, L) context responses (noisy).
        q: (P, d) queries.
        y_q: (P, d_y) noiseless targets Gᵀq.
        G: (P, d, d_y) task matrices.
    """

    X: jax.Array
    Y: jax.Array
    q: jax.Array
    y_q: jax.Array
    G: jax.Array


class TaskStructure(NamedTuple):
    """Fixed structure of the task family: block sizes d_i, signals λ_i, noise σ, Φ, Ψ.

    Attributes:
        d_i: (I,) block sizes, Σ d_i = d.
        lam: (I,) signal variances λ_i (Cov g_i = λ_i I).
        sigma: noise standard deviation σ.
        Phi: (d, d) orthogonal covariate basis.
        Psi: (d_y, d_y) orthogonal output basis.
    """

    d_i: tuple
    lam: tuple
    sigma: float
    Phi: jax.Array
    Psi: jax.Array

    @property
    def d(self) -> int:
        """Covariate dimension d = Σ d_i."""
        return int(sum(self.d_i))

    @property
    def d_y(self) -> int:
        """Output dimension d_y (≥ I; outputs beyond I are nominal tasks with λ = 0)."""
        return int(self.Psi.shape[0])


def haar_orthogonal(key: jax.Array, n: int) -> jax.Array:
    """Haar-random orthogonal matrix: Q of the QR of an iid Gaussian matrix, columns signed by diag R.

    Args:
        key: PRNG key; n: size.
    Returns:
        (n, n) float64 orthogonal matrix.
    """
    q, r = jnp.linalg.qr(jax.random.normal(key, (n, n), dtype=jnp.float64))
    return q * jnp.sign(jnp.diag(r))[None, :]


def task_structure(d_i, lam, *, sigma: float = 0.0, d_y: int | None = None,
                   rotation_key: jax.Array | None = None) -> TaskStructure:
    """Builds the task family of (2.4): blocks J_i of sizes d_i, Cov g_i = λ_i I, noise σ, bases Φ, Ψ.

    Args:
        d_i: (I,) positive block sizes (homogeneous tasks: all equal).
        lam: (I,) non-negative per-task signals λ_i, or a scalar (every task's λ_i).
        sigma: noise standard deviation σ ≥ 0.
        d_y: output dimension ≥ I (default I); extra outputs are nominal tasks with λ = 0.
        rotation_key: None for Φ = Ψ = I, else a PRNG key for Haar-random Φ and Ψ.
    Returns:
        The :class:`TaskStructure` (Φ, Ψ in float64).
    """
    d_i = tuple(int(v) for v in np.atleast_1d(d_i))
    I = len(d_i)
    lam_arr = np.broadcast_to(np.asarray(lam, dtype=float), (I,))
    if min(d_i) < 1 or np.any(lam_arr < 0) or sigma < 0:
        raise ValueError(f"need d_i >= 1, lam >= 0, sigma >= 0 (got {d_i}, {lam}, {sigma})")
    d_y = I if d_y is None else int(d_y)
    if d_y < I:
        raise ValueError(f"d_y must be >= I = {I} (got {d_y})")
    d = sum(d_i)
    if rotation_key is None:
        Phi, Psi = jnp.eye(d, dtype=jnp.float64), jnp.eye(d_y, dtype=jnp.float64)
    else:
        k1, k2 = jax.random.split(rotation_key)
        Phi, Psi = haar_orthogonal(k1, d), haar_orthogonal(k2, d_y)
    return TaskStructure(d_i, tuple(float(v) for v in lam_arr), float(sigma), Phi, Psi)


def homogeneous(I: int, d_bar: int, *, lam: float = 1.0, sigma: float = 0.0, d_y: int | None = None,
                rotation_key: jax.Array | None = None) -> TaskStructure:
    """I tasks of equal size d̄ and signal λ_i = λ (Thm 4.4, Table 1, Figs 1, 4–5).

    Args:
        I: tasks; d_bar: block size d̄ (d = I d̄); lam: every task's signal λ; sigma: noise standard
        deviation σ; d_y, rotation_key: as :func:`task_structure`.
    Returns:
        The :class:`TaskStructure`.
    """
    return task_structure((d_bar,) * I, lam, sigma=sigma, d_y=d_y, rotation_key=rotation_key)


def block_scales(ts: TaskStructure) -> np.ndarray:
    """Scales S of the task matrix: G = d^{-1/2} Φ (S ⊙ N) Ψᵀ with N iid N(0, 1), S[J_i, i] = √λ_i, else 0.

    Args:
        ts: the task family.
    Returns:
        (d, d_y) float64 array S.
    """
    S = np.zeros((ts.d, ts.d_y))
    start = 0
    for i, (di, li) in enumerate(zip(ts.d_i, ts.lam)):
        S[start:start + di, i] = np.sqrt(li)
        start += di
    return S


def sample_G(key: jax.Array, ts: TaskStructure, P: int) -> jax.Array:
    """Task matrices G = d^{-1/2} Φ blockdiag(g_1, …, g_I) Ψᵀ, g_i ~ N(0, λ_i I) (eq 2.4).

    Args:
        key: PRNG key; ts: the task family; P: number of matrices.
    Returns:
        (P, d, d_y) in the dtype of ts.Phi.
    """
    S = jnp.asarray(block_scales(ts), dtype=ts.Phi.dtype)
    core = jax.random.normal(key, (P, ts.d, ts.d_y), dtype=ts.Phi.dtype) * S / float(np.sqrt(ts.d))  # a Python float keeps the dtype
    return jnp.einsum("ab,pbc,dc->pad", ts.Phi, core, ts.Psi)


def sample_prompts(key: jax.Array, ts: TaskStructure, L: int, P: int) -> MultitaskPrompts:
    """Draws P prompts of L context pairs (eq 2.4): y_l = Gᵀx_l + ε_l, y_q = Gᵀq.

    The key is split into four, for G, X, q and ε in that order.

    Args:
        key: PRNG key; ts: the task family (its Φ's dtype sets the dtype of the draws); L: context
        length; P: prompts.
    Returns:
        :class:`MultitaskPrompts` of P prompts.
    """
    kg, kx, kq, ke = jax.random.split(key, 4)
    dt = ts.Phi.dtype
    G = sample_G(kg, ts, P)
    X = jax.random.normal(kx, (P, ts.d, L), dtype=dt)
    q = jax.random.normal(kq, (P, ts.d), dtype=dt)
    eps = ts.sigma * jax.random.normal(ke, (P, ts.d_y, L), dtype=dt)
    Y = jnp.einsum("pdy,pdl->pyl", G, X) + eps
    y_q = jnp.einsum("pdy,pd->py", G, q)
    return MultitaskPrompts(X, Y, q, y_q, G)


def target_second_moment(ts: TaskStructure) -> float:
    """E‖y_q‖² = Σ_i λ_i d_i / d (the loss of the zero predictor, without the ½).

    Args:
        ts: the task family.
    Returns:
        float.
    """
    return float(sum(l * di for l, di in zip(ts.lam, ts.d_i)) / ts.d)
