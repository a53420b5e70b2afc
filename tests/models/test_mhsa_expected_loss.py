import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.models import mhsa as m
from iclab.tasks.multitask_regression import sample_G, task_structure


@pytest.mark.slow
def test_spectral_expected_loss_is_the_average_over_tasks_and_noise():
    # Fixed (X, q); Monte Carlo over G (2.4) and ε of ‖predict_spectral − y_q‖², within 4 standard errors.
    d_i, lam, sigma = (2, 3), (1.0, 0.6), 0.4
    ts = task_structure(d_i, lam, sigma=sigma)
    L, P, n = 6, 3, 40_000
    kx, kq, kg, ke = jax.random.split(jax.random.PRNGKey(0), 4)
    X = jax.random.normal(kx, (P, 5, L), dtype=jnp.float64)
    q = jax.random.normal(kq, (P, 5), dtype=jnp.float64)
    spec = {"omega": jnp.array([[0.3, 0.1], [0.05, 0.4]]), "mu": jnp.array([[1.2, 0.3], [-0.2, 0.9]])}
    exact = m.spectral_expected_loss(spec, X, q, d_i, lam, sigma2=sigma**2)
    G = sample_G(kg, ts, n)  # (n, d, d_y)
    eps = sigma * jax.random.normal(ke, (n, P, 2, L), dtype=jnp.float64)
    Y = jnp.einsum("ndy,pdl->npyl", G, X) + eps
    y_q = jnp.einsum("ndy,pd->npy", G, q)
    yhat = jax.vmap(lambda Yn: m.predict_spectral(spec, X, Yn, q, d_i))(Y)
    per = jnp.mean(jnp.sum((yhat - y_q) ** 2, axis=-1), axis=1)  # (n,)
    mc, se = float(jnp.mean(per)), float(jnp.std(per) / np.sqrt(n))
    assert abs(float(exact) - mc) <= 4 * se, (float(exact), mc, se)
    assert se < 0.02 * mc  # the test can fail: the Monte Carlo is precise to ~1 %
