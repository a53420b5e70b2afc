"""In-context linear regression under AR(1) task drift (drift paper, Sec 2, eqs 2-4, 10-12, 17).

A prompt of length n holds inputs x_1..x_{n+1} iid N(0, Λ) and a task vector that drifts along the
prompt as an AR(1) process,

    w_0 ~ N(0, σ_w² I_d),   w_i = γ w_{i-1} + e_i,   e_i ~ N(0, σ_e² I_d)   (i = 1..n+1),

with noiseless labels y_i = ⟨w_i, x_i⟩; the target is y_{n+1}. γ = 1 and σ_e = 0 give the
stationary task (one w per prompt). The test prompts of Theorem 3 (eq 17) are drawn by the same
function with their own (m, γ̄, σ̄_w², σ̄_e²) and the same Λ.

The model sees the token matrix Z (eq 4, token-major here): rows z_i = (x_i, y_i) for i ≤ n and
z_{n+1} = (x_{n+1}, 0). Batches lie along a leading axis B. γ, σ_w², σ_e² may be traced arrays, so
a sampler can be vmapped over a grid of task processes. The task setting is passed by keyword in the
order of :mod:`iclab.theory.drift` (``gamma, sigma_w2, sigma_e2, n, Lam``), so one dict of it serves
the sampler and the closed forms alike. Gaussian draws come from :func:`iclab.tasks.standard_normal`.

:func:`sample_training_batch` and :func:`sample_shared_batch` draw the same process by the compiled sampler
of :mod:`iclab.ops` (another generator: Philox with a ziggurat or Box-Muller, so other numbers), in the token
layouts the compiled layer kernels read; the shared layout keeps the inputs once for a grid of γ.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from iclab.ops import DRIFT_NORMALS as NORMALS
from iclab.ops import drift_shared_batch as sample_shared_batch
from iclab.ops import drift_training_batch as sample_training_batch
from iclab.tasks import standard_normal

__all__ = ["NORMALS", "DriftPrompts", "sample_drift_prompts", "sample_shared_batch", "sample_tasks",
           "sample_training_batch", "tokens"]


class DriftPrompts(NamedTuple):
    """A batch of B drifting-task prompts of n context pairs.

    Attributes:
        x: (B, n+1, d) inputs x_1..x_{n+1} (the last is the query).
        y: (B, n+1) labels y_i = ⟨w_i, x_i⟩ (the last, y_{n+1}, is the target).
        w: (B, n+1, d) task vectors w_1..w_{n+1}.
    """

    x: jax.Array
    y: jax.Array
    w: jax.Array

    @property
    def n(self) -> int:
        """Number of labelled context pairs."""
        return self.x.shape[-2] - 1

    @property
    def target(self) -> jax.Array:
        """y_{n+1}, shape (B,)."""
        return self.y[..., -1]


def sample_tasks(key: jax.Array, B: int, d: int, *, gamma, sigma_w2, sigma_e2, n: int, dtype=jnp.float64) -> jax.Array:
    """Task vectors w_1..w_{n+1} of the AR(1) process w_i = γ w_{i-1} + e_i, w_0 ~ N(0, σ_w² I) (eq 2).

    ``gamma``, ``sigma_w2`` and ``sigma_e2`` may be arrays of one shape G (a grid of processes):
    every process is then driven by the SAME standard normals (common random numbers), w_0 = σ_w ε_0,
    e_i = σ_e ε_i, so the draws for a single process equal its slice of the grid's.

    Args:
        key: PRNG key.
        B: number of prompts.
        d: dimension.
        gamma, sigma_w2, sigma_e2: AR(1) coefficient γ and variances σ_w², σ_e², scalars or arrays of shape G.
        n: context length (the process runs to step n+1).
        dtype: float dtype of the result.
    Returns:
        (*G, B, n+1, d) array; [..., i-1, :] is w_i.
    """
    gamma, sigma_w2, sigma_e2 = jnp.broadcast_arrays(*(jnp.asarray(v, dtype) for v in (gamma, sigma_w2, sigma_e2)))
    G = gamma.shape
    k0, ke = jax.random.split(key)
    eps0 = standard_normal(k0, (B, d), dtype)
    eps = standard_normal(ke, (n + 1, B, d), dtype)
    expand = lambda a: a[(...,) + (None,) * 2]  # noqa: E731  (G) -> (G, 1, 1)
    w0 = expand(jnp.sqrt(sigma_w2)) * eps0
    g, se = expand(gamma), expand(jnp.sqrt(sigma_e2))

    def step(w, eps_i):
        w = g * w + se * eps_i
        return w, w

    _, w = jax.lax.scan(step, jnp.broadcast_to(w0, G + (B, d)), eps)
    return jnp.moveaxis(w, 0, -2)


def sample_drift_prompts(key: jax.Array, B: int, *, gamma, sigma_w2, sigma_e2, n: int, Lam: jax.Array,
                         dtype=None) -> DriftPrompts:
    """Draws B prompts of the drifting task (eqs 2-3): x_i ~ N(0, Λ), AR(1) w_i, y_i = ⟨w_i, x_i⟩.

    Inputs and task noise use independent keys (fold_in(key, 0) and fold_in(key, 1)). Given arrays
    of shape G for (γ, σ_w², σ_e²), it draws the prompts of every process from the same inputs and
    the same standard normals (common random numbers, see ``sample_tasks``): a grid costs one
    process's random numbers, and the slice g of the grid equals the draw for process g alone.

    Args:
        key: PRNG key.
        B: number of prompts.
        gamma, sigma_w2, sigma_e2: task process (γ̄, σ̄_w², σ̄_e² for test prompts), scalars or
            arrays of one shape G.
        n: labelled context pairs (the test length m of eq 17 for test prompts).
        Lam: (d, d) input covariance Λ.
        dtype: float dtype (default Λ's).
    Returns:
        DriftPrompts with x (*G, B, n+1, d) (broadcast), y (*G, B, n+1), w (*G, B, n+1, d).
    """
    if n < 1 or B < 1:
        raise ValueError(f"n and B must be >= 1 (got n={n}, B={B})")
    Lam = jnp.asarray(Lam)
    dtype = Lam.dtype if dtype is None else dtype
    d = Lam.shape[-1]
    chol = jnp.linalg.cholesky(Lam).astype(dtype)
    x = standard_normal(jax.random.fold_in(key, 0), (B, n + 1, d), dtype) @ chol.T
    w = sample_tasks(jax.random.fold_in(key, 1), B, d, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=n,
                     dtype=dtype)
    y = jnp.einsum("btd,...btd->...bt", x, w)
    return DriftPrompts(x=jnp.broadcast_to(x, w.shape), y=y, w=w)


def tokens(prompts: DriftPrompts) -> jax.Array:
    """The prompt matrix of eq 4, token-major: z_i = (x_i, y_i) for i ≤ n, z_{n+1} = (x_{n+1}, 0).

    Args:
        prompts: a batch of drifting-task prompts.
    Returns:
        (B, n+1, d+1) array Z.
    """
    y = prompts.y.at[..., -1].set(0.0)
    return jnp.concatenate([prompts.x, y[..., None]], axis=-1)
