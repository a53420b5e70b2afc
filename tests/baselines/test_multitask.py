"""gating's correlated tasks with delimiters: the posterior mean against the kernel (GP) form of the same
conditioning, the Bayes risk against its closed form and Monte Carlo, and Bayes beating WPGD's optimum."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.tasks import multitask as mt
from iclab.theory import wpgd


def _prompts(rng, B, sizes, factor, d, sigma=0.0):
    """Sec 5.1 prompts (``iclab.tasks.multitask.sample_blocks``), drawn with numpy."""
    K, n = len(sizes), sum(sizes)
    betas = np.einsum("ij,bjd->bid", factor, rng.standard_normal((B, K + 1, d)))
    xs = rng.standard_normal((B, n + 1, d))
    owner = np.repeat(np.arange(K), sizes)
    per_sample = np.concatenate([betas[:, owner], betas[:, K:]], axis=1)
    ys = np.einsum("bid,bid->bi", xs, per_sample) + sigma * rng.standard_normal((B, n + 1))
    return mt.MultitaskPrompts(*(jnp.asarray(a) for a in (xs[:, :n], ys[:, :n], xs[:, n], ys[:, n], betas[:, :K],
                                                          betas[:, K])))


def _kernel_form(x, y, xq, sizes, C, sigma2):
    """The kernel form Cov(x_qᵀβ, y) Cov(y)⁺ y: ŷ = Σ_j C_{K+1,k(j)} (x_qᵀx_j) α_j,
    α = (C_{k(i)k(j)} x_iᵀx_j + σ²δ_ij)⁺ y."""
    K = len(sizes)
    owner = np.repeat(np.arange(K), sizes)
    Ky = C[np.ix_(owner, owner)] * (x @ x.T) + sigma2 * np.eye(len(owner))
    kq = C[K, owner] * (x @ xq)
    return kq @ np.linalg.pinv(Ky, rcond=1e-10, hermitian=True) @ y


def _correlated_factor():
    """(task_R, task_r) of a random valid joint correlation of K = 3 tasks and the query task."""
    A = np.random.default_rng(11).standard_normal((4, 6))
    G = A @ A.T
    C = G / np.sqrt(np.outer(np.diag(G), np.diag(G)))
    return C[:3, :3], C[:3, 3]


@pytest.mark.parametrize("sigma2", [0.0, 0.4])
def test_posterior_mean_is_the_kernel_form_for_any_factor(sigma2):
    rng = np.random.default_rng(0)
    sizes, d = [2, 5, 3], 3  # the middle block holds more samples than dimensions: Cov(y) is singular at σ = 0
    R, r = _correlated_factor()
    L = mt.task_correlation_factor(R, r)
    C = mt.joint_task_correlation(R, r)
    pr = _prompts(rng, 4, sizes, L, d, np.sqrt(sigma2))
    got = bl.on_prompts(bl.multitask_posterior_mean, block_sizes=sizes, factor=L, sigma2=sigma2)(pr)
    want = [_kernel_form(*(np.asarray(a)[b] for a in (pr.x, pr.y, pr.x_query)), sizes, C, sigma2) for b in range(4)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    chol = np.linalg.cholesky(C)  # another factor of the same C: the same posterior
    np.testing.assert_allclose(bl.multitask_posterior_mean(pr.x, pr.y, pr.x_query, block_sizes=sizes, factor=chol,
                                                           sigma2=sigma2), got, rtol=0, atol=1e-10)


def test_closed_form_risk_of_independent_tasks_holds_for_every_context():
    rng = np.random.default_rng(1)
    d = 4
    L = mt.two_task_factor(r1=0.2, r2=0.8)
    for sizes in ([2, 3], [6, 3], [5, 7]):
        pr = _prompts(rng, 20, sizes, L, d)
        np.testing.assert_allclose(bl.multitask_bayes_risk(pr.x, block_sizes=sizes, factor=L),
                                   bl.independent_tasks_bayes_risk(block_sizes=sizes, task_r=[0.2, 0.8], d=d),
                                   rtol=0, atol=1e-10)
    assert bl.independent_tasks_bayes_risk(block_sizes=[5, 7], task_r=[0.2, 0.8], d=4) == pytest.approx(4 * 0.32)


def test_bayes_risk_matches_monte_carlo_and_beats_wpgd():
    rng = np.random.default_rng(2)
    sizes, d, sigma2 = [2, 5, 3], 3, 0.25
    R, r = _correlated_factor()
    L = mt.task_correlation_factor(R, r)
    pr = _prompts(rng, 4000, sizes, L, d, np.sqrt(sigma2))
    x, y, xq = bl.split_prompts(pr)
    err = np.asarray((bl.multitask_posterior_mean(x, y, xq, block_sizes=sizes, factor=L, sigma2=sigma2)
                      - pr.y_query) ** 2)
    risk = np.asarray(bl.multitask_bayes_risk(x, block_sizes=sizes, factor=L, sigma2=sigma2))
    diff = err - risk
    assert abs(diff.mean()) < 4 * diff.std(ddof=1) / np.sqrt(diff.size)
    # the optimal WPGD of Thm 2 (any one-layer GLA's best, eq 17) on the same prompts: worse, by many SE
    R_s, r_s = wpgd.multitask_correlation(sizes, R, r)
    opt = wpgd.wpgd_optimum(np.eye(d), R_s, r_s, sigma2)
    w_err = np.asarray((bl.wpgd(x, y, xq, P=opt.P, omega=opt.omega) - pr.y_query) ** 2)
    assert abs(w_err.mean() - opt.risk) < 4 * w_err.std(ddof=1) / np.sqrt(w_err.size)
    gap = w_err - err
    assert gap.mean() > 4 * gap.std(ddof=1) / np.sqrt(gap.size)
    # and pooled least squares on all blocks, which ignores that the blocks hold different tasks
    ls = np.asarray((bl.least_squares(x, y, xq) - pr.y_query) ** 2) - err
    assert ls.mean() > 4 * ls.std(ddof=1) / np.sqrt(ls.size)


def test_app_b1_bayes_risk_is_far_below_the_wpgd_optimum():
    # App B.1 panel (a): (r1, r2) = (0, 1), d = 10, σ = 0; per-d risks at n̄ = 5 and 10
    d = 10
    for n_bar, wpgd_per_d in ((5, 0.6875), (10, 0.5238)):
        R_s, r_s = wpgd.two_task_correlation(n_bar, r1=0.0, r2=1.0)
        assert wpgd.wpgd_optimal_risk_isotropic(d, R_s, r_s, 0.0) / d == pytest.approx(wpgd_per_d, abs=1e-4)
        bayes = bl.independent_tasks_bayes_risk(block_sizes=[n_bar, n_bar], task_r=[0.0, 1.0], d=d) / d
        assert bayes == pytest.approx(1 - n_bar / d)
        assert bayes < wpgd_per_d
