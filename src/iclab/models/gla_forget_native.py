"""The one-layer GLA read-out of a grid of models on shared prompts, as a compiled CPU kernel (numba).

For models k = 1..K of row g (one forget factor λ_gk each) on the prompts Z_g (B, T, D) of that row,

    ŷ_gkb = Σ_t w_t a_t s_t,   a_t = u_gk · z_gbt,   s_t = c_gkb · z_gbt,   w_t = λ_gk^{T-1-t},

with u = (W_V)_{d+1,:} (the label row of the values) and c = W_Kᵀ W_Q z_q (the query seen through the
keys): :func:`iclab.models.gla_forget.gla_readout`, the naive twin this kernel is tested against. ŷ is
bilinear in (u, c), so ONE pass over the tokens gives it and every residual of its gradient:

    H_gkb = Σ_t w_t a_t z_t = ∂ŷ/∂c,   J_gkb = Σ_t w_t s_t z_t = ∂ŷ/∂u,   ŷ'_gkb = Σ_t w'_t a_t s_t = ∂ŷ/∂λ,

w'_t = (T-1-t) λ^{T-2-t}; then ŷ = c · H, and the backward pass (in JAX) is three contractions with the
cotangent g_gkb: ∂/∂u = Σ_b g J, ∂/∂c = g H, ∂/∂λ = Σ_b g ŷ'. The gradient of W_Q, W_K flows on through c.

Why a kernel: XLA:CPU runs these contractions (T = 101 by D = 11, batched over prompts and models) at
1-2 GFLOP/s on this machine, a few per cent of its matmul peak. The kernel takes a block of prompts of one
row, transposes it prompt-minor into a buffer that stays in cache for the K models of the row, and
vectorises over the prompts of the block (the loops over D unrolled into scalars, as in
:mod:`iclab.engines.moments_native`). Each output is summed by one thread in a fixed order, so the result
does not depend on the thread count. It runs inside jitted JAX code through ``jax.pure_callback`` (CPU
only; a GPU run would copy to the host every step: use the XLA form there).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.threads import thread_count

__all__ = ["readout_grid"]

#: Prompts per block: the block's tokens (T·D·CH floats) stay in the L2 cache while the K models of its row pass.
CHUNK = 64

# Reassociation and FMA contraction let LLVM vectorise over the prompts of a block (no 'nnan'/'ninf': a
# diverging run gives NaN and inf as the XLA form does).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _source(D: int) -> str:
    """Kernel source for tokens of width D (the loops over D unrolled into scalar variables)."""
    dz = range(D)
    lines = [
        "def kernel(Z, u, c, lam, yhat, H, J, dy, first, stop):",
        "    G, B, T, _ = Z.shape",
        "    K = u.shape[1]",
        "    nblocks = (B + CH - 1) // CH",
        "    for job in range(first, stop):",
        "        g = job // nblocks",
        "        b0 = (job % nblocks) * CH",
        "        n = min(CH, B - b0)",
        f"        zb = np.zeros((T, {D}, CH), Z.dtype)",
        f"        cb = np.zeros(({D}, CH), Z.dtype)",
        f"        acc = np.empty(({2 * D + 1}, CH), Z.dtype)",
        "        w = np.empty(T, Z.dtype)",
        "        wp = np.empty(T, Z.dtype)",
        "        for b in range(n):",
        "            for t in range(T):",
        f"                for e in range({D}):",
        "                    zb[t, e, b] = Z[g, b0 + b, t, e]",
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
    return "\n".join(lines)


@functools.cache
def _kernel(D: int):
    """The compiled kernel for width D (compiled on first call per dtype, ~3 s): jobs [first, stop) of the G × ⌈B/CH⌉
    blocks. Serial code (numba's parallel mode doubles the compile time); threads split the jobs (``_host_forward``)."""
    import numba

    namespace = {"np": np, "CH": CHUNK}
    exec(compile(_source(D), f"<iclab GLA read-out kernel, D={D}>", "exec"), namespace)
    return numba.njit(fastmath=_FASTMATH, nogil=True, boundscheck=False)(namespace["kernel"])


def _readonly(a, dtype) -> np.ndarray:
    """A read-only C-contiguous view: numba types writable and read-only arrays apart, and the callback's arrays
    come either way, so one form gives one compiled signature per dtype."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


def _host_forward(Z, u, c, lam):
    """numpy side of the callback: (ŷ, H, J, ŷ') of one grid."""
    Z, u, c, lam = (_readonly(a, Z.dtype) for a in (Z, u, c, lam))
    G, B, T, D = Z.shape
    K = u.shape[1]
    yhat = np.empty((G, K, B), Z.dtype)
    dy = np.empty((G, K, B), Z.dtype)
    H = np.empty((G, K, B, D), Z.dtype)
    J = np.empty((G, K, B, D), Z.dtype)
    kernel = _kernel(D)
    jobs = G * -(-B // CHUNK)
    threads = max(1, min(thread_count(), jobs))
    bounds = [jobs * i // threads for i in range(threads + 1)]
    if threads == 1:
        kernel(Z, u, c, lam, yhat, H, J, dy, 0, jobs)
    else:  # the kernel releases the GIL; each thread owns a contiguous run of blocks (and their outputs)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: kernel(Z, u, c, lam, yhat, H, J, dy, bounds[i], bounds[i + 1]), range(threads)))
    return yhat, H, J, dy


def _forward(Z, u, c, lam):
    G, B, T, D = Z.shape
    K = u.shape[1]
    dt = Z.dtype
    shapes = (jax.ShapeDtypeStruct((G, K, B), dt), jax.ShapeDtypeStruct((G, K, B, D), dt),
              jax.ShapeDtypeStruct((G, K, B, D), dt), jax.ShapeDtypeStruct((G, K, B), dt))
    u, c, lam = (jnp.asarray(a, dt) for a in (u, c, lam))
    return jax.pure_callback(_host_forward, shapes, Z, u, c, lam, vmap_method="sequential")


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


def _fwd(Z, u, c, lam):
    yhat, H, J, dy = _forward(Z, u, c, lam)
    return yhat, (H, J, dy, Z, u, c, lam)


def _bwd(res, g):
    H, J, dy, Z, u, c, lam = res
    return (jnp.zeros_like(Z), jnp.einsum("gkb,gkbd->gkd", g, J).astype(u.dtype),
            (g[..., None] * H).astype(c.dtype), jnp.einsum("gkb,gkb->gk", g, dy).astype(lam.dtype))


readout_grid.defvjp(_fwd, _bwd)
