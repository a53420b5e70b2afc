"""Correlated multitask in-context regression (gating paper, Defs 1-2, Sec 5.1, App B.1).

Def 1-2: the n + 1 samples of a prompt have their own task vectors β_1..β_n, β = β_{n+1}, jointly
Gaussian with E[β_iβ_jᵀ] = C_ij I_d (the isotropic cross-covariance eq 37 needs; Def 1 states only the marginals), where
C = [[R, r], [rᵀ, 1]] is a correlation matrix (PSD, unit diagonal; validated by
:func:`joint_task_correlation`). Inputs x_i ~ N(0, Σ) iid and labels
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

from iclab.ops import multitask_block_tokens as block_tokens
from iclab.ops import multitask_task_normals as task_normals

from iclab.tasks._random import standard_normal

__all__ = ["MultitaskPrompts", "block_draw", "block_tasks", "block_tokens", "joint_task_correlation", "padding_mask",
           "sample_blocks", "sample_correlated", "sample_multitask", "take_blocks", "task_correlation_factor",
           "task_normals", "two_task_factor"]

# Correlation matrices coming from user input are checked to this absolute tolerance.
_CORR_TOL = 1e-10


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


def joint_task_correlation(R, r) -> np.ndarray:
    """Joint correlation C = [[R, r], [rᵀ, 1]] of (β_1, …, β_n, β) (Def 1, eq 12), validated.

    Raises ValueError (one line: field, allowed range) unless R is square and symmetric with unit
    diagonal, r matches it, all entries lie in [−1, 1] and C is positive semidefinite.

    Args:
        R: (n, n) in-context task correlations E[β_iᵀβ_j]/d.
        r: (n,) correlations with the query task E[β_iᵀβ]/d.
    Returns:
        (n+1, n+1) matrix C.
    """
    R, r = np.asarray(R, dtype=float), np.asarray(r, dtype=float)
    if R.ndim != 2 or R.shape[0] != R.shape[1] or R.shape[0] < 1:
        raise ValueError(f"R must be a square (n, n) matrix with n >= 1 (got shape {R.shape})")
    n = R.shape[0]
    if r.shape != (n,):
        raise ValueError(f"r must have shape ({n},) to match R (got {r.shape})")
    if not np.all(np.isfinite(R)) or not np.all(np.isfinite(r)):
        raise ValueError("R and r must be finite")
    if np.max(np.abs(R - R.T)) > _CORR_TOL:
        raise ValueError(f"R must be symmetric (max |R - Rᵀ| = {np.max(np.abs(R - R.T)):.3g})")
    if np.max(np.abs(np.diag(R) - 1.0)) > _CORR_TOL:
        i = int(np.argmax(np.abs(np.diag(R) - 1.0)))
        raise ValueError(f"R must have unit diagonal (got R[{i},{i}] = {R[i, i]:.6g})")
    if np.max(np.abs(R)) > 1.0 + _CORR_TOL:
        raise ValueError(f"R entries must lie in [-1, 1] (got max |R_ij| = {np.max(np.abs(R)):.6g})")
    if np.max(np.abs(r)) > 1.0 + _CORR_TOL:
        i = int(np.argmax(np.abs(r)))
        raise ValueError(f"r entries must lie in [-1, 1] (got r[{i}] = {r[i]:.6g})")
    C = np.block([[R, r[:, None]], [r[None, :], np.ones((1, 1))]])
    C = 0.5 * (C + C.T)
    min_eig = float(np.linalg.eigvalsh(C)[0])
    if min_eig < -_CORR_TOL * (n + 1):
        raise ValueError("joint correlation [[R, r], [rᵀ, 1]] must be positive semidefinite "
                         f"(smallest eigenvalue {min_eig:.3g} < 0)")
    return C


def task_correlation_factor(R, r) -> np.ndarray:
    """Factor L with LLᵀ = C = [[R, r], [rᵀ, 1]] for sampling tasks [β_1 … β_n β]ᵀ = L G (Def 1).

    The symmetric PSD square root, so singular C (e.g. tasks shared within a block) works. G ∈ R^{(n+1)×d}
    has iid N(0, 1) entries; then E[β_iβ_jᵀ] = C_ij I_d.

    Args:
        R: (n, n); r: (n,) as in :func:`joint_task_correlation` (validated there).
    Returns:
        (n+1, n+1) factor L.
    """
    C = joint_task_correlation(R, r)
    w, V = np.linalg.eigh(C)
    # Clipping tiny negative eigenvalues keeps singular correlation matrices usable.
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T


def block_draw(key: jax.Array, B: int, block_sizes: Sequence[int], d: int, dtype=jnp.float64) -> jax.Array:
    """:func:`sample_blocks`' one standard-normal draw: the task normals G, the inputs and the noise in that order
    (one draw: each random-number call site costs seconds of XLA compile on CPU).

    Args:
        key: a raw PRNG key; B: batch size; block_sizes: (n_1, ..., n_K) (static); d: input dimension.
        dtype: float dtype of the draw.
    Returns:
        (B, (K+1)·d + (n+1)·(d+1)) standard normals, n = Σ n_k.
    """
    K, n = len(block_sizes), sum(int(m) for m in block_sizes)
    return standard_normal(key, (B, (K + 1) * d + (n + 1) * (d + 1)), dtype)


def block_tasks(w: jax.Array, factor, K: int, d: int) -> jax.Array:
    """The tasks [β_1 … β_K β] = L G of :func:`sample_blocks`' draw.

    Args:
        w: (B, W) the draw (:func:`block_draw`), or its first (K+1)·d columns.
        factor: (K+1, K+1) L with LLᵀ = C (may be traced).
        K: task blocks; d: input dimension.
    Returns:
        (B, K+1, d) tasks, w's dtype.
    """
    G = w[:, : (K + 1) * d].reshape(w.shape[0], K + 1, d)
    return jnp.einsum("ij,bjd->bid", jnp.asarray(factor, w.dtype), G)


def sample_blocks(key: jax.Array, B: int, block_sizes: Sequence[int], factor, Sigma_half=None, sigma=0.0,
                  d: int | None = None, dtype=jnp.float64) -> MultitaskPrompts:
    """Draws B block prompts given a task factor L (LLᵀ = C): the jittable core of the samplers.

    [β_1 … β_K β]ᵀ = L G with G iid N(0, 1); x_i = Σ^{1/2} g_i; y_i = x_iᵀβ_{k(i)} + σ ε_i (Sec 5.1, Def 2).
    Every random number comes from ONE normal draw of ``key``, so prompts with the same key and
    different factors share G, the inputs and the noise (common random numbers across settings).

    Args:
        key: a raw PRNG key; the draw is :func:`iclab.tasks.standard_normal` (fast to compile, safe under vmap).
        B: batch size.
        block_sizes: (n_1, ..., n_K) (static).
        factor: (K+1, K+1) L with LLᵀ = C (may be traced).
        Sigma_half: (d, d) symmetric Σ^{1/2}, or None for Σ = I (then ``d`` is required).
        sigma: label-noise standard deviation σ (may be traced).
        d: input dimension when Sigma_half is None.
        dtype: float dtype of the draw.
    Returns:
        MultitaskPrompts.
    """
    sizes = [int(m) for m in block_sizes]
    K, n = len(sizes), sum(sizes)
    if Sigma_half is not None:
        d = Sigma_half.shape[0]
    if d is None:
        raise ValueError("d is required when Sigma_half is None")
    w = block_draw(key, B, sizes, d, dtype)
    xs = w[:, (K + 1) * d: (K + 1) * d + (n + 1) * d].reshape(B, n + 1, d)
    eps = w[:, (K + 1) * d + (n + 1) * d:]
    betas = block_tasks(w, factor, K, d)
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
        dtype: float dtype of the prompts.
    Returns:
        MultitaskPrompts with tasks (B, K, d).
    """
    if len(block_sizes) != np.asarray(task_r).shape[0]:
        raise ValueError(f"block_sizes must have K = {np.asarray(task_r).shape[0]} entries (got {len(block_sizes)})")
    if sigma2 < 0:
        raise ValueError(f"sigma2 must be >= 0 (got {sigma2})")
    L = task_correlation_factor(task_R, task_r)
    Sh = None if Sigma is None else _sqrt_psd(Sigma)
    return sample_blocks(key, B, block_sizes, L, Sh, float(np.sqrt(sigma2)), d=d, dtype=dtype)


def sample_correlated(key: jax.Array, B: int, R, r, d: int, Sigma=None, sigma2: float = 0.0,
                      dtype=jnp.float64) -> MultitaskPrompts:
    """Def 1-2 prompts: every sample its own task, E[β_iβ_jᵀ] = R_ij I, E[β_iβᵀ] = r_i I (eq 12).

    Args:
        key: PRNG key; B: batch size; R: (n, n); r: (n,); d: input dimension.
        Sigma: (d, d) input covariance (None: I); sigma2: label-noise variance σ².
        dtype: float dtype of the prompts.
    Returns:
        MultitaskPrompts with tasks (B, n, d).
    """
    if sigma2 < 0:
        raise ValueError(f"sigma2 must be >= 0 (got {sigma2})")
    L = task_correlation_factor(R, r)
    Sh = None if Sigma is None else _sqrt_psd(Sigma)
    return sample_blocks(key, B, [1] * (L.shape[0] - 1), L, Sh, float(np.sqrt(sigma2)), d=d, dtype=dtype)


def two_task_factor(*, r1: float, r2: float) -> np.ndarray:
    """Task factor of App B.1: β₁, β₂ ~ N(0, I) independent, β = r₁β₁ + r₂β₂ + √(1 − r₁² − r₂²) ξ.

    Args:
        r1, r2: correlations E[β_kᵀβ]/d of the query task with tasks 1 and 2 (r₁² + r₂² ≤ 1).
    Returns:
        (3, 3) lower-triangular L with LLᵀ = [[I₂, r], [rᵀ, 1]] (validated).
    """
    joint_task_correlation(np.eye(2), np.array([r1, r2], dtype=float))
    s = np.sqrt(max(0.0, 1.0 - r1 * r1 - r2 * r2))
    return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [r1, r2, s]])


def padding_mask(max_sizes: Sequence[int], block_sizes: Sequence[int]) -> np.ndarray:
    """0/1 mask (n_max,) of a prompt laid out with ``max_sizes`` that keeps the LAST n_k slots of block k.

    With the model's token mask (masked tokens contribute nothing and gate 1) a padded prompt gives the
    prediction of the prompt with block sizes ``block_sizes``; prompts of every n̄ then share one shape.

    Args:
        max_sizes: (n_max,1, ..., n_max,K) the block sizes of the layout.
        block_sizes: (n_1, ..., n_K) the samples kept per block, 0 ≤ n_k ≤ n_max,k.
    Returns:
        (Σ_k n_max,k,) float array of 0/1.
    """
    if len(max_sizes) != len(block_sizes) or any(b > m or b < 0 for b, m in zip(block_sizes, max_sizes)):
        raise ValueError(f"block_sizes must satisfy 0 <= n_k <= max_k (got {list(block_sizes)} vs {list(max_sizes)})")
    return np.concatenate([np.r_[np.zeros(m - b), np.ones(b)] for m, b in zip(max_sizes, block_sizes)])


def take_blocks(prompts: MultitaskPrompts, max_sizes: Sequence[int], block_sizes: Sequence[int]) -> MultitaskPrompts:
    """The prompts restricted to the LAST n_k samples of each block (the samples ``padding_mask`` keeps).

    Prompts drawn once at ``max_sizes`` thereby serve every smaller n̄ (common random numbers).

    Args:
        prompts: prompts laid out with ``max_sizes``.
        max_sizes, block_sizes: as in :func:`padding_mask`.
    Returns:
        MultitaskPrompts with x (..., n, d) and y (..., n), n = Σ_k n_k; the query and tasks unchanged.
    """
    keep = np.nonzero(padding_mask(max_sizes, block_sizes))[0]
    return prompts._replace(x=prompts.x[..., keep, :], y=prompts.y[..., keep])
