"""Rooflines for the benchmarks: this machine's matmul peak and the flops a compiled step executes.

A training step's distance to its arithmetic floor is a ratio of two measurements taken in one
process: the flops the step must do (counted from the shapes, in each bench's docstring) over its
measured time gives the achieved GFLOP/s, and a large float32 matrix product timed in the same run
gives the machine's practical peak (the benches measure it before and after their timings and use the
larger: a shared or virtual machine's speed can drift within hours, and a reading taken in a slow minute would flatter
the fractions). A paper preset's whole step is timed in rounds, each beside its own peaks
(:func:`step_beside_peaks`). XLA's own count of the compiled step (``cost_analysis``) is
reported beside the floor: it includes the data sampling and whatever the chosen form computes
beyond the floor, so floor / XLA is the share of the executed work the model needs.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

__all__ = ["compiled_flops", "matmul_peak_gflops", "step_beside_peaks"]


def matmul_peak_gflops(n: int = 1024, *, dtype=jnp.float32, seconds: float = 1.0) -> float:
    """Measured GFLOP/s of an n × n by n × n product (2n³ flops) in ``dtype``, on every XLA thread.

    The product is compiled and run once, then repeated until ``seconds`` have passed; the best of
    three such rounds is returned (the peak the machine reaches, not its average under load).
    """
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while True:
            jax.block_until_ready(f(a))
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / 3:
                break
        best = max(best, 2.0 * n**3 * reps / elapsed / 1e9)
    return best


def compiled_flops(fn, *args) -> float | None:
    """XLA's flop count of ``jax.jit(fn)(*args)`` as compiled (None where the backend gives none).

    A ``fori_loop``'s body is counted once, not once per iteration: pass one step.
    """
    try:
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    except Exception:  # pragma: no cover - a backend without cost analysis
        return None
    if isinstance(cost, list):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    flops = cost.get("flops") if cost else None
    return float(flops) if flops is not None and flops >= 0 else None


def step_beside_peaks(run, *, steps: int, floor_flops: float, rounds: int = 5, peak=None, clock=time.perf_counter) -> dict:
    """A training step's time against the matmul peak measured beside it, in ``rounds`` rounds.

    A shared or virtual machine's speed can drift within minutes: one step loop against peaks taken a minute away
    can read its distance to the floor well high or low. So the peak
    P is measured before the first round and after every round (P_0, run, P_1, run, …, P_rounds); round r's step
    s_r (its loop's seconds / ``steps``) is paired with the faster peak beside it, P̂_r = max(P_{r−1}, P_r) (a slow
    reading would flatter it), and its fraction of the peak is f_r = floor / s_r / P̂_r. The step reported is
    the median round: f = median_r f_r, its floor ratio 1 / f (the step's time over the floor's at the peak:
    1 at the floor), and s = median_r s_r.

    Args:
        run: a callable that does ``steps`` steps of the compiled step and returns once they are done.
        steps: steps per call of ``run``.
        floor_flops: the step's arithmetic floor in flops.
        rounds: timed calls of ``run`` (odd: the median is one round's).
        peak: a callable returning the peak in GFLOP/s (None: :func:`matmul_peak_gflops` for 0.6 s).
        clock: seconds (``time.perf_counter``; a test's fake clock).
    Returns:
        JSON-able dict: ``step_rounds_s`` (s_r), ``matmul_peak_gflops_at_step`` (P_0 … P_rounds),
        ``fraction_of_matmul_peak_step_rounds`` (f_r), ``step_s`` (median s_r), ``achieved_gflops_step``
        (floor / step_s), ``fraction_of_matmul_peak_step`` (median f_r), ``floor_ratio_step`` (1 / that).
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be at least 1 (got {rounds}, {steps})")
    peak = peak or (lambda: matmul_peak_gflops(seconds=0.6))
    peaks, times = [peak()], []
    for _ in range(rounds):
        start = clock()
        run()
        times.append((clock() - start) / steps)
        peaks.append(peak())
    fractions = [floor_flops / s / 1e9 / max(peaks[r], peaks[r + 1]) for r, s in enumerate(times)]
    step, fraction = statistics.median(times), statistics.median(fractions)
    return {"step_rounds_s": times, "matmul_peak_gflops_at_step": peaks,
            "fraction_of_matmul_peak_step_rounds": fractions, "step_s": step,
            "achieved_gflops_step": floor_flops / step / 1e9, "fraction_of_matmul_peak_step": fraction,
            "floor_ratio_step": 1.0 / fraction}
