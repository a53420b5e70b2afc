"""Bayes posterior mean and Bayes risk of gating's correlated multitask prompts (Sec 5.1, Defs 1-2).

Data model (``iclab.tasks.multitask``): K task blocks, block k holding n_k samples
y_i = x_iᵀβ_k + σε_i; the query task β = β_{K+1} and target y = x_qᵀβ + σε. The tasks are
[β_1 … β_K β]ᵀ = L G with LLᵀ = C (the joint task correlation) and G ∈ R^{(K+1)×d} iid N(0, 1), so
with g = vec(G) (row-major) every label is linear in g:

    y_i = (L_{k(i),:} ⊗ x_iᵀ) g + σε_i,    x_qᵀβ = (L_{K+1,:} ⊗ x_qᵀ) g.

The posterior mean of x_qᵀβ given all blocks is therefore Gaussian conditioning of g on the
n × (K+1)d design M with rows L_{k(i),:} ⊗ x_iᵀ (through its SVD, exact at σ² = 0), and does not
depend on which factor L of C is given. Equivalently (the kernel form used as a test twin)
ŷ = Σ_j C_{K+1,k(j)} (x_qᵀx_j) α_j, α = (C_{k(i)k(j)} x_iᵀx_j + σ²δ_ij)⁻¹ y.

Def 1 prompts (every sample its own task) are the case block_sizes = (1, …, 1).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from iclab.baselines._conditioning import _jit, _posterior, _posterior_mean_g, _posterior_quadratic

__all__ = ["independent_tasks_bayes_risk", "multitask_bayes_risk", "multitask_posterior_mean"]


def _check(block_sizes, factor, n: int | None):
    sizes = [int(m) for m in block_sizes]
    K = len(sizes)
    if K < 1 or min(sizes) < 0:
        raise ValueError(f"block_sizes must be K >= 1 non-negative sizes (got {list(block_sizes)})")
    if tuple(factor.shape) != (K + 1, K + 1):
        raise ValueError(f"factor must be ({K + 1}, {K + 1}) for K = {K} blocks (got shape {tuple(factor.shape)})")
    if n is not None and sum(sizes) != n:
        raise ValueError(f"block_sizes must sum to the {n} context samples (got {sum(sizes)})")
    return sizes, K


def _design(x, sizes, factor):
    """(..., n, (K+1)d) rows L_{k(i),:} ⊗ x_iᵀ."""
    owner = np.repeat(np.arange(len(sizes)), sizes)
    rows = factor[owner]  # (n, K+1)
    M = rows[:, :, None] * x[..., :, None, :]
    return M.reshape(x.shape[:-1] + (factor.shape[0] * x.shape[-1],))


@_jit("block_sizes")
def multitask_posterior_mean(x, y, x_q, *, block_sizes: Sequence[int], factor, sigma2=0.0) -> jax.Array:
    """Bayes posterior mean ŷ = x_qᵀ E[β | all blocks] of the query task (gating Sec 5.1).

    E[g | y] = M⁺_σ y with M's rows L_{k(i),:} ⊗ x_iᵀ (module docstring), ŷ = (L_{K+1,:} ⊗ x_qᵀ) E[g | y].

    Args:
        x: (..., n, d) context inputs, blocks stacked in order.
        y: (..., n) context labels.
        x_q: (..., d) query inputs.
        block_sizes: (n_1, ..., n_K), summing to n (static).
        factor: (K+1, K+1) L with LLᵀ = C = [[task_R, task_r], [task_rᵀ, 1]] (e.g.
            ``iclab.tasks.multitask.two_task_factor`` or ``task_correlation_factor``); may be traced.
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        (...,) predictions.
    """
    x, y, x_q = map(jnp.asarray, (x, y, x_q))
    factor = jnp.asarray(factor, x.dtype)
    sizes, K = _check(block_sizes, factor, x.shape[-2])
    g = _posterior_mean_g(_posterior(_design(x, sizes, factor), jnp.asarray(sigma2, x.dtype)), y)
    G = g.reshape(g.shape[:-1] + (K + 1, x.shape[-1]))
    return jnp.einsum("j,...jd,...d->...", factor[K], G, x_q)


@_jit("block_sizes")
def multitask_bayes_risk(x, *, block_sizes: Sequence[int], factor, sigma2=0.0, Sigma=None) -> jax.Array:
    """Bayes risk given the context, x_q ~ N(0, Σ) integrated out: E[(y − ŷ)² | X] = tr(Q Cov[g | X]) + σ².

    Q = E[hhᵀ] = (l lᵀ) ⊗ Σ for the target's design h = l ⊗ x_q, l = L_{K+1,:}; the σ² is the noise of
    the target y = x_qᵀβ + σε, as the data model draws it.

    Args:
        x: (..., n, d) context inputs.
        block_sizes: (n_1, ..., n_K) (static).
        factor: (K+1, K+1) task factor L.
        sigma2: label-noise variance σ² ≥ 0 (context and target).
        Sigma: (d, d) input covariance Σ, or None for I.
    Returns:
        (...,) conditional Bayes risks.
    """
    x = jnp.asarray(x)
    factor = jnp.asarray(factor, x.dtype)
    sizes, K = _check(block_sizes, factor, x.shape[-2])
    d = x.shape[-1]
    S = jnp.eye(d, dtype=x.dtype) if Sigma is None else jnp.asarray(Sigma, x.dtype)
    Q = jnp.kron(jnp.outer(factor[K], factor[K]), S)
    s2 = jnp.asarray(sigma2, x.dtype)
    return _posterior_quadratic(_posterior(_design(x, sizes, factor), s2), Q) + s2


def independent_tasks_bayes_risk(*, block_sizes: Sequence[int], task_r, d: int) -> float:
    """Closed-form Bayes risk for independent block tasks, noiseless, Σ = I: d − Σ_k r_k² min(n_k, d).

    With task_R = I, E[β | β_1..β_K] = Σ_k r_k β_k and the remainder has variance (1 − Σ_k r_k²) per
    coordinate; σ = 0 reveals β_k on the span of its block's n_k inputs, leaving E‖(I − Π_k)β_k‖² =
    d − min(n_k, d). The conditional risk is this same number for almost every context (no average
    over X is involved). App B.1's experiments (K = 2, β ~ N(r₁β₁ + r₂β₂, (1 − r₁² − r₂²)I),
    σ = 0, Σ = I) have it as d − (r₁² + r₂²) min(n̄, d).

    Args:
        block_sizes: (n_1, ..., n_K).
        task_r: (K,) correlations r_k = E[β_kᵀβ]/d, Σ r_k² ≤ 1.
        d: input dimension.
    Returns:
        float risk (no ½; divide by d for gating's normalised risk).
    """
    r = np.asarray(task_r, dtype=float)
    n = np.asarray(block_sizes, dtype=float)
    if r.shape != n.shape:
        raise ValueError(f"task_r must have one entry per block (got {r.shape} for {len(n)} blocks)")
    if np.sum(r ** 2) > 1.0 + 1e-10:
        raise ValueError(f"task_r must satisfy Σ r_k² <= 1 (got {np.sum(r ** 2):.6g})")
    return float(d - np.sum(r ** 2 * np.minimum(n, d)))
