"""In-context linear regression (linattn paper, Sec 2.1, eqs 1-2).

A prompt holds N context pairs (x_n, y_n) and a query x_q, all x ~ N(0, Λ) iid, one task vector
w ~ N(0, I_D) per prompt, and noiseless labels y = wᵀx. Prompts are batched along a leading axis P.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Prompts", "QueryMoments", "Spectrum", "context_moment", "covariance", "expected_lambda_hat_sq",
           "fixed_task_vector", "population_loss", "prompt_matrix", "sample_mixture_prompts", "sample_prompts",
           "sample_query_moments", "spectrum_eigenvalues", "whiten_tasks"]

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

    Args:
        spectrum: "linear", "inverse" or "white".
        D: dimension, ≥ 1.
    Returns:
        (D,) numpy eigenvalues, decreasing, summing to 1.
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
    Returns:
        Prompts with x (P, N, D), y (P, N), x_q (P, D), y_q (P,), w (P, D), in Λ's dtype.
    """
    D = Lam.shape[0]
    kx, kw = jax.random.split(key)
    chol = jnp.linalg.cholesky(Lam)
    xs = jax.random.normal(kx, (P, N + 1, D), dtype=Lam.dtype) @ chol.T
    w = jax.random.normal(kw, (P, D), dtype=Lam.dtype)
    ys = jnp.einsum("pnd,pd->pn", xs, w)
    return Prompts(x=xs[:, :N], y=ys[:, :N], x_q=xs[:, N], y_q=ys[:, N], w=w)


def context_moment(prompts: Prompts) -> jax.Array:
    """β = (1/N) Σ_n y_n x_n (eq 4).

    Args:
        prompts: P prompts of N context pairs.
    Returns:
        (P, D) β of each prompt.
    """
    return jnp.einsum("pn,pnd->pd", prompts.y, prompts.x) / prompts.x.shape[1]


def prompt_matrix(prompts: Prompts) -> jax.Array:
    """The token matrix X of eq 1, tokens as columns: [[x_1..x_N x_q], [y_1..y_N 0]].

    Args:
        prompts: P prompts of N context pairs.
    Returns:
        (P, D+1, N+1) array.
    """
    xs = jnp.concatenate([prompts.x, prompts.x_q[:, None, :]], axis=1)
    ys = jnp.concatenate([prompts.y, jnp.zeros_like(prompts.y_q)[:, None]], axis=1)
    return jnp.concatenate([jnp.swapaxes(xs, 1, 2), ys[:, None, :]], axis=1)


# ---------------------------------------------------------------------------------------------
# In-weight learning (App G, Fig 14): a portion of the prompts share one fixed task vector.


def fixed_task_vector(key: jax.Array, D: int) -> jax.Array:
    """A N(0, I_D) draw rescaled to ‖w‖ = √D (‖w‖² = E‖w‖² = D of the random tasks): the reference
    code's fixed task vector of Fig 14 (the paper leaves it unspecified).

    Args:
        key: PRNG key; D: dimension.
    Returns:
        (D,) float64 task vector.
    """
    w = jax.random.normal(key, (D,), dtype=jnp.float64)
    return w * jnp.sqrt(D) / jnp.linalg.norm(w)


def sample_mixture_prompts(key: jax.Array, Lam: jax.Array, N: int, P: int, fixed_fraction: float,
                           w_fixed: jax.Array, context: Literal["task", "noise"] = "task",
                           noise_std: float = 1.0, whiten: bool = False) -> Prompts:
    """P prompts of which the last round(fixed_fraction·P) share the task vector ``w_fixed``.

    The first prompts have w ~ N(0, I) as in eq 2 (the reference code's ``--icl c`` puts its
    random-task prompts first too). The query label of a fixed-task prompt is always
    y_q = w_fixedᵀx_q; its context labels are w_fixedᵀx_n (``context="task"``) or iid
    N(0, noise_std²) noise (``"noise"``: the reference's in-weight test set, and its training set
    when every prompt is fixed), so that only the weights can predict y_q.

    Args:
        key: PRNG key.
        Lam: (D, D) covariance.
        N: context pairs per prompt.
        P: number of prompts.
        fixed_fraction: portion of prompts with the fixed task, in [0, 1].
        w_fixed: (D,) the fixed task vector.
        context: context labels of the fixed-task prompts.
        noise_std: standard deviation of the noise labels.
        whiten: give the random task vectors exact zero mean and identity empirical covariance
            (:func:`whiten_tasks`; the reference code does so when every task is random), which
            removes the training set's mean task, a spurious in-weight target of the full model.
    Returns:
        Prompts (P of them) in Λ's dtype; ``w`` holds each prompt's task vector.
    """
    if not 0.0 <= fixed_fraction <= 1.0:
        raise ValueError(f"fixed_fraction must be in [0, 1] (got {fixed_fraction})")
    if context not in ("task", "noise"):
        raise ValueError(f"context must be 'task' or 'noise' (got {context!r})")
    k_base, k_noise = jax.random.split(key)
    base = sample_prompts(k_base, Lam, N, P)
    n_fixed = int(round(fixed_fraction * P))
    fixed = (jnp.arange(P) >= P - n_fixed)[:, None]
    w_random = base.w
    if whiten and P - n_fixed > 0:
        w_random = w_random.at[: P - n_fixed].set(whiten_tasks(w_random[: P - n_fixed]))
    w = jnp.where(fixed, jnp.asarray(w_fixed, dtype=Lam.dtype)[None, :], w_random)
    y_task = jnp.einsum("pnd,pd->pn", base.x, w)
    if context == "noise":
        noise = noise_std * jax.random.normal(k_noise, y_task.shape, dtype=Lam.dtype)
        y_task = jnp.where(fixed, noise, y_task)
    return Prompts(x=base.x, y=y_task, x_q=base.x_q, y_q=jnp.einsum("pd,pd->p", base.x_q, w), w=w)


def whiten_tasks(w: jax.Array) -> jax.Array:
    """Task vectors with exact zero mean and identity empirical covariance (ddof = 1), as the
    reference code's ``whiten``: (w − w̄) C^{-1/2}, C the sample covariance.

    Args:
        w: (P, D) task vectors, P > D.
    Returns:
        (P, D) whitened task vectors.
    """
    P, D = w.shape
    if P <= D:
        raise ValueError(f"whitening needs more task vectors than dimensions (got P = {P}, D = {D})")
    centred = w - w.mean(axis=0, keepdims=True)
    evals, evecs = jnp.linalg.eigh(centred.T @ centred / (P - 1))
    return centred @ (evecs / jnp.sqrt(evals)[None, :]) @ evecs.T


# ---------------------------------------------------------------------------------------------
# What the reduced linattn models read of a prompt, drawn without its N context pairs.


class QueryMoments(NamedTuple):
    """β (eq 4), x_q, y_q and w of P prompts: all that the reduced models (eqs M, S) read.

    Attributes:
        beta: (P, D) β = (1/N) Σ_n y_n x_n.
        x_q: (P, D) query inputs.
        y_q: (P,) query labels.
        w: (P, D) task vectors.
    """

    beta: jax.Array
    x_q: jax.Array
    y_q: jax.Array
    w: jax.Array


def sample_query_moments(key: jax.Array, Lam: jax.Array, N: int, P: int) -> QueryMoments:
    """(β, x_q, y_q, w) of P prompts of eq 2, drawn from their exact joint law without the contexts.

    With Λ = CCᵀ, x_n = C u_n (u_n ~ N(0, I)) and a = Cᵀw: y_n = aᵀu_n and
    β = (1/N) C Σ_n u_n (aᵀu_n). Splitting u_n = â s_n + u⊥_n along â = a/‖a‖ (s_n ~ N(0, 1)
    independent of u⊥_n) gives Σ_n u_n aᵀu_n = ‖a‖ (â Q + Σ_n u⊥_n s_n) with Q = Σ_n s_n² ~ χ²_N
    and, given the s_n, Σ_n u⊥_n s_n ~ N(0, Q (I − ââᵀ)). Hence

        β = (1/N) C (a Q + ‖a‖ √Q (I − ââᵀ) g),   g ~ N(0, I_D),

    Q is drawn as a sum of N squared normals (exact; jax's gamma sampler costs seconds to
    compile): N + 3D random numbers per prompt instead of (N + 2)D. Equal in law (not draw by draw) to
    ``context_moment(sample_prompts(key, Lam, N, P))`` with its x_q, y_q, w; E[ββᵀ] = E[Λ̂²] (eq 31).

    Args:
        key: PRNG key.
        Lam: (D, D) covariance.
        N: context pairs per prompt.
        P: number of prompts.
    Returns:
        QueryMoments with beta, x_q (P, D), y_q (P,), w (P, D).
    """
    D = Lam.shape[0]
    kw, kq, kg, kc = jax.random.split(key, 4)
    chol = jnp.linalg.cholesky(Lam)
    w = jax.random.normal(kw, (P, D), dtype=Lam.dtype)
    u_q = jax.random.normal(kq, (P, D), dtype=Lam.dtype)
    g = jax.random.normal(kg, (P, D), dtype=Lam.dtype)
    Q = jnp.sum(jax.random.normal(kc, (P, N), dtype=Lam.dtype) ** 2, axis=1)
    a = w @ chol  # rows a_p = Cᵀ w_p
    norm = jnp.linalg.norm(a, axis=1, keepdims=True)
    a_hat = a / norm
    g_perp = g - a_hat * jnp.sum(a_hat * g, axis=1, keepdims=True)
    beta = (a * Q[:, None] + norm * jnp.sqrt(Q)[:, None] * g_perp) @ chol.T / N
    return QueryMoments(beta=beta, x_q=u_q @ chol.T, y_q=jnp.sum(a * u_q, axis=1), w=w)


# --------------------------------------------------------------------------------------------
# Population moments of the prompts


def expected_lambda_hat_sq(Lam, inv_N):
    """E[Λ̂²] for Λ̂ = (1/N) Σ_n x_n x_nᵀ, x_n ~ N(0, Λ): eq 30 (eq 31 for fixed N).

    E[Λ̂²] = Λ² + E(1/N) (Λ + trΛ·I) Λ.

    Args:
        Lam: (D, D) covariance Λ.
        inv_N: E(1/N); pass 1/N for a fixed context length N.
    Returns:
        (D, D) matrix E[Λ̂²].
    """
    Lam = jnp.asarray(Lam)
    D = Lam.shape[0]
    return Lam @ Lam + inv_N * (Lam + jnp.trace(Lam) * jnp.eye(D, dtype=Lam.dtype)) @ Lam


def population_loss(A, Lam, inv_N):
    """Expected query loss of the predictor ŷ_q = βᵀ A x_q on these prompts (the linattn paper's Sec 3):

    L(A) = trΛ − 2 tr(AΛ²) + tr(Aᵀ E[Λ̂²] A Λ),

    with A = Σ_i v_i U_i (ATTN_M), Σ_{i,r} v_i k_{i,r} q_{i,r}ᵀ (ATTN_S) or the column-major
    reshape of w₂ᵀW₁ (MLP on the cubic feature). Differentiable in A.

    Args:
        A: (D, D) effective matrix of the linear-attention predictor.
        Lam: (D, D) covariance Λ.
        inv_N: E(1/N) (1/N for a fixed length).
    Returns:
        scalar loss E(y_q − ŷ_q)².
    """
    Lam = jnp.asarray(Lam)
    Lhat2 = expected_lambda_hat_sq(Lam, inv_N)
    return jnp.trace(Lam) - 2.0 * jnp.trace(A @ Lam @ Lam) + jnp.trace(A.T @ Lhat2 @ A @ Lam)
