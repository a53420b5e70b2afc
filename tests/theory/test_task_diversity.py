"""iclab.theory.task_diversity against Monte Carlo of the linear predictor ŷ = x_qᵀ Γ β on pool and fresh tasks.

Every Monte Carlo comparison is at 4 standard errors of the per-prompt squared errors (a false alarm about 6e-5
per comparison); the exact identities (the optimum's first-order condition, the excess risk as a quadratic form)
at float64 roundoff.
"""

import numpy as np
import pytest

from iclab.theory import task_diversity as td

Z = 4.0


def _prompts(rng, tasks, N, sigma2):
    """Prompts with the given (P, D) tasks: x ~ N(0, I), noisy context and query labels (iclab.tasks.pool's model)."""
    P, D = tasks.shape
    x = rng.standard_normal((P, N, D))
    x_q = rng.standard_normal((P, D))
    y = np.einsum("pnd,pd->pn", x, tasks) + np.sqrt(sigma2) * rng.standard_normal((P, N))
    y_q = np.einsum("pd,pd->p", x_q, tasks) + np.sqrt(sigma2) * rng.standard_normal(P)
    return x, y, x_q, y_q


def _mc_risk(Gamma, x, y, x_q, y_q):
    beta = np.einsum("pn,pnd->pd", y, x) / x.shape[1]
    err = (np.einsum("pd,de,pe->p", x_q, Gamma, beta) - y_q) ** 2
    return err.mean(), err.std(ddof=1) / np.sqrt(err.size)


def test_wishart_moment_against_monte_carlo():
    rng = np.random.default_rng(0)
    D, N, P = 3, 4, 200_000
    A = rng.standard_normal((D, D))
    A = A + A.T
    x = rng.standard_normal((P, N, D))
    S = np.einsum("pnd,pne->pde", x, x) / N
    samples = np.einsum("pij,jk,pkl->pil", S, A, S)
    mean, se = samples.mean(0), samples.std(0, ddof=1) / np.sqrt(P)
    assert np.all(np.abs(mean - td.wishart_moment(A, N=N)) <= Z * se)


@pytest.mark.parametrize("M", [1, 3, 50])
def test_linear_risk_on_pool_and_fresh_tasks_against_monte_carlo(M):
    rng = np.random.default_rng(M)
    D, N, sigma2, P = 3, 5, 0.3, 200_000
    pool = rng.standard_normal((M, D))
    risks = td.pool_linear_risks(pool, N=N, sigma2=sigma2)
    other = rng.standard_normal((D, D)) * 0.3  # a predictor that is not optimal for either distribution
    pool_tasks = pool[rng.integers(0, M, P)]
    fresh_tasks = rng.standard_normal((P, D))
    for Gamma in (risks.Gamma, other):
        for tasks, Sigma in ((pool_tasks, td.pool_second_moment(pool)), (fresh_tasks, np.eye(D))):
            mean, se = _mc_risk(Gamma, *_prompts(rng, tasks, N, sigma2))
            exact = td.linear_risk(Gamma, Sigma, N=N, sigma2=sigma2)
            assert abs(mean - exact) <= Z * se, (M, mean, exact, se)
    assert np.isclose(risks.pool, td.linear_risk(risks.Gamma, td.pool_second_moment(pool), N=N, sigma2=sigma2))


def test_the_optimum_is_the_minimiser():
    rng = np.random.default_rng(7)
    D, N, sigma2 = 4, 6, 0.25
    pool = rng.standard_normal((5, D))
    Sigma = td.pool_second_moment(pool)
    G = td.optimal_linear(Sigma, N=N, sigma2=sigma2)
    B = td.beta_second_moment(Sigma, N=N, sigma2=sigma2)
    assert np.allclose(G @ B, Sigma, atol=1e-12)  # first-order condition Γ B = Σ
    base = td.linear_risk(G, Sigma, N=N, sigma2=sigma2)
    assert np.isclose(base, np.trace(Sigma) - np.trace(Sigma @ np.linalg.solve(B, Sigma)) + sigma2, rtol=1e-12)
    for _ in range(5):  # the excess risk of any other Γ is the quadratic form tr(E B Eᵀ) > 0
        E = rng.standard_normal((D, D))
        excess = td.linear_risk(G + E, Sigma, N=N, sigma2=sigma2) - base
        assert excess > 0 and np.isclose(excess, np.trace(E @ B @ E.T), rtol=1e-10)


def test_large_pools_tend_to_the_fresh_optimum_which_is_above_the_noise():
    rng = np.random.default_rng(3)
    D, N, sigma2 = 4, 8, 0.25
    small_pool = rng.standard_normal((2, D))
    small = td.pool_linear_risks(small_pool, N=N, sigma2=sigma2)
    large = td.pool_linear_risks(rng.standard_normal((200_000, D)), N=N, sigma2=sigma2)
    G_inf = td.optimal_linear(np.eye(D), N=N, sigma2=sigma2)
    Sigma_small = td.pool_second_moment(small_pool)
    # each optimum wins on its own distribution: Γ_M on the pool, Γ_∞ on fresh tasks
    assert small.pool < td.linear_risk(G_inf, Sigma_small, N=N, sigma2=sigma2)
    assert small.fresh > small.fresh_optimum
    assert abs(large.fresh - large.fresh_optimum) < 1e-3 * large.fresh_optimum
    assert abs(large.pool - large.fresh_optimum) < 2e-2 * large.fresh_optimum  # Σ_M − I is O(M^{-1/2})
    assert large.fresh_optimum > sigma2


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="N"):
        td.beta_second_moment(np.eye(2), N=0, sigma2=0.1)
    with pytest.raises(ValueError, match="sigma2"):
        td.beta_second_moment(np.eye(2), N=3, sigma2=-1.0)
