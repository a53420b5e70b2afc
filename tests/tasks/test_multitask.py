"""Correlated multitask prompts (gating paper, Defs 1-2, Sec 5.1): moments by Monte Carlo, layout, validation of
the joint task correlation and its factor."""

import jax
import numpy as np
import pytest

from iclab.tasks import multitask as mt
from iclab.theory import wpgd as theory

N = 40_000


def _gram_z(samples, C):
    """z-scores of the empirical E[β_iᵀβ_j]/d against C; samples (N, m, d)."""
    d = samples.shape[-1]
    per = np.einsum("nid,njd->nij", samples, samples) / d
    mean, se = per.mean(0), per.std(0) / np.sqrt(per.shape[0])
    return np.abs(mean - C) / np.maximum(se, 1e-12)


def test_def1_2_sampler_moments():
    d, n, sigma2 = 3, 4, 0.3
    rng = np.random.default_rng(0)
    A = rng.normal(size=(n + 1, n + 1))
    C = A @ A.T
    C = C / np.sqrt(np.outer(np.diag(C), np.diag(C)))
    R, r = C[:n, :n], C[:n, n]
    B = rng.normal(size=(d, d))
    Sigma = B @ B.T / d + 0.5 * np.eye(d)
    pr = mt.sample_correlated(jax.random.PRNGKey(1), N, R, r, d, Sigma, sigma2)
    betas = np.concatenate([np.asarray(pr.tasks), np.asarray(pr.beta)[:, None]], axis=1)
    assert np.max(_gram_z(betas, C)) < 4.5
    # cross-covariance is isotropic: E[β_iβ_jᵀ] = C_ij I (off-diagonal coordinates uncorrelated)
    cross = np.einsum("na,nb->ab", betas[:, 0], betas[:, n]) / N
    np.testing.assert_allclose(cross, r[0] * np.eye(d), atol=5 / np.sqrt(N))
    x = np.concatenate([np.asarray(pr.x), np.asarray(pr.x_query)[:, None]], axis=1).reshape(-1, d)
    np.testing.assert_allclose(x.T @ x / x.shape[0], Sigma, atol=5 * np.sqrt(2 / x.shape[0]) * np.max(Sigma))
    resid = np.asarray(pr.y) - np.einsum("nid,nid->ni", np.asarray(pr.x), betas[:, :n])
    resid_q = np.asarray(pr.y_query) - np.einsum("nd,nd->n", np.asarray(pr.x_query), betas[:, n])
    for e in (resid.ravel(), resid_q):
        assert abs(e.var() - sigma2) < 5 * sigma2 * np.sqrt(2 / e.size)
        assert abs(e.mean()) < 5 * np.sqrt(sigma2 / e.size)


def test_two_task_prompts_of_app_b1():
    d, n_bar, r1, r2 = 4, 3, 0.2, 0.8
    pr = mt.sample_multitask(jax.random.PRNGKey(2), N, [n_bar, n_bar], np.eye(2), [r1, r2], d)
    tasks, beta = np.asarray(pr.tasks), np.asarray(pr.beta)
    C = np.array([[1, 0, r1], [0, 1, r2], [r1, r2, 1]])
    assert np.max(_gram_z(np.concatenate([tasks, beta[:, None]], 1), C)) < 4.5
    # labels: block k uses task k, σ = 0
    owner = np.repeat([0, 1], n_bar)
    np.testing.assert_allclose(np.asarray(pr.y), np.einsum("nid,nid->ni", np.asarray(pr.x), tasks[:, owner]), atol=1e-12)
    np.testing.assert_allclose(np.asarray(pr.y_query), np.einsum("nd,nd->n", np.asarray(pr.x_query), beta), atol=1e-12)
    # the sample-level (R, r) of eq 12 are those of the theory module
    R, r = theory.two_task_correlation(n_bar, r1=r1, r2=r2)
    per = np.concatenate([tasks[:, owner], beta[:, None]], 1)
    assert np.max(_gram_z(per, np.block([[R, r[:, None]], [r[None], np.ones((1, 1))]]))) < 4.5


def test_two_task_factor_and_singular_case():
    L = mt.two_task_factor(r1=0.6, r2=0.8)  # r₁² + r₂² = 1: β is exactly 0.6β₁ + 0.8β₂
    np.testing.assert_allclose(L @ L.T, [[1, 0, 0.6], [0, 1, 0.8], [0.6, 0.8, 1]], atol=1e-12)
    pr = mt.sample_blocks(jax.random.PRNGKey(3), 5, [2, 2], L, None, 0.0, d=3)
    np.testing.assert_allclose(pr.beta, 0.6 * pr.tasks[:, 0] + 0.8 * pr.tasks[:, 1], atol=1e-12)
    with pytest.raises(ValueError, match="positive semidefinite"):
        mt.two_task_factor(r1=0.8, r2=0.8)


def test_task_correlation_factor_handles_singular_C():
    R, r = theory.two_task_correlation(3, r1=0.6, r2=0.8)  # r₁² + r₂² = 1: C is singular (rank 2)
    L = mt.task_correlation_factor(R, r)
    C = np.block([[R, r[:, None]], [r[None, :], np.ones((1, 1))]])
    np.testing.assert_allclose(L @ L.T, C, atol=1e-12)
    np.testing.assert_allclose(L, L.T, atol=0)  # the symmetric square root


@pytest.mark.parametrize("R, r, message", [
    (np.ones((2, 3)), np.zeros(2), "R must be a square"),
    (np.eye(2), np.zeros(3), "r must have shape (2,)"),
    (np.array([[1.0, 0.2], [0.3, 1.0]]), np.zeros(2), "R must be symmetric"),
    (np.array([[1.0, 0.2], [0.2, 0.5]]), np.zeros(2), "R must have unit diagonal"),
    (np.eye(2), np.array([0.0, 1.5]), "r entries must lie in [-1, 1]"),
    (np.array([[1.0, 0.9], [0.9, 1.0]]), np.array([0.9, -0.9]), "must be positive semidefinite"),
])
def test_joint_correlation_rejects_invalid(R, r, message):
    with pytest.raises(ValueError) as err:
        mt.joint_task_correlation(R, r)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_padding_and_take_blocks_agree():
    pr = mt.sample_multitask(jax.random.PRNGKey(4), 3, [5, 5], np.eye(2), [0.5, 0.5], 2)
    mask = mt.padding_mask([5, 5], [2, 3])
    np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 0, 0, 1, 1, 1])
    cut = mt.take_blocks(pr, [5, 5], [2, 3])
    np.testing.assert_array_equal(cut.x, np.asarray(pr.x)[:, mask > 0])
    np.testing.assert_array_equal(cut.y, np.asarray(pr.y)[:, mask > 0])
    with pytest.raises(ValueError, match="n_k"):
        mt.padding_mask([2, 2], [3, 1])


@pytest.mark.parametrize("R, r, message", [
    (np.array([[1.0, 0.5], [0.5, 1.0]]), np.array([0.9, -0.9]), "positive semidefinite"),
    (np.array([[2.0]]), np.array([0.1]), "unit diagonal"),
])
def test_invalid_correlations_are_rejected(R, r, message):
    with pytest.raises(ValueError, match=message):
        mt.sample_correlated(jax.random.PRNGKey(0), 2, R, r, 2)


def test_sampler_is_key_deterministic_and_batched():
    a = mt.sample_multitask(jax.random.PRNGKey(7), 4, [2, 1], np.eye(2), [0.3, 0.4], 3)
    b = mt.sample_multitask(jax.random.PRNGKey(7), 4, [2, 1], np.eye(2), [0.3, 0.4], 3)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert a.x.shape == (4, 3, 3) and a.y.shape == (4, 3) and a.tasks.shape == (4, 2, 3) and a.beta.shape == (4, 3)
