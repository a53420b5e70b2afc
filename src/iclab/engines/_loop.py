"""The shared training loop: jit + lax.scan in chunks, observing every ``record_every`` steps.

The loop itself never syncs with the host inside a chunk; between chunks the host receives the
latest observation for a progress bar (and, later, checkpoints). Chunking changes nothing in the
arithmetic: the trajectory is the same for any chunk size.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Callback = Callable[[int, dict], None]


class Trajectory(NamedTuple):
    """A recorded training run on the shared time axis t = Σ lr.

    Attributes:
        step: (T,) optimiser step of each record (NaN for gradient flow, which has no steps).
        t: (T,) time t = Σ_{k<step} lr_k (for gradient flow, the integration time).
        loss: (T,) or (S, T) the objective the engine descends (S seeds when vmapped).
        metrics: dict of extra observed scalars, same shapes as ``loss``.
        params: the parameters at each record (leading (S,) T axis), or None if not recorded.
    """

    step: np.ndarray
    t: np.ndarray
    loss: np.ndarray
    metrics: dict
    params: Any


class LoopState(NamedTuple):
    """Everything a step needs: the trained params, optimiser state, step count, time t = Σ lr,
    constants of the run (``aux``: data, covariance, ...) and the data key of a sampled run."""

    params: Any
    opt_state: Any
    step: jax.Array
    t: jax.Array
    aux: Any
    key: Any


def record_steps(n_steps: int, record_every: int) -> np.ndarray:
    """Steps at which a run of n_steps records: 0, r, 2r, ... and always the last step."""
    steps = np.arange(0, n_steps + 1, record_every)
    if steps[-1] != n_steps:
        steps = np.append(steps, n_steps)
    return steps


def run_loop(
    step_fn: Callable[[LoopState], LoopState],
    observe: Callable[[LoopState], dict],
    state: LoopState,
    n_steps: int,
    record_every: int,
    *,
    batched: bool = False,
    callback: Callback | None = None,
    records_per_chunk: int = 64,
):
    """Runs ``step_fn`` n_steps times and returns (records, final state).

    Args:
        step_fn: one optimiser step, LoopState -> LoopState (for one run).
        observe: LoopState -> dict of scalars recorded at each record step (for one run).
        state: initial state; with ``batched`` every leaf has a leading seed axis.
        n_steps: number of steps.
        record_every: record spacing in steps (the last step is always recorded).
        batched: vmap step and observe over a leading seed axis.
        callback: called on the host after each chunk with (step, last observation).
        records_per_chunk: records computed per jitted call.
    Returns:
        (steps (T,), dict name -> array (T,) or (S, T) of observations incl. "t", final state).
    """
    if batched:
        step_fn, observe = jax.vmap(step_fn), jax.vmap(observe)
    steps = record_steps(n_steps, record_every)
    gaps = np.diff(steps)

    def advance(state, n):
        return jax.lax.fori_loop(0, n, lambda _, s: step_fn(s), state)

    @jax.jit
    def chunk_equal(state, n_records_dummy):
        def body(s, _):
            s = advance(s, record_every)
            return s, observe(s)

        return jax.lax.scan(body, state, None, length=n_records_dummy.shape[0])

    first = jax.jit(observe)(state)
    records = [jax.tree_util.tree_map(lambda a: np.asarray(a)[None], first)]
    if callback is not None:
        callback(0, jax.tree_util.tree_map(np.asarray, first))
    done = 0
    n_full = int(np.sum(gaps == record_every))
    while done < n_full:
        n = min(records_per_chunk, n_full - done)
        state, obs = chunk_equal(state, jnp.zeros(n))
        obs = jax.tree_util.tree_map(np.asarray, obs)
        records.append(obs)
        done += n
        if callback is not None:
            callback(int(steps[done]), jax.tree_util.tree_map(lambda a: a[-1], obs))
    if len(gaps) > n_full:  # a shorter last gap so that the final step is recorded
        state = jax.jit(advance, static_argnums=1)(state, int(gaps[-1]))
        last = jax.jit(observe)(state)
        records.append(jax.tree_util.tree_map(lambda a: np.asarray(a)[None], last))
        if callback is not None:
            callback(n_steps, jax.tree_util.tree_map(np.asarray, last))
    obs = jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis=0), *records)
    if batched:  # put the seed axis first: (S, T)
        obs = jax.tree_util.tree_map(lambda a: np.moveaxis(a, 0, 1), obs)
    return steps, obs, state
