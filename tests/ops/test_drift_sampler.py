"""The compiled sampler of drift training batches (ops.drift_sampler.native): its generator against Random123's known
answers, its normals against N(0, 1), its batches against the process's moments (Lemma 1) at a few standard errors,
and its structure: the tokens' layout, common random numbers over a grid of processes, keys, vmap, threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import iclab  # noqa: F401  (float64)
import iclab.theory.drift as theory
from iclab.ops.drift_sampler import native


def _draw(key, B, *, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1, n=6, Lam=None, dtype=jnp.float64, normals="ziggurat"):
    Lam = jnp.eye(2) if Lam is None else Lam
    Z, y = native.sample_training_batch(jax.random.PRNGKey(key), B, gamma=gamma, sigma_w2=sigma_w2,
                                        sigma_e2=sigma_e2, n=n, Lam=Lam, dtype=dtype, normals=normals)
    return np.asarray(Z), np.asarray(y)


NORMALS = pytest.mark.parametrize("normals", native.NORMALS)


@pytest.mark.parametrize("counter,key,expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_matches_the_random123_known_answers(counter, key, expected):
    import numba

    namespace = {"np": np}
    exec(compile(native._source(), "<test>", "exec"), namespace)
    philox = numba.njit(namespace["philox"])
    out = np.empty(4, np.int64)
    philox(*(np.uint64(v) for v in counter + key), out)
    assert tuple(int(v) for v in out) == expected
    # the vectorised form, the counter in lane 2 of 9 (the other lanes hold other counters)
    lanes = numba.njit(namespace["philox_lanes"])
    c = [np.arange(9, dtype=np.uint64) for _ in range(3)]
    for j in range(3):
        c[j][2] = counter[j + 1]
    words = np.empty((4, 9), np.int64)
    lanes(counter[0], native.round_keys(*key), *c, words)
    assert tuple(int(v) for v in words[:, 2]) == expected
    # Box-Muller's twin (the IR kernel's Philox equals it bit for bit: test_box_muller_kernel_equals_its_numpy_twin)
    from iclab.ops.drift_sampler import _ir as ir

    assert tuple(int(v) for v in ir._philox_np(*counter, native.round_keys(*key))) == expected


def _kernels():
    import importlib

    module = importlib.import_module(native._kernel().__module__)
    return module.kernel, module.kernel_reference


@pytest.mark.parametrize("d,chol", [(1, None), (3, "full"), (10, None), (10, "full")])
def test_vectorised_kernel_equals_the_scalar_reference(d, chol):
    """The kernel in use (Philox drawn ahead over lanes, a fast-path prefix, then the slow path) against the scalar
    kernel, bit for bit, with diagonal and full Cholesky factors. Of the 2 × 41 × 1500 + 1500 streams, some need a block
    beyond those drawn ahead, so word()'s later blocks are compared too (with the 256-layer tables, per key and
    diagonal factor: 7-10 at d = 1, 1 at d = 3, 930-990 at d = 10)."""
    kernel, reference = _kernels()
    rng = np.random.default_rng(d)
    L = np.eye(d) if chol is None else np.linalg.cholesky(np.cov(rng.normal(size=(d, 4 * d))) + np.eye(d))
    G, B, T = 3, 1500, 41
    common = (np.array([0.8, 0.95, 1.0]), np.array([1.0, 0.5, 2.0]), np.array([0.1, 0.2, 0.0]), L)
    X, R = native._ziggurat()
    for key in ((0, 0), (0xDEADBEEF, 12345)):
        out = [np.full((G, B, T, d + 1), np.nan), np.full((G, B), np.nan)]
        ref = [np.full((G, B, T, d + 1), np.nan), np.full((G, B), np.nan)]
        k = (np.uint64(key[0]), np.uint64(key[1]))
        kernel(*k, native.round_keys(*key), *common, bool(chol is None), X, R, *out, 0, B)
        reference(*k, *common, X, R, *ref, 0, B)
        np.testing.assert_array_equal(out[0], ref[0])
        np.testing.assert_array_equal(out[1], ref[1])


@NORMALS
def test_normals_are_standard_normal(normals):
    """Λ = I, so the tokens' inputs are the raw normals: Kolmogorov-Smirnov against N(0, 1), the tail beyond the
    ziggurat's base strip r = 3.65 and the fourth moment, at 10⁶ draws; Box-Muller's normals within its 6.66 σ."""
    Z, _ = _draw(0, 10_000, n=49, normals=normals)
    x = Z[0, :, :, :2].ravel()  # 10⁶
    assert stats.kstest(x, "norm").pvalue > 1e-4
    if normals == "box_muller":
        assert np.max(np.abs(x)) <= np.sqrt(-2 * np.log(0.5 * 2.0 ** -32))
    r = native._ziggurat()[0][1]  # the base strip's edge
    tail, p = np.mean(np.abs(x) > r), 2 * stats.norm.sf(r)
    assert abs(tail - p) < 5 * np.sqrt(p / x.size)
    assert abs(np.mean(x ** 4) - 3) < 5 * np.sqrt(96 / x.size)  # Var(x⁴) = 105 − 9


@NORMALS
@pytest.mark.parametrize("gamma,sw2,se2", [(0.8, 1.0, 0.1), (1.0, 0.5, 0.02)])
def test_batches_have_the_processes_moments(gamma, sw2, se2, normals):
    """Λ = I, d = 2: E[y_a²] = d c(a, a) and E[(y_a x_a)(y_b x_b)] = c(a, b) per coordinate for a ≠ b (Lemma 1's
    c), at 5 standard errors."""
    B, n, d = 40_000, 5, 2
    Z, target = _draw(1, B, gamma=gamma, sigma_w2=sw2, sigma_e2=se2, n=n, normals=normals)
    C = theory.ar1_covariance(gamma=gamma, sigma_w2=sw2, sigma_e2=se2, n=n)
    x, y = Z[0, :, :, :d], np.concatenate([Z[0, :, :-1, d], target[0][:, None]], axis=1)  # (B, n+1, d), (B, n+1)
    sq = y ** 2
    assert np.all(np.abs(sq.mean(0) - d * np.diag(C)) <= 5 * sq.std(0) / np.sqrt(B))
    s = y[:, :, None] * x  # y_a x_a: E[s_a s_bᵀ] = C[a, b] I for a ≠ b
    prod = np.einsum("bae,bce->bac", s, s) / d
    off = ~np.eye(n + 1, dtype=bool)
    assert np.all(np.abs(prod.mean(0) - C)[off] <= 5 * (prod.std(0) / np.sqrt(B))[off])


@NORMALS
def test_inputs_have_covariance_lambda(normals):
    Lam = np.array([[2.0, 0.3], [0.3, 0.5]])
    Z, _ = _draw(2, 20_000, n=4, Lam=jnp.asarray(Lam), normals=normals)
    x = Z[0, :, :, :2].reshape(-1, 2)
    np.testing.assert_allclose(x.T @ x / len(x), Lam, atol=5 * 2.0 / np.sqrt(len(x)))


@NORMALS
def test_token_layout_and_common_random_numbers(normals):
    """Labels in the last column, 0 at the query, the target its label; a (G,) grid of processes equals G single
    draws from the same key (row by row), and shares its inputs."""
    gam, sw, se = jnp.array([0.8, 0.95, 1.0]), jnp.array([1.0, 2.0, 1.0]), jnp.array([0.01, 0.1, 0.0])
    Z, y = _draw(3, 7, gamma=gam, sigma_w2=sw, sigma_e2=se, n=5, Lam=jnp.eye(3), normals=normals)
    assert Z.shape == (3, 7, 6, 4) and y.shape == (3, 7)
    np.testing.assert_array_equal(Z[..., -1, -1], 0.0)
    for g in range(3):
        np.testing.assert_array_equal(Z[g, ..., :3], Z[0, ..., :3])
        Zg, yg = _draw(3, 7, gamma=float(gam[g]), sigma_w2=float(sw[g]), sigma_e2=float(se[g]), n=5, Lam=jnp.eye(3),
                       normals=normals)
        np.testing.assert_array_equal(Zg[0], Z[g])
        np.testing.assert_array_equal(yg[0], y[g])
    # γ = 1, σ_e = 0: one task per prompt, so y = ⟨w, x⟩ is linear in x with one w per prompt
    x, lab = Z[2, :, :-1, :3], Z[2, :, :-1, 3]
    w = np.stack([np.linalg.lstsq(x[b], lab[b], rcond=None)[0] for b in range(7)])
    np.testing.assert_allclose(np.einsum("bd,btd->bt", w, x), lab, atol=1e-10)


@NORMALS
def test_keys_vmap_threads_and_dtype(monkeypatch, normals):
    a, b = _draw(4, 50, normals=normals), _draw(5, 50, normals=normals)
    assert not np.allclose(a[0], b[0])
    keys = jnp.stack([jax.random.PRNGKey(4), jax.random.PRNGKey(5)])
    Zs, ys = jax.vmap(lambda k: native.sample_training_batch(k, 50, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1, n=6,
                                                             Lam=jnp.eye(2), dtype=jnp.float64,
                                                             normals=normals))(keys)
    np.testing.assert_array_equal(Zs[0], a[0])
    np.testing.assert_array_equal(Zs[1], b[0])
    for threads in (1, 3):  # 50 prompts over 3 threads: ranges that do not fill Box-Muller's lanes of 4
        monkeypatch.setattr(native, "thread_count", lambda t=threads: t)
        np.testing.assert_array_equal(_draw(4, 50, normals=normals)[0], a[0])
    Z32, y32 = _draw(4, 50, dtype=jnp.float32, normals=normals)
    assert Z32.dtype == np.float32
    np.testing.assert_array_equal(Z32, a[0].astype(np.float32))
    with pytest.raises(ValueError, match="n and B"):
        _draw(4, 0, normals=normals)
    with pytest.raises(ValueError, match="normals must be one of ziggurat, box_muller"):
        _draw(4, 5, normals="polar")


@NORMALS
def test_shared_layout_is_the_tokens_bit_for_bit(normals):
    """sample_shared_batch: the inputs once and each process's labels, Z_g = [X, Y_g] and the same targets, bit for
    bit, with a full Λ and in float32."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((3, 3))
    kw = dict(gamma=jnp.array([0.8, 0.95, 1.0]), sigma_w2=1.0, sigma_e2=jnp.array([0.1, 0.05, 0.0]), n=12,
              Lam=A @ A.T + np.eye(3), normals=normals)
    for dtype in (jnp.float64, jnp.float32):
        Z, y = native.sample_training_batch(jax.random.PRNGKey(8), 70, dtype=dtype, **kw)
        X, Y, y2 = native.sample_shared_batch(jax.random.PRNGKey(8), 70, dtype=dtype, **kw)
        assert X.shape == (70, 13, 3) and Y.shape == (3, 70, 13) and X.dtype == dtype
        np.testing.assert_array_equal(Z[..., :-1], np.broadcast_to(X, Z.shape[:-1] + (3,)))
        np.testing.assert_array_equal(Z[..., -1], Y)
        np.testing.assert_array_equal(y, y2)


# --------------------------------------------------------------------------------------------
# Box-Muller's kernel (ops.drift_sampler._ir) against its numpy twin


@pytest.mark.parametrize("d,full", [(1, False), (3, True), (10, False), (10, True)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_box_muller_kernel_equals_its_numpy_twin(d, full, dtype):
    """The IR kernel (Philox, Box-Muller, the AR(1) recursion over lanes of 4 prompts) against ``reference`` (numpy,
    the same operations), bit for bit, in both layouts, with a diagonal and a full Cholesky factor, an odd batch (the
    last lanes empty) and the batch cut into ranges that do not start at a lane boundary."""
    from iclab.ops.drift_sampler import _ir as ir

    rng = np.random.default_rng(d)
    L = np.linalg.cholesky(np.cov(rng.normal(size=(d, 4 * d))) + np.eye(d)) if full else np.diag(rng.uniform(0.5, 2, d))
    G, B, T = 3, 37, 9
    gamma, sw, se = np.array([0.8, 0.95, 1.0]), np.array([1.0, 0.5, 2.0]), np.array([0.1, 0.2, 0.0])
    keys = native.round_keys(0xDEADBEEF, 12345)
    xs, ys, tg = ir.reference(keys, L, gamma, sw, se, B, T, dtype)
    shared = (np.full((B, T, d), np.nan, dtype), np.full((G, B, T), np.nan, dtype), np.full((G, B), np.nan, dtype))
    tokens = (np.full((G, B, T, d + 1), np.nan, dtype), np.full((G, B), np.nan, dtype))
    for out in (shared, tokens):
        for first, stop in ((0, 5), (5, 6), (6, B)):
            ir.sample(keys, L, gamma, sw, se, out, first, stop)
    for a, b in zip(shared, (xs, ys, tg)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(tokens[0][..., :d], np.broadcast_to(xs, (G, B, T, d)))
    np.testing.assert_array_equal(tokens[0][..., d], ys)
    np.testing.assert_array_equal(tokens[1], tg)


def test_box_muller_functions_are_accurate():
    """ln u, cos 2πu and sin 2πu as the kernel computes them (the twin's functions, equal to it bit for bit by the
    test above) against numpy's, over 32-bit uniforms including both ends: within a few ulp (3 ulp for ln,
    ≈ 7·10⁻¹⁶ for cos and sin)."""
    from iclab.ops.drift_sampler import _ir as ir

    w = np.concatenate([np.random.default_rng(0).integers(0, 2 ** 32, 10 ** 6, dtype=np.uint64),
                        np.array([0, 1, 2 ** 31, 2 ** 32 - 2, 2 ** 32 - 1], np.uint64)])
    u = (w.astype(np.float64) + 0.5) * 2.0 ** -32
    eps = np.finfo(np.float64).eps
    assert np.max(np.abs(ir._log_np(u) / np.log(u) - 1)) <= 6 * eps
    c, s = ir._cos_sin_np(u)
    assert np.max(np.abs(c - np.cos(2 * np.pi * u))) <= 6 * eps
    assert np.max(np.abs(s - np.sin(2 * np.pi * u))) <= 6 * eps
    z = ir.normals_np(w[:-1])  # pairs
    r = np.sqrt(-2 * np.log(u[:-1:2]))
    np.testing.assert_allclose(z[0::2], r * np.cos(2 * np.pi * u[1::2]), rtol=0, atol=1e-14)
    np.testing.assert_allclose(z[1::2], r * np.sin(2 * np.pi * u[1::2]), rtol=0, atol=1e-14)
