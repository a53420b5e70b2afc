"""Correlated multitask in-context regression (gating paper, Defs 1-2, Sec 5.1, App B.1).

Def 1-2: the n + 1 samples of a prompt have their own task vectors β_1..β_n, β = β_{n+1}, jointly
Gaussian with E[β_iβ_jᵀ] = C_ij I_d (the isotropic cross-covariance eq 37 needs, spec §7), where
C = [[R, r], [rᵀ, 1]] is a correlation matrix (PSD, unit diagonal; validated by
``iclab.theory.wpgd.joint_task_correlation``). Inputs x_i ~ N(0, Σ) iid and labels
y_i = x_iᵀβ_i + σ ε_i, i = 1..n+1; the target is y_{n+1}.

Sec 5.1: K tasks β_1..β_K in blocks, block k holding n_k samples of task β_k; the query task β
correlates with them through the task-level C = [[R_task, r_task], [r_taskᵀ, 1]]. App B.1 (the
experiments): K = 2 independent tasks, β ~ N(r₁β₁ + r₂β₂, (1 − r₁² − r₂²)I), Σ = I, σ = 0.

Tasks are drawn as [β_1 … β_K β]ᵀ = L G with LLᵀ = C and G iid N(0, 1) (the symmetric PSD square
root, so singular C such as r₁² + r₂² = 1 works). Batches lie along a leading axis B.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from iclab.theory import wpgd as theory


class MultitaskPrompts(NamedTuple):
    """A batch of B prompts with n context samples in task blocks.

    Attributes:
        x: (B, n, d) context inputs, blocks stacked in order.
        y: (B, n) context labels.
        x_query: (B, d) query input x = x_{n+1}.
        y_query: (B,) target y = y_{n+1}.
        tasks: (B, K, d) the task vector of each block (K = n for Def 1 prompts, one task per sample).
        beta: (B, d) the query task β.
    """

    x: jax.Array
    y: jax.Array
    x_query: jax.Array
    y_query: jax.Array
    tasks: jax.Array
    beta: jax.Array


def _sqrt_psd(A) -> np.ndarray:
    w, V = np.linalg.eigh(0.5 * (np.asarray(A, float) + np.asarray(A, float).T))
    if w[0] < -1e-10 * max(1.0, w[-1]):
        raise ValueError(f"Sigma must be positive semidefinite (smallest eigenvalue {w[0]:.3g})")
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T


def sample_blocks(key: jax.Array, B: int, block_sizes: Sequence[int], factor, Sigma_half=None, sigma=0.0,
                  d: int | None = None, dtype=jnp.float64) -> MultitaskPrompts:
    """Draws B block prompts given a task factor L (LLᵀ = C): the jittable core of the samplers.

    Args:
        key: PRNG key.
        B: batch size.
        block_sizes: (n_1, ..., n_K) (static).
        factor: (K+1, K+1) L with LLᵀ = C (may be traced).
        Sigma_half: (d, d) symmetric Σ^{1/2}, or None for Σ = I (then ``d`` is required).
        sigma: label-noise standard deviation σ (may be traced).
        d: input dimension when Sigma_half is None.
    Returns:
        MultitaskPrompts.
    """
    sizes = [int(m) for m in block_sizes]
    K, n = len(sizes), sum(sizes)
    if Sigma_half is not None:
        d = Sigma_half.shape[0]
    if d is None:
        raise ValueError("d is required when Sigma_half is None")
    # One draw for tasks, inputs and noise: each random-number call site costs seconds of XLA compile on CPU.
    w = jax.random.normal(key, (B, (K + 1) * d + (n + 1) * (d + 1)), dtype)
    G = w[:, : (K + 1) * d].reshape(B, K + 1, d)
    xs = w[:, (K + 1) * d: (K + 1) * d + (n + 1) * d].reshape(B, n + 1, d)
    eps = w[:, (K + 1) * d + (n + 1) * d:]
    betas = jnp.einsum("ij,bjd->bid", jnp.asarray(factor, dtype), G)
    if Sigma_half is not None:
        xs = xs @ jnp.asarray(Sigma_half, dtype)
    owner = np.repeat(np.arange(K), sizes)  # task of each context sample
    per_sample = jnp.concatenate([betas[:, owner], betas[:, K:]], axis=1)  # (B, n+1, d)
    ys = jnp.einsum("bid,bid->bi", xs, per_sample) + sigma * eps
    return MultitaskPrompts(xs[:, :n], ys[:, :n], xs[:, n], ys[:, n], betas[:, :K], betas[:, K])


def sample_multitask(key: jax.Array, B: int, block_sizes: Sequence[int], task_R, task_r, d: int, Sigma=None,
                     sigma2: float = 0.0, dtype=jnp.float64) -> MultitaskPrompts:
    """K-task prompts of Sec 5.1: block k has n_k samples of β_k; C = [[task_R, task_r], [task_rᵀ, 1]].

    Args:
        key: PRNG key; B: batch size; block_sizes: (n_1..n_K).
        task_R: (K, K) task correlations E[β_iᵀβ_j]/d (unit diagonal); task_r: (K,) E[β_kᵀβ]/d.
        d: input dimension; Sigma: (d, d) input covariance (None: I); sigma2: label-noise variance σ².
    Returns:
        MultitaskPrompts with tasks (B, K, d).
    """
    if len(block_sizes) != np.asarray(task_r).shape[0]:
        raise ValueError(f"block_sizes must have K = {np.asarray(task_r).shape[0]} entries (got {len(block_sizes)})")
    if sigma2 < 0:
        raise ValueError(f"sigma2 must be >= 0 (got {sigma2})")
    L = theory.task_correlation_factor(task_R, task_r)
    Sh = None if Sigma is None else _sqrt_psd(Sigma)
    return sample_blocks(key, B, block_sizes, L, Sh, float(np.sqrt(sigma2)), d=d, dtype=dtype)


def sample_correlated(key: jax.Array, B: int, R, r, d: int, Sigma=None, sigma2: float = 0.0,
                      dtype=jnp.float64) -> MultitaskPrompts:
    """Def 1-2 prompts: every sample its own task, E[β_iβ_jᵀ] = R_ij I, E[β_iβᵀ] = r_i I (eq 12).

    Args:
        key: PRNG key; B: batch size; R: (n, n); r: (n,); d: input dimension.
        Sigma: (d, d) input covariance (None: I); sigma2: label-noise variance σ².
    Returns:
        MultitaskPrompts with tasks (B, n, d).
    """
    if sigma2 < 0:
        raise ValueError(f"sigma2 must be >= 0 (got {sigma2})")
    L = theory.task_correlation_factor(R, r)
    Sh = None if Sigma is None else _sqrt_psd(Sigma)
    return sample_blocks(key, B, [1] * (L.shape[0] - 1), L, Sh, float(np.sqrt(sigma2)), d=d, dtype=dtype)


def two_task_factor(r1: float, r2: float) -> np.ndarray:
    """Task factor of App B.1: β₁, β₂ ~ N(0, I) independent, β = r₁β₁ + r₂β₂ + √(1 − r₁² − r₂²) ξ.

    Returns:
        (3, 3) lower-triangular L with LLᵀ = [[I₂, r], [rᵀ, 1]] (validated).
    """
    theory.joint_task_correlation(np.eye(2), np.array([r1, r2], dtype=float))
    s = np.sqrt(max(0.0, 1.0 - r1 * r1 - r2 * r2))
    return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [r1, r2, s]])


def padding_mask(max_sizes: Sequence[int], block_sizes: Sequence[int]) -> np.ndarray:
    """0/1 mask (n_max,) of a prompt laid out with ``max_sizes`` that keeps the LAST n_k slots of block k.

    With the model's token mask (masked tokens contribute nothing and gate 1) a padded prompt gives the
    prediction of the prompt with block sizes ``block_sizes``; prompts of every n̄ then share one shape.
    """
    if len(max_sizes) != len(block_sizes) or any(b > m or b < 0 for b, m in zip(block_sizes, max_sizes)):
        raise ValueError(f"block_sizes must satisfy 0 <= n_k <= max_k (got {list(block_sizes)} vs {list(max_sizes)})")
    return np.concatenate([np.r_[np.zeros(m - b), np.ones(b)] for m, b in zip(max_sizes, block_sizes)])


def take_blocks(prompts: MultitaskPrompts, max_sizes: Sequence[int], block_sizes: Sequence[int]) -> MultitaskPrompts:
    """The prompts restricted to the LAST n_k samples of each block (the samples ``padding_mask`` keeps).

    Prompts drawn once at ``max_sizes`` thereby serve every smaller n̄ (common random numbers).
    """
    keep = np.nonzero(padding_mask(max_sizes, block_sizes))[0]
    return prompts._replace(x=prompts.x[..., keep, :], y=prompts.y[..., keep])
