"""Compiled CPU kernels of the moments engine for the reduced linattn models (numba).

:func:`iclab.engines.moments.full_batch` runs any model ⟨T(θ), φ⟩ through XLA: a step of the Fig 4
setting (64 features) is nearly all XLA's fixed cost per operation, not arithmetic. Here the whole loop of plain GD on

    L(θ) = c − 2⟨T, m⟩ + Tᵀ G T,   ∇_T L = g = 2(G_s T − m),   G_s = (G + Gᵀ)/2,

is one compiled function for the two tensor maps of the linattn paper's reduced models, with their
chain rule written out (A is the D×D matrix with T = vec(A), column-stacking, so gA[i, j] = g[j·D + i]):

- ATTN_S (eq S), rows p = (i, r) of k and q, head i(p):  A = Σ_p v_i k_p q_pᵀ,
  ∂L/∂k_p = v_i gA q_p,  ∂L/∂q_p = v_i gAᵀ k_p,  ∂L/∂v_i = Σ_{p ∈ i} k_pᵀ gA q_p;
- ATTN_M (eq M) and the MLP on z (eq 7), with u_i = vec(U_i) = row i of W₁:  T = Σ_i v_i u_i,
  ∂L/∂u_i = v_i g,  ∂L/∂v_i = u_iᵀ g.

It follows the XLA engine's trajectory to rounding (tests compare both, and both against full-batch
GD on the prompts). The kernels are generated for each D with the loops over D unrolled into scalar
accumulators, which LLVM keeps in registers (loops accumulating into small arrays keep them in memory);
G·T is blocked four rows at a time. Plain GD with a
constant learning rate only: other optimisers and schedules use :func:`iclab.engines.moments.full_batch`.
The engine that runs this kernel with the engines' records, progress and divergence checks is
:func:`iclab.engines.moments_native.full_batch`.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Literal, get_args

import numpy as np

from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime.threads import thread_count

__all__ = ["NATIVE_MODELS", "NativeModel", "plain_gd"]

NativeModel = Literal["attn_s", "attn_m", "mlp"]
NATIVE_MODELS: tuple[str, ...] = get_args(NativeModel)

# Reassociation and FMA contraction let LLVM vectorise the reductions; no 'nnan'/'ninf', so a
# diverging run still records NaN and inf as the XLA engine does.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def _unrolled(template: str, D: int, sep: str = "; ") -> str:
    """``template`` with {i} = 0..D-1, joined: the scalar accumulators of one D-vector."""
    return sep.join(template.format(i=i) for i in range(D))


def _matvec_source(F: int) -> str:
    """G_s·T into GT, four rows at a time (four independent sums per pass over T)."""
    F4 = F - F % 4
    return f"""
        for a in range(0, {F4}, 4):
            s0 = 0.0; s1 = 0.0; s2 = 0.0; s3 = 0.0
            for b in range({F}):
                tb = T[b]
                s0 += Gs[a, b] * tb; s1 += Gs[a + 1, b] * tb; s2 += Gs[a + 2, b] * tb; s3 += Gs[a + 3, b] * tb
            GT[a] = s0; GT[a + 1] = s1; GT[a + 2] = s2; GT[a + 3] = s3
        for a in range({F4}, {F}):
            s0 = 0.0
            for b in range({F}):
                s0 += Gs[a, b] * T[b]
            GT[a] = s0"""


def _record_source(params: str) -> str:
    """Loss of the current params (c − 2 T·m + T·G_s T) and a copy of them at a record step."""
    copies = "\n".join(f"            rec_{p}[r] = {p}" for p in params.split(", "))
    return f"""
        if step == rec_steps[r]:
            loss = c
            for a in range(F):
                loss += T[a] * (GT[a] - 2.0 * m[a])
            rec_loss[r] = loss
{copies}
            r += 1
        if step == n_steps:
            break"""


def _attn_s_tensor_source(D: int) -> str:
    """T[j·D + i] = A[i, j] = Σ_p v_i(p) k_p[i] q_p[j], two columns j at a time (two independent
    chains of FMAs over p: the sums are latency-bound, not throughput-bound)."""
    D2 = D - D % 2
    pair = f"""
        for j in range(0, {D2}, 2):
            {_unrolled("a{i} = 0.0", D)}
            {_unrolled("b{i} = 0.0", D)}
            for p in range(K.shape[0]):
                w = v[p // R] * Q[p, j]
                x = v[p // R] * Q[p, j + 1]
                {_unrolled("a{i} += w * K[p, {i}]", D)}
                {_unrolled("b{i} += x * K[p, {i}]", D)}
            {_unrolled(f"T[j * {D} + {{i}}] = a{{i}}", D)}
            {_unrolled(f"T[j * {D} + {D} + {{i}}] = b{{i}}", D)}"""
    if D2 == D:
        return pair
    return pair + f"""
        {_unrolled("a{i} = 0.0", D)}
        for p in range(K.shape[0]):
            w = v[p // R] * Q[p, {D - 1}]
            {_unrolled("a{i} += w * K[p, {i}]", D)}
        {_unrolled(f"T[{(D - 1) * D} + {{i}}] = a{{i}}", D)}"""


def _attn_s_source(D: int) -> str:
    F = D * D
    acc, sacc = _unrolled("a{i} = 0.0", D), _unrolled("s{i} = 0.0", D)
    return f"""
def kernel(v, K, Q, Gs, m, c, lr, n_steps, rec_steps, rec_loss, rec_v, rec_K, rec_Q):
    H = v.shape[0]
    R = K.shape[0] // H
    T = np.empty(F)
    GT = np.empty(F)
    g = np.empty(F)
    gT = np.empty(F)
    gv = np.empty(H)
    r = 0
    for step in range(n_steps + 1):
{_attn_s_tensor_source(D)}
{_matvec_source(F)}
{_record_source("v, K, Q")}
        for j in range({D}):
            for i in range({D}):
                e = 2.0 * (GT[j * {D} + i] - m[j * {D} + i])
                g[j * {D} + i] = e
                gT[i * {D} + j] = e
        for h in range(H):
            gv[h] = 0.0
        for p in range(K.shape[0]):
            # a_i = (gA q_p)_i, s_j = (gAᵀ k_p)_j: rows of g and of its transpose, both contiguous
            {acc}
            {sacc}
            for j in range({D}):
                w = Q[p, j]
                e = K[p, j]
                {_unrolled(f"a{{i}} += w * g[j * {D} + {{i}}]", D)}
                {_unrolled(f"s{{i}} += e * gT[j * {D} + {{i}}]", D)}
            gv[p // R] += {_unrolled("Q[p, {i}] * s{i}", D, " + ")}
            step_v = lr * v[p // R]
            {_unrolled("K[p, {i}] -= step_v * a{i}", D)}
            {_unrolled("Q[p, {i}] -= step_v * s{i}", D)}
        for h in range(H):
            v[h] -= lr * gv[h]
"""


def _attn_m_source(D: int) -> str:
    return f"""
def kernel(v, U, Gs, m, c, lr, n_steps, rec_steps, rec_loss, rec_v, rec_U):
    H = v.shape[0]
    T = np.empty(F)
    GT = np.empty(F)
    g = np.empty(F)
    r = 0
    for step in range(n_steps + 1):
        for a in range(F):
            T[a] = 0.0
        for h in range(H):
            w = v[h]
            for a in range(F):
                T[a] += w * U[h, a]
{_matvec_source(D * D)}
{_record_source("v, U")}
        for a in range(F):
            g[a] = 2.0 * (GT[a] - m[a])
        for h in range(H):
            gv = 0.0
            step_u = lr * v[h]
            for a in range(F):
                gv += U[h, a] * g[a]
                U[h, a] -= step_u * g[a]
            v[h] -= lr * gv
"""


@functools.cache
def _kernel(model: str, D: int):
    """The compiled kernel of ``model`` for this D (compiled on first call, ~1-4 s at D = 8)."""
    source = (_attn_s_source if model == "attn_s" else _attn_m_source)(D)
    return compile_kernels(source, ["kernel"], label=f"iclab moments kernel {model}, D={D}", constants={"F": D * D},
                           fastmath=_FASTMATH, nogil=True)[0]


def _vec_columns(U: np.ndarray) -> np.ndarray:
    """(H, D, D) U_i -> (H, D²) rows vec(U_i) (column-stacking, as T)."""
    return np.swapaxes(U, -1, -2).reshape(U.shape[:-2] + (-1,))


def _unvec_columns(u: np.ndarray, D: int) -> np.ndarray:
    return np.swapaxes(u.reshape(u.shape[:-1] + (D, D)), -1, -2)


class _Seed:
    """One seed's kernel arguments: its params in the kernel's layout (updated in place, chunk after
    chunk), G_s, m, c, and its record buffers."""

    def __init__(self, model: str, p0: dict, G, m, c, n_rec: int, D: int):
        self.model = model
        self.stats = (np.ascontiguousarray(0.5 * (G + G.T)), np.ascontiguousarray(m), float(c))
        if model == "attn_s":
            H, R, _ = p0["k"].shape
            self.shape = (H, R)
            # copies: the kernel writes its params in place
            self.params = [p0["v"].copy(), p0["k"].reshape(H * R, D).copy(), p0["q"].reshape(H * R, D).copy()]
        elif model == "attn_m":
            self.params = [p0["v"].copy(), _vec_columns(p0["U"]).copy()]
        else:
            self.params = [p0["w2"].copy(), np.ascontiguousarray(p0["W1"]).copy()]
        self.loss = np.empty(n_rec)
        self.records = [np.empty((n_rec,) + a.shape) for a in self.params]

    def run(self, kernel, lr: float, n_steps: int, rec_steps: np.ndarray, first: int) -> None:
        """n_steps steps from the current params, recording at rec_steps (relative) into records first.."""
        last = first + len(rec_steps)
        kernel(*self.params, *self.stats, lr, n_steps, rec_steps, self.loss[first:last],
               *(r[first:last] for r in self.records))

    def recorded_params(self, D: int) -> dict:
        if self.model == "attn_s":
            (H, R), (v, K, Q) = self.shape, self.records
            n = len(v)
            return {"v": v, "k": K.reshape(n, H, R, D), "q": Q.reshape(n, H, R, D)}
        v, U = self.records
        return {"v": v, "U": _unvec_columns(U, D)} if self.model == "attn_m" else {"w2": v, "W1": U}


def plain_gd(model: NativeModel, params0: dict, G: np.ndarray, m: np.ndarray, c: np.ndarray, *, lr: float,
             steps: np.ndarray, record_params: bool = False, records_per_chunk: int = 64, on_chunk=None):
    """Plain GD with constant ``lr`` on L(T(θ)) = c − 2⟨T, m⟩ + Tᵀ G T for S seeds, recorded at ``steps``.

    The loop runs on the host, ``records_per_chunk`` records per kernel call; the seeds run on up to
    ``thread_count()`` threads (the kernel releases the GIL), each seed's numbers independent of it.

    Args:
        model: "attn_s" (params v (S, H), k, q (S, H, R, D)), "attn_m" (v (S, H), U (S, H, D, D)) or "mlp"
            (w2 (S, H), W1 (S, H, D²)); float64.
        params0: the initial params of the S seeds (a leading seed axis).
        G: (S, D², D²), m: (S, D²), c: (S,) the seeds' sufficient statistics.
        lr: the learning rate.
        steps: (n,) increasing record steps, the first 0 (the loss at the initial params).
        record_params: record the params at each record step too.
        records_per_chunk: records per kernel call.
        on_chunk: called after each call as ``on_chunk(last, losses)``, losses (last, S) the records so far (it may
            raise to stop the run).
    Returns:
        (loss (S, n), recorded params {name: (S, n, ...)} or None).
    """
    S, F = m.shape
    D = int(round(F ** 0.5))
    if D * D != F:
        raise ValueError(f"the feature must be the cubic z of D² entries (got {F})")
    kernel = _kernel("attn_s" if model == "attn_s" else "attn_m", D)
    seeds = [_Seed(model, {k: a[s] for k, a in params0.items()}, G[s], m[s], c[s], len(steps), D) for s in range(S)]
    workers = min(S, thread_count())
    pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
    try:
        first = 0
        while first < len(steps):
            last = min(first + records_per_chunk, len(steps))
            start = steps[first - 1] if first > 0 else 0
            rel = (steps[first:last] - start).astype(np.int64)
            # the kernel releases the GIL: with a pool, seeds run on the cores side by side
            list((pool.map if pool is not None else map)(
                lambda seed: seed.run(kernel, float(lr), int(rel[-1]), rel, first), seeds))
            if on_chunk is not None:
                on_chunk(last, np.stack([seed.loss[:last] for seed in seeds], axis=1))
            first = last
    finally:
        if pool is not None:
            pool.shutdown()
    loss = np.stack([seed.loss for seed in seeds])
    params = None
    if record_params:
        per_seed = [seed.recorded_params(D) for seed in seeds]
        params = {k: np.stack([p[k] for p in per_seed]) for k in per_seed[0]}
    return loss, params
