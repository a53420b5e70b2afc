"""Closed-form theory of "Training Dynamics of Multi-Head Softmax Attention for In-Context
Learning: Emergence, Convergence, and Optimality" (Chen, Sheen, Wang, Yang).

One-layer H-head softmax attention trained by population gradient flow on I-task linear
regression with disjoint covariate blocks of sizes d_i. Under a decomposable initialisation
(Def 3.1) training reduces to per-head, per-task eigenvalues ω̄_i^(h) of W_X and μ_i^(h) of U_Y.
Equation numbers are the paper's. "The reduced ODE" is the leading order of D.1/D.2, the "Dynamics Path" of
App. D.3, for every head and task (``reduced_ode_field``); iclab's paper page for mhsa lists the settings.

Symbols (Sec 2, Def 3.1): one name, one meaning, one place in every signature of this module.

==============  ======  =======================================================================
name            symbol  meaning
==============  ======  =======================================================================
``H``           H       number of heads
``I``           I       number of tasks
``d_i``         d_i     task block sizes, (I,) (a scalar in the single-task functions of (3.4)-(3.6),
                        D.11: the block size of the task considered); d = Σ_i d_i
``d``           d       total covariate dimension Σ_i d_i (homogeneous tasks: I·d̄)
``d_bar``       d̄       block size of homogeneous tasks, d̄ = d/I
``lam``         λ_i     per-task signal, Cov g_i = λ_i I: (I,) for heterogeneous tasks, a scalar
                        where the task is one (single-task functions) or every task has the same
                        λ_i = λ (homogeneous tasks: Table 1, Thm 4.4, E.27, Figs 4, 5, 7). For
                        homogeneous tasks this λ is also the paper's "total signal" Σ_i λ_i d_i/d =
                        E‖y_q‖²; no function here takes the total signal of heterogeneous tasks.
``phi``         φ_i     1 + SNR_i^{-1} = 1 + σ²d/(λ_i d_i) (``task_phi``; homogeneous: 1 + Iσ²/λ)
``sigma2``      σ²      label-noise variance
``L``           L       context length (``L_train``, ``L_test`` = L, L̃ for length generalisation)
``d_e``         d_e     head width
``r``           r       d̄/L (homogeneous tasks)
``omega_bar``   ω̄       (H, I) eigenvalues ω̄_i^(h) of W_X (row h = head, column i = task), or ω̄_i*
``mu``          μ       (H, I) eigenvalues μ_i^(h) of U_Y, or μ_i*
``omega0, mu0`` ω_0,μ_0 initial values of ω̄, μ (scalars shared by every head and task, or (H, I))
``tau``         τ       reduced time of (3.4)-(3.6) and of the reduced ODE
==============  ======  =======================================================================

Signatures: the point a function is evaluated at comes first and positionally (ω̄, μ, τ, r, B, b,
X, W, q, p, …), then, for heterogeneous tasks, the task arrays ``d_i, lam``; every other constant
of the setting is keyword-only, in the order H, I, d_i, d, d_bar, lam, phi, sigma2, L, d_e, then
initial values (omega0, mu0) and numerical options.

* The combination d_i λ_i φ_i = d_i λ_i + σ² d is always formed directly, so that a task with
  λ_i = 0 stays finite.
* Losses are E‖ŷ − y_q‖² with no ½ (the paper's quoted values); the training loss (2.6) is half.
* Time: the reduced systems (3.4)-(3.6) and the reduced ODE run on their own time τ. For the ½-MSE
  gradient flow (2.7) the original time is t = (d/2)τ (``gf_time_from_tau``, derived here); the paper's
  "t ← 2dt" (Thm D.11) is inconsistent with the model.
* Homogeneous tasks (Table 1, Thm 4.4): d_i = d̄ = d/I, λ_i = λ, φ = 1 + Iσ²/λ, SNR = λ/(Iσ²),
  r = d̄/L.

Errata handled here:

* (3.4) prints the ω̄* equation garbled; ``emergence_field`` uses the form of App. D.3/(D.47),
  which is exactly the reduced ODE restricted to one head.
* (4.2) prints the budget cap as "c^{-22 log L}"; read as B ≤ 2 log L / c² (compare E.17). The cap is
  optional here (``c=None``): with c = 3 it binds (B* = 1 infeasible) for L < e^{4.5} ≈ 90.
* Thm 4.4 / E.27 print closed forms for the Bayes risk. The variance form equals the
  Marchenko-Pastur integral only if its b is read as SNR^{-1} = Iσ²/λ; the printed bias is not the
  MP integral at all (it exceeds λ, e.g. 1.38λ at b = 5, r = 3). The Bayes risk here is the MP
  quadrature (``bayes_risk_mp``) or Monte Carlo of the posterior mean (``bayes_risk_mc``); the
  printed forms are kept as ``printed_variance_formula`` and ``printed_bias_formula_erratum``.
* Lemma C.8 prints ‖p‖₄⁴ in the second Stein moment; the identity holds with ‖p‖₂⁴ (tested by Monte Carlo).
* Thm 4.4's prior g_i ~ N(0, λ/d·I) conflicts with (2.4); (2.4) is used (Cov g_i = λ_i I), so the
  regression vector g_i/√d has covariance (λ/d) I and the posterior mean is ridge with penalty σ²d/λ.
* (5.4) bounds the error of the nonlinear-transfer prediction by O(L^{-2(1-ε)}). Its proof (F.2) drops
  E[‖p‖² | q] as O(L^{-2(1-ε)}), but Lemma B.2 makes E‖p‖² ≈ e^{‖Wq‖²}/L: the error is of order
  e^{‖q‖²/d}/L for |α| ≥ 1 (``softmax_derivative_sum``, ``nonlinear_transfer_mean`` keep it exactly).
* Fig 6 at L = 10⁴: exact quadrature (``softmax_collision``) gives E‖p‖² = .00451/.01896/.05304 at
  r = 2/2.5/3, as direct sampling does; Lemma B.2's exponential approximation e^{r²}/L is within 2 % only
  up to r ≈ 1.5 (17 % high at r = 2).

This module imports nothing from iclab's engines: every function here can be checked without
training anything.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import quad, solve_ivp
from scipy.optimize import minimize_scalar

__all__ = [
    "FIG1", "FIG3", "FIG4_5", "FIG6", "OptS", "ReducedPath",
    # task constants and time
    "task_phi", "task_snr", "homogeneous_phi", "gf_time_from_tau",
    # surrogate loss and the reduced ODE (App. D.3)
    "head_overlaps", "surrogate_loss", "reduced_ode_field", "solve_reduced_dynamics", "initial_state",
    "quasi_equilibrium_ratio", "hyperbolic_growth_rate",
    # single-head emergence (3.4)-(3.6), D.11
    "emergence_field", "solve_emergence", "mu_quasi_equilibrium", "omega_reduced_rate", "solve_omega_reduced",
    "omega_reduced_hitting_time", "emergence_time", "path_loss",
    # convergence point (4.1), (4.3), (4.4), length generalisation (5.2)
    "convergence_limit", "limit_weights", "per_task_optimal_loss", "gf_icl", "length_generalization_task_losses",
    "length_generalization_loss",
    # single-head optimum (4.2), E.19, E.24
    "simplified_loss", "optimal_output_scale", "opts_allocation", "opts_icl", "optimal_mu_given_omega",
    # Table 1 (homogeneous tasks), E.26, E.28-E.30
    "lb_icl", "equiangular_gain", "equiangular_lower_bound", "gf_icl_table", "gf_icl_snr_form", "mmse_table",
    "mmse_e3_form", "const_icl", "opts_icl_table", "small_ratio_forms",
    # Bayes risk and ridge (E.27)
    "mp_expectation", "ridge_variance_bias_mp", "bayes_risk_mp", "bayes_risk_mc", "printed_variance_formula",
    "printed_bias_formula_erratum",
    # softmax moments (4.7), Lemmas B.1-B.2
    "attention_probabilities", "softmax_moment_scalars", "stein_first_moment", "stein_second_moment",
    "collision_approximation", "softmax_collision",
    # extensions (5.1), (5.3)-(5.4)
    "single_head_output", "linear_attention_output", "nonlinear_transfer_weights", "nonlinear_transfer_prediction",
    "softmax_self_derivative_coefficients", "softmax_derivative_sum", "nonlinear_transfer_mean",
]

#: Paper settings (the figures' captions and text). Fig 1's d_e, ω_0, μ_0 are UNSPECIFIED; d_e = 30 is Fig 3's value,
#: which the paper says matches Fig 1, and ω_0, μ_0 are the defaults of ``initial_state``.
FIG1 = dict(H=3, d_i=(10, 10, 10), lam=(1.0, 1.0, 1.0), sigma2=0.0, L=100, d_e=30)
#: Fig 3: (3.4) from τ = 4 at (ω̄*, μ*) = (0.01, 1); (3.6) from τ = 4 at ω̄* = 0.01.
FIG3 = dict(d_i=10, lam=1.0, phi=1.0, L=100, d_e=30, tau0=4.0, omega0=0.01, mu0=1.0)
#: Figs 4-5: I = 10 homogeneous tasks, λ = σ² = 1; Fig 4(b)(ii) at r = 0.01; Fig 5 ridge penalties.
FIG4_5 = dict(I=10, lam=1.0, sigma2=1.0, r_fig4b=0.01, ridge_penalties=(0.05, 5.0))
#: Fig 6: L = 10⁴.
FIG6 = dict(L=10_000)

# Tolerances of the ODE integrations (DOP853); tight so that two integrations of the same flow
# agree to ~1e-10.
_RTOL = 1e-11
_ATOL = 1e-13


# ---------------------------------------------------------------------------------------------
# Task constants (Sec 2.2)
# ---------------------------------------------------------------------------------------------


def _task_arrays(d_i, lam):
    d_i = np.atleast_1d(np.asarray(d_i, dtype=float))
    lam = np.broadcast_to(np.asarray(lam, dtype=float), d_i.shape).copy()
    if np.any(d_i <= 0):
        raise ValueError(f"d_i must be > 0 (got {d_i})")
    if np.any(lam < 0):
        raise ValueError(f"lam must be >= 0 (got {lam})")
    return d_i, lam


def _dlphi(d_i, lam, sigma2):
    """d_i λ_i φ_i = d_i λ_i + σ² d, finite also for λ_i = 0."""
    return d_i * lam + sigma2 * d_i.sum()


def task_phi(d_i, lam, *, sigma2):
    """φ_i = 1 + SNR_i^{-1} = 1 + σ² d/(λ_i d_i) (Sec 2.2).

    Args:
        d_i: (I,) task block sizes; lam: (I,) per-task signals λ_i (> 0 for a finite φ_i);
        sigma2: noise variance σ².
    Returns:
        (I,) array φ_i (inf where λ_i = 0 and σ² > 0).
    """
    d_i, lam = _task_arrays(d_i, lam)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 + np.where(sigma2 > 0, sigma2 * d_i.sum() / (lam * d_i), 0.0)


def task_snr(d_i, lam, *, sigma2):
    """SNR_i = λ_i d_i/(d σ²) (Sec 2.2).

    Args:
        d_i: (I,) block sizes; lam: (I,) λ_i; sigma2: σ² > 0.
    Returns:
        (I,) array SNR_i.
    """
    d_i, lam = _task_arrays(d_i, lam)
    return lam * d_i / (d_i.sum() * sigma2)


def homogeneous_phi(*, I, lam, sigma2):
    """φ = 1 + Iσ²/λ for I homogeneous tasks of signal λ_i = λ (Table 1, Thm 4.4; ``task_phi`` with d_i = d/I).

    Args:
        I: tasks; lam: every task's signal λ; sigma2: σ².
    Returns:
        float φ.
    """
    return 1.0 + I * sigma2 / lam


def gf_time_from_tau(tau, *, d):
    """Original gradient-flow time of the ½-MSE flow (2.7) for reduced time τ: t = (d/2)τ.

    Derived here: the reduced ODEs are (2.7) with τ = 2t/d; the paper's Thm D.11 writes t = 2dτ instead.
    Experiments should calibrate this against training.

    Args:
        tau: (...) reduced times; d: total covariate dimension.
    Returns:
        (...) times t.
    """
    return 0.5 * d * np.asarray(tau, dtype=float)


# ---------------------------------------------------------------------------------------------
# Surrogate loss and the reduced ODE system (App. D.3)
# ---------------------------------------------------------------------------------------------


def head_overlaps(omega_bar, d_i):
    """Gram of head eigenvalues ⟨ω^(h), ω^(h')⟩ = Σ_k d_k ω̄_k^(h) ω̄_k^(h') (Sec 3.2).

    Args:
        omega_bar: (H, I) eigenvalues ω̄; d_i: (I,) block sizes.
    Returns:
        (H, H) array (numpy or jax, following the input).
    """
    xp = jnp if isinstance(omega_bar, jax.Array) else np
    omega_bar = xp.asarray(omega_bar)
    return (omega_bar * xp.asarray(d_i, dtype=omega_bar.dtype)) @ omega_bar.T


def surrogate_loss(omega_bar, mu, d_i, lam, *, sigma2, L):
    """Surrogate ICL loss L_sur(ω̄, μ) whose weighted gradient flow is the reduced ODE (derived here; tested in
    tests/theory/test_mhsa.py).

    L_sur = Σ_i (λ_i d_i/d)[1 − 2Σ_h μ_i^h ω̄_i^h + Σ_{h,h'} μ_i^h μ_i^h' (ω̄_i^h ω̄_i^h'
            + φ_i e^{⟨ω^h, ω^h'⟩}/L)],
    the multi-head, heterogeneous-task form of Sec 4.3.3 (E.7/(4.10) for H = 1). Differentiable
    in (omega_bar, mu) with JAX. No ½ (the paper's quoted losses have none).

    Args:
        omega_bar: (H, I) ω̄_i^(h); mu: (H, I) μ_i^(h); d_i: (I,) block sizes; lam: (I,) λ_i;
        sigma2: σ²; L: context length.
    Returns:
        scalar loss (jax array).
    """
    d_np, lam_np = _task_arrays(d_i, lam)
    d = d_np.sum()
    omega_bar = jnp.asarray(omega_bar)
    mu = jnp.asarray(mu)
    w = jnp.asarray(lam_np * d_np / d)
    wphi = jnp.asarray(_dlphi(d_np, lam_np, sigma2) / d)
    E = jnp.exp(head_overlaps(omega_bar, d_np))
    s = jnp.sum(mu * omega_bar, axis=0)
    quad_softmax = jnp.einsum("hi,hk,ki->i", mu, E, mu)
    return jnp.sum(w * (1.0 - 2.0 * s + s**2)) + jnp.sum(wphi * quad_softmax) / L


def reduced_ode_field(omega_bar, mu, d_i, lam, *, sigma2, L, d_e):
    """Right-hand side of the reduced ODE system (D.1/D.2 leading order, App. D.3).

    √d_e ∂_τ ω̄_i^h = λ_i μ_i^h ω̄_i^h − λ_i Σ_h' μ_i^h μ_i^h' ω̄_i^h' ω̄_i^h
                    − Σ_h' (e^{⟨ω^h,ω^h'⟩}/L) ⟨d⊙λ⊙φ, μ^h⊙μ^h'⟩ ω̄_i^h' ω̄_i^h,
    ∂_τ μ_i^h = d_iλ_i ω̄_i^h μ_i^h − Σ_h' d_iλ_i ω̄_i^h ω̄_i^h' μ_i^h' μ_i^h
                − Σ_h' (e^{⟨ω^h,ω^h'⟩}/L) d_iλ_iφ_i μ_i^h' μ_i^h,
    with ⟨d⊙λ⊙φ, μ⊙μ'⟩ = Σ_k (d_kλ_k + σ²d) μ_k μ'_k. Equals ∂_τ μ = −(d/2) μ ⊙ ∂L_sur/∂μ and
    ∂_τ ω̄_i = −(d/(2 d_i √d_e)) ω̄_i ⊙ ∂L_sur/∂ω̄_i (iclab's derivation, tested in tests/theory/test_mhsa.py).

    Args:
        omega_bar: (H, I); mu: (H, I); d_i: (I,); lam: (I,); sigma2: σ²; L: context length;
        d_e: head width.
    Returns:
        (d_omega_bar, d_mu), two (H, I) numpy arrays.
    """
    d_i, lam = _task_arrays(d_i, lam)
    omega_bar = np.asarray(omega_bar, dtype=float)
    mu = np.asarray(mu, dtype=float)
    dlphi = _dlphi(d_i, lam, sigma2)
    E = np.exp(head_overlaps(omega_bar, d_i)) / L
    s = np.sum(mu * omega_bar, axis=0)
    C = (mu * dlphi) @ mu.T
    d_omega = (lam * mu * omega_bar * (1.0 - s) - ((E * C) @ omega_bar) * omega_bar) / np.sqrt(d_e)
    d_mu = d_i * lam * omega_bar * mu * (1.0 - s) - dlphi * (E @ mu) * mu
    return d_omega, d_mu


class ReducedPath(NamedTuple):
    """Solution of the reduced ODE: ``tau`` (T,), ``omega_bar`` (T, H, I), ``mu`` (T, H, I)."""

    tau: np.ndarray
    omega_bar: np.ndarray
    mu: np.ndarray


def solve_reduced_dynamics(tau, d_i, lam, *, sigma2, L, d_e, omega0, mu0, rtol=_RTOL, atol=_ATOL):
    """Integrates the reduced ODE system (App. D.3) from (ω̄, μ)(τ[0]) = (ω_0, μ_0) and samples it at ``tau``.

    Args:
        tau: (T,) increasing reduced times; d_i, lam, sigma2, L, d_e: as in ``reduced_ode_field``.
        omega0, mu0: (H, I) initial values at τ = tau[0] (the theory's init: ``initial_state``).
        rtol, atol: DOP853 tolerances.
    Returns:
        ReducedPath with arrays at the requested times.
    """
    omega0 = np.asarray(omega0, dtype=float)
    shape = omega0.shape
    n = omega0.size

    def rhs(_, y):
        dw, dm = reduced_ode_field(y[:n].reshape(shape), y[n:].reshape(shape), d_i, lam, sigma2=sigma2,
                                   L=L, d_e=d_e)
        return np.concatenate([dw.ravel(), dm.ravel()])

    y0 = np.concatenate([omega0.ravel(), np.asarray(mu0, dtype=float).ravel()])
    path = _integrate(rhs, y0, tau, rtol, atol)
    T = path.shape[1]
    return ReducedPath(np.asarray(tau, dtype=float), path[:n].T.reshape(T, *shape),
                       path[n:].T.reshape(T, *shape))


def _integrate(rhs, y0, tau, rtol, atol, events=None):
    tau = np.asarray(tau, dtype=float)
    if tau.ndim != 1 or tau.size < 1 or np.any(np.diff(tau) < 0):
        raise ValueError("tau must be a non-empty, non-decreasing 1-D array")
    sol = solve_ivp(rhs, (tau[0], tau[-1]), y0, method="DOP853", t_eval=tau, rtol=rtol,
                    atol=atol, events=events)
    if not sol.success:
        raise RuntimeError(f"integration failed: {sol.message}")
    return (sol.y, sol) if events is not None else sol.y


def initial_state(*, H, I, omega0=0.01, mu0=0.05, advantage=0.5):
    """Theory initialisation (Thm 3.3) with head i favoured on task i (our choice).

    ω̄_i^(h) = ω_0 for all h, i; μ_i^(h) = μ_0 (1 + advantage·1[h = i]). The paper leaves ω_0, μ_0
    and the advantage UNSPECIFIED; Fig 1 has h_i* = i. Needs H ≥ I for every task to have
    a distinct favoured head.

    Args:
        H: heads; I: tasks; omega0: ω_0; mu0: μ_0; advantage: relative gap ε of the favoured head.
    Returns:
        (omega_bar0, mu0): two (H, I) arrays.
    """
    omega_bar = np.full((H, I), float(omega0))
    mu = np.full((H, I), float(mu0))
    k = min(H, I)
    mu[np.arange(k), np.arange(k)] *= 1.0 + advantage
    return omega_bar, mu


def quasi_equilibrium_ratio(omega_bar, mu, *, phi, L):
    """Warm-up quasi-equilibrium ρ_iφ_i = φ_i Σ_h μ_i^h/(L ω̄_i*) (D.56; ≈ 1 before emergence).

    The optimal head h_i* is argmax_h μ_i^h at each time (Sec 3.2).

    Args:
        omega_bar, mu: (..., H, I); phi: (I,) φ_i; L: context length.
    Returns:
        (..., I) array ρ_iφ_i.
    """
    omega_bar = np.asarray(omega_bar, dtype=float)
    mu = np.asarray(mu, dtype=float)
    star = np.argmax(mu, axis=-2)[..., None, :]
    omega_star = np.take_along_axis(omega_bar, star, axis=-2)[..., 0, :]
    return np.asarray(phi) * mu.sum(axis=-2) / (L * omega_star)


def hyperbolic_growth_rate(*, lam, phi, L, d_e):
    """Slope σ_4 = Lλ_i/(√d_e φ_i) of 1/ω̄_i* falling linearly in τ late in warm-up (D.20).

    Args:
        lam: λ_i; phi: φ_i; L: context length; d_e: head width (scalars or (I,) arrays).
    Returns:
        σ_4 (same shape), so that 1/ω̄_i*(τ) ≈ 1/ω̄_i*(τ_4) − σ_4 (τ − τ_4).
    """
    return L * np.asarray(lam, dtype=float) / (np.sqrt(d_e) * np.asarray(phi, dtype=float))


# ---------------------------------------------------------------------------------------------
# Single-head emergence system (3.4)-(3.6), T_0, the D.11 path loss
# ---------------------------------------------------------------------------------------------


def emergence_field(omega_bar, mu, *, d_i, lam, phi, L, d_e):
    """Optimal-head dynamics (3.4), ω̄* equation corrected from App. D.3/(D.47).

    ∂_τ μ* = λ_i d_i (−e^{d_i ω̄*²} φ_i μ*²/L + (1 − ω̄*μ*) ω̄*μ*),
    ∂_τ ω̄* = d_e^{-1/2} λ_i ω̄*μ* (1 − (1 + e^{d_i ω̄*²} d_i φ_i/L) μ*ω̄*).
    This is the reduced ODE with a single head and a single task.

    Args:
        omega_bar, mu: ω̄*, μ* (scalars or arrays of one shape); d_i, lam, phi: task i's d_i, λ_i,
        φ_i; L: context length; d_e: head width.
    Returns:
        (d_omega_bar, d_mu), same shape as the inputs.
    """
    omega_bar = np.asarray(omega_bar, dtype=float)
    mu = np.asarray(mu, dtype=float)
    E = np.exp(d_i * omega_bar**2)
    d_mu = lam * d_i * (-E * phi * mu**2 / L + (1.0 - omega_bar * mu) * omega_bar * mu)
    d_omega = lam * omega_bar * mu * (1.0 - (1.0 + E * d_i * phi / L) * mu * omega_bar)
    d_omega = d_omega / np.sqrt(d_e)
    return d_omega, d_mu


def solve_emergence(tau, *, d_i, lam, phi, L, d_e, omega0, mu0, rtol=_RTOL, atol=_ATOL):
    """Integrates (3.4) from (ω̄*, μ*)(τ[0]) = (ω_0, μ_0); samples at ``tau``.

    Args:
        tau: (T,) increasing times; d_i, lam, phi, L, d_e: as ``emergence_field``;
        omega0, mu0: initial values; rtol, atol: DOP853 tolerances.
    Returns:
        (omega_bar, mu): two (T,) arrays.
    """
    def rhs(_, y):
        return np.array(emergence_field(y[0], y[1], d_i=d_i, lam=lam, phi=phi, L=L, d_e=d_e))

    y = _integrate(rhs, np.array([omega0, mu0], dtype=float), tau, rtol, atol)
    return y[0], y[1]


def mu_quasi_equilibrium(omega_bar, *, d_i, phi, L):
    """Fast-variable limit (3.5): μ* = ω̄*/(ω̄*² + φ_i e^{d_i ω̄*²}/L).

    Args:
        omega_bar: ω̄* (any shape); d_i, phi: task's d_i, φ_i; L: context length.
    Returns:
        μ*, same shape.
    """
    omega_bar = np.asarray(omega_bar, dtype=float)
    return omega_bar / (omega_bar**2 + phi * np.exp(d_i * omega_bar**2) / L)


def omega_reduced_rate(omega_bar, *, d_i, lam, phi, L, d_e):
    """Slow-variable dynamics (3.6): ∂_τ ω̄* with μ* at its quasi-equilibrium (3.5).

    ∂_τ ω̄* = (1 − d_i ω̄*²) d_e^{-1/2} λ_i
             / [2 + φ_i e^{d_i ω̄*²}/(L ω̄*²) + L ω̄*²/(φ_i e^{d_i ω̄*²})].

    Args:
        omega_bar: ω̄* > 0 (any shape); d_i, lam, phi: task constants; L; d_e.
    Returns:
        rate, same shape; zero at the fixed point ω̄* = d_i^{-1/2}.
    """
    omega_bar = np.asarray(omega_bar, dtype=float)
    ratio = phi * np.exp(d_i * omega_bar**2) / (L * omega_bar**2)
    return (1.0 - d_i * omega_bar**2) * lam / (np.sqrt(d_e) * (2.0 + ratio + 1.0 / ratio))


def solve_omega_reduced(tau, *, d_i, lam, phi, L, d_e, omega0, rtol=_RTOL, atol=_ATOL):
    """Integrates (3.6) from ω̄*(τ[0]) = ω_0; samples at ``tau``.

    Args:
        tau: (T,) increasing times; d_i, lam, phi, L, d_e: as ``omega_reduced_rate``;
        omega0: initial ω̄* > 0; rtol, atol: DOP853 tolerances.
    Returns:
        (T,) array ω̄*(τ).
    """
    def rhs(_, y):
        return omega_reduced_rate(y, d_i=d_i, lam=lam, phi=phi, L=L, d_e=d_e)

    return _integrate(rhs, np.array([omega0], dtype=float), tau, rtol, atol)[0]


def omega_reduced_hitting_time(omega_target, *, d_i, lam, phi, L, d_e, omega0):
    """Time for (3.6) to go from ω_0 to omega_target: ∫ dω̄/(3.6) (D.49).

    Args:
        omega_target: target ω̄ with omega0 ≤ omega_target < d_i^{-1/2}; d_i, lam, phi, L, d_e: as
        ``omega_reduced_rate``; omega0: start ω̄ > 0.
    Returns:
        float elapsed reduced time.
    """
    if not 0.0 < omega0 <= omega_target < 1.0 / np.sqrt(d_i):
        raise ValueError(f"need 0 < omega0 <= omega_target < d_i^(-1/2) (got {omega0}, "
                         f"{omega_target})")
    val, _ = quad(lambda w: 1.0 / omega_reduced_rate(w, d_i=d_i, lam=lam, phi=phi, L=L, d_e=d_e), omega0,
                  omega_target, epsabs=0.0, epsrel=1e-11, limit=400)
    return float(val)


def emergence_time(*, lam, phi, L, d_e, omega0):
    """Leading-order emergence time T_0,i = √d_e φ_i/(λ_i L ω_0) (Thm 3.3, Sec 3.2).

    The blow-up time of ∂_τω̄ = λ_i L ω̄²/(√d_e φ_i), the small-ω̄ limit of (3.6). Reduced time τ;
    multiply by d/2 for the ½-MSE flow (``gf_time_from_tau``).

    Args:
        lam, phi: λ_i, φ_i (scalars or (I,)); L: context length; d_e: head width; omega0: ω_0.
    Returns:
        T_0,i, same shape as lam.
    """
    return np.sqrt(d_e) * np.asarray(phi, dtype=float) / (np.asarray(lam, dtype=float) * L * omega0)


def path_loss(omega_bar, *, d_i, d, lam, phi, L):
    """Task-i loss along the emergence path with μ* at (3.5) (D.11):

    (λ_i d_i/d)(1 − 1/(1 + (d_i ω̄*²)^{-1} e^{d_i ω̄*²} φ_i d_i/L)).

    Args:
        omega_bar: ω̄* > 0 (any shape); d_i: task i's block size; d: total dimension; lam, phi: λ_i,
        φ_i; L: context length.
    Returns:
        loss (no ½), same shape as omega_bar.
    """
    omega_bar = np.asarray(omega_bar, dtype=float)
    x = d_i * omega_bar**2
    return (lam * d_i / d) * (1.0 - 1.0 / (1.0 + np.exp(x) * phi * d_i / (x * L)))


# ---------------------------------------------------------------------------------------------
# Convergence point and its loss (4.1), (4.3), (4.4), length generalisation (5.2)
# ---------------------------------------------------------------------------------------------


def convergence_limit(d_i, lam, *, sigma2, L):
    """Limit of the optimal head for each task (4.3; Thm 3.3(iii)):

    ω̄_i* = d_i^{-1/2}, μ_i* = √d_i/(1 + e d_i φ_i/L).

    Args:
        d_i: (I,) block sizes; lam: (I,) λ_i > 0 (a task with λ_i = 0 gets μ_i = 0 when σ² > 0);
        sigma2: σ²; L: context length.
    Returns:
        (omega_bar, mu): two (I,) arrays.
    """
    d_i, lam = _task_arrays(d_i, lam)
    a = np.e * d_i * task_phi(d_i, lam, sigma2=sigma2) / L
    return 1.0 / np.sqrt(d_i), np.sqrt(d_i) / (1.0 + a)


def limit_weights(d_i, lam, *, H, sigma2, L, assignment=None, omega_off=0.0):
    """(H, I) eigenvalues at the convergence point: head assignment[i] carries (4.3) for task i.

    Other entries get ω̄ = omega_off (the GF keeps losers near ω_0, Thm 3.3(i)) and μ = 0.

    Args:
        d_i, lam, sigma2, L: as ``convergence_limit``; H: heads (≥ I); assignment: (I,) distinct head
        indices (default h_i* = i); omega_off: ω̄ of non-optimal entries.
    Returns:
        (omega_bar, mu): two (H, I) arrays.
    """
    w, m = convergence_limit(d_i, lam, sigma2=sigma2, L=L)
    I = w.size
    assignment = np.arange(I) if assignment is None else np.asarray(assignment)
    if H < I or len(set(assignment.tolist())) != I:
        raise ValueError(f"need H >= I and distinct assignment (got H={H}, {assignment})")
    omega_bar = np.full((H, I), float(omega_off))
    mu = np.zeros((H, I))
    omega_bar[assignment, np.arange(I)] = w
    mu[assignment, np.arange(I)] = m
    return omega_bar, mu


def per_task_optimal_loss(d_i, lam, *, sigma2, L):
    """Optimal single-head loss of task i (4.4): L_i* = (λ_i d_i/d) a_i/(1 + a_i), a_i = e d_iφ_i/L.

    Args:
        d_i: (I,) block sizes; lam: (I,) λ_i; sigma2: σ²; L: context length (or test length).
    Returns:
        (I,) array L_i* (no ½).
    """
    d_i, lam = _task_arrays(d_i, lam)
    d = d_i.sum()
    eda = np.e * _dlphi(d_i, lam, sigma2) / L  # = λ_i a_i
    return (d_i / d) * lam * eda / (lam + eda)


def gf_icl(d_i, lam, *, sigma2, L):
    """Leading term of the ICL loss at the GF convergence point (4.1, GF-ICL): Σ_i L_i*.

    Error terms O(L^{-(1-ε)/2} + δ + ω_0² d) are dropped.

    Args:
        d_i: (I,); lam: (I,); sigma2: σ²; L: context length.
    Returns:
        float loss (no ½).
    """
    return float(per_task_optimal_loss(d_i, lam, sigma2=sigma2, L=L).sum())


def length_generalization_task_losses(d_i, lam, *, sigma2, L_train, L_test):
    """Per-task loss of the (4.3) weights trained at L, tested at L̃ (leading order of (5.2), Prop 5.1).

    L_i(L̃) = (λ_i d_i/d)(a_i² + ã_i)/(1 + a_i)², a_i = e d_iφ_i/L, ã_i = e d_iφ_i/L̃
    (= ã/(1+ã) + (a−ã)²/((1+a)²(1+ã)): the intrinsic term (4.4) at L̃ plus a quadratic mismatch;
    derived here from E.7 with W_X at (4.3), which does not depend on L, and μ_i at its
    length-L value; (5.2) itself prints the intrinsic term at L, the text and F.1 have L̃).

    Args:
        d_i: (I,); lam: (I,); sigma2: σ²; L_train: training length L; L_test: test length L̃.
    Returns:
        (I,) array of losses (no ½); a task with λ_i = 0 contributes 0.
    """
    d_i, lam = _task_arrays(d_i, lam)
    d = d_i.sum()
    base = np.e * _dlphi(d_i, lam, sigma2)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(lam > 0, base / (lam * L_train), 0.0)
        at = np.where(lam > 0, base / (lam * L_test), 0.0)
    return (lam * d_i / d) * (a**2 + at) / (1.0 + a) ** 2


def length_generalization_loss(d_i, lam, *, sigma2, L_train, L_test):
    """Loss of the (4.3) weights trained at L, tested at L̃ (leading order of (5.2), Prop 5.1).

    Σ_i (λ_i d_i/d)(a_i² + ã_i)/(1 + a_i)², the sum of ``length_generalization_task_losses``.

    Args:
        d_i: (I,); lam: (I,); sigma2: σ²; L_train: training length L; L_test: test length L̃.
    Returns:
        float loss (no ½).
    """
    return float(np.sum(length_generalization_task_losses(d_i, lam, sigma2=sigma2, L_train=L_train, L_test=L_test)))


# ---------------------------------------------------------------------------------------------
# Single-head optimum (4.2, OptS-ICL), E.19, E.24
# ---------------------------------------------------------------------------------------------


def simplified_loss(B, b, d_i, lam, *, sigma2, L):
    """Single-head objective of (4.2): L_sim(B, b) = Σ_i (λ_i d_i/d)(1 − b_i/(b_i + d_iφ_i e^B/L)).

    Args:
        B: attention budget ‖W_X‖_F²; b: (I,) allocation b_i = d_i ω̄_i² (1ᵀb = B for (4.2));
        d_i, lam, sigma2, L: task constants.
    Returns:
        float loss (no ½).
    """
    d_i, lam = _task_arrays(d_i, lam)
    b = np.asarray(b, dtype=float)
    d = d_i.sum()
    kappa_lam = _dlphi(d_i, lam, sigma2) * np.exp(B) / L  # λ_i κ_i, κ_i = d_iφ_i e^B/L
    return float(np.sum((d_i / d) * lam * kappa_lam / (lam * b + kappa_lam)))


def optimal_output_scale(B, b, d_i, lam, *, sigma2, L):
    """Optimal u_i*(b) = √(b_i d_i)/(b_i + d_iφ_i e^B/L) for fixed attention (E.19, Thm 4.2).

    Args:
        B: budget; b: (I,) allocation; d_i, lam, sigma2, L: task constants (λ_i > 0).
    Returns:
        (I,) array u_i* (the eigenvalue μ_i of U_Y).
    """
    d_i, lam = _task_arrays(d_i, lam)
    b = np.asarray(b, dtype=float)
    kappa = task_phi(d_i, lam, sigma2=sigma2) * d_i * np.exp(B) / L
    return np.sqrt(b * d_i) / (b + kappa)


def opts_allocation(B, d_i, lam, *, sigma2, L):
    """Inner problem of (4.2): min_b L_sim(B, b) over b ≥ 0, 1ᵀb = B (convex; the solver is iclab's).

    KKT: b_i = max(0, √(w_iκ_i/ν) − κ_i), w_i = λ_i d_i/d, κ_i = d_iφ_i e^B/L, with ν set by
    1ᵀb = B (bisection on log ν). Tasks with λ_i = 0 get b_i = 0.

    Args:
        B: budget ≥ 0; d_i: (I,); lam: (I,); sigma2: σ²; L: context length.
    Returns:
        (I,) optimal allocation b.
    """
    d_i, lam = _task_arrays(d_i, lam)
    act = lam > 0
    b = np.zeros_like(d_i)
    if B <= 0 or not act.any():
        return b
    d = d_i.sum()
    kappa = d_i[act] * task_phi(d_i, lam, sigma2=sigma2)[act] * np.exp(B) / L
    wk = (lam[act] * d_i[act] / d) * kappa

    def alloc(log_nu):
        return np.maximum(0.0, np.sqrt(wk * np.exp(-log_nu)) - kappa)

    # Σ alloc is decreasing in ν: bracket then bisect in log ν.
    lo = np.log(wk.min() / (kappa.max() + B) ** 2) - 1.0
    hi = np.log(wk.max() / kappa.min() ** 2) + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if alloc(mid).sum() > B:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    ba = alloc(0.5 * (lo + hi))
    b[act] = ba * (B / ba.sum())
    return b


class OptS(NamedTuple):
    """Solution of (4.2): ``loss`` L_sim(B*, b*), ``B`` B*, ``b`` (I,) b*, ``u`` (I,) u_i*,
    ``omega_bar`` (I,) ω̄_i = √(b_i*/d_i) (W* = blockdiag(ω̄_i I_{d_i}))."""

    loss: float
    B: float
    b: np.ndarray
    u: np.ndarray
    omega_bar: np.ndarray


def opts_icl(d_i, lam, *, sigma2, L, c=None, n_grid=200):
    """Optimal single-head loss and weights (4.2, OptS-ICL; Thm 4.2).

    min over 0 ≤ B ≤ B_max of min_b L_sim(B, b): the inner problem by ``opts_allocation``, the outer
    1-D problem by a grid on [0, B_max] refined with a bounded Brent search.

    Args:
        d_i: (I,); lam: (I,); sigma2: σ²; L: context length.
        c: constant of (3.7) setting B_max = 2 log L/c² (the garbled cap of (4.2)); None (default)
            means no cap beyond a numerical one (B_max = log L + 10, past which e^B/L dominates).
        n_grid: grid points for the outer search.
    Returns:
        OptS(loss, B, b, u, omega_bar).
    """
    d_i, lam = _task_arrays(d_i, lam)
    B_max = np.log(L) + 10.0 if c is None else 2.0 * np.log(L) / c**2

    def f(B):
        return simplified_loss(B, opts_allocation(B, d_i, lam, sigma2=sigma2, L=L), d_i, lam, sigma2=sigma2, L=L)

    grid = np.linspace(0.0, B_max, n_grid)
    vals = np.array([f(B) for B in grid])
    k = int(np.argmin(vals))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, n_grid - 1)]
    res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12})
    B = float(res.x) if res.fun <= vals[k] else float(grid[k])
    b = opts_allocation(B, d_i, lam, sigma2=sigma2, L=L)
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(b > 0, optimal_output_scale(B, b, d_i, lam, sigma2=sigma2, L=L), 0.0)
    return OptS(float(f(B)), B, b, u, np.sqrt(b / d_i))


def optimal_mu_given_omega(omega_bar, d_i, lam, *, sigma2, L):
    """Minimiser of the surrogate over μ for fixed ω̄ (E.24): μ_i = (ω̄_iω̄_iᵀ + B_i)^{-1} ω̄_i.

    (B_i)_{hh'} = φ_i e^{⟨ω^h, ω^h'⟩}/L, ω̄_i = (ω̄_i^(1..H)). The minimum is
    Σ_i (λ_i d_i/d)(1 − ω̄_iᵀ(ω̄_iω̄_iᵀ + B_i)^{-1}ω̄_i).

    Args:
        omega_bar: (H, I); d_i: (I,); lam: (I,) (λ_i > 0); sigma2: σ²; L: context length.
    Returns:
        (mu, loss): (H, I) array and float.
    """
    d_i, lam = _task_arrays(d_i, lam)
    omega_bar = np.asarray(omega_bar, dtype=float)
    phi = task_phi(d_i, lam, sigma2=sigma2)
    E = np.exp(head_overlaps(omega_bar, d_i)) / L
    M = omega_bar.T[:, :, None] * omega_bar.T[:, None, :] + phi[:, None, None] * E[None]
    mu = np.linalg.solve(M, omega_bar.T[:, :, None])[..., 0]
    loss = np.sum(lam * d_i / d_i.sum() * (1.0 - np.sum(mu * omega_bar.T, axis=1)))
    return mu.T, float(loss)


# ---------------------------------------------------------------------------------------------
# Table 1 (homogeneous tasks), E.26, E.28-E.30
# ---------------------------------------------------------------------------------------------


def lb_icl(*, H, I, d, lam, sigma2, L):
    """Equiangular lower bound (4.5, LB-ICL): λ/((H − 1) φ^{-1} d^{-1} L + 1), φ = 1 + Iσ²/λ.

    Args:
        H: heads (≥ 2); I: tasks; d: total dimension; lam: every task's signal λ; sigma2: σ²;
        L: context length.
    Returns:
        float (no ½); error term O(L^{-ε/2}) dropped.
    """
    return lam / ((H - 1) * L / (homogeneous_phi(I=I, lam=lam, sigma2=sigma2) * d) + 1.0)


def equiangular_gain(x, *, H):
    """g(x) = e^{x/H}(H − 1)x/(e^x − 1), the quantity maximised in E.26 (limit H − 1 at x = 0).

    Args:
        x: (...) values ≥ 0; H: heads.
    Returns:
        (...) array g(x).
    """
    x = np.asarray(x, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = np.exp(x / H) * (H - 1) * x / np.expm1(x)
    return np.where(x == 0, H - 1.0, g)


def equiangular_lower_bound(*, H, I, d, lam, sigma2, L, x_max=20.0):
    """E.26: λ/(φ^{-1} d^{-1} L · sup_{x≥0} g(x) + 1), the sup found numerically on [0, x_max].

    Args:
        H, I, d, lam, sigma2, L: as ``lb_icl``; x_max: search range for x.
    Returns:
        float lower bound (equals ``lb_icl`` because the sup is the x → 0 limit H − 1).
    """
    res = minimize_scalar(lambda x: -equiangular_gain(x, H=H), bounds=(0.0, x_max),
                          method="bounded", options={"xatol": 1e-12})
    sup = max(float(-res.fun), float(equiangular_gain(0.0, H=H)))
    return lam / (sup * L / (homogeneous_phi(I=I, lam=lam, sigma2=sigma2) * d) + 1.0)


def gf_icl_table(*, I, d, lam, sigma2, L):
    """Table 1 GF-ICL (H ≥ I): λ/(I e^{-1} φ^{-1} d^{-1} L + 1) ((4.1) for homogeneous tasks).

    Args:
        I: tasks; d: total dimension; lam: every task's signal λ; sigma2: σ²; L: context length.
    Returns:
        float (no ½).
    """
    return lam / (I * L / (np.e * homogeneous_phi(I=I, lam=lam, sigma2=sigma2) * d) + 1.0)


def gf_icl_snr_form(*, I, d, lam, sigma2, L):
    """Table 1 GF-ICL for H > I rewritten in SNR = λ/(Iσ²):
    σ²(1 + SNR)/(e^{-1} d^{-1} L + I^{-1}(1 + SNR^{-1})).

    Args:
        I, d, lam, sigma2, L: as ``gf_icl_table`` (σ² > 0).
    Returns:
        float, equal to ``gf_icl_table``.
    """
    snr = lam / (I * sigma2)
    return sigma2 * (1.0 + snr) / (L / (np.e * d) + (1.0 + 1.0 / snr) / I)


def mmse_table(*, I, d, lam, sigma2, L):
    """Bayes risk to first order in d̄/L (4.6, MMSE): σ²/(d^{-1} L + I^{-1}(SNR^{-1} − 1)).

    Args:
        I, d, lam, sigma2, L: as ``gf_icl_table`` (σ² > 0).
    Returns:
        float (no ½).
    """
    snr = lam / (I * sigma2)
    return sigma2 / (L / d + (1.0 / snr - 1.0) / I)


def mmse_e3_form(r, *, I, sigma2, b):
    """Small-r Bayes form of E.3: Iσ² r/(1 + (b − 1) r); equals (4.6) only for b = SNR^{-1} = Iσ²/λ.

    Args:
        r: d̄/L; I: tasks; sigma2: σ²; b: the printed b (E.3 says σ²/λ; (4.6) needs b = SNR^{-1}).
    Returns:
        float.
    """
    return I * sigma2 * r / (1.0 + (b - 1.0) * r)


def const_icl(*, H, I, d, lam, sigma2, L):
    """Table 1 Const-ICL (H < I, I = kH): λ/(H e^{-1} φ^{-1} d^{-1} L + 1).

    Each head solves k = I/H tasks as the single-head optimum of (4.2), the others at zero signal.

    Args:
        H: heads; I, d, lam, sigma2, L: as ``gf_icl_table``.
    Returns:
        float (no ½).
    """
    return lam / (H * L / (np.e * homogeneous_phi(I=I, lam=lam, sigma2=sigma2) * d) + 1.0)


def opts_icl_table(*, I, d, lam, sigma2, L):
    """Table 1 OptS-ICL (H = 1; (4.2) at B* = 1 for homogeneous tasks): λ/(e^{-1}φ^{-1}d^{-1}L + 1).

    Args:
        I, d, lam, sigma2, L: as ``gf_icl_table``.
    Returns:
        float (no ½).
    """
    return const_icl(H=1, I=I, d=d, lam=lam, sigma2=sigma2, L=L)


def small_ratio_forms(*, H, I, d, lam, sigma2, L):
    """Leading terms as d/L → 0 (E.28-E.30, E.3): OptS ≈ e(λ+Iσ²)d/L, LB ≈ (λ+Iσ²)d/((H−1)L),
    GF ≈ e I^{-1}(λ+Iσ²)d/L, MMSE ≈ σ² d/L.

    Args:
        H: heads (≥ 2 for LB); I, d, lam, sigma2, L: as ``gf_icl_table``.
    Returns:
        dict with keys "opts", "lb", "gf", "mmse".
    """
    s = (lam + I * sigma2) * d / L
    return {"opts": np.e * s, "lb": s / (H - 1), "gf": np.e * s / I, "mmse": sigma2 * d / L}


# ---------------------------------------------------------------------------------------------
# Bayes risk and ridge (E.27): Marchenko-Pastur quadrature and Monte Carlo
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _leggauss(n):
    return np.polynomial.legendre.leggauss(n)


def mp_expectation(f, r, *, n_nodes=400):
    """E_{s~ν}[f(s)] for the Marchenko-Pastur law ν of XXᵀ/L, X ∈ R^{d̄×L} standard, r = d̄/L.

    Includes the atom 1 − 1/r at s = 0 for r > 1. Gauss-Legendre in θ with
    s = (s₊ + s₋)/2 + (s₊ − s₋)/2·cos θ, which removes the square-root edges (and the 1/√s
    edge at r = 1).

    Args:
        f: vectorised callable on arrays of s ≥ 0; r: aspect ratio > 0; n_nodes: quadrature nodes.
    Returns:
        float expectation.
    """
    if not r > 0:
        raise ValueError(f"r must be > 0 (got {r})")
    sm, sp = (1.0 - np.sqrt(r)) ** 2, (1.0 + np.sqrt(r)) ** 2
    x, w = _leggauss(int(n_nodes))
    theta = 0.5 * np.pi * (x + 1.0)
    w = 0.5 * np.pi * w
    h = 0.5 * (sp - sm)
    # = (s₊ + s₋)/2 + h cos θ, written without cancellation near s₋ = 0 (r ≈ 1).
    s = sm + 2.0 * h * np.cos(0.5 * theta) ** 2
    dens = h**2 * np.sin(theta) ** 2 / (2.0 * np.pi * r * s)
    val = float(np.sum(w * dens * f(s)))
    if r > 1:
        val += (1.0 - 1.0 / r) * float(f(np.zeros(1))[0])
    return val


def ridge_variance_bias_mp(r, *, I, lam, sigma2, b):
    """Asymptotic risk of per-task ridge with penalty b·d (E.27 derivation), summed over I tasks.

    Variance = σ²(d/L) E_ν[s/(s+κ)²], Bias = λ E_ν[κ²/(s+κ)²], κ = b d/L = b I r, ν = MP(r).
    (Fig 5's "penalty" is read as this b: our reading; the paper does not say.)

    Args:
        r: d̄/L; I: tasks; lam: every task's signal λ; sigma2: σ²; b: penalty coefficient (> 0; b = 0
            gives only the bias, the ridgeless variance E[1/s] is not implemented).
    Returns:
        (variance, bias) floats.
    """
    kappa = b * I * r
    var = sigma2 * I * r * mp_expectation(lambda s: s / (s + kappa) ** 2, r)
    bias = lam * mp_expectation(lambda s: kappa**2 / (s + kappa) ** 2, r) if kappa > 0 else (
        lam * max(0.0, 1.0 - 1.0 / r))
    return var, bias


def bayes_risk_mp(r, *, I, lam, sigma2):
    """Asymptotic Bayes risk (MMSE of Thm 4.4/E.27, derivation corrected): ridge with b = σ²/λ.

    Equals Iσ² r E_ν[1/(s + κ)], κ = σ² I r/λ (posterior mean = ridge with penalty σ²d/λ).

    Args:
        r: d̄/L; I: tasks; lam: every task's signal λ; sigma2: σ² > 0.
    Returns:
        float risk (no ½).
    """
    var, bias = ridge_variance_bias_mp(r, I=I, lam=lam, sigma2=sigma2, b=sigma2 / lam)
    return var + bias


def bayes_risk_mc(seed, *, I, d_bar, lam, sigma2, L, n, b=None, batch_size=500):
    """Monte Carlo risk of the posterior mean (or of ridge with penalty b·d), summed over I tasks.

    Per task: β = g_i/√d ~ N(0, (λ/d) I_{d̄}), y_l = βᵀx_l + ε_l, β̂ = (XXᵀ + b d I)^{-1} X y;
    the query is integrated out exactly (E‖β̂ − β‖²). b = None uses b = σ²/λ (posterior mean).
    Batched numpy (no JIT compile: one draw is a small d̄×d̄ solve).

    Args:
        seed: int or numpy Generator; I: tasks (d = I d̄); d_bar: d̄; lam: every task's signal λ;
        sigma2: σ²; L: context length; n: Monte Carlo draws; b: ridge coefficient or None;
        batch_size: draws per batch.
    Returns:
        (mean, standard error) of I·‖β̂ − β‖².
    """
    rng = np.random.default_rng(seed)
    d = I * d_bar
    pen = (sigma2 / lam if b is None else b) * d
    vals = []
    for m in np.diff(np.append(np.arange(0, n, batch_size), n)):
        X = rng.standard_normal((m, d_bar, L))
        beta = np.sqrt(lam / d) * rng.standard_normal((m, d_bar))
        y = np.einsum("mdl,md->ml", X, beta) + np.sqrt(sigma2) * rng.standard_normal((m, L))
        A = np.matmul(X, X.transpose(0, 2, 1)) + pen * np.eye(d_bar)
        bhat = np.linalg.solve(A, np.matmul(X, y[..., None]))[..., 0]
        vals.append(I * np.sum((bhat - beta) ** 2, axis=1))
    vals = np.concatenate(vals)
    return float(vals.mean()), float(vals.std(ddof=1) / np.sqrt(n))


def printed_variance_formula(r, *, I, sigma2, b):
    """Variance closed form as printed in E.27 (Thm 4.4 prints "+4b" for "+4br"):

    Iσ²·(br + 1 + r − √((br − 1 + r)² + 4br))/(2√((br − 1 + r)² + 4br)).
    Correct (= Iσ² r E_ν[s/(s + br)²]) only when its b is read as SNR^{-1} = Iσ²/λ, i.e. κ = br.

    Args:
        r: d̄/L; I: tasks; sigma2: σ²; b: printed b.
    Returns:
        float.
    """
    sq = np.sqrt((b * r - 1.0 + r) ** 2 + 4.0 * b * r)
    return I * sigma2 * (b * r + 1.0 + r - sq) / (2.0 * sq)


def printed_bias_formula_erratum(r, *, lam, b):
    """Bias closed form as printed in E.27 / Thm 4.4. WRONG (not the MP integral; e.g. 1.38λ at b = 5, r = 3):
    kept to show the gap.

    λ·((br(1+r) + (1−r)² − |1−r|√((br−1+r)² + 4br))/(2√((br−1+r)² + 4br)) + (1 − 1/r)1(r>1)).
    It is not the MP integral λE_ν[κ²/(s+κ)²] for any reading of b (it exceeds λ, e.g. 1.38λ at
    b = 5, r = 3). Use ``ridge_variance_bias_mp``.

    Args:
        r: d̄/L; lam: every task's signal λ; b: printed b.
    Returns:
        float.
    """
    sq = np.sqrt((b * r - 1.0 + r) ** 2 + 4.0 * b * r)
    main = (b * r * (1.0 + r) + (1.0 - r) ** 2 - abs(1.0 - r) * sq) / (2.0 * sq)
    return lam * (main + (1.0 - 1.0 / r) * (r > 1))


# ---------------------------------------------------------------------------------------------
# Softmax moments: Stein identities (4.7)/Lemma C.8, Lemmas B.1-B.2
# ---------------------------------------------------------------------------------------------


def attention_probabilities(X, W, q):
    """Softmax attention p = softmax(Xᵀ W q) over the L context tokens (2.2 under Def 3.1).

    Args:
        X: (..., d, L) covariates as columns; W: (d, d) W_X; q: (..., d) query.
    Returns:
        (..., L) probabilities.
    """
    s = jnp.einsum("...dl,de,...e->...l", X, W, q)
    return jax.nn.softmax(s, axis=-1)


def softmax_moment_scalars(p):
    """Scalars of the Stein identities: (‖p‖₂², 1 − ‖p‖₂² − 6‖p‖₃³ + 6‖p‖₂⁴) per sample (4.7).

    Args:
        p: (..., L) probabilities.
    Returns:
        (p2, f2): two (...) arrays; their conditional means given q enter the identities.
    """
    p2 = jnp.sum(p**2, axis=-1)
    p3 = jnp.sum(p**3, axis=-1)
    return p2, 1.0 - p2 - 6.0 * p3 + 6.0 * p2**2


def stein_first_moment(W, q, p2):
    """E[Xp | q] = W q (1 − E[‖p‖² | q]) (4.7; Lemma C.8, exact for x_l ~ N(0, I)).

    Linear in p2, so per-sample values of ‖p‖² give per-sample terms with the right mean.

    Args:
        W: (d, d) W_X; q: (..., d); p2: (...) E[‖p‖² | q] (or per-sample ‖p‖²).
    Returns:
        (..., d) array.
    """
    Wq = jnp.einsum("de,...e->...d", W, q)
    return Wq * (1.0 - jnp.asarray(p2))[..., None]


def stein_second_moment(W, q, p2, f2):
    """E[X p pᵀ Xᵀ | q] = WqqᵀWᵀ·E[1 − ‖p‖² − 6‖p‖₃³ + 6‖p‖₂⁴ | q] + I·E[‖p‖² | q] (4.7; C.8).

    Lemma C.8 prints ‖p‖₄⁴ for the last term; the exact identity has ‖p‖₂⁴ (tested by Monte Carlo).

    Args:
        W: (d, d); q: (..., d); p2, f2: (...) the two scalars of ``softmax_moment_scalars``.
    Returns:
        (..., d, d) array.
    """
    Wq = jnp.einsum("de,...e->...d", W, q)
    eye = jnp.eye(W.shape[0])
    return (Wq[..., :, None] * Wq[..., None, :] * jnp.asarray(f2)[..., None, None]
            + eye * jnp.asarray(p2)[..., None, None])


def collision_approximation(W, W_tilde, q, *, L):
    """Exponential-regime approximation E[pᵀp̃ | q] ≈ e^{qᵀW̃ᵀWq}/L (Lemma B.2; Fig 6 left).

    Valid for ‖Wq‖², ‖W̃q‖² ≤ 2 log L/c² with error O(L^{-2(1-ε)}); fails for ‖Wq‖ ≳ √(2 log L)/c.

    Args:
        W, W_tilde: (d, d) attention matrices of two heads; q: (..., d); L: context length.
    Returns:
        (...) array.
    """
    Wq = jnp.einsum("de,...e->...d", jnp.asarray(W), jnp.asarray(q))
    Wtq = jnp.einsum("de,...e->...d", jnp.asarray(W_tilde), jnp.asarray(q))
    return jnp.exp(jnp.sum(Wq * Wtq, axis=-1)) / L


def softmax_collision(r, *, L, z_max=10.0):
    """E[‖p‖² | ‖Wq‖ = r] = E‖softmax(r z)‖², z ~ N(0, I_L) (Lemma B.1; Fig 6), by exact quadrature.

    E‖p‖² = L·E[p_1²], p_1 = e^{rz_1}/(e^{rz_1} + S') with S' = Σ_{l≥2} e^{r z_l} independent of
    z_1, and 1/x² = ∫_0^∞ t e^{−tx} dt (t = e^u) give
    E‖p‖² = L ∫_R e^{2u} M(e^u)^{L−1} J(e^u) du,
    M(t) = E e^{−t e^{rz}}, J(t) = E[e^{2rz} e^{−t e^{rz}}], z ~ N(0, 1): two 1-D Gaussian integrals
    (trapezoid on |z| ≤ z_max, spacing ≤ 0.5/r) inside a trapezoid in u (spacing 0.1), both
    spectrally accurate (relative error ~1e-12). No Monte Carlo, no approximation in L.

    Args:
        r: scalar or (R,) array of ‖Wq‖ ≥ 0; L: context length ≥ 1; z_max: Gaussian truncation.
    Returns:
        float or (R,) array E‖p‖²; 1/L at r = 0, increasing in r to 1 (Lemma B.1).
    """
    r_arr = np.atleast_1d(np.asarray(r, dtype=float))
    out = np.array([_softmax_collision_one(rr, L, z_max) for rr in r_arr])
    return float(out[0]) if np.ndim(r) == 0 else out


def _softmax_collision_one(r, L, z_max):
    from scipy.special import logsumexp

    if r < 0 or L < 1:
        raise ValueError(f"need r >= 0 and L >= 1 (got r={r}, L={L})")
    hz = min(0.02, 0.5 / r) if r > 0 else 0.02
    z = np.linspace(-z_max, z_max, int(np.ceil(2.0 * z_max / hz)) + 1)
    logw = -0.5 * z**2 - 0.5 * np.log(2.0 * np.pi) + np.log(z[1] - z[0])
    w = np.exp(logw)
    du = 0.1
    u = np.arange(-(z_max * r + np.log(L) + 40.0), 10.0 + du, du)
    rz = r * z
    total = 0.0
    for ub in np.array_split(u, max(1, u.size // 400)):
        tx = np.exp(ub[:, None] + rz[None, :])
        one_minus_M = np.minimum((-np.expm1(-tx)) @ w, 1.0)
        with np.errstate(divide="ignore"):
            logM = np.log1p(-one_minus_M)
        logJ = logsumexp(2.0 * rz[None, :] - tx + logw[None, :], axis=1)
        expo = 2.0 * ub + logJ + np.where(L > 1, (L - 1) * logM, 0.0)
        total += np.sum(np.exp(np.where(np.isfinite(expo), expo, -np.inf)))
    return L * total * du


# ---------------------------------------------------------------------------------------------
# Extensions: linear-attention limit (5.1), nonlinear transfer (5.3)-(5.4)
# ---------------------------------------------------------------------------------------------


def single_head_output(X, Y, W_X, U_Y, q):
    """Decomposable single-head output ŷ_q = U_Y Y softmax(Xᵀ W_X q) (2.1 with U_X = W_Y = 0).

    Args:
        X: (..., d, L); Y: (..., d_y, L); W_X: (d, d); U_Y: (d_y, d_y) or scalar; q: (..., d).
    Returns:
        (..., d_y) prediction.
    """
    p = attention_probabilities(X, W_X, q)
    Yp = jnp.einsum("...yl,...l->...y", Y, p)
    U_Y = jnp.asarray(U_Y)
    return U_Y * Yp if U_Y.ndim == 0 else jnp.einsum("yz,...z->...y", U_Y, Yp)


def linear_attention_output(X, Y, W_X, U_Y, q):
    """Linear-attention limit (5.1) for L ≫ d: ŷ ≈ (1/L) U_Y Y Xᵀ W_X q.

    Args:
        X: (..., d, L); Y: (..., d_y, L); W_X: (d, d); U_Y: (d_y, d_y) or scalar; q: (..., d).
    Returns:
        (..., d_y) prediction.
    """
    L = X.shape[-1]
    s = jnp.einsum("...dl,de,...e->...l", X, W_X, q) / L
    Ys = jnp.einsum("...yl,...l->...y", Y, s)
    U_Y = jnp.asarray(U_Y)
    return U_Y * Ys if U_Y.ndim == 0 else jnp.einsum("yz,...z->...y", U_Y, Ys)


def nonlinear_transfer_weights(*, d, lam, sigma2, L):
    """Single-task optimal single head (5.3): W_X = d^{-1/2} I_d, U_Y = μ = √d/(1 + e d φ/L).

    Args:
        d: dimension (one task, d_1 = d); lam: λ; sigma2: σ²; L: context length.
    Returns:
        (omega_bar, mu): floats, W_X = omega_bar·I_d.
    """
    w, m = convergence_limit([d], [lam], sigma2=sigma2, L=L)
    return float(w[0]), float(m[0])


def nonlinear_transfer_prediction(coeffs, alphas, q, *, mu):
    """Predicted E[ŷ_q | q] for y = f(x) + ε, f = Σ_α f̂_α He_α, under (5.3) weights (5.4):

    μ Σ_α f̂_α d^{-|α|/2} q^α (monomials q^α, not He_α(q): high degrees leak into low ones).

    Args:
        coeffs: (K,) Hermite coefficients f̂_α; alphas: (K, d) multi-indices; q: (..., d) queries;
        mu: output scale μ.
    Returns:
        (...) predictions. (5.4) states the error as O(L^{-2(1-ε)}) with high probability over q; it is
        of order e^{‖q‖²/d}/L for |α| ≥ 1 (``nonlinear_transfer_mean`` keeps it; |α| = 0 is exact).
    """
    alphas = np.asarray(alphas, dtype=int)
    coeffs = np.asarray(coeffs, dtype=float)
    q = np.asarray(q, dtype=float)
    d = alphas.shape[1]
    mono = np.prod(q[..., None, :] ** alphas, axis=-1)
    return mu * mono @ (coeffs * float(d) ** (-0.5 * alphas.sum(axis=1)))


@lru_cache(maxsize=16)
def softmax_self_derivative_coefficients(k):
    """Coefficients c_j with ∂^k p_l/∂s_l^k = Σ_j c_j p_l^j for p = softmax(s) (App. F.2, proof of Lemma 5.2).

    From ∂p_l/∂s_l = p_l(1 − p_l): P_0(p) = p, P_{k+1}(p) = P_k'(p)·(p − p²). P_1 = p − p²,
    P_2 = p − 3p² + 2p³. c_1 = 1 for every k, so Σ_l P_k(p_l) = 1 + O(‖p‖²).

    Args:
        k: derivative order ≥ 0.
    Returns:
        tuple (c_0, …, c_{k+1}) of floats (c_0 = 0).
    """
    if k < 0:
        raise ValueError(f"k must be >= 0 (got {k})")
    P = np.array([0.0, 1.0])
    for _ in range(int(k)):
        P = np.polynomial.polynomial.polymul(np.polynomial.polynomial.polyder(P), [0.0, 1.0, -1.0])
    return tuple(float(c) for c in P)


def softmax_derivative_sum(p, k):
    """D_k = Σ_l ∂^k p_l/∂s_l^k = Σ_j c_j ‖p‖_j^j (App. F.2): D_0 = 1, D_1 = 1 − ‖p‖²,
    D_2 = 1 − 3‖p‖² + 2‖p‖₃³.

    F.2 replaces E[D_k | q] by 1; the neglected part is −(2^k − 1)·E‖p‖² + … ≈ −(2^k − 1)e^{‖Wq‖²}/L
    (c_2 = −(2^k − 1); Lemma B.2), of order 1/L, not the O(L^{-2(1-ε)}) that (5.4) states.

    Args:
        p: (..., L) attention probabilities; k: derivative order ≥ 0.
    Returns:
        (...) array D_k.
    """
    c = softmax_self_derivative_coefficients(k)
    xp = jnp if isinstance(p, jax.Array) else np
    return sum(cj * xp.sum(p**j, axis=-1) for j, cj in enumerate(c) if j > 0 and cj != 0.0)


def nonlinear_transfer_mean(coeffs, alphas, q, D, *, omega_bar, mu):
    """Exact E[ŷ_q | q] of one head with W_X = ω̄ I_d, U_Y = μ on y = f(x) + ε, f = Σ_α f̂_α He_α (App. F.2):

    E[Σ_l He_α(x_l) p_l | q] = (ω̄q)^α E[D_{|α|} | q] (Stein's lemma |α| times; D_k of
    ``softmax_derivative_sum``), so E[ŷ_q | q] = μ Σ_α f̂_α (ω̄q)^α E[D_{|α|} | q]. With D = 1 and
    ω̄ = d^{-1/2} this is (5.4), ``nonlinear_transfer_prediction``.

    Args:
        coeffs: (K,) f̂_α; alphas: (K, d) multi-indices; q: (..., d) queries;
        D: (..., K) E[D_{|α_k|} | q] per term (per-sample D_k give per-sample terms with that mean);
        omega_bar: ω̄; mu: μ.
    Returns:
        (...) array.
    """
    alphas = np.asarray(alphas, dtype=int)
    coeffs = np.asarray(coeffs, dtype=float)
    q = np.asarray(q, dtype=float)
    mono = np.prod((omega_bar * q[..., None, :]) ** alphas, axis=-1)  # (..., K)
    return mu * np.sum(coeffs * mono * np.asarray(D, dtype=float), axis=-1)
