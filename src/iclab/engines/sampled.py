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
import optax

from iclab.engines._descent import Schedule, descend
from iclab.engines._loop import Callback, Trajectory


def full_batch(
    loss_fn: Callable[[Any, Any], jax.Array],
    params0,
    data,
    *,
    lr: Schedule,
    n_steps: int,
    optimizer: Callable[..., optax.GradientTransformation] = optax.sgd,
    record_every: int = 1,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
) -> Trajectory:
    """Full-batch descent on ``loss_fn(params, data)``; ``metrics`` receive (params, data)."""
    return descend(
        lambda params, state: loss_fn(params, state.aux),
        params0,
        data,
        lr=lr,
        n_steps=n_steps,
        optimizer=optimizer,
        record_every=record_every,
        metrics=metrics,
        record_params=record_params,
        batched=batched,
        callback=callback,
    )


def minibatch(
    loss_fn: Callable[[Any, Any], jax.Array],
    params0,
    sampler: Callable[[jax.Array, Any], Any],
    key: jax.Array,
    aux=None,
    *,
    lr: Schedule,
    n_steps: int,
    optimizer: Callable[..., optax.GradientTransformation] = optax.sgd,
    record_every: int = 1,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
) -> Trajectory:
    """Descent on ``loss_fn(params, sampler(fold_in(key, step), aux))``, a fresh batch per step.

    The recorded ``loss`` is that of the batch the next step would use.
    """
    return descend(
        lambda params, state: loss_fn(params, sampler(jax.random.fold_in(state.key, state.step), state.aux)),
        params0,
        aux,
        lr=lr,
        n_steps=n_steps,
        optimizer=optimizer,
        key=key,
        record_every=record_every,
        metrics=metrics,
        record_params=record_params,
        batched=batched,
        callback=callback,
    )
