"""The sampled engine: optimiser steps on a finite training set or on fresh minibatches.

- :func:`full_batch`: every step uses the whole fixed training set (the linattn reference code's
  procedure: one "epoch" = one GD step on P prompts).
- :func:`minibatch`: every step draws a fresh batch from ``sampler(key, aux)`` with the key
  ``fold_in(key, step)``, so runs are reproducible and independent of chunking.

Both record the training objective as ``loss`` and any ``metrics`` (e.g. the population loss of
the current weights), on t = Σ lr, and vmap over seeds when ``batched``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from iclab.engines._descent import descend
from iclab.engines._loop import Trajectory

__all__ = ["full_batch", "minibatch"]


def full_batch(loss_fn: Callable[[Any, Any], jax.Array], params0, data, **options) -> Trajectory:
    """Full-batch descent on the training loss of a fixed data set, ``loss_fn(params, data)``.

    Args:
        loss_fn: (params, data) -> scalar training loss.
        params0: initial params (leading seed axis S when ``batched``).
        data: the training set (batched with the params); ``metrics`` receive (params, data).
        options: those of :func:`iclab.engines._descent.descend` (lr, n_steps, optimizer, record_every,
            metrics, record_params, batched, callback, unroll).
    Returns:
        A Trajectory on t = Σ lr; ``loss`` is the training loss at each record.
    """
    return descend(lambda params, state: loss_fn(params, state.aux), params0, data, **options)


def minibatch(
    loss_fn: Callable[[Any, Any], jax.Array],
    params0,
    sampler: Callable[[jax.Array, Any], Any],
    key: jax.Array,
    aux=None,
    **options,
) -> Trajectory:
    """Descent on ``loss_fn(params, sampler(fold_in(key, step), aux))``, a fresh batch per step.

    Args:
        loss_fn: (params, batch) -> scalar.
        params0: initial params (leading seed axis S when ``batched``).
        sampler: (key, aux) -> batch.
        key: the data key; with ``batched``, one key (split per seed) or one per seed.
        aux: constants passed to the sampler and the metrics ((params, aux)).
        options: those of :func:`iclab.engines._descent.descend`.
    Returns:
        A Trajectory on t = Σ lr whose ``loss`` is that of the batch the next step would use.
    """
    return descend(
        lambda params, state: loss_fn(params, sampler(jax.random.fold_in(state.key, state.step), state.aux)),
        params0, aux, key=key, **options,
    )
