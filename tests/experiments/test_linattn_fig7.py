import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.experiments.linattn import fig7
from iclab.models import linattn as models
from iclab.tasks.linreg import covariance, sample_prompts
from iclab.theory import linattn as theory

LAM = np.array([0.4, 0.3, 0.2, 0.1])


@pytest.mark.parametrize("normalization", ["context", "tokens"])
def test_next_token_features_against_a_per_position_loop(normalization):
    D, N = 3, 5
    pr = sample_prompts(jax.random.PRNGKey(1), covariance([0.5, 0.3, 0.2]), N, 4)
    z, y = map(np.asarray, models.next_token_features(pr, normalization))
    assert z.shape == (4, N, D * D) and y.shape == (4, N)
    xs = np.concatenate([pr.x, pr.x_q[:, None]], axis=1)
    ys = np.concatenate([pr.y, pr.y_q[:, None]], axis=1)
    for p in range(4):
        for n in range(2, N + 2):  # 1-based position n: context = the first n−1 pairs
            ctx = n - 1
            beta = sum(ys[p, j] * xs[p, j] for j in range(ctx)) / (ctx if normalization == "context" else n)
            x_n = xs[p, n - 1]
            for i in range(D):
                for j in range(D):  # column-stacking vec: z[jD + i] = β_i x_j
                    assert z[p, n - 2, j * D + i] == pytest.approx(beta[i] * x_n[j], rel=1e-12, abs=1e-14)
            assert y[p, n - 2] == ys[p, n - 1]
    with pytest.raises(ValueError, match="normalization"):
        models.next_token_features(pr, "query")


def test_last_position_is_the_ordinary_cubic_feature():
    pr = sample_prompts(jax.random.PRNGKey(2), covariance(LAM), 7, 5)
    z, y = models.next_token_features(pr)
    np.testing.assert_allclose(z[:, -1], models.cubic_feature(pr), rtol=1e-13)
    np.testing.assert_array_equal(y[:, -1], pr.y_q)


def _monte_carlo(A, normalization, P=12000, N_max=31, seed=0):
    """Mean and standard error of the next-token loss of ŷ = βᵀA x over P independent prompts."""
    pr = sample_prompts(jax.random.PRNGKey(seed), covariance(LAM), N_max, P)
    z, y = models.next_token_features(pr, normalization)
    per_prompt = np.mean((np.asarray(y) - np.asarray(z) @ np.asarray(A).T.reshape(-1)) ** 2, axis=1)
    return per_prompt.mean(), per_prompt.std(ddof=1) / np.sqrt(P)


@pytest.mark.parametrize("normalization", ["context", "tokens"])
def test_expected_next_token_loss_against_monte_carlo(normalization):
    """The expected next-token loss (eq 23) of the reduced forms is the eq-30 loss at E(1/N) (context
    normalisation: linear in E(1/N)), or its affine map (token normalisation). 4 standard errors;
    the wrong E(1/N) = 1/N_max is rejected."""
    rng = np.random.default_rng(0)
    Lam = jnp.diag(LAM)
    A = np.asarray(theory.attn_m_fixed_point(Lam, 0.13)) + 0.8 * rng.standard_normal((4, 4))
    mean, se = _monte_carlo(A, normalization)
    exact = float(fig7.next_token_population_loss(A, Lam, 31, normalization))
    assert abs(mean - exact) < 4 * se, (mean, exact, se)
    b, e2, _ = fig7.length_constants(31, normalization)
    wrong = float((1 - b * b / e2) * LAM.sum() + (b * b / e2) * theory.population_loss((e2 / b) * A, Lam, 1 / 31))
    assert abs(mean - wrong) > 10 * se


@pytest.mark.parametrize("normalization", ["context", "tokens"])
def test_expected_loss_is_the_mean_over_lengths_of_the_fixed_length_losses(normalization):
    rng = np.random.default_rng(1)
    Lam = covariance(LAM, jax.random.PRNGKey(4))
    A = rng.standard_normal((4, 4))
    N = np.arange(1, 32)
    c = np.ones(31) if normalization == "context" else N / (N + 1.0)
    direct = np.mean([float(theory.population_loss(ci * A, Lam, 1.0 / n)) for ci, n in zip(c, N)])
    assert float(fig7.next_token_population_loss(A, Lam, 31, normalization)) == pytest.approx(direct, rel=1e-12)


def test_context_plateaus_are_eq_26_and_E_inv_N_is_harmonic():
    b, e2, kappa = fig7.length_constants(31, "context")
    assert (b, e2) == (1.0, 1.0) and kappa == pytest.approx(0.129911, abs=1e-6)
    np.testing.assert_allclose(fig7.next_token_plateau_losses(LAM, 31),
                               [1.0, 0.72503, 0.53308, 0.42069, 0.37952], atol=6e-6)  # eq 26, computed independently


@pytest.mark.parametrize("normalization", ["context", "tokens"])
def test_plateaus_are_stationary_losses_of_top_m_projections(normalization):
    """M_m = A* restricted to the top-m eigendirections: zero gradient on that subspace, loss = level m."""
    Lam = jnp.diag(LAM)
    A_star = np.asarray(fig7.next_token_fixed_point(Lam, 31, normalization))
    levels = fig7.next_token_plateau_losses(LAM, 31, normalization)
    loss = lambda A: fig7.next_token_population_loss(A, Lam, 31, normalization)  # noqa: E731
    assert np.abs(np.asarray(jax.grad(loss)(jnp.asarray(A_star)))).max() < 1e-12
    for m in range(5):
        A_m = A_star * (np.arange(4) < m)[None, :] * (np.arange(4) < m)[:, None]
        assert float(loss(A_m)) == pytest.approx(levels[m], abs=1e-12)
        g = np.asarray(jax.grad(loss)(jnp.asarray(A_m)))
        assert np.abs(g[:m, :m]).max(initial=0.0) < 1e-12
    if normalization == "tokens":  # the token count shrinks β: a genuinely different set of levels
        assert np.abs(levels - fig7.next_token_plateau_losses(LAM, 31, "context")).max() > 1e-3


def _staircase(t, levels, times, width):
    loss = np.full_like(t, levels[0])
    for k, tk in enumerate(times):
        loss += (levels[k + 1] - levels[k]) / (1 + np.exp(-(t - tk) / width))
    return loss


def test_plateau_readings_on_a_synthetic_staircase():
    t = np.linspace(0, 100, 2001)
    levels = [1.0, 0.7, 0.5, 0.42, 0.38]
    r = fig7.plateau_readings(t, _staircase(t, levels, [15, 35, 55, 80], 0.8))
    np.testing.assert_allclose(r, levels, atol=2e-3)
    # Two drops: three readings, and a shallow valley between merged drops is not a plateau.
    r2 = fig7.plateau_readings(t, _staircase(t, [1.0, 0.6, 0.3], [30, 70], 1.0))
    np.testing.assert_allclose(r2, [1.0, 0.6, 0.3], atol=2e-3)
    assert len(fig7.plateau_readings(t, _staircase(t, [1.0, 0.6, 0.3], [30, 33], 3.0))) == 2
