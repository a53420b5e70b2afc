"""Training batches of the drifting task drawn by compiled CPU kernels: the tokens and targets only.

The same model as :func:`iclab.tasks.drift.sample_drift_prompts` (eqs 2-3), for a grid of AR(1) processes g:

    x_i = L ξ_i (Λ = L Lᵀ),   w_0 = σ_w ε_0,   w_i = γ_g w_{i-1} + σ_e ε_i,   y_i = ⟨w_i, x_i⟩,   i = 1..n+1,

returned as tokens Z (G, B, n+1, d+1) (query label 0) and targets y_{n+1} (G, B), the batch the drift
trainings consume. All processes share the ξ and ε (common random numbers, as in ``sample_drift_prompts``), so
row g equals the draw for γ_g alone.

The standard normals come from another stream: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011), a counter-based generator keyed by the two 32-bit words of the JAX key, with the counter
(prompt b, position i, stream, block), and a 256-layer ziggurat (one 32-bit word per normal on its fast path). A normal is
a function of (key, b, i, coordinate) alone, so the batch does not depend on the thread count, and a vmapped
call draws each key's numbers by itself. Why: XLA's normal sampler (RNG bits and an erfinv transform) is a
large part of drift.fig1's step at batch 5000 (10⁷ normals); here one pass draws the normals, runs the
AR(1) recursion and writes the tokens. The draws differ from ``sample_drift_prompts``' (another generator);
their distribution is the same, which the tests check against the process's moments.

Two forms of one kernel, equal bit for bit (tested): ``kernel_reference`` draws each stream's Philox blocks
and runs its ziggurat one word at a time; ``kernel`` (the one used) first draws the first ⌈(d+2)/4⌉ blocks of
all 2T + 1 streams of a prompt in one loop over lanes that LLVM vectorises (Philox's 32 × 32-bit products,
8 lanes per AVX-512 instruction), then reads each stream's normals off its words in a call-free loop while
they take the ziggurat's fast path, and only then (14 % of the streams at d = 10) runs the slow path,
which draws further blocks when a stream needs them. Inside jitted code it relies on freed memory being retained
(:mod:`iclab.ops._runtime.malloc`): with glibc's defaults page faults would cost more than the draws. 256 ziggurat
layers keep the slow path rare.

``normals="box_muller"`` draws the same process from another stream, in one LLVM IR kernel over lanes of four
prompts (:mod:`iclab.ops.drift_sampler._ir`): Philox words under the same key, Box-Muller normals (ln, cos and sin by
polynomials, a few ulp from numpy's), the AR(1) recursion and the writes, straight-line vector code where the
ziggurat's branches and table reads are scalar. Its 32-bit uniforms cut the normal's tail beyond 6.66 σ (mass
2.7·10⁻¹¹). It draws drift.fig1's batch faster than the ziggurat kernel. Its naive twin is
``_drift_ir.reference`` in numpy (equal bit for bit, tested); the ziggurat stays the default, whose stored results it
reproduces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime.host import host_call
from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops.drift_sampler import _ir as _drift_ir
from iclab.ops._runtime.philox import M0 as _M0, M1 as _M1, W0 as _W0, W1 as _W1, round_key_lines as _round_key_lines
from iclab.ops._runtime.philox import round_keys, round_lines as _round_lines
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["NORMALS", "sample_shared_batch", "sample_training_batch"]

#: Counter streams: inputs ξ, the initial task ε_0, the drift increments ε_i.
_X, _W_INIT, _E = 0, 1, 2


def _source() -> str:
    return _scalar_and_vectorised_source() + "\n\n" + _shared_variant(_kernel_text(_scalar_and_vectorised_source()))


def _kernel_text(source: str) -> str:
    """The text of ``kernel`` (the vectorised sampler) in the source."""
    return source[source.index("def kernel(k0, k1, round_keys"):]


def _shared_variant(kernel: str) -> str:
    """``kernel_shared``: ``kernel`` writing the shared layout, the inputs once (xs (B, T, d)) and each row's labels
    (ys (G, B, T), the query's 0), instead of the tokens Z (G, B, T, d+1)."""
    old_writes = """            for g in range(G):
                y = 0.0
                for e in range(d):
                    w[g, e] = gamma[g] * w[g, e] + sigma_e[g] * eps[e]
                    y += w[g, e] * x[e]
                    Z[g, b, i, e] = x[e]
                if i == T - 1:
                    Z[g, b, i, d] = 0.0
                    target[g, b] = y
                else:
                    Z[g, b, i, d] = y
"""
    new_writes = """            for e in range(d):
                xs[b, i, e] = x[e]
            for g in range(G):
                y = 0.0
                for e in range(d):
                    w[g, e] = gamma[g] * w[g, e] + sigma_e[g] * eps[e]
                    y += w[g, e] * x[e]
                if i == T - 1:
                    ys[g, b, i] = 0.0
                    target[g, b] = y
                else:
                    ys[g, b, i] = y
"""
    for old, new in ((old_writes, new_writes),
                     ("def kernel(k0, k1, round_keys, gamma, sigma_w, sigma_e, chol, diagonal, X, R, Z, target, first, stop):",
                      "def kernel_shared(k0, k1, round_keys, gamma, sigma_w, sigma_e, chol, diagonal, X, R, xs, ys, target, first,"
                      " stop):"),
                     ("    G, B, T, D = Z.shape\n    d = D - 1\n", "    G, B, T = ys.shape\n    d = xs.shape[2]\n")):
        if old not in kernel:
            raise AssertionError("the sampler's source changed: update _shared_variant")
        kernel = kernel.replace(old, new)
    return kernel


def _scalar_and_vectorised_source() -> str:
    return f'''
def philox(c0, c1, c2, c3, k0, k1, out):
    """Philox4x32-10 of the counter (c0..c3) under key (k0, k1): four uint32 words into out[0:4]."""
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64({_M0}) * c0
        p1 = np.uint64({_M1}) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0) & mask, p1 & mask, ((p0 >> np.uint64(32)) ^ c3 ^ k1) & mask, p0 & mask
        k0 = (k0 + np.uint64({_W0})) & mask
        k1 = (k1 + np.uint64({_W1})) & mask
    out[0] = np.int64(c0)  # int64 words: their conversion to float is one instruction, uint64's is not
    out[1] = np.int64(c1)
    out[2] = np.int64(c2)
    out[3] = np.int64(c3)


def uniform(b, i, stream, k0, k1, words, pos, block):
    """(U(0, 1) from the stream's next word, (w + 1/2) 2⁻³², pos, block): words[pos:] are the unused words of
    block − 1 of the stream (b, i, stream)."""
    if pos == 4:
        philox(np.uint64(b), np.uint64(i), np.uint64(stream), np.uint64(block), k0, k1, words)
        block += 1
        pos = 0
    return (np.float64(words[pos]) + 0.5) * 2.3283064365386963e-10, pos + 1, block


def normals(b, i, stream, k0, k1, n, words, out, X, R):
    """n standard normals of the stream (b, i, stream) into out[0:n]: the 256-layer ziggurat (Marsaglia and
    Tsang 2000, with Doornik's 2005 symmetric form and tail), whose layer (8 bits) and abscissa (24 bits) are
    disjoint bits of one word, so the fast path (98.5 %) costs one word."""
    pos = 4
    block = 0
    j = 0
    while j < n:
        if pos == 4:
            philox(np.uint64(b), np.uint64(i), np.uint64(stream), np.uint64(block), k0, k1, words)
            block += 1
            pos = 0
        w = words[pos]
        pos += 1
        layer = w & 255
        u = 2.0 * (np.float64(w >> 8) + 0.5) * 5.9604644775390625e-08 - 1.0  # (-1, 1), 2⁻²³ steps
        if abs(u) < R[layer]:
            out[j] = u * X[layer]
            j += 1
        elif layer == 0:  # the tail beyond X[1] = r
            r = X[1]
            while True:
                a, pos, block = uniform(b, i, stream, k0, k1, words, pos, block)
                c, pos, block = uniform(b, i, stream, k0, k1, words, pos, block)
                x = np.log(a) / r
                if -2.0 * np.log(c) >= x * x:
                    break
            out[j] = x - r if u < 0 else r - x
            j += 1
        else:
            x = u * X[layer]
            f0 = np.exp(-0.5 * (X[layer] * X[layer] - x * x))
            f1 = np.exp(-0.5 * (X[layer + 1] * X[layer + 1] - x * x))
            a, pos, block = uniform(b, i, stream, k0, k1, words, pos, block)
            if f1 + a * (f0 - f1) < 1.0:
                out[j] = x
                j += 1


def kernel_reference(k0, k1, gamma, sigma_w, sigma_e, chol, X, R, Z, target, first, stop):
    """The scalar sampler: each stream's words drawn and consumed one at a time (the naive twin of kernel)."""
    G, B, T, D = Z.shape
    d = D - 1
    words = np.empty(4, np.int64)
    xi = np.empty(d, np.float64)
    eps = np.empty(d, np.float64)
    x = np.empty(d, np.float64)
    w = np.empty((G, d), np.float64)
    for b in range(first, stop):
        normals(b, 0, {_W_INIT}, k0, k1, d, words, eps, X, R)
        for g in range(G):
            for e in range(d):
                w[g, e] = sigma_w[g] * eps[e]
        for i in range(T):
            normals(b, i, {_X}, k0, k1, d, words, xi, X, R)
            normals(b, i, {_E}, k0, k1, d, words, eps, X, R)
            for e in range(d):
                acc = 0.0
                for f in range(e + 1):
                    acc += chol[e, f] * xi[f]
                x[e] = acc
            for g in range(G):
                y = 0.0
                for e in range(d):
                    w[g, e] = gamma[g] * w[g, e] + sigma_e[g] * eps[e]
                    y += w[g, e] * x[e]
                    Z[g, b, i, e] = x[e]
                if i == T - 1:
                    Z[g, b, i, d] = 0.0
                    target[g, b] = y
                else:
                    Z[g, b, i, d] = y

def philox_lanes(b, round_keys, c1, c2, c3, words):
    """Philox4x32-10 of the counters (b, c1[l], c2[l], c3[l]) of every lane l into words[0:4, l]: the rounds written
    out and the words stored lane-minor, so that LLVM vectorises the loop over the lanes (8 lanes per AVX-512
    instruction). round_keys (10, 2): the key of each round."""
    mask = np.uint64(0xFFFFFFFF)
    hi = np.uint64(32)
    x0b = np.uint64(b) & mask  # masked: LLVM then knows every product is 32 × 32 bits (one vpmuludq)
{_round_key_lines()}
    for l in range(c1.shape[0]):
        x0 = x0b
        x1 = c1[l] & mask
        x2 = c2[l] & mask
        x3 = c3[l] & mask
{_round_lines()}
        words[0, l] = np.int64(x0)
        words[1, l] = np.int64(x1)
        words[2, l] = np.int64(x2)
        words[3, l] = np.int64(x3)


def word(wflat, L, base, q, nbw, b, i, stream, k0, k1, extra):
    """Word q of the stream whose first nbw words lie in the lanes base, base + 1, ... of wflat (words (4, L) flattened:
    word q of a lane is row q mod 4); later blocks are drawn here (extra[0:4], extra[4] the block they are)."""
    if q < nbw:
        return wflat[(q & 3) * L + base + (q >> 2)]
    block = q // 4
    if extra[4] != block:
        philox(np.uint64(b), np.uint64(i), np.uint64(stream), np.uint64(block), k0, k1, extra)
        extra[4] = block
    return extra[q % 4]


def fast_prefix(wflat, L, base, n, out, X, R):
    """The stream's first normals while its words take the ziggurat's fast path, into out: how many (≤ n). A plain
    loop without calls: 98.5 % of words take the fast path, and 86 % of streams of 10 normals never leave it."""
    for k in range(n):
        w = wflat[(k & 3) * L + base + (k >> 2)]
        layer = w & 255
        u = 2.0 * (np.float64(w >> 8) + 0.5) * 5.9604644775390625e-08 - 1.0
        if abs(u) >= R[layer]:
            return k
        out[k] = u * X[layer]
    return n


def walk(wflat, L, base, nbw, b, i, stream, k0, k1, n, out, X, R, extra, start):
    """The normals start..n-1 of the stream (b, i, stream) into out, its words 0..start-1 having given normals
    0..start-1 on the fast path (fast_prefix): normals()'s ziggurat on the same words, read from the lanes drawn
    ahead (word())."""
    extra[4] = -1
    q = start
    j = start
    while j < n:
        while q < nbw:  # fast_prefix's loop on the words drawn ahead, until a word leaves the fast path
            w = wflat[(q & 3) * L + base + (q >> 2)]
            u = 2.0 * (np.float64(w >> 8) + 0.5) * 5.9604644775390625e-08 - 1.0
            if abs(u) >= R[w & 255]:
                break
            out[j] = u * X[w & 255]
            j += 1
            q += 1
            if j == n:
                return
        w = word(wflat, L, base, q, nbw, b, i, stream, k0, k1, extra)
        q += 1
        layer = w & 255
        u = 2.0 * (np.float64(w >> 8) + 0.5) * 5.9604644775390625e-08 - 1.0
        if abs(u) < R[layer]:
            out[j] = u * X[layer]
            j += 1
        elif layer == 0:  # the tail beyond X[1] = r
            r = X[1]
            while True:
                a = (np.float64(word(wflat, L, base, q, nbw, b, i, stream, k0, k1, extra)) + 0.5) * 2.3283064365386963e-10
                c = (np.float64(word(wflat, L, base, q + 1, nbw, b, i, stream, k0, k1, extra)) + 0.5) * 2.3283064365386963e-10
                q += 2
                x = np.log(a) / r
                if -2.0 * np.log(c) >= x * x:
                    break
            out[j] = x - r if u < 0 else r - x
            j += 1
        else:
            x = u * X[layer]
            f0 = np.exp(-0.5 * (X[layer] * X[layer] - x * x))
            f1 = np.exp(-0.5 * (X[layer + 1] * X[layer + 1] - x * x))
            a = (np.float64(word(wflat, L, base, q, nbw, b, i, stream, k0, k1, extra)) + 0.5) * 2.3283064365386963e-10
            q += 1
            if f1 + a * (f0 - f1) < 1.0:
                out[j] = x
                j += 1


def kernel(k0, k1, round_keys, gamma, sigma_w, sigma_e, chol, diagonal, X, R, Z, target, first, stop):
    """kernel_reference's batch, bit for bit: per prompt, the first blocks of all its 2T + 1 streams are drawn in one
    vectorised pass (philox_lanes), and each stream's normals are then read off its words (walk), which draws a
    further block only when a stream needs one (about 1 % of them)."""
    G, B, T, D = Z.shape
    d = D - 1
    nb = (d + 5) // 4  # blocks drawn ahead per stream: d words and at least two to spare for the slow path
    nbw = 4 * nb
    S = 2 * T + 1  # streams of a prompt: w_0's, then the inputs' and the increments' of each position
    L = S * nb
    c1 = np.empty(L, np.uint64)
    c2 = np.empty(L, np.uint64)
    c3 = np.empty(L, np.uint64)
    for s in range(S):
        for k in range(nb):
            c1[s * nb + k] = 0 if s == 0 else (s - 1) // 2
            c2[s * nb + k] = {_W_INIT} if s == 0 else ({_X} if (s - 1) % 2 == 0 else {_E})
            c3[s * nb + k] = k
    words = np.empty((4, L), np.int64)
    wflat = words.reshape(4 * L)
    extra = np.empty(5, np.int64)
    xi = np.empty(d, np.float64)
    eps = np.empty(d, np.float64)
    x = np.empty(d, np.float64)
    w = np.empty((G, d), np.float64)
    for b in range(first, stop):
        philox_lanes(b, round_keys, c1, c2, c3, words)
        k = fast_prefix(wflat, L, 0, d, eps, X, R)
        if k < d:
            walk(wflat, L, 0, nbw, b, 0, {_W_INIT}, k0, k1, d, eps, X, R, extra, k)
        for g in range(G):
            for e in range(d):
                w[g, e] = sigma_w[g] * eps[e]
        for i in range(T):
            k = fast_prefix(wflat, L, (1 + 2 * i) * nb, d, xi, X, R)
            if k < d:
                walk(wflat, L, (1 + 2 * i) * nb, nbw, b, i, {_X}, k0, k1, d, xi, X, R, extra, k)
            k = fast_prefix(wflat, L, (2 + 2 * i) * nb, d, eps, X, R)
            if k < d:
                walk(wflat, L, (2 + 2 * i) * nb, nbw, b, i, {_E}, k0, k1, d, eps, X, R, extra, k)
            if diagonal:  # the triangular product's value when its off-diagonal terms are zeros
                for e in range(d):
                    x[e] = chol[e, e] * xi[e]
            else:
                for e in range(d):
                    acc = 0.0
                    for f in range(e + 1):
                        acc += chol[e, f] * xi[f]
                    x[e] = acc
            for g in range(G):
                y = 0.0
                for e in range(d):
                    w[g, e] = gamma[g] * w[g, e] + sigma_e[g] * eps[e]
                    y += w[g, e] * x[e]
                    Z[g, b, i, e] = x[e]
                if i == T - 1:
                    Z[g, b, i, d] = 0.0
                    target[g, b] = y
                else:
                    Z[g, b, i, d] = y
'''


@functools.cache
def _ziggurat() -> tuple[np.ndarray, np.ndarray]:
    """The 256-layer ziggurat tables (Marsaglia and Tsang 2000's r and v): abscissae X (257,), X[1] = r, X[256] = 0,
    and ratios R[i] = X[i+1]/X[i] (layer 0 is the base strip with the tail, X[0] = v/f(r)).

    256 layers, not Doornik's 128: a word takes the fast path with probability mean(R) = 98.5 % against 97.2 %, so
    14 % of the streams of 10 normals leave it against 24 %, and the slow path was a quarter of the sampler's time."""
    C, r, v = 256, 3.6541528853610088, 4.92867323399e-3
    X = np.zeros(C + 1)
    f = np.exp(-0.5 * r * r)
    X[0], X[1] = v / f, r
    for i in range(2, C):
        X[i] = np.sqrt(-2.0 * np.log(v / X[i - 1] + f))
        f = np.exp(-0.5 * X[i] * X[i])
    return X, X[1:] / X[:-1]


@functools.cache
def _kernels():
    """(kernel, kernel_shared), compiled once (iclab.ops._runtime.numba_cache's cache)."""
    return tuple(compile_kernels(_source(), ["philox", "uniform", "normals", "kernel_reference", "philox_lanes", "word",
                                             "fast_prefix", "walk", "kernel", "kernel_shared"],
                                 label="iclab drift sampling kernel", nogil=True, boundscheck=False)[-2:])


def _kernel():
    """The tokens kernel."""
    return _kernels()[0]


def _host(key, gamma, sigma_w, sigma_e, chol, *, B: int, T: int, dtype, shared: bool = False,
          normals: str = "ziggurat", out=None):
    """The batch, written into ``out`` (the result buffers of the host call) when given."""
    key = np.asarray(key, np.uint32)
    G, d = gamma.shape[0], chol.shape[0]
    if out is None and shared:
        out = (np.empty((B, T, d), dtype), np.empty((G, B, T), dtype), np.empty((G, B), dtype))
    elif out is None:
        out = (np.empty((G, B, T, d + 1), dtype), np.empty((G, B), dtype))
    if normals == "box_muller":
        params = [np.asarray(a, np.float64) for a in (chol, gamma, sigma_w, sigma_e)]
        run_split(functools.partial(_drift_ir.sample, round_keys(key[0], key[1]), *params, out), B,
                  threads=thread_count())  # prompts split over threads
        return out
    chol = np.asarray(chol, np.float64)
    args = (np.uint64(key[0]), np.uint64(key[1]), round_keys(key[0], key[1]),
            *(np.asarray(a, np.float64) for a in (gamma, sigma_w, sigma_e)), chol,
            bool(np.all(chol == np.diag(np.diag(chol)))), *_ziggurat(), *out)
    run_split(_kernels()[1 if shared else 0], B, *args, threads=thread_count())  # prompts split over threads
    return out


#: The standard normals' generators (module docstring).
NORMALS = ("ziggurat", "box_muller")


def _call(key, B, gamma, sigma_w2, sigma_e2, n, Lam, dtype, shared, normals):
    if n < 1 or B < 1:
        raise ValueError(f"n and B must be >= 1 (got n={n}, B={B})")
    if normals not in NORMALS:
        raise ValueError(f"normals must be one of {', '.join(NORMALS)} (got {normals!r})")
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    gamma, sigma_w2, sigma_e2 = jnp.broadcast_arrays(*(jnp.atleast_1d(jnp.asarray(v, jnp.float64))
                                                       for v in (gamma, sigma_w2, sigma_e2)))
    Lam = jnp.asarray(Lam, jnp.float64)
    chol = jnp.linalg.cholesky(Lam)
    G, d, T = gamma.shape[0], Lam.shape[-1], n + 1
    if shared:
        shapes = (jax.ShapeDtypeStruct((B, T, d), dtype), jax.ShapeDtypeStruct((G, B, T), dtype),
                  jax.ShapeDtypeStruct((G, B), dtype))
    else:
        shapes = (jax.ShapeDtypeStruct((G, B, T, d + 1), dtype), jax.ShapeDtypeStruct((G, B), dtype))
    host = functools.partial(_host, B=B, T=T, dtype=np.dtype(dtype), shared=shared, normals=normals)
    return host_call(host, shapes, jnp.asarray(data, jnp.uint32), gamma, jnp.sqrt(sigma_w2),
                     jnp.sqrt(sigma_e2), chol, vmap_method="sequential", writes_out=True)


def sample_training_batch(key: jax.Array, B: int, *, gamma, sigma_w2, sigma_e2, n: int, Lam, dtype=jnp.float32,
                          normals: str = "ziggurat"):
    """Tokens and targets of B drifting-task prompts per process, by the compiled sampler (module docstring).

    Args:
        key: a raw (2,) uint32 PRNG key (typed keys: their key data); vmap over keys draws each key's batch.
        B: prompts per process.
        gamma, sigma_w2, sigma_e2: AR(1) coefficients and variances, scalars or arrays of one shape (G,).
        n: labelled context pairs (T = n+1 tokens).
        Lam: (d, d) input covariance Λ (positive definite).
        dtype: float dtype of the result (the draws are computed in float64).
        normals: the standard normals' generator, ``ziggurat`` or ``box_muller`` (module docstring): two streams of
            one process.
    Returns:
        (Z, y): Z (G, B, n+1, d+1) tokens with the query's label 0, y (G, B) the query's label y_{n+1};
        G = 1 for scalar process parameters.
    """
    return _call(key, B, gamma, sigma_w2, sigma_e2, n, Lam, dtype, shared=False, normals=normals)


def sample_shared_batch(key: jax.Array, B: int, *, gamma, sigma_w2, sigma_e2, n: int, Lam, dtype=jnp.float32,
                        normals: str = "ziggurat"):
    """``sample_training_batch``'s batch in the shared layout: the inputs once, the labels per process.

    The G processes share their inputs (common random numbers), so Z_g = [X, Y_g] bit for bit (tested), at
    (d + G)/(G(d+1)) of the memory (30 MB against 111 MB for drift.fig1's batch); the read-out kernel
    ``ops.decayed_attention.forget.readout_grid_shared`` consumes it.

    Args:
        key: a raw (2,) uint32 PRNG key (typed keys: their key data).
        B: prompts per process.
        gamma, sigma_w2, sigma_e2: AR(1) coefficients and variances, scalars or arrays of one shape (G,).
        n: labelled context pairs (T = n+1 tokens).
        Lam: (d, d) input covariance Λ (positive definite).
        dtype: float dtype of the result (the draws are computed in float64).
        normals: the standard normals' generator, ``ziggurat`` or ``box_muller`` (module docstring).
    Returns:
        (X, Y, y): X (B, n+1, d) inputs (the query last), Y (G, B, n+1) labels with the query's label 0, y (G, B)
        the query's label y_{n+1}.
    """
    return _call(key, B, gamma, sigma_w2, sigma_e2, n, Lam, dtype, shared=True, normals=normals)
