"""The compiled read-out kernel of a grid of one-layer GLA models (iclab.ops.forget_readout_grid) against its
naive twin, gla_forget.gla_readout vmapped over the grid: predictions and gradients with respect to every weight
and λ, in float64 (to rounding) and float32 (to float32 rounding), under jit and vmap, at block-boundary batch
sizes; and its result does not depend on the number of threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.models import gla_forget as gla
from iclab.ops.decayed_attention import forget as native
from iclab.ops._runtime.blocked import LANES
from iclab.tasks.drift import sample_drift_prompts, tokens

#: One token width for every test: the kernel compiles once per (width, dtype), a few seconds each.
D = 5


def _grid(kind, G, K, d, dtype, key=0):
    keys = jax.random.split(jax.random.PRNGKey(key), G * K)
    P = jax.vmap(lambda k: gla.init_gla(k, d, kind, 0.4, dtype=dtype))(keys)
    return jax.tree_util.tree_map(lambda a: a.reshape((G, K) + a.shape[1:]), P)


def _prompts(G, B, d, n, dtype, key=1):
    Lam = jnp.diag(jnp.linspace(1.5, 0.5, d))
    pr = sample_drift_prompts(jax.random.PRNGKey(key), B, gamma=jnp.linspace(0.8, 0.95, G), sigma_w2=1.0,
                              sigma_e2=0.05, n=n, Lam=Lam)
    return tokens(pr).astype(dtype), pr.target.astype(dtype)  # (G, B, T, d+1), (G, B)


def _loss_naive(P, lam, Z, y):
    yhat = jax.vmap(lambda p, Zg, lg: jax.vmap(lambda q, l: gla.gla_readout(q, Zg, l))(p, lg))(P, Z, lam)
    return jnp.sum(jnp.mean((yhat - y[:, None]) ** 2, -1) * jnp.arange(1, yhat.shape[1] + 1))


def _loss_native(P, lam, Z, y):
    WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(P)
    c = jnp.einsum("gbe,gkfe->gkbf", Z[:, :, -1, :], WKQ)
    yhat = native.readout_grid(Z, WV[..., -1, :], c, lam)
    return jnp.sum(jnp.mean((yhat - y[:, None]) ** 2, -1) * jnp.arange(1, yhat.shape[1] + 1))


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("kind,B", [("qkv", native.CHUNK + 3), ("merged", 5), ("restricted", 2 * native.CHUNK)])
def test_readout_grid_equals_the_naive_readout_with_gradients(kind, B):
    G, K, d, n = 2, 3, D - 1, 9
    P = _grid(kind, G, K, d, jnp.float64)
    lam = jnp.array([[0.6, 0.9, 1.0], [0.75, 0.3, 0.95]])
    Z, y = _prompts(G, B, d, n, jnp.float64)
    if kind == "restricted":  # fill the query's label slot, as a residual stream does, so its own term counts
        Z = Z.at[:, :, -1, -1].set(0.7)
    ref = jax.jit(jax.value_and_grad(_loss_naive, argnums=(0, 1)))(P, lam, Z, y)
    out = jax.jit(jax.value_and_grad(_loss_native, argnums=(0, 1)))(P, lam, Z, y)
    assert abs(float(out[0] - ref[0])) <= 1e-12 * abs(float(ref[0]))
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        assert a.shape == b.shape and _rel(a, b) < 1e-11


def test_readout_grid_shared_equals_readout_grid_on_the_tokens_with_gradients():
    """The shared layout (inputs once, labels per row): the same predictions bit for bit as readout_grid on the
    tokens Z_g = [X, Y_g], and the same gradients (the same kernel arithmetic on the same block buffer)."""
    G, K, d, n, B = 3, 2, D - 1, 11, native.CHUNK + 5
    P = _grid("qkv", G, K, d, jnp.float64)
    lam = jnp.array([[0.6, 0.9], [0.75, 1.0], [0.8, 0.95]])
    rng = np.random.default_rng(2)
    X, Y = jnp.asarray(rng.standard_normal((B, n + 1, d))), jnp.asarray(rng.standard_normal((G, B, n + 1)))
    Y = Y.at[:, :, -1].set(0.0)
    y = jnp.asarray(rng.standard_normal((G, B)))
    Z = jnp.concatenate([jnp.broadcast_to(X, (G,) + X.shape), Y[..., None]], axis=-1)

    def loss_shared(P, lam):
        WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(P)
        c = jnp.einsum("gbe,gkfe->gkbf", Z[:, :, -1, :], WKQ)
        yhat = native.readout_grid_shared(X, Y, WV[..., -1, :], c, lam)
        return jnp.sum(jnp.mean((yhat - y[:, None]) ** 2, -1) * jnp.arange(1, K + 1))

    ref = jax.jit(jax.value_and_grad(_loss_native, argnums=(0, 1)))(P, lam, Z, y)
    out = jax.jit(jax.value_and_grad(loss_shared, argnums=(0, 1)))(P, lam)
    assert float(out[0]) == float(ref[0])
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a second compilation of the kernel (float32), ~15 s
def test_readout_grid_in_float32_is_the_float64_result_to_float32_rounding():
    G, K, d, n, B = 2, 2, D - 1, 40, 100
    P = _grid("qkv", G, K, d, jnp.float64)
    lam = jnp.array([[0.7, 0.97], [0.85, 1.0]])
    Z, y = _prompts(G, B, d, n, jnp.float64)
    v64, g64 = jax.value_and_grad(_loss_native, argnums=(0, 1))(P, lam, Z, y)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    v32, g32 = jax.value_and_grad(_loss_native, argnums=(0, 1))(jax.tree_util.tree_map(f32, P), f32(lam), f32(Z), f32(y))
    assert v32.dtype == jnp.float32
    assert abs(float(v32) - float(v64)) < 1e-5 * abs(float(v64))
    for a, b in zip(jax.tree_util.tree_leaves(g32), jax.tree_util.tree_leaves(g64)):
        assert a.dtype == jnp.float32 and _rel(a.astype(jnp.float64), b) < 1e-4


@pytest.mark.slow  # 8 s of compilation; the trainer's vmap over seeds is also covered by test_drift_fig1's slow test
def test_readout_grid_under_vmap_is_the_grid_of_each_seed():
    S, G, K, d, n, B = 3, 1, 2, D - 1, 7, 10
    P = jax.vmap(lambda s: _grid("qkv", G, K, d, jnp.float64, key=s))(jnp.arange(S))
    lam = jnp.array([[0.8, 0.95]])
    Z, y = _prompts(G, B, d, n, jnp.float64)
    batched = jax.jit(jax.vmap(jax.grad(_loss_native), in_axes=(0, None, None, None)))(P, lam, Z, y)
    for s in range(S):
        one = jax.jit(jax.grad(_loss_naive))(jax.tree_util.tree_map(lambda a: a[s], P), lam, Z, y)
        for a, b in zip(jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(one)):
            assert _rel(a[s], b) < 1e-11


def test_readout_grid_does_not_depend_on_the_thread_count(monkeypatch):
    """Every output is summed by one thread in a fixed order: 1, 2 and 3 threads give the same bits, in either
    layout (the shared layout's jobs are blocks of every row, the tokens' blocks of one row)."""
    rng = np.random.default_rng(0)
    G, K, B, T = 2, 3, 3 * native.CHUNK + 1, 21
    Z, u, c = rng.standard_normal((G, B, T, D)), rng.standard_normal((G, K, D)), rng.standard_normal((G, K, B, D))
    lam = rng.uniform(0.3, 1.0, (G, K))
    Z[:, :, :, :-1] = Z[0, :, :, :-1]  # inputs shared by the rows: the shared layout's kernel reads the same tokens
    X, Y = Z[0, :, :, :-1].copy(), Z[..., -1].copy()
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        outs.append(native._host_forward(Z, u, c, lam))
        outs.append(native._host_forward_shared(X, Y, u, c, lam))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def _shared_batch(G, B, d, n, seed=3):
    """Shared-layout prompts (X, Y, y) in float64, the query's label 0, and their tokens Z_g = [X, Y_g]."""
    rng = np.random.default_rng(seed)
    X, Y = jnp.asarray(rng.standard_normal((B, n + 1, d))), jnp.asarray(rng.standard_normal((G, B, n + 1)))
    Y = Y.at[:, :, -1].set(0.0)
    y = jnp.asarray(rng.standard_normal((G, B)))
    return X, Y, y, jnp.concatenate([jnp.broadcast_to(X, (G,) + X.shape), Y[..., None]], axis=-1)


def _loss_fused(P, lam, X, Y, y):
    WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(P)
    losses = native.readout_mse_shared(X, Y, y, WV[..., -1, :], WKQ, lam)
    return jnp.sum(losses * jnp.arange(1, losses.shape[1] + 1))


@pytest.mark.parametrize("kind,B", [("qkv", LANES + 3), ("merged", 5), ("qkv", 2 * LANES)])
def test_readout_mse_shared_equals_the_naive_loss_with_gradients(kind, B):
    """The fused float32 loss kernel against its naive twin (gla_readout vmapped, JAX's gradient) in float64: the
    loss and the gradients of every weight and λ to float32 rounding, at batches across the blocks' lanes (spare
    lanes must add nothing), a learnt-λ-like spread of forget factors, 1.0 included."""
    G, K, d, n = 2, 3, D - 1, 12
    P = _grid(kind, G, K, d, jnp.float64)
    lam = jnp.array([[0.6, 0.9, 1.0], [0.75, 0.3, 0.95]])
    X, Y, y, Z = _shared_batch(G, B, d, n)
    ref = jax.jit(jax.value_and_grad(_loss_naive, argnums=(0, 1)))(P, lam, Z, y)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    out = jax.jit(jax.value_and_grad(_loss_fused, argnums=(0, 1)))(jax.tree_util.tree_map(f32, P), f32(lam), f32(X),
                                                                    f32(Y), f32(y))
    assert out[0].dtype == jnp.float32
    assert abs(float(out[0]) - float(ref[0])) < 1e-5 * abs(float(ref[0]))
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        assert a.shape == b.shape and a.dtype == jnp.float32 and _rel(a.astype(jnp.float64), b) < 2e-5


def test_readout_mse_shared_in_float64_equals_the_naive_loss_to_rounding():
    """The same kernel in float64: the loss and every gradient equal the naive twin's to float64 rounding, so an
    arithmetic slip that float32's tolerance could hide shows here."""
    G, K, d, n, B = 2, 3, D - 1, 70, LANES + 5  # T = 71: the kernel's token chunks (CHUNK = 32) end mid-prompt
    P = _grid("qkv", G, K, d, jnp.float64)
    lam = jnp.array([[0.6, 0.9, 1.0], [0.75, 0.3, 0.95]])
    X, Y, y, Z = _shared_batch(G, B, d, n, seed=6)
    ref = jax.jit(jax.value_and_grad(_loss_naive, argnums=(0, 1)))(P, lam, Z, y)
    out = jax.jit(jax.value_and_grad(_loss_fused, argnums=(0, 1)))(P, lam, X, Y, y)
    assert out[0].dtype == jnp.float64
    assert abs(float(out[0] - ref[0])) <= 1e-12 * abs(float(ref[0]))
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        assert a.shape == b.shape and _rel(a, b) < 1e-11


@pytest.mark.slow
def test_readout_mse_shared_is_the_readout_kernels_loss_per_model_and_under_vmap():
    """Each (g, k) loss and its own gradient (one model's cotangent at a time), and a vmap over seeds (the trainer's),
    against the read-out kernel ``readout_grid_shared`` with XLA's contractions, both in float32."""
    S, G, K, d, n, B = 2, 2, 2, D - 1, 9, LANES + 1
    P = jax.vmap(lambda s: _grid("qkv", G, K, d, jnp.float32, key=s))(jnp.arange(S))
    lam = jnp.array([[0.8, 0.95], [0.7, 1.0]], jnp.float32)
    X, Y, y, _ = (a.astype(jnp.float32) for a in _shared_batch(G, B, d, n, seed=4))
    zq = jnp.concatenate([jnp.broadcast_to(X[:, -1, :], (G, B, d)), Y[:, :, -1:]], axis=-1)

    def losses_fused(P, lam):
        WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(P)
        return native.readout_mse_shared(X, Y, y, WV[..., -1, :], WKQ, lam)

    def losses_twin(P, lam):
        WV, WKQ = jax.vmap(jax.vmap(gla.merged_weights))(P)
        yhat = native.readout_grid_shared(X, Y, WV[..., -1, :], jnp.einsum("gbe,gkfe->gkbf", zq, WKQ), lam)
        return jnp.mean((yhat - y[:, None]) ** 2, -1)

    for fn in (losses_fused, losses_twin):
        assert fn(jax.tree_util.tree_map(lambda a: a[0], P), lam).shape == (G, K)
    v_f = jax.jit(jax.vmap(losses_fused, in_axes=(0, None)))(P, lam)
    v_t = jax.jit(jax.vmap(losses_twin, in_axes=(0, None)))(P, lam)
    assert _rel(v_f, v_t) < 1e-5
    for g in range(G):
        for k in range(K):
            pick = lambda fn, g=g, k=k: lambda P, lam: fn(P, lam)[g, k]  # noqa: E731
            for s in range(S):
                Ps = jax.tree_util.tree_map(lambda a: a[s], P)
                gf = jax.grad(pick(losses_fused), argnums=(0, 1))(Ps, lam)
                gt = jax.grad(pick(losses_twin), argnums=(0, 1))(Ps, lam)
                for a, b in zip(jax.tree_util.tree_leaves(gf), jax.tree_util.tree_leaves(gt)):
                    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12


def test_readout_mse_shared_does_not_depend_on_the_thread_count(monkeypatch):
    """Each block's sums are one job's, summed over the blocks by numpy afterwards: 1, 2 and 3 threads give the
    same bits."""
    rng = np.random.default_rng(5)
    G, K, B, T = 2, 3, 5 * LANES + 7, 17
    X = rng.standard_normal((B, T, D - 1)).astype(np.float32)
    Y = rng.standard_normal((G, B, T)).astype(np.float32)
    y = rng.standard_normal((G, B)).astype(np.float32)
    u = rng.standard_normal((G, K, D)).astype(np.float32)
    M = (0.3 * rng.standard_normal((G, K, D, D))).astype(np.float32)
    lam = rng.uniform(0.3, 1.0, (G, K)).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        outs.append(native._host_readout_mse_shared(X, Y, y, u, M, lam))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_readout_mse_kernel_token_chunks_and_register_tiles_change_no_bit(dtype):
    """Passes (1) and (3) run chunk by chunk over the tokens for all K models of a row, each model's accumulators
    waiting in the scratch between chunks, in register tiles of ``tokens`` tokens (pass 1) and ``columns``
    features (pass 3): one token per chunk, chunks ending mid-prompt or mid-tile, one chunk holding every token,
    and tiles of one token and one feature (each chain alone, in the order of a dot from the left) give the same
    bits as the defaults."""
    from iclab.ops.decayed_attention import _readout_ir

    rng = np.random.default_rng(8)
    G, K, B, T = 2, 3, 2 * LANES + 5, 41
    X = rng.standard_normal((B, T, D - 1)).astype(dtype)
    Y = rng.standard_normal((G, B, T)).astype(dtype)
    Y[:, :, -1] = 0.0
    y = rng.standard_normal((G, B)).astype(dtype)
    u = rng.standard_normal((G, K, D)).astype(dtype)
    M = (0.3 * rng.standard_normal((G, K, D, D))).astype(dtype)
    lam = rng.uniform(0.3, 1.0, (G, K)).astype(dtype)
    NB = -(-B // LANES)
    outs = []
    for chunk, tokens, columns in ((None, None, None), (1, 1, 1), (1, None, None), (7, 3, 2), (32, 1, 1),
                                   (T, 5, D), (T, None, 4)):
        out = [np.empty((G, K, NB), dtype), np.empty((G, K, NB, D, D), dtype), np.empty((G, K, NB, D), dtype),
               np.empty((G, K, NB), dtype)]
        _readout_ir.readout_mse_kernel(D, dtype, chunk, tokens, columns)(X, Y, y, M, u, lam, *out, 0, NB)
        outs.append(out)
    assert np.all(np.isfinite(outs[0][1])) and np.any(outs[0][1] != 0.0)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Full layers: the compiled recurrent form against the parallel form


def _layer_loss(form, R):
    def loss(params, Z, lam):
        O = gla.gla_layer(params, Z, lam, form)
        return jnp.sum(O * R) + 0.1 * jnp.sum(O ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("kind,B,lam", [("qkv", native.CHUNK + 5, 0.85), ("merged", 3, 1.0), ("qkv", 2, 0.3)])
def test_native_layer_equals_the_parallel_form_with_gradients(kind, B, lam):
    """Outputs and the gradients of every weight, the tokens and λ (the hand-written backward pass)."""
    T = 9
    params = gla.init_gla(jax.random.PRNGKey(3), D - 1, kind, 0.4)
    Z = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))
    R = jax.random.normal(jax.random.PRNGKey(5), (B, T, D))
    ref = _layer_loss("parallel", R)(params, Z, lam)
    out = _layer_loss("native", R)(params, Z, lam)
    assert abs(float(out[0] - ref[0])) <= 1e-12 * abs(float(ref[0]))
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        assert a.shape == b.shape and _rel(a, b) < 1e-11, a.shape


@pytest.mark.slow  # 10 s of compilation (make test's budget); CI runs it
def test_native_multilayer_model_equals_the_parallel_form_with_a_learnt_lambda():
    """A 3-layer residual model (two native full layers, the read-out on the stream) with λ = sigmoid(θ): loss
    and gradients of every layer's weights and θ, under vmap over models."""
    layers = jax.vmap(lambda k: gla.init_gla(k, D - 1, "qkv", 0.3, layers=3, theta=1.2))(
        jax.random.split(jax.random.PRNGKey(6), 2))
    Z, y = _prompts(1, 11, D - 1, 7, jnp.float64)
    Z, y = Z[0], y[0]

    def loss(form):
        return jax.jit(jax.value_and_grad(lambda L: jnp.sum(jax.vmap(
            lambda l: jnp.mean((gla.predict_multilayer(l, Z, None, form) - y) ** 2))(L))))

    (vr, gr), (vn, gn) = loss("parallel")(layers), loss("native")(layers)
    assert abs(float(vn - vr)) <= 1e-12 * abs(float(vr))
    for k in gr:
        assert _rel(gn[k], gr[k]) < 1e-10, k
    assert float(jnp.max(jnp.abs(gr["theta"]))) > 0  # λ's gradient is exercised


def test_native_layer_backward_does_not_depend_on_the_thread_count(monkeypatch):
    rng = np.random.default_rng(1)
    B, T = 3 * native.CHUNK + 2, 13
    Z, dO = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))
    W = [0.3 * rng.standard_normal((D, D)) for _ in range(3)]
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        outs.append((native._host_layer_forward(Z, *W, 0.8),) + native._host_layer_backward(Z, *W, 0.8, dO))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind,dtype,tol", [("qkv", jnp.float64, 1e-12),
                                            pytest.param("merged", jnp.float64, 1e-12, marks=pytest.mark.slow),
                                            pytest.param("qkv", jnp.float32, 1e-4, marks=pytest.mark.slow)])
def test_multilayer_mse_equals_the_parallel_form_with_gradients(kind, dtype, tol):
    """The whole L-layer model in one host call (layer kernels with the residual added in place, the read-out
    kernel, the token cotangents of the read-out) against predict_multilayer in XLA's parallel form: loss and the
    gradient of every weight and of λ, at a block-boundary batch size, under jit and vmap over models."""
    d, L, B = D - 1, 3, native.CHUNK + 3
    Z, y = _prompts(1, B, d, 9, dtype)
    Z, y = Z[0], y[0]
    lam = jnp.asarray([0.9, 0.75], dtype)
    Ps = [gla.init_gla(jax.random.PRNGKey(k), d, kind, 0.3, layers=L, dtype=dtype) for k in (3, 4)]
    P = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *Ps)

    def ref(P, lam):
        return jnp.sum(jax.vmap(lambda p, l: jnp.mean((gla.predict_multilayer(p, Z, l, form="parallel") - y) ** 2))(
            P, lam) * jnp.asarray([1.0, -2.0], dtype))

    def got(P, lam):
        return jnp.sum(jax.vmap(lambda p, l: gla.multilayer_mse_native(p, Z, y, l))(P, lam) * jnp.asarray([1.0, -2.0], dtype))

    r, g = jax.value_and_grad(ref, argnums=(0, 1))(P, lam)
    n, h = jax.jit(jax.value_and_grad(got, argnums=(0, 1)))(P, lam)
    assert abs(float(n - r)) <= tol * abs(float(r))
    for a, b in zip(jax.tree_util.tree_leaves(h), jax.tree_util.tree_leaves(g)):
        assert _rel(a, b) < 10 * tol


@pytest.mark.slow
def test_multilayer_mse_with_a_learnt_forget_factor():
    d, B = D - 1, 7
    Z, y = _prompts(1, B, d, 9, jnp.float64)
    P = gla.init_gla(jax.random.PRNGKey(5), d, "qkv", 0.3, layers=2, theta=1.2)
    ref = jax.grad(lambda p: jnp.mean((gla.predict_multilayer(p, Z[0], None, form="parallel") - y[0]) ** 2))(P)
    got = jax.grad(lambda p: gla.multilayer_mse_native(p, Z[0], y[0], None))(P)
    assert _rel(got["theta"], ref["theta"]) < 1e-11 and _rel(got["WQ"], ref["WQ"]) < 1e-11


def test_blocked_layer_kernels_equal_the_token_layout_kernels():
    """The layer kernels on the blocked layout (the tokens as (⌈B/16⌉, T, D, 16), the spare lanes zero) against the
    kernels on the tokens (tested against the parallel form above): outputs, and the backward pass with and
    without the input cotangent and λ̄; spare lanes stay zero."""
    rng = np.random.default_rng(2)
    B, T = 2 * native.LANES + 5, 11
    Z, dO = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))
    W = [0.3 * rng.standard_normal((D, D)) for _ in range(3)]
    lam = 0.85
    O_ref = native._host_layer_forward(Z, *W, lam, residual=True)
    dZ_ref, *gW_ref, gl_ref = native._host_layer_backward(Z, *W, lam, dO, residual=True)
    Zb, dOb = native._to_blocks(Z), native._to_blocks(dO)
    nb = Zb.shape[0]
    assert Zb.shape == (3, T, D, native.LANES) and not Zb[-1, ..., 5:].any()
    fwd = native._layer_kernels(D, True, blocked=True)[0]
    Ob = np.full_like(Zb, np.nan)
    native._run_blocks(fwd, nb, Zb, *W, lam, Ob)
    got = np.moveaxis(Ob, 3, 1).reshape(nb * native.LANES, T, D)  # prompt-major again
    np.testing.assert_allclose(got[:B], O_ref, rtol=1e-13, atol=1e-13)
    assert not got[B:].any()
    for grad_z in (True, False):
        for grad_lam in (True, False):
            bwd = native._layer_kernels(D, True, blocked=True, grad_z=grad_z, grad_lam=grad_lam)[1]
            dZb = np.full_like(Zb, np.nan)
            dW, dlam = np.empty((nb, 3, D, D)), np.empty(nb)
            native._run_blocks(bwd, nb, Zb, *W, lam, dOb, dZb, dW, dlam)
            for a, b in zip(dW.sum(0), gW_ref):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
            assert dlam.sum() == pytest.approx(gl_ref if grad_lam else 0.0, rel=1e-12, abs=0.0)
            if grad_z:
                got = np.moveaxis(dZb, 3, 1).reshape(nb * native.LANES, T, D)
                np.testing.assert_allclose(got[:B], dZ_ref, rtol=1e-12, atol=1e-12)
                assert not got[B:].any()
            else:
                assert np.isnan(dZb).all()  # not written


def test_blocked_layer_backward_does_not_depend_on_the_thread_count(monkeypatch):
    rng = np.random.default_rng(3)
    B, T = 5 * native.LANES + 1, 7
    Zb, dOb = native._to_blocks(rng.standard_normal((B, T, D))), native._to_blocks(rng.standard_normal((B, T, D)))
    W = [0.3 * rng.standard_normal((D, D)) for _ in range(3)]
    bwd = native._layer_kernels(D, True, blocked=True)[1]
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        dZb, dW, dlam = np.empty_like(Zb), np.empty((Zb.shape[0], 3, D, D)), np.empty(Zb.shape[0])
        native._run_blocks(bwd, Zb.shape[0], Zb, *W, 0.9, dOb, dZb, dW, dlam)
        outs.append((dZb, dW, dlam))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_multilayer_mse_with_a_fixed_forget_factor_and_shared_tokens(monkeypatch):
    """The paper presets' use: models vmapped over a row (the tokens shared: one host call for all of them, the
    tokens blocked once) and over rows (tokens per row), λ fixed (not differentiated: λ̄ is skipped), gradients of
    the weights only; and the loss alone (no gradient computed) under jit. Against the parallel form."""
    d, L, B = D - 1, 3, native.LANES + 3
    Z, y = _prompts(2, B, d, 9, jnp.float64)  # two rows of tokens
    lam = jnp.asarray([[0.9, 0.75, 1.0], [0.8, 0.95, 0.7]])
    keys = jax.random.split(jax.random.PRNGKey(6), 6)
    P = jax.vmap(lambda k: gla.init_gla(k, d, "qkv", 0.3, layers=L))(keys)
    P = jax.tree_util.tree_map(lambda a: a.reshape((2, 3) + a.shape[1:]), P)
    weights = jnp.arange(1.0, 7.0).reshape(2, 3)

    def total(mse):
        return lambda P: jnp.sum(jax.vmap(lambda p, Zg, yg, lg: jax.vmap(lambda q, l: mse(q, Zg, yg, l))(p, lg))(
            P, Z, y, lam) * weights)

    def ref_mse(p, Zg, yg, l):
        return jnp.mean((gla.predict_multilayer(p, Zg, l, form="parallel") - yg) ** 2)

    calls, blocked = [], []
    model_mse, to_blocks = native._model_mse, native._to_blocks
    monkeypatch.setattr(native, "_model_mse", lambda *a: calls.append(a[-2:]) or model_mse(*a))
    monkeypatch.setattr(native, "_to_blocks", lambda Z: blocked.append(Z.shape) or to_blocks(Z))
    r, g = jax.value_and_grad(total(ref_mse))(P)
    n, h = jax.jit(jax.value_and_grad(total(gla.multilayer_mse_native)))(P)
    # one host call: six models with their gradients, λ̄ skipped; each row's tokens blocked once
    assert calls == [(True, False)] * 6 and len(blocked) == 2
    assert abs(float(n - r)) <= 1e-12 * abs(float(r))
    for a, b in zip(jax.tree_util.tree_leaves(h), jax.tree_util.tree_leaves(g)):
        assert _rel(a, b) < 1e-10
    assert abs(float(jax.jit(total(gla.multilayer_mse_native))(P) - r)) <= 1e-12 * abs(float(r))
