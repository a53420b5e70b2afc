"""Least squares, ridge, n-step (preconditioned) GD and WPGD against naive per-prompt numpy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl

P, D = 5, 4


def _data(N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((P, N, D)), rng.standard_normal((P, N)), rng.standard_normal((P, D))


@pytest.mark.parametrize("N", [2, 9])  # under- and over-determined
def test_least_squares_is_min_norm_lstsq(N):
    x, y, xq = _data(N)
    want = [xq[p] @ np.linalg.lstsq(x[p], y[p], rcond=None)[0] for p in range(P)]
    np.testing.assert_allclose(bl.least_squares(x, y, xq), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("N", [2, 9])
def test_ridge_is_the_explicit_solve_and_its_dual(N):
    x, y, xq = _data(N, 1)
    lam = 0.37
    primal = [xq[p] @ np.linalg.solve(x[p].T @ x[p] + lam * np.eye(D), x[p].T @ y[p]) for p in range(P)]
    dual = [xq[p] @ x[p].T @ np.linalg.solve(x[p] @ x[p].T + lam * np.eye(N), y[p]) for p in range(P)]
    got = bl.ridge(x, y, xq, lam=lam)
    np.testing.assert_allclose(got, primal, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got, dual, rtol=0, atol=1e-12)


def _naive_pgd(x, y, xq, P_mat, eta, steps):
    out = []
    for p in range(x.shape[0]):
        w = np.zeros(D)
        for _ in range(steps):
            w = w + eta / x.shape[1] * P_mat @ (x[p].T @ (y[p] - x[p] @ w))
        out.append(xq[p] @ w)
    return np.array(out)


@pytest.mark.parametrize("steps", [0, 1, 7])
def test_gd_and_preconditioned_gd_match_python_loops(steps):
    x, y, xq = _data(6, 2)
    Pm = np.random.default_rng(3).standard_normal((D, D))  # not symmetric: checks the side P acts on
    np.testing.assert_allclose(bl.gd(x, y, xq, eta=0.3, steps=steps), _naive_pgd(x, y, xq, np.eye(D), 0.3, steps),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(bl.preconditioned_gd(x, y, xq, P=Pm, eta=0.2, steps=steps),
                               _naive_pgd(x, y, xq, Pm, 0.2, steps), rtol=0, atol=1e-12)


def test_one_pgd_step_is_the_linattn_eq11_form():
    x, y, xq = _data(6, 4)
    Pm = np.random.default_rng(5).standard_normal((D, D))
    beta = np.einsum("pn,pnd->pd", y, x) / x.shape[1]  # linattn eq 4
    np.testing.assert_allclose(bl.preconditioned_gd(x, y, xq, P=Pm), np.einsum("pi,ij,pj->p", xq, Pm, beta),
                               rtol=0, atol=1e-12)


def test_eq11_preconditioner_reproduces_the_theory_module():
    """Part 3's linattn algorithm: P = A*ᵀ with A* = E[Λ̂²]⁻¹Λ (theory.linattn.attn_m_fixed_point)."""
    from iclab.theory import linattn as theory

    x, y, xq = _data(6, 10)
    q, _ = np.linalg.qr(np.random.default_rng(11).standard_normal((D, D)))
    Lam = (q * np.array([0.4, 0.3, 0.2, 0.1])) @ q.T
    beta = np.einsum("pn,pnd->pd", y, x) / 6
    np.testing.assert_allclose(bl.preconditioned_gd(x, y, xq, P=theory.attn_m_fixed_point(Lam, 1 / 6).T),
                               theory.converged_predictor(beta, xq, Lam, 1 / 6), rtol=0, atol=1e-12)


def test_gd_converges_to_least_squares():
    x, y, xq = _data(40, 6)
    eta = 0.5 * x.shape[1] / np.max(np.linalg.svd(x, compute_uv=False)) ** 2
    np.testing.assert_allclose(bl.gd(x, y, xq, eta=eta, steps=3000), bl.least_squares(x, y, xq), rtol=0, atol=1e-9)


def test_wpgd_is_gating_eq7_and_batched_preconditioners_broadcast():
    x, y, xq = _data(6, 7)
    rng = np.random.default_rng(8)
    Pm, omega = rng.standard_normal((P, D, D)), rng.standard_normal(6)
    want = [xq[p] @ Pm[p] @ x[p].T @ (omega * y[p]) for p in range(P)]
    np.testing.assert_allclose(bl.wpgd(x, y, xq, P=Pm, omega=omega), want, rtol=0, atol=1e-12)
    # uniform weights η/N: one step of preconditioned GD
    np.testing.assert_allclose(bl.wpgd(x, y, xq, P=Pm[0], omega=np.full(6, 0.3 / 6)),
                               bl.preconditioned_gd(x, y, xq, P=Pm[0], eta=0.3), rtol=0, atol=1e-12)


def test_exponential_weights_are_drift_eq15():
    np.testing.assert_allclose(bl.exponential_weights(4, lam=0.5), [0.0625, 0.125, 0.25, 0.5], rtol=1e-15)


def test_dtypes_are_preserved_and_jit_agrees():
    x, y, xq = (jnp.asarray(a, jnp.float32) for a in _data(6, 9))
    assert bl.least_squares(x, y, xq).dtype == jnp.float32
    assert bl.gd(x, y, xq, eta=0.1, steps=3).dtype == jnp.float32
    assert bl.wpgd(x, y, xq, omega=jnp.ones(6)).dtype == jnp.float32
    x, y, xq = _data(6, 9)
    out = bl.ridge(x, y, xq, lam=0.1)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(jax.jit(lambda a, b, c: bl.ridge(a, b, c, lam=0.1))(x, y, xq), out, rtol=0, atol=1e-13)
