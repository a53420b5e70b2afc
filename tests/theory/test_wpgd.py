"""Tests of iclab.theory.wpgd ("Gating is Weighting").

Reference values come from the paper, from a table of the experiments' setting derived by hand (equal-n̄ closed
forms, below), or from computations independent of
the closed form under test: Monte Carlo of the WPGD predictor, JAX autodiff of eq 37/39, and an
L-BFGS minimisation of eq 37 with random restarts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.theory import wpgd as W

# ---------------------------------------------------------------------------------- fixtures


def random_covariance(rng, d, spread):
    """Σ = Q diag(s) Qᵀ with log-eigenvalues uniform in [−spread, spread]."""
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    s = np.exp(rng.uniform(-spread, spread, size=d))
    return (Q * s) @ Q.T


def random_correlation(rng, m, rank=None):
    """Random (m, m) correlation matrix (unit diagonal, PSD) of the given rank."""
    G = rng.normal(size=(m, rank or m))
    C = G @ G.T
    dd = np.sqrt(np.diag(C))
    return C / np.outer(dd, dd)


def random_problem(seed, d, n, sigma2, spread=1.0, rank=None):
    rng = np.random.default_rng(seed)
    Sigma = random_covariance(rng, d, spread)
    C = random_correlation(rng, n + 1, rank)
    return Sigma, C[:n, :n], C[:n, n], sigma2


# ------------------------------------------------------------------ eq 37 against Monte Carlo


def mc_risk(P, omega, Sigma, betas, sigma2, rng, rao_blackwell):
    """Sample mean and SE of the WPGD loss (y − xᵀPXᵀ(ω⊙y))² given sampled tasks betas (N, n+1, d).

    rao_blackwell=True integrates the query (x, ξ) exactly given the context:
    E[(y − xᵀβ̂)² | context] = (β − β̂)ᵀΣ(β − β̂) + σ², which cuts the SE about 3x.
    """
    N, n1, d = betas.shape
    n = n1 - 1
    X = rng.standard_normal((N, n1, d)) @ np.linalg.cholesky(Sigma).T
    y = np.einsum("Nid,Nid->Ni", X, betas) + np.sqrt(sigma2) * rng.standard_normal((N, n1))
    beta_hat = np.einsum("de,Nie,Ni->Nd", P, X[:, :n], omega * y[:, :n])
    if rao_blackwell:
        diff = betas[:, n] - beta_hat
        loss = np.einsum("Nd,de,Ne->N", diff, Sigma, diff) + sigma2
    else:
        loss = (y[:, n] - np.einsum("Nd,Nd->N", X[:, n], beta_hat)) ** 2
    return loss.mean(), loss.std(ddof=1) / np.sqrt(N)


def plausible_wrong_risks(P, omega, Sigma, R, r, sigma2):
    """Eq 37 with two easy derivation slips; the MC must be able to tell them apart from eq 37."""
    L = float(W.wpgd_risk(P, omega, Sigma, R, r, sigma2))
    w2 = omega @ omega
    return {
        # forgetting the Gaussian fourth moment: (‖ω‖² + ωᵀRω) → ωᵀRω
        "no_fourth_moment": L - w2 * np.trace(Sigma @ Sigma @ P.T @ Sigma @ P),
        # forgetting label noise in the variance term: M → tr Σ
        "no_noise_in_variance": L - sigma2 * w2 * np.trace(Sigma @ P.T @ Sigma @ P),
    }


N_MC = 200_000


@pytest.mark.parametrize("point, rao_blackwell", [("random", False), ("random", True), ("scaled_optimum", True)])
def test_risk_eq37_matches_monte_carlo(point, rao_blackwell):
    d, n, sigma2 = 3, 4, 1.0
    Sigma, R, r, _ = random_problem(0, d, n, sigma2)
    rng = np.random.default_rng(1)
    if point == "random":
        P, omega = 0.2 * rng.normal(size=(d, d)), rng.normal(size=n)
    else:  # off the optimum so that every term of eq 37 is exercised
        opt = W.wpgd_optimum(Sigma, R, r, sigma2)
        P, omega = 1.5 * opt.P, opt.omega
    C = np.block([[R, r[:, None]], [r[None, :], np.ones((1, 1))]])
    betas = np.einsum("ij,Njd->Nid", np.linalg.cholesky(C), rng.standard_normal((N_MC, n + 1, d)))
    mean, se = mc_risk(P, omega, Sigma, betas, sigma2, rng, rao_blackwell)
    L = float(W.wpgd_risk(P, omega, Sigma, R, r, sigma2))
    assert abs(mean - L) < 3 * se, (mean, se, L)
    # The test can fail: the SE resolves the terms a wrong derivation would get wrong.
    for name, wrong in plausible_wrong_risks(P, omega, Sigma, R, r, sigma2).items():
        assert abs(wrong - L) > 6 * se, (name, wrong, L, se)


def test_risk_eq37_matches_monte_carlo_on_multitask_prompts():
    """Sec 5.1 prompts sampled generatively: 2 independent tasks in blocks, β = r₁β₁ + r₂β₂ + noise."""
    d, n_bar, r1, r2, sigma2 = 3, 2, 0.6, 0.3, 0.5
    n = 2 * n_bar
    rng = np.random.default_rng(2)
    Sigma = random_covariance(rng, d, 0.7)
    P, omega = 0.3 * rng.normal(size=(d, d)), rng.normal(size=n)
    tasks = rng.standard_normal((N_MC, 2, d))
    beta = r1 * tasks[:, 0] + r2 * tasks[:, 1] + np.sqrt(1 - r1**2 - r2**2) * rng.standard_normal((N_MC, d))
    betas = np.concatenate([np.repeat(tasks, n_bar, axis=1), beta[:, None]], axis=1)
    mean, se = mc_risk(P, omega, Sigma, betas, sigma2, rng, rao_blackwell=True)
    R, r = W.two_task_correlation(n_bar, r1=r1, r2=r2)
    L = float(W.wpgd_risk(P, omega, Sigma, R, r, sigma2))
    assert abs(mean - L) < 3 * se, (mean, se, L)
    for name, wrong in plausible_wrong_risks(P, omega, Sigma, R, r, sigma2).items():
        assert abs(wrong - L) > 6 * se, (name, wrong, L, se)


# --------------------------------------------------------------- gradients (40)-(41) vs autodiff


@pytest.mark.parametrize("d, n, seed", [(1, 1, 0), (3, 5, 1), (5, 2, 2), (4, 7, 3)])
def test_gradients_eq40_41_match_autodiff(d, n, seed):
    Sigma, R, r, sigma2 = random_problem(seed, d, n, 0.3)
    rng = np.random.default_rng(seed + 100)
    P, omega = rng.normal(size=(d, d)), rng.normal(size=n)  # P not symmetric
    Sh = W._sqrtm_psd(Sigma)
    Pt = Sh @ P @ Sh
    # eq 39 is eq 37 under the substitution (38)
    np.testing.assert_allclose(W.wpgd_risk_tilde(Pt, omega, Sigma, R, r, sigma2),
                               W.wpgd_risk(P, omega, Sigma, R, r, sigma2), rtol=1e-12)
    ad_Pt, ad_w = jax.grad(W.wpgd_risk_tilde, argnums=(0, 1))(jnp.asarray(Pt), jnp.asarray(omega), Sigma, R, r, sigma2)
    g_Pt, g_w = W.wpgd_grad_tilde(Pt, omega, Sigma, R, r, sigma2)
    np.testing.assert_allclose(g_Pt, ad_Pt, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_w, ad_w, rtol=1e-10, atol=1e-12)
    ad_P, ad_w37 = jax.grad(W.wpgd_risk, argnums=(0, 1))(jnp.asarray(P), jnp.asarray(omega), Sigma, R, r, sigma2)
    g_P, g_w37 = W.wpgd_grad(P, omega, Sigma, R, r, sigma2)
    np.testing.assert_allclose(g_P, ad_P, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_w37, ad_w37, rtol=1e-10, atol=1e-12)


def test_eq40_as_printed_is_wrong_off_the_stationary_set():
    """Eq 40 prints 2(‖ω‖²+ωᵀRω)ΣP̃; autodiff gives P̃Σ. They agree iff P̃ commutes with Σ."""
    d, n = 3, 4
    Sigma, R, r, sigma2 = random_problem(5, d, n, 0.2)
    rng = np.random.default_rng(6)
    omega = rng.normal(size=n)
    c = omega @ omega + omega @ R @ omega

    def printed(Pt):
        g, _ = W.wpgd_grad_tilde(Pt, omega, Sigma, R, r, sigma2)
        return g - 2 * c * Pt @ Sigma + 2 * c * Sigma @ Pt

    def autodiff(Pt):
        return np.asarray(jax.grad(W.wpgd_risk_tilde)(jnp.asarray(Pt), omega, Sigma, R, r, sigma2))

    generic = rng.normal(size=(d, d))
    assert np.max(np.abs(printed(generic) - autodiff(generic))) > 1e-2
    commuting = np.linalg.inv(Sigma + 0.7 * np.eye(d))  # a function of Σ
    np.testing.assert_allclose(printed(commuting), autodiff(commuting), rtol=1e-10, atol=1e-12)


# -------------------------------------------------------- Thm 2: γ*, corrected P*, global minimum

FIXED_POINT_CASES = [
    dict(seed=10, d=4, n=6, sigma2=0.3, spread=1.0, rank=None),
    dict(seed=11, d=3, n=5, sigma2=0.0, spread=1.5, rank=3),
    dict(seed=12, d=2, n=8, sigma2=1.0, spread=2.5, rank=None),  # violates (16)
]


@pytest.mark.parametrize("case", FIXED_POINT_CASES)
def test_gamma_star_corrected_P_is_the_global_minimum(case):
    Sigma, R, r, sigma2 = random_problem(case["seed"], case["d"], case["n"], case["sigma2"],
                                         case["spread"], case["rank"])
    opt = W.wpgd_optimum(Sigma, R, r, sigma2)
    # fixed point of h1∘h2 + 1, and γ is what it stands for: 1 + ωᵀRω/‖ω‖² at ω*
    assert abs(float(W.fixed_point_map(opt.gamma, Sigma, R, r, sigma2)) - opt.gamma) < 1e-12
    assert opt.gamma >= 1.0
    np.testing.assert_allclose(opt.gamma, 1 + opt.omega @ R @ opt.omega / (opt.omega @ opt.omega), rtol=1e-12)
    # corrected P* with the eq 53-54 scale is stationary for eq 37 (autodiff, not eqs 40-41)
    gP, gw = jax.grad(W.wpgd_risk, argnums=(0, 1))(jnp.asarray(opt.P), jnp.asarray(opt.omega), Sigma, R, r, sigma2)
    scale = np.trace(Sigma) + sigma2
    assert np.max(np.abs(gP)) < 1e-10 * scale and np.max(np.abs(gw)) < 1e-10 * scale
    np.testing.assert_allclose(float(W.wpgd_risk(opt.P, opt.omega, Sigma, R, r, sigma2)), opt.risk, rtol=1e-12)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, n_restarts=6, seed=case["seed"])
    np.testing.assert_allclose(opt.risk, num.risk, rtol=1e-8)
    assert opt.risk <= num.restart_risks.min() * (1 + 1e-10)  # no restart beats the closed form


def test_isotropic_case_cor1_and_eq17():
    d, n, sigma2 = 5, 6, 0.4
    _, R, r, _ = random_problem(20, d, n, sigma2)
    Sigma = np.eye(d)
    sp = W.spectra(Sigma, R, r, sigma2)
    grid = np.linspace(1.0, 1.0 + n, 50)
    np.testing.assert_allclose(W.h2(grid, sp.s, sp.M), 1.0 / (d + sigma2 + 1.0), rtol=1e-13)
    opt = W.wpgd_optimum(Sigma, R, r, sigma2)
    np.testing.assert_allclose(opt.P, opt.P[0, 0] * np.eye(d), atol=1e-13)
    w_cor1 = np.linalg.solve(R + (d + sigma2 + 1) * np.eye(n), r)
    np.testing.assert_allclose(opt.omega / np.linalg.norm(opt.omega), w_cor1 / np.linalg.norm(w_cor1), atol=1e-12)
    np.testing.assert_allclose(opt.risk, W.wpgd_optimal_risk_isotropic(d, R, r, sigma2), rtol=1e-12)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, n_restarts=4, seed=1)
    np.testing.assert_allclose(W.wpgd_optimal_risk_isotropic(d, R, r, sigma2), num.risk, rtol=1e-8)


@pytest.mark.parametrize("seed", [30, 31])
def test_printed_eq15_preconditioner_is_not_stationary(seed):
    """ERRATUM: eq 15's Σ^{-1/2}(γ*Σ/M + I)^{-1}Σ^{-1/2} is not a stationary point when Σ ≠ I."""
    d, n, sigma2 = 4, 6, 0.3
    Sigma, R, r, _ = random_problem(seed, d, n, sigma2, spread=1.0)
    opt = W.wpgd_optimum(Sigma, R, r, sigma2)
    P_printed = W.optimal_preconditioner_as_printed(Sigma, gamma=opt.gamma, sigma2=sigma2)
    t, risk_printed = W.optimal_scale(P_printed, opt.omega, Sigma, R, r, sigma2)
    gP = jax.grad(W.wpgd_risk)(jnp.asarray(t * P_printed), jnp.asarray(opt.omega), Sigma, R, r, sigma2)
    assert np.max(np.abs(gP)) > 1e-3
    # Even the best ω (and scale) for the printed P direction stays above L*: for a fixed
    # direction P, min over tω of (37) is M − tr(Σ²P)² rᵀQ⁻¹r, Q = (M a + b)I + bR.
    M = np.trace(Sigma) + sigma2
    a = np.trace(Sigma @ P_printed.T @ Sigma @ P_printed)
    b = np.trace(Sigma @ Sigma @ P_printed.T @ Sigma @ P_printed)
    best_for_printed = M - np.trace(Sigma @ Sigma @ P_printed) ** 2 * r @ np.linalg.solve((M * a + b) * np.eye(n) + b * R, r)
    assert risk_printed >= best_for_printed > opt.risk * (1 + 1e-3)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, n_restarts=3, seed=0)
    np.testing.assert_allclose(opt.risk, num.risk, rtol=1e-8)
    # Control: for Σ = cI the printed form is the corrected one up to scale, hence optimal.
    Sc = 2.5 * np.eye(d)
    optc = W.wpgd_optimum(Sc, R, r, sigma2)
    _, risk_c = W.optimal_scale(W.optimal_preconditioner_as_printed(Sc, gamma=optc.gamma, sigma2=sigma2), optc.omega, Sc,
                                R, r, sigma2)
    np.testing.assert_allclose(risk_c, optc.risk, rtol=1e-12)


def test_optimal_preconditioner_given_weights_is_stationary_in_P():
    d, n = 3, 5
    Sigma, R, r, sigma2 = random_problem(40, d, n, 0.5)
    omega = np.random.default_rng(41).normal(size=n)
    P = W.optimal_preconditioner_given_weights(omega, Sigma, R, r, sigma2)
    gP = jax.grad(W.wpgd_risk)(jnp.asarray(P), jnp.asarray(omega), Sigma, R, r, sigma2)
    assert np.max(np.abs(gP)) < 1e-12
    np.testing.assert_allclose(W.risk_given_weights(omega, Sigma, R, r, sigma2),
                               float(W.wpgd_risk(P, omega, Sigma, R, r, sigma2)), rtol=1e-12)


# ------------------------------------------------------------------------ Thm 3 / Lemma 2 (eq 16)


def test_eq16_contraction_bound_and_convergence():
    rng = np.random.default_rng(50)
    df = jax.vmap(jax.grad(lambda g, s, M, lam, a: W.h1(W.h2(g, s, M), lam, a)), in_axes=(0,) + (None,) * 4)
    grid = jnp.linspace(1.0, 40.0, 200)
    checked = 0
    d, n = 4, 5  # fixed shapes: one trace of the autodiff slope for all cases
    while checked < 25:
        Sigma = random_covariance(rng, d, rng.uniform(0.0, 2.0))
        C = random_correlation(rng, n + 1, rng.integers(1, n + 2))
        R, r, sigma2 = C[:n, :n], C[:n, n], rng.uniform(0.0, 1.0)
        if not W.uniqueness_condition(Sigma, R, sigma2):
            continue
        checked += 1
        bound = W.contraction_bound(Sigma, R, sigma2)
        assert bound < 1.0
        sp = W.spectra(Sigma, R, r, sigma2)
        slope = np.abs(np.asarray(df(grid, sp.s, sp.M, sp.lam, sp.a)))
        assert slope.max() <= bound * (1 + 1e-9) + 1e-15
        fps = W.fixed_points(Sigma, R, r, sigma2)
        assert fps.size == 1  # T1: unique fixed point
        for g0 in (1.0, 5.0, 50.0):
            g, _, ok = W.fixed_point_iteration(g0, Sigma, R, r, sigma2)
            assert ok and abs(g - fps[0]) < 1e-10


def _rotated(eigenvalues, seed):
    """Q diag(eigenvalues) Qᵀ for a random orthogonal Q: a matrix whose spectrum is known by construction."""
    Q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(len(eigenvalues),) * 2))
    return (Q * np.asarray(eigenvalues, dtype=float)) @ Q.T


@pytest.mark.parametrize("s, R, sigma2, expected", [
    # Σ spectrum {1, 3}: Δ_Σ = 2, s_min = 1; R = [[1, .5], [.5, 1]] has eigenvalues {0.5, 1.5}: Δ_R = 1;
    # M = tr Σ + σ² = 4 + 1 = 5, so Δ_Σ²Δ_R²/(M + s_min)² = 4/36 = 1/9. The ratio 1/3 ≠ 1 keeps the slips
    # apart: no square 1/3, numerator squared only 4/6, denominator squared only 2/36.
    ([1.0, 3.0], [[1.0, 0.5], [0.5, 1.0]], 1.0, 1.0 / 9.0),
    # Σ spectrum {0.5, 1.5, 2.5}: Δ_Σ = 2, s_min = 0.5; R = [[1,1,0],[1,1,0],[0,0,1]] has eigenvalues
    # {2, 1, 0}: Δ_R = 2 − 1 = 1 over the nonzero ones (2 with the zero); M = 4.5 + 0.5 = 5, so
    # 2²·1²/(5 + 0.5)² = 4/30.25. Without the square 2/5.5; with the zero eigenvalue 16/30.25.
    ([0.5, 1.5, 2.5], [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], 0.5, 4.0 / 30.25),
], ids=["d2-full-rank-R", "d3-singular-R"])
def test_contraction_bound_value(s, R, sigma2, expected):
    """Lemma 2's bound Δ_Σ²Δ_R²/(M + s_min)² on spectra chosen by hand (Σ rotated so it is not diagonal)."""
    Sigma = _rotated(s, seed=len(s))
    assert W.contraction_bound(Sigma, np.asarray(R), sigma2) == pytest.approx(expected, rel=1e-12)


def test_spectral_gap_uses_nonzero_eigenvalues():
    R, _ = W.two_task_correlation(4, r1=0.0, r2=1.0)  # eigenvalues {4, 4, 0, ..., 0}
    dS, dR = W.spectral_gaps(np.diag([1.0, 3.0]), R)
    assert dS == pytest.approx(2.0) and dR == pytest.approx(0.0, abs=1e-12)
    # (16) can fail: Δ_Σ Δ_R = 20·(1.9 − 0.1) = 36 ≥ M + s_min = 20.3
    assert not W.uniqueness_condition(np.diag([0.1, 20.1]), np.array([[1.0, 0.9], [0.9, 1.0]]), 0.0)
    assert W.uniqueness_condition(np.diag([0.1, 20.1]), np.array([[1.0, 0.5], [0.5, 1.0]]), 0.0)  # 20 < 20.3


# --------------------------------------------------------------------- Cor 2: linear attention (24)


def test_eq24_equals_eq37_at_omega_one():
    d, n, sigma2 = 4, 5, 0.3
    _, R, r, _ = random_problem(60, d, n, sigma2)
    c = r.sum() / (n * (d + sigma2 + 1) + R.sum())  # Cor 2's P* = cI
    L37 = float(W.wpgd_risk(c * np.eye(d), np.ones(n), np.eye(d), R, r, sigma2))
    np.testing.assert_allclose(W.linear_attention_risk_isotropic(d, R, r, sigma2), L37, rtol=1e-12)
    np.testing.assert_allclose(W.linear_attention_risk(np.eye(d), R, r, sigma2), L37, rtol=1e-12)
    # general Σ: closed form min_P L(P, 1) against L-BFGS over (P, ω ∝ 1)
    Sigma, R, r, sigma2 = random_problem(61, d, n, sigma2)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, block_sizes=[n], n_restarts=3, seed=2)
    np.testing.assert_allclose(W.linear_attention_risk(Sigma, R, r, sigma2), num.risk, rtol=1e-8)


# ------------------------------------------------------------------ reference table (normalised by d)
# d = 10, σ = 0, Σ = I, two independent tasks of n̄ samples; with c = d + σ² + 1 the equal-n̄ closed forms (derived
# by hand) are eq 17 / d = 1 − n̄ Σ_k r_k²/(n̄ + c) and eq 24 / d = 1 − n̄ (Σ_k r_k)²/(K(n̄ + c)).

N_BARS = [1, 5, 10, 20, 50]
TABLE_WPGD = {  # eq 17 / d
    (0.0, 1.0): [0.9167, 0.6875, 0.5238, 0.3548, 0.1803],
    (0.2, 0.8): [0.9433, 0.7875, 0.6762, 0.5613, 0.4426],
    (0.8, 0.2): [0.9433, 0.7875, 0.6762, 0.5613, 0.4426],
}
TABLE_ATT = [0.9583, 0.8438, 0.7619, 0.6774, 0.5902]  # eq 24 / d, all four panels
TABLE_WPGD[(0.5, 0.5)] = TABLE_ATT  # (.5,.5): WPGD = ATT = GLA


@pytest.mark.parametrize("r1, r2", [(0.0, 1.0), (0.2, 0.8), (0.5, 0.5), (0.8, 0.2)])
def test_experiment_table(r1, r2):
    d, sigma2, Sigma = 10, 0.0, np.eye(10)
    for k, n_bar in enumerate(N_BARS):
        R, r = W.two_task_correlation(n_bar, r1=r1, r2=r2)
        wpgd, att = TABLE_WPGD[(r1, r2)][k], TABLE_ATT[k]
        gla = wpgd if r1 <= r2 else att  # Thm 4 (K = 2): scalar GLA = WPGD iff r₁ ≤ r₂
        got = {
            "eq17": W.wpgd_optimal_risk_isotropic(d, R, r, sigma2),
            "wpgd": W.wpgd_optimal_risk(Sigma, R, r, sigma2),
            "vector": W.vector_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 2).risk,
            "eq24": W.linear_attention_risk_isotropic(d, R, r, sigma2),
            "att": W.linear_attention_risk(Sigma, R, r, sigma2),
            "eq22": W.scalar_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 2).risk,
        }
        want = dict(eq17=wpgd, wpgd=wpgd, vector=wpgd, eq24=att, att=att, eq22=gla)
        for key in got:
            assert abs(got[key] / d - want[key]) < 1e-4, (key, n_bar, got[key] / d, want[key])
        assert got["eq17"] <= got["eq24"] + 1e-12
        if r1 != r2:  # equality iff ω* ∝ 1
            assert got["eq17"] < got["eq24"] - 1e-6


def test_eq22_two_tasks_against_numerical_constrained_minimum():
    d, n_bar, sigma2, Sigma = 10, 3, 0.0, np.eye(10)
    R, r = W.two_task_correlation(n_bar, r1=0.8, r2=0.2)
    eq22 = W.scalar_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 2)
    np.testing.assert_allclose(eq22.risk, W.linear_attention_risk_isotropic(d, R, r, sigma2), rtol=1e-12)
    assert eq22.omega_blocks.tolist() == pytest.approx([1.0, 1.0])  # the two blocks pool; normalised to max 1
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, block_sizes=[n_bar] * 2, monotone=True, n_restarts=4)
    np.testing.assert_allclose(eq22.risk, num.risk, rtol=1e-8)
    R, r = W.two_task_correlation(n_bar, r1=0.2, r2=0.8)
    np.testing.assert_allclose(W.scalar_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 2).risk,
                               W.wpgd_optimal_risk_isotropic(d, R, r, sigma2), rtol=1e-12)


# ------------------------------------------------------------------- Thms 4-5 beyond two tasks


def test_thm4_equality_case_general_sigma():
    """Assumption 3 + equal blocks ⇒ eq 22 = L*_WPGD and ω* = r/(h₂(γ*) n̄ + 1), for any Σ."""
    d, n_bar, sigma2 = 3, 2, 0.2
    task_R, task_r = np.eye(3), np.array([0.1, 0.3, 0.6])
    assert W.assumption3_holds(task_R, task_r)
    R, r = W.multitask_correlation([n_bar] * 3, task_R, task_r)
    Sigma = random_covariance(np.random.default_rng(70), d, 1.0)
    opt = W.wpgd_optimum(Sigma, R, r, sigma2)
    np.testing.assert_allclose(opt.omega, r / (opt.h2 * n_bar + 1), rtol=1e-12)
    eq22 = W.scalar_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 3)
    np.testing.assert_allclose(eq22.risk, opt.risk, rtol=1e-12)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, block_sizes=[n_bar] * 3, monotone=True, n_restarts=4)
    np.testing.assert_allclose(eq22.risk, num.risk, rtol=1e-8)


def test_eq22_three_tasks_lies_strictly_between():
    """Derived here: for K ≥ 3 the binding blocks pool and eq 22 can fall strictly between (17) and (24)."""
    d, n_bar, sigma2, Sigma = 4, 3, 0.1, np.eye(4)
    task_R, task_r = np.eye(3), np.array([0.5, 0.1, 0.6])
    assert not W.assumption3_holds(task_R, task_r)
    R, r = W.multitask_correlation([n_bar] * 3, task_R, task_r)
    eq22 = W.scalar_gating_optimum(Sigma, R, r, sigma2, [n_bar] * 3)
    l17, l24 = W.wpgd_optimal_risk_isotropic(d, R, r, sigma2), W.linear_attention_risk_isotropic(d, R, r, sigma2)
    assert l17 + 1e-3 < eq22.risk < l24 - 1e-3
    assert np.all(np.diff(eq22.omega_blocks) >= -1e-12) and eq22.omega_blocks[0] >= 0
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, block_sizes=[n_bar] * 3, monotone=True, n_restarts=6)
    np.testing.assert_allclose(eq22.risk, num.risk, rtol=1e-8)


@pytest.mark.parametrize("seed", [80, 81, 82])
def test_vector_gating_beats_scalar_and_reaches_wpgd(seed):
    """Thm 5: vector gating = L*_WPGD ≤ scalar gating (eq 22), with correlated tasks and unequal blocks."""
    rng = np.random.default_rng(seed)
    d, blocks, sigma2 = 3, [2, 1, 3], 0.3
    Sigma = random_covariance(rng, d, 1.0)
    C = random_correlation(rng, 4)
    R, r = W.multitask_correlation(blocks, C[:3, :3], C[:3, 3])
    vec = W.vector_gating_optimum(Sigma, R, r, sigma2, blocks)
    sca = W.scalar_gating_optimum(Sigma, R, r, sigma2, blocks)
    assert vec.risk <= sca.risk + 1e-12
    np.testing.assert_allclose(vec.risk, W.wpgd_optimal_risk(Sigma, R, r, sigma2), rtol=1e-10)
    num = W.wpgd_numerical_minimum(Sigma, R, r, sigma2, block_sizes=blocks, monotone=True, n_restarts=4, seed=seed)
    np.testing.assert_allclose(sca.risk, num.risk, rtol=1e-8)


@pytest.mark.parametrize("monotone", [True, False])
def test_block_weights_are_normalised_and_P_carries_the_scale(monotone):
    """GatingOptimum: max_k |w_k| = 1 (scalar gating: 0 ≤ w_1 ≤ … ≤ w_K = 1), ω = Bw, and (P, ω) attains the risk."""
    rng = np.random.default_rng(90)
    d, blocks, sigma2 = 3, [2, 1, 3], 0.3
    Sigma = random_covariance(rng, d, 1.0)
    C = random_correlation(rng, 4)
    R, r = W.multitask_correlation(blocks, C[:3, :3], C[:3, 3])
    opt = (W.scalar_gating_optimum if monotone else W.vector_gating_optimum)(Sigma, R, r, sigma2, blocks)
    w = opt.omega_blocks
    assert np.max(np.abs(w)) == pytest.approx(1.0, abs=1e-15)
    if monotone:
        assert w[-1] == 1.0 and w[0] >= 0 and np.all(np.diff(w) >= 0)
    np.testing.assert_array_equal(opt.omega, np.repeat(w, blocks))
    np.testing.assert_allclose(float(W.wpgd_risk(opt.P, opt.omega, Sigma, R, r, sigma2)), opt.risk, rtol=1e-12)
    gP = jax.grad(W.wpgd_risk)(jnp.asarray(opt.P), jnp.asarray(opt.omega), Sigma, R, r, sigma2)
    assert np.max(np.abs(gP)) < 1e-12


def test_isotropic_forms_take_d_in_the_place_of_sigma():
    d, sigma2 = 3, 0.2
    _, R, r, _ = random_problem(21, d, 4, sigma2)
    assert W.wpgd_optimal_risk_isotropic(d, R, r, sigma2) == pytest.approx(
        W.wpgd_optimal_risk(np.eye(d), R, r, sigma2), rel=1e-12)
    assert W.linear_attention_risk_isotropic(d, R, r, sigma2) == pytest.approx(
        W.linear_attention_risk(np.eye(d), R, r, sigma2), rel=1e-12)


# ----------------------------------------------------------------------------- data-model errors


def test_multitask_helpers_reject_invalid():
    with pytest.raises(ValueError, match=r"r1² \+ r2² <= 1"):
        W.two_task_correlation(3, r1=0.8, r2=0.8)
    with pytest.raises(ValueError, match="n_bar must be an integer >= 1"):
        W.two_task_correlation(0, r1=0.1, r2=0.2)
    with pytest.raises(ValueError, match="block_sizes"):
        W.multitask_correlation([2, 0], np.eye(2), np.zeros(2))
    with pytest.raises(ValueError, match="task_R must have shape"):
        W.multitask_correlation([2, 2], np.eye(3), np.zeros(3))
    with pytest.raises(ValueError, match="task_r must have shape"):
        W.multitask_correlation([2, 2], np.eye(2), np.zeros(3))
    with pytest.raises(ValueError, match="r must be nonzero"):
        W.wpgd_optimum(np.eye(2), np.eye(3), np.zeros(3), 0.0)
