"""Finite task pools: the pretraining task diversity of Raventós et al. (2023), for in-context linear regression.

A **pool** is M task vectors w_1..w_M drawn once, iid from the Gaussian task prior N(0, Σ_w), from a seed of its
own. Prompts from the pool draw each prompt's task uniformly from it, w = w_m with m ~ U{1..M}; every other part
of the prompt is the linreg task's (:mod:`iclab.tasks.linreg`): x_n, x_q ~ N(0, Λ) iid, and labels

    y_n = wᵀx_n + σ ε_n,    y_q = wᵀx_q + σ ε_q,    ε ~ N(0, 1) iid,

so σ² = 0 gives linreg's noiseless prompts, and ``pool=None`` (M = ∞) draws a fresh task per prompt from the
prior itself. A model pretrained on the pool and then tested on fresh tasks shows the task-diversity transition:
with few tasks its best predictor is the Bayes predictor over the pool (dMMSE,
:func:`iclab.baselines.pool_posterior_mean`), with many it is the Bayes predictor under the Gaussian prior (ridge,
:func:`iclab.baselines.gaussian_posterior_mean`).

The query's label carries the noise as the context's do (as in Raventós et al.), so a risk on these prompts is the
noiseless-target risk plus σ².

:class:`PoolTask` declares the settings of this task once (D, N, σ², with Λ = I and the prior N(0, I) of Raventós
et al.): an experiment's config holds it whole (``task: PoolTask = nested(PoolTask, ...)``, named ``task.D`` by
users) and draws its pool and prompts with its methods.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field

from iclab.tasks.linreg import Prompts

__all__ = ["PoolTask", "pool_task_vectors", "sample_pool", "sample_pool_prompts"]


def sample_pool(key: jax.Array, M: int, D: int, *, prior_cov=1.0, dtype=jnp.float64) -> jax.Array:
    """A pool of M task vectors drawn iid from the prior N(0, Σ_w).

    Args:
        key: the pool's own key (the pool is fixed before pretraining starts).
        M: pool size (≥ 1).
        D: input dimension.
        prior_cov: σ_w² (scalar: Σ_w = σ_w² I) or a (D, D) positive semi-definite Σ_w.
        dtype: the pool's dtype.
    Returns:
        (M, D) task vectors.
    """
    if not isinstance(M, int) or M < 1:
        raise ValueError(f"M: a pool holds at least one task (got {M!r})")
    g = jax.random.normal(key, (M, D), dtype)
    p = jnp.asarray(prior_cov, dtype)
    if p.ndim == 0:
        return jnp.sqrt(p) * g
    if p.shape != (D, D):
        raise ValueError(f"prior_cov must be a scalar or a ({D}, {D}) matrix (got shape {p.shape})")
    evals, evecs = jnp.linalg.eigh(0.5 * (p + p.T))  # Σ_w = C Cᵀ with C its symmetric square root (PSD allowed)
    return g @ ((evecs * jnp.sqrt(jnp.clip(evals, 0.0, None))) @ evecs.T)


def pool_task_vectors(key: jax.Array, pool: jax.Array, P: int) -> jax.Array:
    """P task vectors drawn uniformly, with replacement, from the pool's M rows.

    Args:
        key: the draw's key.
        pool: (M, D) task vectors (:func:`sample_pool`).
        P: tasks to draw.
    Returns:
        (P, D) task vectors, each a row of ``pool``.
    """
    return pool[jax.random.randint(key, (P,), 0, pool.shape[0])]


def sample_pool_prompts(key: jax.Array, Lam: jax.Array, N: int, P: int, *, pool: jax.Array | None = None,
                        prior_cov=1.0, sigma2=0.0) -> Prompts:
    """P prompts of N noisy context pairs and a noisy query, each task from the pool (or fresh from the prior).

    Args:
        key: the prompts' key (split into tasks, inputs and noise).
        Lam: (D, D) input covariance Λ.
        N: context pairs per prompt.
        P: prompts.
        pool: (M, D) task pool (:func:`sample_pool`), or None for a fresh task per prompt (M = ∞).
        prior_cov: the prior of the fresh tasks when ``pool`` is None (σ_w² or Σ_w, as :func:`sample_pool`).
        sigma2: label-noise variance σ² ≥ 0 (context and query labels alike).
    Returns:
        :class:`iclab.tasks.linreg.Prompts` with x (P, N, D), y (P, N), x_q (P, D), y_q (P,), w (P, D).
    """
    sigma2 = float(sigma2)
    if sigma2 < 0:
        raise ValueError(f"sigma2: a noise variance is ≥ 0 (got {sigma2})")
    Lam = jnp.asarray(Lam)
    D, dtype = Lam.shape[0], Lam.dtype
    k_w, k_x, k_e = jax.random.split(key, 3)
    w = sample_pool(k_w, P, D, prior_cov=prior_cov, dtype=dtype) if pool is None else pool_task_vectors(
        k_w, jnp.asarray(pool, dtype), P)
    chol = jnp.linalg.cholesky(Lam)
    xs = jax.random.normal(k_x, (P, N + 1, D), dtype) @ chol.T
    labels = jnp.einsum("pnd,pd->pn", xs, w) + jnp.sqrt(sigma2) * jax.random.normal(k_e, (P, N + 1), dtype)
    return Prompts(x=xs[:, :N], y=labels[:, :N], x_q=xs[:, N], y_q=labels[:, N], w=w)


class PoolTask(BaseModel):
    """The settings of a task-pool experiment's prompts, declared once: inputs x_n, x_q ~ N(0, I_D), N context
    pairs, labels y = wᵀx + σε on context and query alike, tasks w from a pool of M vectors drawn from N(0, I_D)
    (:meth:`pool`) or fresh from N(0, I_D) per prompt (M = ∞), Raventós et al.'s setting. The pool sizes M are
    an experiment's sweep, not the task's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    D: int = Field(2, ge=1, le=4096, description="input dimension D (x and the task vectors w)")
    N: int = Field(8, ge=1, le=100_000, description="context pairs N per prompt (the query is the (N+1)-th input)")
    sigma2: float = Field(0.25, ge=0, le=1e4, description="label-noise variance σ² (context and query labels)")

    def pool(self, key: jax.Array, M: int, *, dtype=jnp.float64) -> jax.Array:
        """M task vectors from the prior N(0, I_D) (:func:`sample_pool`).

        Args:
            key: the pool's key; M: its size; dtype: the vectors' dtype.
        Returns:
            (M, D) pool.
        """
        return sample_pool(key, M, self.D, dtype=dtype)

    def prompts(self, key: jax.Array, P: int, *, pool: jax.Array | None = None, dtype=jnp.float64) -> Prompts:
        """P prompts with Λ = I_D, each task from ``pool`` (or fresh from N(0, I_D) when None: M = ∞), the labels
        noisy with variance σ² (:func:`sample_pool_prompts`).

        Args:
            key: the prompts' key; P: how many; pool: (M, D) pool or None; dtype: the prompts' dtype.
        Returns:
            :class:`iclab.tasks.linreg.Prompts` with x (P, N, D), y (P, N), x_q (P, D), y_q (P,), w (P, D).
        """
        return sample_pool_prompts(key, jnp.eye(self.D, dtype=dtype), self.N, P, pool=pool, sigma2=self.sigma2)
