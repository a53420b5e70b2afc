"""Online adaptive filters on a prompt: LMS and exponentially weighted RLS, and LMS's exact risk under drift.

Both filters read the context pairs in order, as a stream, and predict the query with their final
estimate ŵ_N (ŷ = x_qᵀŵ_N); they are the classical trackers of a drifting task (drift paper, Sec 5):

- LMS (online GD with step μ, one pass, ŵ_0 = 0): ŵ_t = ŵ_{t−1} + μ x_t (y_t − x_tᵀŵ_{t−1}).
- RLS with forget factor β and P_0 = δI (ŵ_0 = 0): the exponentially weighted least squares
  ŵ_N = (Σ_{i≤N} β^{N−i} x_i x_iᵀ + β^N I/δ)⁻¹ Σ_{i≤N} β^{N−i} x_i y_i, solved directly here (the
  recursive form, ``iclab.theory.drift.rls_predictions``, is its test twin).

Fed the first n tokens of a drift prompt and x_{n+1}, ``lms(...)`` equals the last a-priori prediction of
``iclab.theory.drift.lms_predictions`` on the whole prompt, and likewise for RLS.

:func:`lms_risk` is the exact expected squared error of LMS's query prediction under drift's AR(1) task
process with Gaussian inputs. The pair (w_t, ŵ_t) evolves linearly with random rank-one factors
x_t x_tᵀ independent of the past, so its second moments follow a deterministic recursion (Gaussian
fourth moments E[x xᵀ M x xᵀ] = Λ(M + Mᵀ)Λ + tr(ΛM)Λ close it) [derived here; not in the papers].
No such closed form exists for RLS (its gain is a random matrix inverse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from iclab.baselines._conditioning import _jit

__all__ = ["lms", "lms_risk", "rls"]


@_jit()
def lms(x, y, x_q, *, mu, w0=None) -> jax.Array:
    """LMS (least mean squares, one pass of online GD) over the context, then the query: ŷ = x_qᵀŵ_N.

    ŵ_t = ŵ_{t−1} + μ x_t (y_t − x_tᵀŵ_{t−1}), t = 1..N, from ŵ_0 = w0 (default 0).

    Args:
        x: (..., N, D) context inputs, in stream order.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        mu: step size μ > 0 (scalar, possibly traced).
        w0: (..., D) initial estimate ŵ_0, or None for 0.
    Returns:
        (...,) predictions, in x's dtype.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    batch = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-1], x_q.shape[:-1])
    x = jnp.broadcast_to(x, batch + x.shape[-2:])
    y = jnp.broadcast_to(y, batch + y.shape[-1:])
    w = jnp.zeros(batch + x.shape[-1:], x.dtype) if w0 is None else jnp.broadcast_to(jnp.asarray(w0, x.dtype),
                                                                                      batch + x.shape[-1:])
    m = jnp.asarray(mu, x.dtype)

    def step(w, xy):
        xt, yt = xy
        return w + m * xt * (yt - jnp.sum(w * xt, axis=-1))[..., None], None

    w, _ = jax.lax.scan(step, w, (jnp.moveaxis(x, -2, 0), jnp.moveaxis(y, -1, 0)))
    return jnp.sum(w * x_q, axis=-1)


@_jit()
def rls(x, y, x_q, *, beta, delta=100.0) -> jax.Array:
    """Exponentially weighted RLS over the context, then the query: ŷ = x_qᵀŵ_N.

    ŵ_N = (Σ_{i≤N} β^{N−i} x_i x_iᵀ + β^N I/δ)⁻¹ Σ_{i≤N} β^{N−i} x_i y_i: the recursive least squares
    filter with forget factor β, P_0 = δI and ŵ_0 = 0 after N updates, solved in one step. β = 1 is
    ridge with penalty 1/δ; the effective memory is about 1/(1 − β) samples, so β with 1/(1 − β) ≲ D
    leaves the weighted Gram nearly singular (as it does the recursive filter).

    Args:
        x: (..., N, D) context inputs, in stream order (the last is the most recent).
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        beta: forget factor β ∈ (0, 1] (scalar, possibly traced).
        delta: initial inverse-Gram scale δ > 0 (P_0 = δI).
    Returns:
        (...,) predictions, in x's dtype.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    N, D = x.shape[-2:]
    b = jnp.asarray(beta, x.dtype)
    om = b ** jnp.arange(N - 1, -1, -1, dtype=x.dtype)  # β^{N−i}, i = 1..N
    A = jnp.einsum("...ni,n,...nj->...ij", x, om, x) + (b**N / jnp.asarray(delta, x.dtype)) * jnp.eye(D, dtype=x.dtype)
    g = jnp.einsum("...ni,n,...n->...i", x, om, y)
    A, g = jnp.broadcast_arrays(A, g[..., None])
    w = jnp.linalg.solve(A, g)[..., 0]
    return jnp.sum(w * x_q, axis=-1)


def lms_risk(mu, *, gamma, sigma_w2, sigma_e2, n, Lam, sigma2=0.0) -> float:
    """Exact E[(ŷ_{n+1} − y_{n+1})²] of LMS (:func:`lms`, ŵ_0 = 0) on a drift prompt: no Monte Carlo.

    Data (drift eqs 2-3): w_0 ~ N(0, σ_w²I), w_t = γw_{t−1} + e_t, x_t ~ N(0, Λ), y_t = x_tᵀw_t + σε_t
    (t ≤ n), target y_{n+1} = x_{n+1}ᵀw_{n+1} (noiseless, as in ``kalman_bayes_risk``). With
    A = E[w_t w_tᵀ], B = E[w_t ŵ_tᵀ], C = E[ŵ_t ŵ_tᵀ] (A_0 = σ_w²I, B_0 = C_0 = 0) and
    F(M) = E[x xᵀ M x xᵀ] = Λ(M + Mᵀ)Λ + tr(ΛM)Λ, one step t−1 → t is

        A' = γ²A + σ_e²I,  B⁻ = γB,  Δ = A' − B⁻ − B⁻ᵀ + C   (= E[(w_t − ŵ_{t−1})(·)ᵀ]),
        B' = B⁻(I − μΛ) + μA'Λ,
        C' = C − μ(ΛC + CΛ) + μ(ΛB⁻ + B⁻ᵀΛ) + μ²(F(Δ) + σ²Λ),

    and the a-priori error at step t is tr(ΛΔ); the risk is tr(ΛΔ) at t = n+1 (after the n context
    updates). Exact for any μ (a diverging μ gives a large finite number, or inf past float range).

    Args:
        mu: LMS step size μ ≥ 0.
        gamma: AR(1) coefficient γ.
        sigma_w2: variance σ_w² of w_0.
        sigma_e2: innovation variance σ_e².
        n: number of context pairs (the query is step n+1).
        Lam: (d, d) input covariance Λ.
        sigma2: observation-noise variance σ² ≥ 0 of the context labels.
    Returns:
        float risk (no ½).
    """
    Lam = np.asarray(Lam, dtype=float)
    if Lam.ndim != 2 or Lam.shape[0] != Lam.shape[1]:
        raise ValueError(f"Lam must be a (d, d) matrix (got shape {Lam.shape})")
    if int(n) != n or n < 0:
        raise ValueError(f"n must be an integer >= 0 (got {n})")
    d = Lam.shape[0]
    eye = np.eye(d)

    def F(M):
        return Lam @ (M + M.T) @ Lam + np.trace(Lam @ M) * Lam

    A, B, C = sigma_w2 * eye, np.zeros((d, d)), np.zeros((d, d))
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(int(n)):
            A = gamma**2 * A + sigma_e2 * eye
            Bm = gamma * B
            Delta = A - Bm - Bm.T + C
            B = Bm @ (eye - mu * Lam) + mu * A @ Lam
            C = C - mu * (Lam @ C + C @ Lam) + mu * (Lam @ Bm + Bm.T @ Lam) + mu**2 * (F(Delta) + sigma2 * Lam)
            C = 0.5 * (C + C.T)
        A = gamma**2 * A + sigma_e2 * eye
        Bm = gamma * B
        risk = float(np.trace(Lam @ (A - Bm - Bm.T + C)))
    return risk if np.isfinite(risk) else float("inf")
