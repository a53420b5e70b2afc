"""Whole models of :func:`iclab.ops.decayed_attention.gated.multilayer_mse_grid` (float32, the LLVM IR kernels) run by one
compiled loop: ``run_members``.

Per member (s, m, g) of the grid, with T its prompt length and the L − 1 full layers below its query read-out:

    forward:  X_0 = layer_0(prompts at P),  X_l = layer_l(X_{l−1}) (l < L − 1);
    read-out: loss and the last layer's per-block gradients from X_{L−2} (the prompts at P when L = 1), with the
              token cotangents X̄_{L−2} below it;
    backward: layer l = L − 2, …, 0 from (its input, X_l, X̄_l): its per-block weight gradients and X̄_{l−1};

then the per-block partial sums added over the blocks in order. A member's blocks go through its whole model
``BLOCKS`` at a time (forward, read-out, backward of one block, then the next): the outputs, q, k, v and cotangents
the backward reads are then the last few hundred kB written, in cache, and their buffers are one block's, reused. The
full layers run as their ``kept`` kernels (``_layer_ir.gated_layer_kernels``): each forward leaves q_t, k_t, v_t in
R[l] for its backward, which does not compute them again (the same bits; the forward pays a little for the stores, the
backward saves more). These are the kernels and the sums of ``gated._multilayer_member``'s IR path, the naive twin
this loop is tested against bit for bit; what differs is who calls them, and in what order of blocks. gating.fig2's
step calls ≈ 1500 kernels on 300 models, and between them the Python of the member (operand checks, allocations,
slicing, numpy's small sums) held the GIL: on two threads one thread's Python stalled the other's. Here a numba
function (no GIL) calls the IR kernels through their addresses (numba's first-class function types), in buffers kept
per thread.

The loss is left per block (``loss_parts``, (S, M, G, blocks)) for numpy's sum over the last axis, which is the
same pairwise sum as the per-member ``lo.sum()``; the weight gradients are summed here block after block, as
numpy's ``sum(axis=0)`` does.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime import blocked as _blocked
from iclab.ops.decayed_attention import _layer_ir

__all__ = ["run_members"]

_SOURCE = '''
def drive(fwd_g, fwd, bwd_g, bwd, qry_g, qry, members, first, stop, rows, lengths, positions, pair_of, Zp, Yb,
          WQt, WKt, WVt, Wq, Wk, U, Wg, label, inv_b, two_b, X, dZa, dZb, lo, gq, gk, gv, gg, dW, dwg, R, GS, DA,
          ACC, SC, loss_parts, oq, ok, ov, og):
    nb = Zp.shape[1]
    TZ = Zp.shape[2]
    D = Zp.shape[3]
    LN = Zp.shape[4]
    L = Wq.shape[3]
    RZ = pair_of.shape[1]
    null = np.uint64(0)
    for i in range(first, stop):
        s = members[i, 0]
        m = members[i, 1]
        g = members[i, 2]
        T = lengths[g]
        Zin = Zp[pair_of[s, rows[m] % RZ]]
        P = positions[g].ctypes.data
        yb = Yb[s, rows[m]].ctypes.data
        last = L - 1
        if L == 1:
            qry_g(Zin.ctypes.data, yb, Wq[s, m, g, 0].ctypes.data, Wk[s, m, g, 0].ctypes.data, U[s, m, g].ctypes.data,
                  Wg[s, m, g, 0].ctypes.data, lo.ctypes.data, gq.ctypes.data, gk.ctypes.data, gv.ctypes.data,
                  gg.ctypes.data, null, SC.ctypes.data, T, 0, nb, inv_b, two_b, P, TZ)
        # the blocks BLOCKS at a time through the whole model (forward, read-out, backward), so that a block's
        # tokens, outputs, q, k, v and cotangents are still in cache when its backward reads them
        step = nb if BLOCKS == 0 else BLOCKS
        for b0 in range(0, nb if L > 1 else 0, step):
            b1 = min(nb, b0 + step)
            # X, R, X̄ hold `step` blocks: each pointer shifted back by b0 blocks, so that the kernels' block b0 is
            # the buffer's first (the same few hundred kB reused block after block, in cache)
            sx = np.uint64(b0 * T * D * LN * 4)
            sr = np.uint64(3) * sx
            x0 = X[0].ctypes.data - sx
            r0 = R[0].ctypes.data - sr
            za = dZa.ctypes.data - sx
            zb = dZb.ctypes.data - sx
            for l in range(L - 1):  # the full layers, each writing X[l] (its T tokens, blocked) and R[l] (q, k, v)
                if l == 0:
                    fwd_g(Zin.ctypes.data, WQt[s, m, g, 0].ctypes.data, WKt[s, m, g, 0].ctypes.data,
                          WVt[s, m, g, 0].ctypes.data, Wg[s, m, g, 0].ctypes.data, x0, r0, T, b0, b1, P, TZ)
                else:
                    fwd(X[l - 1].ctypes.data - sx, WQt[s, m, g, l].ctypes.data, WKt[s, m, g, l].ctypes.data,
                        WVt[s, m, g, l].ctypes.data, Wg[s, m, g, l].ctypes.data, X[l].ctypes.data - sx,
                        R[l].ctypes.data - sr, T, b0, b1)
            qry(X[L - 2].ctypes.data - sx, yb, Wq[s, m, g, last].ctypes.data, Wk[s, m, g, last].ctypes.data,
                U[s, m, g].ctypes.data, Wg[s, m, g, last].ctypes.data, lo.ctypes.data, gq.ctypes.data, gk.ctypes.data,
                gv.ctypes.data, gg.ctypes.data, za, SC.ctypes.data, T, b0, b1, inv_b, two_b)
            cur = za
            nxt = zb
            for l in range(L - 2, -1, -1):  # X̄_{l-1} = X̄_l + the layer's input cotangent (in the kernel)
                if l == 0:
                    bwd_g(Zin.ctypes.data, WQt[s, m, g, 0].ctypes.data, WKt[s, m, g, 0].ctypes.data,
                          WVt[s, m, g, 0].ctypes.data, Wg[s, m, g, 0].ctypes.data, x0, cur, null, dW[0].ctypes.data,
                          dwg[0].ctypes.data, r0, GS.ctypes.data, DA.ctypes.data, ACC.ctypes.data, T, b0, b1, P, TZ)
                else:
                    bwd(X[l - 1].ctypes.data - sx, WQt[s, m, g, l].ctypes.data, WKt[s, m, g, l].ctypes.data,
                        WVt[s, m, g, l].ctypes.data, Wg[s, m, g, l].ctypes.data, X[l].ctypes.data - sx, cur, nxt,
                        dW[l].ctypes.data, dwg[l].ctypes.data, R[l].ctypes.data - sr, GS.ctypes.data,
                        DA.ctypes.data, ACC.ctypes.data, T, b0, b1)
                    tmp = cur
                    cur = nxt
                    nxt = tmp
        for b in range(nb):
            loss_parts[s, m, g, b] = lo[b]
        for e in range(D):  # blocks in order, as numpy's sum(axis=0)
            for f in range(D):
                a = gq[0, e, f]
                c = gk[0, e, f]
                for b in range(1, nb):
                    a += gq[b, e, f]
                    c += gk[b, e, f]
                oq[s, m, g, last, e, f] = a
                ok[s, m, g, last, e, f] = c
            a = gv[0, e]
            c = gg[0, e]
            for b in range(1, nb):
                a += gv[b, e]
                c += gg[b, e]
            ov[s, m, g, last, e, label] = a
            og[s, m, g, last, e] = c
        for l in range(L - 1):
            for k in range(3):  # the kernel's W̄_• is the gradient of W_•ᵀ
                for e in range(D):
                    for f in range(D):
                        a = dW[l, 0, k, e, f]
                        for b in range(1, nb):
                            a += dW[l, b, k, e, f]
                        if k == 0:
                            oq[s, m, g, l, f, e] = a
                        elif k == 1:
                            ok[s, m, g, l, f, e] = a
                        else:
                            ov[s, m, g, l, f, e] = a
            for e in range(D):
                a = dwg[l, 0, e]
                for b in range(1, nb):
                    a += dwg[l, b, e]
                og[s, m, g, l, e] = a
'''


def _wap_class():
    import numba.experimental.function_type  # noqa: F401  (registers the typing of first-class functions)
    from numba.core.types import FunctionType
    from numba.core.types.function_type import WrapperAddressProtocol
    from numba.core.typing.typeof import typeof_impl

    class Kernel(WrapperAddressProtocol):
        """An IR kernel (a ctypes function) as a numba first-class function: its address and signature."""

        def __init__(self, fn, sig):
            self.fn, self.sig = fn, sig
            self.address = ctypes.cast(fn, ctypes.c_void_p).value
            self.numba_type = FunctionType(sig)

        def __wrapper_address__(self):
            return self.address

        def signature(self):
            return self.sig

    # its numba type made once, not at every call: numba's own typing of a first-class function builds the type
    # anew for every kernel argument of every driver call
    typeof_impl.register(Kernel)(lambda val, c: val.numba_type)
    return Kernel


#: Blocks of a member taken through its whole model at a time (0: all of them, layer after layer, as the naive
#: twin). One block at a time keeps a member's activations in cache between its layers; the same bits.
BLOCKS = 1


@functools.cache
def _compiled(blocks: int):
    return compile_kernels(_SOURCE, ["drive"], label="iclab multi-layer grid driver", constants={"BLOCKS": blocks},
                           nogil=True, boundscheck=False)[0]


@functools.cache
def _kernels(D: int, label: int):
    """The six IR kernels the driver calls, as first-class functions: the first layer's forward and backward
    (reading the prompts at positions, no token cotangent), the other layers' (with it), and the query read-out
    without and with token cotangents."""
    from numba import types

    Kernel = _wap_class()
    dt = np.dtype(np.float32)
    p, i, f = types.uint64, types.int64, types.float32
    fwd_g, bwd_g = _layer_ir.gated_layer_kernels(D, dt, grad_z=False, gathered=True, kept=True)
    fwd, bwd = _layer_ir.gated_layer_kernels(D, dt, grad_z=True, gathered=False, kept=True)
    qry_g = _layer_ir.query_loss_kernel(D, dt, gated=True, residual=True, grad_z=False, label=label, gathered=True)
    qry = _layer_ir.query_loss_kernel(D, dt, gated=True, residual=True, grad_z=True, label=label)
    raw = {name: k.raw for name, k in (("fwd_g", fwd_g), ("bwd_g", bwd_g), ("fwd", fwd), ("bwd", bwd),
                                        ("qry_g", qry_g), ("qry", qry))}
    return (Kernel(raw["fwd_g"], types.void(*(p,) * 7, i, i, i, p, i)),
            Kernel(raw["fwd"], types.void(*(p,) * 7, i, i, i)),
            Kernel(raw["bwd_g"], types.void(*(p,) * 14, i, i, i, p, i)),
            Kernel(raw["bwd"], types.void(*(p,) * 14, i, i, i)),
            Kernel(raw["qry_g"], types.void(*(p,) * 13, i, i, i, f, f, p, i)),
            Kernel(raw["qry"], types.void(*(p,) * 13, i, i, i, f, f)))


_BUFFERS = threading.local()


def _buffers(nb: int, T: int, D: int, L: int, step: int) -> tuple:
    """This thread's work buffers for members of up to T tokens and L layers, kept between calls (every kernel
    writes them before reading), each ``_blocked.ALIGN``-byte aligned; the full layers' outputs X, their q, k, v
    (R) and the token cotangents X̄ for ``step`` blocks (0: all nb): ≈ 1.6 MB per thread at gating.fig2's largest
    (L = 3, T = 103, D = 16, 16 blocks) with one block, ≈ 17 MB with all."""
    cache = getattr(_BUFFERS, "cache", None)
    if cache is None:
        cache = _BUFFERS.cache = {}
    key = (nb, T, D, L, step)
    if key not in cache:
        LN, f32 = _blocked.LANES, np.float32
        tokens = (step or nb) * T * D * LN
        cache[key] = (
            _blocked.aligned_empty((max(L - 1, 1), tokens), f32),  # X: the full layers' outputs
            _blocked.aligned_empty(tokens, f32), _blocked.aligned_empty(tokens, f32),  # X̄, ping-pong
            _blocked.aligned_empty(nb, f32), _blocked.aligned_empty((nb, D, D), f32),
            _blocked.aligned_empty((nb, D, D), f32), _blocked.aligned_empty((nb, D), f32),
            _blocked.aligned_empty((nb, D), f32),  # the read-out's per-block parts
            _blocked.aligned_empty((max(L - 1, 1), nb, 3, D, D), f32),  # the full layers' per-block W̄ and w̄_g
            _blocked.aligned_empty((max(L - 1, 1), nb, D), f32),
            _blocked.aligned_empty((max(L - 1, 1), tokens * 3), f32),  # R: the full layers' q, k, v
            _blocked.aligned_empty(T * 3 * D * LN, f32),
            _blocked.aligned_empty(T * _layer_ir.DA_SLOTS * LN, f32),
            _blocked.aligned_empty(_layer_ir.acc_vectors(D) * LN, f32),  # the backward's scratch
            _blocked.aligned_empty((T * 8 + 2 * D + 1) * LN, f32),  # the read-out's scratch
        )
    return cache[key]


def run_members(members: np.ndarray, first: int, stop: int, *, rows, lengths, positions, pair_of, Zp, Yb, WQt, WKt,
                WVt, Wq, Wk, U, Wg, label: int, B: int, loss_parts, oq, ok, ov, og) -> None:
    """Members ``members[first:stop]`` ((n, 3) int64 rows (s, m, g)) of a float32 multi-layer grid, on this thread.

    Args:
        rows, lengths, positions: the grid's layout (``gated.multilayer_mse_grid``), int64.
        pair_of: (S, R_Z) int64, the index in Zp of seed s's prompts of row r.
        Zp: (pairs, blocks, T_Z, D, LANES) the prompts, blocked, 64-byte aligned.
        Yb: (S, R, blocks, LANES) the targets in lanes (spare lanes zero).
        WQt, WKt, WVt: (S, M, G, L, D, D) the layers' W_Qᵀ, W_Kᵀ, W_Vᵀ; Wq, Wk: (S, M, G, L, D, D) as the model's;
            U: (S, M, G, D) the last layer's (W_V)_{:,label}; Wg: (S, M, G, L, D); all C-contiguous.
        label: the label coordinate; B: prompts (the mean's divisor).
        loss_parts: (S, M, G, blocks) written; oq, ok, ov (S, M, G, L, D, D), og (S, M, G, L, D): the members'
            gradients written (ov's last layer in its label column only).
    """
    D = Zp.shape[3]
    bufs = _buffers(Zp.shape[1], int(lengths.max()), D, Wq.shape[3], min(BLOCKS, Zp.shape[1]))
    one = np.float32(1.0)
    _compiled(BLOCKS)(*_kernels(D, label), members, first, stop, rows, lengths, positions, pair_of, Zp, Yb, WQt, WKt,
                      WVt, Wq, Wk, U, Wg, label, one / np.float32(B), np.float32(2.0) / np.float32(B), *bufs,
                      loss_parts, oq, ok, ov, og)
