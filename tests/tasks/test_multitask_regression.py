import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.tasks.multitask_regression import (
    block_scales, homogeneous, sample_prompts, target_second_moment, task_structure)


@pytest.mark.parametrize("rotated", [False, True])
def test_shapes_and_noiseless_relations(rotated):
    ts = task_structure((3, 2, 4), (1.0, 0.5, 2.0), sigma=0.0, d_y=4,
                        rotation_key=jax.random.PRNGKey(5) if rotated else None)
    pr = sample_prompts(jax.random.PRNGKey(0), ts, L=7, P=6)
    assert pr.X.shape == (6, 9, 7) and pr.Y.shape == (6, 4, 7) and pr.q.shape == (6, 9)
    assert pr.y_q.shape == (6, 4) and pr.G.shape == (6, 9, 4) and pr.X.dtype == jnp.float64
    for p in range(6):
        np.testing.assert_allclose(pr.Y[p], pr.G[p].T @ pr.X[p], atol=1e-13)
        np.testing.assert_allclose(pr.y_q[p], pr.G[p].T @ pr.q[p], atol=1e-13)
        # the block structure in the Φ, Ψ basis (nominal 4th output is zero)
        core = np.asarray(ts.Phi.T @ pr.G[p] @ ts.Psi) * np.sqrt(9)
        np.testing.assert_allclose(core * (block_scales(ts) == 0), 0, atol=1e-12)
    np.testing.assert_allclose(ts.Phi @ ts.Phi.T, np.eye(9), atol=1e-13)
    np.testing.assert_allclose(ts.Psi @ ts.Psi.T, np.eye(4), atol=1e-13)


@pytest.mark.parametrize("rotated", [False, True])
def test_moments_by_monte_carlo(rotated):
    d_i, lam, sigma = (3, 2), (1.0, 3.0), 0.7
    ts = task_structure(d_i, lam, sigma=sigma, rotation_key=jax.random.PRNGKey(1) if rotated else None)
    P, L = 40_000, 3
    pr = sample_prompts(jax.random.PRNGKey(2), ts, L=L, P=P)
    d = 5
    # E[G_ab G_ce] in the rotated basis: Cov(vec core) = diag(S²)/d
    core = np.einsum("ab,pbc,cd->pad", np.asarray(ts.Phi).T, np.asarray(pr.G), np.asarray(ts.Psi))
    S2 = block_scales(ts) ** 2 / d
    emp = (core**2).mean(0)
    se = np.sqrt(2.0 * S2**2 / P) + 1e-300
    assert np.all(np.abs(emp - S2) <= 4 * se + 1e-15)
    assert abs(core.mean(0)).max() < 4 * np.sqrt(S2.max() / P)
    # E‖y_q‖² = Σ λ_i d_i / d, and the noise has variance σ²
    yq2 = (np.asarray(pr.y_q) ** 2).sum(1)
    assert abs(yq2.mean() - target_second_moment(ts)) < 4 * yq2.std() / np.sqrt(P)
    resid = np.asarray(pr.Y) - np.einsum("pdy,pdl->pyl", pr.G, pr.X)
    assert abs(resid.var() - sigma**2) < 4 * sigma**2 * np.sqrt(2.0 / resid.size)
    # covariates: white Gaussian
    x = np.asarray(pr.X).transpose(0, 2, 1).reshape(-1, d)
    np.testing.assert_allclose(x.T @ x / x.shape[0], np.eye(d), atol=4 * np.sqrt(2.0 / x.shape[0]))
    # E[y_l y_lᵀ] = diag(λ_i d_i/d) + σ² I in the Ψ basis (Φ, Ψ orthogonal)
    Yr = np.einsum("ab,pbl->pal", np.asarray(ts.Psi).T, np.asarray(pr.Y)).transpose(0, 2, 1).reshape(-1, 2)
    want = np.diag([l * di / d for l, di in zip(lam, d_i)]) + sigma**2 * np.eye(2)
    np.testing.assert_allclose(Yr.T @ Yr / Yr.shape[0], want, atol=0.04)


def test_homogeneous_and_validation():
    ts = homogeneous(3, 10, lam=1.0)
    assert ts.d == 30 and ts.d_y == 3 and target_second_moment(ts) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        task_structure((3, 2), (1.0, 1.0), d_y=1)
    with pytest.raises(ValueError):
        task_structure((3, 0), 1.0)
    with pytest.raises(TypeError):  # σ follows λ: keyword-only, never a positional float
        task_structure((3, 2), 1.0, 0.5)
