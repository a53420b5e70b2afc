"""The Bayes predictors of task diversity: dMMSE (posterior mean over a finite pool) against a brute-force
computation per prompt, and its risk against ridge's (the Gaussian prior's posterior mean) on pool and on
fresh tasks; ridge's Monte Carlo risk at M = ∞ against its exact conditional risk."""

import jax
import jax.numpy as jnp
import numpy as np

from iclab import baselines as bl
from iclab.tasks import pool as tp

D, N, SIGMA2 = 4, 6, 0.25


def _brute_force_dmmse(x, y, x_q, pool, sigma2):
    """For each prompt: the posterior weight of every pool task from its Gaussian likelihood, normalised by
    hand in log space, and the weighted prediction."""
    out = np.empty(len(x))
    for p in range(len(x)):
        logs = np.array([-np.sum((y[p] - x[p] @ w) ** 2) / (2 * sigma2) for w in pool])
        weights = np.exp(logs - logs.max())
        weights /= weights.sum()
        out[p] = sum(wt * (w @ x_q[p]) for wt, w in zip(weights, pool))
    return out


def test_dmmse_is_the_posterior_mean_over_the_pool():
    pool = np.asarray(tp.sample_pool(jax.random.PRNGKey(0), 7, D))
    pr = tp.sample_pool_prompts(jax.random.PRNGKey(1), jnp.eye(D), N, 50, pool=pool, sigma2=SIGMA2)
    x, y, x_q = map(np.asarray, (pr.x, pr.y, pr.x_q))
    got = np.asarray(bl.pool_posterior_mean(x, y, x_q, pool=pool, sigma2=SIGMA2))
    np.testing.assert_allclose(got, _brute_force_dmmse(x, y, x_q, pool, SIGMA2), rtol=1e-12, atol=1e-12)
    post = np.asarray(bl.pool_posterior(x, y, pool=pool, sigma2=SIGMA2))
    np.testing.assert_allclose(post.sum(axis=-1), 1.0, atol=1e-12)
    # the true task carries most of the posterior once the context pins it down
    truth = np.argmax(np.all(np.asarray(pr.w)[:, None] == pool[None], axis=-1), axis=1)
    assert np.mean(np.argmax(post, axis=1) == truth) > 0.9


def test_a_pool_of_one_task_is_known_exactly():
    pool = np.asarray(tp.sample_pool(jax.random.PRNGKey(2), 1, D))
    pr = tp.sample_pool_prompts(jax.random.PRNGKey(3), jnp.eye(D), N, 20_000, pool=pool, sigma2=SIGMA2)
    pred = bl.pool_posterior_mean(pr.x, pr.y, pr.x_q, pool=pool, sigma2=SIGMA2)
    np.testing.assert_allclose(pred, pr.x_q @ pool[0], rtol=1e-12)
    risk = bl.mc_risk(lambda p: bl.pool_posterior_mean(p.x, p.y, p.x_q, pool=pool, sigma2=SIGMA2), pr)
    assert abs(float(risk.mean) - SIGMA2) < 4 * float(risk.se)  # only the query's own noise is left


def _paired_gap(pr, pool):
    """Per-prompt squared error of dMMSE minus ridge's (σ²/σ_w² = σ²), on the same prompts: mean and SE."""
    d = bl.pool_posterior_mean(pr.x, pr.y, pr.x_q, pool=pool, sigma2=SIGMA2)
    r = bl.gaussian_posterior_mean(pr.x, pr.y, pr.x_q, prior_cov=1.0, sigma2=SIGMA2)
    gap = np.asarray((d - pr.y_q) ** 2 - (r - pr.y_q) ** 2)
    return gap.mean(), gap.std(ddof=1) / np.sqrt(gap.size)


def test_each_bayes_predictor_wins_on_its_own_tasks():
    M, P = 8, 20_000
    pool = np.asarray(tp.sample_pool(jax.random.PRNGKey(4), M, D))
    on_pool = tp.sample_pool_prompts(jax.random.PRNGKey(5), jnp.eye(D), N, P, pool=pool, sigma2=SIGMA2)
    fresh = tp.sample_pool_prompts(jax.random.PRNGKey(6), jnp.eye(D), N, P, pool=None, sigma2=SIGMA2)
    mean, se = _paired_gap(on_pool, pool)
    assert mean + 4 * se < 0  # dMMSE is Bayes-optimal on pool tasks: strictly better than ridge there
    mean, se = _paired_gap(fresh, pool)
    assert mean - 4 * se > 0  # ridge is Bayes-optimal on fresh tasks


def test_ridge_monte_carlo_risk_at_m_infinity_is_its_exact_conditional_risk():
    Lam = jnp.diag(jnp.array([1.5, 1.0, 0.7, 0.3]))
    pr = tp.sample_pool_prompts(jax.random.PRNGKey(7), Lam, N, 40_000, pool=None, sigma2=SIGMA2)
    mc = bl.mc_risk(lambda p: bl.gaussian_posterior_mean(p.x, p.y, p.x_q, prior_cov=1.0, sigma2=SIGMA2), pr)
    # exact given each context: tr(Λ Cov[w | X]) + σ² (the query's noise), averaged over the same contexts
    exact = np.asarray(bl.gaussian_bayes_risk(pr.x, Lam=Lam, prior_cov=1.0, sigma2=SIGMA2)) + SIGMA2
    assert abs(float(mc.mean) - exact.mean()) < 4 * float(mc.se)
