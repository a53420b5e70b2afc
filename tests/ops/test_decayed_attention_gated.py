"""The compiled training loss of one-layer GLA grids read at the query (iclab.ops.gated_query_mse_grid) against its
naive twin, the mean squared error of gla.predict_last on each member's own prompt (cut out of the token tensor
and read member by member in a Python loop): losses and the gradient of every weight, for each gating (none,
scalar, vector with a head), in float64 (to rounding) and float32 (to float32 rounding), with saturated gates,
under jit and vmap, at block-boundary batch sizes; its result does not depend on the number of threads; and a
gating training run with kernel 'native' follows the XLA run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.models import gla
from iclab.ops._runtime import blocked as _blocked
from iclab.ops.decayed_attention import gated as native

#: One token width for every test: the kernel compiles once per (gating, width, dtype), a few seconds each.
D = 7
LABEL = 4
KINDS = (("none", False), ("scalar", False), ("vector", True))


def _tokens(R, B, T, dtype, key=0):
    Z = jax.random.normal(jax.random.PRNGKey(key), (R, B, T, D), dtype)
    y = jax.random.normal(jax.random.PRNGKey(key + 1), (R, B), dtype)
    return Z.at[:, :, :, LABEL].set(Z[:, :, :, LABEL]).at[:, :, -1, LABEL].set(0.0), y  # the query's label slot 0


def _grid(kind, head, M, G, dtype, std=0.4, key=2):
    keys = jax.random.split(jax.random.PRNGKey(key), M * G)
    P = jax.vmap(lambda k: gla.init_params(k, D, kind, head=head, std=std, dtype=dtype))(keys)
    return jax.tree_util.tree_map(lambda a: a.reshape((M, G) + a.shape[1:]), P)


#: Prompts of three lengths cut out of T = 13 tokens (the query, position 12, last in each).
KEEP = [[0, 5, 9, 12], list(range(13)), [3, 4, 12]]
ROWS = [2, 0]


def _naive(params, Z, y, keep=KEEP, rows=ROWS):
    """(M, G) losses, member by member: the prompt cut out of its row, gla.predict_last, the mean squared error."""
    out = []
    for m, r in enumerate(rows):
        out.append(jnp.stack([
            jnp.mean((gla.predict_last(jax.tree_util.tree_map(lambda a: a[m, g], params), Z[r][:, np.asarray(k)],
                                       label=LABEL) - y[r]) ** 2) for g, k in enumerate(keep)]))
    return jnp.stack(out)


def _native(params, Z, y, keep=KEEP, rows=ROWS):
    pos, lens = native.subsequence_positions(keep)
    return native.query_mse_grid(params, Z, y, positions=pos, lengths=lens, rows=rows, label=LABEL)


def _weighted(fn):
    w = jnp.asarray([[1.0, -0.5, 2.0], [0.3, 1.5, -1.0]])  # a cotangent that is not all ones
    return lambda params, Z, y: jnp.sum(w * fn(params, Z, y))


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("kind,head", KINDS)
@pytest.mark.parametrize("B", [native.CHUNK + 3, pytest.param(5, marks=pytest.mark.slow)])
def test_query_mse_grid_equals_the_naive_loss_with_gradients(kind, head, B):
    Z, y = _tokens(3, B, 13, jnp.float64)
    P = _grid(kind, head, 2, 3, jnp.float64)
    ref = jax.jit(jax.value_and_grad(_weighted(_naive)))(P, Z, y)
    out = jax.jit(jax.value_and_grad(_weighted(_native)))(P, Z, y)
    assert _rel(out[0], ref[0]) < 1e-13
    np.testing.assert_allclose(_native(P, Z, y), _naive(P, Z, y), rtol=1e-13)
    assert set(out[1]) == set(P)
    for name in P:
        assert _rel(out[1][name], ref[1][name]) < 1e-12, name
    if kind != "vector":  # the label read-out uses one column of W_V: the others get no gradient
        rest = np.delete(np.asarray(out[1]["Wv"]), LABEL, axis=-1)
        assert np.all(rest == 0.0) and np.any(np.asarray(out[1]["Wv"])[..., LABEL] != 0)


@pytest.mark.slow
@pytest.mark.parametrize("kind,head", KINDS[1:])
def test_saturated_gates(kind, head):
    """Gate logits of ±30: products of gates ≈ 0 or 1, and 1 − φ computed as φ(−a) keeps the gate gradients exact."""
    Z, y = _tokens(3, 9, 13, jnp.float64, key=4)
    P = _grid(kind, head, 2, 3, jnp.float64)
    name = "w_g" if kind == "scalar" else "W_g"
    P[name] = P[name] * 60.0
    ref = jax.value_and_grad(_weighted(_naive))(P, Z, y)
    out = jax.value_and_grad(_weighted(_native))(P, Z, y)
    assert _rel(out[0], ref[0]) < 1e-12
    for k in P:
        assert _rel(out[1][k], ref[1][k]) < 1e-10, k


@pytest.mark.slow
@pytest.mark.parametrize("kind,head", KINDS)
def test_float32_against_float64(kind, head):
    Z, y = _tokens(3, native.CHUNK + 3, 13, jnp.float64, key=6)
    P = _grid(kind, head, 2, 3, jnp.float64)
    ref = jax.value_and_grad(_weighted(_naive))(P, Z, y)
    P32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), P)
    out = jax.value_and_grad(_weighted(_native))(P32, Z.astype(jnp.float32), y.astype(jnp.float32))
    assert _native(P32, Z.astype(jnp.float32), y.astype(jnp.float32)).dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in out[1].values())
    assert _rel(out[0], ref[0]) < 1e-5
    for k in P:
        assert _rel(out[1][k], ref[1][k]) < 1e-4, k


@pytest.mark.slow
@pytest.mark.parametrize("kind,head", [KINDS[1], KINDS[2]])
def test_vmap_over_seeds(kind, head):
    """Under vmap (the trainer maps seeds) one callback serves every seed; each equals its own call."""
    Z, y = _tokens(3, 6, 13, jnp.float64, key=8)
    Ps = [_grid(kind, head, 2, 3, jnp.float64, key=k) for k in (10, 11)]
    P = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *Ps)
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])
    grad = jax.grad(_weighted(_native))
    lv = jax.jit(jax.vmap(_native))(P, Zs, ys)
    gv = jax.jit(jax.vmap(grad))(P, Zs, ys)
    for s in range(2):
        np.testing.assert_array_equal(lv[s], _native(Ps[s], Zs[s], ys[s]))
        one = grad(Ps[s], Zs[s], ys[s])
        for k in one:
            np.testing.assert_array_equal(gv[k][s], one[k])


def test_does_not_depend_on_the_thread_count(monkeypatch):
    """Each block writes its own partial sums, added up in a fixed order: 1, 2 and 3 threads give the same bits."""
    Z, y = _tokens(3, 3 * native.CHUNK + 1, 13, jnp.float32, key=12)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        res = []
        for kind, head in KINDS:
            P = _grid(kind, head, 2, 3, jnp.float32)
            res.append(jax.value_and_grad(_weighted(_native))(P, Z, y))
        outs.append(jax.tree_util.tree_leaves(res))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_one_row_of_tokens_serves_every_row_of_y(dtype):
    """Z with one row (gating.fig1's panels share their tokens) gives the bits of that row repeated for every row
    of y, for each one-layer kind and the multi-layer grid (float32: the IR kernels; float64: numba), under vmap
    over seeds; the rows still pick each member's targets."""
    Z, y = _tokens(3, native.CHUNK + 3, 13, dtype, key=14)
    Z1 = jnp.stack([Z[:1], 0.5 * Z[:1]])  # (S, 1, B, T, D)
    ZR, ys = jnp.broadcast_to(Z1, (2,) + Z.shape), jnp.stack([y, -y])
    cases = [(_native, lambda k, kind=kind, head=head: _grid(kind, head, 2, 3, dtype, key=k)) for kind, head in KINDS]
    cases.append((_native_multilayer, lambda k: _layers(2, dtype, key=k)))
    for fn, make in cases:
        P = jax.tree_util.tree_map(lambda *a: jnp.stack(a), make(30), make(31))
        vg = jax.jit(jax.vmap(jax.value_and_grad(_weighted(fn))))
        got, want = vg(P, Z1, ys), vg(P, ZR, ys)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(vg(P, Z1, ys[:, ::-1])[0], got[0])  # the rows pick y


@pytest.mark.parametrize("kind,head", KINDS)
def test_grid_kernels_read_the_blocked_copy_as_they_gathered(monkeypatch, kind, head):
    """float32 grids read one blocked copy of the prompts per call (``grid_blocks``) where each job gathered its
    block's tokens: the same losses and gradients bit for bit, under vmap over seeds, with Z of every row and of
    one row, at a batch that leaves spare lanes, on 1 and 2 threads."""
    Z, y = _tokens(3, 2 * native._blocked.LANES + 5, 13, jnp.float32, key=21)
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])
    P = jax.tree_util.tree_map(lambda *a: jnp.stack(a), _grid(kind, head, 2, 3, jnp.float32, key=40),
                               _grid(kind, head, 2, 3, jnp.float32, key=41))
    vg = jax.jit(jax.vmap(jax.value_and_grad(_weighted(_native))))
    outs = {}
    for blocked in (False, True):
        for threads in (1, 2):
            monkeypatch.setattr(native, "BLOCKED_GRID", blocked)
            monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
            outs[blocked, threads] = [vg(P, Zs, ys), vg(P, Zs[:, :1], ys)]
    want = jax.tree_util.tree_leaves(outs[False, 1])
    assert np.all(np.isfinite(want[0])) and np.any(want[1] != 0.0)
    for key, got in outs.items():
        for a, b in zip(jax.tree_util.tree_leaves(got), want):
            np.testing.assert_array_equal(a, b, err_msg=str(key))


def test_grid_blocks_is_each_rows_blocked_layout():
    """``grid_blocks`` (the IR kernel's gathers, float32 and float64), into a fresh array or this thread's kept
    buffer: each (s, r) is ``to_blocks`` of its prompts, the spare lanes zero."""
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float64):
        Z = rng.standard_normal((2, 3, 37, 9, D)).astype(dtype)
        want = np.stack([np.stack([native._blocked.to_blocks(Z[s, r]) for r in range(3)]) for s in range(2)])
        for threads, reuse in ((1, False), (2, True), (3, True)):
            got = native.grid_blocks(Z, threads=threads, reuse=reuse)
            assert got.shape == (2, 3, 3, 9, D, native._blocked.LANES) and got.dtype == dtype
            np.testing.assert_array_equal(got, want)
            assert np.all(got[:, :, -1, :, :, 37 - 2 * native._blocked.LANES:] == 0.0)


def test_bad_layouts_are_refused():
    Z, y = _tokens(3, 4, 13, jnp.float64)
    P = _grid("scalar", False, 2, 3, jnp.float64)
    pos, lens = native.subsequence_positions(KEEP)
    with pytest.raises(ValueError, match="head"):
        native.query_mse_grid({**P, "h": jnp.zeros((2, 3, D))}, Z, y, positions=pos, lengths=lens, rows=ROWS,
                              label=LABEL)
    with pytest.raises(ValueError, match="out of"):
        native.query_mse_grid(P, Z, y, positions=pos, lengths=lens, rows=[0, 3], label=LABEL)
    with pytest.raises(ValueError, match="shared row"):
        native.query_mse_grid(P, Z[:2], y, positions=pos, lengths=lens, rows=ROWS, label=LABEL)
    with pytest.raises(ValueError, match="grid"):
        native.query_mse_grid(P, Z, y, positions=pos[:2], lengths=lens[:2], rows=ROWS, label=LABEL)
    with pytest.raises(ValueError, match="increasing"):
        native.subsequence_positions([[0, 2, 1]])
    big, lb = native.subsequence_positions([[0, 13]] * 3)
    with pytest.raises(ValueError, match="out of"):
        native.query_mse_grid(P, Z, y, positions=big, lengths=lb, rows=ROWS, label=LABEL)


# --------------------------------------------------------------------------------------------
# The full scalar-gated layer


def _layer_case(dtype, B, key=20, gate_scale=4.0):
    p = gla.init_params(jax.random.PRNGKey(key), D, "scalar", std=0.5, dtype=dtype)
    p["w_g"] = p["w_g"] * gate_scale  # gates spread over (0, 1)
    Z = jax.random.normal(jax.random.PRNGKey(key + 1), (B, 11, D), dtype)
    W = jax.random.normal(jax.random.PRNGKey(key + 2), (B, 11, D), dtype)  # a cotangent that is not all ones
    return p, Z, W


@pytest.mark.parametrize("B", [native.LAYER_CHUNK + 3, pytest.param(5, marks=pytest.mark.slow)])
def test_gated_layer_equals_the_recurrent_and_parallel_forms_with_gradients(B):
    p, Z, W = _layer_case(jnp.float64, B)
    out = native.gated_layer(p, Z)
    np.testing.assert_allclose(out, gla.gla_layer(p, Z, None, "recurrent"), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(out, gla.gla_layer(p, Z, None, "native"), rtol=0, atol=0)
    ref = jax.grad(lambda q, Z: jnp.sum(W * gla.gla_layer(q, Z, None, "parallel")), argnums=(0, 1))(p, Z)
    got = jax.jit(jax.grad(lambda q, Z: jnp.sum(W * native.gated_layer(q, Z)), argnums=(0, 1)))(p, Z)
    for k in p:
        assert _rel(got[0][k], ref[0][k]) < 1e-12, k
    assert _rel(got[1], ref[1]) < 1e-12


@pytest.mark.slow
def test_gated_layer_float32_saturated_gates_and_leading_axes():
    p, Z, W = _layer_case(jnp.float64, 9, key=30, gate_scale=40.0)  # gates ≈ 0 or 1
    ref = jax.grad(lambda q, Z: jnp.sum(W * gla.gla_layer(q, Z, None, "parallel")), argnums=(0, 1))(p, Z)
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)
    Z32, W32 = Z.astype(jnp.float32).reshape(3, 3, 11, D), W.astype(jnp.float32).reshape(3, 3, 11, D)
    got = jax.grad(lambda q, Z: jnp.sum(W32 * native.gated_layer(q, Z)), argnums=(0, 1))(p32, Z32)
    assert got[1].shape == (3, 3, 11, D) and got[1].dtype == jnp.float32
    for k in p:
        assert _rel(got[0][k], ref[0][k]) < 1e-4, k
    assert _rel(got[1].reshape(Z.shape), ref[1]) < 1e-4


@pytest.mark.slow
def test_multilayer_prediction_in_the_native_form():
    """predict_multilayer with form 'native' (full layers by the kernels, the last at the query) equals 'parallel'."""
    layers = gla.init_multilayer(jax.random.PRNGKey(40), D, 3, std=0.3)
    Z = jax.random.normal(jax.random.PRNGKey(41), (6, 11, D)).at[:, -1, LABEL].set(0.0)

    def loss(form):
        return lambda ls: jnp.sum(gla.predict_multilayer(ls, Z, label=LABEL, form=form) ** 2)

    np.testing.assert_allclose(gla.predict_multilayer(layers, Z, label=LABEL, form="native"),
                               gla.predict_multilayer(layers, Z, label=LABEL, form="parallel"), rtol=1e-11)
    ref, got = jax.grad(loss("parallel"))(layers), jax.grad(loss("native"))(layers)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert _rel(a, b) < 1e-11


@pytest.mark.slow
def test_gated_layer_does_not_depend_on_the_thread_count(monkeypatch):
    p, Z, W = _layer_case(jnp.float32, 3 * native.LAYER_CHUNK + 1, key=50)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        value, grads = jax.value_and_grad(lambda q, Z: jnp.sum(W * native.gated_layer(q, Z)), argnums=(0, 1))(p, Z)
        outs.append([value] + jax.tree_util.tree_leaves(grads))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_gated_layer_refuses_other_gates_and_masks():
    p, Z, _ = _layer_case(jnp.float64, 3)
    with pytest.raises(ValueError, match="scalar-gated"):
        native.gated_layer({k: v for k, v in p.items() if k != "w_g"}, Z)
    with pytest.raises(ValueError, match="mask"):
        gla.gla_layer(p, Z, jnp.ones(Z.shape[:-1]), "native")


# --------------------------------------------------------------------------------------------
# L-layer residual models, whole loss in the host call


def _layers(L, dtype, key=60):
    keys = jax.random.split(jax.random.PRNGKey(key), 6)
    ls = jax.vmap(lambda k: gla.init_multilayer(k, D, L, std=0.3, dtype=dtype))(keys)
    return [jax.tree_util.tree_map(lambda a: a.reshape((2, 3) + a.shape[1:]), layer) for layer in ls]


def _naive_multilayer(layers, Z, y):
    out = []
    for m, r in enumerate(ROWS):
        out.append(jnp.stack([jnp.mean((gla.predict_multilayer(
            [jax.tree_util.tree_map(lambda a: a[m, g], layer) for layer in layers], Z[r][:, np.asarray(k)],
            label=LABEL) - y[r]) ** 2) for g, k in enumerate(KEEP)]))
    return jnp.stack(out)


def _native_multilayer(layers, Z, y):
    pos, lens = native.subsequence_positions(KEEP)
    return native.multilayer_mse_grid(layers, Z, y, positions=pos, lengths=lens, rows=ROWS, label=LABEL)


@pytest.mark.parametrize("L", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_multilayer_mse_grid_equals_the_naive_loss_with_gradients(L):
    """Against predict_multilayer (parallel form, XLA) member by member: L = 1 is the residual read-out alone (the
    query's label slot of the prompt is 0), L = 2, 3 add full layers and their backward passes."""
    Z, y = _tokens(3, native.LAYER_CHUNK + 3, 13, jnp.float64, key=61)
    layers = _layers(L, jnp.float64)
    ref = jax.value_and_grad(_weighted(_naive_multilayer))(layers, Z, y)
    out = jax.jit(jax.value_and_grad(_weighted(_native_multilayer)))(layers, Z, y)
    assert _rel(out[0], ref[0]) < 1e-13
    for a, b in zip(jax.tree_util.tree_leaves(out[1]), jax.tree_util.tree_leaves(ref[1])):
        assert _rel(a, b) < 1e-11


@pytest.mark.slow
def test_multilayer_mse_grid_under_vmap_and_in_float32():
    Z, y = _tokens(3, 6, 13, jnp.float64, key=62)
    L64 = [_layers(2, jnp.float64, key=k) for k in (63, 64)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *L64)
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])
    lv = jax.jit(jax.vmap(_native_multilayer))(stacked, Zs, ys)
    for s in range(2):
        np.testing.assert_array_equal(lv[s], _native_multilayer(L64[s], Zs[s], ys[s]))
    f32 = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    ref = jax.grad(_weighted(_naive_multilayer))(L64[0], Z, y)
    got = jax.grad(_weighted(_native_multilayer))(f32(L64[0]), f32(Z), f32(y))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == jnp.float32 and _rel(a, b) < 1e-4


def test_blocked_gated_layer_kernels_equal_the_token_layout_kernels(monkeypatch):
    """The residual layer's kernels on the blocked layout (multilayer_mse_grid's) against those on the tokens
    (tested against the naive forms above): outputs, every gradient, the input cotangent (or none on a first
    layer); the same bits for 1, 2 and 3 threads."""
    rng = np.random.default_rng(7)
    B, T = 2 * _blocked.LANES + 3, 9
    Z, dO = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))
    Wq, Wk, Wv = (0.3 * rng.standard_normal((D, D)) for _ in range(3))
    wg = 0.5 * rng.standard_normal(D)
    O = native._host_layer_forward(Z, Wq, Wk, Wv, wg, residual=True)
    ref = native._host_layer_backward(Z, Wq, Wk, Wv, wg, O, dO, residual=True)
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(dO)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        Ob = native._blocked_layer_forward(Zb, Wq, Wk, Wv, wg)
        outs.append([Ob, *native._blocked_layer_backward(Zb, Wq, Wk, Wv, wg, Ob, dOb)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    Ob, dZb, *grads = outs[0]
    np.testing.assert_allclose(_blocked.from_blocks(Ob, B), O, rtol=1e-13, atol=1e-13)
    assert not np.moveaxis(Ob, 3, 1).reshape(-1, T, D)[B:].any()
    np.testing.assert_allclose(_blocked.from_blocks(dZb, B), ref[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    first = native._blocked_layer_backward(Zb, Wq, Wk, Wv, wg, Ob, dOb, grad_z=False)
    assert first[0] is None
    for a, b in zip(first[1:], ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_the_blocked_query_loss_kernel_is_the_scalar_residual_one():
    # multilayer_mse_grid's last layer on the blocked layout (tested through it above, L = 2, 3)
    for kind, residual in (("none", True), ("scalar", False), ("vector", True)):
        with pytest.raises(ValueError):
            native._kernel(kind, D, "float64", residual, True)


@pytest.mark.parametrize("L", [1, 2, 3])
def test_the_grid_driver_is_the_per_member_python_bit_for_bit(L, monkeypatch):
    """float32 grids of whole models run by the compiled driver (``_grid_driver.run_members``) against its naive
    twin, ``_multilayer_member``'s Python calling the same kernels: loss and every gradient the same bits, under
    vmap over seeds, with Z of one row or of every row, on 1 and 2 threads, claiming 1 or 5 members at a time or a
    thread's whole share of those left, taking the blocks through the model one, four (the last step partial) or
    all at a time."""
    from iclab.ops.decayed_attention import _grid_driver

    Z, y = _tokens(3, 8 * _blocked.LANES + 5, 13, jnp.float32, key=66)  # 9 blocks: numpy sums 8 or more pairwise
    layers = [jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.7 * a]), layer) for layer in _layers(L, jnp.float32)]
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])
    grad = jax.jit(jax.vmap(jax.value_and_grad(_weighted(_native_multilayer))))
    for Zc in (Zs, Zs[:, :1]):
        monkeypatch.setattr(native, "MODELS_PER_THREAD", 1)
        monkeypatch.setattr(native, "GRID_DRIVER", False)
        monkeypatch.setattr(native, "thread_count", lambda: 1)
        ref = jax.tree_util.tree_leaves(grad(layers, Zc, ys))
        monkeypatch.setattr(native, "GRID_DRIVER", True)
        for threads, chunk, guide, blocks in ((1, 1, 4, 1), (2, 1, 4, 0), (2, 5, 4, 4), (2, 1, 1, 1)):
            monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
            monkeypatch.setattr(native, "DRIVER_CHUNK", chunk)
            monkeypatch.setattr(native, "DRIVER_GUIDE", guide)
            monkeypatch.setattr(_grid_driver, "BLOCKS", blocks)
            for a, b in zip(jax.tree_util.tree_leaves(grad(layers, Zc, ys)), ref):
                np.testing.assert_array_equal(a, b)
        assert all(np.all(np.isfinite(a)) and np.any(a != 0) for a in ref)


def _in_lanes(Z):
    """Tokens (..., R, B, T, D) on the blocked layout (..., R, ⌈B/LANES⌉, T, D, LANES), the spare lanes zero."""
    Z = np.asarray(Z)
    *lead, R, B, T, D_ = Z.shape
    nb = -(-B // _blocked.LANES)
    padded = np.zeros((*lead, R, nb * _blocked.LANES, T, D_), Z.dtype)
    padded[..., :B, :, :] = Z
    return np.moveaxis(padded.reshape(*lead, R, nb, _blocked.LANES, T, D_), -3, -1)


@pytest.mark.parametrize("L", [1, 3])
def test_blocked_prompts_give_the_bits_of_the_tokens(L, monkeypatch):
    """multilayer_mse_grid on prompts drawn on the blocked layout (``blocked=True``, read in place by the grid
    driver; converted back to tokens on the other paths) against the same prompts as tokens: loss and gradients
    the same bits, under vmap over seeds, with one row of prompts or every row."""
    Z, y = _tokens(3, 2 * _blocked.LANES + 5, 13, jnp.float32, key=67)
    layers = [jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.7 * a]), layer) for layer in _layers(L, jnp.float32)]
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])
    pos, lens = native.subsequence_positions(KEEP)

    def blocked(layers, Zb, y):
        return native.multilayer_mse_grid(layers, Zb, y, positions=pos, lengths=lens, rows=ROWS, label=LABEL,
                                          blocked=True)

    rows_grad = jax.jit(jax.vmap(jax.value_and_grad(_weighted(_native_multilayer))))
    blocked_grad = jax.jit(jax.vmap(jax.value_and_grad(_weighted(blocked))))
    monkeypatch.setattr(native, "MODELS_PER_THREAD", 1)  # the driver on two threads for this small grid
    for Zc in (Zs, Zs[:, :1]):
        for driver in (True, False):
            monkeypatch.setattr(native, "GRID_DRIVER", driver)
            ref = jax.tree_util.tree_leaves(rows_grad(layers, Zc, ys))
            got = jax.tree_util.tree_leaves(blocked_grad(layers, jnp.asarray(_in_lanes(Zc)), ys))
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="blocked prompts"):
        blocked(_layers(L, jnp.float32), Z, y)
    # prompts not on a 64-byte boundary (the kernels load aligned vectors): read through an aligned copy
    monkeypatch.setattr(native, "GRID_DRIVER", True)
    host = native._host_multilayer(LABEL, pos, lens, np.asarray(ROWS), True)
    names = ("Wq", "Wk", "Wv", "w_g")
    weights = [np.stack([np.asarray(layer[k]) for layer in _layers(L, jnp.float32)], axis=2) for k in names]
    Zb = _blocked.aligned_empty(_in_lanes(Z).shape, np.float32)
    Zb[...] = _in_lanes(Z)
    shifted = np.empty(Zb.size + 1, np.float32)[1:].reshape(Zb.shape)
    shifted[...] = Zb
    assert shifted.ctypes.data % _blocked.ALIGN
    for a, b in zip(host(shifted, np.asarray(y), *weights), host(Zb, np.asarray(y), *weights)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.float64, marks=pytest.mark.slow)])
def test_grids_of_several_depths_in_one_call_give_each_grids_bits(dtype, monkeypatch):
    """multilayer_mse_grids (grids of depth 1, 2, 3, one with other rows, in one host call: one queue of models on
    the threads) against each grid's multilayer_mse_grid alone: losses and gradients the same bits, under vmap over
    seeds, on the prompts as tokens and blocked, by the grid driver on 1 and 2 threads and by the other path."""
    Z, y = _tokens(3, _blocked.LANES + 5, 13, dtype, key=68)
    pos, lens = native.subsequence_positions(KEEP)
    depths = [_layers(L, dtype, key=69 + L) for L in (1, 2, 3)]
    depths = [[jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.7 * a]), layer) for layer in ls] for ls in depths]
    rows = [ROWS, ROWS, list(reversed(ROWS))]
    Zs, ys = jnp.stack([Z, 0.5 * Z]), jnp.stack([y, -y])

    def apart(grids, Z, y, blocked):
        return [native.multilayer_mse_grid(ls, Z, y, positions=pos, lengths=lens, rows=r, label=LABEL,
                                           blocked=blocked) for ls, r in zip(grids, rows)]

    def together(grids, Z, y, blocked):
        return native.multilayer_mse_grids([(ls, pos, lens, r) for ls, r in zip(grids, rows)], Z, y, label=LABEL,
                                           blocked=blocked)

    def total(fn, blocked):
        w = jnp.arange(1.0, 7.0).reshape(2, 3)
        return jax.jit(jax.vmap(jax.value_and_grad(
            lambda g, Z, y: sum(jnp.sum(w * v) * (k + 1) for k, v in enumerate(fn(g, Z, y, blocked))))))

    monkeypatch.setattr(native, "MODELS_PER_THREAD", 1)
    for blocked in ((False, True) if dtype == jnp.float32 else (False,)):
        Zc = jnp.asarray(_in_lanes(Zs)) if blocked else Zs
        for threads, driver in ((2, True), (1, True), (2, False)):
            monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
            monkeypatch.setattr(native, "GRID_DRIVER", driver)
            ref = jax.tree_util.tree_leaves(total(apart, blocked)(depths, Zc, ys))
            got = jax.tree_util.tree_leaves(total(together, blocked)(depths, Zc, ys))
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a, b)
    assert all(np.any(np.asarray(a) != 0) for a in ref)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_multilayer_grid_runs_models_on_threads_with_the_same_bits(dtype, monkeypatch):
    """A grid with enough models runs whole models on the threads (each model's kernels on one); the result is the
    same, bit for bit, as each model's kernels split over 1, 2 or 3 threads."""
    Z, y = _tokens(3, _blocked.LANES + 3, 13, dtype, key=65)
    layers = _layers(3, dtype)
    grad = jax.jit(jax.value_and_grad(_weighted(_native_multilayer)))
    outs = []
    for threads, per_thread in ((2, 1), (3, 1), (1, 10**6), (2, 10**6), (3, 10**6)):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        monkeypatch.setattr(native, "MODELS_PER_THREAD", per_thread)
        outs.append(jax.tree_util.tree_leaves(grad(layers, Z, y)))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
