"""Training batches of the drifting task drawn by a compiled CPU kernel (numba): the tokens and targets only.

The same model as :func:`iclab.tasks.drift.sample_drift_prompts` (eqs 2-3), for a grid of AR(1) processes g:

    x_i = L ξ_i (Λ = L Lᵀ),   w_0 = σ_w ε_0,   w_i = γ_g w_{i-1} + σ_e ε_i,   y_i = ⟨w_i, x_i⟩,   i = 1..n+1,

returned as tokens Z (G, B, n+1, d+1) (query label 0) and targets y_{n+1} (G, B), the batch the drift
trainings consume. All processes share the ξ and ε (common random numbers, as in ``sample_drift_prompts``), so
row g equals the draw for γ_g alone.

The standard normals come from another stream: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011), a counter-based generator keyed by the two 32-bit words of the JAX key, with the counter
(prompt b, position i, stream, block), and a 128-layer ziggurat (one 32-bit word per normal on its fast path). A normal is
a function of (key, b, i, coordinate) alone, so the batch does not depend on the thread count, and a vmapped
call draws each key's numbers by itself. Why: XLA's normal sampler (RNG bits and an erfinv transform) cost
0.3 s of drift.fig1's 0.95 s step at batch 5000 (10⁷ normals); here one pass draws the normals, runs the
AR(1) recursion and writes the tokens. The draws differ from ``sample_drift_prompts``' (another generator);
their distribution is the same, which the tests check against the process's moments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab._host import host_call
from iclab._numba import compile_kernels
from iclab.threads import thread_count

__all__ = ["sample_training_batch"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
#: Counter streams: inputs ξ, the initial task ε_0, the drift increments ε_i.
_X, _W_INIT, _E = 0, 1, 2


def _source() -> str:
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
    """n standard normals of the stream (b, i, stream) into out[0:n]: the 128-layer ziggurat (Marsaglia and
    Tsang 2000, with Doornik's 2005 tables and tail), whose layer (7 bits) and abscissa (25 bits) are disjoint bits
    of one word, so the fast path (98.8 %) costs one word."""
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
        layer = w & 127
        u = 2.0 * (np.float64(w >> 7) + 0.5) * 2.9802322387695312e-08 - 1.0  # (-1, 1), 2⁻²⁵ steps
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


def kernel(k0, k1, gamma, sigma_w, sigma_e, chol, X, R, Z, target, first, stop):
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
'''


@functools.cache
def _ziggurat() -> tuple[np.ndarray, np.ndarray]:
    """Doornik's 128-layer ziggurat tables: abscissae X (129,), X[1] = r, X[128] = 0, and ratios R[i] = X[i+1]/X[i]
    (layer 0 is the base strip with the tail, X[0] = v/f(r))."""
    C, r, v = 128, 3.442619855899, 9.91256303526217e-3
    X = np.zeros(C + 1)
    f = np.exp(-0.5 * r * r)
    X[0], X[1] = v / f, r
    for i in range(2, C):
        X[i] = np.sqrt(-2.0 * np.log(v / X[i - 1] + f))
        f = np.exp(-0.5 * X[i] * X[i])
    return X, X[1:] / X[:-1]


@functools.cache
def _kernel():
    return compile_kernels(_source(), ["philox", "uniform", "normals", "kernel"], label="iclab drift sampling kernel",
                           nogil=True, boundscheck=False)[-1]


def _host(key, gamma, sigma_w, sigma_e, chol, *, B: int, T: int, dtype):
    key = np.asarray(key, np.uint32)
    G, d = gamma.shape[0], chol.shape[0]
    Z = np.empty((G, B, T, d + 1), dtype)
    target = np.empty((G, B), dtype)
    args = (np.uint64(key[0]), np.uint64(key[1]), *(np.asarray(a, np.float64) for a in (gamma, sigma_w, sigma_e, chol)),
            *_ziggurat(), Z, target)
    kernel = _kernel()
    threads = max(1, min(thread_count(), B))
    bounds = [B * i // threads for i in range(threads + 1)]
    if threads == 1:
        kernel(*args, 0, B)
    else:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:  # the kernel releases the GIL
            list(pool.map(lambda i: kernel(*args, bounds[i], bounds[i + 1]), range(threads)))
    return Z, target


def sample_training_batch(key: jax.Array, B: int, *, gamma, sigma_w2, sigma_e2, n: int, Lam, dtype=jnp.float32):
    """Tokens and targets of B drifting-task prompts per process, by the compiled sampler (module docstring).

    Args:
        key: a raw (2,) uint32 PRNG key (typed keys: their key data); vmap over keys draws each key's batch.
        B: prompts per process.
        gamma, sigma_w2, sigma_e2: AR(1) coefficients and variances, scalars or arrays of one shape (G,).
        n: labelled context pairs (T = n+1 tokens).
        Lam: (d, d) input covariance Λ (positive definite).
        dtype: float dtype of the result (the draws are computed in float64).
    Returns:
        (Z, y): Z (G, B, n+1, d+1) tokens with the query's label 0, y (G, B) the query's label y_{n+1};
        G = 1 for scalar process parameters.
    """
    if n < 1 or B < 1:
        raise ValueError(f"n and B must be >= 1 (got n={n}, B={B})")
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    gamma, sigma_w2, sigma_e2 = jnp.broadcast_arrays(*(jnp.atleast_1d(jnp.asarray(v, jnp.float64))
                                                       for v in (gamma, sigma_w2, sigma_e2)))
    Lam = jnp.asarray(Lam, jnp.float64)
    chol = jnp.linalg.cholesky(Lam)
    G, d = gamma.shape[0], Lam.shape[-1]
    shapes = (jax.ShapeDtypeStruct((G, B, n + 1, d + 1), dtype), jax.ShapeDtypeStruct((G, B), dtype))
    host = functools.partial(_host, B=B, T=n + 1, dtype=np.dtype(dtype))
    return host_call(host, shapes, jnp.asarray(data, jnp.uint32), gamma, jnp.sqrt(sigma_w2),
                     jnp.sqrt(sigma_e2), chol, vmap_method="sequential")
