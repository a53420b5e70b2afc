"""Benchmark: the training step of drift.fig1 and drift.fig2 at their paper settings, against its floor.

Settings (the paper presets): d = 10, n = 100 (T = n+1 = 101 tokens of width D = d+1 = 11), batch 5000
fresh prompts per step, W_Q, W_K, W_V weights, AdamW, float32.

- fig1: 5 γ × (17 λ + 1 learnt λ) = 90 one-layer models; the models of one γ share its prompts.
- fig2: γ = 0.95; 5 λ × depths 1, 2, 3, plus one 1-layer model at λ*: 16 models, 15 full layers (every
  position) below the read-out layers.

A step is: draw the batch (every γ from the same normals; the paper presets' sampler, native, draws it with
``ops.drift_sampler.native.sample_training_batch`` with the preset's ``normals``, the xla sampler with
``tasks.drift.sample_drift_prompts``: both are timed, and fig1's shared layout with each of the native sampler's
normals, ``sample_s_native_shared_ziggurat`` and ``_box_muller``), the loss and its gradient (``_common._group_mse``, the experiments' own loss), one AdamW update. Each
part is timed apart (jitted, second call), and the whole step as a jitted loop of ``steps`` steps.

Floor (flops counted from the shapes; a product's backward computes the gradient of each input that needs
one, at the forward's cost each):

- a layer read out at the query: q = W_Q z_q and c = W_Kᵀ q (4D²), the label values Z·(W_V)_{d+1,:} and the
  scores Z·c (2TD each), the λ-weighted sum (O(T)): 4TD + 4D² forward; 2(4TD + 4D²) with the backward on
  the raw tokens (only the weights need gradients), 3(4TD + 4D²) on a residual stream (its tokens too);
- a full layer (every position, the recurrent state form): q, k, v (6TD²), S_t = λS_{t−1} + v_t k_tᵀ (2TD²),
  o_t = S_t q_t (2TD²): 10TD² forward; 24TD² with the backward on the raw tokens (q, k, v and the weights
  need gradients, the tokens not), 30TD² on a residual stream;
- an L-layer model: one full layer on the raw tokens, L − 2 on the stream, a read-out layer on the stream
  (L = 1: one read-out layer on the raw tokens).

So fig1 needs 90 · 2(4TD + 4D²) ≈ 8.9·10⁵ flops per prompt (4.4 GFLOP per step at batch 5000) and fig2
6 · 2(4TD + 4D²) + 10 · 3(4TD + 4D²) + 10 · 24TD² + 5 · 30TD² ≈ 5.0·10⁶ (25 GFLOP per step). Sampling
(≈ 10⁷ Gaussian draws per step, the AR(1) scan and y = ⟨w, x⟩) and AdamW are not counted in the floor;
their time is reported apart. Reported beside it: XLA's flop count of the compiled loss-and-gradient, the achieved GFLOP/s (floor over
the measured loss-and-gradient time, and over the whole step), and a float32 matmul's GFLOP/s measured in
the same run. fig1's models are timed with each kernel (XLA's ``gla_forget.gla_readout``, the compiled
``ops.decayed_attention.forget.readout_grid`` on the tokens, and ``native_shared``: ``readout_grid_shared`` on the shared
layout of ``ops.drift_sampler.native.sample_shared_batch``, the inputs once for the 5 γ, which the paper preset's step
uses: in float32 the fused loss kernel ``readout_mse_shared``; ``native_shared_twin`` is the same layout through
``readout_grid_shared`` and XLA's contractions of its residuals, the path before it), fig2's full layers in each form of ``models.gla_forget.predict_multilayer``
(``parallel`` in XLA, ``native`` the compiled recurrent kernels; losses and gradients compared with the first);
the step loops use the paper presets' kernel (native).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from iclab.ops import forget_kernel_timings, forget_readout_call_timings
from iclab.benches._roofline import compiled_flops, matmul_peak_gflops, step_beside_peaks
from iclab.experiments.drift import _common
from iclab.models import gla_forget as gla
from iclab.tasks.drift import sample_drift_prompts, tokens
from iclab.tasks.drift import NORMALS, sample_shared_batch, sample_training_batch

__all__ = ["bench_drift", "floor_flops_per_prompt"]


def floor_flops_per_prompt(T: int, D: int, depths) -> int:
    """Forward-and-backward flops per prompt of models of the given depths (module docstring).

    Args:
        T: tokens per prompt; D: token width.
        depths: each model's number of layers L (1: a read-out layer on the raw tokens; L ≥ 2: a full layer on
            the raw tokens, L − 2 full layers and a read-out layer on the residual stream).
    Returns:
        flops.
    """
    readout = 4 * T * D + 4 * D * D
    total = 0
    for L in depths:
        total += 2 * readout if L == 1 else 24 * T * D * D + (L - 2) * 30 * T * D * D + 3 * readout
    return total


def _models(which: str, config):
    """(gammas, {name: (lams (G, K), layers)}) of a paper preset."""
    if which == "fig1":
        lams = np.tile(np.asarray(config.lams + [config.learn_lam_init]), (len(config.gammas), 1))
        return np.asarray(config.gammas), {"grid": (lams, None)}
    lams = np.asarray(config.lams)[None]
    groups = {f"L{L}": (lams, None if L == 1 else L) for L in config.depths}
    groups["star"] = (np.array([[0.9]]), None)
    return np.array([config.gamma]), groups


def _timed(fn, *args, repeats: int = 2) -> float:
    """Seconds per call of a jitted function (compiled and run once before timing)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def _setting(which: str, batch: int | None, steps: int, forms, rounds: int = 5) -> dict:
    from iclab.experiments import get_experiment

    config = get_experiment(f"drift.{which}").resolve("paper", {} if batch is None else {"batch": batch})
    dt = jnp.float32
    gammas, groups = _models(which, config)
    B, T, D = config.batch, config.n + 1, config.d + 1
    Lam = jnp.asarray(config.Lam(), dt)
    gam = jnp.asarray(gammas, dt)

    def sample_xla(key):
        pr = sample_drift_prompts(key, B, gamma=gam, **config.process(), Lam=Lam, dtype=dt)
        return tokens(pr), pr.target

    def sample_native(key):
        return sample_training_batch(key, B, gamma=gam, **config.process(), Lam=Lam, dtype=dt, normals=_common.NORMALS)

    def sample_shared(key, normals=_common.NORMALS):  # the paper preset's layout for one-layer models on native kernels
        X, Y, y = sample_shared_batch(key, B, gamma=gam, **config.process(), Lam=Lam, dtype=dt, normals=normals)
        return _common.SharedTokens(X, Y), y

    # the step as the experiments run it on a CPU (the native backend): the compiled sampler and kernels
    shared = which == "fig1"
    sample = sample_shared if shared else sample_native

    params = {}
    for i, (name, (lams, layers)) in enumerate(groups.items()):
        keys = jax.random.split(jax.random.PRNGKey(i), lams.size)
        p = jax.vmap(lambda k, L=layers: gla.init_gla(k, config.d, config.parametrisation, config.init_std, layers=L,
                                                       dtype=dt))(keys)
        params[name] = jax.tree_util.tree_map(lambda a, s=lams.shape: a.reshape(s + a.shape[1:]), p)

    def loss_fn(form):
        # fig1: ``form`` is the kernel (native_shared: native on the shared layout); fig2: the full layers' form (its
        # one-layer models by the preset's kernel)
        kw = ({"kernel": form.split("_")[0], "fused": not form.endswith("_twin")} if which == "fig1"
              else {"form": form, "kernel": "native"})

        def loss(p, batch):
            return sum(jnp.sum(_common._group_mse(layers, **kw)(p[name], batch, {"lam": jnp.asarray(lams, dt)}))
                       for name, (lams, layers) in groups.items())
        return loss

    depths = [layers or 1 for lams, layers in groups.values() for _ in range(lams.size)]
    floor = B * floor_flops_per_prompt(T, D, depths)
    key = jax.random.PRNGKey(0)
    batch0 = jax.jit(sample_native)(key)  # tokens: every form reads them
    out = {"normals": _common.NORMALS, "models": len(depths), "G": len(gammas), "full_layers": sum(L - 1 for L in depths), "batch": B, "T": T, "D": D, "floor_flops_per_step": floor,
           "sample_s": _timed(jax.jit(sample), key), "sample_s_xla": _timed(jax.jit(sample_xla), key),
           "sample_s_native": _timed(jax.jit(sample_native), key), "xla_flops_sample": compiled_flops(sample_xla, key),
           "forms": {}}
    batches = {}
    if which == "fig1":
        batches["native_shared"] = batches["native_shared_twin"] = jax.jit(sample_shared)(key)
        out["sample_s_native_shared"] = _timed(jax.jit(sample_shared), key)
        for normals in NORMALS:  # both generators of the compiled sampler, side by side (the preset's is one of them)
            out[f"sample_s_native_shared_{normals}"] = _timed(jax.jit(functools.partial(sample_shared, normals=normals)),
                                                              key)
        forms = tuple(forms) + ("native_shared_twin", "native_shared") if "native" in forms else tuple(forms)
    ref = None
    for form in forms:
        vg = jax.jit(jax.value_and_grad(loss_fn(form)))
        batch = batches.get(form, batch0)
        value, grad = vg(params, batch)
        if ref is None:
            ref = (value, grad)
        rel = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                  for a, b in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(ref[1])))
        s = _timed(vg, params, batch)
        out["forms"][form] = {"loss_grad_s": s, "achieved_gflops": floor / s / 1e9,
                              # a native kernel runs outside XLA: its count would omit the kernel
                              "xla_flops_loss_grad": None if form.startswith("native") else compiled_flops(
                                  jax.value_and_grad(loss_fn(form)), params, batch),
                              "loss_rel_diff": float(abs(value - ref[0]) / abs(ref[0])), "grad_max_rel_diff": rel}
    # the whole step, in the experiments' form: sample, loss and gradient, AdamW, as a jitted loop
    opt = optax.chain(config.transformation(), optax.scale(-config.lr))
    loss = loss_fn("native")
    out["step_layout"] = "shared" if shared else "tokens"

    @functools.partial(jax.jit, static_argnums=2)
    def run(p, key, n):
        def body(k, carry):
            p, s = carry
            g = jax.grad(lambda q: loss(q, sample(jax.random.fold_in(key, k))))(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s
        return jax.lax.fori_loop(0, n, body, (p, opt.init(p)))[0]

    start = time.perf_counter()
    jax.block_until_ready(run(params, key, steps))
    out["compile_and_first_call_s"] = time.perf_counter() - start
    # in rounds, each beside its own peaks: a machine's speed can drift within minutes
    out.update(step_beside_peaks(lambda: jax.block_until_ready(run(params, jax.random.PRNGKey(1), steps)),
                                 steps=steps, floor_flops=floor, rounds=rounds))
    out["paper_steps"] = config.steps
    out["training_estimate_s"] = config.steps * out["step_s"]
    return out


def bench_drift(steps: int = 3, batch: int | None = None, fig2_forms: tuple[str, ...] = ("parallel", "native"),
                fig1_kernels: tuple[str, ...] = ("xla", "native"), rounds: int = 5) -> dict:
    """Roofline of drift.fig1's and drift.fig2's paper training steps (module docstring).

    Args:
        steps: steps per timed loop.
        batch: prompts per step (None: the paper's 5000; smaller only to test the benchmark).
        fig2_forms: forms of fig2's full layers, timed side by side and compared with the first.
        fig1_kernels: kernels of fig1's models (``TrainConfig.kernel``), timed side by side and compared with the
            first. The step loops use the paper presets' kernel (native: the read-out kernel, the native form).
        rounds: timed loops of each whole step, each beside its own peaks (``_roofline.step_beside_peaks``).
    Returns:
        JSON-able dict: per setting the floor flops, sampling / loss-and-gradient / step seconds, achieved GFLOP/s
        and their fraction of the matmul peak, XLA's counts, the forms' agreement; the compiled layer kernels
        alone (``native_layer_kernels``: seconds, GFLOP/s, fraction of the peak); fig1's read-out kernel alone, through
        ``host_call`` and through ``jax.pure_callback`` (``readout_callback``: seconds per call); the peak (measured
        before and after the settings, the larger used; a whole step's in ``rounds`` timed loops, each against the
        peaks measured beside it, ``matmul_peak_gflops_at_step``: ``_roofline.step_beside_peaks``); load and device.
    """
    load_before = os.getloadavg()
    peaks = [matmul_peak_gflops()]
    out = {"fig1": _setting("fig1", batch, steps, tuple(fig1_kernels), rounds),
           "fig2": _setting("fig2", batch, steps, tuple(fig2_forms), rounds)}
    peaks.append(matmul_peak_gflops())
    peak = max(peaks)  # the faster of the two: a machine's speed can drift, and a slow reading would flatter the fractions
    kernels = forget_kernel_timings(out["fig2"]["batch"], out["fig2"]["T"], out["fig2"]["D"])
    for name in [k.removesuffix("_gflops") for k in kernels if k.endswith("_gflops")]:
        kernels[f"{name}_fraction_of_matmul_peak"] = kernels[f"{name}_gflops"] / peak
    out["native_layer_kernels"] = kernels
    f1 = out["fig1"]
    out["readout_callback"] = forget_readout_call_timings(f1["G"], f1["models"] // f1["G"], f1["batch"], f1["T"], f1["D"])
    for entry in (out["fig1"], out["fig2"]):  # (its whole step against the peaks beside it: ``step_beside_peaks``)
        for f in entry["forms"].values():
            f["fraction_of_matmul_peak"] = f["achieved_gflops"] / peak
    return {
        "setting": "drift paper presets: d=10, n=100 (T=101, D=11), batch 5000 (unless set), qkv weights, AdamW, float32",
        **out,
        "matmul_peak_gflops_f32": peak,
        "matmul_peak_gflops_f32_before_after": peaks,
        "steps_timed_per_call": steps,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "device": str(jax.devices()[0]),
    }
