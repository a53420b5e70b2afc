"""Timings of the decayed-attention kernels alone, for the benches (``iclab bench drift``): the compiled
full-layer kernels on their own layouts, and the read-out kernel called from numpy, from jitted code by
``host_call`` and by ``jax.pure_callback``. Seconds per call (best of a few) and the GFLOP/s they imply.
"""

from __future__ import annotations

import time
import timeit

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime import host as _host
from iclab.ops.decayed_attention import _layer_ir
from iclab.ops.decayed_attention import forget as native

__all__ = ["forget_kernel_timings", "forget_readout_call_timings"]


def _timed(fn, *args, repeats: int = 2) -> float:
    """Seconds per call of a jitted function (compiled and run once before timing)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def forget_kernel_timings(B: int, T: int, D: int) -> dict:
    """The compiled full-layer kernels alone (:mod:`.forget`), float32, at B prompts: seconds per call and
    GFLOP/s, with their flops counted per (prompt, token) as the multiply-adds they execute: forward 5D² (q, k,
    v; the state update; o = S q), backward 16D² (pass 1: q, k, v, S, q̄, W̄_Q, z̄; pass 2: E, λ̄, S̄, k̄, v̄, W̄_K,
    W̄_V, z̄). ``layer_*``: on the tokens (B, T, D), which the kernels transpose block by block (``gla_layer``);
    ``blocked_*``: numba's kernels on the blocked layout, the backward of a first layer (``data``: no z̄, 11D²) and
    of a layer on the residual stream (``stream``: 14D²), λ fixed (no λ̄); ``ir_*``: the same three as the LLVM IR
    kernels (:mod:`._layer_ir`) that fig2's models run in float32 (``multilayer_mse``). Each the best of 5
    calls, the two families alternated.

    Args:
        B: prompts; T: tokens per prompt; D: token width.
    Returns:
        {name_s: seconds per call, name_gflops: the flops counted above per second} for each kernel.
    """

    rng = np.random.default_rng(0)
    Z, dO = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(2))
    W = [(0.3 * rng.standard_normal((D, D))).astype(np.float32) for _ in range(3)]
    lam = np.float32(0.9)
    Zb, dOb = native._to_blocks(Z), native._to_blocks(dO)
    nb = Zb.shape[0]
    Ob, dZb, dW, dlam = np.empty_like(Zb), np.empty_like(Zb), np.empty((nb, 3, D, D), np.float32), np.empty(nb,
                                                                                                        np.float32)

    def blocked(family):
        def kernels(grad_z):
            if family == "ir":
                return _layer_ir.layer_kernels(D, True, np.float32, grad_z=grad_z, grad_lam=False)
            return native._layer_kernels(D, True, blocked=True, grad_z=grad_z, grad_lam=False)

        forward, data, stream = kernels(True)[0], kernels(False)[1], kernels(True)[1]
        return ((f"{family}_forward", lambda: native._run_blocks(forward, nb, Zb, *W, lam, Ob), 5),
                (f"{family}_backward_data", lambda: native._run_blocks(data, nb, Zb, *W, lam, dOb, dZb, dW, dlam), 11),
                (f"{family}_backward_stream", lambda: native._run_blocks(stream, nb, Zb, *W, lam, dOb, dZb, dW, dlam),
                 14))

    timed = [("layer_forward", lambda: native._host_layer_forward(Z, *W, lam), 5),
             ("layer_backward", lambda: native._host_layer_backward(Z, *W, lam, dO), 16)]
    timed += [x for pair in zip(blocked("blocked"), blocked("ir")) for x in pair]  # alternated: speed drifts
    out = {}
    for name, call, fma in timed:
        call()
        seconds = min(timeit.repeat(call, number=1, repeat=5))  # best of 5: a machine's speed drifts between calls
        out[f"{name}_s"] = seconds
        out[f"{name}_gflops"] = 2 * fma * D * D * B * T / seconds / 1e9
    return out


def forget_readout_call_timings(G: int, K: int, B: int, T: int, D: int) -> dict:
    """The read-out kernel of fig1's grid (:func:`.forget.readout_grid`, float32) called three ways: on
    numpy arrays (the kernel alone), from jitted code through ``host_call`` (the experiments' path)
    and through ``jax.pure_callback`` (which copies the 111 MB of tokens twice more): seconds per call.

    Args:
        G: rows (γ values); K: models per row; B: prompts; T: tokens per prompt; D: token width.
    Returns:
        {kernel_alone_s, host_call_s, pure_callback_s}: seconds per call.
    """

    rng = np.random.default_rng(0)
    Z = rng.standard_normal((G, B, T, D)).astype(np.float32)
    u = rng.standard_normal((G, K, D)).astype(np.float32)
    c = rng.standard_normal((G, K, B, D)).astype(np.float32)
    lam = np.full((G, K), 0.9, np.float32)
    out = {"kernel_alone_s": _timed(native._host_forward, Z, u, c, lam, repeats=3)}
    args = tuple(jnp.asarray(a) for a in (Z, u, c, lam))
    prim = _host._PRIM
    try:
        for name, p in (("host_call_s", prim), ("pure_callback_s", None)):
            _host._PRIM = p  # host_call falls back to jax.pure_callback without its primitive
            out[name] = _timed(jax.jit(lambda *a: native.readout_grid(*a)), *args, repeats=3)
    finally:
        _host._PRIM = prim
    return out
