"""Closed forms of the task-diversity setting (Raventós et al. 2023) for the linear in-context predictor.

Prompts (:mod:`iclab.tasks.pool`): x_1..x_N, x_q ~ N(0, I_D) iid, a task w with second moment E[wwᵀ] = Σ, and
noisy labels y_n = wᵀx_n + σε_n, y_q = wᵀx_q + σε_q. Tasks from a pool of M vectors w_1..w_M drawn uniformly have

    Σ_M = (1/M) Σ_m w_m w_mᵀ,

fresh tasks from the prior N(0, σ_w² I) have Σ = σ_w² I (M = ∞). The predictor is linear attention's reduced form
(linattn's eq M with A = Γᵀ):

    ŷ = x_qᵀ Γ β,    β = (1/N) Σ_n y_n x_n = S w + (σ/N) Σ_n ε_n x_n,    S = (1/N) Σ_n x_n x_nᵀ.

**Moments (derived here).** E[β | w] = w (E S = I), and the Wishart moment E[S A S] = ((N+1)/N) A + tr(A) I / N
(A symmetric: the N(N−1) cross terms give A, the N diagonal ones E[xxᵀAxxᵀ] = 2A + tr(A) I) gives

    B(Σ) := E[ββᵀ] = ((N+1)/N) Σ + ((tr Σ + σ²)/N) I.

**Risk.** With x_q ~ N(0, I) integrated out, E[(ŷ − y_q)² | w, context] = ‖Γβ − w‖² + σ², so

    R(Γ; Σ) = tr(Γ B(Σ) Γᵀ) − 2 tr(Γ Σ) + tr Σ + σ²,

a convex quadratic in Γ (B ≻ 0 as soon as tr Σ + σ² > 0) that depends on the task distribution only through Σ.

**Optimum.** ∂R/∂Γ = 2(Γ B − Σ) = 0: Γ*(Σ) = Σ B(Σ)⁻¹, R*(Σ) = tr Σ − tr(Σ B(Σ)⁻¹ Σ) + σ². Pretrained on a pool, the
predictor's optimum is Γ_M = Γ*(Σ_M): its risk on the pool's own tasks is R(Γ_M; Σ_M) = R*(Σ_M), on fresh tasks
R(Γ_M; σ_w² I). As M → ∞, Σ_M → σ_w² I and both tend to the fresh optimum R*(σ_w² I), which is above ridge's risk
(ridge inverts the context's Gram matrix; Γβ cannot). tests/theory/test_task_diversity.py checks every risk against
a Monte Carlo of the predictor.

Only numpy is imported: nothing here trains a model.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PoolLinearRisks", "beta_second_moment", "linear_risk", "optimal_linear", "pool_linear_risks",
           "pool_second_moment", "wishart_moment"]


def _check(N: int, sigma2: float) -> None:
    if not N >= 1:
        raise ValueError(f"N: a context holds at least one pair (got {N})")
    if not sigma2 >= 0:
        raise ValueError(f"sigma2: a noise variance is ≥ 0 (got {sigma2})")


def wishart_moment(A, *, N: int) -> np.ndarray:
    """E[S A S] for S = (1/N) Σ_n x_n x_nᵀ, x_n ~ N(0, I) iid: ((N+1)/N) A + tr(A) I / N (A symmetric).

    Args:
        A: (..., D, D) symmetric matrices.
        N: context pairs N ≥ 1.
    Returns:
        (..., D, D) the moments.
    """
    A = np.asarray(A, dtype=float)
    eye = np.eye(A.shape[-1])
    return (N + 1) / N * A + np.trace(A, axis1=-2, axis2=-1)[..., None, None] * eye / N


def beta_second_moment(Sigma, *, N: int, sigma2: float) -> np.ndarray:
    """B(Σ) = E[ββᵀ] = ((N+1)/N) Σ + ((tr Σ + σ²)/N) I, β = (1/N) Σ_n y_n x_n (module docstring).

    Args:
        Sigma: (..., D, D) the tasks' second moment E[wwᵀ].
        N: context pairs; sigma2: label-noise variance σ².
    Returns:
        (..., D, D) E[ββᵀ].
    """
    _check(N, sigma2)
    Sigma = np.asarray(Sigma, dtype=float)
    return wishart_moment(Sigma, N=N) + sigma2 / N * np.eye(Sigma.shape[-1])


def linear_risk(Gamma, Sigma, *, N: int, sigma2: float) -> np.ndarray:
    """R(Γ; Σ) = tr(Γ B(Σ) Γᵀ) − 2 tr(Γ Σ) + tr Σ + σ²: the risk E(ŷ − y_q)² of ŷ = x_qᵀ Γ β, noisy query included.

    Args:
        Gamma: (..., D, D) the predictor's matrix Γ (linear attention's Aᵀ).
        Sigma: (..., D, D) the tasks' second moment (broadcast against Gamma).
        N: context pairs; sigma2: label-noise variance σ².
    Returns:
        (...) risks.
    """
    Gamma = np.asarray(Gamma, dtype=float)
    Sigma = np.asarray(Sigma, dtype=float)
    B = beta_second_moment(Sigma, N=N, sigma2=sigma2)
    quad = np.einsum("...ij,...jk,...ik->...", Gamma, B, Gamma)
    return quad - 2 * np.einsum("...ij,...ji->...", Gamma, Sigma) + np.trace(Sigma, axis1=-2, axis2=-1) + sigma2


def optimal_linear(Sigma, *, N: int, sigma2: float) -> np.ndarray:
    """Γ*(Σ) = Σ B(Σ)⁻¹, the minimiser of :func:`linear_risk` (B symmetric positive definite).

    Args:
        Sigma: (..., D, D) the tasks' second moment; tr Σ + σ² > 0.
        N: context pairs; sigma2: label-noise variance σ².
    Returns:
        (..., D, D) Γ*.
    """
    Sigma = np.asarray(Sigma, dtype=float)
    B = beta_second_moment(Sigma, N=N, sigma2=sigma2)
    if np.any(np.trace(Sigma, axis1=-2, axis2=-1) + sigma2 <= 0):
        raise ValueError("tr Σ + σ² must be > 0 (no signal and no noise: every Γ has risk 0)")
    # Γ B = Σ  ⇔  B Γᵀ = Σ (B and Σ symmetric)
    return np.swapaxes(np.linalg.solve(B, Sigma), -1, -2)


def pool_second_moment(pool) -> np.ndarray:
    """Σ_M = (1/M) Σ_m w_m w_mᵀ, the second moment of a task drawn uniformly from the pool.

    Args:
        pool: (..., M, D) task vectors.
    Returns:
        (..., D, D) Σ_M.
    """
    pool = np.asarray(pool, dtype=float)
    return np.einsum("...md,...me->...de", pool, pool) / pool.shape[-2]


class PoolLinearRisks(NamedTuple):
    """The pool-optimal linear predictor and its risks (noisy query included).

    Attributes:
        Gamma: (..., D, D) Γ_M = Γ*(Σ_M).
        pool: (...) R(Γ_M; Σ_M), its risk on the pool's tasks.
        fresh: (...) R(Γ_M; σ_w² I), its risk on fresh tasks from the prior.
        fresh_optimum: (...) R*(σ_w² I), the best linear predictor's risk on fresh tasks (M = ∞).
    """

    Gamma: np.ndarray
    pool: np.ndarray
    fresh: np.ndarray
    fresh_optimum: np.ndarray


def pool_linear_risks(pool, *, N: int, sigma2: float, prior_var: float = 1.0) -> PoolLinearRisks:
    """Risks of the linear predictor trained to optimality on a pool; M = ∞ is ``fresh_optimum``.

    Args:
        pool: (..., M, D) task vectors.
        N: context pairs; sigma2: label-noise variance σ²; prior_var: σ_w² of the fresh tasks' prior N(0, σ_w² I).
    Returns:
        :class:`PoolLinearRisks`.
    """
    pool = np.asarray(pool, dtype=float)
    D = pool.shape[-1]
    Sigma_M = pool_second_moment(pool)
    fresh = prior_var * np.eye(D)
    Gamma = optimal_linear(Sigma_M, N=N, sigma2=sigma2)
    G_inf = optimal_linear(fresh, N=N, sigma2=sigma2)
    return PoolLinearRisks(Gamma, linear_risk(Gamma, Sigma_M, N=N, sigma2=sigma2),
                           linear_risk(Gamma, fresh, N=N, sigma2=sigma2),
                           np.broadcast_to(linear_risk(G_inf, fresh, N=N, sigma2=sigma2), Sigma_M.shape[:-2]))
