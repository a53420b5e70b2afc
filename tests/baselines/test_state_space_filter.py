"""The Kalman filter of a general linear-Gaussian state-space task: brute-force Gaussian conditioning of the joint
of all states and labels (float64, 1e-10) for a rotation and a trend, F = γI against the AR(1) filter, and the
per-position Bayes risk against Monte Carlo of the filter's own errors (paired, 4 SE)."""

import jax
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.tasks import state_space as ss

PROCESSES = {
    "rotation": ss.rotation_process(4, omega=0.6, sigma_w2=1.0, sigma_e2=0.05, gamma=0.98),
    "trend": ss.trend_process(2, sigma_w2=1.0, sigma_v2=0.3, sigma_e2=0.02, sigma_u2=0.01),
}


def _joint(p: ss.StateSpace, x: np.ndarray, sigma2: float):
    """Cov of (s_1..s_{T+1}, y_1..y_T) given the inputs x (T, d), from s_t = Σ_{j≤t} F^{t−j} e_j (e_0 = s_0)."""
    T, k = x.shape[0], p.k
    cov_z = np.kron(np.eye(T + 2), p.Q)
    cov_z[:k, :k] = p.P0
    L = np.zeros(((T + 1) * k, (T + 2) * k))  # s_1..s_{T+1} = L z
    for t in range(1, T + 2):
        for j in range(t + 1):
            L[(t - 1) * k:t * k, j * k:(j + 1) * k] = np.linalg.matrix_power(p.F, t - j)
    A = np.zeros((T, (T + 1) * k))  # y_t = x_tᵀ H s_t + σ ε_t
    for t in range(T):
        A[t, t * k:(t + 1) * k] = x[t] @ p.H
    Ss = L @ cov_z @ L.T
    return Ss, Ss @ A.T, A @ Ss @ A.T + sigma2 * np.eye(T), A


def _condition(Ss, Ssy, Syy, y, m):
    """Mean and covariance of the states given the first m labels (a linear solve)."""
    K = np.linalg.solve(Syy[:m, :m], Ssy[:, :m].T).T
    return K @ y[:m], Ss - K @ Ssy[:, :m].T


@pytest.mark.parametrize("sigma2", [0.0, 0.2])
@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_filter_equals_brute_force_conditioning(name, sigma2):
    p, T = PROCESSES[name], 9
    kw = p._asdict()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, T, p.d))
    y = rng.standard_normal((2, T))  # the filter is exact conditioning for any labels
    kf = bl.state_space_filter(x, y, **kw, sigma2=sigma2)
    Lam = np.array([[1.0, 0.2], [0.2, 0.6]]) if p.d == 2 else np.diag([1.0, 0.5, 0.3, 0.2])
    risk = bl.state_space_bayes_risk(x, **kw, Lam=Lam, sigma2=sigma2)
    k = p.k
    for b in range(2):
        Ss, Ssy, Syy, A = _joint(p, x[b], sigma2)
        for t in range(T):  # a-priori prediction of y_{t+1} from y_1..y_t
            mean, cov = _condition(Ss, Ssy, Syy, y[b], t)
            np.testing.assert_allclose(kf.predictions[b, t], A[t] @ mean, rtol=0, atol=1e-10)
            np.testing.assert_allclose(kf.variances[b, t], A[t] @ cov @ A[t] + sigma2, rtol=0, atol=1e-10)
            Pw = p.H @ cov[t * k:(t + 1) * k, t * k:(t + 1) * k] @ p.H.T
            np.testing.assert_allclose(risk[b, t], np.trace(Lam @ Pw) + sigma2, rtol=0, atol=1e-10)
        mean, cov = _condition(Ss, Ssy, Syy, y[b], T)
        np.testing.assert_allclose(kf.mean[b], mean[T * k:], rtol=0, atol=1e-10)
        np.testing.assert_allclose(kf.cov[b], cov[T * k:, T * k:], rtol=0, atol=1e-10)
    q = bl.state_space_posterior_mean(x[:, :-1], y[:, :-1], x[:, -1], **kw, sigma2=sigma2)
    np.testing.assert_allclose(q, kf.predictions[:, -1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("gamma,sigma_w2,sigma_e2,sigma2", [
    (0.9, 1.0, 0.1, 0.0), (1.0, 2.0, 0.05, 0.0), (1.0, 1.0, 0.0, 0.0), (0.8, 1.0, 0.2, 0.3)])
def test_ar1_transition_reproduces_the_ar1_filter(gamma, sigma_w2, sigma_e2, sigma2):
    """F = γI, Q = σ_e²I, P_0 = σ_w²I, H = I: kalman_filter's numbers, the noiseless skip rule included."""
    setting = dict(gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2)
    p = ss.ar1_process(3, **setting)
    pr = ss.sample_state_space_prompts(jax.random.PRNGKey(3), 4, p, n=12, Lam=np.eye(3), sigma2=sigma2)
    want = bl.kalman_filter(pr.x, pr.y, **setting, sigma2=sigma2)
    got = bl.state_space_filter(pr.x, pr.y, **p._asdict(), sigma2=sigma2)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    Lam = np.diag([1.5, 1.0, 0.5])
    risk = bl.state_space_bayes_risk(pr.x, **p._asdict(), Lam=Lam, sigma2=sigma2)
    np.testing.assert_allclose(risk[:, -1] - sigma2, bl.kalman_bayes_risk(pr.x[:, :-1], **setting, Lam=Lam,
                                                                          sigma2=sigma2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_bayes_risk_matches_monte_carlo_of_the_filter(name):
    """E[(y_t − ŷ_t)² | x_<t] = risk_t(x_<t): the paired difference has mean 0 (4 SE), at every third position."""
    p, n, sigma2 = PROCESSES[name], 12, 0.1
    Lam = np.array([[1.0, 0.4], [0.4, 0.8]]) if p.d == 2 else np.diag([1.2, 0.8, 0.6, 0.4])
    pr = ss.sample_state_space_prompts(jax.random.PRNGKey(4), 6000, p, n=n, Lam=Lam, sigma2=sigma2)
    kf = bl.state_space_filter(pr.x, pr.y, **p._asdict(), sigma2=sigma2)
    err = np.asarray((pr.y - kf.predictions) ** 2)
    risk = np.asarray(bl.state_space_bayes_risk(pr.x, **p._asdict(), Lam=Lam, sigma2=sigma2))
    for t in (0, 3, 6, 9, 12):
        diff = err[:, t] - risk[:, t]
        assert abs(diff.mean()) < 4 * diff.std(ddof=1) / np.sqrt(diff.size), t
    assert np.all(risk >= sigma2)
