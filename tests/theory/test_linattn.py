"""linattn theory against Monte Carlo and reference numbers computed independently of iclab."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.models.linattn import cubic_feature
from iclab.tasks.linreg import context_moment, covariance, sample_prompts
from iclab.theory import linattn as th

LAM4 = [0.4, 0.3, 0.2, 0.1]


def _within(mean, se, expected, n_se=5.0):
    return np.all(np.abs(np.asarray(mean) - np.asarray(expected)) <= n_se * np.asarray(se))


def _mc(samples):
    samples = np.asarray(samples)
    return samples.mean(0), samples.std(0, ddof=1) / np.sqrt(samples.shape[0])


def _lambda_hat(pr):
    N = pr.x.shape[1]
    return jnp.einsum("pni,pnj->pij", pr.x, pr.x) / N


def test_expected_lambda_hat_sq_fixed_length_monte_carlo():
    """Eq 31 within 5 standard errors; the N→∞ form Λ² is rejected by the same test."""
    N = 5
    Lam = covariance(LAM4, jax.random.PRNGKey(0))
    pr = sample_prompts(jax.random.PRNGKey(1), Lam, N, 100_000)
    Lh = _lambda_hat(pr)
    mean, se = _mc(jnp.einsum("pij,pjk->pik", Lh, Lh))
    assert _within(mean, se, th.expected_lambda_hat_sq(Lam, 1.0 / N))
    assert not _within(mean, se, Lam @ Lam)


def test_expected_lambda_hat_sq_random_length_monte_carlo():
    """Eq 30 with N uniform on 1..N_max: E(1/N) = H_{N_max}/N_max."""
    N_max, P = 6, 100_000
    Lam = covariance(LAM4)
    key = jax.random.PRNGKey(2)
    pr = sample_prompts(key, Lam, N_max, P)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (P,), 1, N_max + 1)
    mask = (jnp.arange(N_max)[None, :] < lengths[:, None]).astype(jnp.float64)
    Lh = jnp.einsum("pn,pni,pnj->pij", mask, pr.x, pr.x) / lengths[:, None, None]
    mean, se = _mc(jnp.einsum("pij,pjk->pik", Lh, Lh))
    inv_N = th.harmonic_inv_length(N_max)
    assert inv_N == pytest.approx(sum(1 / n for n in range(1, 7)) / 6, rel=1e-15)
    assert _within(mean, se, th.expected_lambda_hat_sq(Lam, inv_N))
    assert not _within(mean, se, th.expected_lambda_hat_sq(Lam, 1.0 / N_max))


def test_harmonic_inverse_length_reference():
    assert th.harmonic_inv_length(31) == pytest.approx(0.129911, abs=5e-7)


def test_cubic_feature_moments_monte_carlo():
    """Eqs 43-44: E(y_q z) = vec(Λ²), E(zzᵀ) = Λ ⊗ E[Λ̂²], within 5 standard errors."""
    N = 4
    Lam = covariance([0.5, 0.3, 0.2], jax.random.PRNGKey(3))
    pr = sample_prompts(jax.random.PRNGKey(4), Lam, N, 200_000)
    z = cubic_feature(pr)
    E_yz, E_zz = th.cubic_feature_moments(Lam, 1.0 / N)
    mean, se = _mc(pr.y_q[:, None] * z)
    assert _within(mean, se, E_yz)
    mean, se = _mc(z[:, :, None] * z[:, None, :])
    assert _within(mean, se, E_zz)
    # The Kronecker order matters: Λ_q ⊗ E[Λ̂²], not E[Λ̂²] ⊗ Λ_q.
    assert not _within(mean, se, jnp.kron(th.expected_lambda_hat_sq(Lam, 1.0 / N), Lam))


@pytest.mark.parametrize("N", [3, 31])
def test_population_loss_monte_carlo(N):
    """L(A) = trΛ − 2tr(AΛ²) + tr(AᵀE[Λ̂²]AΛ) against the empirical query loss of ŷ = βᵀAx_q."""
    Lam = covariance(LAM4, jax.random.PRNGKey(5))
    A = jax.random.normal(jax.random.PRNGKey(6), (4, 4))
    pr = sample_prompts(jax.random.PRNGKey(7), Lam, N, 200_000)
    resid = pr.y_q - jnp.einsum("pi,ij,pj->p", context_moment(pr), A, pr.x_q)
    mean, se = _mc(resid**2)
    assert abs(mean - th.population_loss(A, Lam, 1.0 / N)) <= 5 * se
    # The MLP route (eq 44 moments) gives the same number to rounding.
    W = A.T.reshape(-1)
    assert th.mlp_population_loss(W, Lam, 1.0 / N) == pytest.approx(float(th.population_loss(A, Lam, 1.0 / N)), rel=1e-12)


def test_plateau_losses_reference_numbers():
    """Reference numbers of eq 19 (trace-1 Λ, N = 31), computed independently."""
    np.testing.assert_allclose(th.plateau_losses(LAM4, 1 / 31), [1, 0.64058, 0.37737, 0.20980, 0.13600], atol=6e-6)
    inv = np.array([1 / d for d in range(1, 9)])
    np.testing.assert_allclose(
        th.plateau_losses(inv / inv.sum(), 1 / 31),
        [1, 0.67146, 0.51912, 0.42444, 0.35792, 0.30788, 0.26853, 0.23660, 0.21007], atol=6e-6)
    lin8 = np.arange(8, 0, -1) / 36
    np.testing.assert_allclose(
        th.plateau_losses(lin8, 1 / 31),
        [1, 0.81126, 0.64898, 0.51301, 0.40318, 0.31917, 0.26045, 0.22601, 0.21335], atol=6e-6)
    np.testing.assert_allclose(th.plateau_losses([0.35, 0.35, 0.15, 0.15], 1 / 31),
                               [1, 0.68873, 0.37746, 0.25720, 0.13694], atol=6e-6)
    np.testing.assert_allclose(th.plateau_losses(LAM4, th.harmonic_inv_length(31)),
                               [1, 0.72503, 0.53308, 0.42069, 0.37952], atol=6e-6)
    assert th.plateau_losses([0.25] * 4, 1 / 31)[-1] == pytest.approx(0.13889, abs=6e-6)
    assert th.plateau_losses([1.0] * 4, 1 / 31)[-1] == pytest.approx(4 * 5 / (31 + 1 + 4), abs=1e-12)


def test_global_minimum_of_population_loss_is_L_MD():
    """The minimiser A* = E[Λ̂²]⁻¹Λ (eq 11) has zero gradient and loss L(M_D) (eq 19, m = D)."""
    Lam = covariance(LAM4, jax.random.PRNGKey(8))
    inv_N = 1 / 31
    A_star = jnp.linalg.solve(th.expected_lambda_hat_sq(Lam, inv_N), Lam)
    grad = jax.grad(th.population_loss)(A_star, Lam, inv_N)
    assert np.abs(grad).max() < 1e-12
    assert float(th.population_loss(A_star, Lam, inv_N)) == pytest.approx(th.plateau_losses(LAM4, inv_N)[-1], abs=1e-12)


def test_public_surface_documented_and_keyword_only():
    """Every name in __all__ exists and has its maths documented with Args and Returns; scalars that follow
    each other are keyword-only, and the context length enters as inv_N = E(1/N) everywhere."""
    import inspect

    for name in th.__all__:
        fn = getattr(th, name)
        doc = fn.__doc__ or ""
        assert "Args:" in doc and "Returns:" in doc, name
        assert "N" not in inspect.signature(fn).parameters, name  # inv_N, never N
    with pytest.raises(TypeError):
        th.v_star(0.4, 1 / 31, 1.0)
    with pytest.raises(TypeError):
        th.white_loss(1.0, 4, 1 / 31, 0.1)
    # random lengths: eq 51 at E(1/N) (the loss is linear in E(1/N) through α)
    kappa = th.harmonic_inv_length(31)
    assert th.white_loss(np.inf, 4, inv_N=kappa, w_init=0.1) == pytest.approx(4 * (1 - 1 / (1 + 5 * kappa)), rel=1e-12)
    with pytest.raises(TypeError):
        th.eq21_solve(0.1, 0.4, 1 / 31, 1.0, np.array([0.0, 1.0]))
