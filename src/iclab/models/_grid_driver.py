"""Whole models of :func:`iclab.models.gla_native.multilayer_mse_grid` (float32, the LLVM IR kernels) run by one
compiled loop: ``run_members``.

Per member (s, m, g) of the grid, with T its prompt length and the L − 1 full layers below its query read-out:

    forward:  X_0 = layer_0(prompts at P),  X_l = layer_l(X_{l−1}) (l < L − 1);
    read-out: loss and the last layer's per-block gradients from X_{L−2} (the prompts at P when L = 1), with the
              token cotangents X̄_{L−2} below it;
    backward: layer l = L − 2, …, 0 from (its input, X_l, X̄_l): its per-block weight gradients and X̄_{l−1};

then the per-block partial sums added over the blocks in order. The full layers run as their ``kept`` kernels
(``_layer_ir.gated_layer_kernels``): each forward leaves q_t, k_t, v_t in R[l] for its backward, which does not
compute them again (the same bits; gating's layer at D = 16, T = 103, 16 blocks, one thread: the backward
3.2-3.3 → 2.9-3.0 ms with z̄, 2.7 → 2.3 ms without, the forward 1.00 → 1.06-1.11 ms for the stores). These are the kernels and the sums of
``gla_native._multilayer_member``'s IR path, the naive twin this loop is tested against bit for bit; what
differs is only who calls them. gating.fig2's step calls ≈ 1500 kernels on 300 models, and between them the
Python of the member (operand checks, allocations, slicing, numpy's small sums; ≈ 0.08-0.10 s a step) held the
GIL: on two threads one thread's Python stalled the other's. Here a numba function (no GIL) calls the IR kernels
through their addresses (numba's first-class function types), in buffers kept per thread.

The loss is left per block (``loss_parts``, (S, M, G, blocks)) for numpy's sum over the last axis, which is the
same pairwise sum as the per-member ``lo.sum()``; the weight gradients are summed here block after block, as
numpy's ``sum(axis=0)`` does.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

from iclab._numba import compile_kernels
from iclab.models import _blocked, _layer_ir

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
        size = nb * T * D * LN
        for l in range(L - 1):  # the full layers, each writing X[l] (its T tokens, blocked) and R[l] (q, k, v)
            if l == 0:
                fwd_g(Zin.ctypes.data, WQt[s, m, g, 0].ctypes.data, WKt[s, m, g, 0].ctypes.data,
                      WVt[s, m, g, 0].ctypes.data, Wg[s, m, g, 0].ctypes.data, X[0].ctypes.data, R[0].ctypes.data,
                      T, 0, nb, P, TZ)
            else:
                fwd(X[l - 1].ctypes.data, WQt[s, m, g, l].ctypes.data, WKt[s, m, g, l].ctypes.data,
                    WVt[s, m, g, l].ctypes.data, Wg[s, m, g, l].ctypes.data, X[l].ctypes.data, R[l].ctypes.data,
                    T, 0, nb)
        yb = Yb[s, rows[m]].ctypes.data
        last = L - 1
        if L == 1:
            qry_g(Zin.ctypes.data, yb, Wq[s, m, g, 0].ctypes.data, Wk[s, m, g, 0].ctypes.data, U[s, m, g].ctypes.data,
                  Wg[s, m, g, 0].ctypes.data, lo.ctypes.data, gq.ctypes.data, gk.ctypes.data, gv.ctypes.data,
                  gg.ctypes.data, null, SC.ctypes.data, T, 0, nb, inv_b, two_b, P, TZ)
        else:
            qry(X[L - 2].ctypes.data, yb, Wq[s, m, g, last].ctypes.data, Wk[s, m, g, last].ctypes.data,
                U[s, m, g].ctypes.data, Wg[s, m, g, last].ctypes.data, lo.ctypes.data, gq.ctypes.data, gk.ctypes.data,
                gv.ctypes.data, gg.ctypes.data, dZa.ctypes.data, SC.ctypes.data, T, 0, nb, inv_b, two_b)
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
        cur = dZa
        nxt = dZb
        for l in range(L - 2, -1, -1):  # X̄_{l-1} = X̄_l + the layer's input cotangent (in the kernel)
            if l == 0:
                bwd_g(Zin.ctypes.data, WQt[s, m, g, 0].ctypes.data, WKt[s, m, g, 0].ctypes.data,
                      WVt[s, m, g, 0].ctypes.data, Wg[s, m, g, 0].ctypes.data, X[0].ctypes.data, cur.ctypes.data,
                      null, dW.ctypes.data, dwg.ctypes.data, R[0].ctypes.data, GS.ctypes.data, DA.ctypes.data,
                      ACC.ctypes.data, T, 0, nb, P, TZ)
            else:
                bwd(X[l - 1].ctypes.data, WQt[s, m, g, l].ctypes.data, WKt[s, m, g, l].ctypes.data,
                    WVt[s, m, g, l].ctypes.data, Wg[s, m, g, l].ctypes.data, X[l].ctypes.data, cur.ctypes.data,
                    nxt.ctypes.data, dW.ctypes.data, dwg.ctypes.data, R[l].ctypes.data, GS.ctypes.data,
                    DA.ctypes.data, ACC.ctypes.data, T, 0, nb)
                tmp = cur
                cur = nxt
                nxt = tmp
            for k in range(3):  # the kernel's W̄_• is the gradient of W_•ᵀ
                for e in range(D):
                    for f in range(D):
                        a = dW[0, k, e, f]
                        for b in range(1, nb):
                            a += dW[b, k, e, f]
                        if k == 0:
                            oq[s, m, g, l, f, e] = a
                        elif k == 1:
                            ok[s, m, g, l, f, e] = a
                        else:
                            ov[s, m, g, l, f, e] = a
            for e in range(D):
                a = dwg[0, e]
                for b in range(1, nb):
                    a += dwg[b, e]
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
    # anew, ≈ 40 µs per kernel argument, ≈ 270-300 µs of each driver call with its six kernels
    typeof_impl.register(Kernel)(lambda val, c: val.numba_type)
    return Kernel


@functools.cache
def _compiled():
    return compile_kernels(_SOURCE, ["drive"], label="iclab multi-layer grid driver", nogil=True,
                           boundscheck=False)[0]


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


def _buffers(nb: int, T: int, D: int, L: int) -> tuple:
    """This thread's work buffers for members of up to T tokens and L layers, kept between calls (every kernel
    writes them before reading), each ``_blocked.ALIGN``-byte aligned: ≈ 17 MB per thread at gating.fig2's
    largest (L = 3, T = 103, D = 16, 16 blocks), 10 MB of it the full layers' q, k, v (R)."""
    cache = getattr(_BUFFERS, "cache", None)
    if cache is None:
        cache = _BUFFERS.cache = {}
    key = (nb, T, D, L)
    if key not in cache:
        LN, f32 = _blocked.LANES, np.float32
        tokens = nb * T * D * LN
        cache[key] = (
            _blocked.aligned_empty((max(L - 1, 1), tokens), f32),  # X: the full layers' outputs
            _blocked.aligned_empty(tokens, f32), _blocked.aligned_empty(tokens, f32),  # X̄, ping-pong
            _blocked.aligned_empty(nb, f32), _blocked.aligned_empty((nb, D, D), f32),
            _blocked.aligned_empty((nb, D, D), f32), _blocked.aligned_empty((nb, D), f32),
            _blocked.aligned_empty((nb, D), f32),  # the read-out's per-block parts
            _blocked.aligned_empty((nb, 3, D, D), f32), _blocked.aligned_empty((nb, D), f32),  # a layer's
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
        rows, lengths, positions: the grid's layout (``gla_native.multilayer_mse_grid``), int64.
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
    bufs = _buffers(Zp.shape[1], int(lengths.max()), D, Wq.shape[3])
    one = np.float32(1.0)
    _compiled()(*_kernels(D, label), members, first, stop, rows, lengths, positions, pair_of, Zp, Yb, WQt, WKt, WVt,
                Wq, Wk, U, Wg, label, one / np.float32(B), np.float32(2.0) / np.float32(B), *bufs,
                loss_parts, oq, ok, ov, og)
