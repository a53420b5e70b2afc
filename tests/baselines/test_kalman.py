"""The Kalman filter of drift's AR(1) task: brute-force Gaussian conditioning to 1e-10 (the acceptance
point), the noiseless stationary limit, Bayes risk against Monte Carlo, and the filter beating GLA(λ*)."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.tasks.drift import DriftPrompts, tokens
from iclab.theory import drift as theory


def _brute(x, y, *, gamma, sigma_w2, sigma_e2, sigma2=0.0):
    """E[w_{n+1} | y_1..y_n] and its covariance from the joint covariance c(a, b) I of w_1..w_{n+1} (Lemma 1)."""
    n, d = x.shape
    c = theory.ar1_covariance(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n)
    Ky = c[:n, :n] * (x @ x.T) + sigma2 * np.eye(n)  # Cov(y_i, y_j) = c(i, j) x_iᵀx_j
    Kwy = c[n, :n][:, None] * x  # Cov(w_{n+1}, y_j) = c(n+1, j) x_j
    return Kwy.T @ np.linalg.solve(Ky, y), c[n, n] * np.eye(d) - Kwy.T @ np.linalg.solve(Ky, Kwy)


def _drift_prompts(rng, B, *, gamma, sigma_w2, sigma_e2, n, Lam):
    """drift's eqs 2-3 (``iclab.tasks.drift.sample_drift_prompts``), drawn with numpy."""
    d = Lam.shape[0]
    x = rng.standard_normal((B, n + 1, d)) @ np.linalg.cholesky(Lam).T
    w = np.sqrt(sigma_w2) * rng.standard_normal((B, d))
    ws = []
    for _ in range(n + 1):
        w = gamma * w + np.sqrt(sigma_e2) * rng.standard_normal((B, d))
        ws.append(w)
    w = np.stack(ws, axis=1)
    return DriftPrompts(x=jnp.asarray(x), y=jnp.asarray(np.einsum("btd,btd->bt", x, w)), w=jnp.asarray(w))


# One shape (n = 9 > d = 3, noiseless: the case the filter must keep stable) for every setting: the
# settings are traced, so the filter compiles once.
SETTINGS = [  # γ, σ_w², σ_e², σ²
    (0.9, 1.0, 0.1, 0.0),
    (0.95, 1.0, 0.01, 0.0),
    (1.0, 2.0, 0.05, 0.0),  # random walk
    (1.2, 0.5, 0.1, 0.0),  # γ > 1 (Theorem 4's range)
    (0.3, 1.0, 1.0, 0.0),  # fast drift
    (0.8, 1.0, 0.2, 0.3),  # observation noise
]


@pytest.mark.parametrize("gamma,sigma_w2,sigma_e2,sigma2", SETTINGS)
def test_kalman_equals_brute_force_conditioning(gamma, sigma_w2, sigma_e2, sigma2):
    n, d = 9, 3
    rng = np.random.default_rng(int(100 * gamma))
    setting = dict(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2)
    pr = _drift_prompts(rng, 3, **setting, n=n, Lam=np.eye(d))
    x = np.asarray(pr.x)
    y = np.asarray(pr.y) + np.sqrt(sigma2) * rng.standard_normal(pr.y.shape)
    kf = bl.kalman_filter(x, y, **setting, sigma2=sigma2)
    pred = bl.kalman_posterior_mean(x[:, :-1], y[:, :-1], x[:, -1], **setting, sigma2=sigma2)
    for b in range(3):
        mean, cov = _brute(x[b, :-1], y[b, :-1], **setting, sigma2=sigma2)
        np.testing.assert_allclose(pred[b], x[b, -1] @ mean, rtol=0, atol=1e-10)
        np.testing.assert_allclose(kf.predictions[b, -1], x[b, -1] @ mean, rtol=0, atol=1e-10)
        np.testing.assert_allclose(kf.variances[b, -1], x[b, -1] @ cov @ x[b, -1] + sigma2, rtol=0, atol=1e-10)
        for t in (1, 2, 5):  # a-priori predictions along the prompt: the same conditioning on a prefix
            mean_t, _ = _brute(x[b, :t], y[b, :t], **setting, sigma2=sigma2)
            np.testing.assert_allclose(kf.predictions[b, t], x[b, t] @ mean_t, rtol=0, atol=1e-10)
    mean, cov = _brute(x[0], y[0], **setting, sigma2=sigma2)
    np.testing.assert_allclose(kf.mean[0], mean, rtol=0, atol=1e-10)
    np.testing.assert_allclose(kf.cov[0], cov, rtol=0, atol=1e-10)


def test_stationary_noiseless_limit_is_the_gaussian_prior_and_stays_stable():
    rng = np.random.default_rng(0)
    stationary = dict(gamma=1.0, sigma_w2=2.0, sigma_e2=0.0)  # one w per prompt: y = Xw, w ~ N(0, 2I)
    x, y, xq = rng.standard_normal((4, 3, 5)), rng.standard_normal((4, 3)), rng.standard_normal((4, 5))
    np.testing.assert_allclose(bl.kalman_posterior_mean(x, y, xq, **stationary),
                               bl.gaussian_posterior_mean(x, y, xq, prior_cov=2.0), rtol=0, atol=1e-12)
    # n ≫ d: P reaches 0 after d steps and every later observation is skipped, not divided by roundoff
    x, w = rng.standard_normal((20, 400, 5)), rng.standard_normal((20, 5))
    y = np.einsum("ptd,pd->pt", x, w)
    kf = bl.kalman_filter(x, y, **stationary)
    np.testing.assert_allclose(kf.mean, w, rtol=0, atol=1e-8)
    np.testing.assert_allclose(kf.predictions[:, 5:], y[:, 5:], rtol=0, atol=1e-8)
    assert np.abs(np.asarray(kf.cov)).max() < 1e-8
    # drifting, noiseless, long: the covariance stays symmetric positive definite, ≥ σ_e² I
    # (n = 399: the same x shape as above, one compile)
    pr = _drift_prompts(rng, 20, gamma=0.97, sigma_w2=1.0, sigma_e2=0.01, n=399, Lam=np.eye(5))
    cov = np.asarray(bl.kalman_filter(pr.x, pr.y, gamma=0.97, sigma_w2=1.0, sigma_e2=0.01).cov)
    np.testing.assert_array_equal(cov, np.swapaxes(cov, -1, -2))
    assert np.linalg.eigvalsh(cov).min() > 0.01 * (1 - 1e-9)


def test_layouts_and_the_target_is_never_read():
    rng = np.random.default_rng(1)
    setting = dict(gamma=0.9, sigma_w2=1.0, sigma_e2=0.05)
    pr = _drift_prompts(rng, 6, **setting, n=10, Lam=np.eye(3))
    want = bl.kalman_filter(pr.x, pr.y, **setting).predictions[:, -1]
    np.testing.assert_allclose(bl.on_prompts(bl.kalman_posterior_mean, **setting)(pr), want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(bl.kalman_posterior_mean(*bl.split_drift_tokens(tokens(pr)), **setting), want,
                               rtol=0, atol=1e-13)
    moved = pr._replace(y=pr.y.at[:, -1].add(100.0))
    np.testing.assert_allclose(bl.kalman_filter(moved.x, moved.y, **setting).predictions[:, -1], want, rtol=0,
                               atol=1e-13)
    out = bl.kalman_posterior_mean(*(jnp.asarray(a, jnp.float32) for a in bl.split_prompts(pr)), **setting)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)


def test_bayes_risk_matches_monte_carlo_and_beats_gla_at_its_optimum():
    rng = np.random.default_rng(2)
    n = 20
    Lam = np.diag([0.6, 0.3, 0.1]) * 3
    setting = dict(gamma=0.9, sigma_w2=1.0, sigma_e2=0.05)
    pr = _drift_prompts(rng, 4000, **setting, n=n, Lam=Lam)
    x, y, xq = bl.split_prompts(pr)
    err = np.asarray((bl.kalman_posterior_mean(x, y, xq, **setting) - pr.target) ** 2)
    risk = np.asarray(bl.kalman_bayes_risk(x, **setting, Lam=Lam))
    diff = err - risk  # E[err | X] = risk(X) exactly: the paired difference has mean 0
    assert abs(diff.mean()) < 4 * diff.std(ddof=1) / np.sqrt(diff.size)
    v_next = theory.ar1_variance(n + 1, **setting)
    assert np.all(risk >= setting["sigma_e2"] * np.trace(Lam) * (1 - 1e-12))
    assert np.all(risk <= v_next * np.trace(Lam) * (1 + 1e-12))
    # GLA at its optimal forget factor (eq 15 = WPGD with ω_i = λ*^{n+1−i}, P = D1 Λ̃⁻¹): Theorem 2's
    # error, reproduced on these prompts, and clearly above the Bayes risk (paired, many SE)
    lam_star, err_star = theory.optimal_forget_factor(**setting, n=n, Lam=Lam)
    D1, D2, D3, _ = theory.D_sums(lam_star, **setting, n=n)
    Lam_t = theory.Lam_tilde(Lam, D2=D2, D3=D3)
    eq15 = bl.wpgd(x, y, xq, P=D1 * np.linalg.inv(Lam_t), omega=bl.exponential_weights(n, lam=lam_star))
    np.testing.assert_allclose(eq15, theory.optimal_prediction(tokens(pr), lam_star, D1=D1, Lam_t=Lam_t), rtol=1e-10,
                               atol=1e-12)
    gla = np.asarray((eq15 - pr.target) ** 2)
    assert abs(gla.mean() - err_star) < 4 * gla.std(ddof=1) / np.sqrt(gla.size)
    gap = gla - err
    assert gap.mean() > 4 * gap.std(ddof=1) / np.sqrt(gap.size)
