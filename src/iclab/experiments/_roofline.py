"""Rooflines for the benchmarks: this machine's matmul peak and the flops a compiled step executes.

A training step's distance to its arithmetic floor is a ratio of two measurements taken in one
process: the flops the step must do (counted from the shapes, in each bench's docstring) over its
measured time gives the achieved GFLOP/s, and a large float32 matrix product timed in the same run
gives the machine's practical peak (the benches measure it before and after their timings and use the
larger: this VM's speed drifts by up to 2x within hours, and a reading taken in a slow minute would flatter
the fractions). XLA's own count of the compiled step (``cost_analysis``) is
reported beside the floor: it includes the data sampling and whatever the chosen form computes
beyond the floor, so floor / XLA is the share of the executed work the model needs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

__all__ = ["compiled_flops", "matmul_peak_gflops"]


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
