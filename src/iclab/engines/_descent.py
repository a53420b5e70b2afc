"""Optimiser steps on a loss, shared by the population, sampled, moments and joint engines.

An engine takes the optimiser as an optax ``GradientTransformation`` WITHOUT its learning rate
(the update direction: ``optax.identity()`` for plain GD, ``optax.scale_by_adam()`` for Adam,
``optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd))`` for AdamW) and the learning
rate ``lr`` (a float or an optax schedule of the step) separately, and steps with

    θ_{k+1} = θ_k − lr_k · u_k,   (u_k, s_{k+1}) = optimizer.update(∇L(θ_k), s_k, θ_k),

i.e. ``optax.chain(optimizer, optax.scale_by_learning_rate(lr))``, which is exactly optax's own
``sgd``/``adam``/``adamw`` at that learning rate. Keeping lr apart defines the shared time axis
t = Σ_{k<step} lr_k (for plain GD the gradient-flow time that GD approximates) and needs no closures.
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
    """A constant learning rate as a schedule; a schedule is returned unchanged.

    Args:
        lr: a float > 0, or a schedule step -> learning rate (e.g. ``optax.cosine_decay_schedule``).
    Returns:
        A function step -> lr_step (float64 for a constant).
    """
    if callable(lr):
        return lr
    if not lr > 0:
        raise ValueError(f"lr must be > 0 (got {lr})")
    return lambda step: jnp.asarray(lr, dtype=jnp.float64)


def with_learning_rate(optimizer: optax.GradientTransformation | None, lr: Schedule) -> optax.GradientTransformation:
    """``optax.chain(optimizer, optax.scale_by_learning_rate(schedule))``: the step an engine takes.

    Args:
        optimizer: the update direction without a learning rate (None: plain GD); see the module docstring.
        lr: a float or a schedule (see :func:`as_schedule`).
    Returns:
        The optax transformation whose updates are −lr_k · u_k.
    """
    optimizer = optax.identity() if optimizer is None else optimizer
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError("optimizer must be an optax GradientTransformation without its learning rate, e.g. "
                        f"optax.scale_by_adam() (got {optimizer!r}); the engine applies lr itself")
    return optax.chain(optimizer, optax.scale_by_learning_rate(as_schedule(lr)))


def descend(
    objective: Callable[[Any, LoopState], jax.Array],
    params0,
    aux,
    *,
    lr: Schedule,
    n_steps: int,
    optimizer: optax.GradientTransformation | None = None,
    key: jax.Array | None = None,
    record_every: int = 1,
    metrics: dict[str, Callable[[Any, Any], jax.Array]] | None = None,
    record_params: bool = False,
    batched: bool = False,
    callback: Callback | None = None,
    unroll: int = 1,
    observation: Callable[[Any, LoopState], tuple[jax.Array, dict]] | None = None,
) -> Trajectory:
    """Runs n_steps of ``optimizer`` at learning rate ``lr`` on ``objective(params, state)``.

    θ_{k+1} = θ_k − lr_k u_k with u_k the optimizer's update (module docstring); t = Σ_{k<step} lr_k.

    Args:
        objective: (params, LoopState) -> scalar; it receives the loop state so that a sampled engine
            can draw its minibatch from ``state.key`` and ``state.step``.
        params0: initial params (leading seed axis S when ``batched``).
        aux: constants of the run, available as ``state.aux`` (batched with the params).
        lr: a float or a schedule step -> lr.
        n_steps: optimiser steps.
        optimizer: the update direction, an optax GradientTransformation without learning rate
            (None: plain GD).
        key: PRNG key of the run (one per seed when batched), available as ``state.key``.
        record_every: record spacing in steps (the last step is always recorded).
        metrics: {name: fn(params, aux)} recorded beside the loss.
        record_params: also record the params at every record.
        batched: vmap over a leading seed axis.
        callback: progress callback (see :mod:`iclab.engines._loop`).
        unroll: steps unrolled per iteration of the compiled loop (see :func:`iclab.engines._loop.run_loop`).
        observation: (params, LoopState) -> (loss, dict of extra metrics) evaluated at each record
            instead of the objective, when one pass gives both (it must return the objective's value).
    Returns:
        A Trajectory: the recorded ``loss`` is the objective at each record; ``final_params`` the params
        after the last step.
    """
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0 (got {n_steps})")
    if record_every < 1:
        raise ValueError(f"record_every must be >= 1 (got {record_every})")
    schedule = as_schedule(lr)
    opt = with_learning_rate(optimizer, schedule)
    metrics = metrics or {}

    def step_fn(state: LoopState) -> LoopState:
        grads = jax.grad(objective)(state.params, state)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        t = state.t + schedule(state.step)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1, t=t)

    def observe(state: LoopState) -> dict:
        if observation is None:
            out = {"loss": objective(state.params, state), "t": state.t}
        else:
            loss, extra = observation(state.params, state)
            out = {"loss": loss, "t": state.t, **extra}
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
    steps, obs, final = run_loop(step_fn, observe, state0, n_steps, record_every, batched=batched, callback=callback,
                                 unroll=unroll)
    t = obs.pop("t")
    loss = obs.pop("loss")
    params = obs.pop("params", None)
    return Trajectory(step=steps.astype(float), t=np.asarray(t[0] if batched else t), loss=loss, metrics=obs,
                      params=params, final_params=final.params)
