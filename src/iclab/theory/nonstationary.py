"""The exponential-weights predictor (one-layer GLA with a fixed forget factor) under ANY drifting task process.

Data: x_i ~ N(0, Λ) iid, y_i = x_iᵀ w_i + σ ε_i (i = 1..n+1), the tasks w_1..w_{n+1} a zero-mean process
independent of the inputs and the noise, with autocovariance C(a, b) = E[w_a w_bᵀ] (d, d). The predictor is
the one of the drift paper's Theorem 1 (eq 15) with a free readout Γ (d, d):

    ŷ = x_{n+1}ᵀ Γ G,   G = Σ_{i≤n} λ^{n+1−i} y_i x_i,

with the drift paper's weights ω_i = λ^{n+1−i} (the most recent pair weighted λ, as GLA's state
S_{n+1} = Σ_i λ^{n+1−i} z_i z_iᵀ; :mod:`iclab.theory.drift`). Its trained one-layer GLA reads ŷ = D1 Gᵀ Λ̃⁻¹ x_{n+1},
i.e. Γ = D1 Λ̃⁻¹ (Λ̃ symmetric). A weight λ^{n−i} would change Γ by a factor λ and nothing else.

The risk depends on the task process only through C (every term is quadratic in the tasks), so the formulas
below serve every drift family with known second moments: AR(1) (drift eq 2), a rotating or trending task
(:func:`iclab.tasks.state_space.task_autocovariance`), abrupt switches. Derived here [D], with Gaussian fourth
moments (Isserlis) E[x xᵀ A x xᵀ] = Λ(A + Aᵀ)Λ + tr(ΛA)Λ:

    B := E[G w_{n+1}ᵀ] = Λ K_q,   K_q = Σ_i ω_i C(i, n+1),
    M := E[G Gᵀ] = Λ K Λ + Λ D Λ + tr(Λ D) Λ + σ² s Λ,
         K = Σ_{i,j≤n} ω_i ω_j C(i, j),  D = Σ_i ω_i² C(i, i),  s = Σ_i ω_i²,

(the diagonal i = j brings the extra Λ C(i,i) Λ + tr(ΛC(i,i))Λ of the fourth moment, and the noise σ²Λ), and

    R(λ, Γ) = E[(ŷ − y_{n+1})²] = tr(Λ (Γ M Γᵀ − Γ B − Bᵀ Γᵀ + C(n+1, n+1))) + σ²,

the error of predicting the noisy label y_{n+1} (subtract σ² for the noiseless target x_{n+1}ᵀ w_{n+1}; the
drift paper has σ = 0). R is a convex quadratic in Γ (Λ ≻ 0, M ≻ 0), minimised by Γ* = Bᵀ M⁻¹ with

    R*(λ) = tr(Λ C(n+1, n+1)) − tr(Λ Bᵀ M⁻¹ B) + σ².

For AR(1), C(a, b) = c(a, b) I gives K_q = D1 I, K = (D2 + D3) I, D = D2 I, M = Λ Λ̃ (Lemma 3's constants and
Λ̃ = D2 (2Λ + tr(Λ) I) + D3 Λ), Γ* = D1 Λ̃⁻¹ (eq 14) and R* = D4 tr Λ − D1² tr(Λ² Λ̃⁻¹): Theorem 2's train
error (eq 16, :func:`iclab.theory.drift.train_error`). The risk at an earlier position t is the same formula with
C restricted to the tasks w_1..w_{t+1} (``C[:t+1, :t+1]``).

Conventions: ``lam`` the forget factor λ (scalar or array), ``C`` the task autocovariance over w_1..w_{n+1},
either (n+1, n+1, d, d) with C[a−1, b−1] = E[w_a w_bᵀ] or (n+1, n+1) scalars c(a, b) for an isotropic process
E[w_a w_bᵀ] = c(a, b) I_d (cheap at large n, d); ``Lam`` the (d, d) input covariance, ``sigma2`` the label noise
σ². Risks carry no ½. This module imports nothing but numpy, scipy and :mod:`iclab.theory.drift`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from iclab.theory.drift import _grid_then_brent

__all__ = ["ExponentialWeightsMoments", "exponential_weights_moments", "exponential_weights_readout",
           "exponential_weights_risk", "optimal_exponential_forget_factor"]


class ExponentialWeightsMoments(NamedTuple):
    """The second moments of the exponential-weights feature G and the target task (module docstring).

    Attributes:
        M: (..., d, d) E[G Gᵀ].
        B: (..., d, d) E[G w_{n+1}ᵀ].
        Cqq: (d, d) C(n+1, n+1) = E[w_{n+1} w_{n+1}ᵀ].
    """

    M: np.ndarray
    B: np.ndarray
    Cqq: np.ndarray


def _inputs(lam, C, Lam, sigma2):
    lam = np.asarray(lam, dtype=float)
    if np.any(~(lam > 0)) or np.any(~np.isfinite(lam)):
        raise ValueError(f"lam: a forget factor is a finite number > 0 (got {lam})")
    Lam = np.asarray(Lam, dtype=float)
    if Lam.ndim != 2 or Lam.shape[0] != Lam.shape[1]:
        raise ValueError(f"Lam: the input covariance must be a (d, d) matrix (got shape {Lam.shape})")
    if np.linalg.eigvalsh(0.5 * (Lam + Lam.T)).min() <= 0:
        raise ValueError("Lam: the input covariance must be positive definite")
    d = Lam.shape[0]
    C = np.asarray(C, dtype=float)
    if C.ndim not in (2, 4) or C.shape[0] != C.shape[1] or C.shape[0] < 2 or (C.ndim == 4 and C.shape[2:] != (d, d)):
        raise ValueError(f"C: the task autocovariance must be (n+1, n+1, {d}, {d}) or (n+1, n+1) with n >= 1 "
                         f"(got shape {C.shape})")
    if not (np.isfinite(sigma2) and sigma2 >= 0):
        raise ValueError(f"sigma2: a noise variance is a finite number >= 0 (got {sigma2!r})")
    return lam, C, Lam, float(sigma2)


def exponential_weights_moments(lam, *, C, Lam, sigma2=0.0) -> ExponentialWeightsMoments:
    """M = E[G Gᵀ], B = E[G w_{n+1}ᵀ] and C(n+1, n+1) of G = Σ_{i≤n} λ^{n+1−i} y_i x_i (module docstring, [D]).

    Args:
        lam: forget factor λ > 0, scalar or array of shape L.
        C: task autocovariance over w_1..w_{n+1}: (n+1, n+1, d, d), or (n+1, n+1) for c(a, b) I_d.
        Lam: (d, d) input covariance Λ (positive definite).
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        ExponentialWeightsMoments with M, B of shape (*L, d, d) and Cqq (d, d).
    """
    lam, C, Lam, sigma2 = _inputs(lam, C, Lam, sigma2)
    n, d = C.shape[0] - 1, Lam.shape[0]
    om = lam[..., None] ** np.arange(n, 0, -1, dtype=float)  # (*L, n): ω_i = λ^{n+1−i}
    s = np.sum(om * om, axis=-1)[..., None, None]
    Cn, eye = C[:n, :n], np.eye(d)
    if C.ndim == 2:  # isotropic: every sum is a scalar times I
        Kq = (om @ C[:n, n])[..., None, None] * eye
        K = np.einsum("...i,ij,...j->...", om, Cn, om)[..., None, None] * eye
        D = ((om * om) @ np.diag(Cn))[..., None, None] * eye
        Cqq = C[n, n] * eye
    else:
        Kq = np.einsum("...i,iab->...ab", om, C[:n, n])
        K = np.einsum("...j,...jab->...ab", om, np.einsum("...i,ijab->...jab", om, Cn, optimize=True))
        D = np.einsum("...i,iab->...ab", om * om, np.einsum("iiab->iab", Cn))
        Cqq = C[n, n]
    trLD = np.einsum("ab,...ba->...", Lam, D)[..., None, None]
    M = Lam @ (K + D) @ Lam + (trLD + sigma2 * s) * Lam
    return ExponentialWeightsMoments(M=0.5 * (M + np.swapaxes(M, -1, -2)), B=Lam @ Kq, Cqq=Cqq)


def exponential_weights_readout(lam, *, C, Lam, sigma2=0.0) -> np.ndarray:
    """The best readout Γ* = Bᵀ M⁻¹ for the forget factor λ: the minimiser of the quadratic risk R(λ, Γ).

    For AR(1) it is D1 Λ̃⁻¹, the readout of the drift paper's trained GLA (Theorem 1, eq 14).

    Args:
        lam: forget factor λ > 0, scalar or array of shape L.
        C: task autocovariance over w_1..w_{n+1}: (n+1, n+1, d, d), or (n+1, n+1) for c(a, b) I_d.
        Lam: (d, d) input covariance Λ.
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        (*L, d, d) Γ*, the prediction being ŷ = x_{n+1}ᵀ Γ* G.
    """
    mom = exponential_weights_moments(lam, C=C, Lam=Lam, sigma2=sigma2)
    # Γ* = Bᵀ M⁻¹ = (M⁻¹ B)ᵀ, M symmetric
    return np.swapaxes(np.linalg.solve(mom.M, mom.B), -1, -2)


def exponential_weights_risk(lam, *, C, Lam, sigma2=0.0, Gamma=None):
    """E[(ŷ − y_{n+1})²] of ŷ = x_{n+1}ᵀ Γ Σ_{i≤n} λ^{n+1−i} y_i x_i, exact for any task autocovariance C.

    R(λ, Γ) = tr(Λ (Γ M Γᵀ − Γ B − Bᵀ Γᵀ + C(n+1, n+1))) + σ² (module docstring); with ``Gamma=None`` the best
    readout Γ* for each λ, R*(λ) = tr(Λ C(n+1, n+1)) − tr(Λ Bᵀ M⁻¹ B) + σ². For AR(1) this is the drift paper's
    Theorem 2 train error (eq 16) plus σ². The risk at an earlier position t: pass ``C[:t+1, :t+1]``.

    Args:
        lam: forget factor λ > 0, scalar or array of shape L.
        C: task autocovariance over w_1..w_{n+1}: (n+1, n+1, d, d) with C[a−1, b−1] = E[w_a w_bᵀ], or
            (n+1, n+1) scalars c(a, b) for E[w_a w_bᵀ] = c(a, b) I_d.
        Lam: (d, d) input covariance Λ (positive definite).
        sigma2: label-noise variance σ² ≥ 0 (context labels and the scored target).
        Gamma: (d, d) fixed readout (the same for every λ), or None for the best readout Γ*(λ).
    Returns:
        float, or an array of shape L for an array ``lam``.
    """
    mom = exponential_weights_moments(lam, C=C, Lam=Lam, sigma2=sigma2)
    M, B, Cqq = mom
    Lam = np.asarray(Lam, dtype=float)
    base = np.trace(Lam @ Cqq) + float(sigma2)
    if Gamma is None:
        gain = np.einsum("ab,...cb,...ca->...", Lam, B, np.linalg.solve(M, B))  # tr(Λ Bᵀ M⁻¹ B)
        R = base - gain
    else:
        G = np.asarray(Gamma, dtype=float)
        if G.shape != Lam.shape:
            raise ValueError(f"Gamma: the readout must be a {Lam.shape} matrix (got shape {G.shape})")
        GMG = np.einsum("ab,...bc,dc->...ad", G, M, G)
        GB = np.einsum("ab,...bc->...ac", G, B)
        R = base + np.einsum("ab,...ba->...", Lam, GMG - GB - np.swapaxes(GB, -1, -2))
    return float(R) if np.ndim(R) == 0 else R


def optimal_exponential_forget_factor(*, C, Lam, sigma2=0.0, bounds=(1e-3, 1.0), xatol=1e-10):
    """λ* = argmin_λ R*(λ) (each λ with its best readout), by bounded scalar minimisation.

    A 201-point grid over ``bounds`` locates the basin; scipy's bounded Brent method then refines inside the
    neighbouring grid cells to ``xatol`` (as :func:`iclab.theory.drift.optimal_forget_factor`, which it equals
    for AR(1) at σ² = 0).

    Args:
        C: task autocovariance over w_1..w_{n+1}: (n+1, n+1, d, d), or (n+1, n+1) for c(a, b) I_d.
        Lam: (d, d) input covariance Λ.
        sigma2: label-noise variance σ² ≥ 0.
        bounds: (lo, hi) search interval for λ, 0 < lo < hi.
        xatol: absolute tolerance on λ*.
    Returns:
        (lam_star float, risk float) with risk = exponential_weights_risk(lam_star, ...).
    """
    setting = dict(C=C, Lam=Lam, sigma2=sigma2)
    return _grid_then_brent(lambda lam: exponential_weights_risk(lam, **setting), bounds, xatol)
