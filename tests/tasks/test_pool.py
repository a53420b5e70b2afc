"""Finite task pools (iclab.tasks.pool): the pool's prior, uniform draws from it, and the noisy labels, by Monte
Carlo at a few standard errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.tasks import pool as tp

D, N = 3, 5


def test_the_pool_is_drawn_from_the_prior():
    A = np.random.default_rng(0).standard_normal((D, D))
    Sigma = A @ A.T / D + 0.5 * np.eye(D)
    M = 40_000
    w = np.asarray(tp.sample_pool(jax.random.PRNGKey(1), M, D, prior_cov=Sigma))
    assert w.shape == (M, D)
    emp = w.T @ w / M
    se = np.sqrt((np.outer(np.diag(Sigma), np.diag(Sigma)) + Sigma**2) / M)  # Var(w_i w_j) = Σ_ii Σ_jj + Σ_ij²
    assert np.all(np.abs(emp - Sigma) < 4 * se)
    scalar = np.asarray(tp.sample_pool(jax.random.PRNGKey(1), M, D, prior_cov=2.0))
    assert np.abs(np.mean(scalar**2) - 2.0) < 4 * np.sqrt(2 * 4.0 / (M * D))
    # the same key gives the same pool
    assert np.array_equal(w, np.asarray(tp.sample_pool(jax.random.PRNGKey(1), M, D, prior_cov=Sigma)))


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="M: a pool holds at least one task"):
        tp.sample_pool(jax.random.PRNGKey(0), 0, D)
    with pytest.raises(ValueError, match="prior_cov"):
        tp.sample_pool(jax.random.PRNGKey(0), 4, D, prior_cov=np.eye(D + 1))
    with pytest.raises(ValueError, match="sigma2"):
        tp.sample_pool_prompts(jax.random.PRNGKey(0), jnp.eye(D), N, 4, sigma2=-1.0)


def test_prompts_draw_their_tasks_uniformly_from_the_pool():
    M, P = 5, 50_000
    pool = tp.sample_pool(jax.random.PRNGKey(2), M, D)
    pr = tp.sample_pool_prompts(jax.random.PRNGKey(3), jnp.eye(D), N, P, pool=pool, sigma2=0.0)
    # every task is a row of the pool, and each row is drawn with frequency 1/M
    match = np.all(np.asarray(pr.w)[:, None, :] == np.asarray(pool)[None], axis=-1)  # (P, M)
    assert np.all(match.sum(axis=1) == 1)
    freq = match.mean(axis=0)
    assert np.all(np.abs(freq - 1 / M) < 4 * np.sqrt((1 / M) * (1 - 1 / M) / P))
    # σ² = 0: noiseless labels, as linreg's
    np.testing.assert_allclose(pr.y, np.einsum("pnd,pd->pn", pr.x, pr.w), rtol=1e-12, atol=1e-12)


def test_labels_carry_noise_of_variance_sigma2_and_inputs_follow_lambda():
    P, sigma2 = 40_000, 0.3
    Lam = jnp.diag(jnp.array([2.0, 1.0, 0.5]))
    pr = tp.sample_pool_prompts(jax.random.PRNGKey(4), Lam, N, P, pool=None, sigma2=sigma2)
    noise = np.concatenate([np.ravel(pr.y - np.einsum("pnd,pd->pn", pr.x, pr.w)),
                            np.ravel(pr.y_q - np.einsum("pd,pd->p", pr.x_q, pr.w))])
    assert abs(noise.var() - sigma2) < 4 * sigma2 * np.sqrt(2 / noise.size)
    x = np.asarray(pr.x).reshape(-1, D)
    np.testing.assert_array_less(np.abs(np.var(x, axis=0) - np.diag(Lam)), 4 * np.diag(Lam) * np.sqrt(2 / len(x)))
    # M = ∞: fresh tasks from the prior, E w wᵀ = I
    w = np.asarray(pr.w)
    assert np.all(np.abs(w.T @ w / P - np.eye(D)) < 4 * np.sqrt(2 / P))


def test_pool_task_draws_with_identity_inputs_and_its_noise():
    """PoolTask, the settings an experiment holds whole: its pool and prompts are the samplers' with Λ = I_D and
    its σ² (the same keys give the same arrays), and it refuses values out of range by field."""
    task = tp.PoolTask(D=D, N=N, sigma2=0.3)
    pool = task.pool(jax.random.PRNGKey(5), 7)
    assert np.array_equal(pool, tp.sample_pool(jax.random.PRNGKey(5), 7, D))
    for p in (pool, None):
        got = task.prompts(jax.random.PRNGKey(6), 11, pool=p)
        want = tp.sample_pool_prompts(jax.random.PRNGKey(6), np.eye(D), N, 11, pool=p, sigma2=0.3)
        assert got.x.shape == (11, N, D) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert task.prompts(jax.random.PRNGKey(6), 3, dtype=jnp.float32).x.dtype == jnp.float32
    for bad in ({"D": 0}, {"sigma2": -0.1}, {"N": 0}, {"M": 3}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tp.PoolTask(**bad)
