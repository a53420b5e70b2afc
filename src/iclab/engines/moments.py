"""The moments engine: exact full-batch GD from sufficient statistics.

For a model whose prediction is linear in a fixed feature of the prompt, ŷ = ⟨T(θ), φ(X)⟩, the
full-batch mean squared loss on P prompts is

    L(θ) = c − 2⟨T, m⟩ + Tᵀ G T,   m = mean(y φ), G = mean(φ φᵀ), c = mean(y²),

so after one pass over the data (:func:`sufficient_statistics`) each step costs O(dim φ²),
independent of P and N, and follows the same trajectory as full-batch GD on the prompts
(:mod:`iclab.engines.sampled`) up to rounding. φ is the cubic feature z for the reduced linattn
models and vec(XXᵀ/N) ⊗ x_q for the full-matrix forms.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from iclab.engines._descent import descend
from iclab.engines._loop import Trajectory

__all__ = ["LONG_RUN_UNROLL", "SufficientStatistics", "full_batch", "quadratic_loss", "sufficient_statistics"]


class SufficientStatistics(NamedTuple):
    """c = mean(y²) (), m = mean(y φ) (F,), G = mean(φφᵀ) (F, F), over P samples."""

    c: jax.Array
    m: jax.Array
    G: jax.Array
    P: int


def sufficient_statistics(features: jax.Array, targets: jax.Array, chunk: int = 8192) -> SufficientStatistics:
    """The statistics of a data set, accumulated over chunks of rows to bound memory.

    Args:
        features: (P, F) φ of each prompt.
        targets: (P,) y of each prompt.
        chunk: rows per accumulation step (memory bound).
    Returns:
        SufficientStatistics (c, m, G, P).
    """
    P, F = features.shape
    c = jnp.zeros((), features.dtype)
    m = jnp.zeros((F,), features.dtype)
    G = jnp.zeros((F, F), features.dtype)
    for start in range(0, P, chunk):
        f, y = features[start : start + chunk], targets[start : start + chunk]
        c, m, G = c + y @ y, m + f.T @ y, G + f.T @ f
    return SufficientStatistics(c / P, m / P, G / P, P)


#: Steps unrolled per loop iteration for long runs (``full_batch(..., unroll=LONG_RUN_UNROLL)``): a step costs
#: a few µs, much of it the loop's own overhead on a CPU; unrolling 32 steps trims that overhead at the price
#: of more compilation, so it pays off over thousands of steps only. The arithmetic of each step is unchanged
#: (same trajectories).
LONG_RUN_UNROLL = 32


def quadratic_loss(T: jax.Array, stats: SufficientStatistics) -> jax.Array:
    """Full-batch mean squared loss c − 2⟨T, m⟩ + Tᵀ G T of the predictor ⟨T, φ⟩.

    Args:
        T: (F,) the tensor of the predictor; stats: the data's sufficient statistics.
    Returns:
        The scalar loss.
    """
    return stats.c - 2.0 * T @ stats.m + T @ (stats.G @ T)


def full_batch(
    tensor_fn: Callable[[Any], jax.Array],
    params0,
    stats: SufficientStatistics,
    *,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    extra=None,
    **options,
) -> Trajectory:
    """Full-batch descent on ``quadratic_loss(tensor_fn(params), stats)``.

    Args:
        tensor_fn: params -> T (F,), the predictor ŷ = ⟨T(θ), φ⟩.
        params0: initial params (leading seed axis S when ``batched``).
        stats: the sufficient statistics (leading seed axis when batched; ``P`` is static and shared).
        metrics: {name: fn(params, extra)} recorded beside the loss.
        extra: any pytree the metrics need (e.g. the covariance, to record the population loss).
        options: those of :func:`iclab.engines._descent.descend` (lr, n_steps, optimizer, record_every,
            record_params, batched, callback, unroll: see ``LONG_RUN_UNROLL``).
    Returns:
        A Trajectory on t = Σ lr; ``loss`` is the full-batch training loss, equal to full-batch GD on the
        prompts up to rounding.
    """

    def objective(params, state):
        s = state.aux
        T = tensor_fn(params)
        return s["c"] - 2.0 * T @ s["m"] + T @ (s["G"] @ T)

    return descend(
        objective,
        params0,
        {"c": stats.c, "m": stats.m, "G": stats.G, "extra": extra},
        metrics={k: (lambda p, a, f=f: f(p, a["extra"])) for k, f in (metrics or {}).items()},
        **options,
    )
