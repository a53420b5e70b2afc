"""Closed-form theory of "Training Dynamics of In-Context Learning in Linear Attention".

Zhang, Singh, Latham, Saxe (ICML 2025). Equation numbers are the paper's; the digest is
``shared/spec/linattn.md``. Conventions: ``Lam`` is the input covariance Λ (D, D), ``N`` the
number of context pairs, time in the paper's units (τ = 1) unless a docstring says otherwise.

This module imports nothing from iclab's engines: every function here can be checked without
training anything.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def harmonic_inv_length(N_max: int) -> float:
    """E(1/N) for a context length N uniform on {1, ..., N_max}: H_{N_max} / N_max (Sec A.1)."""
    if N_max < 1:
        raise ValueError(f"N_max must be >= 1 (got {N_max})")
    return float(sum(1.0 / n for n in range(1, N_max + 1)) / N_max)


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
    """Expected query loss of the predictor ŷ_q = βᵀ A x_q (spec §3, derived):

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


def fixed_point_loss(eigenvalues, subset, inv_N):
    """Loss at the fixed point M(S_m) of ATTN_S (eq 63; eq 26 with E(1/N) for random length):

    L(M(S_m)) = trΛ − Σ_{d∈S_m} λ_d [1 + E(1/N)(1 + trΛ/λ_d)]⁻¹.

    Args:
        eigenvalues: (D,) eigenvalues λ_d of Λ.
        subset: indices d (0-based) in S_m.
        inv_N: E(1/N).
    """
    lam = np.asarray(eigenvalues, dtype=float)
    tr = lam.sum()
    idx = np.asarray(list(subset), dtype=int)
    if idx.size == 0:
        return float(tr)
    sel = lam[idx]
    return float(tr - np.sum(sel / (1.0 + inv_N * (1.0 + tr / sel))))


def plateau_losses(eigenvalues, inv_N):
    """Losses L(M_0), ..., L(M_D) of the saddles visited from small init (eq 19; eq 26).

    M_m learns the top-m eigendirections: L(M_m) = trΛ − Σ_{d≤m} λ_d [1 + E(1/N)(1 + trΛ/λ_d)]⁻¹,
    with eigenvalues sorted in decreasing order. L(M_0) = trΛ and L(M_D) is the loss of the
    global minimum (eq 11), which ATTN_M reaches in one drop.

    Args:
        eigenvalues: (D,) eigenvalues of Λ, any order.
        inv_N: E(1/N) (1/N for a fixed length N).
    Returns:
        (D+1,) numpy array of plateau losses, non-increasing.
    """
    lam = np.sort(np.asarray(eigenvalues, dtype=float))[::-1]
    return np.array([fixed_point_loss(lam, range(m), inv_N) for m in range(lam.size + 1)])


def cubic_feature_moments(Lam, inv_N):
    """Population moments of the cubic feature z = vec(β x_qᵀ) = x_q ⊗ β (eqs 43-44).

    E(y_q z) = vec(Λ²) and E(z zᵀ) = Λ ⊗ E[Λ̂²] (column-stacking vec; x_q independent of β).

    Returns:
        (E_yz (D²,), E_zz (D², D²)).
    """
    Lam = jnp.asarray(Lam)
    E_yz = (Lam @ Lam).T.reshape(-1)
    E_zz = jnp.kron(Lam, expected_lambda_hat_sq(Lam, inv_N))
    return E_yz, E_zz


def mlp_population_loss(W, Lam, inv_N):
    """Expected loss of a linear predictor ŷ_q = Wᵀ z on the cubic feature (eqs 8, 43-44):

    L = trΛ − 2 Wᵀ E(y_q z) + Wᵀ E(z zᵀ) W, with W = W₁ᵀ w₂ for the 2-layer MLP.

    Computed from the moments of z, independently of the eq-M route through E[Λ̂²] and A.
    """
    E_yz, E_zz = cubic_feature_moments(Lam, inv_N)
    return jnp.trace(jnp.asarray(Lam)) - 2.0 * W @ E_yz + W @ E_zz @ W
