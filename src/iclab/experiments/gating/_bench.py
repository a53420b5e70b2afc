"""Benchmark: Adam training steps per second of one-layer GLA in the Fig 1a setting at n̄ = 50.

Setting: (r₁, r₂) = (0, 1), d = 10, p = 5, K = 2 blocks of n̄ = 50 samples with delimiters, so T = 103
tokens of width D = 16; scalar sigmoid gating; batch 256 fresh prompts per step; float32.

Two forms of the same model, each inside the same training step (sample a fresh batch, ``jax.grad`` of
the mean squared error, an Adam update):

- ``fast``: :func:`iclab.models.gla.predict` with ``form="last"``, the form the experiments train with:
  the query's output o_T = Σ_j w_j v_j (k_jᵀ q_T), O(T·D) per prompt for scalar gates;
- ``recurrent``: the direct per-token recurrence S_i = g_i S_{i−1} + v_i k_iᵀ, o_i = S_i q_i
  (:func:`iclab.models.gla.recurrent`, a ``lax.scan`` over the T tokens with a D×D state), read at the
  query.

Each is timed for 1 seed and for ``seeds`` seeds vmapped. The loop is one jitted ``fori_loop``,
compiled once and timed on a second call (compilation reported separately). Before timing, the two
forms' losses and gradients at the init are compared (they are one model).

Roofline (:mod:`iclab.experiments._roofline`). The arithmetic floor of one prompt's forward pass in the
query-only form, scalar gates, label read-out: u = W_k W_qᵀ z_T (4D² flops), the scores z_jᵀu, the gate
pre-activations z_jᵀw_g and the label values z_jᵀ(W_v)_{:,d} (2TD each), and O(T) for the gates'
suffix sums and the weighted sum: 6TD + 4D² (+ O(T)). Backward costs twice the forward (the usual
count for products), so a step needs batch · 3(6TD + 4D²) flops, ≈ 3.3·10⁴ per prompt at T = 103,
D = 16; Adam's O(D²) and the sampling are not counted. Reported: that floor per step, XLA's count of
the compiled loss-and-gradient (sampling included), the achieved GFLOP/s (floor / measured step),
and a float32 matmul's GFLOP/s measured in the same run.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from iclab.experiments._roofline import compiled_flops, matmul_peak_gflops
from iclab.experiments._timing import steps_fn, time_first_and_second_call
from iclab.experiments.gating._common import K
from iclab.models import gla
from iclab.tasks import multitask as mt


def _loss_fn(form: str, n_bar: int, d: int, contexts, batch: int, dtype):
    factor = jnp.asarray(mt.two_task_factor(r1=0.0, r2=1.0), dtype)

    def loss(params, key):
        pr = mt.sample_blocks(key, batch, [n_bar] * K, factor, None, 0.0, d=d, dtype=dtype)
        Z = gla.delimiter_prompt(pr.x, pr.y, pr.x_query, [n_bar] * K, contexts, query_context=0)[0]
        return jnp.mean((gla.predict(params, Z, None, label=d, form=form) - pr.y_query) ** 2)

    return loss


def bench_gating(n_bar: int = 50, d: int = 10, p: int = 5, batch: int = 256, seeds: int = 10, steps: int = 20,
                 lr: float = 1e-3) -> dict:
    """Steps per second of the fast and the recurrent form, 1 seed and ``seeds`` seeds vmapped.

    Args:
        n_bar: samples per task (the figure's largest, 50).
        d, p: input and context dimensions (the paper's 10 and 5).
        batch: fresh prompts per step (the paper's 256).
        seeds: seeds of the vmapped runs.
        steps: steps per timed call.
    Returns:
        JSON-able dict: steps/s and seconds per step of each (form, seeds), their ratio, compile+first-call
        seconds, the fast form's floor flops, achieved GFLOP/s and fraction of the measured matmul peak,
        the roofline figures (module docstring), the largest relative difference of loss and gradient between the forms, load and device.
    """
    load_before = os.getloadavg()
    dtype = jnp.float32
    D = d + 1 + p
    rng = np.random.default_rng(0)
    contexts = jnp.asarray(rng.standard_normal((K + 1, p)), dtype)
    params0 = gla.init_params(jax.random.PRNGKey(0), D, "scalar", std=0.1, dtype=dtype)
    params0 = {k: v + 0.3 * jnp.eye(D, dtype=dtype) if k in ("Wq", "Wk", "Wv") else v for k, v in params0.items()}

    losses = {form: _loss_fn(form, n_bar, d, contexts, batch, dtype) for form in ("last", "recurrent")}
    # one model: the same loss and gradient from both forms (float32: agreement to rounding)
    key = jax.random.PRNGKey(1)
    (l_f, g_f), (l_r, g_r) = (jax.jit(jax.value_and_grad(losses[f]))(params0, key) for f in ("last", "recurrent"))
    grad_rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                   for a, b in zip(jax.tree_util.tree_leaves(g_f), jax.tree_util.tree_leaves(g_r)))

    out = {}
    for name, form in (("fast", "last"), ("recurrent", "recurrent")):
        for S in (1, seeds):
            batched = S > 1
            params = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (S,) + a.shape), params0) if batched \
                else params0
            keys = jax.random.split(jax.random.PRNGKey(0), S) if batched else jax.random.PRNGKey(0)
            run = steps_fn(losses[form], steps, optax.adam(lr), batched)
            first, second = time_first_and_second_call(run, params, keys)
            out[f"{name}_{S}_seed{'s' if S > 1 else ''}"] = {
                "steps_per_s": steps / second, "s_per_step": second / steps,
                "seed_steps_per_s": S * steps / second, "compile_and_first_call_s": first}
    T = K * n_bar + K + 1
    floor_per_prompt = 3 * (6 * T * D + 4 * D * D)
    xla_fast = compiled_flops(jax.value_and_grad(losses["last"]), params0, key)
    peak = matmul_peak_gflops()
    for S in (1, seeds):
        entry = out[f"fast_{S}_seed{'s' if S > 1 else ''}"]
        entry["floor_flops_per_step"] = S * batch * floor_per_prompt
        entry["achieved_gflops"] = entry["floor_flops_per_step"] / entry["s_per_step"] / 1e9
        entry["fraction_of_matmul_peak"] = entry["achieved_gflops"] / peak
    roofline = {"matmul_peak_gflops_f32": peak, "floor_flops_per_prompt": floor_per_prompt,
                "xla_flops_per_step_1_seed": xla_fast,
                "floor_over_xla_flops": None if not xla_fast else batch * floor_per_prompt / xla_fast}
    ratios = {f"speedup_{S}_seed{'s' if S > 1 else ''}":
              out[f"fast_{S}_seed{'s' if S > 1 else ''}"]["steps_per_s"]
              / out[f"recurrent_{S}_seed{'s' if S > 1 else ''}"]["steps_per_s"] for S in (1, seeds)}
    return {
        "setting": f"gating Fig 1a: (r1, r2) = (0, 1), d={d}, p={p}, n̄={n_bar} (T={2 * n_bar + K + 1}, D={D}), "
                   f"scalar gating, batch={batch}, float32, Adam lr={lr}, fresh prompts per step",
        **out,
        **ratios,
        "roofline": roofline,
        "loss_rel_diff": float(abs(l_f - l_r) / abs(l_r)),
        "grad_max_rel_diff": grad_rel,
        "steps_timed_per_call": steps,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "device": str(jax.devices()[0]),
        "note": "steps_per_s counts optimiser steps of the whole (vmapped) run; seed_steps_per_s multiplies by "
                "seeds; speedup = fast / recurrent steps per second",
    }
