"""Benchmark: the moments engine against full-batch GD on the prompts, in the Fig 4 setting.

Both engines train the reduced ATTN_S (D = 8, H = 9, R = 1, N = 31, λ_d ∝ 1/d) through
:func:`iclab.engines.linreg.train`, from the same eq-36 init on the same P prompts (those it draws for
seed 0 of the base seed), so their loss trajectories must agree to rounding. The moments engine is
timed with both of its backends: XLA (:func:`iclab.engines.moments.full_batch`) and the compiled kernel
(:func:`iclab.engines.moments_native.full_batch`); the headline speedup is the faster one's. Each
timed call trains from scratch (init, prompts or statistics given, compilation), so the per-step cost
is the slope between a short and a long run (:func:`_per_step`).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from iclab.engines import linreg, moments, seed_keys
from iclab.engines.linreg import LinregTraining
from iclab.experiments.linattn._rank_sweep import REFERENCE_LR
from iclab.tasks.linreg import covariance, sample_prompts, spectrum_eigenvalues

D, H, R, N = 8, 9, 1, 31
W_INIT = 0.4  # Fig 4's default init
FIG4_SEEDS = 6  # Fig 4 trains 6 seeds per rank together (vmapped)
# A moments step costs a tiny fraction of the compilation every engine call repeats (which jitters), so its
# timed runs must be long enough that the steps, not the compilation, make the difference (see _per_step).
MOMENTS_STEPS = (20_000, 1_000_000)


def _spec(engine: str, n: int, *, lr: float, P: int, record_every: int | None,
          backend: str = "xla") -> LinregTraining:
    """n steps of ATTN_S in the Fig 4 setting by one engine on P prompts, recording every ``record_every``
    steps (None: the first and the last only)."""
    return LinregTraining(model="attn_s", engine=engine, H=H, R=R, w_init=W_INIT, lr=lr, steps=n,
                          record_every=record_every or max(n, 1), P=P, backend=backend,
                          unroll=moments.LONG_RUN_UNROLL if engine == "moments" and backend == "xla" else 1)


def _setup(P: int, seed: int, S: int = 1):
    """Seed keys, Λ and the P prompts of seeds 0..S-1, as :func:`iclab.engines.linreg.train` draws them."""
    keys = seed_keys(seed, S)
    Lams = jnp.broadcast_to(covariance(spectrum_eigenvalues("inverse", D)), (S, D, D))
    data = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, P))(keys, Lams)
    return keys, Lams, data


def _timed(fn, n_steps: int, repeats: int = 2) -> float:
    """Least wall time of ``repeats`` calls of fn(n_steps) (each compiles anew: the engines jit per call)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(n_steps)
        best = min(best, time.perf_counter() - start)
    return best


def _per_step(fn, n_short: int, n_long: int, min_step_share: float = 0.5, max_doublings: int = 6) -> tuple[float, float]:
    """(seconds per step after compilation, seconds of compilation and fixed overhead per call).

    Every engine call traces and compiles its loop again, so the per-step cost is the slope between a
    short and a long run recording only their last step (the same compiled structure), and the
    intercept is what a call costs besides its steps. The slope is only as good as the long run's
    extra time is large against the jitter of that per-call cost, so ``n_long`` doubles until the
    extra time is at least ``min_step_share`` of the long run; a slope that is still not positive is an
    error, not a number to report.
    """
    t_short = _timed(fn, n_short)
    for _ in range(max_doublings + 1):
        t_long = _timed(fn, n_long)
        if t_long - t_short >= min_step_share * t_long:
            break
        n_long *= 2
    per_step = (t_long - t_short) / (n_long - n_short)
    if per_step <= 0:
        raise RuntimeError(f"timing too noisy: {n_long} steps took no longer than {n_short} ({t_long:.3f} s vs {t_short:.3f} s)")
    return per_step, t_short - n_short * per_step


def _engines(P: int, seed: int, S: int, lr: float):
    """(run_sampled, run_moments (XLA), run_native, statistics pass seconds (first call, again)) for
    seeds 0..S-1."""
    keys, Lams, data = _setup(P, seed, S)
    common = dict(keys=keys, Lams=Lams, N=N)

    def run_sampled(n, record_every=None):
        return linreg.train(_spec("sampled", n, lr=lr, P=P, record_every=record_every), prompts=data, **common)

    start = time.perf_counter()
    stats = linreg.prompt_statistics(keys, Lams, N, P, method="prompts")
    jax.block_until_ready(stats.G)
    t_stats = time.perf_counter() - start  # includes compiling the pass
    start = time.perf_counter()
    jax.block_until_ready(linreg.prompt_statistics(keys, Lams, N, P, method="prompts").G)
    t_stats_again = time.perf_counter() - start

    def run_moments(n, record_every=None):
        return linreg.train(_spec("moments", n, lr=lr, P=P, record_every=record_every), stats=stats, **common)

    def run_native(n, record_every=None):
        return linreg.train(_spec("moments", n, lr=lr, P=P, record_every=record_every, backend="native"),
                            stats=stats, **common)

    return run_sampled, run_moments, run_native, (t_stats, t_stats_again)


def bench_linattn(P: int = 80_000, steps: int = 200, seed: int = 0, seeds: int = FIG4_SEEDS) -> dict:
    """Moments vs sampled full-batch GD on the reduced ATTN_S, Fig 4 setting (R = 1), one process.

    The moments engine runs with both backends (XLA and the compiled kernel). Every engine is timed
    for one seed and for ``seeds`` seeds (vmapped, or on one thread per core for the kernel; how
    Fig 4 trains each rank); for the latter the per-step times are divided by the seeds (seconds per
    seed-step).

    Args:
        P: training prompts.
        steps: steps of the trajectories compared, and of the timed sampled run.
        seed: base seed.
        seeds: seeds of the multi-seed timing.
    Returns:
        JSON-able dict: per-step seconds of each engine after compilation, the speedups (headline:
        the faster moments backend), the statistics pass of the moments engine (once, and amortised
        over ``steps`` and over Fig 4's 20000 steps), the largest relative loss difference from the
        sampled run over the first ``steps`` steps (one seed) of each backend, and the load.
    """
    load_before = os.getloadavg()
    lr = REFERENCE_LR
    run_sampled, run_xla, run_native, (t_stats, t_stats_again) = _engines(P, seed, 1, lr)

    # The trajectories (also the warm-up of every engine).
    loss_s = np.asarray(run_sampled(steps, record_every=1).loss)[0]
    diff = {name: float(np.max(np.abs(np.asarray(run(steps, record_every=1).loss)[0] - loss_s) / np.abs(loss_s)))
            for name, run in (("xla", run_xla), ("native", run_native))}

    per_step_s, overhead_s = _per_step(run_sampled, max(steps // 10, 1), steps)
    per_step = {"xla": _per_step(run_xla, *MOMENTS_STEPS), "native": _per_step(run_native, *MOMENTS_STEPS)}
    best = min(per_step, key=lambda name: per_step[name][0])
    per_step_m = per_step[best][0]
    stats_pass = min(t_stats, t_stats_again)

    def amortised(n):
        return per_step_m + stats_pass / n

    many_sampled, many_xla, many_native, _ = _engines(P, seed, seeds, lr)
    per_seed_step_s = _per_step(many_sampled, max(steps // 20, 1), steps // 2)[0] / seeds
    per_seed_step = {"xla": _per_step(many_xla, *MOMENTS_STEPS)[0] / seeds,
                     "native": _per_step(many_native, *MOMENTS_STEPS)[0] / seeds}

    return {
        "setting": f"ATTN_S reduced, D={D}, H={H}, R={R}, N={N}, lambda ~ 1/d, P={P}, lr={lr:.4g}, "
                   f"w_init={W_INIT}, float64, 1 seed (and {seeds} seeds)",
        "moments_backend": best,
        "sampled_s_per_step": per_step_s,
        "moments_s_per_step": per_step_m,
        "speedup_per_step": per_step_s / per_step_m,
        "max_relative_loss_difference": diff[best],
        "moments_s_per_step_by_backend": {name: value[0] for name, value in per_step.items()},
        "speedup_per_step_by_backend": {name: per_step_s / per_step[name][0] for name in per_step},
        "max_relative_loss_difference_by_backend": diff,
        f"sampled_s_per_seed_step_{seeds}_seeds": per_seed_step_s,
        f"moments_s_per_seed_step_{seeds}_seeds_by_backend": per_seed_step,
        f"speedup_per_seed_step_{seeds}_seeds_by_backend": {name: per_seed_step_s / v for name, v in per_seed_step.items()},
        "moments_statistics_pass_s": stats_pass,
        "moments_statistics_pass_first_call_s": t_stats,
        "moments_s_per_step_amortised_over_steps": amortised(steps),
        "speedup_amortised_over_steps": per_step_s / amortised(steps),
        "moments_s_per_step_amortised_over_20000": amortised(20_000),
        "speedup_amortised_over_20000": per_step_s / amortised(20_000),
        "compile_and_overhead_per_call_s": {"sampled": overhead_s, "xla": per_step["xla"][1],
                                             "native": per_step["native"][1]},
        "steps_compared": steps,
        "timed_steps": {"sampled": [max(steps // 10, 1), steps], "moments": list(MOMENTS_STEPS),
                        "note": "the long run doubles until its steps are at least half its time"},
        "moments_unroll_xla": moments.LONG_RUN_UNROLL,
        "targets": "speedup >= 1e4, difference <= 1e-9",
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "device": str(jax.devices()[0]),
    }
