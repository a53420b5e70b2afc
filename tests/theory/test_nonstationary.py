"""The exponential-weights risk for any task autocovariance: equal to the drift paper's Theorem 2 at AR(1)
(to rounding), against Monte Carlo of the same predictor (4 SE) for a rotation, a trend and AR(1) with label
noise and under abrupt task switches, the best readout minimising the quadratic, and the Kalman filter's
Bayes risk below it."""

import jax
import numpy as np
import pytest

import iclab.theory.drift as drift
from iclab import baselines as bl
from iclab.tasks import state_space as ss
from iclab.theory import nonstationary as ns

LAM2 = np.array([[1.0, 0.4], [0.4, 0.6]])
LAM4 = np.array([[1.0, 0.3, 0.0, 0.1], [0.3, 0.8, 0.2, 0.0], [0.0, 0.2, 0.6, 0.1], [0.1, 0.0, 0.1, 0.4]])


@pytest.mark.parametrize("gamma,sigma_w2,sigma_e2", [(0.9, 1.0, 0.1), (1.0, 1.0, 0.02), (1.1, 0.5, 0.3)])
def test_ar1_is_theorem2(gamma, sigma_w2, sigma_e2):
    setting = dict(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2)
    n, Lam = 10, LAM4
    C = ss.task_autocovariance(ss.ar1_process(4, **setting), n=n)
    c = drift.ar1_covariance(**setting, n=n)
    lams = np.array([0.2, 0.6, gamma, 0.95, 1.0, 1.05])
    want = drift.train_error(lams, **setting, n=n, Lam=Lam)
    np.testing.assert_allclose(ns.exponential_weights_risk(lams, C=C, Lam=Lam), want, rtol=1e-12)
    np.testing.assert_allclose(ns.exponential_weights_risk(lams, C=c, Lam=Lam), want, rtol=1e-12)  # isotropic form
    # the best readout is the trained GLA's D1 Λ̃⁻¹ (eq 14)
    D1, D2, D3, _ = drift.D_sums(0.8, **setting, n=n)
    np.testing.assert_allclose(ns.exponential_weights_readout(0.8, C=C, Lam=Lam),
                               D1 * np.linalg.inv(drift.Lam_tilde(Lam, D2=D2, D3=D3)), rtol=1e-11, atol=1e-13)
    got = ns.optimal_exponential_forget_factor(C=c, Lam=Lam, bounds=(1e-3, 1.2))
    ref = drift.optimal_forget_factor(**setting, n=n, Lam=Lam, bounds=(1e-3, 1.2))
    np.testing.assert_allclose(got, ref, rtol=1e-7)
    # label noise adds σ² to the target and σ² Σω² Λ to E[GGᵀ]: the risk rises by more than σ²
    assert ns.exponential_weights_risk(0.8, C=c, Lam=Lam, sigma2=0.2) > ns.exponential_weights_risk(0.8, C=c, Lam=Lam) + 0.2


def test_best_readout_minimises_the_quadratic():
    p = ss.rotation_process(4, omega=0.5, sigma_w2=1.0, sigma_e2=0.05)
    C, kw = ss.task_autocovariance(p, n=8), dict(Lam=LAM4, sigma2=0.1)
    G = ns.exponential_weights_readout(0.85, C=C, **kw)
    best = ns.exponential_weights_risk(0.85, C=C, **kw)
    np.testing.assert_allclose(ns.exponential_weights_risk(0.85, C=C, **kw, Gamma=G), best, rtol=1e-12)
    rng = np.random.default_rng(0)
    M = ns.exponential_weights_moments(0.85, C=C, **kw).M
    for _ in range(3):  # R(Γ* + E) − R(Γ*) = tr(Λ E M Eᵀ) > 0 exactly (a quadratic with no linear term at Γ*)
        E = 0.1 * rng.standard_normal((4, 4))
        np.testing.assert_allclose(ns.exponential_weights_risk(0.85, C=C, **kw, Gamma=G + E) - best,
                                   np.trace(LAM4 @ E @ M @ E.T), rtol=1e-8)
    lams = np.array([0.5, 0.85, 1.0])
    np.testing.assert_allclose(ns.exponential_weights_risk(lams, C=C, **kw),
                               [ns.exponential_weights_risk(v, C=C, **kw) for v in lams], rtol=1e-13)


CASES = {  # process, Λ, σ², λ
    "rotation": (ss.rotation_process(4, omega=0.5, sigma_w2=1.0, sigma_e2=0.05, gamma=0.97), LAM4, 0.1, 0.8),
    "trend": (ss.trend_process(2, sigma_w2=1.0, sigma_v2=0.1, sigma_e2=0.02, sigma_u2=0.005), LAM2, 0.05, 0.7),
    "ar1": (ss.ar1_process(2, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1), LAM2, 0.2, 0.85),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_risk_matches_monte_carlo_of_the_predictor(name):
    """ŷ = x_{n+1}ᵀ Γ Σ λ^{n+1−i} y_i x_i with Γ* and with a fixed Γ, 20000 prompts, each within 4 SE."""
    p, Lam, sigma2, lam = CASES[name]
    n = 8
    C = ss.task_autocovariance(p, n=n)
    pr = ss.sample_state_space_prompts(jax.random.PRNGKey(11), 20000, p, n=n, Lam=Lam, sigma2=sigma2)
    x, y = np.asarray(pr.x), np.asarray(pr.y)
    om = lam ** np.arange(n, 0, -1.0)
    G = np.einsum("i,bi,bid->bd", om, y[:, :n], x[:, :n])
    for Gamma in (ns.exponential_weights_readout(lam, C=C, Lam=Lam, sigma2=sigma2), 0.3 * np.eye(p.d)):
        err = (np.einsum("bd,de,be->b", x[:, n], Gamma, G) - y[:, n]) ** 2
        want = ns.exponential_weights_risk(lam, C=C, Lam=Lam, sigma2=sigma2, Gamma=Gamma)
        assert abs(err.mean() - want) < 4 * err.std(ddof=1) / np.sqrt(err.size), (err.mean(), want)


def test_the_kalman_filter_beats_the_best_forget_factor_on_a_rotation():
    """The Bayes risk (Monte Carlo over contexts of the exact conditional risk) lies below R*(λ*) by many SE."""
    p, n, sigma2 = ss.rotation_process(4, omega=0.5, sigma_w2=1.0, sigma_e2=0.05, gamma=0.97), 12, 0.1
    lam_star, best = ns.optimal_exponential_forget_factor(C=ss.task_autocovariance(p, n=n), Lam=LAM4, sigma2=sigma2)
    assert 0.001 < lam_star < 1.0
    x = ss.sample_state_space_prompts(jax.random.PRNGKey(5), 2000, p, n=n, Lam=LAM4).x
    bayes = np.asarray(bl.state_space_bayes_risk(x, **p._asdict(), Lam=LAM4, sigma2=sigma2))[:, -1]
    assert best - bayes.mean() > 4 * bayes.std(ddof=1) / np.sqrt(bayes.size)


@pytest.mark.parametrize("kw,field", [
    (dict(lam=0.0), "lam"), (dict(C=np.zeros((1, 1))), "C"), (dict(C=np.zeros((4, 4, 3, 3))), "C"),
    (dict(Lam=-np.eye(2)), "Lam"), (dict(sigma2=-1.0), "sigma2")])
def test_bad_input_names_the_field(kw, field):
    args = dict(lam=0.5, C=np.ones((4, 4)), Lam=np.eye(2), sigma2=0.0) | kw
    with pytest.raises(ValueError, match=f"^{field}:"):
        ns.exponential_weights_risk(args.pop("lam"), **args)


@pytest.mark.parametrize("prior", ["scalar", "matrix"])
def test_risk_matches_monte_carlo_under_abrupt_switches(prior):
    """The same formula under the switching task (w redrawn from N(0, Σ_w) with hazard h): its autocovariance
    (1 − h)^{|i−j|} Σ_w is all the formula reads, although the tasks are not Gaussian as a process (a mixture
    over switch times); Monte Carlo of the predictor, 20000 prompts, within 4 SE, at Γ* and at a fixed Γ."""
    from iclab.tasks import switching as sw

    n, h, sigma2, lam = 8, 0.2, 0.1, 0.75
    Sw = 1.0 if prior == "scalar" else np.array([[1.0, 0.5], [0.5, 0.8]])
    C = sw.switching_autocovariance(hazard=h, n=n, prior_cov=Sw)
    pr = sw.sample_switching_prompts(jax.random.PRNGKey(13), 20000, hazard=h, prior_cov=Sw, sigma2=sigma2, n=n,
                                     Lam=LAM2)
    x, y = np.asarray(pr.x), np.asarray(pr.y)
    om = lam ** np.arange(n, 0, -1.0)
    G = np.einsum("i,bi,bid->bd", om, y[:, :n], x[:, :n])
    for Gamma in (ns.exponential_weights_readout(lam, C=C, Lam=LAM2, sigma2=sigma2), 0.3 * np.eye(2)):
        err = (np.einsum("bd,de,be->b", x[:, n], Gamma, G) - y[:, n]) ** 2
        want = ns.exponential_weights_risk(lam, C=C, Lam=LAM2, sigma2=sigma2, Gamma=Gamma)
        assert abs(err.mean() - want) < 4 * err.std(ddof=1) / np.sqrt(err.size), (err.mean(), want)
