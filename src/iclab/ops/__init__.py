"""iclab's compiled CPU kernels behind one door: arrays in, arrays out, a pure-JAX reference beside each.

Every operation here takes arrays (and sizes) and returns arrays: no model objects, configs or experiment
names. Each lives in a folder of its own, its fast forms beside the reference they are tested against
(``tests/ops/``: values and gradients):

================================  ====================================================================
op                                what it computes
================================  ====================================================================
``decayed_attention``             S_t = d_t S_{t−1} + v_t k_tᵀ, o_t = S_t q_t: the gating paper's GLA layer
                                  (d_t a gate φ(w_gᵀz_t)) and the drift paper's (d_t = λ); whole layers,
                                  read-outs at the query, and grids of models' losses with their gradients
``drift_sampler``                 the drift paper's AR(1) task drift prompts (Philox, ziggurat or Box-Muller)
``multitask_sampler``             the gating paper's delimited multi-task prompts
``normals``                       counter-based random words (Philox blocks), the bits of
                                  ``lax.rng_bit_generator``
``moments_step``                  plain GD on the moments engine's quadratic loss, reduced linattn models
``online_filters``                LMS and RLS filters' tail errors over many streams
================================  ====================================================================

The backend is a run option, never a paper setting: ``native`` (these compiled kernels: numba, LLVM IR,
host calls into jitted code) or ``xla`` (the pure-JAX forms, the path an accelerator takes); ``auto`` picks
``native`` on a CPU and ``xla`` elsewhere. :func:`use_backend` sets it for a block of code (``iclab run
--backend``), :func:`backend` reads it, and the layers above (models, tasks, engines, baselines) call the op
of the backend in force. The runtime they share (LLVM and numba compilation, host calls, the blocked layouts,
the thread split, freed-memory retention) is in ``ops/_runtime``.

This package imports nothing else of iclab. Importing it is cheap: every op loads on first use.
"""

from __future__ import annotations

import importlib

from iclab.ops._runtime.backend import BACKENDS, backend, resolve_backend, use_backend

__all__ = [
    "BACKENDS", "DRIFT_NORMALS", "LANES", "MOMENTS_MODELS", "NATIVE_RNG_IMPL", "MomentsModel", "available_cores", "backend",
    "convert_keeping_weak_type", "die_with_parent", "drift_shared_batch", "drift_training_batch",
    "filter_tail_errors", "forget_kernel_timings", "forget_layer", "forget_multilayer_mse", "forget_readout_grid", "forget_readout_call_timings", "forget_readout_grid_shared",
    "forget_readout_mse_shared", "gated_layer", "gated_multilayer_mse_grid",
    "gated_multilayer_mse_grids", "gated_query_mse_grid", "jax_backend_started", "moments_plain_gd",
    "multitask_block_tokens", "multitask_task_normals", "random_bits", "resolve_backend", "retain_freed_memory",
    "subsequence_positions", "thread_count", "use_backend",
]

# name -> (module, attribute): loaded on first use, so that `import iclab` stays light (it reads the thread
# count before any numerical runtime loads).
_LAZY = {
    "available_cores": ("iclab.ops._runtime.threads", "available_cores"),
    "thread_count": ("iclab.ops._runtime.threads", "thread_count"),
    "retain_freed_memory": ("iclab.ops._runtime.malloc", "retain_freed_memory"),
    "die_with_parent": ("iclab.ops._runtime.process", "die_with_parent"),
    "jax_backend_started": ("iclab.ops._runtime.jax_private", "jax_backend_started"),
    "convert_keeping_weak_type": ("iclab.ops._runtime.jax_private", "convert_keeping_weak_type"),
    "LANES": ("iclab.ops._runtime.blocked", "LANES"),
    "gated_layer": ("iclab.ops.decayed_attention", "gated_layer"),
    "gated_query_mse_grid": ("iclab.ops.decayed_attention", "gated_query_mse_grid"),
    "gated_multilayer_mse_grid": ("iclab.ops.decayed_attention", "gated_multilayer_mse_grid"),
    "gated_multilayer_mse_grids": ("iclab.ops.decayed_attention", "gated_multilayer_mse_grids"),
    "subsequence_positions": ("iclab.ops.decayed_attention", "subsequence_positions"),
    "forget_layer": ("iclab.ops.decayed_attention", "forget_layer"),
    "forget_multilayer_mse": ("iclab.ops.decayed_attention", "forget_multilayer_mse"),
    "forget_readout_grid": ("iclab.ops.decayed_attention", "forget_readout_grid"),
    "forget_readout_grid_shared": ("iclab.ops.decayed_attention", "forget_readout_grid_shared"),
    "forget_readout_mse_shared": ("iclab.ops.decayed_attention", "forget_readout_mse_shared"),
    "forget_kernel_timings": ("iclab.ops.decayed_attention._timings", "forget_kernel_timings"),
    "forget_readout_call_timings": ("iclab.ops.decayed_attention._timings", "forget_readout_call_timings"),
    "DRIFT_NORMALS": ("iclab.ops.drift_sampler", "DRIFT_NORMALS"),
    "drift_training_batch": ("iclab.ops.drift_sampler", "drift_training_batch"),
    "drift_shared_batch": ("iclab.ops.drift_sampler", "drift_shared_batch"),
    "multitask_block_tokens": ("iclab.ops.multitask_sampler", "multitask_block_tokens"),
    "multitask_task_normals": ("iclab.ops.multitask_sampler", "multitask_task_normals"),
    "random_bits": ("iclab.ops.normals", "random_bits"),
    "NATIVE_RNG_IMPL": ("iclab.ops.normals", "NATIVE_RNG_IMPL"),
    "MOMENTS_MODELS": ("iclab.ops.moments_step", "MOMENTS_MODELS"),
    "MomentsModel": ("iclab.ops.moments_step", "MomentsModel"),
    "moments_plain_gd": ("iclab.ops.moments_step", "moments_plain_gd"),
    "filter_tail_errors": ("iclab.ops.online_filters", "filter_tail_errors"),
}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
