"""LMS and RLS along many streams at once, as a compiled CPU kernel (numba): ``filter_tail_errors``.

For streams b = 1..B of inputs x_bt (shared by G label sets) and labels y_gbt, t = 1..T, both filters of
``iclab.theory.drift`` (``lms_predictions``, ``rls_predictions``: their naive twins in the tests) run from
ŵ_0 = 0 and P_0 = δI:

    LMS:  ŷ_t = ŵ_{t-1}ᵀx_t,  ŵ_t = ŵ_{t-1} + μ x_t (y_t − ŷ_t);
    RLS:  ŷ_t = v_{t-1}ᵀx_t,  k_t = P x_t / (β + x_tᵀP x_t),  v_t = v_{t-1} + k_t (y_t − ŷ_t),
          P ← (P − k_t (P x_t)ᵀ)/β,

and the result is each stream's a-priori squared error (y_t − ŷ_t)² averaged over its last ``window`` steps:
drift.baselines' Monte-Carlo protocol (Sec 5).

Why a kernel: XLA runs RLS's step (batched 10 × 10 products, T = 1000 steps in a scan) at well under 1 GFLOP/s,
a large part of drift.baselines' paper run. The kernel
keeps a block of CH streams' states (lanes last: w (G, d, CH), P (G, d, d, CH), a few tens of KB) in cache for
the whole stream, reads each step's inputs once for the G label sets, and vectorises over the lanes. Each
stream is one lane, so the result does not depend on the thread count or the block size.
"""

from __future__ import annotations

import functools

import numpy as np

from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["filter_tail_errors"]

#: Streams per block (lanes): 16 float64 lanes are two AVX-512 vectors; the G RLS states of a block
#: (G·d²·CH floats, 64 KB at G = 5, d = 10) stay in the L2 cache for the whole stream.
CHUNK = 16

_SOURCE = '''
def kernel(X, Y, mu, beta, delta, window, lms_err, rls_err, first, stop):
    """Blocks [first, stop) of CH streams: LMS and RLS for each of the G label sets, tail errors into
    lms_err, rls_err (G, B)."""
    B, T, d = X.shape
    G = Y.shape[0]
    x = np.empty((d, CH))
    yt = np.empty(CH)
    yh = np.empty(CH)
    r = np.empty(CH)
    den = np.empty(CH)
    w = np.empty((G, d, CH))
    v = np.empty((G, d, CH))
    P = np.empty((G, d, d, CH))
    Px = np.empty((d, CH))
    k = np.empty((d, CH))
    ibeta = 1.0 / beta  # a product, not a division, per element of P (rounding differs by an ulp)
    el = np.empty((G, CH))
    er = np.empty((G, CH))
    t0 = T - window
    for job in range(first, stop):
        b0 = job * CH
        n = min(CH, B - b0)
        w[:] = 0.0
        v[:] = 0.0
        P[:] = 0.0
        for g in range(G):
            for e in range(d):
                P[g, e, e, :] = delta
        el[:] = 0.0
        er[:] = 0.0
        x[:] = 0.0
        yt[:] = 0.0
        for t in range(T):
            for b in range(n):
                for e in range(d):
                    x[e, b] = X[b0 + b, t, e]
            for g in range(G):
                for b in range(n):
                    yt[b] = Y[g, b0 + b, t]
                # LMS
                yh[:] = 0.0
                for e in range(d):
                    for b in range(CH):
                        yh[b] += w[g, e, b] * x[e, b]
                for b in range(CH):
                    r[b] = yt[b] - yh[b]
                for e in range(d):
                    for b in range(CH):
                        w[g, e, b] += mu * x[e, b] * r[b]
                if t >= t0:
                    for b in range(CH):
                        el[g, b] += r[b] * r[b]
                # RLS
                yh[:] = 0.0
                for e in range(d):
                    for b in range(CH):
                        yh[b] += v[g, e, b] * x[e, b]
                for i in range(d):
                    for b in range(CH):
                        Px[i, b] = 0.0
                    for j in range(d):
                        for b in range(CH):
                            Px[i, b] += P[g, i, j, b] * x[j, b]
                for b in range(CH):
                    den[b] = beta
                for i in range(d):
                    for b in range(CH):
                        den[b] += x[i, b] * Px[i, b]
                for b in range(CH):
                    r[b] = yt[b] - yh[b]
                for i in range(d):
                    for b in range(CH):
                        k[i, b] = Px[i, b] / den[b]
                        v[g, i, b] += k[i, b] * r[b]
                for i in range(d):
                    for j in range(d):
                        for b in range(CH):
                            P[g, i, j, b] = (P[g, i, j, b] - k[i, b] * Px[j, b]) * ibeta
                if t >= t0:
                    for b in range(CH):
                        er[g, b] += r[b] * r[b]
        for g in range(G):
            for b in range(n):
                lms_err[g, b0 + b] = el[g, b] / window
                rls_err[g, b0 + b] = er[g, b] / window
'''


@functools.cache
def _kernel():
    """The compiled kernel (float64), compiled once (iclab.ops._runtime.numba_cache's cache)."""
    return compile_kernels(_SOURCE, ["kernel"], label="iclab LMS/RLS filter kernel", constants={"CH": CHUNK},
                           fastmath={"contract"}, nogil=True, boundscheck=False)[0]


def filter_tail_errors(x, y, *, mu: float, beta: float, delta: float, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each stream's LMS and RLS a-priori squared error, averaged over its last ``window`` steps (module docstring).

    Equal to ``mean((theory.drift.lms_predictions(x, y_g, mu=mu) − y_g)²[..., T−window:], -1)`` and its RLS
    twin (``rls_predictions(x, y_g, beta=beta, delta=delta)``) for each label set g, to float rounding (tested).
    Computed in float64 on the host, by ``thread_count()`` threads over blocks of streams.

    Args:
        x: (B, T, d) inputs of B streams of length T, shared by the label sets.
        y: (G, B, T) labels of each stream under each of G label sets (a (B, T) array is one set).
        mu: LMS step size μ.
        beta: RLS forget factor β.
        delta: RLS initial P_0 = δI.
        window: the errors of the last ``window`` steps are averaged (1 ≤ window ≤ T).
    Returns:
        (lms, rls): numpy arrays (G, B), or (B,) for a (B, T) y.
    """
    x = np.ascontiguousarray(x, np.float64)
    y = np.asarray(y, np.float64)
    single = y.ndim == 2
    y = np.ascontiguousarray(y[None] if single else y)
    if x.ndim != 3 or y.ndim != 3 or y.shape[1:] != x.shape[:2]:
        raise ValueError(f"x must be (B, T, d) and y (G, B, T) or (B, T) (got {x.shape} and {y.shape})")
    B, T, _ = x.shape
    if not 1 <= int(window) <= T:
        raise ValueError(f"window must be in [1, T = {T}] (got {window})")
    G = y.shape[0]
    lms, rls = np.empty((G, B)), np.empty((G, B))
    jobs = -(-B // CHUNK)
    run_split(_kernel(), jobs, x, y, float(mu), float(beta), float(delta), int(window), lms, rls, threads=thread_count())
    return (lms[0], rls[0]) if single else (lms, rls)
