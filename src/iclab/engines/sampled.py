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


def full_batch(loss_fn: Callable[[Any, Any], jax.Array], params0, data, **options) -> Trajectory:
    """Full-batch descent on ``loss_fn(params, data)``; ``metrics`` receive (params, data).

    ``options`` are those of :func:`iclab.engines._descent.descend` (lr, n_steps, optimizer,
    record_every, metrics, record_params, batched, callback).
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

    The recorded ``loss`` is that of the batch the next step would use; ``metrics`` receive
    (params, aux). With ``batched``, ``key`` may be one key (split per seed) or one per seed.
    """
    return descend(
        lambda params, state: loss_fn(params, sampler(jax.random.fold_in(state.key, state.step), state.aux)),
        params0, aux, key=key, **options,
    )
