"""Algorithm matching: prediction gap and sensitivity cosine on known cases, the query lenses of every
layout, and models matching the algorithms their papers name when their weights are set to them."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.models import gla_forget
from iclab.models import linattn as la_models
from iclab.tasks import drift as dr
from iclab.tasks import linreg
from iclab.tasks import multitask as mt
from iclab.tasks import multitask_regression as mr

P, N, D = 200, 6, 5


def _linreg(seed=0):
    rng = np.random.default_rng(seed)
    x, xq, w = rng.standard_normal((P, N, D)), rng.standard_normal((P, D)), rng.standard_normal((P, D))
    y, yq = np.einsum("pnd,pd->pn", x, w), np.einsum("pd,pd->p", xq, w)
    return linreg.Prompts(*(jnp.asarray(a) for a in (x, y, xq, yq, w)))


RIDGE = bl.on_prompts(bl.ridge, lam=0.5)


def test_self_scaled_and_unrelated():
    pr = _linreg()
    f2 = float(jnp.mean(RIDGE(pr) ** 2))
    m = bl.algorithm_match(RIDGE, RIDGE, pr)
    assert float(m.gap) == 0.0 and float(m.gap_se) == 0.0
    assert float(m.cosine) == pytest.approx(1.0, abs=1e-12)
    c = -2.0
    m = bl.algorithm_match(RIDGE, lambda p: c * RIDGE(p), pr)
    assert float(m.gap) == pytest.approx((1 - c) ** 2 * f2, rel=1e-12)
    assert float(m.relative_gap) == pytest.approx((1 - c) ** 2 / c ** 2, rel=1e-12)
    assert float(m.cosine) == pytest.approx(-1.0, abs=1e-12)
    v = np.random.default_rng(9).standard_normal(D)
    m = bl.algorithm_match(RIDGE, lambda p: p.x_q @ v, pr)  # a fixed direction, blind to the context
    assert abs(float(m.cosine)) < 0.3  # random directions in R^5: cos ≈ 0 ± 0.45/√P per prompt
    assert float(m.gap) > 1.0


def test_sensitivity_is_the_estimate_and_mc_risk():
    pr = _linreg(1)
    J = bl.query_sensitivity(RIDGE, pr)
    w_hat = [np.linalg.solve(pr.x[p].T @ pr.x[p] + 0.5 * np.eye(D), pr.x[p].T @ pr.y[p]) for p in range(3)]
    np.testing.assert_allclose(J[:3], w_hat, rtol=0, atol=1e-12)
    est = bl.mc_risk(RIDGE, pr)
    e = np.asarray((RIDGE(pr) - pr.y_q) ** 2)
    assert float(est.mean) == pytest.approx(e.mean(), rel=1e-12)
    assert float(est.se) == pytest.approx(e.std(ddof=1) / np.sqrt(P), rel=1e-10)


def test_attn_m_at_eq11_is_one_step_of_preconditioned_gd_in_both_layouts():
    pr = _linreg(2)
    lam = linreg.spectrum_eigenvalues("linear", D)
    Gamma_inv = np.diag(1.0 / (lam + (lam + lam.sum()) / N))  # eq 11: (Λ + (Λ + trΛ·I)/N)⁻¹
    params = {"v": jnp.ones(1), "U": jnp.asarray(Gamma_inv)[None]}
    model = lambda p: la_models.predict_attn_m(params, p)  # noqa: E731
    alg = bl.on_prompts(bl.preconditioned_gd, P=Gamma_inv, eta=1.0, steps=1)
    m = bl.algorithm_match(model, alg, pr)
    assert float(m.gap) < 1e-24 and float(m.cosine) == pytest.approx(1.0, abs=1e-12)
    # the prompt matrix of eq 1 with its own lens
    X = linreg.prompt_matrix(pr)
    alg_tokens = lambda Z: bl.preconditioned_gd(*bl.split_linreg_tokens(Z), P=Gamma_inv)  # noqa: E731
    np.testing.assert_allclose(alg_tokens(X), model(pr), rtol=0, atol=1e-12)
    J = bl.query_sensitivity(alg_tokens, X, query=bl.LINREG_TOKENS_QUERY)
    np.testing.assert_allclose(J, bl.query_sensitivity(model, pr), rtol=0, atol=1e-12)


def test_restricted_gla_is_eq15_wpgd_through_drift_tokens():
    rng = np.random.default_rng(3)
    n, d, lam = 8, 3, 0.8
    x = rng.standard_normal((P, n + 1, d))
    w = rng.standard_normal((P, n + 1, d))
    pr = dr.DriftPrompts(jnp.asarray(x), jnp.asarray(np.einsum("btd,btd->bt", x, w)), jnp.asarray(w))
    U11, u = rng.standard_normal((d, d)), 1.7
    model = lambda Z: gla_forget.predict_restricted(U11, u, Z, lam)  # noqa: E731
    omega = bl.exponential_weights(n, lam=lam)
    alg = lambda Z: bl.wpgd(*bl.split_drift_tokens(Z), P=u * U11.T, omega=omega)  # noqa: E731
    m = bl.algorithm_match(model, alg, dr.tokens(pr), query=bl.DRIFT_TOKENS_QUERY)
    assert float(m.gap) < 1e-24 and float(m.cosine) == pytest.approx(1.0, abs=1e-12)
    # the DriftPrompts lens moves x_{n+1} only: the Kalman sensitivity is E[w_{n+1} | y_1..y_n]
    setting = dict(gamma=0.9, sigma_w2=1.0, sigma_e2=0.1)
    J = bl.query_sensitivity(bl.on_prompts(bl.kalman_posterior_mean, **setting), pr)
    np.testing.assert_allclose(J, bl.kalman_filter(pr.x[:, :-1], pr.y[:, :-1], **setting).mean, rtol=0, atol=1e-12)


def test_gating_and_mhsa_lenses():
    rng = np.random.default_rng(4)
    sizes, d = [3, 3], 4
    L = mt.two_task_factor(r1=0.3, r2=0.9)
    x, xq, y = rng.standard_normal((P, 6, d)), rng.standard_normal((P, d)), rng.standard_normal((P, 6))
    pr = mt.MultitaskPrompts(jnp.asarray(x), jnp.asarray(y), jnp.asarray(xq), jnp.zeros(P), jnp.zeros((P, 2, d)),
                             jnp.zeros((P, d)))
    bayes = bl.on_prompts(bl.multitask_posterior_mean, block_sizes=sizes, factor=L)
    omega = np.r_[np.full(3, 0.1), np.full(3, 0.5)]
    J = bl.query_sensitivity(bl.on_prompts(bl.wpgd, omega=omega), pr)
    np.testing.assert_allclose(J, np.einsum("pnd,pn->pd", x, omega * y), rtol=0, atol=1e-12)
    assert float(bl.sensitivity_cosine(bayes, bayes, pr).mean) == pytest.approx(1.0, abs=1e-12)
    # mhsa: vector outputs, Jacobians (P, d_y, d)
    ts = mr.homogeneous(2, 2, lam=1.0, sigma=0.3)
    X, Y, q = rng.standard_normal((P, 4, 7)), rng.standard_normal((P, 2, 7)), rng.standard_normal((P, 4))
    prm = mr.MultitaskPrompts(*(jnp.asarray(a) for a in (X, Y, q, np.zeros((P, 2)), np.zeros((P, 4, 2)))))
    f = bl.on_prompts(bl.mhsa_posterior_mean, ts=ts)
    J = bl.query_sensitivity(f, prm)
    assert J.shape == (P, 2, 4)
    np.testing.assert_allclose(J[:, 0, 2:], 0.0, atol=1e-14)  # output 1 reads block 1 only
    half = lambda p: 0.5 * f(p)  # noqa: E731
    m = bl.algorithm_match(f, half, prm)
    assert float(m.cosine) == pytest.approx(1.0, abs=1e-12)
    assert float(m.gap) == pytest.approx(0.25 * float(jnp.mean(jnp.sum(f(prm) ** 2, axis=-1))), rel=1e-12)


def test_layout_errors_are_one_line():
    with pytest.raises(TypeError, match="split token matrices"):
        bl.split_prompts(jnp.zeros((2, 3, 4)))
    with pytest.raises(TypeError, match="QueryLens"):
        bl.query_lens(jnp.zeros((2, 3, 4)))
