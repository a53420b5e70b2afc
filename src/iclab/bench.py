"""Benchmarks: speed shown side by side in one run (``iclab bench NAME``).

Each benchmark is a function returning a JSON-able dict; they live in :mod:`iclab.benches`, one module per
paper, and are looked up here by name, so importing this module stays cheap.
"""

from __future__ import annotations

import importlib

BENCHMARKS = {
    "linattn": ("iclab.benches.linattn", "bench_linattn",
                "Fig 4 setting (D=8, H=9, R=1, N=31, P=80000): sampled full-batch GD vs the moments engine"),
    "gating": ("iclab.benches.gating", "bench_gating",
               "Fig 1a setting at n̄ = 50 (d=10, p=5, T=103, batch 256): Adam steps/s, fast (query-only) vs per-token "
               "recurrent GLA, 1 and 10 seeds; gating.fig1's paper step (1600 models) against its flop floor, XLA "
               "against the compiled (native) loss kernel"),
    "mhsa": ("iclab.benches.mhsa", "bench_mhsa", "Fig 1 setting (H=I=3, d=30, L=100, batch 4096): SGD steps/s, full vs spectral model, 1 and 6 seeds"),
    "drift": ("iclab.benches.drift", "bench_drift",
              "drift.fig1 and drift.fig2 paper steps (d=10, n=100, batch 5000, qkv, AdamW, float32): sampling, loss and "
              "gradient, whole step against the flop floor and the measured matmul peak; XLA against the compiled "
              "(native) sampler and kernels; the full-layer kernels alone (their two compiled forms, side by side)"),
    "sweep": ("iclab.benches.sweep", "bench_sweep",
              "sharing the CPU: a 4-point quick sweep with 1, C and 2C workers, and one run idle vs beside a "
              "CPU-bound neighbour (wall and CPU seconds)"),
}


def run_benchmark(name: str, **kwargs) -> dict:
    """Runs the named benchmark and returns its measurements.

    The process keeps its freed memory, as the training loop does (:func:`iclab.ops.retain_freed_memory`; ``ICLAB_MALLOC=system``
    measures glibc's defaults): ``malloc_retains_freed_memory`` in the result says which.
    """
    from iclab import settings
    from iclab.ops import retain_freed_memory

    retained = retain_freed_memory(settings.malloc_mode())
    module, func, _ = BENCHMARKS[name]
    out = getattr(importlib.import_module(module), func)(**kwargs)
    if isinstance(out, dict):
        out["malloc_retains_freed_memory"] = retained
    return out
