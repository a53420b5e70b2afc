"""Optimiser steps on a loss, shared by the population and sampled engines.

Any optax optimiser can be used; the time axis is t = Σ_k lr_k, the learning rate the schedule
gives at each step (for plain GD this is the gradient-flow time that GD approximates).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from iclab.engines._loop import Callback, LoopState, Trajectory, run_loop

Schedule = float | Callable[[jax.Array], jax.Array]


def as_schedule(lr: Schedule) -> Callable[[jax.Array], jax.Array]:
    """A constant learning rate as a schedule; a schedule is returned unchanged."""
    if callable(lr):
        return lr
    if not lr > 0:
        raise ValueError(f"lr must be > 0 (got {lr})")
    return lambda step: jnp.asarray(lr, dtype=jnp.float64)


def descend(
    objective: Callable[[Any, LoopState], jax.Array],
    params0,
    aux,
    *,
    lr: Schedule,
    n_steps: int,
    optimizer: Callable[..., optax.GradientTransformation] = optax.sgd,
    key: jax.Array | None = None,
    record_every: int = 1,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
    unroll: int = 1,
) -> Trajectory:
    """Runs n_steps of ``optimizer(learning_rate=lr)`` on ``objective(params, state)``.

    The objective receives the loop state so that a sampled engine can draw its minibatch from
    ``state.key`` and ``state.step``; the recorded ``loss`` is the objective at each record.
    ``unroll``: steps unrolled per iteration of the compiled loop (see :func:`iclab.engines._loop.run_loop`).
    """
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0 (got {n_steps})")
    if record_every < 1:
        raise ValueError(f"record_every must be >= 1 (got {record_every})")
    schedule = as_schedule(lr)
    opt = optimizer(learning_rate=schedule)
    metrics = metrics or {}

    def step_fn(state: LoopState) -> LoopState:
        grads = jax.grad(objective)(state.params, state)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        t = state.t + schedule(state.step)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, t=t)

    def observe(state: LoopState) -> dict:
        out = {"loss": objective(state.params, state), "t": state.t}
        out.update({name: fn(state.params, state.aux) for name, fn in metrics.items()})
        if record_params:
            out["params"] = state.params
        return out

    def init(params, aux, key):
        return LoopState(params, opt.init(params), jnp.asarray(0), jnp.asarray(0.0, jnp.float64), aux, key)

    if key is None:
        key = jax.random.PRNGKey(0)
    if batched and jnp.ndim(key) == 1:
        n_seeds = jax.tree_util.tree_leaves(params0)[0].shape[0]
        key = jax.random.split(key, n_seeds)
    state0 = (jax.vmap(init) if batched else init)(params0, aux, key)
    steps, obs, _ = run_loop(step_fn, observe, state0, n_steps, record_every, batched=batched, callback=callback,
                             unroll=unroll)
    t = obs.pop("t")
    loss = obs.pop("loss")
    params = obs.pop("params", None)
    return Trajectory(step=steps.astype(float), t=np.asarray(t[0] if batched else t), loss=loss, metrics=obs, params=params)
