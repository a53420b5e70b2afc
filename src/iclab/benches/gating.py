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

Roofline (:mod:`iclab.benches._roofline`). The arithmetic floor of one prompt's forward pass in the
query-only form, scalar gates, label read-out: u = W_k W_qᵀ z_T (4D² flops), the scores z_jᵀu, the gate
pre-activations z_jᵀw_g and the label values z_jᵀ(W_v)_{:,d} (2TD each), and O(T) for the gates'
suffix sums and the weighted sum: 6TD + 4D² (+ O(T)). Backward costs twice the forward (the usual
count for products), so a step needs batch · 3(6TD + 4D²) flops, ≈ 3.3·10⁴ per prompt at T = 103,
D = 16; Adam's O(D²) and the sampling are not counted. Reported: that floor per step, XLA's count of
the compiled loss-and-gradient (sampling included), the achieved GFLOP/s (floor / measured step),
and a float32 matmul's GFLOP/s measured in the same run.

The paper step of gating.fig1 (``fig1_paper``): every model of the paper preset (4 kinds × 4 panels × 10 n̄ ×
10 seeds), batch 256, one Adam step: the fresh batch, the summed loss and gradient in each kernel (``xla``:
``gla.predict_last`` under autodiff, each n̄ at its own length; ``native``: ``ops.decayed_attention.gated.query_mse_grid``), and
the whole step in the native kernels (the experiments' backend on a CPU). Floor per prompt and model, forward (backward twice that; tokens need
no gradient), with T = 2n̄ + 3 tokens (2n̄ + 1 without delimiters) of width D: the query through the keys
c = W_K W_Qᵀ z_T (4D²), then per token the score z_tᵀc (2D) and: the label value (2D) without gates; the label
value and the gate logit (4D) with scalar gates; all D values and D gate logits (4D²) with vector gates.
So batch · Σ_models 3(4D² + T·{4D, 6D, 2D + 4D²}) flops per step (``fig1_floor_flops_per_step``).

The paper step of gating.fig2 (``fig2_paper``): residual GLAs of depth L = 1, 2, 3 (eq 25, scalar gates) × 10 n̄ ×
10 seeds, batch 256, the same measurements (XLA's parallel form against the compiled kernels of
``ops.decayed_attention.gated.multilayer_mse_grid``). Floor per prompt, counted as ``iclab bench drift`` counts its full layers: a
full layer in the recurrent form costs T(10D² + 2D) forward (q, k, v: 6D²; the state update v kᵀ and o = S q: 2D²
each; the gate 2D) and T(14D² + 4D) backward without the input's cotangent (the first layer: the tokens need no
gradient), T(20D² + 4D) with it; in the parallel form 6TD² + 4T²D + 2TD forward (projections, gates, scores,
outputs) and 6TD² + 8T²D + 2TD backward (+ 6TD² + 2TD for the input's cotangent), fewer where T < D (n̄ ≤ 6); the
floor takes the cheaper form per layer. The last layer is read at the query, 3(4D² + 6TD), plus 6TD for its
token cotangents when layers lie below it (``fig2_floor_flops_per_step``).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from iclab.benches._roofline import compiled_flops, matmul_peak_gflops, step_beside_peaks
from iclab.benches._timing import steps_fn, time_first_and_second_call
from iclab.experiments.gating._common import K
from iclab.models import gla
from iclab.ops import use_backend
from iclab.tasks import multitask as mt


def _loss_fn(form: str, n_bar: int, d: int, contexts, batch: int, dtype):
    factor = jnp.asarray(mt.two_task_factor(r1=0.0, r2=1.0), dtype)

    def loss(params, key):
        pr = mt.sample_blocks(key, batch, [n_bar] * K, factor, None, 0.0, d=d, dtype=dtype)
        Z = gla.delimiter_prompt(pr.x, pr.y, pr.x_query, [n_bar] * K, contexts, query_context=0)[0]
        return jnp.mean((gla.predict(params, Z, None, label=d, form=form) - pr.y_query) ** 2)

    return loss


def bench_gating(n_bar: int = 50, d: int = 10, p: int = 5, batch: int = 256, seeds: int = 10, steps: int = 20,
                 lr: float = 1e-3, fig1_paper: dict | None = None, fig2_paper: dict | None = None) -> dict:
    """Steps per second of the fast and the recurrent form, 1 seed and ``seeds`` seeds vmapped.

    Args:
        n_bar: samples per task (the figure's largest, 50).
        d, p: input and context dimensions (the paper's 10 and 5).
        batch: fresh prompts per step (the paper's 256).
        seeds: seeds of the vmapped runs.
        steps: steps per timed call.
        fig1_paper: keywords of :func:`bench_fig1_paper` (None: its defaults, the paper preset's step).
        fig2_paper: keywords of :func:`bench_fig2_paper` (None: its defaults).
    Returns:
        JSON-able dict: steps/s and seconds per step of each (form, seeds), their ratio, compile+first-call
        seconds, the fast form's floor flops, achieved GFLOP/s and fraction of the measured matmul peak,
        the roofline figures (module docstring), the largest relative difference of loss and gradient between the
        forms, gating.fig1's and gating.fig2's paper steps (``fig1_paper``, ``fig2_paper``: :func:`bench_fig1_paper`,
        :func:`bench_fig2_paper`, with fractions of the peak: the larger of two measurements, before and after the
        paper steps; a whole step's in rounds against the peaks measured beside each, ``matmul_peak_gflops_at_step``:
        ``_roofline.step_beside_peaks``), load and device.
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
    peaks = [matmul_peak_gflops()]
    papers = {"fig1_paper": bench_fig1_paper(**(fig1_paper or {})), "fig2_paper": bench_fig2_paper(**(fig2_paper or {}))}
    peaks.append(matmul_peak_gflops())
    peak = max(peaks)  # the faster of the two: a machine's speed can drift, and a slow reading would flatter the fractions
    for S in (1, seeds):
        entry = out[f"fast_{S}_seed{'s' if S > 1 else ''}"]
        entry["floor_flops_per_step"] = S * batch * floor_per_prompt
        entry["achieved_gflops"] = entry["floor_flops_per_step"] / entry["s_per_step"] / 1e9
        entry["fraction_of_matmul_peak"] = entry["achieved_gflops"] / peak
    for paper in papers.values():  # (its whole step against the peaks beside it: ``step_beside_peaks``)
        for entry in paper["kernels"].values():
            entry["fraction_of_matmul_peak"] = entry["achieved_gflops"] / peak
    roofline = {"matmul_peak_gflops_f32": peak, "matmul_peak_gflops_f32_before_after": peaks, "floor_flops_per_prompt": floor_per_prompt,
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
        **papers,
        "loss_rel_diff": float(abs(l_f - l_r) / abs(l_r)),
        "grad_max_rel_diff": grad_rel,
        "steps_timed_per_call": steps,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "device": str(jax.devices()[0]),
        "note": "steps_per_s counts optimiser steps of the whole (vmapped) run; seed_steps_per_s multiplies by "
                "seeds; speedup = fast / recurrent steps per second",
    }


#: Per-token forward flops of the query-only form beyond the score z_tᵀc (2D), by gating (module docstring).
_PER_TOKEN = {"none": lambda D: 2 * D, "scalar": lambda D: 4 * D, "vector": lambda D: 4 * D * D}


def fig1_floor_flops_per_step(config, kinds: dict) -> int:
    """The arithmetic floor of one training step of gating.fig1's joint grid (module docstring), in flops.

    Args:
        config: a Fig1Config (batch, seeds, n_bars, d, p).
        kinds: name -> Kind (fig1._models(config)).
    Returns:
        batch · seeds · Σ_(kind, panel, n̄) 3(4D² + T(2D + per-token)).
    """
    from iclab.experiments.gating._common import _fmt, token_width

    total = 0
    for kind in kinds.values():
        D = token_width(kind.family, config.d, config.p)
        delim = _fmt(kind.family) == "delim"
        gating = {"linatt": "none", "gla": "scalar", "gla_wo": "scalar", "gla_vector": "vector"}[kind.family]
        for n_bar in config.n_bars:
            T = K * n_bar + (K if delim else 0) + 1
            total += len(kind.panels) * 3 * (4 * D * D + T * (2 * D + _PER_TOKEN[gating](D)))
    return total * config.batch * config.seeds


def fig2_floor_flops_per_step(config) -> int:
    """The arithmetic floor of one training step of gating.fig2's joint grid (module docstring), in flops.

    Args:
        config: a Fig2Config (batch, seeds, n_bars, layers, d, p).
    Returns:
        batch · seeds · Σ_(L, n̄) [full layers + the query read-out].
    """
    D = config.d + 1 + config.p
    total = 0
    for L in config.layers:
        for n_bar in config.n_bars:
            T = K * n_bar + K + 1
            full = sum(min(T * ((24 if l == 0 else 30) * D * D + 6 * D),  # recurrent, parallel
                           (12 if l == 0 else 18) * T * D * D + 12 * T * T * D + (4 if l == 0 else 6) * T * D)
                       for l in range(L - 1))
            total += full + 3 * (4 * D * D + 6 * T * D) + (6 * T * D if L > 1 else 0)
    return total * config.batch * config.seeds


def _timed(fn, *args, repeats: int = 2) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def _paper_step(exp_id: str, models, floor_fn, steps: int, over: dict, kernels: tuple[str, ...],
                rounds: int = 5) -> dict:
    """A gating paper preset's training step (module docstring): sampling, loss and gradient per kernel (compared
    with the first), and the whole step in the preset's kernel, against ``floor_fn(config)`` (``rounds`` timed
    loops, each beside its own peaks: :func:`iclab.benches._roofline.step_beside_peaks`)."""
    from iclab.experiments import get_experiment
    from iclab.experiments.gating import _common
    from iclab.engines.joint import group_losses, init_members, seed_keys

    preset = get_experiment(exp_id).resolve("paper", over)
    kinds = models(preset)
    panels = preset.panel_values() if hasattr(preset, "panel_values") else [_common.PANELS[0]]
    floor = floor_fn(preset)
    keys = seed_keys(preset.seed, preset.seeds)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 7))(keys)
    out = {"models": preset.seeds * sum(len(k.panels) for k in kinds.values()) * len(preset.n_bars),
           "seeds": preset.seeds, "batch": preset.batch, "floor_flops_per_step": floor, "kernels": {}}
    setups, ref = {}, None
    for kernel in kernels:
        with use_backend(kernel):  # the backend decides the loss and sampler when they are built and traced
            groups, sampler, aux = _common.training_setup(preset, kinds, panels)
            params = {name: init_members(g, keys, _common.INIT_STREAM) for name, g in groups.items()}

            def loss(p, batch_, groups=groups):
                settings = {name: g.settings for name, g in groups.items()}
                return sum(jnp.sum(v) for v in group_losses(groups, p, batch_, settings).values())

            sample = jax.jit(jax.vmap(sampler))
            batch0 = sample(step_keys, aux)
            vg = jax.jit(jax.vmap(jax.value_and_grad(loss)))
            value, grad = vg(params, batch0)
            if ref is None:
                ref = (value, grad)
            rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                      for a, b in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(ref[1])))
            s = _timed(vg, params, batch0)
            out["kernels"][kernel] = {
                "sample_s": _timed(sample, step_keys, aux), "loss_grad_s": s, "achieved_gflops": floor / s / 1e9,
                # a native kernel runs outside XLA: its count would omit the kernel
                "xla_flops_loss_grad": None if kernel == "native" else compiled_flops(
                    jax.vmap(jax.value_and_grad(loss)), params, batch0),
                "loss_rel_diff": float(jnp.max(jnp.abs(value - ref[0]) / jnp.abs(ref[0]))), "grad_max_rel_diff": rel}
            setups[kernel] = (groups, sampler, aux, params, loss)
    # the whole step in the preset's kernel: sample, loss and gradient, Adam (with the preset's per-model clipping
    # left out: O(params)), as one jitted loop over the seeds
    step_kernel = "native" if "native" in setups else next(iter(setups))  # the experiments' backend on a CPU
    groups, sampler, aux, params, loss = setups[step_kernel]
    opt = optax.adam(preset.lr)

    @functools.partial(jax.jit, static_argnums=3)
    def run(p, key, aux_, n):
        def one_seed(p, key, aux_):
            def body(k, carry):
                p, s = carry
                g = jax.grad(lambda q: loss(q, sampler(jax.random.fold_in(key, k), aux_)))(p)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s
            return jax.lax.fori_loop(0, n, body, (p, opt.init(p)))[0]
        return jax.vmap(one_seed)(p, key, aux_)

    start = time.perf_counter()
    with use_backend(step_kernel):
        jax.block_until_ready(run(params, step_keys, aux, steps))
    out["compile_and_first_call_s"] = time.perf_counter() - start
    out["step_kernel"] = step_kernel
    # in rounds, each beside its own peaks: a machine's speed can drift within minutes
    out.update(step_beside_peaks(lambda: jax.block_until_ready(run(params, keys, aux, steps)), steps=steps,
                                 floor_flops=floor, rounds=rounds))
    out["paper_steps"] = preset.steps
    out["training_estimate_s"] = preset.steps * out["step_s"]
    return out


def bench_fig1_paper(steps: int = 3, seeds: int | None = None, batch: int | None = None,
                     kernels: tuple[str, ...] = ("xla", "native"), dtype: str | None = None, rounds: int = 5) -> dict:
    """gating.fig1's paper training step against its floor (module docstring).

    Args:
        steps: steps per timed loop.
        seeds, batch: the preset's (10, 256) unless set (smaller only to test the benchmark).
        kernels: the kernels whose summed loss and gradient are timed side by side (and compared with the first).
        dtype: the preset's training dtype (float32) unless set; float64 makes the kernels' comparison exact.
        rounds: timed loops of the whole step, each beside its own peaks (``_roofline.step_beside_peaks``).
    Returns:
        JSON-able dict: models, floor flops per step, sampling / loss-and-gradient seconds per kernel (with their
        agreement), the whole step in the preset's kernel (each round's seconds, the peaks beside them, its
        fractions of the peak; the median round's, and its floor ratio), achieved GFLOP/s, XLA's count of its own
        loss and gradient, the training estimate at the paper's steps.
    """
    from iclab.experiments.gating.fig1 import _models

    over = {k: v for k, v in (("seeds", seeds), ("batch", batch), ("dtype", dtype)) if v is not None}
    return _paper_step("gating.fig1", _models, lambda c: fig1_floor_flops_per_step(c, _models(c)), steps, over,
                       kernels, rounds)


def bench_fig2_paper(steps: int = 3, seeds: int | None = None, batch: int | None = None,
                     n_bars: list[int] | None = None, kernels: tuple[str, ...] = ("xla", "native"),
                     dtype: str | None = None, rounds: int = 5) -> dict:
    """gating.fig2's paper training step against its floor (module docstring); arguments as
    :func:`bench_fig1_paper`, ``n_bars`` a subset of the grid (e.g. one shard's; the draw stays at the grid's
    largest n̄ only when that n̄ is in the subset).

    Returns:
        JSON-able dict as :func:`bench_fig1_paper`.
    """
    from iclab.experiments.gating.fig2 import _models

    over = {k: v for k, v in (("seeds", seeds), ("batch", batch), ("n_bars", n_bars), ("dtype", dtype))
            if v is not None}
    return _paper_step("gating.fig2", _models, fig2_floor_flops_per_step, steps, over, kernels, rounds)
