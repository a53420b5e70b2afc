"""Closed-form theory of "Gating is Weighting: Understanding Gated Linear Attention through
In-context Learning" (Li, Tarzanagh, Rawat, Fazel, Oymak).

One-layer gated linear attention under the restricted construction (9) computes one step of
weighted preconditioned gradient descent (WPGD), ŷ = xᵀ P Xᵀ(ω ⊙ y) (eqs 7, 11). This module
holds the closed-form risk of that predictor under the correlated multitask model (Defs 1-2),
its optimum (Thms 2-3, Cor 1), linear attention (Cor 2), scalar and vector gating with
delimiters (Thms 4-5), and a numerical global minimiser that cross-checks all of them.
Equation numbers are the paper's.

Conventions: ``Sigma`` (d, d) feature covariance Σ; ``R`` (n, n) and ``r`` (n,) the task
correlations of eq 12; ``sigma2`` the label-noise variance σ²; M = tr Σ + σ²; ``P`` (d, d)
preconditioner; ``omega`` (n,) sample weights; ``block_sizes`` (n_1, ..., n_K) the task blocks
of a multitask prompt (Sec 5.1). Every risk takes (what is evaluated, Sigma, R, r, sigma2) in this
order; the isotropic closed forms (Σ = I_d, eqs 17 and 24) take the dimension ``d`` in Σ's place:
``wpgd_optimal_risk_isotropic(d, R, r, sigma2)`` = ``wpgd_optimal_risk(np.eye(d), R, r, sigma2)``.
(R, r) must come from a valid joint correlation [[R, r], [rᵀ, 1]] (PSD, unit diagonal), which the
data model validates (``iclab.tasks.multitask.joint_task_correlation``).

Errata handled here:

* Eq 15 prints P* = Σ^{-1/2}(γ*Σ/M + I)^{-1}Σ^{-1/2}. Back-transforming (42a) through
  P̃ = Σ^{1/2}PΣ^{1/2} (38) gives P* ∝ (γ*Σ/M + I)^{-1}; the printed form is not stationary
  when Σ ≠ I. ``optimal_preconditioner`` is the corrected one; the printed one is kept as
  ``optimal_preconditioner_as_printed`` only to exhibit the gap.
* Eq 40 prints the last term as 2(‖ω‖² + ωᵀRω)ΣP̃; the gradient of tr(ΣP̃ᵀP̃) is 2P̃Σ. The two
  agree only when P̃ commutes with Σ (as at the stationary point), so ``wpgd_grad_tilde`` uses P̃Σ.

Only numpy, scipy and JAX are imported: nothing here needs a model or training.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize

__all__ = [
    "GatingOptimum", "NumericalOptimum", "Spectra", "WPGDOptimum", "assumption3_holds", "block_indicator",
    "contraction_bound", "fixed_point_iteration", "fixed_point_map", "fixed_points", "gamma_star", "h1", "h2",
    "linear_attention_risk", "linear_attention_risk_isotropic", "multitask_correlation", "optimal_preconditioner",
    "optimal_preconditioner_as_printed", "optimal_preconditioner_given_weights", "optimal_scale", "optimal_weights",
    "risk_given_weights", "scalar_gating_optimum", "spectra", "spectral_gaps", "two_task_correlation",
    "uniqueness_condition", "vector_gating_optimum", "wpgd_grad", "wpgd_grad_tilde", "wpgd_numerical_minimum",
    "wpgd_optimal_risk", "wpgd_optimal_risk_isotropic", "wpgd_optimum", "wpgd_risk", "wpgd_risk_tilde",
]

# Relative tolerance below which an eigenvalue of R counts as zero (eq 13 uses nonzero ones).
_EIG_TOL = 1e-10
# r₁² + r₂² ≤ 1 (App B.1) is checked to this absolute tolerance.
_CORR_TOL = 1e-10


# ----------------------------------------------------------------------------- risk and gradients


def wpgd_risk(P, omega, Sigma, R, r, sigma2):
    """Population risk of the WPGD predictor ŷ = xᵀPXᵀ(ω⊙y) (eq 37).

    L(P, ω) = M − 2 tr(Σ²P) ωᵀr + M‖ω‖² tr(ΣPᵀΣP) + (‖ω‖² + ωᵀRω) tr(Σ²PᵀΣP),
    M = tr Σ + σ². Assumes E[β_iβ_jᵀ] = R_ij I_d (isotropic cross-covariance; Def 1 states only the marginals).
    Differentiable in every argument.

    Args:
        P: (d, d) preconditioner (not necessarily symmetric).
        omega: (n,) sample weights ω.
        Sigma: (d, d) feature covariance Σ.
        R: (n, n) in-context task correlation (unit diagonal).
        r: (n,) correlation of the in-context tasks with the query task.
        sigma2: label-noise variance σ².
    Returns:
        scalar risk E[(y − ŷ)²].
    """
    P, omega, Sigma, R, r = map(jnp.asarray, (P, omega, Sigma, R, r))
    M = jnp.trace(Sigma) + sigma2
    S2 = Sigma @ Sigma
    w2 = omega @ omega
    wRw = omega @ R @ omega
    PtSP = P.T @ Sigma @ P
    return (
        M
        - 2.0 * jnp.trace(S2 @ P) * (omega @ r)
        + M * w2 * jnp.trace(Sigma @ PtSP)
        + (w2 + wRw) * jnp.trace(S2 @ PtSP)
    )


def wpgd_risk_tilde(P_tilde, omega, Sigma, R, r, sigma2):
    """Risk (37) in the whitened variable P̃ = Σ^{1/2}PΣ^{1/2} (eqs 38-39).

    L(P̃, ω) = M − 2 tr(ΣP̃) ωᵀr + M‖ω‖² tr(P̃ᵀP̃) + (‖ω‖² + ωᵀRω) tr(ΣP̃ᵀP̃).

    Args:
        P_tilde: (d, d) whitened preconditioner P̃.
        omega, Sigma, R, r, sigma2: as in ``wpgd_risk``.
    Returns:
        scalar risk.
    """
    Pt, omega, Sigma, R, r = map(jnp.asarray, (P_tilde, omega, Sigma, R, r))
    M = jnp.trace(Sigma) + sigma2
    w2 = omega @ omega
    PtP = Pt.T @ Pt
    return (
        M
        - 2.0 * jnp.trace(Sigma @ Pt) * (omega @ r)
        + M * w2 * jnp.trace(PtP)
        + (w2 + omega @ R @ omega) * jnp.trace(Sigma @ PtP)
    )


def wpgd_grad_tilde(P_tilde, omega, Sigma, R, r, sigma2):
    """Gradients of the whitened risk (39): eqs 40-41, with eq 40's ΣP̃ corrected to P̃Σ.

    ∇_P̃ = −2ωᵀr Σ + 2M‖ω‖² P̃ + 2(‖ω‖² + ωᵀRω) P̃Σ,
    ∇_ω = −2 tr(ΣP̃) r + 2M tr(P̃ᵀP̃) ω + 2 tr(ΣP̃ᵀP̃)(I + R) ω.

    Args:
        P_tilde: (d, d); omega: (n,); Sigma, R, r, sigma2 as in ``wpgd_risk``.
    Returns:
        (grad_P_tilde (d, d), grad_omega (n,)) as numpy arrays.
    """
    Pt, omega, Sigma, R, r = (np.asarray(a, dtype=float) for a in (P_tilde, omega, Sigma, R, r))
    M = np.trace(Sigma) + sigma2
    w2 = omega @ omega
    PtP = Pt.T @ Pt
    # Eq 40 prints ΣP̃ for the last term; d tr(ΣP̃ᵀP̃)/dP̃ = 2P̃Σ (an erratum: see the module docstring).
    g_P = -2.0 * (omega @ r) * Sigma + 2.0 * M * w2 * Pt + 2.0 * (w2 + omega @ R @ omega) * Pt @ Sigma
    g_w = (
        -2.0 * np.trace(Sigma @ Pt) * r
        + 2.0 * M * np.trace(PtP) * omega
        + 2.0 * np.trace(Sigma @ PtP) * (omega + R @ omega)
    )
    return g_P, g_w


def wpgd_grad(P, omega, Sigma, R, r, sigma2):
    """Gradients of the risk (37) in the original variables, via eqs 38, 40-41.

    ∇_P L = Σ^{1/2} ∇_P̃ L Σ^{1/2} at P̃ = Σ^{1/2}PΣ^{1/2}; ∇_ω unchanged.

    Args:
        P: (d, d); omega: (n,); Sigma, R, r, sigma2 as in ``wpgd_risk``.
    Returns:
        (grad_P (d, d), grad_omega (n,)) as numpy arrays.
    """
    Sh = _sqrtm_psd(Sigma)
    g_Pt, g_w = wpgd_grad_tilde(Sh @ np.asarray(P, dtype=float) @ Sh, omega, Sigma, R, r, sigma2)
    return Sh @ g_Pt @ Sh, g_w


# ----------------------------------------------------------------- Theorem 2: h1, h2 and γ*


class Spectra(NamedTuple):
    """Spectral data of Definition 3 / Assumption 1: s = eig(Σ), λ = eig(R), a = Eᵀr, M.

    Attributes:
        s: (d,) eigenvalues of Σ, ascending.
        lam: (n,) eigenvalues λ of R = E diag(λ) Eᵀ, ascending.
        a: (n,) coordinates a = Eᵀr of r in R's eigenbasis.
        M: tr Σ + σ².
    """

    s: np.ndarray
    lam: np.ndarray
    a: np.ndarray
    M: float


def spectra(Sigma, R, r, sigma2) -> Spectra:
    """Eigen-data used by eqs 13-14 (Def 3, Assumption 1): R = E diag(λ) Eᵀ, a = Eᵀr.

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        Spectra(s (d,), lam (n,), a (n,), M = tr Σ + σ²).
    """
    Sigma = np.asarray(Sigma, dtype=float)
    s = np.linalg.eigvalsh(Sigma)
    lam, E = np.linalg.eigh(np.asarray(R, dtype=float))
    a = E.T @ np.asarray(r, dtype=float)
    if not np.any(np.abs(a) > 0):
        raise ValueError("r must be nonzero (Assumption 1: r = Ea with a ≠ 0)")
    return Spectra(s, lam, a, float(s.sum() + sigma2))


def h1(gamma_bar, lam, a):
    """h₁(γ̄) = Σ λ_i a_i²/(1+λ_iγ̄)² / Σ a_i²/(1+λ_iγ̄)² (eq 14a).

    Equals ωᵀRω/‖ω‖² for ω = (γ̄R + I)^{-1} r (eq 44). Vectorised over γ̄ and differentiable.

    Args:
        gamma_bar: scalar or (m,) array, γ̄ ≥ 0.
        lam: (n,) eigenvalues λ of R.
        a: (n,) coordinates a = Eᵀr of r in R's eigenbasis.
    Returns:
        h₁(γ̄) with the shape of gamma_bar.
    """
    xp = _xp(gamma_bar, lam, a)
    g = xp.asarray(gamma_bar)[..., None]
    lam = xp.asarray(lam)
    w = xp.asarray(a) ** 2 / (1.0 + lam * g) ** 2
    return xp.sum(lam * w, axis=-1) / xp.sum(w, axis=-1)


def h2(gamma, s, M):
    """h₂(γ) = (1 + M Σ s_i²/(M+s_iγ)² / Σ s_i³/(M+s_iγ)²)^{-1} (eq 14b).

    Equals tr(ΣP̃ᵀP̃)/(M tr(P̃ᵀP̃) + tr(ΣP̃ᵀP̃)) at P̃ ∝ (γI/M + Σ^{-1})^{-1} (App E.1).
    Vectorised over γ and differentiable. Σ = I gives 1/(d + σ² + 1) for every γ (Cor 1).

    Args:
        gamma: scalar or (m,) array, γ ≥ 1.
        s: (d,) eigenvalues of Σ.
        M: tr Σ + σ².
    Returns:
        h₂(γ) with the shape of gamma.
    """
    xp = _xp(gamma, s, M)
    g = xp.asarray(gamma)[..., None]
    s = xp.asarray(s)
    den = (M + s * g) ** 2
    return 1.0 / (1.0 + M * xp.sum(s**2 / den, axis=-1) / xp.sum(s**3 / den, axis=-1))


def fixed_point_map(gamma, Sigma, R, r, sigma2):
    """f(γ) = h₁(h₂(γ)) + 1, whose fixed point is γ* (Thm 2, Lemma 1).

    Args:
        gamma: scalar or (m,) array, γ ≥ 1.
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        f(γ) with the shape of gamma (differentiable in γ).
    """
    sp = spectra(Sigma, R, r, sigma2)
    return h1(h2(gamma, sp.s, sp.M), sp.lam, sp.a) + 1.0


def _scan_roots(g, lo, hi, num=400):
    """All sign changes of a continuous g on [lo, hi], refined with brentq."""
    grid = np.linspace(lo, hi, num)
    vals = np.asarray(g(grid), dtype=float)
    roots = [x for x, v in zip(grid, vals) if v == 0.0]
    for i in np.nonzero(vals[:-1] * vals[1:] < 0)[0]:
        roots.append(optimize.brentq(lambda t: float(g(np.array([t]))[0]), grid[i], grid[i + 1],
                                     xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500))
    return np.sort(np.asarray(roots, dtype=float))


def _gamma_bracket(R):
    # γ(ω) = 1 + ωᵀRω/‖ω‖² ∈ [1, 1 + λ_max(R)], so every fixed point lies in this bracket;
    # the small overshoot makes f(hi) − hi strictly negative even when f ≡ hi.
    lam_max = float(np.linalg.eigvalsh(np.asarray(R, dtype=float))[-1])
    return 1.0, 1.0 + lam_max * (1.0 + 1e-9) + 1e-12


def fixed_points(Sigma, R, r, sigma2, num=400):
    """All fixed points γ = h₁(h₂(γ)) + 1 in [1, 1 + λ_max(R)] (Lemma 1: at least one exists).

    Found by scanning f(γ) − γ on a grid of ``num`` points and refining each sign change.

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ²; num: grid size.
    Returns:
        (k,) sorted fixed points, k ≥ 1.
    """
    sp = spectra(Sigma, R, r, sigma2)

    def g(gam):
        return np.asarray(h1(h2(gam, sp.s, sp.M), sp.lam, sp.a)) + 1.0 - gam

    roots = _scan_roots(g, *_gamma_bracket(R), num=num)
    if roots.size == 0:  # cannot happen for r ≠ 0 (f(1) > 1, f(hi) < hi); a bug if it does
        raise RuntimeError("no fixed point of h1(h2(γ)) + 1 found in [1, 1 + λ_max(R)]")
    return roots


def fixed_point_iteration(gamma0, Sigma, R, r, sigma2, *, tol=1e-14, max_iter=100_000):
    """Iterate γ ← h₁(h₂(γ)) + 1 from γ₀ (Thm 3 T1: converges when (16) holds).

    Args:
        gamma0: starting point γ₀ ≥ 1.
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
        tol: stop when |γ_{k+1} − γ_k| ≤ tol·max(1, γ_k).
        max_iter: iteration cap.
    Returns:
        (gamma, iterations, converged): the last iterate (float), the iterations taken, and whether the
        tolerance was met.
    """
    sp = spectra(Sigma, R, r, sigma2)
    gam = float(gamma0)
    for k in range(1, max_iter + 1):
        new = float(h1(h2(gam, sp.s, sp.M), sp.lam, sp.a)) + 1.0
        if abs(new - gam) <= tol * max(1.0, gam):
            return new, k, True
        gam = new
    return gam, max_iter, False


def gamma_star(Sigma, R, r, sigma2):
    """The fixed point γ* of h₁(h₂(γ)) + 1 whose stationary point (15) has least risk (Thm 2).

    Unique when (16) holds (Thm 3); otherwise the global minimiser is picked among all fixed
    points, since the global minimum of (37) is a stationary point.

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        γ* ≥ 1 (float).
    """
    return wpgd_optimum(Sigma, R, r, sigma2).gamma


# ---------------------------------------------------------------- Theorem 3: uniqueness condition


def spectral_gaps(Sigma, R):
    """Effective spectral gaps Δ_Σ = s_max − s_min, Δ_R = λ_max − λ_min over nonzero λ (eq 13).

    Args:
        Sigma: (d, d); R: (n, n).
    Returns:
        (Delta_Sigma, Delta_R).
    """
    s = np.linalg.eigvalsh(np.asarray(Sigma, dtype=float))
    lam = np.linalg.eigvalsh(np.asarray(R, dtype=float))
    nz = lam[lam > _EIG_TOL * max(lam.max(), 1.0)]
    return float(s[-1] - s[0]), float(nz.max() - nz.min())


def uniqueness_condition(Sigma, R, sigma2):
    """Whether Δ_Σ·Δ_R < M + s_min holds (eq 16; sufficient for a unique γ* and minimum, Thm 3).

    Args:
        Sigma: (d, d); R: (n, n); sigma2: σ².
    Returns:
        bool.
    """
    dS, dR = spectral_gaps(Sigma, R)
    s = np.linalg.eigvalsh(np.asarray(Sigma, dtype=float))
    return bool(dS * dR < s.sum() + sigma2 + s[0])


def contraction_bound(Sigma, R, sigma2):
    """Lemma 2's bound on |f'(γ)| for f = h₁∘h₂ + 1: Δ_Σ²Δ_R²/(M + s_min)² (< 1 under (16)).

    Args:
        Sigma: (d, d); R: (n, n); sigma2: σ².
    Returns:
        the bound (float).
    """
    dS, dR = spectral_gaps(Sigma, R)
    s = np.linalg.eigvalsh(np.asarray(Sigma, dtype=float))
    return float((dS * dR) ** 2 / (s.sum() + sigma2 + s[0]) ** 2)


# ------------------------------------------------------------ optimal P, ω and their scale


def optimal_weights(R, r, h):
    """ω* = (h R + I)^{-1} r, with h = h₂(γ*) at the optimum (eq 15).

    Args:
        R: (n, n); r: (n,); h: scalar h₂(γ) > 0.
    Returns:
        (n,) weights (unit scale: only the product of the scales of P and ω is identified).
    """
    R = np.asarray(R, dtype=float)
    return np.linalg.solve(h * R + np.eye(R.shape[0]), np.asarray(r, dtype=float))


def optimal_preconditioner(Sigma, *, gamma, sigma2):
    """Corrected optimal preconditioner direction P* ∝ (γΣ/M + I)^{-1} (eq 15, erratum; eq 42a).

    Eq 15 prints Σ^{-1/2}(γΣ/M + I)^{-1}Σ^{-1/2}, which is not stationary for Σ ≠ I.

    Args:
        Sigma: (d, d) feature covariance.
        gamma: γ (γ* at the optimum).
        sigma2: σ².
    Returns:
        (d, d) symmetric P (unit scale; see ``optimal_scale``).
    """
    Sigma = np.asarray(Sigma, dtype=float)
    M = np.trace(Sigma) + sigma2
    return np.linalg.inv(gamma * Sigma / M + np.eye(Sigma.shape[0]))


def optimal_preconditioner_as_printed(Sigma, *, gamma, sigma2):
    """Eq 15's P* exactly as printed, Σ^{-1/2}(γΣ/M + I)^{-1}Σ^{-1/2} (ERRATUM; for comparison only).

    Args:
        Sigma: (d, d) feature covariance.
        gamma: γ.
        sigma2: σ².
    Returns:
        (d, d) matrix; proportional to ``optimal_preconditioner`` only when Σ ∝ I.
    """
    Si = np.linalg.inv(_sqrtm_psd(Sigma))
    return Si @ optimal_preconditioner(Sigma, gamma=gamma, sigma2=sigma2) @ Si


def optimal_scale(P, omega, Sigma, R, r, sigma2):
    """Best product scale t for (tP, ω) and the resulting risk (eqs 53-54).

    With A = tr(Σ²P)ωᵀr and Q = M‖ω‖²tr(ΣPᵀΣP) + (‖ω‖²+ωᵀRω)tr(Σ²PᵀΣP):
    L(tP, ω) = M − 2tA + t²Q, minimised at t = A/Q with L = M − A²/Q.

    Args:
        P: (d, d); omega: (n,); Sigma, R, r, sigma2 as in ``wpgd_risk``.
    Returns:
        (t, risk) as floats.
    """
    P, omega, Sigma, R, r = (np.asarray(x, dtype=float) for x in (P, omega, Sigma, R, r))
    M = np.trace(Sigma) + sigma2
    S2 = Sigma @ Sigma
    PtSP = P.T @ Sigma @ P
    A = np.trace(S2 @ P) * (omega @ r)
    w2 = omega @ omega
    Q = M * w2 * np.trace(Sigma @ PtSP) + (w2 + omega @ R @ omega) * np.trace(S2 @ PtSP)
    if Q <= 0.0:
        return 0.0, float(M)
    return float(A / Q), float(M - A * A / Q)


def optimal_preconditioner_given_weights(omega, Sigma, R, r, sigma2):
    """argmin_P L(P, ω) for fixed ω: P = ωᵀr (M‖ω‖² I + (‖ω‖² + ωᵀRω) Σ)^{-1} (from eq 42a).

    Args:
        omega: (n,); Sigma, R, r, sigma2 as in ``wpgd_risk``.
    Returns:
        (d, d) optimal P, scale included.
    """
    omega, Sigma, R, r = (np.asarray(x, dtype=float) for x in (omega, Sigma, R, r))
    M = np.trace(Sigma) + sigma2
    w2 = omega @ omega
    return (omega @ r) * np.linalg.inv(M * w2 * np.eye(Sigma.shape[0]) + (w2 + omega @ R @ omega) * Sigma)


def risk_given_weights(omega, Sigma, R, r, sigma2):
    """min_P L(P, ω) = M − (ωᵀr)² Σ_i s_i² / (M‖ω‖² + (‖ω‖² + ωᵀRω) s_i) (derived here from (37), (42a)).

    Scale-invariant in ω; for Σ = I it is the Rayleigh quotient
    d + σ² − d(ωᵀr)²/((d+σ²+1)‖ω‖² + ωᵀRω) (derived here, P = cI) that yields eqs 17 and 24.

    Args:
        omega: (n,) weights (ω = 0 gives M); Sigma, R, r, sigma2 as in ``wpgd_risk``.
    Returns:
        risk (float).
    """
    omega, R, r = (np.asarray(x, dtype=float) for x in (omega, R, r))
    s = np.linalg.eigvalsh(np.asarray(Sigma, dtype=float))
    M = s.sum() + sigma2
    w2 = omega @ omega
    if w2 == 0.0:
        return float(M)
    c = w2 + omega @ R @ omega
    return float(M - (omega @ r) ** 2 * np.sum(s**2 / (M * w2 + c * s)))


class WPGDOptimum(NamedTuple):
    """Global minimiser of eq 37 (Thm 2 with the corrected P*).

    Attributes:
        gamma: γ*, the fixed point of h₁(h₂(γ)) + 1 of least risk.
        h2: h₂(γ*).
        P: (d, d) preconditioner, the optimal product scale included (eqs 53-54).
        omega: (n,) ω* = (h₂(γ*)R + I)^{-1} r, unit scale (eq 15).
        risk: L*_WPGD.
    """

    gamma: float
    h2: float
    P: np.ndarray
    omega: np.ndarray
    risk: float


def wpgd_optimum(Sigma, R, r, sigma2) -> WPGDOptimum:
    """Global minimiser of the WPGD risk (eq 2 / 37) via Thm 2 with the corrected P* (eq 15).

    For each fixed point γ of h₁(h₂(γ)) + 1: ω = (h₂(γ)R + I)^{-1}r, P ∝ (γΣ/M + I)^{-1},
    product scale from eqs 53-54; the fixed point of least risk is returned.

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        WPGDOptimum(gamma, h2, P (d, d), omega (n,), risk); ω carries unit scale, P the rest.
    """
    sp = spectra(Sigma, R, r, sigma2)
    best = None
    for gam in fixed_points(Sigma, R, r, sigma2):
        hh = float(h2(gam, sp.s, sp.M))
        w = optimal_weights(R, r, hh)
        P = optimal_preconditioner(Sigma, gamma=gam, sigma2=sigma2)
        t, risk = optimal_scale(P, w, Sigma, R, r, sigma2)
        if best is None or risk < best.risk:
            best = WPGDOptimum(float(gam), hh, t * P, w, risk)
    return best


def wpgd_optimal_risk(Sigma, R, r, sigma2):
    """L*_WPGD = min_{P, ω} L(P, ω) for general Σ (eq 2, Thms 2-3 with the corrected P*).

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        risk (float).
    """
    return wpgd_optimum(Sigma, R, r, sigma2).risk


def wpgd_optimal_risk_isotropic(d, R, r, sigma2):
    """L*_WPGD for Σ = I_d: d + σ² − d·rᵀ(R + (d+σ²+1)I)^{-1}r (eq 17, Cor 1).

    Equals ``wpgd_optimal_risk(np.eye(d), R, r, sigma2)``: the dimension d takes Σ's place.

    Args:
        d: feature dimension (Σ = I_d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        risk (float).
    """
    R, r = np.asarray(R, dtype=float), np.asarray(r, dtype=float)
    c = d + sigma2 + 1.0
    return float(d + sigma2 - d * r @ np.linalg.solve(R + c * np.eye(R.shape[0]), r))


def linear_attention_risk(Sigma, R, r, sigma2):
    """L*_ATT = min_P L(P, ω = 1) for general Σ (Cor 2 extended; = eq 24 when Σ = I).

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        risk (float).
    """
    return risk_given_weights(np.ones(np.asarray(r).shape[0]), Sigma, R, r, sigma2)


def linear_attention_risk_isotropic(d, R, r, sigma2):
    """L*_ATT for Σ = I_d: d + σ² − d(1ᵀr)²/(n(d+σ²+1) + 1ᵀR1) (eq 24, Cor 2).

    Equals ``linear_attention_risk(np.eye(d), R, r, sigma2)``: the dimension d takes Σ's place.

    Args:
        d: feature dimension (Σ = I_d); R: (n, n); r: (n,); sigma2: σ².
    Returns:
        risk (float).
    """
    R, r = np.asarray(R, dtype=float), np.asarray(r, dtype=float)
    n = r.shape[0]
    return float(d + sigma2 - d * r.sum() ** 2 / (n * (d + sigma2 + 1.0) + R.sum()))


# ----------------------------------------------------------- Theorems 4-5: scalar and vector gating


def block_indicator(block_sizes):
    """Indicator B ∈ {0,1}^{n×K} with ω = B w for block weights w (the set W of eq 22).

    Args:
        block_sizes: (K,) positive block lengths n_1, ..., n_K.
    Returns:
        (n, K) float array.
    """
    sizes = [int(m) for m in block_sizes]
    if len(sizes) == 0 or min(sizes) < 1:
        raise ValueError(f"block_sizes must be a nonempty list of integers >= 1 (got {list(block_sizes)})")
    return np.repeat(np.eye(len(sizes)), sizes, axis=0)


def _cone_rayleigh(b, Q, monotone):
    """argmax of (wᵀb)²/(wᵀQw) over w ∈ R^K (monotone=False) or the cone 0 ≤ w_1 ≤ … ≤ w_K.

    For the cone, w = T u with T lower-triangular ones and u ≥ 0. The optimum's support S makes
    u_S an interior stationary point of the face, i.e. u_S ∝ A_S^{-1}c_S, so enumerating the
    supports whose stationary point has one sign and keeping the largest ratio c_Sᵀ A_S^{-1} c_S
    is exact (the binding constraints pool adjacent blocks to one weight).
    """
    K = b.shape[0]
    if not monotone:
        return np.linalg.solve(Q, b)
    if K > 16:
        raise ValueError(f"block_sizes must have at most 16 blocks for the exact monotone solver (got {K})")
    T = np.tril(np.ones((K, K)))
    c, A = T.T @ b, T.T @ Q @ T
    best_val, best_u = -1.0, np.zeros(K)
    for size in range(1, K + 1):
        for S in itertools.combinations(range(K), size):
            S = list(S)
            uS = np.linalg.solve(A[np.ix_(S, S)], c[S])
            val = float(c[S] @ uS)
            scale = np.max(np.abs(uS))
            if scale == 0.0:
                continue
            if np.all(uS >= -1e-12 * scale) or np.all(uS <= 1e-12 * scale):
                if val > best_val:
                    u = np.zeros(K)
                    u[S] = np.abs(uS)  # flipping the sign of ω is absorbed by P
                    best_val, best_u = val, u
    return T @ best_u


class GatingOptimum(NamedTuple):
    """Optimum of eq 37 over P and block weights ω = Bw (eq 22, Thms 4-5).

    Only the product of the scales of P and ω is identified; the weights are normalised to
    max_k |w_k| = 1 by a positive factor and P carries the rest. For scalar gating this is
    0 ≤ w_1 ≤ … ≤ w_K = 1, the form the gates of Thm 4 realise (``iclab.models.gla.scalar_gate_for_weights``).

    Attributes:
        risk: the optimal risk.
        omega_blocks: (K,) block weights w, max_k |w_k| = 1 (zeros when ω = 0 is optimal).
        omega: (n,) sample weights ω = Bw, on the same scale.
        P: (d, d) the optimal preconditioner for this ω, scale included (``optimal_preconditioner_given_weights``).
        gamma: γ = 1 + ωᵀRω/‖ω‖² at the optimum.
    """

    risk: float
    omega_blocks: np.ndarray
    omega: np.ndarray
    P: np.ndarray
    gamma: float


def _block_optimum(Sigma, R, r, sigma2, block_sizes, monotone) -> GatingOptimum:
    """min of (37) over P and ω = Bw, w free or in the monotone cone.

    At the optimum, ω is the (cone-)Rayleigh maximiser for h = h₂(γ) and γ = 1 + ωᵀRω/‖ω‖²
    (the Thm 2 argument with eq 41 restricted to the block subspace / cone), so the optimum is
    one of the fixed points of γ ↦ 1 + ω(h₂(γ))ᵀRω/‖ω‖², scanned as in ``fixed_points``.
    """
    R, r = np.asarray(R, dtype=float), np.asarray(r, dtype=float)
    B = block_indicator(block_sizes)
    if B.shape[0] != r.shape[0]:
        raise ValueError(f"block_sizes must sum to n = {r.shape[0]} (got {B.shape[0]})")
    s = np.linalg.eigvalsh(np.asarray(Sigma, dtype=float))
    M = s.sum() + sigma2
    b, N, RB = B.T @ r, B.T @ B, B.T @ R @ B

    def weights(gam):
        return _cone_rayleigh(b, N + float(h2(gam, s, M)) * RB, monotone)

    def f_minus_id(gams):
        out = []
        for gam in np.atleast_1d(gams):
            om = B @ weights(gam)
            w2 = om @ om
            out.append((1.0 + om @ R @ om / w2 if w2 > 0 else 1.0) - gam)
        return np.array(out)

    best = None
    for gam in _scan_roots(f_minus_id, *_gamma_bracket(R), num=200):
        w = weights(gam)
        risk = risk_given_weights(B @ w, Sigma, R, r, sigma2)
        if best is None or risk < best[0]:
            best = (risk, w, float(gam))
    d = np.asarray(Sigma).shape[0]
    if best is None:  # b ⊥ the cone: no weighting helps, ω = 0 is optimal
        return GatingOptimum(float(M), np.zeros(B.shape[1]), np.zeros(B.shape[0]), np.zeros((d, d)), 1.0)
    risk, w, gam = best
    scale = np.max(np.abs(w))
    if scale == 0:
        return GatingOptimum(risk, w, B @ w, np.zeros((d, d)), gam)
    w = w / scale  # the risk is scale-invariant in ω: P carries the scale
    om = B @ w
    return GatingOptimum(risk, w, om, optimal_preconditioner_given_weights(om, Sigma, R, r, sigma2), gam)


def scalar_gating_optimum(Sigma, R, r, sigma2, block_sizes) -> GatingOptimum:
    """L*_GLA = L*^{,W}_WPGD: min of (37) over P and block weights 0 ≤ ω_1 ≤ … ≤ ω_K ≤ 1 (eq 22).

    The bound ω_K ≤ 1 is inactive because P absorbs the scale. For K = 2 the result is eq 17
    when r_1 ≤ r_2 and eq 24 otherwise (Σ = I, independent tasks); for K ≥ 3 it can lie strictly
    between (derived here; tested in tests/experiments/test_gating_optimum.py).

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
        block_sizes: (K,) task-block lengths, summing to n.
    Returns:
        GatingOptimum(risk, omega_blocks (K,), omega (n,), P (d, d), gamma); 0 ≤ w_1 ≤ … ≤ w_K = 1.
    """
    return _block_optimum(Sigma, R, r, sigma2, block_sizes, monotone=True)


def vector_gating_optimum(Sigma, R, r, sigma2, block_sizes) -> GatingOptimum:
    """L*_GLA-v: min of (37) over P and any real block-constant ω (Thm 5; needs K ≤ p).

    Under the multitask model samples in a block are exchangeable, so this equals L*_WPGD.

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
        block_sizes: (K,) task-block lengths, summing to n.
    Returns:
        GatingOptimum(risk, omega_blocks (K,), omega (n,), P (d, d), gamma); max_k |w_k| = 1.
    """
    return _block_optimum(Sigma, R, r, sigma2, block_sizes, monotone=False)


def assumption3_holds(task_R, task_r, tol=1e-12):
    """Assumption 3: E[β_iᵀβ_j] = 0 for i ≠ j and E[β_iᵀβ] ≤ E[β_jᵀβ] for i < j (typo fixed).

    Args:
        task_R: (K, K) task-level correlations E[β_iᵀβ_j]/d.
        task_r: (K,) task-query correlations E[β_kᵀβ]/d.
        tol: absolute tolerance of both conditions.
    Returns:
        bool.
    """
    task_R, task_r = np.asarray(task_R, dtype=float), np.asarray(task_r, dtype=float)
    off = task_R - np.diag(np.diag(task_R))
    return bool(np.all(np.abs(off) <= tol) and np.all(np.diff(task_r) >= -tol))


# ------------------------------------------------------------------ correlated multitask data model


def multitask_correlation(block_sizes, task_R, task_r):
    """Sample-level (R, r) of a K-task prompt (Sec 5.1): R = B R_task Bᵀ, r = B r_task.

    Block k holds n_k samples of task β_k; task_R = E[β_iᵀβ_j]/d (unit diagonal),
    task_r = E[β_kᵀβ]/d. Checks the shapes only: that [[task_R, task_r], [task_rᵀ, 1]] is a correlation
    matrix is the data model's condition (``iclab.tasks.multitask.joint_task_correlation``).

    Args:
        block_sizes: (K,) block lengths; task_R: (K, K); task_r: (K,).
    Returns:
        (R (n, n), r (n,)).
    """
    B = block_indicator(block_sizes)
    task_R, task_r = np.asarray(task_R, dtype=float), np.asarray(task_r, dtype=float)
    K = B.shape[1]
    if task_R.shape != (K, K):
        raise ValueError(f"task_R must have shape ({K}, {K}) for {K} blocks (got {task_R.shape})")
    if task_r.shape != (K,):
        raise ValueError(f"task_r must have shape ({K},) for {K} blocks (got {task_r.shape})")
    return B @ task_R @ B.T, B @ task_r


def two_task_correlation(n_bar, *, r1, r2):
    """(R, r) of the App B.1 experiment: K = 2 independent tasks with n̄ samples each (Sec 5.1).

    β₁, β₂ ~ N(0, I) independent and β ~ N(r₁β₁ + r₂β₂, (1 − r₁² − r₂²)I).

    Args:
        n_bar: samples per task (≥ 1); r1, r2: query correlations with r₁² + r₂² ≤ 1.
    Returns:
        (R (2n̄, 2n̄) = blockdiag(11ᵀ, 11ᵀ), r (2n̄,) = [r₁1; r₂1]).
    """
    if int(n_bar) != n_bar or n_bar < 1:
        raise ValueError(f"n_bar must be an integer >= 1 (got {n_bar})")
    if r1**2 + r2**2 > 1.0 + _CORR_TOL:
        raise ValueError(f"(r1, r2) must satisfy r1² + r2² <= 1 (got {r1**2 + r2**2:.6g})")
    return multitask_correlation([int(n_bar)] * 2, np.eye(2), np.array([r1, r2], dtype=float))


# ---------------------------------------------------------------------- numerical cross-check


class NumericalOptimum(NamedTuple):
    """Best of several BFGS runs on eq 37.

    Attributes:
        risk: the least risk found.
        P: (d, d) and omega: (n,) its minimiser.
        restart_risks: (n_restarts,) each restart's final risk.
    """

    risk: float
    P: np.ndarray
    omega: np.ndarray
    restart_risks: np.ndarray


@functools.partial(jax.jit, static_argnames=("monotone",))
def _flat_value_and_grad(theta, Sigma, R, r, sigma2, B, monotone):
    d = Sigma.shape[0]

    def f(th):
        v = th[d * d:]
        # u = v² ≥ 0 keeps the monotone cone without bounds, so plain BFGS applies.
        w = jnp.cumsum(v**2) if monotone else v
        return wpgd_risk(th[: d * d].reshape(d, d), B @ w, Sigma, R, r, sigma2)

    return jax.value_and_grad(f)(theta)


def wpgd_numerical_minimum(Sigma, R, r, sigma2, *, block_sizes=None, monotone=False,
                           n_restarts=8, seed=0, maxiter=5_000) -> NumericalOptimum:
    """Numerical global minimum of eq 37 over (P, ω) by BFGS with random restarts.

    Independent of the closed forms: only eq 37 and JAX autodiff are used. With block_sizes,
    ω = Bw (vector gating, Thm 5; block_sizes=[n] gives linear attention, ω ∝ 1); with
    monotone=True also 0 ≤ w_1 ≤ … ≤ w_K via w = cumsum(v²) (scalar gating, eq 22).

    Args:
        Sigma: (d, d); R: (n, n); r: (n,); sigma2: σ².
        block_sizes: optional (K,) block lengths; None means ω ∈ R^n free.
        monotone: constrain block weights to be non-decreasing and non-negative.
        n_restarts: number of random initialisations; seed: numpy seed.
        maxiter: BFGS iteration cap per restart.
    Returns:
        NumericalOptimum(risk, P, omega, restart_risks (n_restarts,)).
    """
    Sigma = jnp.asarray(Sigma, dtype=jnp.float64)
    R = jnp.asarray(R, dtype=jnp.float64)
    r = jnp.asarray(r, dtype=jnp.float64)
    d, n = Sigma.shape[0], r.shape[0]
    B = jnp.eye(n) if block_sizes is None else jnp.asarray(block_indicator(block_sizes))
    K = B.shape[1]
    if B.shape[0] != n:
        raise ValueError(f"block_sizes must sum to n = {n} (got {B.shape[0]})")
    rng = np.random.default_rng(seed)
    sig2 = jnp.float64(sigma2)

    def fun(theta):
        v, g = _flat_value_and_grad(jnp.asarray(theta), Sigma, R, r, sig2, B, monotone)
        return float(v), np.asarray(g, dtype=float)

    best, risks = None, []
    for _ in range(n_restarts):
        theta0 = np.concatenate([rng.normal(size=d * d) / d, rng.normal(size=K)])
        # BFGS stops on "precision loss" once the risk is flat to rounding: that is convergence here.
        res = optimize.minimize(fun, theta0, jac=True, method="BFGS",
                                options=dict(maxiter=maxiter, gtol=1e-11))
        risks.append(float(res.fun))
        if best is None or res.fun < best.fun:
            best = res
    th = best.x
    v = th[d * d:]
    w = np.cumsum(v**2) if monotone else v
    return NumericalOptimum(float(best.fun), th[: d * d].reshape(d, d), np.asarray(B) @ w, np.array(risks))


# ---------------------------------------------------------------------------------- helpers


def _xp(*args):
    # numpy for plain inputs keeps the root scans fast; jnp whenever JAX traces or holds a value.
    return jnp if any(isinstance(x, jax.Array) for x in args) else np


def _sqrtm_psd(A):
    A = np.asarray(A, dtype=float)
    w, V = np.linalg.eigh(0.5 * (A + A.T))
    # Clipping tiny negative eigenvalues keeps singular correlation matrices usable.
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T
