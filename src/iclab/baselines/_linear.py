"""Linear in-context estimators: least squares, ridge, n-step (preconditioned) GD and WPGD.

Each takes one layout of plain arrays, ``x: (..., N, D)`` context inputs, ``y: (..., N)`` labels and
``x_q: (..., D)`` query inputs, batched over any leading axes (the prompts), and returns the
prediction ŷ = x_qᵀŵ, shape (...,), in x's dtype. These are the algorithms the papers say their
trained models implement: one step of preconditioned GD (linattn eq 11: P = (Λ + (Λ + trΛ·I)/N)⁻¹,
η = 1), WPGD (gating eq 7; drift eq 15 with ω_i = λ^{n+1−i}, P = D1 Λ̃⁻¹).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iclab.baselines._conditioning import _jit, _posterior, _posterior_mean_g

__all__ = ["exponential_weights", "gd", "least_squares", "preconditioned_gd", "ridge", "wpgd"]


def _dot(a, b):
    return jnp.sum(a * b, axis=-1)


def _matvec(A, v):
    return (A @ v[..., None])[..., 0]


@_jit()
def least_squares(x, y, x_q) -> jax.Array:
    """Minimum-norm least squares: ŵ = X⁺y (the interpolant of least norm when N < D), ŷ = x_qᵀŵ.

    X⁺ is applied through the thin SVD of X, dropping singular values below 10·max(N, D)·eps·s_max.

    Args:
        x: (..., N, D) context inputs X.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    return _dot(x_q, _posterior_mean_g(_posterior(x, jnp.zeros((), x.dtype)), y))


@_jit()
def ridge(x, y, x_q, *, lam) -> jax.Array:
    """Ridge regression: ŵ = (XᵀX + λI)⁻¹Xᵀy, ŷ = x_qᵀŵ (the raw penalty λ, not scaled by N).

    The Bayes posterior mean under w ~ N(0, σ_w² I), label noise σ² is ridge with λ = σ²/σ_w²
    (:func:`gaussian_posterior_mean`).

    Args:
        x: (..., N, D) context inputs X.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        lam: penalty λ > 0 (a scalar, possibly traced).
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    D = x.shape[-1]
    A = jnp.swapaxes(x, -1, -2) @ x + lam * jnp.eye(D, dtype=x.dtype)
    b = jnp.einsum("...nd,...n->...d", x, y)
    return _dot(x_q, jnp.linalg.solve(A, b[..., None])[..., 0])


@_jit("steps")
def preconditioned_gd(x, y, x_q, *, P=None, eta=1.0, steps: int = 1) -> jax.Array:
    """n steps of preconditioned GD from w_0 = 0 on L(w) = (1/2N) Σ_n (y_n − wᵀx_n)².

    w_{t+1} = w_t + (η/N) P Xᵀ(y − X w_t),  ŷ = x_qᵀ w_steps. One step with η = 1 is
    ŷ = x_qᵀ P β, β = (1/N) Σ_n y_n x_n (linattn eq 4); with P = (Λ + (Λ + trΛ·I)/N)⁻¹ it is the
    converged ATTN_M of linattn eq 11.

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        P: (D, D) or (..., D, D) preconditioner; None for I (plain GD).
        eta: step size η.
        steps: number of steps (static int ≥ 0; 0 gives ŷ = 0).
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    if steps < 0:
        raise ValueError(f"steps must be >= 0 (got {steps})")
    N = x.shape[-2]
    scale = jnp.asarray(eta, x.dtype) / N

    def step(w, _):
        g = jnp.einsum("...nd,...n->...d", x, y - jnp.einsum("...nd,...d->...n", x, w))
        return w + scale * (g if P is None else _matvec(jnp.asarray(P, x.dtype), g)), None

    w0 = jnp.zeros(jnp.broadcast_shapes(x.shape[:-2], y.shape[:-1]) + x.shape[-1:], x.dtype)
    w, _ = jax.lax.scan(step, w0, None, length=steps)
    return _dot(x_q, w)


def gd(x, y, x_q, *, eta, steps: int) -> jax.Array:
    """n steps of plain GD from w_0 = 0: w_{t+1} = w_t + (η/N) Xᵀ(y − X w_t), ŷ = x_qᵀ w_steps.

    :func:`preconditioned_gd` with P = I. For 0 < η < 2N/s_max(X)² it tends to least squares as
    steps → ∞ (the min-norm solution: every iterate lies in the row space of X).

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        eta: step size η.
        steps: number of steps (static int ≥ 0).
    Returns:
        (...,) predictions.
    """
    return preconditioned_gd(x, y, x_q, P=None, eta=eta, steps=steps)


@_jit()
def wpgd(x, y, x_q, *, P=None, omega) -> jax.Array:
    """Weighted preconditioned GD, one step (gating eq 7): ŷ = x_qᵀ P Xᵀ(ω ⊙ y).

    No 1/N: ω carries the scale. Drift's eq 15 is ω_i = λ^{n+1−i} (:func:`exponential_weights`)
    with P = D1 Λ̃⁻¹; linear attention is ω = 1.

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        P: (D, D) or (..., D, D) preconditioner; None for I.
        omega: (N,) or (..., N) sample weights ω.
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    g = jnp.einsum("...nd,...n->...d", x, jnp.asarray(omega, x.dtype) * y)
    return _dot(x_q, g if P is None else _matvec(jnp.asarray(P, x.dtype), g))


def exponential_weights(n: int, *, lam, dtype=jnp.float64) -> jax.Array:
    """Recency weights of a forget factor λ: ω_i = λ^{n+1−i}, i = 1..n (drift eq 15, GLA's λ^{n+1−i}).

    Args:
        n: number of context samples.
        lam: forget factor λ (scalar, possibly traced).
        dtype: float dtype of the result.
    Returns:
        (n,) weights, the last (most recent) λ.
    """
    return jnp.asarray(lam, dtype) ** jnp.arange(n, 0, -1, dtype=dtype)
