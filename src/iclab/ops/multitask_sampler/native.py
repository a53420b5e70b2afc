"""The labels and tokens of :func:`iclab.tasks.multitask.sample_blocks`' prompts from its draw, in a compiled kernel.

:func:`~iclab.tasks.multitask.sample_blocks` turns ONE standard-normal draw w (B, W) into prompts: the tasks
[β_1 … β_K β] = L G (G = w's first (K+1)·d numbers), the inputs x_i (the next (n+1)·d) and the noise ε_i (the
last n+1), with the labels y_i = x_iᵀβ_{k(i)} + σ ε_i; gating's training steps then lay the prompts out as tokens
(the delimiter prompt of eq 19, and the plain one). :func:`block_tokens` does the labels and the tokens in one pass
over w on every thread, from w and the tasks (which stay XLA's: L G is a small product), optionally on the compiled
layer kernels' blocked layout, which they then read without a copy. XLA wrote the inputs, each sample's task and
the labels as arrays of their own before the tokens, and computed the draw's normals in three passes
(:func:`task_normals` says why).

The labels' sums: y_i sums the d products x_{i,c} β_{k(i),c} (each rounded to float32) in eight lanes: lane l sums
the products c ≡ l (mod 8) in order of c, then the lanes are added pairwise, (l, l + 4), then (l, l + 2), then
(0, 1) (:func:`label_sum`, the kernel tested bit for bit against it). That is the order of XLA's reduction in
gating.fig2's batch on an AVX2 CPU, so its training gives the same bits as with XLA's sampler there (checked end to
end). XLA's order depends on its fusion and the CPU: in gating.fig1's batch it sums with FMAs in sequence (which is
why that batch stays XLA's); another order differs from these labels by rounding only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime.host import host_call
from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["block_tokens", "draw_width", "label_sum", "task_normals"]

#: The lanes of the labels' reduction (XLA's on an AVX2 CPU: eight float32 lanes).
LANES = 8


def draw_width(K: int, n: int, d: int) -> int:
    """Normals per prompt of ``sample_blocks``' draw: (K+1)·d task normals, (n+1)·d inputs, n+1 noises.

    Args:
        K: task blocks; n: context samples (K·n_max); d: input dimension.
    Returns:
        (K+1)·d + (n+1)·(d+1).
    """
    return (K + 1) * d + (n + 1) * (d + 1)


def label_sum(products: np.ndarray) -> np.ndarray:
    """The labels' sum of the last axis of float32 ``products`` in the order of the module docstring (the naive
    twin of the kernel's; numpy, float32 throughout).

    Args:
        products: (..., d) the products x_{i,c} β_{k(i),c}, each rounded to float32.
    Returns:
        (...,) float32 sums.
    """
    products = np.asarray(products, np.float32)
    d = products.shape[-1]
    lanes = np.zeros(products.shape[:-1] + (LANES,), np.float32)
    for c in range(d):
        lanes[..., c % LANES] = products[..., c] if c < LANES else lanes[..., c % LANES] + products[..., c]
    half = lanes[..., :4] + lanes[..., 4:]
    quarter = half[..., :2] + half[..., 2:]
    return quarter[..., 0] + quarter[..., 1]


def _source(d: int, block: int) -> str:
    """The kernel's source for inputs of width d: the label's eight lanes as scalars, its products written out;
    ``block`` > 0: the delimiter tokens in blocks of that many prompts (:func:`block_tokens`), 0: as rows."""
    lanes = []
    for c in range(d):
        prod = f"ws[base + {c}] * tk[{c}]"
        lane = f"l{c % LANES}"
        lanes.append(f"                {lane} = {prod}" if c < LANES else f"                {lane} = {lane} + {prod}")
    lanes += [f"                l{c} = zero" for c in range(d, LANES)]
    label = "\n".join(lanes)
    LN = ", ln" if block else ""
    BLOCK = max(block, 1)
    return f'''
def fill(w, tasks, ctx, sigma, n_max, qc, delim, plain, yq, want_delim, want_plain, first, stop):
    """Prompts j in [first, stop) of the (seed, prompt) grid: labels, delimiter and plain tokens, query labels."""
    B = w.shape[1]
    P = tasks.shape[1]
    K1 = tasks.shape[3]
    K = K1 - 1
    d = {d}
    p = ctx.shape[2]
    n = K * n_max
    xoff = K1 * d
    eoff = xoff + (n + 1) * d
    rows = delim.shape[1] if want_delim else plain.shape[1]
    zero = np.float32(0.0)
    for j in range(first, stop):
        s = j // B
        b = j - s * B
        ln = b % {BLOCK}
        ws = w[s, b]
        cs = ctx[s]
        for q in range(P):
            tq = tasks[s, q, b]
            dq = delim[s, q if want_delim else 0, {'b // ' + str(BLOCK) if block else 'b'}]
            pq = plain[s, q if want_plain else 0, b]
            k = 0 if q < rows and n > 0 else K  # sample i's block, counted (an integer division cost a third)
            r = 0
            for i in range(0 if q < rows else n, n + 1):
                base = xoff + i * d
                tk = tq[k]
{label}
                y = (((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))) + sigma * ws[eoff + i]
                if i == n:
                    yq[s, q, b] = y
                    if q >= rows:
                        continue
                    y = zero  # the query's token carries no label
                if want_delim:
                    t = i + k  # block k's samples sit after k delimiters; the query after K
                    for c in range(d):
                        dq[t, c{LN}] = ws[base + c]
                    dq[t, d{LN}] = y
                    if i < n:
                        for c in range(p):
                            dq[t, d + 1 + c{LN}] = cs[0, c]
                    elif qc >= 0:
                        for c in range(p):
                            dq[t, d + 1 + c{LN}] = cs[qc, c]
                    else:
                        for c in range(p):
                            dq[t, d + 1 + c{LN}] = zero
                if want_plain:
                    for c in range(d):
                        pq[i, c] = ws[base + c]
                    pq[i, d] = y
                r += 1
                if r == n_max:
                    r = 0
                    k += 1
            if q < rows and want_delim:
                for k in range(K):  # block k's delimiter: no input, no label, context k + 1
                    t = k * (n_max + 1) + n_max
                    for c in range(d + 1):
                        dq[t, c{LN}] = zero
                    for c in range(p):
                        dq[t, d + 1 + c{LN}] = cs[k + 1, c]
'''


@functools.cache
def _kernel(d: int, block: int):
    return compile_kernels(_source(d, block), ["fill"], nogil=True, boundscheck=False,
                           label=f"iclab block prompts' labels and tokens, d = {d}, blocks of {block}")[0]


@functools.lru_cache(maxsize=None)
def _host(n_max: int, qc: int, sigma: float, formats: tuple[str, ...], block: int):
    """The host function of one setting (a stable object: one jitted graph per setting)."""
    sigma32 = np.float32(sigma)

    def host(w, tasks, ctx, *, out):
        lead = w.shape[:-2]  # the vmapped axes (seeds), flattened into one
        S = int(np.prod(lead, dtype=np.int64))
        w3 = w.reshape((S,) + w.shape[-2:])
        B = w3.shape[1]
        t5 = tasks.reshape((S,) + tasks.shape[-4:])
        c3 = ctx.reshape((S,) + ctx.shape[-2:])
        arrays = dict(zip(formats + ("y",), out))
        yq = arrays["y"].reshape((S,) + arrays["y"].shape[-2:])
        dummy = np.zeros((1,) * (6 if block else 5), np.float32)
        delim = dummy
        if "delim" in arrays:
            delim = arrays["delim"].reshape((S,) + arrays["delim"].shape[len(lead):])
            if block and B % block:
                delim[:, :, -1, :, :, B % block:] = 0  # the last block's spare lanes
        plain = arrays["plain"].reshape((S,) + arrays["plain"].shape[-4:]) if "plain" in arrays else dummy[..., 0]
        kernel = _kernel(t5.shape[-1], block)

        def run(first, stop):
            kernel(w3, t5, c3, sigma32, n_max, qc, delim, plain, yq, "delim" in arrays, "plain" in arrays, first,
                   stop)

        run_split(run, S * B, threads=min(thread_count(), max(1, S * B // 16)))

    return host


def _host_task_normals(w, *, out):
    (G,) = out
    G[...] = w[..., :G.shape[-1]]


def task_normals(w: jax.Array, K: int, d: int) -> jax.Array:
    """The task normals G = w[:, :(K+1)d] of ``sample_blocks``' draw w (B, W), copied out by a host call.

    Why not ``w[:, :(K+1)d]``: XLA then computes the draw's normals in three passes (its log1p and square root
    written out for two readers, the slice and the rest); with one reader of the whole draw, in one.

    Args:
        w: (B, W) the draw (leading vmapped axes allowed); K: task blocks; d: input dimension.
    Returns:
        (B, (K+1)·d) the task normals, w's dtype.
    """
    return host_call(_host_task_normals, jax.ShapeDtypeStruct(w.shape[:-1] + ((K + 1) * d,), w.dtype), w,
                     vmap_method="broadcast_all", writes_out=True)


def block_tokens(w: jax.Array, tasks: jax.Array, contexts: jax.Array, *, n_max: int, sigma: float,
                 query_context: int | None, formats=("delim",), token_rows: int | None = None, block: int = 0):
    """Labels and tokens of K-block prompts (blocks of n_max samples) from ``sample_blocks``' draw, compiled.

    With n = K·n_max, x_i = w[(K+1)d + i·d : (K+1)d + (i+1)d] and y_i = x_iᵀβ_{k(i)} + σ w[(K+1)d + (n+1)d + i]
    (k(i) = ⌊i / n_max⌋, k(n) = K: the query), the tokens are rows of width D:

    - ``delim`` (D = d + 1 + p, T = n + K + 1, eq 19): [x_i, y_i, c̄_0] per sample, block k followed by its
      delimiter [0, 0, c̄_{k+1}], then the query [x_n, 0, c̄_qc] (c̄_qc = 0 when ``query_context`` is None);
    - ``plain`` (D = d + 1, T = n + 1): [x_i, y_i] per sample, then [x_n, 0].

    Args:
        w: (B, W) float32 standard normals, W = ``draw_width(K, n, d)``.
        tasks: (P, B, K+1, d) float32 tasks β_1..β_K, β of P settings (sharing w: common random numbers).
        contexts: (K+1, p) float32 delimiter contexts c̄_0..c̄_K.
        n_max: samples per block (static).
        sigma: label-noise standard deviation σ (static).
        query_context: the query's context index, or None (zero context).
        formats: the token formats to build, ``delim`` and/or ``plain``.
        token_rows: settings whose tokens are built, the first ``token_rows`` of P (default P; 1 when the settings
            share their context tasks and differ only in the query's).
        block: 0, or the delimiter tokens in blocks of ``block`` prompts, (token_rows, ⌈B/block⌉, T, D, block) with
            prompt b at [:, b // block, :, :, b % block] and the last block's spare lanes zero (the layout of the
            compiled layer kernels, ``ops._runtime.blocked``, which then read them without a copy).
    Returns:
        (format -> (token_rows, B, T, D) tokens (delim blocked as above), (P, B) query labels y_n). Under vmap (the
        seeds) one call runs every mapped instance on the threads.
    """
    P, B, K1, d = tasks.shape
    K, p = K1 - 1, contexts.shape[-1]
    if w.dtype != jnp.float32 or tasks.dtype != jnp.float32 or contexts.dtype != jnp.float32:
        raise ValueError("block_tokens draws float32 prompts (XLA's own path serves other dtypes)")
    if w.shape[-1] != draw_width(K, K * n_max, d) or contexts.shape[0] != K1:
        raise ValueError(f"block_tokens: a draw of width {draw_width(K, K * n_max, d)} and {K1} contexts expected "
                         f"(got {w.shape[-1]}, {contexts.shape[0]})")
    formats = tuple(f for f in ("delim", "plain") if f in formats)
    rows = P if token_rows is None else int(token_rows)
    n, block = K * n_max, int(block)
    shapes = {"delim": (rows, B, n + K + 1, d + 1 + p), "plain": (rows, B, n + 1, d + 1)}
    if block:
        shapes["delim"] = (rows, -(-B // block), n + K + 1, d + 1 + p, block)
    outs = tuple(jax.ShapeDtypeStruct(shapes[f], jnp.float32) for f in formats) + (
        jax.ShapeDtypeStruct((P, B), jnp.float32),)
    fn = _host(int(n_max), -1 if query_context is None else int(query_context), float(sigma), formats, block)
    results = host_call(fn, outs, w, tasks, contexts, vmap_method="broadcast_all", writes_out=True)
    return dict(zip(formats, results[:-1])), results[-1]
