"""AR(1) drifting-task prompts (drift paper, eqs 2-4, 17) against Lemma 1's moments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
import iclab.theory.drift as theory
from iclab.tasks.drift import sample_drift_prompts, sample_tasks, tokens


def test_shapes_labels_and_tokens():
    Lam = jnp.diag(jnp.array([2.0, 1.0, 0.5]))
    pr = sample_drift_prompts(jax.random.PRNGKey(0), 5, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1, n=7, Lam=Lam)
    assert pr.x.shape == (5, 8, 3) and pr.y.shape == (5, 8) and pr.w.shape == (5, 8, 3) and pr.n == 7
    np.testing.assert_allclose(pr.y, np.einsum("btd,btd->bt", pr.x, pr.w), rtol=0, atol=1e-14 * np.abs(pr.y).max())
    Z = tokens(pr)
    assert Z.shape == (5, 8, 4)
    np.testing.assert_array_equal(Z[:, -1, -1], 0.0)
    np.testing.assert_array_equal(Z[:, :-1, -1], pr.y[:, :-1])
    np.testing.assert_array_equal(Z[..., :3], pr.x)
    np.testing.assert_array_equal(pr.target, pr.y[:, -1])


@pytest.mark.parametrize("gamma,sw2,se2", [(0.8, 1.0, 0.1), (1.0, 0.5, 0.02), (1.1, 1.0, 0.3)])
def test_task_covariance_matches_lemma1(gamma, sw2, se2):
    """E[w_a w_bᵀ] = c(a, b) I (Lemma 1), Monte Carlo at 5 standard errors."""
    B, n, d = 20000, 6, 2
    w = np.asarray(sample_tasks(jax.random.PRNGKey(1), B, d, gamma=gamma, sigma_w2=sw2, sigma_e2=se2, n=n))
    C = theory.ar1_covariance(gamma=gamma, sigma_w2=sw2, sigma_e2=se2, n=n)
    prod = np.einsum("bai,bci->bac", w, w) / d
    est, se = prod.mean(0), prod.std(0) / np.sqrt(B)
    assert np.all(np.abs(est - C) <= 5 * se + 1e-12)
    cross = np.einsum("ba,bc->ac", w[:, :, 0], w[:, :, 1]) / B  # different coordinates are independent
    assert np.all(np.abs(cross) <= 5 * np.sqrt(np.outer(np.diag(C), np.diag(C)) / B))


def test_input_covariance():
    Lam = np.array([[2.0, 0.3], [0.3, 0.5]])
    pr = sample_drift_prompts(jax.random.PRNGKey(2), 20000, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1, n=4,
                              Lam=jnp.asarray(Lam))
    x = np.asarray(pr.x).reshape(-1, 2)
    np.testing.assert_allclose(x.T @ x / len(x), Lam, atol=5 * 2.0 / np.sqrt(len(x)))


def test_stationary_limit_has_one_task_per_prompt():
    pr = sample_drift_prompts(jax.random.PRNGKey(3), 4, gamma=1.0, sigma_w2=1.0, sigma_e2=0.0, n=9, Lam=jnp.eye(3))
    np.testing.assert_array_equal(pr.w, np.broadcast_to(pr.w[:, :1], pr.w.shape))


def test_grid_of_processes_uses_common_random_numbers():
    """A (G,) grid of (γ, σ_w², σ_e²) equals G single draws from the same key (slice by slice)."""
    key, Lam = jax.random.PRNGKey(4), jnp.eye(3)
    gam, sw, se = jnp.array([0.8, 0.95, 1.0]), jnp.array([1.0, 2.0, 1.0]), jnp.array([0.01, 0.1, 0.0])
    grid = sample_drift_prompts(key, 6, gamma=gam, sigma_w2=sw, sigma_e2=se, n=5, Lam=Lam)
    assert grid.y.shape == (3, 6, 6) and grid.x.shape == (3, 6, 6, 3)
    for g in range(3):
        one = sample_drift_prompts(key, 6, gamma=float(gam[g]), sigma_w2=float(sw[g]), sigma_e2=float(se[g]), n=5, Lam=Lam)
        np.testing.assert_allclose(grid.y[g], one.y, rtol=1e-14)
        np.testing.assert_allclose(grid.w[g], one.w, rtol=1e-14)
        np.testing.assert_array_equal(grid.x[g], one.x)


def test_jit_vmap_and_float32():
    f = jax.jit(jax.vmap(lambda k, g: tokens(sample_drift_prompts(k, 4, gamma=g, sigma_w2=1.0, sigma_e2=0.1, n=3,
                                                                  Lam=jnp.eye(2, dtype=jnp.float32)))))
    Z = f(jax.random.split(jax.random.PRNGKey(5), 2), jnp.array([0.5, 0.9], jnp.float32))
    assert Z.shape == (2, 4, 4, 3) and Z.dtype == jnp.float32


def test_user_errors():
    with pytest.raises(ValueError, match="n and B"):
        sample_drift_prompts(jax.random.PRNGKey(0), 3, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1, n=0, Lam=jnp.eye(2))
    with pytest.raises(TypeError):  # the task setting is keyword-only: no positional γ, σ_w², σ_e² to swap
        sample_drift_prompts(jax.random.PRNGKey(0), 3, 0.9, 1.0, 0.1, 4, jnp.eye(2))


def test_draws_come_from_the_shared_normal_sampler():
    """Inputs are iclab.tasks.standard_normal draws of fold_in(key, 0) times chol(Λ)ᵀ; w_0 and the increments
    come from the split of fold_in(key, 1): the one fast sampler of iclab.tasks, no sampler of its own."""
    from iclab.tasks import standard_normal

    key, Lam = jax.random.PRNGKey(6), jnp.array([[2.0, 0.3], [0.3, 0.5]])
    pr = sample_drift_prompts(key, 3, gamma=0.8, sigma_w2=2.0, sigma_e2=0.1, n=4, Lam=Lam)
    x = standard_normal(jax.random.fold_in(key, 0), (3, 5, 2)) @ jnp.linalg.cholesky(Lam).T
    np.testing.assert_allclose(pr.x, x, rtol=1e-14)
    k0, ke = jax.random.split(jax.random.fold_in(key, 1))
    w1 = 0.8 * np.sqrt(2.0) * standard_normal(k0, (3, 2)) + np.sqrt(0.1) * standard_normal(ke, (5, 3, 2))[0]
    np.testing.assert_allclose(pr.w[:, 0], w1, rtol=1e-14)
