import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.tasks.linreg import context_moment, covariance, prompt_matrix, sample_prompts, spectrum_eigenvalues


def test_named_spectra_match_the_paper():
    np.testing.assert_allclose(spectrum_eigenvalues("linear", 4), [0.4, 0.3, 0.2, 0.1], rtol=1e-15)
    inv = spectrum_eigenvalues("inverse", 8)
    np.testing.assert_allclose(inv * np.arange(1, 9), inv[0], rtol=1e-14)
    np.testing.assert_allclose(spectrum_eigenvalues("white", 5), np.full(5, 0.2))
    for name in ("linear", "inverse", "white"):
        assert spectrum_eigenvalues(name, 6).sum() == pytest.approx(1.0, abs=1e-15)


def test_rotated_covariance_keeps_eigenvalues_and_is_seeded():
    lam = [0.4, 0.3, 0.2, 0.1]
    L1 = covariance(lam, jax.random.PRNGKey(3))
    L2 = covariance(lam, jax.random.PRNGKey(3))
    L3 = covariance(lam, jax.random.PRNGKey(4))
    np.testing.assert_array_equal(L1, L2)
    assert np.abs(L1 - L3).max() > 1e-3
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(L1))[::-1], lam, atol=1e-14)
    assert np.abs(L1 - np.diag(np.diag(L1))).max() > 1e-3  # genuinely rotated


def test_prompts_are_noiseless_linear_and_well_shaped():
    Lam = covariance([0.4, 0.3, 0.2, 0.1])
    pr = sample_prompts(jax.random.PRNGKey(0), Lam, N=7, P=11)
    assert pr.x.shape == (11, 7, 4) and pr.y.shape == (11, 7) and pr.x_q.shape == (11, 4) and pr.y_q.shape == (11,)
    assert pr.x.dtype == jnp.float64
    np.testing.assert_allclose(pr.y, np.einsum("pnd,pd->pn", pr.x, pr.w), atol=1e-13)
    np.testing.assert_allclose(pr.y_q, np.einsum("pd,pd->p", pr.x_q, pr.w), atol=1e-13)
    beta = context_moment(pr)
    np.testing.assert_allclose(beta[3], sum(pr.y[3, n] * pr.x[3, n] for n in range(7)) / 7, atol=1e-14)
    X = prompt_matrix(pr)
    assert X.shape == (11, 5, 8)
    np.testing.assert_array_equal(X[2, :4, 5], pr.x[2, 5])
    np.testing.assert_array_equal(X[2, 4, :7], pr.y[2])
    np.testing.assert_array_equal(X[2, :4, 7], pr.x_q[2])
    assert X[2, 4, 7] == 0.0  # the query's label slot


def test_sample_covariance_matches_lambda():
    Lam = covariance([0.4, 0.3, 0.2, 0.1], jax.random.PRNGKey(1))
    pr = sample_prompts(jax.random.PRNGKey(2), Lam, N=15, P=20000)
    xs = np.asarray(pr.x).reshape(-1, 4)
    emp = xs.T @ xs / xs.shape[0]
    # Entry-wise standard error of the sample covariance: sqrt((Λ_ii Λ_jj + Λ_ij²)/n).
    se = np.sqrt((np.outer(np.diag(Lam), np.diag(Lam)) + np.asarray(Lam) ** 2) / xs.shape[0])
    assert np.all(np.abs(emp - Lam) < 5 * se)
