"""Closed-form theory of "Learning to Adapt: In-Context Learning Beyond Stationarity".

One-layer gated linear attention (GLA) with a single scalar forget factor λ,
S_i = λ S_{i-1} + v_i k_iᵀ, trained on linear-regression prompts whose task vector drifts
as an AR(1) process w_i = γ w_{i-1} + e_i (w_0 ~ N(0, σ_w² I), e_i ~ N(0, σ_e² I),
x_i ~ N(0, Λ), y_i = ⟨w_i, x_i⟩, no label noise). λ = 1 is linear attention (LA).
Equation numbers are the paper's. The paper's text is an OCR with garbled formulas: [R] marks a formula
reconstructed from it, [D] one derived here (both checked numerically in tests/theory/test_drift.py).

Conventions: ``lam`` is the forget factor λ, ``gamma`` the AR(1) coefficient γ,
``sigma_w2``/``sigma_e2`` the variances σ_w², σ_e², ``n`` the number of labelled context
pairs (the query is token n+1), ``Lam`` the input covariance Λ (d, d), ``Lam_t`` the matrix
Λ̃ = D2 (2Λ + tr(Λ) I) + D3 Λ of Lemma 3, ``U11``/``u_m1`` the restricted parameters
U_11 = W^KQ_11 and u_{-1} = w^V_{-1} of Lemma 2. Prompts are token-major,
``Z: (..., n+1, d+1)`` with rows z_i = (x_i, y_i) and z_{n+1} = (x_{n+1}, 0). A test setting
(Theorem 3) carries a bar: ``lam_bar``, ``gamma_bar``, ``sigma_w2_bar``, ``sigma_e2_bar`` and the test
length ``m``.

Signatures: the first positional arguments are what a function varies over (``lam``; the weights
``U11, u_m1``; prompts ``Z``); the setting follows keyword-only, always in the order
``gamma, sigma_w2, sigma_e2, n, Lam`` (task process) or ``D1, D4, Lam_t, Lam`` (its constants), so that
one dict of the setting serves every function and two floats are never swapped by position.

The ½ convention is in the names: an ``..._error`` is the mean squared error E[(ŷ − y_{n+1})²]
(Theorems 2 and 3, no ½); a ``half_...`` loss is the paper's L = ½ E[(ŷ − y_{n+1})²] (eq 12) or
its reduced form L̃ (eq 42), which carry the ½ because the gradient flow (Lemma 3,
``gradient_flow_field``) and the PL rate (Lemma 6, eq 54) are stated for them.

The D constants are computed from their defining finite sums (``D_sums``, the truth used by
every other function); ``D_closed_form`` gives the paper's case-split closed forms, which are
singular at the case boundaries and serve as checks.

The LMS / RLS baselines of Sec 5 are simulations; only the two adaptive filters are here
(``lms_predictions``, ``rls_predictions``). Paper settings: LMS step μ = 0.01, RLS forget factor
0.98, sequence length 1000, 10,000 Monte-Carlo trials, γ ∈ {0.8, 0.85, 0.925, 0.95, 0.975},
d = 10, σ_w² = 1, σ_e² = 0.01 (``PAPER_LMS_RLS``). UNSPECIFIED by the paper: the error
definition, ŵ_0 and the RLS P_0; our choice is the a-priori error near t = 1000, ŵ_0 = 0 and
P_0 = 100 I, which are the defaults here.

This module imports nothing from iclab's engines: every function here can be checked without
training anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import minimize_scalar

__all__ = [
    "PAPER_LMS_RLS", "D_closed_form", "D_sums", "Lam_tilde", "ar1_covariance", "ar1_variance", "assumption1_init",
    "flow_state", "forget_case", "gradient_flow_field", "gradient_flow_rhs", "half_population_loss",
    "half_reduced_loss", "half_reduced_loss_jax", "init_scale_bound", "lemma2_H", "lms_predictions",
    "min_half_reduced_loss", "optimal_forget_factor", "optimal_forget_factor_grid", "optimal_prediction",
    "optimal_restricted", "optimal_weights", "pl_constant", "rank_one_saddle_errors", "restricted_error",
    "restricted_prediction", "rls_predictions", "split_flow_state", "test_error", "test_error_printed", "train_error",
    "train_error_large_d", "train_error_printed", "u_lower_bound", "weights_to_U", "xi", "xi_case_I", "xi_case_II",
]

#: Reported LMS / RLS errors of Sec 5 (d = 10, σ_w² = 1, σ_e² = 0.01, μ = 0.01, RLS forget 0.98).
PAPER_LMS_RLS = {
    "gamma": (0.8, 0.85, 0.925, 0.95, 0.975),
    "lms": (0.2639, 0.3168, 0.6058, 1.0072, 1.4758),
    "rls": (0.2555, 0.3746, 0.6658, 0.8881, 1.2916),
}

# Case boundaries of the closed forms are detected to this relative tolerance.
_CASE_RTOL = 1e-12


def _check_setting(gamma, sigma_w2, sigma_e2, n, name="n"):
    if int(n) != n or n < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {n})")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (got {gamma})")
    if sigma_w2 < 0 or sigma_e2 < 0:
        raise ValueError(f"sigma_w2 and sigma_e2 must be >= 0 (got {sigma_w2}, {sigma_e2})")


def _check_lam(lam):
    lam = np.asarray(lam, dtype=float)
    if np.any(~(lam > 0)):
        raise ValueError(f"lam must be > 0 (got {lam})")
    return lam


# ---------------------------------------------------------------------------------------------
# Lemma 1: second moments of the AR(1) task process
# ---------------------------------------------------------------------------------------------


def ar1_variance(i, *, gamma, sigma_w2, sigma_e2):
    """Per-coordinate variance v_i of w_i (Lemma 1): v_i = γ^{2i} σ_w² + σ_e² Σ_{j<i} γ^{2j}.

    Equals γ^{2i}σ_w² + (1-γ^{2i}) σ_e²/(1-γ²) for γ ≠ 1 and σ_w² + i σ_e² for γ = 1; the
    geometric factor is evaluated as expm1(2i log γ)/expm1(2 log γ), accurate near γ = 1.

    Args:
        i: int or integer array of step indices (i >= 0; v_0 = σ_w²).
        gamma, sigma_w2, sigma_e2: AR(1) coefficient and variances.
    Returns:
        float or array shaped like ``i``.
    """
    i = np.asarray(i, dtype=float)
    if gamma == 1.0:
        geo = i
    else:
        lg = np.log(gamma)
        geo = np.expm1(2.0 * i * lg) / np.expm1(2.0 * lg)
    out = gamma ** (2.0 * i) * sigma_w2 + sigma_e2 * geo
    return float(out) if out.ndim == 0 else out


def ar1_covariance(*, gamma, sigma_w2, sigma_e2, n):
    """Covariance of w_1..w_{n+1} per coordinate (Lemma 1): c(a,b) = γ^{|a-b|} v_{min(a,b)}.

    E[w_a w_bᵀ] = c(a, b) I_d.

    Args:
        gamma, sigma_w2, sigma_e2: AR(1) coefficient and variances.
        n: context length (the matrix covers steps 1..n+1).
    Returns:
        (n+1, n+1) numpy array; entry [a-1, b-1] is c(a, b).
    """
    idx = np.arange(1, n + 2)
    a, b = np.meshgrid(idx, idx, indexing="ij")
    v = ar1_variance(np.minimum(a, b), gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2)
    return gamma ** np.abs(a - b).astype(float) * v


# ---------------------------------------------------------------------------------------------
# Lemma 3 / Theorem 4: the constants D1..D4 and Λ̃
# ---------------------------------------------------------------------------------------------


def D_sums(lam, *, gamma, sigma_w2, sigma_e2, n):
    """D1..D4 of Lemma 3 (eqs 31, 38-39) from their defining finite sums; the module's truth.

    D1 = Σ_{i≤n} λ^{n+1-i} c(n+1, i),   D2 = Σ_{a≤n} λ^{2(n+1-a)} c(a, a),
    D3 = Σ_{a≠b≤n} λ^{2n+2-a-b} c(a, b),   D4 = c(n+1, n+1) = v_{n+1},
    with c(a, b) the AR(1) covariance of Lemma 1. Valid for every λ > 0, γ > 0 (Theorem 4).

    Args:
        lam: forget factor λ > 0, scalar or array (broadcast).
        gamma, sigma_w2, sigma_e2, n: training task process and context length.
    Returns:
        (D1, D2, D3, D4); D1..D3 shaped like ``lam`` (floats for a scalar), D4 a float.
    """
    _check_setting(gamma, sigma_w2, sigma_e2, n)
    lam = _check_lam(lam)
    C = ar1_covariance(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    ell = lam[..., None] ** np.arange(n, 0, -1, dtype=float)  # λ^{n+1-i}, i = 1..n
    C_off = C[:n, :n] - np.diag(np.diag(C[:n, :n]))
    D1 = ell @ C[n, :n]
    D2 = (ell * ell) @ np.diag(C)[:n]
    D3 = np.einsum("...a,ab,...b->...", ell, C_off, ell)
    D4 = float(C[n, n])
    if lam.ndim == 0:
        return float(D1), float(D2), float(D3), D4
    return D1, D2, D3, D4


def _G(r, k):
    """Σ_{j=1}^k r^j for r ≠ 1."""
    return r * (1.0 - r**k) / (1.0 - r)


def _F(r, k):
    """Σ_{i=1}^k (k+1-i) r^i = r (k - (k+1) r + r^{k+1}) / (1-r)² for r ≠ 1."""
    return r * (k - (k + 1) * r + r ** (k + 1)) / (1.0 - r) ** 2


def forget_case(lam, *, gamma):
    """Which of the paper's six closed-form cases of the D constants (Lemma 3 / Theorem 4) (λ, γ) falls in.

    The cases are the singular sets λ = γ = 1, γ = 1, λ = 1, λ = γ and λγ = 1 of the closed forms
    (``D_closed_form``); equalities are tested to a relative tolerance of 1e-12.

    Args:
        lam: scalar forget factor λ.
        gamma: scalar AR(1) coefficient γ.
    Returns:
        One of ``"lam=gamma=1"``, ``"gamma=1"`` (λ ≠ 1), ``"lam=1"`` (γ ≠ 1), ``"lam=gamma"`` (≠ 1),
        ``"lam=1/gamma"`` (λ, γ ≠ 1) or ``"generic"``.
    """
    eq = lambda a, b: abs(a - b) <= _CASE_RTOL * max(abs(a), abs(b))  # noqa: E731
    l1, g1 = eq(lam, 1.0), eq(gamma, 1.0)
    if l1 and g1:
        return "lam=gamma=1"
    if g1:
        return "gamma=1"
    if l1:
        return "lam=1"
    if eq(lam, gamma):
        return "lam=gamma"
    if eq(lam * gamma, 1.0):
        return "lam=1/gamma"
    return "generic"


def D_closed_form(lam, *, gamma, sigma_w2, sigma_e2, n):
    """D1..D4 from the paper's case-split closed forms (Lemma 3, eqs 31, 38-39; Theorem 4).

    Cases (see ``forget_case``), with s = σ_e²/(1-γ²), G(r,k) = r(1-r^k)/(1-r) and
    F(r,k) = r(k-(k+1)r+r^{k+1})/(1-r)²:

    * generic: D1 = Aσ_w² + [λγ(1-λⁿγⁿ)/(1-λγ) - A] s, A = (λ^{n+1}γ^{n+2} - λγ^{2n+2})/(λ-γ);
      D2 = Pσ_w² + [λ²(1-λ^{2n})/(1-λ²) - P] s, P = (λ^{2n+2}γ² - λ²γ^{2n+2})/(λ²-γ²);
      D3 = Wσ_w² + (2T - W) s with p = γ/λ, W = λ^{2n+2}[(p(1-pⁿ)/(1-p))² - p²(1-p^{2n})/(1-p²)],
      T = λγ/(1-λγ)·[λ²(1-λ^{2n-2})/(1-λ²) - (λγ)ⁿ(λ/γ)(1-(λ/γ)^{n-1})/(1-λ/γ)];
      D4 = γ^{2n+2}σ_w² + (1-γ^{2n+2}) s.
    * λ = γ ≠ 1: D1 = D2 = nγ^{2n+2}σ_w² + [γ²(1-γ^{2n})/(1-γ²)² - nγ^{2n+2}/(1-γ²)]σ_e²;
      D3 = γ^{2n+2}n(n-1)σ_w² + [2(γ⁴-γ^{2n+2})/(1-γ²)² - 2(n-1)γ^{2n+2}/(1-γ²)
      - n(n-1)γ^{2n+2}] σ_e²/(1-γ²).
    * λ = γ = 1: D1 = D2 = nσ_w² + n(n+1)σ_e²/2; D3 = n(n-1)σ_w² + (n³-n)σ_e²/3;
      D4 = σ_w² + (n+1)σ_e².
    * λ = 1 ≠ γ: the generic D1; D2 = Pσ_w² + (n - P) s with P = (γ²-γ^{2n+2})/(1-γ²);
      D3 = Wσ_w² + (2T - W) s, W = G(γ,n)² - G(γ²,n), T = γ(n-1-nγ+γⁿ)/(1-γ)².
    * γ = 1 ≠ λ: D1 = G(λ,n)σ_w² + F(λ,n)σ_e²; D2 = G(λ²,n)σ_w² + F(λ²,n)σ_e²;
      D3 = [G(λ,n)² - G(λ²,n)]σ_w² + 2[λF(λ,n) - F(λ²,n)]σ_e²/(1-λ); D4 = σ_w² + (n+1)σ_e².
    * λ = 1/γ (Theorem 4 only, λ > 1 when γ < 1): D1 = Aσ_w² + (n - A) s; generic D2, W, D4;
      T = λ²[(n-1) - λ^{2n}G(γ², n-1)]/(1-λ²).

    The generic D1, D2, D4 and the λ = γ and λ = γ = 1 forms are the paper's (repaired OCR [R]).
    The printed D3 forms are unreadable: the generic D3 is an equivalent form derived here [D], the
    λ = γ D3 matches the legible part of the OCR, and the λ = 1, γ = 1 and λ = 1/γ forms are
    re-derived [D]; all are checked against ``D_sums``. The forms lose precision near case
    boundaries (cancellation of order eps/|λ-γ|); use ``D_sums`` for computation.

    Args:
        lam: scalar forget factor λ > 0.
        gamma, sigma_w2, sigma_e2, n: task process and context length.
    Returns:
        (D1, D2, D3, D4) as floats.
    """
    _check_setting(gamma, sigma_w2, sigma_e2, n)
    lam = float(_check_lam(lam))
    g, sw, se = float(gamma), float(sigma_w2), float(sigma_e2)
    case = forget_case(lam, gamma=g)
    if case == "lam=gamma=1":
        D1 = D2 = n * sw + n * (n + 1) / 2 * se
        D3 = n * (n - 1) * sw + (n**3 - n) / 3 * se
        return D1, D2, D3, sw + (n + 1) * se
    if case == "gamma=1":
        D1 = _G(lam, n) * sw + _F(lam, n) * se
        D2 = _G(lam**2, n) * sw + _F(lam**2, n) * se
        D3 = (_G(lam, n) ** 2 - _G(lam**2, n)) * sw + 2 * (lam * _F(lam, n) - _F(lam**2, n)) / (1 - lam) * se
        return D1, D2, D3, sw + (n + 1) * se
    s = se / (1 - g**2)
    D4 = g ** (2 * n + 2) * sw + (1 - g ** (2 * n + 2)) * s
    if case == "lam=gamma":
        g2n2 = g ** (2 * n + 2)
        D1 = n * g2n2 * sw + (g**2 * (1 - g ** (2 * n)) / (1 - g**2) ** 2 - n * g2n2 / (1 - g**2)) * se
        D3 = n * (n - 1) * g2n2 * sw + (
            2 * (g**4 - g2n2) / (1 - g**2) ** 2 - 2 * (n - 1) * g2n2 / (1 - g**2) - n * (n - 1) * g2n2
        ) * se / (1 - g**2)
        return D1, D1, D3, D4
    if case == "lam=1":
        A = (g ** (n + 2) - g ** (2 * n + 2)) / (1 - g)
        D1 = A * sw + (_G(g, n) - A) * s
        P = (g**2 - g ** (2 * n + 2)) / (1 - g**2)
        D2 = P * sw + (n - P) * s
        W = _G(g, n) ** 2 - _G(g**2, n)
        T = g * (n - 1 - n * g + g**n) / (1 - g) ** 2
        return D1, D2, W * sw + (2 * T - W) * s, D4
    # generic and λ = 1/γ share A, P, W.
    A = (lam ** (n + 1) * g ** (n + 2) - lam * g ** (2 * n + 2)) / (lam - g)
    P = (lam ** (2 * n + 2) * g**2 - lam**2 * g ** (2 * n + 2)) / (lam**2 - g**2)
    p = g / lam
    W = lam ** (2 * n + 2) * ((p * (1 - p**n) / (1 - p)) ** 2 - p**2 * (1 - p ** (2 * n)) / (1 - p**2))
    D2 = P * sw + (lam**2 * (1 - lam ** (2 * n)) / (1 - lam**2) - P) * s
    if case == "lam=1/gamma":
        D1 = A * sw + (n - A) * s
        T = lam**2 * ((n - 1) - lam ** (2 * n) * _G(g**2, n - 1)) / (1 - lam**2)
        return D1, D2, W * sw + (2 * T - W) * s, D4
    lg = lam * g
    D1 = A * sw + (lg * (1 - lg**n) / ((1 - g**2) * (1 - lg)) - A / (1 - g**2)) * se
    q = lam / g
    T = lg / (1 - lg) * (lam**2 * (1 - lam ** (2 * n - 2)) / (1 - lam**2) - lg**n * q * (1 - q ** (n - 1)) / (1 - q))
    return D1, D2, W * sw + (2 * T - W) * s, D4


def Lam_tilde(Lam, *, D2, D3):
    """Λ̃ = D2 (2Λ + tr(Λ) I) + D3 Λ (Lemma 3, eq 39).

    Args:
        Lam: (d, d) input covariance Λ.
        D2, D3: scalars from ``D_sums``.
    Returns:
        (d, d) numpy array Λ̃ (symmetric, commutes with Λ).
    """
    Lam = np.asarray(Lam, dtype=float)
    d = Lam.shape[0]
    return D2 * (2.0 * Lam + np.trace(Lam) * np.eye(d)) + D3 * Lam


# ---------------------------------------------------------------------------------------------
# Lemma 2: the prediction as a quadratic form
# ---------------------------------------------------------------------------------------------


def _state(Z, lam):
    """S = Σ_{i=1}^{n+1} λ^{n+1-i} z_i z_iᵀ for Z (..., n+1, d+1)."""
    Z = np.asarray(Z, dtype=float)
    T = Z.shape[-2]
    ell = lam ** np.arange(T - 1, -1, -1, dtype=float)
    return np.einsum("t,...ti,...tj->...ij", ell, Z, Z)


def weights_to_U(W_V, W_KQ):
    """U of Lemma 2 from the merged weights: U = [[W^KQ_11, w^V_21], [w^KQ_21ᵀ, w^V_{-1}]].

    Args:
        W_V, W_KQ: (d+1, d+1) value matrix and W^KQ = W_Kᵀ W_Q.
    Returns:
        (d+1, d+1) numpy array U (U11 = U[:d, :d], u12 = U[:d, d], u21 = U[d, :d], u_{-1} = U[d, d]).
    """
    W_V, W_KQ = np.asarray(W_V, dtype=float), np.asarray(W_KQ, dtype=float)
    d = W_V.shape[0] - 1
    U = np.empty_like(W_V)
    U[:d, :d] = W_KQ[:d, :d]
    U[:d, d] = W_V[d, :d]
    U[d, :d] = W_KQ[d, :d]
    U[d, d] = W_V[d, d]
    return U


def restricted_prediction(U, Z, lam):
    """GLA readout in the restricted form of eqs 8-9: ŷ = [u12ᵀ, u_{-1}] S [U11; u21ᵀ] x_{n+1}.

    S = Σ_{i=1}^{n+1} λ^{n+1-i} z_i z_iᵀ includes the query token (label slot 0). Equal to the
    eq 7 readout o_{n+1}(d+1) of the GLA layer for any W_V, W_KQ mapped by ``weights_to_U``.

    Args:
        U: (d+1, d+1) Lemma-2 parameter matrix.
        Z: (..., n+1, d+1) prompts.
        lam: forget factor λ.
    Returns:
        (...) predictions ŷ_{n+1}.
    """
    U = np.asarray(U, dtype=float)
    d = U.shape[0] - 1
    S = _state(Z, lam)
    xq = np.asarray(Z)[..., -1, :d]
    return np.einsum("i,...ij,jk,...k->...", U[:, d], S, U[:, :d], xq)


def lemma2_H(Z, lam):
    """H = ½ X ⊗ Σ_{i=1}^{n+1} λ^{n+1-i} z_i z_iᵀ with X = [[0, x_{n+1}], [x_{n+1}ᵀ, 0]] (Lemma 2).

    ŷ = uᵀ H u with u = vec(U) column-major (``U.reshape(-1, order="F")``).

    Args:
        Z: (..., n+1, d+1) prompts.
        lam: forget factor λ.
    Returns:
        (..., (d+1)², (d+1)²) numpy array H.
    """
    Z = np.asarray(Z, dtype=float)
    d = Z.shape[-1] - 1
    xq = Z[..., -1, :d]
    X = np.zeros(Z.shape[:-2] + (d + 1, d + 1))
    X[..., :d, d] = xq
    X[..., d, :d] = xq
    S = _state(Z, lam)
    H = 0.5 * np.einsum("...ij,...kl->...ikjl", X, S)
    return H.reshape(Z.shape[:-2] + ((d + 1) ** 2, (d + 1) ** 2))


# ---------------------------------------------------------------------------------------------
# Lemma 3-6, Corollary 1: gradient flow, reduced loss, PL constants
# ---------------------------------------------------------------------------------------------


def assumption1_init(Theta, sigma):
    """Restricted initial point of Assumption 1 (eq 13): U11(0) = σ ΘΘᵀ, u_{-1}(0) = σ.

    Args:
        Theta: (d, d) with ‖ΘΘᵀ‖_F = 1 and ΛΘ ≠ 0.
        sigma: initial scale σ > 0.
    Returns:
        (U11 (d, d), u_m1 float).
    """
    Theta = np.asarray(Theta, dtype=float)
    nrm = np.linalg.norm(Theta @ Theta.T)
    if abs(nrm - 1.0) > 1e-10:
        raise ValueError(f"Theta must have ||Theta Theta^T||_F = 1 (got {nrm})")
    return sigma * Theta @ Theta.T, float(sigma)


def gradient_flow_field(U11, u_m1, *, D1, Lam_t, Lam):
    """Right-hand side of the restricted gradient flow (Lemma 3, eqs 26-27 / 39, 41).

    dU11/dt = -u_{-1}² Λ̃ Λ U11 Λ + D1 u_{-1} Λ²,
    du_{-1}/dt = -u_{-1} tr(Λ̃ Λ U11 Λ U11ᵀ) + D1 tr(Λ² U11ᵀ);
    the negative gradient of the reduced loss L̃ (``half_reduced_loss``, which carries the paper's ½).

    Args:
        U11: (d, d) U_11; u_m1: scalar u_{-1}.
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        (dU11 (d, d), du_m1 float).
    """
    M = Lam_t @ Lam
    dU = -(u_m1**2) * M @ U11 @ Lam + D1 * u_m1 * Lam @ Lam
    du = -u_m1 * np.trace(M @ U11 @ Lam @ U11.T) + D1 * np.trace(Lam @ Lam @ U11.T)
    return dU, float(du)


def flow_state(U11, u_m1):
    """Pack (U11, u_{-1}) into the flat state y = (vec_row(U11), u_{-1}) used by ``gradient_flow_rhs``.

    Args:
        U11: (d, d) U_11; u_m1: scalar u_{-1}.
    Returns:
        (d² + 1,) numpy array.
    """
    return np.concatenate([np.asarray(U11, dtype=float).ravel(), [float(u_m1)]])


def split_flow_state(y):
    """Inverse of ``flow_state``: y = (vec_row(U11), u_{-1}) -> (U11, u_{-1}).

    Args:
        y: (d²+1,) flat state.
    Returns:
        (U11 (d, d), u_m1 float).
    """
    y = np.asarray(y, dtype=float)
    d = int(round(np.sqrt(y.size - 1)))
    return y[:-1].reshape(d, d), float(y[-1])


def gradient_flow_rhs(*, D1, Lam_t, Lam):
    """Lemma 3 (eqs 26-27) as f(t, y) on the flat state of ``flow_state``, for scipy's solve_ivp.

    Args:
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        callable f(t, y) -> (d²+1,) array.
    """
    Lam_t, Lam = np.asarray(Lam_t, dtype=float), np.asarray(Lam, dtype=float)

    def f(t, y):
        U11, u = split_flow_state(y)
        dU, du = gradient_flow_field(U11, u, D1=D1, Lam_t=Lam_t, Lam=Lam)
        return flow_state(dU, du)

    return f


def half_reduced_loss(U11, u_m1, *, D1, Lam_t, Lam):
    """Reduced loss L̃ (Lemma 4, eq 42): ½ u_{-1}² tr(Λ̃ Λ U11 Λ U11ᵀ) - D1 u_{-1} tr(Λ² U11ᵀ).

    L̃ = L − ½ D4 tr Λ, with L = ½ E[(ŷ − y_{n+1})²] the population loss of eq 12 at u12 = u21 = 0: it
    carries the paper's ½ (hence the name), and so does its minimum ``min_half_reduced_loss``.

    Args:
        U11: (d, d) U_11; u_m1: scalar u_{-1}.
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        float.
    """
    U11 = np.asarray(U11, dtype=float)
    return float(
        0.5 * u_m1**2 * np.trace(Lam_t @ Lam @ U11 @ Lam @ U11.T) - D1 * u_m1 * np.trace(Lam @ Lam @ U11.T)
    )


def half_reduced_loss_jax(U11, u_m1, *, D1, Lam_t, Lam):
    """``half_reduced_loss`` (eq 42, with the paper's ½) in jax.numpy: traceable and differentiable.

    L̃ = ½ u_{-1}² tr(Λ̃ Λ U11 Λ U11ᵀ) − D1 u_{-1} tr(Λ² U11ᵀ); its gradient flow is Lemma 3's
    (``gradient_flow_field``), which the population engine integrates.

    Args:
        U11: (d, d) U_11; u_m1: scalar u_{-1} (jax or numpy).
        D1: scalar; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ (jax or numpy arrays).
    Returns:
        scalar jax array.
    """
    return 0.5 * u_m1**2 * jnp.trace(Lam_t @ Lam @ U11 @ Lam @ U11.T) - D1 * u_m1 * jnp.trace(Lam @ Lam @ U11.T)


def half_population_loss(U11, u_m1, *, D1, D4, Lam_t, Lam):
    """Population loss of eq 12 WITH its ½, L = ½ E[(ŷ − y_{n+1})²], at u12 = u21 = 0: L̃ + ½ D4 tr Λ.

    Twice this is the error ``restricted_error`` at the training setting.

    Args:
        U11: (d, d) U_11; u_m1: scalar u_{-1}.
        D1, D4: scalars from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        float.
    """
    return half_reduced_loss(U11, u_m1, D1=D1, Lam_t=Lam_t, Lam=Lam) + 0.5 * D4 * float(np.trace(Lam))


def restricted_error(U11, u_m1, *, lam, gamma, sigma_w2, sigma_e2, n, Lam):
    """Exact error E[(ŷ - y_{n+1})²] of ANY restricted model ŷ = u_{-1} Gᵀ U11 x_{n+1} on prompts of a setting.

    G = Σ_{i≤n} λ^{n+1-i} y_i x_i; from E[G Gᵀ] = Λ̃ Λ and E[G w_{n+1}ᵀ] = D1 Λ (Lemma 3) with the D's
    and Λ̃ of the prompts' own setting (λ, γ, σ_w², σ_e², n),

        E = u_{-1}² tr(Λ̃ Λ U11 Λ U11ᵀ) - 2 D1 u_{-1} tr(Λ² U11ᵀ) + D4 tr Λ = 2 L (eq 12, eq 42).

    An error (no ½): at the training setting this is twice ``half_population_loss``; at Theorem 1's
    weights it is Theorem 2 (training setting) or Theorem 3 (a test setting with λ̄, γ̄, σ̄_w², σ̄_e², m,
    passed here as lam, gamma, sigma_w2, sigma_e2, n). It lets a trained restricted model be evaluated
    without Monte Carlo.

    Args:
        U11: (..., d, d); u_m1: (...) (any leading shape, broadcast).
        lam: forget factor used on these prompts (λ, or the test-time λ̄), scalar.
        gamma, sigma_w2, sigma_e2, n: the prompts' task process and context length.
        Lam: (d, d) input covariance.
    Returns:
        (...) array (a float for unbatched weights).
    """
    D1, D2, D3, D4 = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    Lam = np.asarray(Lam, dtype=float)
    Lt = Lam_tilde(Lam, D2=D2, D3=D3)
    U11, u = np.asarray(U11, dtype=float), np.asarray(u_m1, dtype=float)
    quad = np.einsum("ij,...jk,kl,...il->...", Lt @ Lam, U11, Lam, U11)  # tr(Λ̃Λ U Λ Uᵀ)
    lin = np.einsum("ij,...ij->...", Lam @ Lam, U11)
    E = u**2 * quad - 2 * D1 * u * lin + D4 * np.trace(Lam)
    return float(E) if E.ndim == 0 else E


def min_half_reduced_loss(*, D1, Lam_t, Lam):
    """Minimum of the reduced loss L̃ (Corollary 1, eq 43), with the paper's ½: −½ D1² tr(Λ² Λ̃⁻¹).

    Args:
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        float.
    """
    Lam = np.asarray(Lam, dtype=float)
    return float(-0.5 * D1**2 * np.trace(Lam @ Lam @ np.linalg.inv(Lam_t)))


def init_scale_bound(*, D1, Lam_t):
    """Largest initial scale of Lemma 6 (eq 49): σ < √(2 D1 / (√d ‖Λ̃‖₂)).

    Constants reconstructed from garbled OCR [R]; ‖Λ̃‖ is read as the spectral norm.

    Args:
        D1: scalar; Lam_t: (d, d) Λ̃.
    Returns:
        float bound on σ.
    """
    Lam_t = np.asarray(Lam_t, dtype=float)
    d = Lam_t.shape[0]
    return float(np.sqrt(2.0 * D1 / (np.sqrt(d) * np.linalg.norm(Lam_t, 2))))


def u_lower_bound(sigma, Theta, *, D1, Lam_t, Lam):
    """Lower bound on u_{-1}(t) along the flow (Lemma 6, eq 50) [R, constants uncertain].

    u_{-1}(t) ≥ √(σ² ‖ΛΘ‖_F² (2D1 - √d σ² ‖Λ̃‖₂) / (2 D1 √d ‖Λ̃‖₂)).

    Args:
        sigma: initial scale σ of Assumption 1; Theta: (d, d) Θ.
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        float.
    """
    Lam, Lam_t = np.asarray(Lam, dtype=float), np.asarray(Lam_t, dtype=float)
    d = Lam.shape[0]
    nt = np.linalg.norm(Lam_t, 2)
    lt = np.linalg.norm(Lam @ np.asarray(Theta, dtype=float)) ** 2
    return float(np.sqrt(sigma**2 * lt * (2 * D1 - np.sqrt(d) * sigma**2 * nt) / (2 * D1 * np.sqrt(d) * nt)))


def pl_constant(sigma, Theta, *, D1, Lam_t, Lam):
    """PL constant α of eq 54 [R, constants uncertain]: L̃(t) - L̃* ≤ e^{-αt} (L̃(0) - L̃*).

    α = σ² ‖ΛΘ‖_F² (2D1 - √d σ² ‖Λ̃‖₂) / (D1 √d ‖Λ̃‖₂ tr(Λ⁻¹Λ̃⁻¹) tr(Λ⁻¹)).

    Args:
        sigma: initial scale σ of Assumption 1; Theta: (d, d) Θ.
        D1: scalar from ``D_sums``; Lam_t: (d, d) Λ̃; Lam: (d, d) Λ.
    Returns:
        float α (for L̃, which carries the paper's ½).
    """
    Lam, Lam_t = np.asarray(Lam, dtype=float), np.asarray(Lam_t, dtype=float)
    d = Lam.shape[0]
    nt = np.linalg.norm(Lam_t, 2)
    lt = np.linalg.norm(Lam @ np.asarray(Theta, dtype=float)) ** 2
    Li = np.linalg.inv(Lam)
    den = D1 * np.sqrt(d) * nt * np.trace(Li @ np.linalg.inv(Lam_t)) * np.trace(Li)
    return float(sigma**2 * lt * (2 * D1 - np.sqrt(d) * sigma**2 * nt) / den)


# ---------------------------------------------------------------------------------------------
# Theorem 1: the optimum
# ---------------------------------------------------------------------------------------------


def optimal_restricted(*, D1, Lam_t):
    """Limit of the flow from Assumption 1 (eqs 46, 57): U11 = √(D1/‖Λ̃⁻¹‖_F) Λ̃⁻¹, u_{-1} = √(D1 ‖Λ̃⁻¹‖_F).

    So u_{-1} U11 = D1 Λ̃⁻¹ (eq 46) and u_{-1}² = ‖U11‖_F² (Lemma 5).

    Args:
        D1: scalar; Lam_t: (d, d) Λ̃.
    Returns:
        (U11 (d, d), u_m1 float).
    """
    inv = np.linalg.inv(np.asarray(Lam_t, dtype=float))
    f = np.linalg.norm(inv)
    return np.sqrt(D1 / f) * inv, float(np.sqrt(D1 * f))


def optimal_weights(*, D1, Lam_t):
    """Theorem 1 (eq 14) weights: W^V = √(D1‖Λ̃⁻¹‖_F) e e ᵀ, W^KQ = √(D1/‖Λ̃⁻¹‖_F) [[Λ̃⁻¹, 0], [0, 0]].

    e is the last basis vector of R^{d+1}.

    Args:
        D1: scalar; Lam_t: (d, d) Λ̃.
    Returns:
        (W_V (d+1, d+1), W_KQ (d+1, d+1)).
    """
    U11, u = optimal_restricted(D1=D1, Lam_t=Lam_t)
    d = U11.shape[0]
    W_V = np.zeros((d + 1, d + 1))
    W_V[d, d] = u
    W_KQ = np.zeros((d + 1, d + 1))
    W_KQ[:d, :d] = U11
    return W_V, W_KQ


def optimal_prediction(Z, lam, *, D1, Lam_t):
    """Prediction of the trained model (eq 15; eq 18 at test): ŷ = D1 Σ_{i≤n} λ^{n+1-i} y_i x_iᵀ Λ̃⁻¹ x_{n+1}.

    Args:
        Z: (..., n+1, d+1) prompts (the query's label slot is ignored).
        lam: forget factor (λ, or the test-time λ̄).
        D1: training D1; Lam_t: (d, d) training Λ̃.
    Returns:
        (...) predictions.
    """
    Z = np.asarray(Z, dtype=float)
    n = Z.shape[-2] - 1
    ell = lam ** np.arange(n, 0, -1, dtype=float)
    G = np.einsum("t,...t,...ti->...i", ell, Z[..., :n, -1], Z[..., :n, :-1])
    return D1 * np.einsum("...i,ij,...j->...", G, np.linalg.inv(Lam_t), Z[..., -1, :-1])


# ---------------------------------------------------------------------------------------------
# Theorems 2 and 3: train and test error
# ---------------------------------------------------------------------------------------------


def _eig(Lam):
    """Eigenvalues of Λ; a 1-D ``Lam`` is taken to be the eigenvalues already (cheap at large d)."""
    Lam = np.asarray(Lam, dtype=float)
    if Lam.ndim == 1:
        mu = Lam.copy()
    elif Lam.ndim == 2 and Lam.shape[0] == Lam.shape[1]:
        mu = np.linalg.eigvalsh(Lam)
    else:
        raise ValueError(f"Lam must be a (d, d) matrix or a (d,) eigenvalue vector (got shape {Lam.shape})")
    if np.any(mu <= 0):
        raise ValueError("Lam must be positive definite")
    return mu


def train_error(lam, *, gamma, sigma_w2, sigma_e2, n, Lam):
    """Train error E[(ŷ_{n+1} - y_{n+1})²] at the optimum (Theorem 2, simplified eq 16).

    E = D4 tr Λ - D1² tr(Λ² Λ̃⁻¹) = Σ_k [D4 μ_k - D1² μ_k² / (D2 (2μ_k + tr Λ) + D3 μ_k)],
    μ_k the eigenvalues of Λ. For Λ = I: d D4 - d D1² / ((d+2) D2 + D3).

    Args:
        lam: forget factor λ > 0, scalar or array.
        gamma, sigma_w2, sigma_e2, n: training task process and context length.
        Lam: (d, d) input covariance, or (d,) its eigenvalues.
    Returns:
        float or array shaped like ``lam``.
    """
    mu = _eig(Lam)
    D1, D2, D3, D4 = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    D1, D2, D3 = (np.asarray(v)[..., None] for v in (D1, D2, D3))
    E = D4 * mu.sum() - np.sum(D1**2 * mu**2 / (D2 * (2 * mu + mu.sum()) + D3 * mu), axis=-1)
    return float(E) if E.ndim == 0 else E


def rank_one_saddle_errors(lam, *, gamma, sigma_w2, sigma_e2, n, Lam):
    """Train errors at the rank-one stationary points of the full-weight GLA loss, one per eigenvector of Λ.

    With every weight of eq 8 trainable (Lemma 2's U = [[U11, u12], [u21ᵀ, u_{-1}]]), the prediction is
    ŷ = u12ᵀ S_xx U11 x + (u12·G)(u21·x) + u_{-1} Gᵀ U11 x + u_{-1} S_yy (u21·x), x = x_{n+1}, S the
    λ-weighted state. At u_{-1} = 0, U11 = 0 the gradients of u_{-1} and U11 vanish (every term is
    odd in the task vectors), so the second route alone, ŷ = Gᵀ (u12 u21ᵀ) x, is a stationary point:
    the predictor of Theorem 1 with a rank-one U. Along an eigenvector e_k of Λ (eigenvalue μ_k), with
    its best scale u12 u21ᵀ = (D1/Λ̃_k) e_k e_kᵀ, it keeps the k-th term of Theorem 2's gain only:

        E_k = D4 tr Λ - D1² μ_k² / Λ̃_k,   Λ̃_k = D2 (2μ_k + tr Λ) + D3 μ_k.

    For Λ = I every k gives d D4 - D1² / ((d+2) D2 + D3): one of Theorem 2's d equal gains. Leaving
    the point needs u_{-1} and U11 to grow together (a second-order escape). (Derived here; not in the paper.)

    Args:
        lam: forget factor λ > 0, scalar or array; gamma, sigma_w2, sigma_e2, n: training setting.
        Lam: (d, d) input covariance, or (d,) its eigenvalues.
    Returns:
        (..., d) errors E_k, one per eigenvalue of Λ (in ``_eig``'s order), for ``lam`` of shape (...).
    """
    mu = _eig(Lam)
    D = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    D1, D2, D3, D4 = (np.asarray(v)[..., None] for v in D)
    return D4 * mu.sum() - D1**2 * mu**2 / (D2 * (2 * mu + mu.sum()) + D3 * mu)


def train_error_printed(lam, *, gamma, sigma_w2, sigma_e2, n, Lam):
    """Train error in the form printed as eq 16 (Theorem 2), evaluated literally with matrices.

    D1² tr(D2 (Λ tr(Λ̃⁻¹ΛΛ̃⁻¹Λ) + 2ΛΛ̃⁻¹ΛΛ̃⁻¹Λ) + D3 ΛΛ̃⁻¹ΛΛ̃⁻¹Λ) + D4 tr Λ - 2 D1² tr(ΛΛ̃⁻¹Λ).

    Args:
        lam: scalar λ; gamma, sigma_w2, sigma_e2, n: training setting; Lam: (d, d).
    Returns:
        float.
    """
    D = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    return _printed_error(D[0], D[1:3], D[0], D[1], D[2], D[3], Lam)


def _printed_error(D1, D23_train, D1b, D2b, D3b, D4b, Lam):
    Lam = np.asarray(Lam, dtype=float)
    Lt = Lam_tilde(Lam, D2=D23_train[0], D3=D23_train[1])
    Li = np.linalg.inv(Lt)
    B = Lam @ Li @ Lam @ Li @ Lam
    inner = D2b * (Lam * np.trace(Li @ Lam @ Li @ Lam) + 2 * B) + D3b * B
    return float(D1**2 * np.trace(inner) + D4b * np.trace(Lam) - 2 * D1 * D1b * np.trace(Lam @ Li @ Lam))


def test_error(lam, *, gamma, sigma_w2, sigma_e2, n, Lam, lam_bar, gamma_bar, sigma_w2_bar, sigma_e2_bar, m):
    """Test error E[(ŷ_{m+1} − y_{m+1})²] of the trained model on a shifted prompt (Theorem 3, eq 19), eigen form.

    E = Σ_k [D̄4 μ_k + μ_k² (D1² Λ̄̃_k / Λ̃_k² − 2 D1 D̄1 / Λ̃_k)], with Λ̃_k = D2(2μ_k + trΛ) + D3 μ_k
    from TRAINING (λ, γ, σ_w², σ_e², n) and D̄1..D̄4, Λ̄̃_k the same formulas at the TEST setting
    (λ̄, γ̄, σ̄_w², σ̄_e², m); μ_k are the eigenvalues of Λ, which test inputs share. Every test argument is
    required: the test setting is never filled in from the training one (pass the training values to
    test at them; then this is Theorem 2, ``train_error``). The OCR's leading coefficient "Di" is read as
    D1² [R, Monte-Carlo verified; the reading D1 is rejected by the tests].

    Args:
        lam: training forget factor λ (scalar).
        gamma, sigma_w2, sigma_e2, n: training task process and context length.
        Lam: (d, d) input covariance or (d,) its eigenvalues.
        lam_bar: test-time forget factor λ̄, scalar or array.
        gamma_bar, sigma_w2_bar, sigma_e2_bar, m: test task process γ̄, σ̄_w², σ̄_e² and test context length m.
    Returns:
        float or array shaped like ``lam_bar``.
    """
    mu = _eig(Lam)
    tr = mu.sum()
    D1, D2, D3, _ = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    Db1, Db2, Db3, Db4 = D_sums(lam_bar, gamma=gamma_bar, sigma_w2=sigma_w2_bar, sigma_e2=sigma_e2_bar, n=m)
    Db1, Db2, Db3 = (np.asarray(v)[..., None] for v in (Db1, Db2, Db3))
    Lt = D2 * (2 * mu + tr) + D3 * mu
    Ltb = Db2 * (2 * mu + tr) + Db3 * mu
    E = Db4 * tr + np.sum(mu**2 * (D1**2 * Ltb / Lt**2 - 2 * D1 * Db1 / Lt), axis=-1)
    return float(E) if E.ndim == 0 else E


def test_error_printed(lam, *, gamma, sigma_w2, sigma_e2, n, Lam, lam_bar, gamma_bar, sigma_w2_bar, sigma_e2_bar, m):
    """Test error in the form printed as eq 19 (Theorem 3), evaluated literally with matrices.

    D1² tr(D̄2 (Λ tr(Λ̃⁻¹ΛΛ̃⁻¹Λ) + 2ΛΛ̃⁻¹ΛΛ̃⁻¹Λ) + D̄3 ΛΛ̃⁻¹ΛΛ̃⁻¹Λ) + D̄4 tr Λ − 2 D1 D̄1 tr(ΛΛ̃⁻¹Λ),
    Λ̃ and D1 from training, D̄ from the test setting. The OCR's leading "Di" is read as D1² [R].

    Args:
        lam: training forget factor λ (scalar).
        gamma, sigma_w2, sigma_e2, n: training task process and context length.
        Lam: (d, d) input covariance.
        lam_bar: test-time forget factor λ̄ (scalar).
        gamma_bar, sigma_w2_bar, sigma_e2_bar, m: test task process and test context length, all required.
    Returns:
        float.
    """
    D1, D2, D3, _ = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    Db = D_sums(lam_bar, gamma=gamma_bar, sigma_w2=sigma_w2_bar, sigma_e2=sigma_e2_bar, n=m)
    return _printed_error(D1, (D2, D3), *Db, Lam)


def xi(lam, *, gamma, sigma_w2, sigma_e2, n):
    """ξ(λ) = D1²/D2, the λ-dependent part of the large-d train error d D4 - ξ (Sec 4, Λ = I).

    Maximised exactly at λ = γ (Cauchy-Schwarz on the sums; D1 = D2 there), where ξ(γ) = D2(γ).
    ξ is the "inverse U" of the paper's wording; the train error d D4 - ξ is U-shaped in λ.

    Args:
        lam: scalar or array; gamma, sigma_w2, sigma_e2, n: training setting.
    Returns:
        float or array shaped like ``lam``.
    """
    D1, D2, _, _ = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    return D1**2 / D2


def xi_case_I(lam, *, gamma, sigma_w2, n):
    """Case I (σ_e ≪ σ_w) approximation of ξ: γ^{2n+2}(λ+γ)(λⁿ-γⁿ)/((λ-γ)(λⁿ+γⁿ)) σ_w² [R].

    Exact when σ_e² = 0; the λ = γ limit nγ^{2n+2}σ_w² is used there.

    Args:
        lam: scalar or array (λ > 0); gamma, sigma_w2, n: setting.
    Returns:
        float or array shaped like ``lam``.
    """
    lam = np.asarray(lam, dtype=float)
    at = np.abs(lam - gamma) <= _CASE_RTOL * np.maximum(lam, gamma)
    ls = np.where(at, gamma + 1.0, lam)
    out = gamma ** (2 * n + 2) * (ls + gamma) * (ls**n - gamma**n) / ((ls - gamma) * (ls**n + gamma**n)) * sigma_w2
    out = np.where(at, n * gamma ** (2 * n + 2) * sigma_w2, out)
    return float(out) if out.ndim == 0 else out


def xi_case_II(lam, *, gamma, sigma_e2):
    """Case II (large n) approximation of ξ: γ²(1-λ²)σ_e² / ((1-γ²)(1-λγ)²) [R]; the n → ∞ limit for λ, γ < 1.

    Args:
        lam: scalar or array in (0, 1); gamma in (0, 1); sigma_e2.
    Returns:
        float or array shaped like ``lam``.
    """
    lam = np.asarray(lam, dtype=float)
    out = gamma**2 * (1 - lam**2) * sigma_e2 / ((1 - gamma**2) * (1 - lam * gamma) ** 2)
    return float(out) if out.ndim == 0 else out


def train_error_large_d(lam, *, gamma, sigma_w2, sigma_e2, n, d):
    """Large-d approximation of the Λ = I train error (Sec 4): d D4 - ξ(λ), ξ = D1²/D2.

    Args:
        lam: scalar or array; gamma, sigma_w2, sigma_e2, n: setting; d: dimension.
    Returns:
        float or array shaped like ``lam``.
    """
    D1, D2, _, D4 = D_sums(lam, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    return d * D4 - D1**2 / D2


def optimal_forget_factor(*, gamma, sigma_w2, sigma_e2, n, Lam, bounds=(1e-3, 1.0), xatol=1e-10):
    """λ* = argmin_λ of the Theorem 2 train error, by bounded scalar minimisation.

    A 201-point grid over ``bounds`` locates the basin; scipy's bounded Brent method then refines
    inside the neighbouring grid cells to ``xatol``.

    Args:
        gamma, sigma_w2, sigma_e2, n: training setting; Lam: (d, d) input covariance or (d,)
            its eigenvalues.
        bounds: (lo, hi) search interval for λ (Theorem 1: λ ≤ 1; Theorem 4 allows λ > 1).
        xatol: absolute tolerance on λ*.
    Returns:
        (lam_star float, err float) with err = train_error(lam_star, ...).
    """
    setting = dict(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n, Lam=Lam)
    return _grid_then_brent(lambda l: train_error(l, **setting), bounds, xatol)


def _grid_then_brent(f, bounds, xatol):
    """(argmin, min) of f over [lo, hi]: the best of a 201-point grid (f vectorised over λ), then bounded Brent
    inside its neighbouring cells; the cell ends are candidates too (the bounded method never evaluates them)."""
    lo, hi = bounds
    if not 0 < lo < hi:
        raise ValueError(f"bounds must satisfy 0 < lo < hi (got {bounds})")
    grid = np.linspace(lo, hi, 201)
    k = int(np.argmin(f(grid)))
    a, b = grid[max(k - 1, 0)], grid[min(k + 1, grid.size - 1)]
    res = minimize_scalar(f, bounds=(a, b), method="bounded", options={"xatol": xatol})
    err, lam_star = min([(float(res.fun), float(res.x)), (float(f(a)), float(a)), (float(f(b)), float(b))])
    return lam_star, err


def optimal_forget_factor_grid(lams, *, gamma, sigma_w2, sigma_e2, n, Lam):
    """Grid argmin of the Theorem 2 train error over the given λ values (the starred λ of Fig 1a).

    Args:
        lams: (K,) candidate forget factors.
        gamma, sigma_w2, sigma_e2, n: training setting; Lam: (d, d) or (d,) eigenvalues.
    Returns:
        (lam_star float, err float).
    """
    lams = np.asarray(lams, dtype=float).ravel()
    E = train_error(lams, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n, Lam=Lam)
    k = int(np.argmin(E))
    return float(lams[k]), float(E[k])


# ---------------------------------------------------------------------------------------------
# Sec 5: adaptive-filter baselines (the simulation itself lives in experiments)
# ---------------------------------------------------------------------------------------------


def lms_predictions(X, y, *, mu=0.01, w0=None):
    """A-priori LMS predictions ŷ_t = ŵ_{t-1}ᵀ x_t, ŵ_t = ŵ_{t-1} + μ x_t (y_t - ŷ_t) (Sec 5 baseline).

    Paper: μ = 0.01. ŵ_0 is UNSPECIFIED; default 0.

    Args:
        X: (..., T, d) inputs; y: (..., T) labels; mu: step size; w0: (..., d) or None.
    Returns:
        (..., T) jax array of a-priori predictions (error at t: (y_t - ŷ_t)²).
    """
    X, y = jnp.asarray(X), jnp.asarray(y)
    w = jnp.zeros(X.shape[:-2] + X.shape[-1:], X.dtype) if w0 is None else jnp.asarray(w0, X.dtype)

    def step(w, xy):
        x, yt = xy
        yh = jnp.sum(w * x, axis=-1)
        return w + mu * x * (yt - yh)[..., None], yh

    _, yh = jax.lax.scan(step, w, (jnp.moveaxis(X, -2, 0), jnp.moveaxis(y, -1, 0)))
    return jnp.moveaxis(yh, 0, -1)


def rls_predictions(X, y, *, beta=0.98, delta=100.0, w0=None):
    """A-priori exponentially weighted RLS predictions (Sec 5 baseline), forget factor β.

    ŷ_t = ŵ_{t-1}ᵀ x_t; k_t = P x_t / (β + x_tᵀ P x_t); ŵ_t = ŵ_{t-1} + k_t (y_t - ŷ_t);
    P ← (P - k_t x_tᵀ P)/β, P_0 = δ I, so ŵ_t = (Σ_i β^{t-i} x_i x_iᵀ + β^t I/δ)⁻¹ Σ_i β^{t-i} x_i y_i
    when ŵ_0 = 0. Paper: β = 0.98; P_0 and ŵ_0 are UNSPECIFIED (defaults δ = 100, ŵ_0 = 0).

    Args:
        X: (..., T, d) inputs; y: (..., T) labels; beta: forget factor; delta: P_0 = δ I;
        w0: (..., d) or None.
    Returns:
        (..., T) jax array of a-priori predictions.
    """
    X, y = jnp.asarray(X), jnp.asarray(y)
    d = X.shape[-1]
    batch = X.shape[:-2]
    w = jnp.zeros(batch + (d,), X.dtype) if w0 is None else jnp.asarray(w0, X.dtype)
    P = jnp.broadcast_to(delta * jnp.eye(d, dtype=X.dtype), batch + (d, d))

    def step(carry, xy):
        w, P = carry
        x, yt = xy
        yh = jnp.sum(w * x, axis=-1)
        Px = jnp.einsum("...ij,...j->...i", P, x)
        k = Px / (beta + jnp.sum(x * Px, axis=-1))[..., None]
        w = w + k * (yt - yh)[..., None]
        P = (P - k[..., :, None] * Px[..., None, :]) / beta
        return (w, P), yh

    _, yh = jax.lax.scan(step, (w, P), (jnp.moveaxis(X, -2, 0), jnp.moveaxis(y, -1, 0)))
    return jnp.moveaxis(yh, 0, -1)


# ``test_*`` names are the paper's terms, not pytest tests.
test_error.__test__ = False
test_error_printed.__test__ = False
