"""LMS and RLS on a prompt against naive per-token loops and the recursive filters of theory.drift; LMS's exact
drift risk (a moment recursion) against Monte Carlo."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.tasks.drift import sample_drift_prompts
from iclab.theory import drift as theory

import jax


def _naive_lms(x, y, x_q, mu):
    w = np.zeros(x.shape[-1])
    for t in range(x.shape[0]):
        w = w + mu * x[t] * (y[t] - x[t] @ w)
    return float(x_q @ w)


def _naive_rls(x, y, x_q, beta, delta):
    """The textbook recursion, one token at a time (P ← (P − k xᵀP)/β)."""
    d = x.shape[-1]
    w, P = np.zeros(d), delta * np.eye(d)
    for t in range(x.shape[0]):
        Px = P @ x[t]
        k = Px / (beta + x[t] @ Px)
        w = w + k * (y[t] - x[t] @ w)
        P = (P - np.outer(k, Px)) / beta
    return float(x_q @ w)


@pytest.mark.parametrize("N,D", [(1, 1), (5, 3), (12, 4), (3, 6)])
def test_lms_and_rls_equal_naive_loops(N, D):
    rng = np.random.default_rng(N * 10 + D)
    x, y, x_q = rng.standard_normal((4, N, D)), rng.standard_normal((4, N)), rng.standard_normal((4, D))
    for mu in (0.01, 0.3):
        got = np.asarray(bl.lms(x, y, x_q, mu=mu))
        want = [_naive_lms(x[b], y[b], x_q[b], mu) for b in range(4)]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    for beta, delta in ((1.0, 100.0), (0.9, 1.0), (0.7, 10.0)):
        got = np.asarray(bl.rls(x, y, x_q, beta=beta, delta=delta))
        want = [_naive_rls(x[b], y[b], x_q[b], beta, delta) for b in range(4)]
        # the recursion and the direct solve differ by roundoff amplified by cond(weighted Gram) ≲ 1e3 here
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_on_a_drift_prompt_they_are_the_last_a_priori_prediction_of_the_sec5_filters():
    pr = sample_drift_prompts(jax.random.PRNGKey(0), 6, gamma=0.9, sigma_w2=1.0, sigma_e2=0.05, n=20, Lam=jnp.eye(3))
    x, y, x_q = pr.x[:, :-1], pr.y[:, :-1], pr.x[:, -1]
    np.testing.assert_allclose(bl.lms(x, y, x_q, mu=0.05), theory.lms_predictions(pr.x, pr.y, mu=0.05)[:, -1],
                               rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(bl.rls(x, y, x_q, beta=0.95, delta=100.0),
                               theory.rls_predictions(pr.x, pr.y, beta=0.95, delta=100.0)[:, -1], rtol=1e-9, atol=1e-10)


def test_batching_broadcasts_and_keeps_dtype():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3, 7, 2)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
    x_q = jnp.asarray(rng.standard_normal((2, 3, 2)), jnp.float32)
    assert bl.lms(x, y, x_q, mu=0.1).shape == (2, 3) and bl.lms(x, y, x_q, mu=0.1).dtype == jnp.float32
    assert bl.rls(x, y, x_q, beta=0.9).shape == (2, 3) and bl.rls(x, y, x_q, beta=0.9).dtype == jnp.float32
    # one shared context, several queries
    got = bl.lms(x[0, 0], y[0, 0], x_q[0], mu=0.1)
    assert got.shape == (3,)
    np.testing.assert_allclose(got[1], bl.lms(x[0, 0], y[0, 0], x_q[0, 1], mu=0.1), rtol=1e-6)


def test_lms_risk_limits():
    Lam = np.diag([2.0, 1.0, 0.5])
    s = dict(gamma=0.9, sigma_w2=1.5, sigma_e2=0.1, n=15, Lam=Lam)
    v = theory.ar1_variance(16, gamma=0.9, sigma_w2=1.5, sigma_e2=0.1)
    # μ = 0: ŵ = 0, the risk is the prior variance of y_{n+1}, v_{n+1} tr Λ (Lemma 1)
    assert bl.lms_risk(0.0, **s) == pytest.approx(v * np.trace(Lam), rel=1e-12)
    # n = 0: nothing seen
    assert bl.lms_risk(0.3, **{**s, "n": 0}) == pytest.approx(
        theory.ar1_variance(1, gamma=0.9, sigma_w2=1.5, sigma_e2=0.1) * np.trace(Lam), rel=1e-12)
    assert bl.lms_risk(5.0, **s) == np.inf or bl.lms_risk(5.0, **s) > 1e6  # μ far past stability diverges


# Settings (one compile each is cheap: n and d are small): γ, σ_w², σ_e², σ², μ, Λ eigenvalues
SETTINGS = [
    (0.9, 1.0, 0.05, 0.0, 0.05, (1.0, 1.0, 1.0)),
    (0.7, 2.0, 0.3, 1.0, 0.1, (2.0, 1.0, 0.5)),  # label noise: the μ²σ²Λ term is ~8 SE here
    (1.0, 1.0, 0.02, 0.0, 0.2, (1.0, 0.5)),
]


@pytest.mark.parametrize("gamma,sigma_w2,sigma_e2,sigma2,mu,eigs", SETTINGS)
def test_lms_risk_equals_monte_carlo(gamma, sigma_w2, sigma_e2, sigma2, mu, eigs):
    n, P = 12, 40_000
    d = len(eigs)
    rng = np.random.default_rng(int(100 * gamma))
    Lam = np.diag(eigs)
    x = rng.standard_normal((P, n + 1, d)) * np.sqrt(np.asarray(eigs))
    w = np.sqrt(sigma_w2) * rng.standard_normal((P, d))
    ws = []
    for _ in range(n + 1):
        w = gamma * w + np.sqrt(sigma_e2) * rng.standard_normal((P, d))
        ws.append(w)
    w = np.stack(ws, axis=1)
    y = np.einsum("ptd,ptd->pt", x, w)
    y_ctx = y[:, :n] + np.sqrt(sigma2) * rng.standard_normal((P, n))
    err = (np.asarray(bl.lms(x[:, :n], y_ctx, x[:, n], mu=mu)) - y[:, n]) ** 2
    exact = bl.lms_risk(mu, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n, Lam=Lam, sigma2=sigma2)
    se = err.std(ddof=1) / np.sqrt(P)
    # a closed form against its own Monte Carlo: 4 standard errors (P = 40 000 resolves ~2 % of the risk, so a
    # wrong sign or a missing μ² term fails)
    assert abs(err.mean() - exact) <= 4 * se, (err.mean(), exact, se)
