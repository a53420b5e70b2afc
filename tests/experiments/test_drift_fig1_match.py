"""drift.fig1, algorithm match: trained GLA against eq 15's predictor and the Kalman filter on held-out prompts.

At Theorem 1's weights the model IS eq 15's predictor (gap 0, cosine 1); away from them the held-out gap is the
exact excess error (the class is linear in u₋₁U₁₁); the checks pass on consistent arrays and fail when a
claim is broken.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments.drift import _common, fig1
from iclab.theory import drift as theory

TINY = dict(d=3, n=8, gammas=[0.9, 0.95], lams=[0.8, 0.9, 1.0], lam_bars=[0.8, 0.9, 1.0], test_ms=[4, 8],
            steps=4, batch=8, record_every=2, n_eval=100)


@pytest.fixture(scope="module")
def held_out():
    config = fig1.Fig1Config(**TINY)
    Z, y = _common.eval_prompts(config, jax.random.PRNGKey(5), 4000, 0.95)
    return config, Z, y


@pytest.mark.slow  # mostly compiling the vmapped Jacobians
def test_eq15_match_is_exact_at_theorem_1_and_the_excess_error_away_from_it(held_out):
    config, Z, y = held_out
    lam, gamma = 0.9, 0.95
    D1, D2, D3, _ = theory.D_sums(lam, gamma=gamma, **config.process())
    U11, u = theory.optimal_restricted(D1=D1, Lam_t=theory.Lam_tilde(config.Lam(), D2=D2, D3=D3))
    R = np.random.default_rng(0).standard_normal((3, 3))
    U_off = U11 + 0.2 * np.linalg.norm(U11) / np.linalg.norm(R) * R  # not symmetric: tests the transpose convention
    params = {"U11": jnp.asarray(np.stack([U11, U_off])), "u_m1": jnp.asarray([u, u])}
    m = _common.eq15_algorithm_match(config, params, [lam, lam], gamma, Z, y)
    E = theory.train_error(lam, **config.setting(gamma))
    assert m["gap"][0] < 1e-20 * E and m["cosine"][0] == pytest.approx(1.0, abs=1e-12)
    excess = theory.restricted_error(U_off, u, lam=lam, gamma=gamma, **config.process(), Lam=config.Lam()) - E
    assert excess > 0.01 * E  # a perturbation the gap must see
    assert abs(m["gap"][1] - excess) < 4 * m["gap_se"][1]  # Pythagoras: ŷ is linear in u₋₁U₁₁
    assert m["cosine"][1] < 0.99
    assert abs(m["alg_risk"][0] - E) < 4 * m["alg_risk_se"][0]  # eq 15's Monte Carlo error = Theorem 2


@pytest.mark.slow  # shares the held-out prompts of the test above
def test_kalman_risk_is_the_monte_carlo_error_of_the_filter_and_below_eq15(held_out):
    config, Z, y = held_out
    gamma = 0.95
    k = _common.kalman_risk(config, gamma, Z, y)
    assert abs(k["mc_minus_bayes"]) < 4 * k["mc_minus_bayes_se"]
    assert abs(k["bayes_mc"] - k["bayes"]) < 4 * k["bayes_mc_se"]
    v = theory.ar1_covariance(gamma=gamma, **config.process())[-1, -1]  # prior variance of w_{n+1}
    assert config.sigma_e2 * config.d <= k["bayes"] <= v * config.d  # σ_e² trΛ ≤ risk ≤ v_{n+1} trΛ
    E_star = theory.optimal_forget_factor(**config.setting(gamma))[1]
    assert k["bayes"] < E_star  # the Bayes predictor beats the best GLA of this setting


def _arrays(config):
    gam, lams = np.asarray(config.gammas), np.asarray(config.lams)
    E = np.stack([theory.train_error(lams, **config.setting(g)) for g in gam])
    S, G, K = 1, gam.size, lams.size
    return {
        "gammas": gam, "lams": lams, "theory_grid": E, "exact_eval": np.bool_(True),
        "lam_star": np.array([theory.optimal_forget_factor(**config.setting(g))[0] for g in gam]),
        "trained_err": E[None].copy(), "trained_err_se": np.zeros((S, G, K)),
        "match_gap": np.full((S, G, K), 1e-6), "match_gap_se": np.full((S, G, K), 1e-6),
        "match_cosine": np.full((S, G, K), 0.999), "match_cosine_se": np.zeros((S, G, K)),
        "kalman_risk": 0.8 * E.min(axis=1), "kalman_risk_se": np.full(G, 1e-3),
        "kalman_mc_diff": np.zeros(G), "kalman_mc_diff_se": np.full(G, 1e-3),
    }


def test_match_checks_pass_on_consistent_arrays_and_fail_when_a_claim_breaks():
    config = fig1.Fig1Config(**TINY)
    r = _arrays(config)
    checks = fig1._match_checks(config, r)
    assert len(checks) == 5 and all(c.passed for c in checks), [c.name for c in checks if not c.passed]

    def failed(**change):
        return [c.name for c in fig1._match_checks(config, {**r, **change}) if not c.passed]

    E = r["theory_grid"]
    # a 5 % gap at λ*, consistent with a 5 % excess error: the gap check fails, the Pythagoras check does not
    f = failed(match_gap=0.05 * E[None], match_gap_se=1e-3 * E[None], trained_err=1.05 * E[None])
    assert len(f) == 1 and f[0].startswith("(a) trained GLA at λ* = eq 15's predictor on held-out prompts")
    f = failed(match_cosine=np.full_like(r["match_cosine"], 0.98))
    assert len(f) == 1 and "cosine" in f[0]
    f = failed(match_gap=0.02 * E[None], match_gap_se=1e-4 * E[None])  # gap without the excess error it implies
    assert len(f) == 1 and f[0].startswith("(a) held-out gap = exact excess error")
    f = failed(kalman_mc_diff=np.full(2, 0.01))
    assert len(f) == 1 and f[0].startswith("(a) Kalman filter's Monte Carlo error")
    f = failed(kalman_risk=1.1 * E.max(axis=1))  # a trained model below the Bayes risk
    assert len(f) == 1 and f[0].startswith("(a) no trained GLA beats the Bayes risk")
    assert fig1._match_checks(config, {k: v for k, v in r.items() if not k.startswith("match_")}) == []
