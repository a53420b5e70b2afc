"""Bayes posterior mean and Bayes risk under a Gaussian task prior (linattn; mhsa per task).

Data model: w ~ N(0, Σ_w), y_n = wᵀx_n + σε_n, target y_q = wᵀx_q (noiseless), x_q ~ N(0, Λ).
With Σ_w = CCᵀ and w = Cg, g ~ N(0, I), this is the linear-Gaussian model y = (XC)g + σε:

    E[w | X, y] = C (XC)⁺_σ y = Σ_w Xᵀ(XΣ_wXᵀ + σ²I)⁻¹ y,
    Cov[w | X]  = Σ_w − Σ_w Xᵀ(XΣ_wXᵀ + σ²I)⁻¹ X Σ_w,

i.e. ridge with penalty σ²/σ_w² when Σ_w = σ_w² I. σ² = 0 (linattn's noiseless labels) is the
limit: the minimum-Σ_w⁻¹-norm interpolant C(XC)⁺y, which for Σ_w = I is least squares (exact
recovery, Bayes risk 0, once N ≥ D). The Bayes risk given the context is tr(Λ Cov[w | X]); its
expectation over X has no closed form in general (exact special cases in
:func:`gaussian_bayes_risk`), so it is estimated by averaging this exact conditional risk over
contexts (a Rao–Blackwellised Monte Carlo).

mhsa (``iclab.tasks.multitask_regression``): y_l = Gᵀx_l + ε_l, G = d^{-1/2} Φ blockdiag(g_i) Ψᵀ,
g_i ~ N(0, λ_i I_{d_i}). In the rotated coordinates x̃ = Φᵀx, ỹ = Ψᵀy, output i ≤ I is a scalar
regression on the block J_i alone, ỹ_i = β_iᵀ x̃_{J_i} + ε̃, β_i = g_i/√d ~ N(0, (λ_i/d) I), so the
posterior mean is blockwise ridge with penalty σ²d/λ_i (mhsa paper, App E.27), rotated back by Ψ; outputs
beyond I (and tasks with λ_i = 0) are predicted 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iclab.baselines._conditioning import _jit, _posterior, _posterior_mean_g, _posterior_quadratic

__all__ = ["gaussian_bayes_risk", "gaussian_posterior_mean", "mhsa_bayes_risk", "mhsa_posterior_mean"]


def _prior_factor(prior_cov, D: int, dtype) -> jax.Array:
    """C with CCᵀ = Σ_w: √σ_w² I for a scalar, the symmetric PSD square root for a matrix."""
    p = jnp.asarray(prior_cov, dtype)
    if p.ndim == 0:
        return jnp.sqrt(p) * jnp.eye(D, dtype=dtype)
    if p.shape != (D, D):
        raise ValueError(f"prior_cov must be a scalar or a ({D}, {D}) matrix (got shape {p.shape})")
    evals, evecs = jnp.linalg.eigh(0.5 * (p + p.T))
    return (evecs * jnp.sqrt(jnp.clip(evals, 0.0, None))) @ evecs.T


@_jit()
def gaussian_posterior_mean(x, y, x_q, *, prior_cov=1.0, sigma2=0.0) -> jax.Array:
    """Bayes posterior-mean prediction ŷ = x_qᵀ E[w | X, y] under w ~ N(0, Σ_w), y = Xw + σε.

    E[w | X, y] = Σ_w Xᵀ(XΣ_wXᵀ + σ²I)⁻¹y; ridge(λ = σ²/σ_w²) for Σ_w = σ_w² I; for σ² = 0 the
    minimum-Σ_w⁻¹-norm interpolant (least squares when Σ_w ∝ I), computed through the SVD of XΣ_w^{1/2}.

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        prior_cov: σ_w² (scalar: Σ_w = σ_w² I) or a (D, D) PSD prior covariance Σ_w.
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    C = _prior_factor(prior_cov, x.shape[-1], x.dtype)
    g = _posterior_mean_g(_posterior(x @ C, jnp.asarray(sigma2, x.dtype)), y)
    return jnp.einsum("...d,de,...e->...", x_q, C, g)


@_jit()
def gaussian_bayes_risk(x, *, Lam, prior_cov=1.0, sigma2=0.0) -> jax.Array:
    """Bayes risk given the context, the query x_q ~ N(0, Λ) integrated out: tr(Λ Cov[w | X]).

    E[(y_q − ŷ)² | X] for the noiseless target y_q = wᵀx_q (add σ² for a noisy one). Exact special
    cases of its mean over X (x_n ~ N(0, Λ), Λ ≻ 0): σ² = 0 and N ≥ D gives 0 for every X; σ² = 0,
    Σ_w = σ_w² I, Λ = cI and N < D gives c σ_w² (D − N).

    Args:
        x: (..., N, D) context inputs.
        Lam: (D, D) covariance Λ of the query input.
        prior_cov: σ_w² or a (D, D) prior covariance Σ_w.
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        (...,) conditional Bayes risks.
    """
    x = jnp.asarray(x)
    C = _prior_factor(prior_cov, x.shape[-1], x.dtype)
    Q = C.T @ jnp.asarray(Lam, x.dtype) @ C
    return _posterior_quadratic(_posterior(x @ C, jnp.asarray(sigma2, x.dtype)), Q)


def _blocks(d_i):
    start = 0
    for i, di in enumerate(d_i):
        yield i, slice(start, start + di)
        start += di


# The block sizes are static; λ_i and σ are traced, so a sweep over them compiles once.
@_jit("d_i")
def _mhsa_posterior_mean(X, Y, q, Phi, Psi, lam, sigma, *, d_i):
    dt = X.dtype
    Phi, Psi = jnp.asarray(Phi, dt), jnp.asarray(Psi, dt)
    Xt = jnp.einsum("ab,pal->plb", Phi, X)  # rows x̃_l = Φᵀx_l
    Yt = jnp.einsum("yz,pyl->plz", Psi, Y)  # rows ỹ_l = Ψᵀy_l
    qt = q @ Phi
    scale = jnp.sqrt(jnp.asarray(lam, dt) / sum(d_i))  # prior standard deviation of β_i's entries
    out = jnp.zeros(q.shape[:-1] + (Psi.shape[0],), dt)
    for i, J in _blocks(d_i):
        g = _posterior_mean_g(_posterior(scale[i] * Xt[..., J], jnp.asarray(sigma, dt) ** 2), Yt[..., i])
        out = out.at[..., i].set(scale[i] * jnp.sum(qt[..., J] * g, axis=-1))
    return out @ Psi.T


@_jit("d_i")
def _mhsa_bayes_risk(X, Phi, lam, sigma, *, d_i):
    dt = X.dtype
    Xt = jnp.einsum("ab,pal->plb", jnp.asarray(Phi, dt), X)
    scale = jnp.sqrt(jnp.asarray(lam, dt) / sum(d_i))
    risk = jnp.zeros(X.shape[:-2], dt)
    for i, J in _blocks(d_i):
        Q = scale[i] ** 2 * jnp.eye(J.stop - J.start, dtype=dt)
        risk = risk + _posterior_quadratic(_posterior(scale[i] * Xt[..., J], jnp.asarray(sigma, dt) ** 2), Q)
    return risk


def mhsa_posterior_mean(X, Y, q, *, ts) -> jax.Array:
    """Bayes posterior mean of mhsa's target y_q = Gᵀq (eq 2.4): blockwise ridge, penalty σ²d/λ_i.

    ŷ_q = Ψ ỹ̂, ỹ̂_i = (Φᵀq)_{J_i}ᵀ β̂_i for i ≤ I (0 beyond), β̂_i the posterior mean of
    β_i ~ N(0, (λ_i/d) I_{d_i}) given ỹ_{l,i} = β_iᵀ(Φᵀx_l)_{J_i} + ε̃_{l,i}, l = 1..L.

    Args:
        X: (P, d, L) context covariates (tokens as columns).
        Y: (P, d_y, L) context responses.
        q: (P, d) queries.
        ts: the task family (``iclab.tasks.multitask_regression.TaskStructure``: d_i, λ_i, σ, Φ, Ψ).
    Returns:
        (P, d_y) predictions.
    """
    X, Y, q = map(jnp.asarray, (X, Y, q))
    return _mhsa_posterior_mean(X, Y, q, ts.Phi, ts.Psi, jnp.asarray(ts.lam), ts.sigma, d_i=tuple(ts.d_i))


def mhsa_bayes_risk(X, *, ts) -> jax.Array:
    """Bayes risk of mhsa's data model given the covariates, q ~ N(0, I) integrated out.

    E[‖y_q − ŷ_q‖² | X] = Σ_i tr Cov[β_i | X] (Φ is orthogonal, so Φᵀq ~ N(0, I)); no ½.

    Args:
        X: (P, d, L) context covariates.
        ts: the task family (``TaskStructure``).
    Returns:
        (P,) conditional Bayes risks.
    """
    return _mhsa_bayes_risk(jnp.asarray(X), ts.Phi, jnp.asarray(ts.lam), ts.sigma, d_i=tuple(ts.d_i))
