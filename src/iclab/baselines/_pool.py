"""The Bayes predictor over a finite task pool (dMMSE, Raventós et al. 2023).

Data model (:mod:`iclab.tasks.pool`): w uniform over the pool {w_1, …, w_M}, y_n = wᵀx_n + σε_n. Given the
context, the posterior over the pool is a softmax of the Gaussian log-likelihoods (the prior is uniform and the
likelihood's normaliser is the same for every m):

    p(m | X, y) = softmax_m( −‖y − X w_m‖² / (2σ²) ),    ŷ = Σ_m p(m | X, y) w_mᵀ x_q,

the posterior mean of y_q, hence the Bayes predictor under squared loss for prompts from the pool (the
"discrete MMSE"). It needs σ² > 0 (with σ² = 0 the posterior is uniform over the tasks that fit the context
exactly). On tasks drawn fresh from the Gaussian prior the Bayes predictor is instead the posterior mean under
that prior, ridge with penalty σ²/σ_w² (:func:`iclab.baselines.gaussian_posterior_mean`); as M → ∞ the two
agree. Their risks on a batch of prompts are Monte Carlo estimates with standard errors
(:func:`iclab.baselines.mc_risk`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iclab.baselines._conditioning import _jit

__all__ = ["pool_posterior", "pool_posterior_mean"]


@_jit()
def pool_posterior(x, y, *, pool, sigma2) -> jax.Array:
    """The posterior over a task pool given the context: softmax_m(−‖y − X w_m‖² / (2σ²)).

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        pool: (M, D) task vectors.
        sigma2: label-noise variance σ² > 0.
    Returns:
        (..., M) posterior probabilities (each row sums to 1).
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    pool = jnp.asarray(pool, x.dtype)
    residual = y[..., None, :] - jnp.einsum("...nd,md->...mn", x, pool)  # (..., M, N)
    return jax.nn.softmax(-jnp.sum(residual**2, axis=-1) / (2.0 * sigma2), axis=-1)


@_jit()
def pool_posterior_mean(x, y, x_q, *, pool, sigma2) -> jax.Array:
    """dMMSE: the Bayes prediction of y_q for tasks uniform over a pool, ŷ = Σ_m p(m | X, y) w_mᵀ x_q.

    Args:
        x: (..., N, D) context inputs.
        y: (..., N) context labels.
        x_q: (..., D) query inputs.
        pool: (M, D) task vectors (:func:`iclab.tasks.pool.sample_pool`).
        sigma2: label-noise variance σ² > 0.
    Returns:
        (...,) predictions.
    """
    x_q = jnp.asarray(x_q)
    post = pool_posterior(x, y, pool=pool, sigma2=sigma2)
    return jnp.einsum("...m,md,...d->...", post, jnp.asarray(pool, x_q.dtype), x_q)
