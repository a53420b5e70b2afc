"""The shared training loop: jit + lax.scan in chunks, observing every ``record_every`` steps.

The loop itself never syncs with the host inside a chunk; between chunks the host receives the
latest observation for a progress bar, and, when the callback carries them (runs launched by
:mod:`iclab.launch`):

- a checkpoint handle (``callback.checkpoint``, :mod:`iclab.checkpoint`): the loop saves its
  state, the records so far and the next record index at chunk boundaries, and resumes from a
  saved checkpoint of the same loop, on the same chunk boundaries, so that a resumed run equals
  an uninterrupted one bit for bit;
- ``callback.stop_on_divergence``: a NaN or infinite recorded loss stops the loop with
  :class:`Diverged`, which carries the step, the last finite loss and the finite part of the
  trajectory.

Chunking changes nothing in the arithmetic: the trajectory is the same for any chunk size. A chunk
is ONE compiled program whose record count is a runtime argument (a loop of ``n ≤ records_per_chunk``
records writing into a buffer of ``records_per_chunk``), so every chunk runs the same executable,
whatever its length: chunk lengths may follow the clock without changing a bit of the numbers. The
first chunk holds one record; each later chunk holds as many records as fit in ``chunk_seconds`` at the
measured cost of a record (at most ``records_per_chunk``). Cheap records (µs to ms) thus run 64 to a
call, and a training whose record takes minutes reports progress, and checkpoints, record by record.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import time

import jax
import jax.numpy as jnp
import numpy as np

from iclab import settings
from iclab.ops import retain_freed_memory

Callback = Callable[[int, dict], None]


class Diverged(Exception):
    """The recorded loss became NaN or infinite: the run stops, keeping its finite part.

    Attributes:
        label: the reporter task the loop ran in (or None).
        step: the first recorded step whose loss is not finite (None for gradient flow).
        t: the time of that record.
        last_finite_step, last_finite_t: the record before it (None if the first record diverged).
        last_finite_loss: the loss there, of the first seed that diverged.
        records: the finite part of the trajectory: "step" and every recorded observation, seed
            axis first when batched.
    """

    def __init__(self, label, step, t, last_finite_step, last_finite_t, last_finite_loss, records):
        self.label, self.step, self.t = label, step, t
        self.last_finite_step, self.last_finite_t, self.last_finite_loss = last_finite_step, last_finite_t, last_finite_loss
        self.records = records
        where = f"step {step}" if step is not None else f"t = {t:.6g}"
        last = ("the first record" if last_finite_loss is None else
                f"last finite loss {last_finite_loss:.6g} at " +
                (f"step {last_finite_step}" if last_finite_step is not None else f"t = {last_finite_t:.6g}"))
        task = f" in {label!r}" if label else ""
        super().__init__(f"loss not finite at {where}{task} ({last})")


class Trajectory(NamedTuple):
    """A recorded training run on the shared time axis t = Σ lr.

    Attributes:
        step: (T,) optimiser step of each record (NaN for gradient flow, which has no steps).
        t: (T,) time t = Σ_{k<step} lr_k (for gradient flow, the integration time).
        loss: (T,) or (S, T) the objective the engine descends (S seeds when vmapped).
        metrics: dict of extra observed scalars, same shapes as ``loss``.
        params: the parameters at each record (leading (S,) T axis), or None if not recorded.
        final_params: the parameters after the last step (leading (S,) axis when batched), or None
            where an engine does not keep them.
    """

    step: np.ndarray
    t: np.ndarray
    loss: np.ndarray
    metrics: dict
    params: Any
    final_params: Any = None


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
    """Steps at which a run of n_steps records: 0, r, 2r, ... and always the last step.

    Args:
        n_steps: steps of the run; record_every: the spacing r.
    Returns:
        (T,) int array of steps.
    """
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
    chunk_seconds: float = 2.0,
    unroll: int = 1,
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
        records_per_chunk: the most records computed per call of the compiled chunk.
        chunk_seconds: the wall time a chunk aims at: the first chunk holds one record, each later one as
            many as took that long in the chunk before (1 to ``records_per_chunk``). Progress reports and
            checkpoints come between chunks; the numbers do not depend on the chunk lengths.
        unroll: steps unrolled per iteration of the compiled step loop: >1 trims the loop overhead
            where it is comparable to a step's cost (the moments engine's steps of a few features), at
            the price of compile time; the arithmetic of each step is unchanged.
    Returns:
        (steps (T,), dict name -> array (T,) or (S, T) of observations incl. "t", final state).
    """
    retain_freed_memory(settings.malloc_mode())  # a step's large buffers are reused, not faulted in again
    if batched:
        step_fn, observe = jax.vmap(step_fn), jax.vmap(observe)
    steps = record_steps(n_steps, record_every)
    gaps = np.diff(steps)

    def advance(state, n):
        return jax.lax.fori_loop(0, n, lambda _, s: step_fn(s), state, unroll=max(1, min(unroll, n)))

    ckpt = loop_checkpoint(callback)
    guard = DivergenceGuard(callback, batched, record_axis=0)
    first = jax.jit(observe)(state)
    records = [jax.tree_util.tree_map(lambda a: np.asarray(a)[None], first)]
    cap = max(1, int(records_per_chunk))

    @jax.jit
    def chunk_equal(state, n):
        """n (traced, 1 ≤ n ≤ cap) records of ``record_every`` steps each: (state, observations (cap, ...)),
        rows ≥ n unused. One executable for every n."""
        buffer = jax.tree_util.tree_map(lambda a: jnp.zeros((cap,) + jnp.shape(a), jnp.result_type(a)), first)

        def body(i, carry):
            s, buf = carry
            s = advance(s, record_every)
            buf = jax.tree_util.tree_map(lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o, i, 0), buf, observe(s))
            return s, buf

        return jax.lax.fori_loop(0, n, body, (state, buffer))

    n_full = int(np.sum(gaps == record_every))
    expect = {"kind": "run_loop", "n_steps": int(n_steps), "record_every": int(record_every),
              "batched": bool(batched), "records_per_chunk": int(records_per_chunk)}
    done, finished = 0, False
    if ckpt is not None:
        restored = ckpt.load(expect, _dynamic(state), records[0])
        if restored is not None:
            meta, dynamic, saved = restored
            state = _with_aux(dynamic, state)
            records, done, finished = [saved], int(meta["done"]), bool(meta["finished"])
            ckpt.note(f"resumed at step {int(steps[len(_first_leaf(saved)) - 1])} of {n_steps}"
                      + (" (finished)" if finished else ""))
    if callback is not None:
        last = jax.tree_util.tree_map(lambda a: np.asarray(a)[-1], records[-1])
        callback(int(steps[len(_first_leaf(records[0])) - 1]), last)
    guard.check(records, steps)
    if done < n_full and not finished:  # compiled by a call of no record, so that each timed call is the records'
        jax.block_until_ready(chunk_equal(state, jnp.asarray(0, jnp.int32)))
    n = 1  # the first chunk: one record, timed; then as many as fit in chunk_seconds
    while done < n_full and not finished:
        m = min(n, n_full - done)
        start = time.perf_counter()
        state, obs = chunk_equal(state, jnp.asarray(m, jnp.int32))
        obs = jax.tree_util.tree_map(lambda a: np.asarray(a)[:m], obs)
        n = int(np.clip(chunk_seconds * m / max(time.perf_counter() - start, 1e-9), 1, cap))
        records.append(obs)
        done += m
        if callback is not None:
            callback(int(steps[done]), jax.tree_util.tree_map(lambda a: a[-1], obs))
        guard.check(records, steps)
        if ckpt is not None and ckpt.due():
            records = [_concat(records)]
            ckpt.save(dict(expect, done=done, finished=False), _dynamic(state), records[0])
    if len(gaps) > n_full and not finished:  # a shorter last gap so that the final step is recorded
        state = jax.jit(advance, static_argnums=1)(state, int(gaps[-1]))
        last = jax.jit(observe)(state)
        records.append(jax.tree_util.tree_map(lambda a: np.asarray(a)[None], last))
        if callback is not None:
            callback(n_steps, jax.tree_util.tree_map(np.asarray, last))
        guard.check(records, steps)
    obs = _concat(records)
    if ckpt is not None and not finished:
        ckpt.save(dict(expect, done=done, finished=True), _dynamic(state), obs)
    if batched:  # put the seed axis first: (S, T)
        obs = jax.tree_util.tree_map(lambda a: np.moveaxis(a, 0, 1), obs)
    return steps, obs, state


def loop_checkpoint(callback):
    """The checkpoint of the next loop of a task callback (None without checkpoints)."""
    handle = getattr(callback, "checkpoint", None)
    return handle.loop() if handle is not None else None


class DivergenceGuard:
    """Raises :class:`Diverged` once the recorded ``loss`` has a non-finite value (when the
    callback asks for it). Records are checked as they arrive, each value once."""

    def __init__(self, callback, batched: bool, record_axis: int):
        self.active = bool(getattr(callback, "stop_on_divergence", False))
        self.label = getattr(callback, "label", None)
        self.batched = batched
        self.axis = record_axis  # the record axis of the arrays in the records list
        self.checked = 0

    def check(self, records: list, steps: np.ndarray | None, times: np.ndarray | None = None) -> None:
        if not self.active:
            return
        losses = [np.asarray(r["loss"]) for r in records if isinstance(r, dict) and "loss" in r]
        if len(losses) != len(records):
            self.active = False  # nothing named "loss" to watch
            return
        loss = np.concatenate(losses, axis=self.axis)
        loss = np.moveaxis(loss, self.axis, 0).reshape(loss.shape[self.axis], -1)
        ok = np.isfinite(loss).all(axis=1)
        if ok[self.checked:].all():
            self.checked = len(ok)
            return
        bad = self.checked + int(np.argmin(ok[self.checked:]))
        obs = _concat(records, self.axis)
        t_all = np.asarray(obs["t"]) if "t" in obs else times
        if t_all is not None and np.ndim(t_all) > 1:  # batched: every seed shares t
            t_all = np.moveaxis(t_all, self.axis, 0)[:, 0]
        partial = jax.tree_util.tree_map(lambda a: np.take(a, np.arange(bad), axis=self.axis), obs)
        if self.batched and self.axis == 0:
            partial = jax.tree_util.tree_map(lambda a: np.moveaxis(a, 0, 1), partial)
        partial = dict(partial)
        if steps is not None:
            partial["step"] = np.asarray(steps[:bad], dtype=float)
        if times is not None and "t" not in partial:
            partial["t"] = np.asarray(times[:bad])
        seed = int(np.argmin(np.isfinite(loss[bad])))  # the first value that diverged
        last_loss = float(loss[bad - 1, seed]) if bad > 0 else None

        def at(i, arr):
            return None if arr is None or i < 0 else float(arr[i])

        raise Diverged(self.label, None if steps is None else int(steps[bad]), at(bad, t_all),
                       None if steps is None or bad == 0 else int(steps[bad - 1]), at(bad - 1, t_all),
                       last_loss, partial)


def _concat(records: list, axis: int = 0):
    if len(records) == 1:
        return records[0]
    return jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis=axis), *records)


def _first_leaf(tree):
    return jax.tree_util.tree_leaves(tree)[0]


def _dynamic(state):
    """What a checkpoint saves of a loop state: everything but ``aux`` (constants the experiment
    rebuilds identically on a rerun)."""
    return state._replace(aux=None) if isinstance(state, LoopState) else state


def _with_aux(dynamic, state):
    return dynamic._replace(aux=state.aux) if isinstance(state, LoopState) else dynamic
