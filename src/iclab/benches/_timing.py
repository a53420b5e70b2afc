"""Shared pieces of the benchmarks (``iclab bench``): a jitted loop of optimiser steps and its timing.

A step is ``jax.grad`` of the loss on the batch drawn from fold_in(key, step), then one update of an
optax optimiser (``optax.sgd(lr)`` is exactly params − lr·grad): the arithmetic of the sampled
engine's step. The loop is one jitted ``fori_loop``, compiled on the first call and timed on a
second, so that compilation is reported apart from the per-step cost.
"""

from __future__ import annotations

import time

import jax
import optax


def steps_fn(loss, n_steps: int, optimizer: optax.GradientTransformation, batched: bool):
    """jit(run) with run(params, key) -> params after ``n_steps`` optimiser steps on
    ``loss(params, fold_in(key, step))``; vmapped over a leading seed axis if ``batched``."""

    def run(params, key):
        def body(k, carry):
            p, s = carry
            g = jax.grad(loss)(p, jax.random.fold_in(key, k))
            u, s = optimizer.update(g, s, p)
            return optax.apply_updates(p, u), s

        return jax.lax.fori_loop(0, n_steps, body, (params, optimizer.init(params)))[0]

    return jax.jit(jax.vmap(run) if batched else run)


def time_first_and_second_call(fn, params, keys) -> tuple[float, float]:
    """(seconds of the first call, compilation included; seconds of a second call on new keys)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(params, keys))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(fn(params, jax.tree_util.tree_map(lambda k: k + 1, keys)))
    return first, time.perf_counter() - start
