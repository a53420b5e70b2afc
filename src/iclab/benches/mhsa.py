"""Benchmark: training steps per second in the Fig 1 setting (H = I = 3, d = 30, L = 100, batch 4096).

Two models, each one SGD step on a fresh batch per step, from the theory's init:

- ``full``: the full H-head softmax attention (eq 2.1) on the ½-MSE of fresh prompts (X, Y, q), the
  step ``mhsa.fig1`` trains with (:mod:`iclab.experiments.mhsa._training`);
- ``spectral``: the decomposable model's (ω̄, μ) on the ½ exact-expectation loss
  (:func:`iclab.models.mhsa.spectral_expected_loss`: G and ε integrated out, fresh X and q per step),
  parametrised directly by (ω̄, μ) (H·I numbers each): a speed comparison only, as GD on (ω̄, μ) is
  not on the full model's time axis (that needs the balanced singular values of the paper's Sec 5.1).

Each is timed for 1 seed and for ``seeds`` seeds vmapped. A step is ``jax.grad`` of the loss on the
batch drawn from fold_in(key, step), then ``params − lr·grad``: the arithmetic of the sampled
engine's step. The loop is one jitted ``fori_loop``, compiled once and timed on a second call, so
the numbers exclude compilation (reported separately).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax

from iclab.benches._timing import steps_fn, time_first_and_second_call
from iclab.experiments.mhsa._training import Fig1Config, half_mse, head_width, initial_params, task_family
from iclab.models import mhsa as models
from iclab.tasks.multitask_regression import sample_prompts
from iclab.theory import mhsa as theory


def bench_mhsa(batch: int = 4096, steps: int = 5, seeds: int = 6, dtype: str = "float32", lr: float = 1.0) -> dict:
    """Steps per second of full and spectral training, 1 seed and ``seeds`` seeds vmapped.

    Args:
        batch: fresh prompts per step (Fig 1 setting: 4096).
        steps: steps per timed call (the full model at batch 4096 is slow on a CPU: keep it small).
        seeds: seeds of the vmapped runs.
        dtype: float32 or float64 arithmetic.
        lr: SGD learning rate.
    Returns:
        JSON-able dict: steps/s and seconds per step of each (model, seeds), compile+first-call
        seconds, the setting, load and device.
    """
    load_before = os.getloadavg()
    c = Fig1Config(batch=batch, dtype=dtype)
    ts = task_family(c)
    d_e = head_width(c)
    w0, m0 = theory.initial_state(H=c.H, I=c.I, omega0=c.omega0, mu0=c.mu0, advantage=c.advantage)
    spec0 = {"omega": jnp.asarray(w0, dtype), "mu": jnp.asarray(m0, dtype)}
    full0 = initial_params(spec0, ts, d_e)

    def full_loss(p, key):
        return half_mse(p, sample_prompts(key, ts, c.L, batch))

    def spectral_loss(s, key):
        kx, kq = jax.random.split(key)
        X = jax.random.normal(kx, (batch, ts.d, c.L), dtype)
        q = jax.random.normal(kq, (batch, ts.d), dtype)
        return 0.5 * models.spectral_expected_loss(s, X, q, ts.d_i, ts.lam, sigma2=c.sigma**2)

    out = {}
    for name, loss, p0 in (("full", full_loss, full0), ("spectral", spectral_loss, spec0)):
        for S in (1, seeds):
            batched = S > 1
            params = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (S,) + a.shape), p0) if batched else p0
            keys = jax.random.split(jax.random.PRNGKey(0), S) if batched else jax.random.PRNGKey(0)
            first, second = time_first_and_second_call(steps_fn(loss, steps, optax.sgd(lr), batched), params, keys)
            out[f"{name}_{S}_seed{'s' if S > 1 else ''}"] = {
                "steps_per_s": steps / second, "s_per_step": second / steps,
                "seed_steps_per_s": S * steps / second, "compile_and_first_call_s": first}
    return {
        "setting": f"mhsa Fig 1: H={c.H}, I={c.I}, d={ts.d}, L={c.L}, d_e={d_e}, batch={batch}, {dtype}, "
                   f"SGD lr={lr}, fresh prompts per step; spectral = exact-expectation loss over G, eps",
        **out,
        "steps_timed_per_call": steps,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "cpus": os.cpu_count(),
        "device": str(jax.devices()[0]),
        "note": "steps_per_s counts optimiser steps of the whole (vmapped) run; seed_steps_per_s multiplies by seeds",
    }
