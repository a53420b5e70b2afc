"""The one-layer GLA read-out of a grid of models on shared prompts, as a compiled CPU kernel (numba).

For models k = 1..K of row g (one forget factor λ_gk each) on the prompts Z_g (B, T, D) of that row,

    ŷ_gkb = Σ_t w_t a_t s_t,   a_t = u_gk · z_gbt,   s_t = c_gkb · z_gbt,   w_t = λ_gk^{T-1-t},

with u = (W_V)_{d+1,:} (the label row of the values) and c = W_Kᵀ W_Q z_q (the query seen through the
keys): :func:`iclab.models.gla_forget.gla_readout`, the naive twin this kernel is tested against. ŷ is
bilinear in (u, c), so ONE pass over the tokens gives it and every residual of its gradient:

    H_gkb = Σ_t w_t a_t z_t = ∂ŷ/∂c,   J_gkb = Σ_t w_t s_t z_t = ∂ŷ/∂u,   ŷ'_gkb = Σ_t w'_t a_t s_t = ∂ŷ/∂λ,

w'_t = (T-1-t) λ^{T-2-t}; then ŷ = c · H, and the backward pass (in JAX) is three contractions with the
cotangent g_gkb: ∂/∂u = Σ_b g J, ∂/∂c = g H, ∂/∂λ = Σ_b g ŷ'. The gradient of W_Q, W_K flows on through c.

Why a kernel: XLA:CPU runs these contractions (T = 101 by D = 11, batched over prompts and models) at a few
per cent of the CPU's matmul peak. The kernel takes a block of prompts of one
row, transposes it prompt-minor into a buffer that stays in cache for the K models of the row, and
vectorises over the prompts of the block (the loops over D unrolled into scalars, as in
:mod:`iclab.engines.moments_native`). Each output is summed by one thread in a fixed order, so the result
does not depend on the thread count. It runs inside jitted JAX code through ``iclab.ops._runtime.host.host_call`` (CPU
only; a GPU run would copy to the host every step: use the XLA form there).

In float32 on the shared layout, ``readout_mse_shared`` goes one step further: the loss of every model and its
gradients in the same pass (``iclab.ops.decayed_attention._readout_ir``, an LLVM IR kernel: each model's values in registers,
per-block sums out, no H and J), which drift.fig1's and drift.baselines' paper presets train with; the kernel above
with XLA's contractions is its twin in the tests.

The full layers at every position (``gla_layer``, ``multilayer_mse``) are kernels of the same kind, in the
recurrent state form, on the tokens (B, T, D) or on a blocked layout (``_layer_source``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime.host import host_call
from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime import blocked as _blocked
from iclab.ops.decayed_attention import _layer_ir, _readout_ir
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["forget_layer", "multilayer_mse", "readout_grid", "readout_grid_shared", "readout_mse_shared"]

#: Prompts per block: the block's tokens (T·D·CH floats) stay in the L2 cache while the K models of its row pass.
CHUNK = 64
#: Lanes of a block in the layer kernels' blocked layout (``_layer_source``, ``iclab.ops._runtime.blocked``).
LANES = _blocked.LANES

# Reassociation and FMA contraction let LLVM vectorise over the prompts of a block (no 'nnan'/'ninf': a
# diverging run gives NaN and inf as the XLA form does).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _source(D: int, shared: bool = False) -> str:
    """Kernel source for tokens of width D (the loops over D unrolled into scalar variables).

    ``kernel`` reads Z (G, B, T, D); a job is one block of CH prompts of one row g. ``kernel_shared`` reads the
    shared layout, inputs X (B, T, D-1) of every row and labels Y (G, B, T) (the compiled sampler's
    ``sample_shared_batch``); a job is one block of prompts for all G rows, whose inputs are transposed into the
    block buffer once, and only the label column is rewritten per row. Both run the same arithmetic per (g, k, b).
    """
    dz = range(D)
    alloc = [
        f"        zb = np.zeros((T, {D}, CH), Z.dtype)",
        f"        cb = np.zeros(({D}, CH), Z.dtype)",
        f"        acc = np.empty(({2 * D + 1}, CH), Z.dtype)",
        "        w = np.empty(T, Z.dtype)",
        "        wp = np.empty(T, Z.dtype)",
    ]
    models = [
        "        for k in range(K):",
        "            l = lam[g, k]",
        "            p = 1.0",
        "            wp[T - 1] = 0.0",
        "            for e in range(T):",
        "                if e > 0:",
        "                    wp[T - 1 - e] = e * p",
        "                    p = p * l",
        "                w[T - 1 - e] = p",
        "            for b in range(n):",
        f"                for e in range({D}):",
        "                    cb[e, b] = c[g, k, b0 + b, e]",
        "            acc[:, :] = 0.0",
        *[f"            u{e} = u[g, k, {e}]" for e in dz],
        "            for t in range(T):",
        "                wt = w[t]",
        "                wpt = wp[t]",
        "                zt = zb[t]",
        "                for b in range(n):",
        *[f"                    z{e} = zt[{e}, b]" for e in dz],
        "                    a = " + " + ".join(f"u{e} * z{e}" for e in dz),
        "                    s = " + " + ".join(f"cb[{e}, b] * z{e}" for e in dz),
        "                    wa = wt * a",
        "                    ws = wt * s",
        *[f"                    acc[{e}, b] += wa * z{e}" for e in dz],
        *[f"                    acc[{D + e}, b] += ws * z{e}" for e in dz],
        f"                    acc[{2 * D}, b] += wpt * a * s",
        "            for b in range(n):",
        "                yhat[g, k, b0 + b] = " + " + ".join(f"cb[{e}, b] * acc[{e}, b]" for e in dz),
        f"                dy[g, k, b0 + b] = acc[{2 * D}, b]",
        f"                for e in range({D}):",
        "                    H[g, k, b0 + b, e] = acc[e, b]",
        f"                    J[g, k, b0 + b, e] = acc[{D} + e, b]",
    ]
    if shared:
        lines = [
            "def kernel_shared(X, Y, u, c, lam, yhat, H, J, dy, first, stop):",
            "    G, B, T = Y.shape",
            "    K = u.shape[1]",
            "    for job in range(first, stop):",
            "        b0 = job * CH",
            "        n = min(CH, B - b0)",
            *alloc,
            "        for b in range(n):",
            "            for t in range(T):",
            f"                for e in range({D - 1}):",
            "                    zb[t, e, b] = X[b0 + b, t, e]",
            "        for g in range(G):",
            "            for b in range(n):",
            "                for t in range(T):",
            f"                    zb[t, {D - 1}, b] = Y[g, b0 + b, t]",
            *["    " + line for line in models],
        ]
    else:
        lines = [
            "def kernel(Z, u, c, lam, yhat, H, J, dy, first, stop):",
            "    G, B, T, _ = Z.shape",
            "    K = u.shape[1]",
            "    nblocks = (B + CH - 1) // CH",
            "    for job in range(first, stop):",
            "        g = job // nblocks",
            "        b0 = (job % nblocks) * CH",
            "        n = min(CH, B - b0)",
            *alloc,
            "        for b in range(n):",
            "            for t in range(T):",
            f"                for e in range({D}):",
            "                    zb[t, e, b] = Z[g, b0 + b, t, e]",
            *models,
        ]
    return "\n".join(lines).replace("Z.dtype", "c.dtype")


@functools.cache
def _kernel(D: int):
    """The compiled kernel for width D (compiled on first call per dtype, ~3 s): jobs [first, stop) of the G × ⌈B/CH⌉
    blocks. Serial code (numba's parallel mode doubles the compile time); threads split the jobs (``_host_forward``)."""
    return compile_kernels(_source(D) + "\n\n\n" + _source(D, shared=True), ["kernel", "kernel_shared"],
                           label=f"iclab GLA read-out kernel, D={D}", constants={"CH": CHUNK}, fastmath=_FASTMATH,
                           nogil=True, boundscheck=False)


def _readonly(a, dtype) -> np.ndarray:
    """A read-only C-contiguous view: numba types writable and read-only arrays apart, and the callback's arrays
    come either way, so one form gives one compiled signature per dtype."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


def _run_readout(kernel, tokens, u, c, lam, G: int, B: int, D: int, jobs: int, out=None):
    """(ŷ, H, J, ŷ') of one grid, written into ``out`` (the host call's result buffers) when given: the kernel's
    jobs split over threads, a contiguous run each."""
    dt = c.dtype
    K = u.shape[1]
    if out is None:
        out = (np.empty((G, K, B), dt), np.empty((G, K, B, D), dt), np.empty((G, K, B, D), dt), np.empty((G, K, B), dt))
    yhat, H, J, dy = out
    run_split(kernel, jobs, *tokens, u, c, lam, yhat, H, J, dy, threads=thread_count())  # each thread its run of blocks
    return yhat, H, J, dy


def _host_forward(Z, u, c, lam, out=None):
    """numpy side of the callback: (ŷ, H, J, ŷ') of one grid."""
    Z, u, c, lam = (_readonly(a, Z.dtype) for a in (Z, u, c, lam))
    G, B, T, D = Z.shape
    return _run_readout(_kernel(D)[0], (Z,), u, c, lam, G, B, D, jobs=G * -(-B // CHUNK), out=out)  # (row, block)


def _host_forward_shared(X, Y, u, c, lam, out=None):
    """numpy side of the callback, tokens in the shared layout: (ŷ, H, J, ŷ') of one grid."""
    X, Y, u, c, lam = (_readonly(a, Y.dtype) for a in (X, Y, u, c, lam))
    G, B, T = Y.shape
    D = X.shape[-1] + 1
    return _run_readout(_kernel(D)[1], (X, Y), u, c, lam, G, B, D, jobs=-(-B // CHUNK), out=out)  # blocks, all rows


def _readout_shapes(G, K, B, D, dt):
    return (jax.ShapeDtypeStruct((G, K, B), dt), jax.ShapeDtypeStruct((G, K, B, D), dt),
            jax.ShapeDtypeStruct((G, K, B, D), dt), jax.ShapeDtypeStruct((G, K, B), dt))


def _forward(Z, u, c, lam):
    G, B, T, D = Z.shape
    dt = Z.dtype
    u, c, lam = (jnp.asarray(a, dt) for a in (u, c, lam))
    return host_call(_host_forward, _readout_shapes(G, u.shape[1], B, D, dt), Z, u, c, lam,
                     vmap_method="sequential", writes_out=True)


def _forward_shared(X, Y, u, c, lam):
    G, B, T = Y.shape
    D = X.shape[-1] + 1
    dt = Y.dtype
    X, u, c, lam = (jnp.asarray(a, dt) for a in (X, u, c, lam))
    return host_call(_host_forward_shared, _readout_shapes(G, u.shape[1], B, D, dt), X, Y, u, c, lam,
                     vmap_method="sequential", writes_out=True)


@jax.custom_vjp
def readout_grid(Z: jax.Array, u: jax.Array, c: jax.Array, lam: jax.Array) -> jax.Array:
    """Read-out predictions of a (G, K) grid of one-layer GLA models on the prompts of their rows (module docstring).

    ŷ_gkb = Σ_t λ_gk^{T-1-t} (u_gk · z_gbt)(c_gkb · z_gbt); with u = (W_V)_{d+1,:} and c = W_Kᵀ W_Q z_q this is
    ``gla_forget.gla_readout``. Differentiable in u, c and λ (custom VJP); Z is data (its cotangent is zero).

    Args:
        Z: (G, B, T, D) tokens of the B prompts of each row g (the query last).
        u: (G, K, D) each model's value read-out row.
        c: (G, K, B, D) each model's query vector per prompt.
        lam: (G, K) forget factors.
    Returns:
        (G, K, B) predictions, in Z's dtype.
    """
    return _forward(Z, u, c, lam)[0]


@jax.custom_vjp
def readout_grid_shared(X: jax.Array, Y: jax.Array, u: jax.Array, c: jax.Array, lam: jax.Array) -> jax.Array:
    """``readout_grid`` on tokens whose inputs all rows share: z_gbt = (x_bt, y_gbt), equal to
    ``readout_grid(Z, u, c, lam)`` with Z_g = [X, Y_g] bit for bit.

    Why: the G rows of drift.fig1 and drift.baselines see the same inputs (common random numbers), so the tokens
    need not hold G copies of them: X and Y are (d + G)/(G(d+1)) of Z's size (30 MB against 111 MB at the paper's
    batch), which the sampler writes, the host call copies and the kernel reads.

    Args:
        X: (B, T, D-1) inputs of the B prompts, shared by the rows (the query last).
        Y: (G, B, T) their labels in each row g (the query's label 0).
        u: (G, K, D); c: (G, K, B, D); lam: (G, K): as in ``readout_grid``.
    Returns:
        (G, K, B) predictions, in Y's dtype.
    """
    return _forward_shared(X, Y, u, c, lam)[0]


def _param_cotangents(H, J, dy, u, c, lam, g):
    """Cotangents of (u, c, λ) from the forward's residuals: Σ_b g J, g H, Σ_b g ŷ'."""
    return (jnp.einsum("gkb,gkbd->gkd", g, J).astype(u.dtype), (g[..., None] * H).astype(c.dtype),
            jnp.einsum("gkb,gkb->gk", g, dy).astype(lam.dtype))


def _fwd(Z, u, c, lam):
    yhat, H, J, dy = _forward(Z, u, c, lam)
    return yhat, (H, J, dy, Z, u, c, lam)


def _bwd(res, g):
    H, J, dy, Z, u, c, lam = res
    return (jnp.zeros_like(Z), *_param_cotangents(H, J, dy, u, c, lam, g))


def _fwd_shared(X, Y, u, c, lam):
    yhat, H, J, dy = _forward_shared(X, Y, u, c, lam)
    return yhat, (H, J, dy, X, Y, u, c, lam)


def _bwd_shared(res, g):
    H, J, dy, X, Y, u, c, lam = res
    return (jnp.zeros_like(X), jnp.zeros_like(Y), *_param_cotangents(H, J, dy, u, c, lam, g))


readout_grid.defvjp(_fwd, _bwd)
readout_grid_shared.defvjp(_fwd_shared, _bwd_shared)


def _host_readout_mse_shared(X, Y, y, u, M, lam):
    """numpy side of ``readout_mse_shared``: the fused kernel over blocks of LANES prompts on the threads, each
    block's loss and gradients summed over the blocks in a fixed order (numpy's sums over the block axis)."""
    dt = np.dtype(Y.dtype)
    X, Y, y, u, M, lam = (_readonly(a, dt) for a in (X, Y, y, u, M, lam))
    G, B, T = Y.shape
    K, D = u.shape[1], u.shape[2]
    NB = -(-B // LANES)
    loss, glam = np.empty((G, K, NB), dt), np.empty((G, K, NB), dt)
    gM, gu = np.empty((G, K, NB, D, D), dt), np.empty((G, K, NB, D), dt)
    run_split(_readout_ir.readout_mse_kernel(D, dt), NB, X, Y, y, M, u, lam, loss, gM, gu, glam,
              threads=thread_count())
    return loss.sum(axis=-1), gM.sum(axis=2), gu.sum(axis=2), glam.sum(axis=-1)


def _readout_mse_call(X, Y, y, u, M, lam):
    G, K, D = u.shape
    dt = Y.dtype
    X, y, u, M, lam = (jnp.asarray(a, dt) for a in (X, y, u, M, lam))
    shapes = (jax.ShapeDtypeStruct((G, K), dt), jax.ShapeDtypeStruct((G, K, D, D), dt),
              jax.ShapeDtypeStruct((G, K, D), dt), jax.ShapeDtypeStruct((G, K), dt))
    return host_call(_host_readout_mse_shared, shapes, X, Y, y, u, M, lam, vmap_method="sequential")


@jax.custom_vjp
def readout_mse_shared(X: jax.Array, Y: jax.Array, y: jax.Array, u: jax.Array, M: jax.Array,
                       lam: jax.Array) -> jax.Array:
    """Each model's mean squared error of the one-layer read-out on the shared layout, with its gradient computed
    in the same pass (``iclab.ops.decayed_attention._readout_ir``; the experiments use it in float32, float64 is tested).

        ℓ_gk = (1/B) Σ_b (ŷ_gkb − y_gb)²,   ŷ_gkb = Σ_t λ_gk^{T-1-t} (u_gk · z_gbt)(c_gkb · z_gbt),   c_gkb = M_gk z_gbq,

    z_gbt = (x_bt, y_gbt), z_gbq = z_gb,T-1 the query: the loss of ``readout_grid_shared(X, Y, u, c, lam)`` with
    c = M z_q, to float32 rounding (tests compare them, and with ``gla_forget.gla_readout``). Differentiable in u,
    M and λ (custom VJP: the gradients come from the forward's kernel call, scaled by the loss's cotangent); X, Y
    and y are data (zero cotangents).

    Why: ``readout_grid_shared`` writes ŷ and the residuals H, J (2 × 40 MB at drift.fig1's paper batch) that XLA
    then contracts; this kernel keeps each model's values in registers and writes only per-block sums.

    Args:
        X: (B, T, D-1) inputs, shared by the G rows (the query last). Y: (G, B, T) labels (the query's 0).
        y: (G, B) targets. u: (G, K, D) value read-out rows (W_V)_{d+1,:}. M: (G, K, D, D) W^{KQ} = W_Kᵀ W_Q.
        lam: (G, K) forget factors.
    Returns:
        (G, K) losses, in Y's dtype.
    """
    return _readout_mse_call(X, Y, y, u, M, lam)[0]


def _mse_fwd(X, Y, y, u, M, lam):
    loss, gM, gu, glam = _readout_mse_call(X, Y, y, u, M, lam)
    return loss, (gM, gu, glam, X, Y, y)


def _mse_bwd(res, g):
    gM, gu, glam, X, Y, y = res
    return (jnp.zeros_like(X), jnp.zeros_like(Y), jnp.zeros_like(y), g[..., None] * gu, g[..., None, None] * gM,
            g * glam)


readout_mse_shared.defvjp(_mse_fwd, _mse_bwd)


# --------------------------------------------------------------------------------------------
# A full layer (every position): forward and backward kernels


def _layer_source(D: int, residual: bool = False, *, blocked: bool = False, grad_z: bool = True,
                  grad_lam: bool = True) -> str:
    """Forward and backward kernels of one GLA layer at every position, for tokens of width D (inner loops over D
    unrolled into scalars; the loops over prompts vectorise).

    forward, per prompt, t = 0..T-1:  q, k, v = W_Q z_t, W_K z_t, W_V z_t;  S ← λS + v kᵀ;  o_t = S q.
    backward, given the cotangents ō_t:
      pass 1 (t ascending): q, k, v and S_t again (q, k, v kept for pass 2); q̄_t = S_tᵀ ō_t; W̄_Q += q̄ zᵀ;
        z̄_t = W_Qᵀ q̄;
      pass 2 (t descending): E_t = S̄_{t+1} + λE_{t+1} (λ̄ += vᵀ E k); S̄_t = λS̄_{t+1} + ō_t qᵀ; v̄ = S̄ k, k̄ = S̄ᵀ v;
        W̄_K += k̄ zᵀ, W̄_V += v̄ zᵀ, z̄_t += W_Kᵀ k̄ + W_Vᵀ v̄.
    (λ̄ = Σ_t ⟨S̄_t, S_{t-1}⟩ = Σ_i v_iᵀ E_i k_i, E_i = Σ_{t>i} λ^{t-1-i} S̄_t.) Each block of CH prompts writes its
    own partial sums of W̄ and λ̄ (summed over blocks in order by the caller: no dependence on the thread count).

    Layouts: the tokens Z (B, T, D), whose blocks the kernels transpose into (T, D, CH) buffers and back; or
    ``blocked``, Z already as (⌈B/CH⌉, T, D, CH) (prompt b of block i in lane b, the last block padded with zero
    prompts, whose outputs and cotangents are zero), read and written in place. Without ``grad_z`` the backward
    skips z̄ (a layer on data: W_Qᵀ q̄ + W_Kᵀ k̄ + W_Vᵀ v̄ is 6TD² of its ≈ 34TD²) and leaves dZ alone; without
    ``grad_lam`` it skips E and λ̄ (4TD²) and writes λ̄ = 0.
    """
    F = range(D)
    zsum = lambda w: " + ".join(f"{w}{f} * z{f}" for f in F)  # noqa: E731
    lanes = "CH" if blocked else "n"
    head = [
        "    T = Z.shape[1]",
        f"    q = np.empty(({D}, CH), Z.dtype)",
        f"    k = np.empty(({D}, CH), Z.dtype)",
        f"    v = np.empty(({D}, CH), Z.dtype)",
        f"    S = np.empty(({D}, {D}, CH), Z.dtype)",
    ]
    if not blocked:
        head.append(f"    zb = np.empty((T, {D}, CH), Z.dtype)")
    start = ["    for blk in range(first, stop):"]
    if blocked:
        start.append("        zb = Z[blk]")
    else:
        # a block of prompts is read once, prompt by prompt (contiguous rows), into zb (T, D, CH); zt = zb[t]
        start += ["        b0 = blk * CH", "        n = min(CH, Z.shape[0] - b0)",
                  "        for b in range(n):", "            for t in range(T):", f"                for f in range({D}):",
                  "                    zb[t, f, b] = Z[b0 + b, t, f]"]
    load_z = ["            zt = zb[t]"]
    qkv = [
        f"            for e in range({D}):",
        *[f"                wq{f} = WQ[e, {f}]; wk{f} = WK[e, {f}]; wv{f} = WV[e, {f}]" for f in F],
        f"                for b in range({lanes}):",
        *[f"                    z{f} = zt[{f}, b]" for f in F],
        f"                    q[e, b] = {zsum('wq')}",
        f"                    k[e, b] = {zsum('wk')}",
        f"                    v[e, b] = {zsum('wv')}",
    ]
    out = " + ".join(f"s{f} * q[{f}, b]" for f in F)
    forward = [
        "def forward(Z, WQ, WK, WV, lam, O, first, stop):",
        *head,
        *([] if blocked else [f"    ob = np.empty((T, {D}, CH), Z.dtype)"]),
        *start,
        *(["        ob = O[blk]"] if blocked else []),
        "        S[:] = 0.0",
        "        for t in range(T):",
        *load_z, *qkv,
        f"            for e in range({D}):",
        "                Se = S[e]",
        f"                for b in range({lanes}):",
        "                    ve = v[e, b]",
        *[f"                    s{f} = lam * Se[{f}, b] + ve * k[{f}, b]; Se[{f}, b] = s{f}" for f in F],
        f"                    ob[t, e, b] = " + ("zt[e, b] + " if blocked and residual else "") + out,
    ]
    if not blocked:
        # written out prompt by prompt: contiguous rows of O (a store per (t, e) inside the loop above would
        # stride by T·D)
        forward += _blocked.store_lines(D, "O", "zb[t, e, b] + ob[t, e, b]" if residual else "ob[t, e, b]")
    # z̄ of a blocked layer is written in place, the residual ō added in pass 1; of a token layer kept in dzb and
    # written out (with ō) at the end
    res = "do[f, b] + " if blocked and residual else ""
    backward = [
        "def backward(Z, WQ, WK, WV, lam, dO, dZ, dW, dlam, first, stop):",
        *head,
        f"    E = np.empty(({D}, {D}, CH), Z.dtype)",
        f"    Qb = np.empty((T, {D}, CH), Z.dtype)",
        f"    Kb = np.empty((T, {D}, CH), Z.dtype)",
        f"    Vb = np.empty((T, {D}, CH), Z.dtype)",
        f"    gW = np.empty((3, {D}, {D}, CH), Z.dtype)",
        f"    dq = np.empty(({D}, CH), Z.dtype)",
        f"    dk = np.empty(({D}, CH), Z.dtype)",
        f"    dv = np.empty(({D}, CH), Z.dtype)",
        "    gl = np.zeros(CH, Z.dtype)",
        *([] if blocked else [f"    dzb = np.empty((T, {D}, CH), Z.dtype)", f"    dob = np.empty((T, {D}, CH), Z.dtype)"]),
        *start,
        *(["        dob = dO[blk]", *(["        dzb = dZ[blk]"] if grad_z else [])] if blocked else [
            "        for b in range(n):", "            for t in range(T):", f"                for f in range({D}):",
            "                    dob[t, f, b] = dO[b0 + b, t, f]"]),
        "        S[:] = 0.0",
        "        gW[:] = 0.0",
        "        gl[:] = 0.0",
        # pass 1: S_t forward, q̄_t = S_tᵀ ō_t; q, k, v kept for pass 2
        "        for t in range(T):",
        "            q = Qb[t]",
        "            k = Kb[t]",
        "            v = Vb[t]",
        *load_z, *qkv,
        "            do = dob[t]",
        "            dq[:] = 0.0",
        f"            for e in range({D}):",
        "                Se = S[e]",
        f"                for b in range({lanes}):",
        "                    ve = v[e, b]",
        "                    doe = do[e, b]",
        *[f"                    s{f} = lam * Se[{f}, b] + ve * k[{f}, b]; Se[{f}, b] = s{f}; dq[{f}, b] += s{f} * doe"
          for f in F],
        f"            for e in range({D}):",
        "                g = gW[0, e]",
        f"                for b in range({lanes}):",
        "                    x = dq[e, b]",
        *[f"                    g[{f}, b] += x * zt[{f}, b]" for f in F],
    ]
    if grad_z:
        backward += [
            f"            for f in range({D}):",
            *[f"                w{e} = WQ[{e}, f]" for e in F],
            f"                for b in range({lanes}):",
            f"                    dzb[t, f, b] = {res}" + " + ".join(f"w{e} * dq[{e}, b]" for e in F),
        ]
    backward += [
        # pass 2: S̄_t backward (S now holds S̄), E for λ̄
        "        S[:] = 0.0",
        *(["        E[:] = 0.0"] if grad_lam else []),
        "        for t in range(T - 1, -1, -1):",
        "            q = Qb[t]",
        "            k = Kb[t]",
        "            v = Vb[t]",
        *load_z,
        "            do = dob[t]",
        "            dk[:] = 0.0",
        f"            for e in range({D}):",
        "                Se = S[e]",
        *(["                Ee = E[e]"] if grad_lam else []),
        f"                for b in range({lanes}):",
        "                    ve = v[e, b]",
        "                    doe = do[e, b]",
        *([*[f"                    x{f} = Se[{f}, b] + lam * Ee[{f}, b]; Ee[{f}, b] = x{f}" for f in F],
           "                    gl[b] += ve * (" + " + ".join(f"x{f} * k[{f}, b]" for f in F) + ")"] if grad_lam else []),
        *[f"                    s{f} = lam * Se[{f}, b] + doe * q[{f}, b]; Se[{f}, b] = s{f}; dk[{f}, b] += s{f} * ve"
          for f in F],
        "                    dv[e, b] = " + " + ".join(f"s{f} * k[{f}, b]" for f in F),
        f"            for e in range({D}):",
        "                gk = gW[1, e]",
        "                gv = gW[2, e]",
        f"                for b in range({lanes}):",
        "                    xk = dk[e, b]",
        "                    xv = dv[e, b]",
        *[f"                    gk[{f}, b] += xk * zt[{f}, b]; gv[{f}, b] += xv * zt[{f}, b]" for f in F],
    ]
    if grad_z:
        backward += [
            f"            for f in range({D}):",
            *[f"                a{e} = WK[{e}, f]; c{e} = WV[{e}, f]" for e in F],
            f"                for b in range({lanes}):",
            "                    dzb[t, f, b] += " + " + ".join(f"a{e} * dk[{e}, b] + c{e} * dv[{e}, b]" for e in F),
        ]
        if not blocked:
            backward += _blocked.store_lines(D, "dZ", "dzb[t, e, b] + dob[t, e, b]" if residual
                                             else "dzb[t, e, b]")
    backward += [
        "        for i in range(3):",
        f"            for e in range({D}):",
        f"                for f in range({D}):",
        "                    acc = 0.0",
        f"                    for b in range({lanes}):",
        "                        acc += gW[i, e, f, b]",
        "                    dW[blk, i, e, f] = acc",
        "        acc = 0.0",
        f"        for b in range({lanes}):",
        "            acc += gl[b]",
        "        dlam[blk] = acc",
    ]
    return "\n".join(forward) + "\n\n\n" + "\n".join(backward)


@functools.cache
def _layer_kernels(D: int, residual: bool = False, *, blocked: bool = False, grad_z: bool = True,
                   grad_lam: bool = True):
    """(forward, backward) compiled for width D (on first call per dtype, a few seconds each); ``_layer_source``'s
    options (the forward depends on ``residual`` and ``blocked`` alone)."""
    lanes = LANES if blocked else CHUNK
    return compile_kernels(_layer_source(D, residual, blocked=blocked, grad_z=grad_z, grad_lam=grad_lam),
                           ["forward", "backward"],
                           label=f"iclab GLA layer kernels, D={D}{', blocked' if blocked else ''}",
                           constants={"CH": lanes}, fastmath=_FASTMATH, nogil=True, boundscheck=False)


#: Which kernels run float32 full layers on the blocked layout in ``multilayer_mse``: "llvm" (``_layer_ir``, the
#: faster) or "numba" (``_layer_source``, their twin in the tests). float64 always runs numba's: there the IR
#: kernels (16 doubles are two vector registers) are no faster.
FLOAT32_LAYERS = "llvm"


def _blocked_layer_kernels(D: int, dtype, *, grad_z: bool = True, grad_lam: bool = True):
    """(forward, backward) of a residual full layer on the blocked layout, for ``_model_mse``."""
    if np.dtype(dtype) == np.float32 and FLOAT32_LAYERS == "llvm":
        return _layer_ir.layer_kernels(D, True, np.float32, grad_z=grad_z, grad_lam=grad_lam)
    return _layer_kernels(D, True, blocked=True, grad_z=grad_z, grad_lam=grad_lam)


def _blocked_source(D: int) -> str:
    """The read-out kernel on the blocked layout Zb (⌈B/CH⌉, T, D, CH) of ``_layer_source`` (``iclab.ops._runtime.blocked``):
    one model's read-out at the query, its error and (with ``cot``) its token cotangents (``_host_multilayer_mse``). Per prompt, with a_t = u·z_t, s_t = c·z_t,
    w_t = λ^{T−1−t}, w'_t = (T−1−t)λ^{T−2−t}:

        ŷ = z_q[label] + c·H,  H = Σ_t w_t a_t z_t,  J = Σ_t w_t s_t z_t,  ŷ' = Σ_t w'_t a_t s_t,  err = ŷ − y,
        z̄_t = e w_t (a_t c + s_t u),  e = scale · err (the cotangent of ŷ),

    the cotangents computed block by block while the block's tokens are in cache. c, H, J, z̄ are blocked as the
    tokens ((⌈B/CH⌉, D, CH), ...), y, err, ŷ' as (⌈B/CH⌉, CH); spare lanes (zero tokens, y = 0) give zeros."""
    F = range(D)
    dot = lambda w: " + ".join(f"{w.format(f=f)} * z{f}" for f in F)  # noqa: E731
    loadz = [f"                z{f} = zt[{f}, b]" for f in F]
    return "\n".join([
        "def readout(Z, u, c, w, wp, y, scale, err, H, J, dy, dZ, cot, first, stop):",
        "    T = Z.shape[1]",
        # accumulators and the block's c in buffers of the kernel's own: with the outputs written in the hot loop,
        # LLVM could not rule out their aliasing the inputs and left the loop scalar
        f"    acc = np.empty(({2 * D + 1}, CH), Z.dtype)",
        f"    cl = np.empty(({D}, CH), Z.dtype)",
        "    el = np.empty(CH, Z.dtype)",
        f"    ot = np.empty(({D}, CH), Z.dtype)",
        *[f"    u{f} = u[{f}]" for f in F],
        "    for blk in range(first, stop):",
        "        zb = Z[blk]",
        f"        for f in range({D}):",
        "            for b in range(CH):",
        "                cl[f, b] = c[blk, f, b]",
        "        acc[:] = 0.0",
        "        for t in range(T):",
        "            zt = zb[t]",
        "            wt = w[t]",
        "            wpt = wp[t]",
        "            for b in range(CH):",
        *loadz,
        f"                a = {dot('u{f}')}",
        f"                s = {dot('cl[{f}, b]')}",
        "                wa = wt * a",
        "                ws = wt * s",
        *[f"                acc[{f}, b] += wa * z{f}; acc[{D + f}, b] += ws * z{f}" for f in F],
        f"                acc[{2 * D}, b] += wpt * a * s",
        "        for b in range(CH):",
        f"            e = zb[T - 1, {D - 1}, b] + (" + " + ".join(f"cl[{f}, b] * acc[{f}, b]" for f in F)
        + ") - y[blk, b]",
        "            err[blk, b] = e",
        "            el[b] = scale * e",
        f"            dy[blk, b] = acc[{2 * D}, b]",
        f"        for f in range({D}):",
        "            for b in range(CH):",
        "                H[blk, f, b] = acc[f, b]",
        f"                J[blk, f, b] = acc[{D} + f, b]",
        "        if not cot:",
        "            continue",
        # the read-out's token cotangents while the block is in cache: z̄_t = e w_t (a_t c + s_t u), e = scale·err
        "        dzb = dZ[blk]",
        "        for t in range(T):",
        "            zt = zb[t]",
        "            dt = dzb[t]",
        "            wt = w[t]",
        "            for b in range(CH):",
        *loadz,
        f"                a = {dot('u{f}')}",
        f"                s = {dot('cl[{f}, b]')}",
        "                x = el[b] * wt",
        *[f"                ot[{f}, b] = x * (a * cl[{f}, b] + s * u{f})" for f in F],
        f"            for f in range({D}):",
        "                for b in range(CH):",
        "                    dt[f, b] = ot[f, b]",
    ])


@functools.cache
def _blocked_kernels(D: int):
    """The read-out kernel of ``_blocked_source``, compiled for width D."""
    return compile_kernels(_blocked_source(D), ["readout"],
                           label=f"iclab GLA blocked read-out kernels, D={D}", constants={"CH": LANES},
                           fastmath=_FASTMATH, nogil=True, boundscheck=False)


def _to_blocks(Z: np.ndarray) -> np.ndarray:
    """Tokens (B, T, D) in the blocked layout (``_blocked.to_blocks``), the blocks split over the threads."""
    return _blocked.to_blocks(Z, threads=thread_count())


def _run_blocks(kernel, blocks: int, *args) -> None:
    """kernel(*args, first, stop) over blocks [0, blocks), split into contiguous runs, one per thread."""
    run_split(kernel, blocks, *args, threads=thread_count())


def _host_layer_forward(Z, WQ, WK, WV, lam, residual: bool = False):
    dt = Z.dtype
    Z, WQ, WK, WV = (_readonly(a, dt) for a in (Z, WQ, WK, WV))
    B, T, D = Z.shape
    O = np.empty_like(Z)
    _run_blocks(_layer_kernels(D, residual)[0], -(-B // CHUNK), Z, WQ, WK, WV, dt.type(lam), O)
    return O


def _host_layer_backward(Z, WQ, WK, WV, lam, dO, residual: bool = False):
    dt = Z.dtype
    Z, WQ, WK, WV, dO = (_readonly(a, dt) for a in (Z, WQ, WK, WV, dO))
    B, T, D = Z.shape
    blocks = -(-B // CHUNK)
    dZ = np.empty_like(Z)
    dW = np.empty((blocks, 3, D, D), dt)
    dlam = np.empty(blocks, dt)
    _run_blocks(_layer_kernels(D, residual)[1], blocks, Z, WQ, WK, WV, dt.type(lam), dO, dZ, dW, dlam)
    gW = dW.sum(axis=0)  # blocks in order
    return dZ, gW[0], gW[1], gW[2], dlam.sum()


@jax.custom_vjp
def _layer(Z, WQ, WK, WV, lam):
    dt = Z.dtype
    return host_call(_host_layer_forward, jax.ShapeDtypeStruct(Z.shape, dt), Z, WQ.astype(dt), WK.astype(dt),
                     WV.astype(dt), jnp.asarray(lam, dt), vmap_method="sequential")


def _layer_fwd(Z, WQ, WK, WV, lam):
    return _layer(Z, WQ, WK, WV, lam), (Z, WQ, WK, WV, lam)


def _layer_bwd(res, dO):
    Z, WQ, WK, WV, lam = res
    dt = Z.dtype
    B, T, D = Z.shape
    shapes = (jax.ShapeDtypeStruct(Z.shape, dt),) + (jax.ShapeDtypeStruct((D, D), dt),) * 3 + (
        jax.ShapeDtypeStruct((), dt),)
    dZ, gQ, gK, gV, gl = host_call(_host_layer_backward, shapes, Z, WQ.astype(dt), WK.astype(dt),
                                   WV.astype(dt), jnp.asarray(lam, dt), dO.astype(dt),
                                   vmap_method="sequential")
    return (dZ, gQ.astype(WQ.dtype), gK.astype(WK.dtype), gV.astype(WV.dtype),
            jnp.asarray(gl, jnp.result_type(lam)).reshape(jnp.shape(lam)))


_layer.defvjp(_layer_fwd, _layer_bwd)


def forget_layer(Z: jax.Array, WQ: jax.Array, WK: jax.Array, WV: jax.Array, lam) -> jax.Array:
    """Outputs o_t of one GLA layer with a forget factor at every position, by the compiled CPU kernels.

    o_t = S_t q_t, S_t = λ S_{t-1} + v_t k_tᵀ (q_t = W_Q z_t, k_t = W_K z_t, v_t = W_V z_t), in the recurrent form:
    O(T D²) work per prompt and no (T, T) matrix. Differentiable in the weights, λ and the tokens (a custom VJP
    whose backward runs the recurrence forward for q̄ and backward for k̄, v̄; see ``_layer_source``).

    Args:
        Z: (B, T, D) tokens (any leading axes are flattened into B).
        WQ, WK, WV: (D, D) projections.
        lam: forget factor λ (a scalar).
    Returns:
        O: Z's shape.
    """
    lead = Z.shape[:-2]
    O = _layer(Z.reshape((-1,) + Z.shape[-2:]), WQ, WK, WV, lam)
    return O.reshape(lead + Z.shape[-2:])


# --------------------------------------------------------------------------------------------
# A whole L-layer model's loss in one host call


def _host_multilayer_mse(Z, WQ, WK, WV, lam, y, grad: bool = True, grad_lam: bool = True):
    """numpy side of :func:`multilayer_mse`: (loss, W̄_Q, W̄_K, W̄_V (..., L, D, D), λ̄) of models on their batches
    (the gradients zero without ``grad``, λ̄ zero without ``grad_lam``).

    Leading axes (a vmap's, by ``expand_dims``: size 1 where the models share an operand, as the models of a row
    share its tokens) broadcast: the models are computed in turn, and each token array is put in the blocked
    layout once (``_to_blocks``) for all the models that read it."""
    dt = np.dtype(Z.dtype)
    Z, WQ, WK, WV, y = (_readonly(a, dt) for a in (Z, WQ, WK, WV, y))
    lam = np.asarray(lam, dt)
    core = {"Z": 3, "W": 3, "lam": 0, "y": 1}
    lead = np.broadcast_shapes(Z.shape[:-3], WQ.shape[:-3], WK.shape[:-3], WV.shape[:-3], lam.shape, y.shape[:-1])
    L, D = WQ.shape[-3], Z.shape[-1]
    out = (np.empty(lead, dt),) + tuple(np.empty(lead + (L, D, D), dt) for _ in range(3)) + (np.empty(lead, dt),)

    def at(a, idx, k):  # a's entry for the model at idx (a size-1 or missing leading axis: shared)
        a = a.reshape((1,) * (len(lead) + k - a.ndim) + a.shape)
        return a[tuple(i if n > 1 else 0 for i, n in zip(idx, a.shape[:len(lead)]))]

    last, Zb = None, None
    for idx in np.ndindex(*lead):
        Zi = at(Z, idx, core["Z"])
        if last is None or Zi.__array_interface__["data"][0] != last:
            last, Zb = Zi.__array_interface__["data"][0], _to_blocks(Zi)
        res = _model_mse(Zb, Zi.shape[0], at(WQ, idx, 3), at(WK, idx, 3), at(WV, idx, 3), at(lam, idx, 0),
                         at(y, idx, 1), grad, grad_lam)
        for o, r in zip(out, res):
            o[idx] = r
    return out


def _model_mse(Zb, B: int, WQ, WK, WV, lam, y, grad: bool, grad_lam: bool):
    """One model of :func:`_host_multilayer_mse` on its tokens in the blocked layout Zb (B prompts).

    Forward: Z_{l+1} = Z_l + GLA_l(Z_l) for the L − 1 full layers (the layer kernel), ŷ = Z_L[q, label] +
    Σ_t λ^{T−1−t} (u·z_t)(c·z_t) with u = (W_V)_{label,:}, c = W_Kᵀ W_Q z_q (the read-out kernel, which also gives
    H = ∂ŷ/∂c, J = ∂ŷ/∂u and ∂ŷ/∂λ). With e = 2(ŷ − y)/B: ū = Σ e J, c̄ = e H (then W̄_K = Σ_b q c̄ᵀ, q̄ = W_K c̄,
    W̄_Q = Σ_b q̄ z_qᵀ), and the read-out's token cotangents z̄_t = e λ^{T−1−t} ((u·z_t) c + (c·z_t) u), plus W_Qᵀ q̄ at
    the query and e at its label slot (the residual); then each layer's backward kernel, last to first, adding the
    residual path (Z̄_l = Z̄_{l+1} + the layer's input cotangent). The first layer reads data: its input cotangent
    is not computed."""
    dt = Zb.dtype
    lam = dt.type(lam)
    L = WQ.shape[0]
    _, T, D, _ = Zb.shape
    fwd, _ = _blocked_layer_kernels(D, dt)
    readout = _blocked_kernels(D)[0]
    Zs = [Zb]
    nb = Zb.shape[0]
    for l in range(L - 1):
        Zs.append(_blocked.aligned_empty(Zs[0].shape, dt))
        _run_blocks(fwd, nb, Zs[-2], WQ[l], WK[l], WV[l], lam, Zs[-1])
    ZL = Zs[-1]
    zq = _blocked.unlanes(ZL[:, -1], B)  # (B, D) query tokens
    q = zq @ WQ[-1].T  # q = W_Q z_q
    c = q @ WK[-1]  # c = W_Kᵀ q
    u = np.ascontiguousarray(WV[-1][-1])
    w = (lam ** np.arange(T - 1, -1, -1, dtype=np.float64)).astype(dt)
    wp = (np.arange(T - 1, -1, -1) * lam ** np.arange(T - 2, -2, -1, dtype=np.float64)).astype(dt)
    wp[-1] = 0.0
    cb = _blocked.lanes(c, nb)
    err, H, J, dy = (np.empty((nb, LANES), dt), np.empty((nb, D, LANES), dt), np.empty((nb, D, LANES), dt),
                     np.empty((nb, LANES), dt))
    cot = grad and L > 1
    dZ = _blocked.aligned_empty(ZL.shape, dt) if cot else ZL[:0]
    _run_blocks(readout, nb, ZL, u, cb, w, wp, _blocked.lanes(y, nb), dt.type(2.0 / B), err, H, J, dy, dZ, cot)
    err = _blocked.unlanes(err, B)
    loss = np.mean(err * err, dtype=dt)
    gWQ, gWK, gWV = np.zeros((L, D, D), dt), np.zeros((L, D, D), dt), np.zeros((L, D, D), dt)
    if not grad:
        return loss, gWQ, gWK, gWV, dt.type(0.0)
    e = (2.0 / B) * err
    H, J = _blocked.unlanes(H, B), _blocked.unlanes(J, B)
    gWV[-1, -1] = e @ J
    gc = e[:, None] * H
    gWK[-1] = q.T @ gc
    gq = gc @ WK[-1].T  # q̄ = W_K c̄
    gWQ[-1] = gq.T @ zq
    glam = e @ _blocked.unlanes(dy, B) if grad_lam else dt.type(0.0)
    if L == 1:
        return loss, gWQ, gWK, gWV, dt.type(glam)
    dZ[:, -1] += _blocked.lanes(gq @ WQ[-1], nb)
    dZ[:, -1, -1] += _blocked.lanes(e, nb)
    dW = np.empty((nb, 3, D, D), dt)
    dlam = np.empty(nb, dt)
    for l in range(L - 2, -1, -1):  # the layer kernel adds the residual path: Z̄_l = Z̄_{l+1} + its input cotangent
        bwd = _blocked_layer_kernels(D, dt, grad_z=l > 0, grad_lam=grad_lam)[1]
        dZin = _blocked.aligned_empty(ZL.shape, dt) if l > 0 else dZ  # layer 0 leaves it alone
        _run_blocks(bwd, nb, Zs[l], WQ[l], WK[l], WV[l], lam, dZ, dZin, dW, dlam)
        gW = dW.sum(axis=0)  # blocks in order
        gWQ[l], gWK[l], gWV[l] = gW
        glam = glam + dlam.sum()
        dZ = dZin
    return loss, gWQ, gWK, gWV, dt.type(glam)


def _multilayer_call(Z, WQ, WK, WV, lam, y, grad: bool, grad_lam: bool):
    dt = Z.dtype
    L, D = WQ.shape[0], Z.shape[-1]
    shapes = (jax.ShapeDtypeStruct((), dt),) + (jax.ShapeDtypeStruct((L, D, D), dt),) * 3 + (
        jax.ShapeDtypeStruct((), dt),)
    return host_call(functools.partial(_host_multilayer_mse, grad=grad, grad_lam=grad_lam), shapes, Z,
                     WQ.astype(dt), WK.astype(dt), WV.astype(dt), jnp.asarray(lam, dt), y.astype(dt),
                     vmap_method="expand_dims")


@jax.custom_vjp
def _multilayer(Z, WQ, WK, WV, lam, y):
    return _multilayer_call(Z, WQ, WK, WV, lam, y, grad=False, grad_lam=False)[0]  # the loss alone


def _multilayer_fwd(Z, WQ, WK, WV, lam, y):
    # symbolic zeros: each primal says whether it is differentiated; λ̄ is computed only where λ is (a fixed λ is
    # most uses: 4TD² of a layer's ≈ 30TD² backward)
    grad_lam = bool(lam.perturbed)
    Z, WQ, WK, WV, lam, y = (a.value for a in (Z, WQ, WK, WV, lam, y))
    loss, gQ, gK, gV, gl = _multilayer_call(Z, WQ, WK, WV, lam, y, grad=True, grad_lam=grad_lam)
    return loss, (gQ, gK, gV, gl, Z, WQ, WK, WV, lam, y)


def _multilayer_bwd(res, ct):
    gQ, gK, gV, gl, Z, WQ, WK, WV, lam, y = res
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
        ct = jnp.zeros((), gQ.dtype)
    return (jnp.zeros_like(Z), (ct * gQ).astype(WQ.dtype), (ct * gK).astype(WK.dtype), (ct * gV).astype(WV.dtype),
            jnp.asarray(ct * gl, jnp.result_type(lam)).reshape(jnp.shape(lam)), jnp.zeros_like(y))


_multilayer.defvjp(_multilayer_fwd, _multilayer_bwd, symbolic_zeros=True)


def multilayer_mse(Z: jax.Array, y: jax.Array, WQ: jax.Array, WK: jax.Array, WV: jax.Array, lam) -> jax.Array:
    """Mean squared error of an L-layer residual GLA (``gla_forget.predict_multilayer``) on one batch, whole model
    in one host call: the L − 1 full layers by the layer kernels, the read-out at the query by the read-out kernel,
    and the backward pass through them (``_host_multilayer_mse``), so that no layer's (B, T, D) tokens cross
    between XLA and the host. Differentiable in the weights and λ (a custom VJP whose forward computes the
    gradient too; λ̄ only where λ is differentiated, the first layer's token cotangent never); Z and y are data.

    Inside, the tokens are put once in a blocked layout (blocks of 16 prompts, prompt-minor: every kernel reads
    and writes its block in place instead of transposing it). vmapped over models, the models are one host call
    (``expand_dims``): models that share their tokens (a row of a grid) share that layout too.

    Args:
        Z: (B, T, D) tokens, the query last; y: (B,) targets.
        WQ, WK, WV: (L, D, D) projections of the L layers.
        lam: forget factor shared by the layers (a scalar).
    Returns:
        The scalar loss mean((ŷ − y)²), in Z's dtype.
    """
    return _multilayer(Z, WQ, WK, WV, jnp.asarray(lam), y)
