"""The switching task (iclab.tasks.switching): its empirical task autocovariance against the exact
C(i, j) = (1 − h)^{|i−j|} Σ_w, the switch frequency, the label noise, the limits h = 0 and h = 1, by Monte Carlo
at a stated number of standard errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.errors import ConfigError
from iclab.tasks import drift
from iclab.tasks import switching as sw
from iclab.theory import drift as theory

D, N = 2, 5


def test_empirical_autocovariance_matches_the_formula():
    h, B = 0.3, 20_000
    Sigma = np.array([[1.5, 0.6], [0.6, 0.8]])
    w = np.asarray(sw.sample_switching_tasks(jax.random.PRNGKey(0), B, D, hazard=h, prior_cov=Sigma, n=N))
    assert w.shape == (B, N + 1, D)
    prod = np.einsum("bia,bjc->bijac", w, w)  # w_i w_jᵀ per prompt
    emp, se = prod.mean(0), prod.std(0, ddof=1) / np.sqrt(B)
    C = sw.switching_autocovariance(hazard=h, n=N, prior_cov=Sigma)
    assert C.shape == (N + 1, N + 1, D, D)
    # 196 entries: 5 SE each keeps a spurious failure of the whole test below 1e-4 (Bonferroni)
    assert np.all(np.abs(emp - C) < 5 * se)
    # the scalar form is drift's AR(1) covariance (Lemma 1) at γ = 1 − h with the stationary σ_e² = σ_w²(1 − γ²)
    c = sw.switching_autocovariance(hazard=h, n=N, prior_cov=2.0)
    np.testing.assert_allclose(c, theory.ar1_covariance(gamma=1 - h, sigma_w2=2.0, sigma_e2=2.0 * (1 - (1 - h) ** 2),
                                                        n=N), rtol=1e-13)
    np.testing.assert_array_equal(sw.switching_autocovariance(hazard=0.0, n=N), np.ones((N + 1, N + 1)))
    np.testing.assert_array_equal(sw.switching_autocovariance(hazard=1.0, n=N), np.eye(N + 1))


def test_switches_happen_with_probability_h_and_the_limits():
    h, B = 0.2, 20_000
    w = np.asarray(sw.sample_switching_tasks(jax.random.PRNGKey(1), B, D, hazard=h, n=N))
    switched = np.any(w[:, 1:] != w[:, :-1], axis=-1)  # a fresh Gaussian draw never repeats the old one
    assert abs(switched.mean() - h) < 4 * np.sqrt(h * (1 - h) / switched.size)
    kept = np.asarray(sw.sample_switching_tasks(jax.random.PRNGKey(1), 50, D, hazard=0.0, n=N))
    np.testing.assert_array_equal(kept, np.broadcast_to(kept[:, :1], kept.shape))
    fresh = np.asarray(sw.sample_switching_tasks(jax.random.PRNGKey(1), 50, D, hazard=1.0, n=N))
    assert np.all(np.any(fresh[:, 1:] != fresh[:, :-1], axis=-1))


def test_prompts_layout_noise_and_inputs():
    B, sigma2 = 20_000, 0.3
    Lam = jnp.diag(jnp.array([2.0, 0.5]))
    key = jax.random.PRNGKey(2)
    pr = sw.sample_switching_prompts(key, B, hazard=0.1, sigma2=sigma2, n=N, Lam=Lam)
    assert isinstance(pr, drift.DriftPrompts) and pr.n == N
    assert pr.x.shape == (B, N + 1, D) and pr.y.shape == (B, N + 1) and pr.w.shape == (B, N + 1, D)
    noise = np.ravel(pr.y - np.einsum("btd,btd->bt", pr.x, pr.w))
    assert abs(noise.var() - sigma2) < 4 * sigma2 * np.sqrt(2 / noise.size)
    # the inputs are drift's: the same key gives the same x
    dr = drift.sample_drift_prompts(key, B, gamma=1.0, sigma_w2=1.0, sigma_e2=0.0, n=N, Lam=Lam)
    np.testing.assert_array_equal(pr.x, dr.x)
    quiet = sw.sample_switching_prompts(key, 8, hazard=0.1, sigma2=0.0, n=N, Lam=Lam)
    np.testing.assert_allclose(quiet.y, np.einsum("btd,btd->bt", quiet.x, quiet.w), rtol=0, atol=1e-13)


def test_bad_input_is_one_line_naming_the_field():
    key = jax.random.PRNGKey(0)
    with pytest.raises(ConfigError, match=r"^hazard: .*\[0, 1\] \(got -0.1\)$"):
        sw.sample_switching_prompts(key, 4, hazard=-0.1, n=N, Lam=jnp.eye(D))
    with pytest.raises(ConfigError, match=r"^sigma2: .*>= 0"):
        sw.sample_switching_prompts(key, 4, hazard=0.1, sigma2=-1.0, n=N, Lam=jnp.eye(D))
    with pytest.raises(ConfigError, match=r"^n: .*>= 1"):
        sw.sample_switching_tasks(key, 4, D, hazard=0.1, n=0)
    with pytest.raises(ConfigError, match=r"^hazard: "):
        sw.switching_autocovariance(hazard=2.0, n=N)
    with pytest.raises(ConfigError, match=r"^prior_cov: "):
        sw.switching_autocovariance(hazard=0.5, n=N, prior_cov=np.ones((2, 3)))
