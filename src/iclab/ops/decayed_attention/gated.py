"""Compiled CPU kernels (numba; in float32 their LLVM IR twins, ``FLOAT32_LAYERS``) for training grids of gated
linear attention models (:mod:`iclab.models.gla`).

- :func:`query_mse_grid`: the training loss of a grid of one-layer models read at the query, and its gradient;
- :func:`gated_layer`: a full scalar-gated layer at every position, forward and backward;
- :func:`multilayer_mse_grid`: the loss of a grid of L-layer residual models (eq 25), each model's whole forward
  and backward pass in the host call (the layer kernels, then the query loss kernel with token cotangents).

The query loss kernel, in detail:

For member m of a grid, reading prompt row r_m of a token tensor Z (R, B, T_max, D) cut to the token positions
``positions[g, :lengths[g]]`` of its prompt length g (the query last), with its own weights θ_mg, the kernel
computes the mean squared error over the B prompts and its gradient in every weight:

    ℓ_mg = (1/B) Σ_b (ŷ_mgb − y_rb)²,   ŷ = Σ_t ω_t s_t v_t  (scalar or no gates, label read-out)
                                        ŷ = Σ_t s_t Σ_r h_r ω_tr v_tr  (vector gates, head h),

with s_t = k_tᵀ q_T = z_tᵀ c, c = W_K W_Qᵀ z_T (the query seen through the keys), v_t = W_Vᵀ z_t (its label
coordinate without a head), and the query weights ω_t = Π_{u>t} φ(w_gᵀ z_u) (scalar), ω_tr = Π_{u>t} φ(W_g z_u)_r
(vector), ω ≡ 1 without gates: :func:`iclab.models.gla.predict_last`, the XLA form this kernel is tested
against. Per prompt (a block of CH prompts at a time; with scalar or no gates prompt-minor, so that the loops
over prompts vectorise; with vector gates token-major rows, so that the D² work is four BLAS products):

- forward, t ascending: s_t, v_t and the gates φ and 1 − φ = φ(−a) (kept); t descending: ω and ŷ;
- e = 2(ŷ − y)/B, the loss's derivative in ŷ;
- backward, t ascending, with the prefix sums P_t = Σ_{j<t} ℓ_j of the contributions ℓ_j = ω_j s_j v_j, since
  ∂ŷ/∂log φ_t = P_t and ∂log φ(a)/∂a = φ(−a): c̄ += e ω_t v_t z_t, v̄ = e ω_t s_t (W̄_V += v̄ z_tᵀ),
  w̄_g += e φ(−a_t) P_t z_t (per gate row for vector gates), h̄ += e ω_t v_t s_t; then W̄_K = Σ_b c̄ qᵀ,
  W̄_Q = Σ_b z_T (W_Kᵀ c̄)ᵀ.

O(T·D) per prompt with scalar or no gates, O(T·D²) with vector gates, and no (T, T) matrix. Each block of
prompts writes its own partial sums (summed over blocks in a fixed order by the caller), so the result does not
depend on the thread count. The loss is a custom VJP whose forward computes the gradient too (training always
needs both); it runs inside jitted JAX code through ``jax.pure_callback`` (CPU only: on a GPU use the XLA form).

Why a kernel: in XLA these contractions (T ≤ 103 by D = 16, batched over 256 prompts and thousands of models)
are a sequence of passes over the token tensor, memory bound, and the query weights cost a (T, T) product;
in gating.fig1's paper step the vector-gated models cost the most (``iclab bench gating``).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime.host import host_call
from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime import blocked as _blocked
from iclab.ops.decayed_attention import _layer_ir
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["gated_layer", "multilayer_mse_grid", "multilayer_mse_grids", "query_mse_grid", "subsequence_positions"]

#: Prompts per block: the block's tokens and per-token buffers stay in cache (T_max·D·CH floats each).
CHUNK = 32

# Reassociation and FMA contraction let LLVM vectorise over the prompts of a block (no 'nnan'/'ninf': a
# diverging run gives NaN and inf as the XLA form does).
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _gating(weights) -> str:
    """Which gate a layer's weights carry: ``scalar`` (``w_g``, (D,)), ``vector`` (``W_g``, (D, D)) or ``none``."""
    return "scalar" if "w_g" in weights else "vector" if "W_g" in weights else "none"


def subsequence_positions(keep: list) -> tuple[np.ndarray, np.ndarray]:
    """Pads lists of token positions into the (G, T_max) positions and (G,) lengths the kernel reads.

    Args:
        keep: G increasing sequences of token positions, each ending with the query's.
    Returns:
        (positions (G, T_max) int64, zero-padded; lengths (G,) int64).
    """
    T = max(len(k) for k in keep)
    pos = np.zeros((len(keep), T), dtype=np.int64)
    for g, k in enumerate(keep):
        k = np.asarray(k, dtype=np.int64)
        if k.size == 0 or np.any(np.diff(k) <= 0) or k[0] < 0:
            raise ValueError("each prompt's positions must be a nonempty increasing sequence of indices >= 0")
        pos[g, :k.size] = k
    return pos, np.asarray([len(k) for k in keep], dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Kernels (source generated per token width D: loops over D have a constant trip count)

_COMMON = """
def kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv, gg, gh, dZ, first, stop):
    S_, R, B, Tmax, _ = Z.shape
    M = rows.shape[0]
    G = lens.shape[0]
    NB = (B + CH - 1) // CH
    dt = Z.dtype
    one = F(1.0)
    two_inv_B = F(2.0) / F(B)
    inv_B = one / F(B)
    zb = np.empty((Tmax, D, CH), dt)
    st = np.empty((Tmax, CH), dt)
    q = np.empty((D, CH), dt)
    c = np.empty((D, CH), dt)
    dc = np.empty((D, CH), dt)
    dq = np.empty((D, CH), dt)
    yh = np.empty(CH, dt)
    e = np.empty(CH, dt)
    xc = np.empty(CH, dt)
{buffers}
    for job in range(first, stop):
        blk = job % NB
        g = (job // NB) % G
        m = (job // (NB * G)) % M
        s = job // (NB * G * M)
        b0 = blk * CH
        n = min(CH, B - b0)
        T = lens[g]
        r = rows[m]
        rz = r % R  # Z may hold one row shared by every row of y
        for b in range(n):
            for t in range(T):
                p = pos[g, t]
                for f in range(D):
                    zb[t, f, b] = Z[s, rz, b0 + b, p, f]
        zq = zb[T - 1]
        # q = W_Qᵀ z_T, c = W_K q: s_t = z_tᵀ c
        q[:, :n] = 0.0
        for f in range(D):
            for j in range(D):
                w = Wq[s, m, g, f, j]
                for b in range(n):
                    q[j, b] += w * zq[f, b]
        c[:, :n] = 0.0
        for f in range(D):
            for j in range(D):
                w = Wk[s, m, g, f, j]
                for b in range(n):
                    c[f, b] += w * q[j, b]
{body}
        # W̄_K = Σ_b c̄ qᵀ, q̄ = W_Kᵀ c̄, W̄_Q = Σ_b z_T q̄ᵀ
        dq[:, :n] = 0.0
        for f in range(D):
            for j in range(D):
                w = Wk[s, m, g, f, j]
                acc = F(0.0)
                for b in range(n):
                    acc += dc[f, b] * q[j, b]
                    dq[j, b] += w * dc[f, b]
                gk[s, m, g, blk, f, j] = acc
        for f in range(D):
            for j in range(D):
                acc = F(0.0)
                for b in range(n):
                    acc += zq[f, b] * dq[j, b]
                gq[s, m, g, blk, f, j] = acc
        if RESIDUAL:  # the query's token cotangent through q and c, and the residual read-out's label slot
            for b in range(n):
                for f in range(D):
                    a = F(0.0)
                    for j in range(D):
                        a += Wq[s, m, g, f, j] * dq[j, b]
                    dZ[s, m, g, b0 + b, T - 1, f] += a
                dZ[s, m, g, b0 + b, T - 1, label] += e[b]
"""

# Scalar gates (GATED) or none, label read-out: ŷ = Σ_t ω_t s_t v_t, v_t = z_tᵀ (W_V)_{:,label}.
_SCALAR_BUFFERS = """
    vt = np.empty((Tmax, CH), dt)
    gt = np.empty((Tmax, CH), dt)
    sm = np.empty((Tmax, CH), dt)
    om = np.empty((Tmax, CH), dt)
    at = np.empty(CH, dt)
    ob = np.empty(CH, dt)
    pre = np.empty(CH, dt)
    xu = np.empty(CH, dt)
    xw = np.empty(CH, dt)
    du = np.empty((D, CH), dt)
    dw = np.empty((D, CH), dt)
    u = np.empty(D, dt)
    wg = np.empty(D, dt)
"""

_SCALAR_BODY = """
        for f in range(D):
            u[f] = Wv[s, m, g, f, label]
            wg[f] = Wg[s, m, g, f]
        for t in range(T):
            zt = zb[t]
            st[t, :n] = 0.0
            vt[t, :n] = 0.0
            at[:n] = 0.0
            for f in range(D):
                uf = u[f]
                wf = wg[f]
                for b in range(n):
                    z = zt[f, b]
                    st[t, b] += c[f, b] * z
                    vt[t, b] += uf * z
                    at[b] += wf * z
            if GATED:
                for b in range(n):
                    a = at[b]
                    x = np.exp(-abs(a))
                    den = one / (one + x)
                    if a >= 0:
                        gt[t, b] = den
                        sm[t, b] = x * den
                    else:
                        gt[t, b] = x * den
                        sm[t, b] = den
        ob[:n] = one
        for b in range(n):  # a residual read-out adds the query's label slot: ŷ = z_T[label] + (o_T)[label]
            yh[b] = zq[label, b] if RESIDUAL else F(0.0)
        for t in range(T - 1, -1, -1):
            for b in range(n):
                om[t, b] = ob[b]
                yh[b] += ob[b] * st[t, b] * vt[t, b]
                if GATED:
                    ob[b] *= gt[t, b]
        lsum = F(0.0)
        for b in range(n):
            err = yh[b] - y[s, r, b0 + b]
            lsum += err * err
            e[b] = two_inv_B * err
        loss[s, m, g, blk] = lsum * inv_B
        dc[:, :n] = 0.0
        du[:, :n] = 0.0
        dw[:, :n] = 0.0
        pre[:n] = 0.0
        for t in range(T):
            zt = zb[t]
            for b in range(n):
                eo = e[b] * om[t, b]
                xc[b] = eo * vt[t, b]
                xu[b] = eo * st[t, b]
                if GATED:
                    xw[b] = e[b] * sm[t, b] * pre[b]
                    pre[b] += om[t, b] * st[t, b] * vt[t, b]
            for f in range(D):
                for b in range(n):
                    z = zt[f, b]
                    dc[f, b] += xc[b] * z
                    du[f, b] += xu[b] * z
                    if GATED:
                        dw[f, b] += xw[b] * z
            if RESIDUAL:  # token cotangents: through s_t = z_tᵀc, v_t = z_tᵀu and the gate logit z_tᵀw_g
                for b in range(n):
                    for f in range(D):
                        dZ[s, m, g, b0 + b, t, f] = xc[b] * c[f, b] + xu[b] * u[f] + (xw[b] * wg[f] if GATED else F(0.0))
        for f in range(D):
            a1 = F(0.0)
            a2 = F(0.0)
            for b in range(n):
                a1 += du[f, b]
                a2 += dw[f, b]
            gv[s, m, g, blk, f, 0] = a1
            gg[s, m, g, blk, f] = a2
"""

# Vector gates φ(W_g z)_r and a head h: ŷ = Σ_t s_t Σ_r h_r ω_tr v_tr. The D² work per token (values, gate logits
# and their two weight gradients) is four matrix products over the block's T·n (token, prompt) rows, done by BLAS
# (np.dot); the recurrences over t run on rows of D gates.
_VECTOR_KERNEL = """
def kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv, gg, gh, dZ, first, stop):
    S_, R, B, Tmax, _ = Z.shape
    M = rows.shape[0]
    G = lens.shape[0]
    NB = (B + CH - 1) // CH
    dt = Z.dtype
    one = F(1.0)
    two_inv_B = F(2.0) / F(B)
    inv_B = one / F(B)
    zr = np.empty((Tmax * CH, D), dt)
    V = np.empty((Tmax * CH, D), dt)
    L = np.empty((Tmax * CH, D), dt)
    SM = np.empty((Tmax * CH, D), dt)
    XV = np.empty((Tmax * CH, D), dt)
    XG = np.empty((Tmax * CH, D), dt)
    st = np.empty(Tmax * CH, dt)
    xc = np.empty(Tmax * CH, dt)
    q = np.empty((CH, D), dt)
    c = np.empty((CH, D), dt)
    dc = np.empty((CH, D), dt)
    dq = np.empty((CH, D), dt)
    ob = np.empty((CH, D), dt)
    ya = np.empty((CH, D), dt)
    pre = np.empty((CH, D), dt)
    dh = np.empty((CH, D), dt)
    e = np.empty(CH, dt)
    hh = np.empty(D, dt)
    WgT = np.empty((D, D), dt)
    for job in range(first, stop):
        blk = job % NB
        g = (job // NB) % G
        m = (job // (NB * G)) % M
        s = job // (NB * G * M)
        b0 = blk * CH
        n = min(CH, B - b0)
        T = lens[g]
        r = rows[m]
        rz = r % R  # Z may hold one row shared by every row of y
        N = T * n
        # rows i = t·n + b (token-major), features contiguous
        for b in range(n):
            for t in range(T):
                p = pos[g, t]
                i = t * n + b
                for f in range(D):
                    zr[i, f] = Z[s, rz, b0 + b, p, f]
        Wvm = np.ascontiguousarray(Wv[s, m, g])
        for j in range(D):
            hh[j] = h[s, m, g, j]
            for f in range(D):
                WgT[f, j] = Wg[s, m, g, j, f]
        Wqm = Wq[s, m, g]
        Wkm = Wk[s, m, g]
        # q = W_Qᵀ z_T, c = W_K q per prompt
        for b in range(n):
            i = (T - 1) * n + b
            for j in range(D):
                a = F(0.0)
                for f in range(D):
                    a += zr[i, f] * Wqm[f, j]
                q[b, j] = a
            for f in range(D):
                a = F(0.0)
                for j in range(D):
                    a += Wkm[f, j] * q[b, j]
                c[b, f] = a
        np.dot(zr[:N], Wvm, V[:N])
        np.dot(zr[:N], WgT, L[:N])
        for i in range(N):
            b = i % n
            a = F(0.0)
            for f in range(D):
                a += zr[i, f] * c[b, f]
            st[i] = a
            for j in range(D):
                a = L[i, j]
                x = np.exp(-abs(a))
                den = one / (one + x)
                L[i, j] = den if a >= 0 else x * den
                SM[i, j] = x * den if a >= 0 else den
        # descending: ω (kept in XV until the backward pass overwrites it) and ŷ
        ob[:n] = one
        ya[:n] = 0.0
        for t in range(T - 1, -1, -1):
            for b in range(n):
                i = t * n + b
                sv = st[i]
                for j in range(D):
                    o = ob[b, j]
                    XV[i, j] = o
                    ya[b, j] += o * V[i, j] * sv
                    ob[b, j] = o * L[i, j]
        lsum = F(0.0)
        for b in range(n):
            a = F(0.0)
            for j in range(D):
                a += hh[j] * ya[b, j]
            err = a - y[s, r, b0 + b]
            lsum += err * err
            e[b] = two_inv_B * err
        loss[s, m, g, blk] = lsum * inv_B
        # ascending: prefix sums P of the contributions h_r ω v s, and the rows' cotangents
        pre[:n] = 0.0
        dh[:n] = 0.0
        dc[:n] = 0.0
        for t in range(T):
            for b in range(n):
                i = t * n + b
                eb = e[b]
                sv = st[i]
                a = F(0.0)
                for j in range(D):
                    o = XV[i, j]
                    ov = o * V[i, j]
                    a += hh[j] * ov
                    dh[b, j] += ov * sv
                    XG[i, j] = eb * SM[i, j] * pre[b, j]
                    pre[b, j] += hh[j] * ov * sv
                    XV[i, j] = eb * hh[j] * o * sv
                xc[i] = eb * a
        for i in range(N):
            b = i % n
            a = xc[i]
            for f in range(D):
                dc[b, f] += a * zr[i, f]
        zT = zr[:N].T
        gv[s, m, g, blk] = np.dot(zT, XV[:N])
        gg[s, m, g, blk] = np.dot(XG[:N].T, zr[:N])
        for j in range(D):
            a = F(0.0)
            for b in range(n):
                a += e[b] * dh[b, j]
            gh[s, m, g, blk, j] = a
        # W̄_K = Σ_b c̄ qᵀ, q̄ = W_Kᵀ c̄, W̄_Q = Σ_b z_T q̄ᵀ
        for b in range(n):
            for j in range(D):
                a = F(0.0)
                for f in range(D):
                    a += Wkm[f, j] * dc[b, f]
                dq[b, j] = a
        for f in range(D):
            for j in range(D):
                a1 = F(0.0)
                a2 = F(0.0)
                for b in range(n):
                    a1 += dc[b, f] * q[b, j]
                    a2 += zr[(T - 1) * n + b, f] * dq[b, j]
                gk[s, m, g, blk, f, j] = a1
                gq[s, m, g, blk, f, j] = a2
"""


def _source(kind: str, blocked: bool = False) -> str:
    if kind == "vector":
        return _VECTOR_KERNEL
    text = _COMMON.format(buffers=_SCALAR_BUFFERS, body=_SCALAR_BODY)
    if blocked:  # one model's last layer on the blocked layout of its full layers: read and written in place
        for old, new in _BLOCKED_EDITS:
            if old not in text:
                raise AssertionError(f"the query-loss kernel's source changed: {old!r}")
            text = text.replace(old, new)
    return text


# The scalar residual kernel on the blocked layout (``iclab.ops._runtime.blocked``): Z is one model's (⌈B/CH⌉, T, D, CH)
# (CH = LANES) and dZ the same, each block read and written in place instead of transposed in and out; y, pos,
# lens, rows and the weights as for the token layout with one model (S = R = M = G = 1).
_BLOCKED_EDITS = (
    ("    S_, R, B, Tmax, _ = Z.shape\n", "    Tmax = Z.shape[1]\n    B = y.shape[2]\n"),
    ("        rz = r % R  # Z may hold one row shared by every row of y\n", ""),
    ("    zb = np.empty((Tmax, D, CH), dt)\n", ""),
    ("""        for b in range(n):
            for t in range(T):
                p = pos[g, t]
                for f in range(D):
                    zb[t, f, b] = Z[s, rz, b0 + b, p, f]
""", "        zb = Z[blk]\n"),
    ("dZ[s, m, g, b0 + b, T - 1, f] += a", "dZ[blk, T - 1, f, b] += a"),
    ("dZ[s, m, g, b0 + b, T - 1, label] += e[b]", "dZ[blk, T - 1, label, b] += e[b]"),
    ("dZ[s, m, g, b0 + b, t, f] = ", "dZ[blk, t, f, b] = "),
)


@functools.cache
def _kernel(kind: str, D: int, dtype: str, residual: bool = False, blocked: bool = False):
    """The kernel of one gating kind (``none``, ``scalar``, ``vector``) for width D and a float dtype (compiled on
    first use, a few seconds). Serial code; threads split the jobs (``_run_jobs``). ``residual`` (scalar and no
    gates): the last layer of a residual stack, ŷ = z_T[label] + (o_T)[label], and the token cotangents dZ.
    ``blocked`` (scalar, residual): one model's tokens and dZ on the blocked layout (``_BLOCKED_EDITS``)."""
    if residual and kind == "vector":
        raise ValueError("the residual read-out is built for scalar or no gates")
    if blocked and not (residual and kind == "scalar"):
        raise ValueError("the blocked query-loss kernel is the scalar residual one")
    constants = {"CH": _blocked.LANES if blocked else CHUNK, "D": D, "F": getattr(np, dtype), "GATED": kind != "none",
                 "RESIDUAL": residual}
    return compile_kernels(_source(kind, blocked), ["kernel"],
                           label=f"iclab GLA query-loss kernel, {kind}, D={D}{', blocked' if blocked else ''}",
                           constants=constants, fastmath=_FASTMATH, nogil=True, boundscheck=False)[0]


def _run_jobs(kernel, jobs: int, *args) -> None:
    """kernel(*args, first, stop) over jobs [0, jobs), split into contiguous runs, one per thread."""
    run_split(kernel, jobs, *args, threads=thread_count())


#: The kernels' dZ argument where no token cotangent is written.
_NO_DZ = {name: np.zeros((1,) * 6, name) for name in ("float32", "float64")}


def _readonly(a, dtype) -> np.ndarray:
    """A read-only C-contiguous array (one compiled signature per dtype, whichever way the callback's arrays come)."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


#: The float32 grid kernels (``_layer_ir``) read a blocked copy of the prompts made once per call
#: (``grid_blocks``) in place, where each job gathered its block's tokens into its scratch (False: the gathers, the
#: tests' twin; the same bits).
BLOCKED_GRID = True


_GRID_BLOCKS = threading.local()


def _grid_blocks_buffer(shape, dtype) -> np.ndarray:
    """This thread's buffer for ``grid_blocks``, kept between calls (grown when too small): a fresh 17-MB array
    for gating.fig1's batch would cost more in page faults per call than the copy itself."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = getattr(_GRID_BLOCKS, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _GRID_BLOCKS.buf = _blocked.aligned_empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def grid_blocks(Z: np.ndarray, *, threads: int = 1, reuse: bool = False) -> np.ndarray:
    """A grid's prompts Z (S, R, B, T, D) (float32 or float64) in the blocked layout (S, R, ⌈B/LANES⌉, T, D, LANES),
    the spare lanes zero: one 16-lane gather per token entry (``_layer_ir.grid_blocks_kernel``), the (row, block)
    units split over ``threads``; one copy per call that every model of the grid reads in place
    (``_layer_ir._grid_job``). ``reuse``: written into this thread's buffer kept between calls (valid until this
    thread's next call: the grid's host function consumes it before it returns)."""
    S, R, B, T, D = Z.shape
    NB = -(-B // _blocked.LANES)
    Zb = _grid_blocks_buffer((S, R, NB, T, D, _blocked.LANES), Z.dtype) if reuse else \
        _blocked.aligned_empty((S, R, NB, T, D, _blocked.LANES), Z.dtype)
    run_split(_layer_ir.grid_blocks_kernel(D, Z.dtype), S * R * NB, Z.reshape(S * R, B, T, D),
              Zb.reshape(S * R, NB, T, D, _blocked.LANES), threads=threads)
    return Zb


def _host(kind: str, label: int, positions: np.ndarray, lengths: np.ndarray, rows: np.ndarray):
    """The callback: (loss (…, M, G), grads) of one grid, with or without a leading seed axis (vmap)."""

    def call(Z, y, Wq, Wk, Wv, Wg, h):
        batched = Z.ndim == 5
        dt = np.dtype(Z.dtype)
        arrs = [Z, y, Wq, Wk, Wv, Wg, h]
        if not batched:
            arrs = [a[None] for a in arrs]
        Z, y, Wq, Wk, Wv, Wg, h = (_readonly(a, dt) for a in arrs)
        S, R, B, _, D = Z.shape
        M, G = Wq.shape[1:3]
        ir = dt == np.float32 and FLOAT32_LAYERS == "llvm" and (kind != "vector" or D <= _blocked.LANES)
        if not ir:
            kernel = _kernel(kind, D, dt.name)
        elif kind == "vector":
            kernel = _layer_ir.vector_grid_kernel(D, dt, blocked=BLOCKED_GRID)
        else:
            kernel = _layer_ir.query_grid_kernel(D, dt, gated=kind == "scalar", label=label, blocked=BLOCKED_GRID)
        NB = -(-B // (_blocked.LANES if ir else CHUNK))
        if ir and BLOCKED_GRID:
            Z = grid_blocks(Z, threads=thread_count(), reuse=True)
        loss = np.empty((S, M, G, NB), dt)
        gq = np.empty((S, M, G, NB, D, D), dt)
        gk = np.empty_like(gq)
        gv = np.empty((S, M, G, NB, D, D if kind == "vector" else 1), dt)
        gg = np.empty((S, M, G, NB) + Wg.shape[3:], dt)
        gh = (np.empty if kind == "vector" else np.zeros)((S, M, G, NB, D), dt)  # only a head has a gradient
        _run_jobs(kernel, S * M * G * NB, Z, y, positions, lengths, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv,
                  gg, gh, _NO_DZ[dt.name])
        out = [loss.sum(axis=3), gq.sum(axis=3), gk.sum(axis=3)]  # blocks in order
        gv = gv.sum(axis=3)
        if kind != "vector":  # only the label column of W_V is read
            full = np.zeros((S, M, G, D, D), dt)
            full[..., label] = gv[..., 0]
            gv = full
        out += [gv, gg.sum(axis=3), gh.sum(axis=3)]
        return tuple(o if batched else o[0] for o in out)

    return call


def _loss_with_grads(call):
    """A custom-VJP loss from ``call(params, Z, y) -> (losses, grads)``, which computes the gradients with the
    losses (the host kernels' forward pass): the backward pass scales them by the losses' cotangent. ``losses`` is
    one array and ``grads`` params' pytree, or both are lists (one entry per grid, params a list of grids)."""

    def scale(grads, ct):
        return jax.tree_util.tree_map(lambda g: g * ct.reshape(ct.shape + (1,) * (g.ndim - ct.ndim)).astype(g.dtype),
                                      grads)

    @jax.custom_vjp
    def loss(params, Z, y):
        return call(params, Z, y)[0]

    def fwd(params, Z, y):
        values, grads = call(params, Z, y)
        return values, (grads, Z, y)

    def bwd(res, cts):
        grads, Z, y = res
        scaled = [scale(g, ct) for g, ct in zip(grads, cts)] if isinstance(cts, (list, tuple)) else scale(grads, cts)
        return scaled, jnp.zeros_like(Z), jnp.zeros_like(y)

    loss.defvjp(fwd, bwd)
    return loss


@functools.cache
def _grid_loss(kind: str, head: bool, label: int, positions: bytes, pshape: tuple, lengths: tuple, rows: tuple):
    """The custom-VJP loss of one grid layout (cached: one traced function per layout)."""
    pos = np.frombuffer(positions, dtype=np.int64).reshape(pshape)
    host = _host(kind, label, pos, np.asarray(lengths, np.int64), np.asarray(rows, np.int64))

    def call(params, Z, y):
        dt = Z.dtype
        M, G = params["Wq"].shape[:2]
        D = Z.shape[-1]
        Wg = params["w_g"] if kind == "scalar" else params["W_g"] if kind == "vector" else jnp.zeros((M, G, D), dt)
        h = params["h"] if head else jnp.zeros((M, G, D), dt)
        args = [Z, y, params["Wq"], params["Wk"], params["Wv"], Wg, h]
        args = [jnp.asarray(a, dt) for a in args]
        shapes = (jax.ShapeDtypeStruct((M, G), dt),) + tuple(
            jax.ShapeDtypeStruct(a.shape, dt) for a in args[2:])
        out = host_call(host, shapes, *args, vmap_method="broadcast_all")
        grads = {"Wq": out[1], "Wk": out[2], "Wv": out[3]}
        if kind == "scalar":
            grads["w_g"] = out[4]
        elif kind == "vector":
            grads["W_g"] = out[4]
        if head:
            grads["h"] = out[5]
        return out[0], {name: grads[name].astype(params[name].dtype) for name in params}

    return _loss_with_grads(call)


def _check_rows(rows: np.ndarray, Z, y) -> None:
    """Rows index y (…, R, B); Z (…, R', B, T, D) has R' = R rows, or one that every row of y reads."""
    R, RZ = y.shape[-2], Z.shape[-4]
    if RZ not in (1, R):
        raise ValueError(f"Z must have the {R} rows of y or one shared row (got {RZ})")
    if np.any(rows < 0) or np.any(rows >= R):
        raise ValueError(f"rows out of y's range [0, {R})")


def query_mse_grid(params: dict, Z: jax.Array, y: jax.Array, *, positions: np.ndarray, lengths: np.ndarray,
                   rows, label: int) -> jax.Array:
    """Mean squared query errors of a (M, G) grid of one-layer GLA models (module docstring), by the compiled kernel.

    Member (m, g) reads row ``rows[m]`` of Z at the token positions ``positions[g, :lengths[g]]`` (the query
    last) and is compared with ``y[rows[m]]``; its loss equals ``mean((gla.predict_last(θ_mg, Z_g, label=label)
    − y)²)``. A Z of one row serves every row of y (settings whose prompts differ only in the query's target,
    as gating.fig1's panels). Differentiable in the params (custom VJP: the forward computes the gradient too); Z and y are
    data. Runs on the host through ``jax.pure_callback`` (vmap: one call for every mapped instance).

    Args:
        params: one layer's params (``gla.init_params``: Wq, Wk, Wv (D, D), w_g (D,) or W_g (D, D), optional
            head h (D,); a head only with vector gates) with leading (M, G) axes.
        Z: (R, B, T_max, D) or (1, B, T_max, D) tokens; y: (R, B) targets.
        positions: (G, T_max) int token positions of each prompt length (``subsequence_positions``).
        lengths: (G,) int prompt lengths.
        rows: (M,) ints, the row of Z each member reads.
        label: index of the label coordinate (the read-out without a head).
    Returns:
        (M, G) losses in Z's dtype.
    """
    kind = _gating(params)
    head = "h" in params
    if head != (kind == "vector"):
        raise ValueError("the kernel reads vector-gated models with a head, and scalar or ungated ones at the label "
                         f"coordinate (got gating {kind!r} with{'' if head else 'out'} a head)")
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    M, G = params["Wq"].shape[:2]
    if positions.shape[0] != G or lengths.shape != (G,) or rows.shape != (M,):
        raise ValueError(f"positions, lengths and rows must describe the params' (M, G) = ({M}, {G}) grid")
    if positions.shape[1] > Z.shape[-2] or np.any(positions >= Z.shape[-2]) or np.any(lengths > positions.shape[1]):
        raise ValueError("token positions out of the prompts' range")
    _check_rows(rows, Z, y)
    fn = _grid_loss(kind, head, int(label), positions.tobytes(), positions.shape, tuple(int(v) for v in lengths),
                    tuple(int(v) for v in rows))
    return fn(params, Z, y)


# --------------------------------------------------------------------------------------------
# A full scalar-gated layer (every position): forward and backward kernels


def _gated_layer_source(D: int, residual: bool = False, *, blocked: bool = False, grad_z: bool = True) -> str:
    """Forward and backward kernels of one scalar-gated GLA layer at every position, tokens of width D (inner
    loops over D unrolled into scalars; the loops over prompts vectorise). Weights come transposed (W = W_•ᵀ,
    so q = W_Q z in the loops), as in ``forget``.

    forward, t ascending: g_t = φ(w_gᵀ z_t); q, k, v = W_Q z_t, W_K z_t, W_V z_t; S ← g_t S + v kᵀ; o_t = S q.
    backward, given ō_t and the forward's outputs o_t:
      pass 1 (t ascending): g, q, k, v and S_t again (kept for pass 2); q̄_t = S_tᵀ ō_t; W̄_Q += q̄ zᵀ; z̄_t = W_Qᵀ q̄;
      pass 2 (t descending): S̄_t = g_{t+1} S̄_{t+1} + ō_t q_tᵀ; v̄ = S̄ k, k̄ = S̄ᵀ v; W̄_K += k̄ zᵀ, W̄_V += v̄ zᵀ,
        z̄_t += W_Kᵀ k̄ + W_Vᵀ v̄; and the gates through the cumulative log gates c_t = Σ_{u≤t} log g_u of the
        parallel form o_i = Σ_{j≤i} e^{c_i − c_j}(q_i·k_j) v_j: ∂L/∂c_t = ō_t·o_t − k_t·k̄_t, so
        ∂L/∂log g_t = Σ_{u≥t} ∂L/∂c_u (a running sum of pass 2), ∂L/∂a_t = φ(−a_t) ∂L/∂log g_t,
        w̄_g += (∂L/∂a_t) z_t, z̄_t += (∂L/∂a_t) w_g.
    Each block of CH prompts writes its own partial sums of W̄ and w̄_g (summed over blocks in order by the caller).
    ``residual``: a layer of the residual stream (eq 25), Z ↦ Z + O: forward writes z_t + o_t, backward z̄_t + ō_t.
    ``blocked``: Z, O, Ō and Z̄ in the blocked layout (⌈B/CH⌉, T, D, CH) of ``iclab.ops._runtime.blocked``, read and
    written in place (the token layout's kernels transpose each block in and out). Without ``grad_z`` (blocked
    only: a first layer, on data) the backward leaves Z̄ alone.
    """
    F = range(D)
    zsum = lambda w: " + ".join(f"{w}{f} * z{f}" for f in F)  # noqa: E731
    head = [
        "    T = Z.shape[1]",
        "    dt = Z.dtype",
        "    one = F(1.0)",
        *([] if blocked else [f"    zb = np.empty((T, {D}, CH), dt)"]),
        f"    q = np.empty(({D}, CH), dt)",
        f"    k = np.empty(({D}, CH), dt)",
        f"    v = np.empty(({D}, CH), dt)",
        f"    S = np.empty(({D}, {D}, CH), dt)",
        "    gb = np.empty((T, CH), dt)",
        "    smb = np.empty((T, CH), dt)",
        *[f"    wg{f} = wg[{f}]" for f in F],
    ]
    if blocked:
        load_block = ["        zb = Z[blk]"]
    else:
        load_block = ["        for b in range(n):", "            for t in range(T):", f"                for f in range({D}):",
                      "                    zb[t, f, b] = Z[b0 + b, t, f]"]
    gates = [  # g_t and 1 − g_t = φ(−a_t) of every prompt of the block
        "        for t in range(T):",
        "            zt = zb[t]",
        "            for b in range(n):",
        *[f"                z{f} = zt[{f}, b]" for f in F],
        f"                a = {zsum('wg')}",
        "                x = np.exp(-abs(a))",
        "                den = one / (one + x)",
        "                gb[t, b] = den if a >= 0 else x * den",
        "                smb[t, b] = x * den if a >= 0 else den",
    ]
    load_z = ["            zt = zb[t]"]
    qkv = [
        f"            for e in range({D}):",
        *[f"                wq{f} = WQ[e, {f}]; wk{f} = WK[e, {f}]; wv{f} = WV[e, {f}]" for f in F],
        "                for b in range(n):",
        *[f"                    z{f} = zt[{f}, b]" for f in F],
        f"                    q[e, b] = {zsum('wq')}",
        f"                    k[e, b] = {zsum('wk')}",
        f"                    v[e, b] = {zsum('wv')}",
    ]
    forward = [
        "def forward(Z, WQ, WK, WV, wg, O, first, stop):",
        *head,
        *([] if blocked else [f"    ob = np.empty((T, {D}, CH), dt)"]),
        "    for blk in range(first, stop):",
        *([] if blocked else ["        b0 = blk * CH", "        n = min(CH, Z.shape[0] - b0)"]),
        "        S[:] = 0.0",
        *load_block, *(["        ob = O[blk]"] if blocked else []), *gates,
        "        for t in range(T):",
        *load_z, *qkv,
        "            gt = gb[t]",
        f"            for e in range({D}):",
        "                Se = S[e]",
        "                for b in range(n):",
        "                    ve = v[e, b]",
        "                    g = gt[b]",
        *[f"                    s{f} = g * Se[{f}, b] + ve * k[{f}, b]; Se[{f}, b] = s{f}" for f in F],
        "                    ob[t, e, b] = " + ("zt[e, b] + " if blocked and residual else "")
        + " + ".join(f"s{f} * q[{f}, b]" for f in F),
    ]
    if not blocked:
        forward += _blocked.store_lines(D, "O", "zb[t, e, b] + ob[t, e, b]" if residual else "ob[t, e, b]")
    backward = [
        "def backward(Z, WQ, WK, WV, wg, O, dO, dZ, dW, dwg, first, stop):",
        *head,
        *([] if blocked else [f"    dzb = np.empty((T, {D}, CH), dt)"]),
        f"    Qb = np.empty((T, {D}, CH), dt)",
        f"    Kb = np.empty((T, {D}, CH), dt)",
        f"    Vb = np.empty((T, {D}, CH), dt)",
        f"    gW = np.empty((3, {D}, {D}, CH), dt)",
        f"    gw = np.empty(({D}, CH), dt)",
        *([] if blocked else [f"    dob = np.empty((T, {D}, CH), dt)"]),
        "    oo = np.empty((T, CH), dt)",
        f"    dq = np.empty(({D}, CH), dt)",
        f"    dk = np.empty(({D}, CH), dt)",
        f"    dv = np.empty(({D}, CH), dt)",
        "    R = np.empty(CH, dt)",
        "    gnext = np.empty(CH, dt)",
        "    for blk in range(first, stop):",
        *([] if blocked else ["        b0 = blk * CH", "        n = min(CH, Z.shape[0] - b0)"]),
        "        S[:] = 0.0",
        "        gW[:] = 0.0",
        "        gw[:] = 0.0",
        *load_block,
        *(["        dob = dO[blk]", "        Ob = O[blk]", *(["        dzb = dZ[blk]"] if grad_z else []),
           "        for t in range(T):",
           "            for b in range(CH):",
           "                oo[t, b] = 0.0",
           f"            for f in range({D}):",
           "                for b in range(CH):",  # ō_t·o_t
           "                    oo[t, b] += dob[t, f, b] * " + ("(Ob[t, f, b] - zb[t, f, b])" if residual else "Ob[t, f, b]")]
          if blocked else [
           "        for b in range(n):",
           "            for t in range(T):",
           "                acc = F(0.0)",
           f"                for f in range({D}):",
           "                    x = dO[b0 + b, t, f]",
           "                    dob[t, f, b] = x",
           "                    acc += x * " + ("(O[b0 + b, t, f] - Z[b0 + b, t, f])" if residual else "O[b0 + b, t, f]"),
           "                oo[t, b] = acc"]),  # ō_t·o_t
        *gates,
        # pass 1: S_t forward, q̄_t = S_tᵀ ō_t; q, k, v kept for pass 2
        "        for t in range(T):",
        "            q = Qb[t]",
        "            k = Kb[t]",
        "            v = Vb[t]",
        *load_z, *qkv,
        "            gt = gb[t]",
        "            do = dob[t]",
        "            dq[:] = 0.0",
        f"            for e in range({D}):",
        "                Se = S[e]",
        "                for b in range(n):",
        "                    ve = v[e, b]",
        "                    doe = do[e, b]",
        "                    g = gt[b]",
        *[f"                    s{f} = g * Se[{f}, b] + ve * k[{f}, b]; Se[{f}, b] = s{f}; dq[{f}, b] += s{f} * doe"
          for f in F],
        f"            for e in range({D}):",
        "                gq = gW[0, e]",
        "                for b in range(n):",
        "                    x = dq[e, b]",
        *[f"                    gq[{f}, b] += x * zt[{f}, b]" for f in F],
        *([f"            for f in range({D}):",
           *[f"                w{e} = WQ[{e}, f]" for e in F],
           "                for b in range(n):",
           "                    dzb[t, f, b] = " + ("dob[t, f, b] + " if blocked and residual else "")
           + " + ".join(f"w{e} * dq[{e}, b]" for e in F)] if grad_z else []),
        # pass 2: S̄_t backward (S now holds S̄), the running sum R of ∂L/∂c for the gates
        "        S[:] = 0.0",
        "        R[:] = 0.0",
        "        gnext[:] = 0.0",
        "        for t in range(T - 1, -1, -1):",
        "            q = Qb[t]",
        "            k = Kb[t]",
        "            v = Vb[t]",
        *load_z,
        "            do = dob[t]",
        "            dk[:] = 0.0",
        f"            for e in range({D}):",
        "                Se = S[e]",
        "                for b in range(n):",
        "                    ve = v[e, b]",
        "                    doe = do[e, b]",
        "                    g = gnext[b]",
        *[f"                    s{f} = g * Se[{f}, b] + doe * q[{f}, b]; Se[{f}, b] = s{f}; dk[{f}, b] += s{f} * ve"
          for f in F],
        "                    dv[e, b] = " + " + ".join(f"s{f} * k[{f}, b]" for f in F),
        "            for b in range(n):",
        "                R[b] += oo[t, b] - (" + " + ".join(f"k[{f}, b] * dk[{f}, b]" for f in F) + ")",
        "                gnext[b] = gb[t, b]",
        f"            for e in range({D}):",
        "                gk = gW[1, e]",
        "                gv = gW[2, e]",
        "                for b in range(n):",
        "                    xk = dk[e, b]",
        "                    xv = dv[e, b]",
        *[f"                    gk[{f}, b] += xk * zt[{f}, b]; gv[{f}, b] += xv * zt[{f}, b]" for f in F],
        f"            for f in range({D}):",
        *[f"                a{e} = WK[{e}, f]; c{e} = WV[{e}, f]" for e in F],
        "                wf = wg[f]",
        "                gwf = gw[f]",
        "                for b in range(n):",
        "                    da = smb[t, b] * R[b]",
        "                    gwf[b] += da * zt[f, b]",
        *(["                    dzb[t, f, b] += da * wf + " + " + ".join(f"a{e} * dk[{e}, b] + c{e} * dv[{e}, b]"
                                                                      for e in F)] if grad_z else []),
        *([] if blocked else _blocked.store_lines(D, "dZ", "dzb[t, e, b] + dob[t, e, b]" if residual
                                                  else "dzb[t, e, b]")),
        "        for i in range(3):",
        f"            for e in range({D}):",
        f"                for f in range({D}):",
        "                    acc = F(0.0)",
        "                    for b in range(n):",
        "                        acc += gW[i, e, f, b]",
        "                    dW[blk, i, e, f] = acc",
        f"        for f in range({D}):",
        "            acc = F(0.0)",
        "            for b in range(n):",
        "                acc += gw[f, b]",
        "            dwg[blk, f] = acc",
    ]
    text = "\n".join(forward) + "\n\n\n" + "\n".join(backward)
    # blocked: every block is CH lanes (the spare ones zero prompts)
    return text.replace("range(n)", "range(CH)").replace(":n] = ", "] = ") if blocked else text


#: Prompts per block of the layer kernels (their per-block state S is D²·CH floats).
LAYER_CHUNK = 64


@functools.cache
def _gated_layer_kernels(D: int, dtype: str, residual: bool = False, *, blocked: bool = False,
                         grad_z: bool = True):
    """(forward, backward) compiled for width D and a float dtype (on first use, a few seconds each);
    ``_gated_layer_source``'s options (the forward depends on ``residual`` and ``blocked`` alone)."""
    return compile_kernels(_gated_layer_source(D, residual, blocked=blocked, grad_z=grad_z), ["forward", "backward"],
                           label=f"iclab gated GLA layer kernels, D={D}{', blocked' if blocked else ''}",
                           constants={"CH": _blocked.LANES if blocked else LAYER_CHUNK, "F": getattr(np, dtype)},
                           fastmath=_FASTMATH, nogil=True, boundscheck=False)


#: Which kernels run float32 grids: "llvm" (``iclab.ops.decayed_attention._layer_ir``: the full layers on the blocked layout
#: (``gated_layer_kernels``), the last layer's query read-out of ``multilayer_mse_grid`` (``query_loss_kernel``)
#: and ``query_mse_grid``'s kernels (``query_grid_kernel``; ``vector_grid_kernel`` for vector gates at D ≤ 16):
#: the same arithmetic with its vectors kept in registers) or "numba" (``_gated_layer_source``, ``_source``: their
#: twins in the tests). float64 always runs numba's (the IR ones are no faster there: 16 doubles are two vector
#: registers).
FLOAT32_LAYERS = "llvm"


def _blocked_gated_kernels(D: int, dt: np.dtype, grad_z: bool = True, gathered: bool = False):
    if dt == np.float32 and FLOAT32_LAYERS == "llvm":
        return _layer_ir.gated_layer_kernels(D, np.float32, grad_z=grad_z, gathered=gathered)
    if gathered:
        raise ValueError("only the float32 IR layer kernels read tokens at positions")
    return _gated_layer_kernels(D, dt.name, True, blocked=True, grad_z=grad_z)


def _blocked_layer_forward(Zb, Wq, Wk, Wv, wg, *, threads: int | None = None, positions: np.ndarray | None = None):
    """Z + GLA(Z) of one residual layer on blocked tokens (``iclab.ops._runtime.blocked``); weights as
    :func:`_host_layer_forward`'s; the blocks split over ``threads`` (default ``thread_count()``). With
    ``positions`` (int64, the IR kernels only) the layer's input is Zb's tokens at those positions, read in place:
    the output has len(positions) tokens."""
    dt = Zb.dtype
    WQ, WK, WV = (_readonly(np.asarray(W).T, dt) for W in (Wq, Wk, Wv))
    gathered = positions is not None
    O = _blocked.aligned_empty(Zb.shape[:1] + (len(positions),) + Zb.shape[2:] if gathered else Zb.shape, dt)
    run_split(_blocked_gated_kernels(Zb.shape[2], dt, not gathered, gathered)[0], Zb.shape[0], Zb,
              *((positions,) if gathered else ()), WQ, WK, WV, _readonly(wg, dt), O, threads=threads or thread_count())
    return O


def _blocked_layer_backward(Zb, Wq, Wk, Wv, wg, Ob, dOb, grad_z: bool = True, *, threads: int | None = None,
                            positions: np.ndarray | None = None):
    """(Z̄ (None without ``grad_z``), W̄_q, W̄_k, W̄_v, w̄_g) of one residual layer on blocked tokens, given its output
    Ob and Ōb (blocked); threads and ``positions`` (without ``grad_z``) as :func:`_blocked_layer_forward`."""
    dt = Zb.dtype
    nb, _, D, _ = Zb.shape
    gathered = positions is not None
    if gathered and grad_z:
        raise ValueError("tokens read at positions are data: they take no cotangent")
    WQ, WK, WV = (_readonly(np.asarray(W).T, dt) for W in (Wq, Wk, Wv))
    dZ = _blocked.aligned_empty(Zb.shape, dt) if grad_z else Zb[:0]
    dW = np.empty((nb, 3, D, D), dt)
    dwg = np.empty((nb, D), dt)
    run_split(_blocked_gated_kernels(D, dt, grad_z, gathered)[1], nb, Zb, *((positions,) if gathered else ()), WQ,
              WK, WV, _readonly(wg, dt), Ob, dOb, dZ, dW, dwg, threads=threads or thread_count())
    gW = dW.sum(axis=0)  # blocks in order; the kernel's W̄_• is the gradient of W_•ᵀ
    return (dZ if grad_z else None), gW[0].T, gW[1].T, gW[2].T, dwg.sum(axis=0)


def _host_layer_forward(Z, Wq, Wk, Wv, wg, residual: bool = False):
    """O = GLA(Z) (Z + GLA(Z) with ``residual``) of one layer on (B, T, D) tokens."""
    dt = np.dtype(Z.dtype)
    Z, wg = _readonly(Z, dt), _readonly(wg, dt)
    WQ, WK, WV = (_readonly(np.asarray(W).T, dt) for W in (Wq, Wk, Wv))  # q = W_Q z in the kernel
    B, T, D = Z.shape
    O = np.empty_like(Z)
    _run_jobs(_gated_layer_kernels(D, dt.name, residual)[0], -(-B // LAYER_CHUNK), Z, WQ, WK, WV, wg, O)
    return O


def _host_layer_backward(Z, Wq, Wk, Wv, wg, O, dO, residual: bool = False):
    """(Z̄, W̄_q, W̄_k, W̄_v, w̄_g) of one layer given its output O (Z + GLA(Z) with ``residual``) and Ō."""
    dt = np.dtype(Z.dtype)
    Z, wg, O, dO = (_readonly(a, dt) for a in (Z, wg, O, dO))
    WQ, WK, WV = (_readonly(np.asarray(W).T, dt) for W in (Wq, Wk, Wv))
    B, T, D = Z.shape
    blocks = -(-B // LAYER_CHUNK)
    dZ = np.empty_like(Z)
    dW = np.empty((blocks, 3, D, D), dt)
    dwg = np.empty((blocks, D), dt)
    _run_jobs(_gated_layer_kernels(D, dt.name, residual)[1], blocks, Z, WQ, WK, WV, wg, O, dO, dZ, dW, dwg)
    gW = dW.sum(axis=0)  # blocks in order; the kernel's W̄_• is the gradient of W_•ᵀ
    return dZ, gW[0].T, gW[1].T, gW[2].T, dwg.sum(axis=0)


@jax.custom_vjp
def _gated_layer(Z, Wq, Wk, Wv, wg):
    return host_call(_host_layer_forward, jax.ShapeDtypeStruct(Z.shape, Z.dtype), Z, Wq, Wk, Wv, wg,
                     vmap_method="sequential")


def _gated_layer_fwd(Z, Wq, Wk, Wv, wg):
    O = _gated_layer(Z, Wq, Wk, Wv, wg)
    return O, (Z, Wq, Wk, Wv, wg, O)


def _gated_layer_bwd(res, dO):
    Z, Wq, Wk, Wv, wg, O = res
    D = Z.shape[-1]
    shapes = (jax.ShapeDtypeStruct(Z.shape, Z.dtype),) + (jax.ShapeDtypeStruct((D, D), Z.dtype),) * 3 + (
        jax.ShapeDtypeStruct((D,), Z.dtype),)
    return host_call(_host_layer_backward, shapes, Z, Wq, Wk, Wv, wg, O, dO.astype(Z.dtype),
                     vmap_method="sequential")


_gated_layer.defvjp(_gated_layer_fwd, _gated_layer_bwd)


def gated_layer(params: dict, Z: jax.Array) -> jax.Array:
    """Outputs o_t of one scalar-gated GLA layer at every position (``gla.gla_layer``), by the compiled CPU kernels.

    o_t = S_t q_t, S_t = φ(w_gᵀz_t) S_{t−1} + v_t k_tᵀ, in the recurrent form: O(T·D²) work per prompt and no
    (T, T) matrix. Differentiable in the weights and the tokens (a custom VJP: the recurrence forward for q̄,
    backward for k̄, v̄, and the gates through the cumulative log gates; see ``_gated_layer_source``). No mask.

    Args:
        params: Wq, Wk, Wv (D, D) and w_g (D,) (scalar gates).
        Z: (..., T, D) tokens (leading axes flattened into the prompts).
    Returns:
        O: Z's shape.
    """
    if _gating(params) != "scalar":
        raise ValueError(f"the native layer kernel computes scalar-gated layers (got {_gating(params)!r} gating)")
    dt = Z.dtype
    lead = Z.shape[:-2]
    O = _gated_layer(Z.reshape((-1,) + Z.shape[-2:]), *(jnp.asarray(params[k], dt) for k in ("Wq", "Wk", "Wv", "w_g")))
    return O.reshape(lead + Z.shape[-2:])


# --------------------------------------------------------------------------------------------
# A grid of L-layer residual models (eq 25): each model's whole loss in the host call


#: A grid call with at least this many models per thread runs whole models on the threads (each model's kernels on
#: one thread) rather than each model's kernels split over the threads: gating.fig2 calls ≈ 1000 kernels a step on
#: 256 prompts, where splitting one call costs a hand-off per call (in float32 the models are then run by the
#: compiled driver, ``GRID_DRIVER``; in float64 the Python between kernels overlaps another model's kernels).
MODELS_PER_THREAD = 4


def _host_multilayer(label: int, positions: np.ndarray, lengths: np.ndarray, rows: np.ndarray, blocked: bool = False):
    """The callback of :func:`multilayer_mse_grid`, with or without a leading seed axis (vmap)."""

    def call(Z, y, Wq, Wk, Wv, wg):
        batched = Z.ndim == (6 if blocked else 5)
        dt = np.dtype(Z.dtype)
        arrs = [Z, y, Wq, Wk, Wv, wg]
        if not batched:
            arrs = [a[None] for a in arrs]
        Z, y, Wq, Wk, Wv, wg = (_readonly(a, dt) for a in arrs)
        S, B, D = Z.shape[0], y.shape[-1], Z.shape[-2 if blocked else -1]
        M, G, L = Wq.shape[1:4]
        loss = np.empty((S, M, G), dt)
        grads = [np.zeros((S, M, G, L, D, D), dt) for _ in range(3)] + [np.zeros((S, M, G, L, D), dt)]
        out = (loss, *grads)
        members = [(s, m, g) for s in range(S) for m in range(M) for g in range(G)]
        threads = thread_count()
        if (dt == np.float32 and FLOAT32_LAYERS == "llvm" and GRID_DRIVER
                and (threads == 1 or len(members) >= MODELS_PER_THREAD * threads)):
            _driven_members(Z, y, Wq, Wk, Wv, wg, label, positions, lengths, rows, out, threads, blocked=blocked)
            return tuple(o if batched else o[0] for o in out)
        if blocked:  # the paths below read the prompts as tokens
            Z = np.stack([np.stack([_blocked.from_blocks(Zsr, B) for Zsr in Zs]) for Zs in Z])
        R = Z.shape[1]
        prompts = None
        if dt == np.float32 and FLOAT32_LAYERS == "llvm":
            # each (seed, row)'s prompts on the blocked layout once, every n̄'s model reading its tokens at its
            # positions in place: a copy per model cost ≈ 10 % of gating.fig2's step (memory-bound)
            pairs = sorted({(s, int(r) % R) for s in range(S) for r in rows})
            shape = (-(-B // _blocked.LANES), Z.shape[3], D, _blocked.LANES)
            prompts = {pair: _blocked.aligned_empty(shape, dt) for pair in pairs}

            def copy(first, stop):
                for (s, r) in pairs[first:stop]:
                    _blocked.to_blocks(Z[s, r], out=prompts[(s, r)])

            run_split(copy, len(pairs), threads=threads)
        if threads > 1 and len(members) >= MODELS_PER_THREAD * threads:
            # the longest prompts first (their cost is ∝ T), each thread taking the next model when done: every
            # model's arithmetic is the same on any thread, so the result does not depend on the split
            queue = iter(sorted(members, key=lambda mem: -int(lengths[mem[2]])))
            lock = threading.Lock()

            def worker(first, stop):
                while True:
                    with lock:
                        member = next(queue, None)
                    if member is None:
                        return
                    _multilayer_member(Z, y, Wq, Wk, Wv, wg, *member, label, positions, lengths, rows, out, 1,
                                       prompts)

            run_split(worker, threads, threads=threads)
        else:
            for member in members:
                _multilayer_member(Z, y, Wq, Wk, Wv, wg, *member, label, positions, lengths, rows, out, threads,
                                   prompts)
        return tuple(o if batched else o[0] for o in out)

    return call


#: float32 grids of whole models on the threads run by ``iclab.ops.decayed_attention._grid_driver`` (one compiled loop calls each
#: member's kernels); False: by ``_multilayer_member``'s Python, its naive twin (the same bits; tested).
GRID_DRIVER = True

#: Members a thread claims at a time from the grid's queue: at least DRIVER_CHUNK, and a 1/(DRIVER_GUIDE · threads)
#: share of those left (guided scheduling: long claims while many are left, short ones at the end, where the
#: threads must finish together): gating.fig2's step makes about half the driver calls of fixed claims of
#: DRIVER_CHUNK, and each call has a fixed cost in Python.
DRIVER_CHUNK = 2
DRIVER_GUIDE = 4


def _driven_members(Z, y, Wq, Wk, Wv, wg, label: int, positions, lengths, rows, out, threads: int, *,
                    blocked: bool = False) -> None:
    """:func:`_host_multilayer`'s float32 grid by ``_grid_driver.run_members`` (:func:`_driven_grids` of one)."""
    _driven_grids(Z, y, [(Wq, Wk, Wv, wg, positions, lengths, rows, out)], label, threads, blocked=blocked)


def _driven_grids(Z, y, grids: list, label: int, threads: int, *, blocked: bool = False) -> None:
    """Float32 grids of multi-layer models on the same prompts by ``_grid_driver.run_members``: the operands prepared
    once (the prompts of each (seed, row) blocked, the targets in lanes; each grid's weights transposed as the layer
    kernels read them), then every grid's members in one queue, claimed a few at a time by the threads: the deepest
    grid first, each grid's longest prompts first (a member's cost is ∝ its full layers × T), so that the cheap
    members end the queue where the threads must finish together.

    Args:
        Z: (S, R_Z, B, T, D) prompts, or (S, R_Z, ⌈B/LANES⌉, T, D, LANES) on the blocked layout (``blocked``: read
            in place); y: (S, R, B) targets.
        grids: (Wq, Wk, Wv, wg, positions, lengths, rows, out) per grid, as :func:`_host_multilayer`'s.
    """
    from iclab.ops.decayed_attention import _grid_driver

    dt = Z.dtype
    S, RZ = Z.shape[:2]
    B = y.shape[-1]
    TZ, D = Z.shape[-3:-1] if blocked else Z.shape[-2:]
    R = y.shape[1]
    nb = -(-B // _blocked.LANES)
    if blocked:
        pair_of = np.arange(S * RZ, dtype=np.int64).reshape(S, RZ)
        Zp = Z.reshape((S * RZ,) + Z.shape[2:])
        if Zp.ctypes.data % _blocked.ALIGN:  # the kernels load whole aligned vectors
            Zp = _blocked.aligned_empty(Zp.shape, dt)
            Zp[...] = Z.reshape(Zp.shape)
    else:
        pairs = sorted({(s, int(r) % RZ) for s in range(S) for grid in grids for r in grid[6]})
        pair_of = np.full((S, RZ), -1, np.int64)
        for k, pair in enumerate(pairs):
            pair_of[pair] = k
        Zp = _blocked.aligned_empty((len(pairs), nb, TZ, D, _blocked.LANES), dt)

        def copy(first, stop):
            for k in range(first, stop):
                _blocked.to_blocks(Z[pairs[k]], out=Zp[k])

        run_split(copy, len(pairs), threads=threads)
    Yb = _blocked.aligned_empty((S, R, nb, _blocked.LANES), dt)
    Yb.reshape(S, R, -1)[:, :, B:] = 0
    Yb.reshape(S, R, -1)[:, :, :B] = y

    def aligned(a):
        c = _blocked.aligned_empty(a.shape, dt)
        c[...] = a
        return c

    queue, kws, parts = [], [], []  # queue: (grid, members in that grid's order)
    for Wq, Wk, Wv, wg, positions, lengths, rows, out in sorted(grids, key=lambda grid: -grid[0].shape[3]):
        loss, *grads = out
        M, G = Wq.shape[1:3]
        WQt, WKt, WVt = (aligned(np.swapaxes(W, -1, -2)) for W in (Wq, Wk, Wv))
        Wq_, Wk_, Wg_ = (aligned(W) for W in (Wq, Wk, wg))
        U = aligned(Wv[:, :, :, -1, :, label])
        loss_parts = np.empty((S, M, G, nb), dt)
        order = sorted(((s, m, g) for s in range(S) for m in range(M) for g in range(G)),
                       key=lambda mem: -int(lengths[mem[2]]))  # the longest prompts first: their cost is ∝ T
        queue += [(len(kws), i) for i in range(len(order))]
        parts.append((loss, loss_parts))
        kws.append((np.asarray(order, np.int64).reshape(-1, 3), dict(
            rows=rows, lengths=lengths, positions=positions, pair_of=pair_of, Zp=Zp, Yb=Yb, WQt=WQt, WKt=WKt,
            WVt=WVt, Wq=Wq_, Wk=Wk_, U=U, Wg=Wg_, label=label, B=B, loss_parts=loss_parts, oq=grads[0], ok=grads[1],
            ov=grads[2], og=grads[3])))
    chunk = len(queue) if threads == 1 else DRIVER_CHUNK
    claimed = [0]
    lock = threading.Lock()

    def worker(first, stop):  # every member's arithmetic is the same on any thread: the split changes no bit
        while True:
            with lock:
                i = claimed[0]
                stop = min(i + max(chunk, (len(queue) - i) // (DRIVER_GUIDE * threads)), len(queue))
                claimed[0] = stop
            if i >= len(queue):
                return
            while i < stop:  # the claim's run of each grid
                grid = queue[i][0]
                j = i
                while j < stop and queue[j][0] == grid:
                    j += 1
                members, kw = kws[grid]
                _grid_driver.run_members(members, queue[i][1], queue[j - 1][1] + 1, **kw)
                i = j

    run_split(worker, threads, threads=threads)
    for loss, loss_parts in parts:
        loss[...] = loss_parts.sum(axis=-1)  # blocks pairwise, as each member's lo.sum()


def _multilayer_member(Z, y, Wq, Wk, Wv, wg, s: int, m: int, g: int, label: int, positions, lengths, rows, out,
                       threads: int, prompts: dict | None = None) -> None:
    """Member (s, m, g) of :func:`_host_multilayer`'s grid: its loss and weight gradients written into ``out``
    (loss (S, M, G), then W̄_q, W̄_k, W̄_v (S, M, G, L, D, D), w̄_g (S, M, G, L, D)), its kernels on ``threads``.
    ``prompts`` (the IR kernels): (seed, row) -> those prompts on the blocked layout, which the first layer (or the
    query read-out of a one-layer model) reads at the model's positions."""
    loss, *grads = out
    dt = Z.dtype
    B, D = Z.shape[2], Z.shape[4]
    L = Wq.shape[3]
    T = int(lengths[g])
    W = [a[s, m, g] for a in (Wq, Wk, Wv, wg)]
    ir = dt == np.float32 and FLOAT32_LAYERS == "llvm"
    P = positions[g, :T]
    at = {} if prompts is None else {"positions": P}  # the first layer's input read in place
    rz = int(rows[m]) % Z.shape[1]  # Z may hold one row shared by every row of y
    if prompts is not None:
        Zs = [prompts[(s, rz)]]
    elif ir or L > 1:  # this n̄'s prompts on the blocked layout (each block read and written in place)
        Zs = [_blocked.to_blocks(Z[s, rz], positions=P)]
    else:  # the token-layout kernel below reads them from Z (one model: S = R = M = G = 1)
        Zs = [np.ascontiguousarray(Z[s, rz][:, P])[None, None]]
    for l in range(L - 1):
        Zs.append(_blocked_layer_forward(Zs[-1], W[0][l], W[1][l], W[2][l], W[3][l], threads=threads,
                                         **(at if l == 0 else {})))
    # the last layer read at the query (residual read-out), its weight gradients and, below a stream, the token
    # cotangents
    if ir:
        nb = Zs[-1].shape[0]
        lo, gv, gg = np.empty(nb, dt), np.empty((nb, D), dt), np.empty((nb, D), dt)
        gq, gk = np.empty((nb, D, D), dt), np.empty((nb, D, D), dt)
        dZ = _blocked.aligned_empty(Zs[-1].shape, dt) if L > 1 else None
        yb, u = _blocked.lanes(y[s, rows[m]], nb), np.ascontiguousarray(W[2][-1][:, label])
        if L == 1 and at:
            query = _layer_ir.query_loss_kernel(D, dt, gated=True, residual=True, grad_z=False, label=label,
                                                gathered=True)
            run_split(query, nb, Zs[-1], P, yb, W[0][-1], W[1][-1], u, W[3][-1], B, lo, gq, gk, gv, gg,
                      threads=threads)
        else:
            query = _layer_ir.query_loss_kernel(D, dt, gated=True, residual=True, grad_z=L > 1, label=label)
            run_split(query, nb, Zs[-1], yb, W[0][-1], W[1][-1], u, W[3][-1], B, lo, gq, gk, gv, gg, dZ,
                      threads=threads)
        parts = (gq, gk, gv, gg)
    else:
        nb = Zs[-1].shape[0] if L > 1 else -(-B // CHUNK)
        lo = np.empty((1, 1, 1, nb), dt)
        gl = [np.empty((1, 1, 1, nb, D, D), dt) for _ in range(2)] + [np.empty((1, 1, 1, nb, D, 1), dt),
                                                                       np.empty((1, 1, 1, nb, D), dt)]
        dZ = np.zeros_like(Zs[-1]) if L > 1 else np.zeros((1, 1, 1, B, T, D), dt)
        args = [a[None, None, None] for a in (W[0][-1], W[1][-1], W[2][-1], W[3][-1])]
        run_split(_kernel("scalar", D, dt.name, True, L > 1), nb, Zs[-1], y[s, rows[m]][None, None],
                  np.arange(T)[None], np.asarray([T]), np.zeros(1, np.int64), *args, np.zeros((1, 1, 1, D), dt),
                  label, lo, gl[0], gl[1], gl[2], gl[3], np.zeros((1,) * 5, dt), dZ, threads=threads)
        parts = (gl[0][0, 0, 0], gl[1][0, 0, 0], gl[2][0, 0, 0, :, :, 0], gl[3][0, 0, 0])
    loss[s, m, g] = lo.sum()  # blocks in order
    grads[0][s, m, g, -1], grads[1][s, m, g, -1] = parts[0].sum(axis=0), parts[1].sum(axis=0)
    grads[2][s, m, g, -1, :, label] = parts[2].sum(axis=0)
    grads[3][s, m, g, -1] = parts[3].sum(axis=0)
    for l in range(L - 2, -1, -1):  # Z̄_l = Z̄_{l+1} + the layer's input cotangent (in the kernel)
        dZ, *gw = _blocked_layer_backward(Zs[l], W[0][l], W[1][l], W[2][l], W[3][l], Zs[l + 1], dZ,
                                          grad_z=l > 0, threads=threads,  # the first layer reads data
                                          **(at if l == 0 else {}))
        for i in range(4):
            grads[i][s, m, g, l] = gw[i]


def _host_multilayers(label: int, layouts: tuple, blocked: bool):
    """The callback of :func:`multilayer_mse_grids`: the float32 grids in one queue on the threads
    (:func:`_driven_grids`); elsewhere each grid as :func:`_host_multilayer` computes it alone."""
    alone = [_host_multilayer(label, pos, lens, rows, blocked) for pos, lens, rows in layouts]

    def call(Z, y, *weights):
        per_grid = [weights[4 * k: 4 * k + 4] for k in range(len(layouts))]
        batched = Z.ndim == (6 if blocked else 5)
        dt = np.dtype(Z.dtype)
        threads = thread_count()
        members = sum(int(np.prod(W[0].shape[:-3])) for W in per_grid)  # (S,) M, G of each grid
        if not (dt == np.float32 and FLOAT32_LAYERS == "llvm" and GRID_DRIVER
                and (threads == 1 or members >= MODELS_PER_THREAD * threads)):
            return tuple(o for fn, W in zip(alone, per_grid) for o in fn(Z, y, *W))
        lead = (lambda a: a) if batched else (lambda a: a[None])
        Zr, yr = (_readonly(lead(a), dt) for a in (Z, y))
        grids, outs = [], []
        for (pos, lens, rows), W in zip(layouts, per_grid):
            Wq, Wk, Wv, wg = (_readonly(lead(a), dt) for a in W)
            S, M, G, L, D = Wq.shape[:5]
            out = (np.empty((S, M, G), dt),) + tuple(np.zeros((S, M, G, L, D, D), dt) for _ in range(3)) + (
                np.zeros((S, M, G, L, D), dt),)
            grids.append((Wq, Wk, Wv, wg, pos, lens, rows, out))
            outs += [o if batched else o[0] for o in out]
        _driven_grids(Zr, yr, grids, label, threads, blocked=blocked)
        return tuple(outs)

    return call


@functools.cache
def _multilayer_grids_loss(label: int, layouts: tuple, blocked: bool):
    """The custom-VJP losses of grids on the same prompts (cached: one traced function per set of layouts)."""
    arrays = tuple((np.frombuffer(pos, dtype=np.int64).reshape(pshape), np.asarray(lens, np.int64),
                    np.asarray(rows, np.int64)) for pos, pshape, lens, rows in layouts)
    host = _host_multilayers(label, arrays, blocked)
    names = ("Wq", "Wk", "Wv", "w_g")

    def call(grids, Z, y):
        dt = Z.dtype
        stacked, shapes = [], []
        for layers in grids:
            st = [jnp.stack([jnp.asarray(layer[k], dt) for layer in layers], axis=2) for k in names]  # (M, G, L, …)
            stacked += st
            shapes += [jax.ShapeDtypeStruct(st[0].shape[:2], dt)] + [jax.ShapeDtypeStruct(a.shape, dt) for a in st]
        out = host_call(host, tuple(shapes), Z, y.astype(dt), *stacked, vmap_method="broadcast_all")
        losses, grads = [], []
        for n, layers in enumerate(grids):
            o = out[5 * n: 5 * n + 5]
            losses.append(o[0])
            grads.append([{k: o[1 + i][:, :, l].astype(layers[l][k].dtype) for i, k in enumerate(names)}
                          for l in range(len(layers))])
        return losses, grads

    return _loss_with_grads(call)


def multilayer_mse_grids(grids: list, Z: jax.Array, y: jax.Array, *, label: int, blocked: bool = False) -> list:
    """:func:`multilayer_mse_grid` of several grids on the same prompts (e.g. one per depth) in one host call: their
    members in one queue on the threads, the prompts prepared once (the same losses and gradients, bit for bit, as
    each grid alone).

    Args:
        grids: (layers, positions, lengths, rows) per grid, each as :func:`multilayer_mse_grid`'s arguments.
        Z, y, label, blocked: as :func:`multilayer_mse_grid`'s.
    Returns:
        the (M, G) losses of each grid, in Z's dtype.
    """
    layouts = []
    for layers, positions, lengths, rows in grids:
        positions, lengths, rows = _grid_layout(layers, Z, y, positions, lengths, rows, blocked)
        layouts.append((positions.tobytes(), positions.shape, tuple(int(v) for v in lengths),
                        tuple(int(v) for v in rows)))
    fn = _multilayer_grids_loss(int(label), tuple(layouts), bool(blocked))
    return fn([list(g[0]) for g in grids], Z, y)


def _grid_layout(layers, Z, y, positions, lengths, rows, blocked: bool):
    """A multi-layer grid's layout checked against its params and prompts: (positions, lengths, rows) as int64."""
    if any(_gating(p) != "scalar" or "h" in p for p in layers):
        raise ValueError("the multi-layer kernel computes scalar-gated layers without a head")
    if blocked and (Z.ndim != 5 or Z.shape[-1] != _blocked.LANES or Z.shape[1] != -(-y.shape[-1] // _blocked.LANES)):
        raise ValueError(f"blocked prompts must be (R, ⌈B/{_blocked.LANES}⌉, T, D, {_blocked.LANES}) for y's B "
                         f"(got {Z.shape} for {y.shape})")
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    M, G = layers[0]["Wq"].shape[:2]
    if positions.shape[0] != G or lengths.shape != (G,) or rows.shape != (M,):
        raise ValueError(f"positions, lengths and rows must describe the params' (M, G) = ({M}, {G}) grid")
    if np.any(positions >= Z.shape[-3 if blocked else -2]) or np.any(lengths > positions.shape[1]):
        raise ValueError("token positions out of the prompts' range")
    _check_rows(rows, jax.ShapeDtypeStruct(Z.shape[:-1], Z.dtype) if blocked else Z, y)
    return positions, lengths, rows


def multilayer_mse_grid(layers: list, Z: jax.Array, y: jax.Array, *, positions: np.ndarray, lengths: np.ndarray,
                        rows, label: int, blocked: bool = False) -> jax.Array:
    """Mean squared query errors of a (M, G) grid of L-layer residual scalar-gated GLAs (eq 25,
    ``gla.predict_multilayer``), each model's whole loss and gradient in the host call.

    Member (m, g) reads row ``rows[m]`` of Z at the positions ``positions[g, :lengths[g]]`` (the query last), as in
    :func:`query_mse_grid`; its L − 1 full layers run by the layer kernels (the residual added in place), the last
    layer is read at the query by the loss kernel (ŷ = z_T[label] + (o_T)[label], with the token cotangents), and
    the backward pass runs the layers' backward kernels last to first. No (B, T, D) tokens cross between XLA and the
    host per layer. In float32 a grid of whole models on the threads runs in one compiled loop per thread
    (``iclab.ops.decayed_attention._grid_driver``: no Python between a model's kernels). Differentiable in the weights (custom VJP:
    the forward computes the gradient too).

    Args:
        layers: L param dicts (Wq, Wk, Wv (D, D), w_g (D,); no head) with leading (M, G) axes.
        Z: (R, B, T_max, D) or (1, B, T_max, D) tokens (:func:`query_mse_grid`); y: (R, B) targets.
        positions, lengths, rows: the grid's layout (:func:`query_mse_grid`).
        label: index of the label coordinate.
        blocked: Z is (R, ⌈B/LANES⌉, T_max, D, LANES), the prompts on the layer kernels' blocked layout
            (``ops._runtime.blocked``, the spare lanes zero), which the float32 grid reads without a copy.
    Returns:
        (M, G) losses in Z's dtype.
    """
    return multilayer_mse_grids([(layers, positions, lengths, rows)], Z, y, label=label, blocked=blocked)[0]
