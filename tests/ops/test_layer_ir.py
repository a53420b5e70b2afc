"""The full-layer kernels as LLVM IR (iclab.ops.decayed_attention._layer_ir) against their twins, for drift's layer (forget factor
λ) and gating's (scalar gates): the token-layout kernels (tested against the parallel and naive forms) and the numba
kernels on the blocked layout: outputs, the backward with and without z̄ (and λ̄), in float64 (to rounding) and
float32; spare lanes; thread counts; the models' losses with either kernel family in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.ops._runtime import blocked as _blocked
from iclab.ops.decayed_attention import _layer_ir
from iclab.models import gla_forget as gla
from iclab.ops.decayed_attention import forget as native
from iclab.ops.decayed_attention import gated as gla_native
from iclab.tasks.drift import sample_drift_prompts, tokens

#: The token width of tests/models/test_gla_forget_native.py (its numba kernels compile once per width and dtype).
D = 5


def _unblock(Xb):
    return np.moveaxis(Xb, 3, 1).reshape(Xb.shape[0] * native.LANES, Xb.shape[1], Xb.shape[2])


def _operands(dtype, B=2 * native.LANES + 5, T=11, seed=2):
    rng = np.random.default_rng(seed)
    Z, dO = (rng.standard_normal((B, T, D)).astype(dtype) for _ in range(2))
    W = [(0.3 * rng.standard_normal((D, D))).astype(dtype) for _ in range(3)]
    return Z, dO, W


def _backward(kernel, Zb, W, lam, dOb):
    nb = Zb.shape[0]
    dZb, dW, dlam = np.full_like(Zb, np.nan), np.full((nb, 3, D, D), np.nan, Zb.dtype), np.full(nb, np.nan, Zb.dtype)
    native._run_blocks(kernel, nb, Zb, *W, lam, dOb, dZb, dW, dlam)
    return dZb, dW, dlam


@pytest.mark.parametrize("T", [11, 2 * _layer_ir.W_CHUNK + 3])  # the weight gradients' sums: one chunk, and three
@pytest.mark.parametrize("residual", [True, False])
def test_ir_kernels_equal_the_token_layout_kernels_in_float64(residual, T):
    Z, dO, W = _operands(np.float64, T=T)
    B, T, _ = Z.shape
    lam = 0.85
    O_ref = native._host_layer_forward(Z, *W, lam, residual=residual)
    dZ_ref, *gW_ref, gl_ref = native._host_layer_backward(Z, *W, lam, dO, residual=residual)
    Zb, dOb = native._to_blocks(Z), native._to_blocks(dO)
    fwd = _layer_ir.layer_kernels(D, residual, np.float64)[0]
    Ob = np.full_like(Zb, np.nan)
    native._run_blocks(fwd, Zb.shape[0], Zb, *W, lam, Ob)
    np.testing.assert_allclose(_unblock(Ob)[:B], O_ref, rtol=1e-13, atol=1e-13)
    assert not _unblock(Ob)[B:].any()  # zero prompts in the spare lanes give zero outputs
    for grad_z in (True, False):
        for grad_lam in (True, False):
            bwd = _layer_ir.layer_kernels(D, residual, np.float64, grad_z=grad_z, grad_lam=grad_lam)[1]
            dZb, dW, dlam = _backward(bwd, Zb, W, lam, dOb)
            for a, b in zip(dW.sum(0), gW_ref):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
            assert dlam.sum() == pytest.approx(gl_ref if grad_lam else 0.0, rel=1e-12, abs=0.0)
            if grad_z:
                np.testing.assert_allclose(_unblock(dZb)[:B], dZ_ref, rtol=1e-12, atol=1e-12)
                assert not _unblock(dZb)[B:].any()
            else:
                assert np.isnan(dZb).all()  # not written


def test_ir_kernels_equal_the_numba_blocked_kernels_in_float32():
    """The paper presets' case: float32, residual layers; the same arithmetic as the numba kernels (the forward
    in the same order), so they agree to float32 rounding of a few operations."""
    Z, dO, W = _operands(np.float32, B=3 * native.LANES, T=23, seed=4)
    lam = np.float32(0.9)
    Zb, dOb = native._to_blocks(Z), native._to_blocks(dO)
    nb = Zb.shape[0]
    outs = []
    for kernels in (_layer_ir.layer_kernels(D, True, np.float32), native._layer_kernels(D, True, blocked=True)):
        Ob = np.empty_like(Zb)
        native._run_blocks(kernels[0], nb, Zb, *W, lam, Ob)
        outs.append((Ob,) + _backward(kernels[1], Zb, W, lam, dOb))
    for a, b in zip(*outs):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(np.abs(b).max()))


def test_ir_backward_does_not_depend_on_the_thread_count(monkeypatch):
    Z, dO, W = _operands(np.float32, B=5 * native.LANES + 1, T=7, seed=3)
    Zb, dOb = native._to_blocks(Z), native._to_blocks(dO)
    bwd = _layer_ir.layer_kernels(D, True, np.float32)[1]
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        outs.append(_backward(bwd, Zb, W, np.float32(0.9), dOb))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loop_shapes_of_the_layer_kernels_change_no_bit(monkeypatch, dtype):
    """The backward's rows loops over slices of ``STATE_COLUMNS`` columns (q̄, k̄ carried in registers; v̄ and λ̄'s
    row sums continued slice after slice; the gated layer's on half vectors, ``HALF_COLUMNS`` wide, or not:
    ``HALF_LANES``), the token cotangent's ``Z_UNITS`` outputs a loop iteration (a tail
    after the loop), the projections' ``PROJECTION_ROWS`` rows an iteration and the weight-gradient tiles of
    ``W_ROWS`` × ``W_COLUMNS`` keep every chain's operands and order: one column, output and accumulator at a
    time, slices and tiles ending mid-row and single slices and tiles give the defaults' bits, for drift's layer
    (with and without z̄, λ̄) and gating's gated layer (with and without z̄)."""
    Z, dO, W = _operands(dtype, T=2 * _layer_ir.W_CHUNK + 3, seed=6)
    wg = (0.3 * np.random.default_rng(7).standard_normal(D)).astype(dtype)
    Zb, dOb = (_blocked.to_blocks(a) for a in (Z, dO))
    nb = Zb.shape[0]
    WT = [np.ascontiguousarray(w.T) for w in W]

    def run():
        out = []
        for grad_z in (True, False):
            for grad_lam in (True, False):
                fwd, bwd = _layer_ir.layer_kernels(D, True, dtype, grad_z=grad_z, grad_lam=grad_lam)
                Ob = np.empty_like(Zb)
                native._run_blocks(fwd, nb, Zb, *W, dtype(0.9), Ob)
                out += [Ob, *_backward(bwd, Zb, W, dtype(0.9), dOb)]
            fwd, bwd = _layer_ir.gated_layer_kernels(D, dtype, grad_z=grad_z)
            Ob, dZb = np.empty_like(Zb), np.zeros_like(Zb)
            dW, dwg = np.empty((nb, 3, D, D), dtype), np.empty((nb, D), dtype)
            fwd(Zb, *WT, wg, Ob, 0, nb)
            bwd(Zb, *WT, wg, Ob, dOb, dZb, dW, dwg, 0, nb)
            out += [Ob, dZb, dW, dwg]
        return out

    outs = []
    for shape in ({}, dict(STATE_COLUMNS=1, Z_UNITS=1, W_ROWS=1, W_COLUMNS=1, PROJECTION_ROWS=1, HALF_COLUMNS=1),
                  dict(STATE_COLUMNS=3, Z_UNITS=D, W_ROWS=2, W_COLUMNS=2, PROJECTION_ROWS=3, HALF_COLUMNS=3),
                  dict(STATE_COLUMNS=D, Z_UNITS=2, W_ROWS=3 * D, W_COLUMNS=D, PROJECTION_ROWS=D, HALF_COLUMNS=D),
                  dict(HALF_LANES=not _layer_ir.HALF_LANES)):
        for name, value in shape.items():
            monkeypatch.setattr(_layer_ir, name, value)
        _layer_ir.layer_kernels.cache_clear()
        _layer_ir.gated_layer_kernels.cache_clear()
        outs.append(run())
    monkeypatch.undo()
    _layer_ir.layer_kernels.cache_clear()
    _layer_ir.gated_layer_kernels.cache_clear()
    assert np.all(np.isfinite(outs[0][-2])) and np.any(outs[0][-2] != 0.0)  # (the unwritten z̄ stay NaN)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_ir_kernels_reject_operands_of_another_dtype_or_shape():
    Z, dO, W = _operands(np.float32, B=native.LANES, T=3)
    Zb = native._to_blocks(Z)
    fwd = _layer_ir.layer_kernels(D, True, np.float32)[0]
    with pytest.raises(ValueError, match="float32"):
        fwd(Zb.astype(np.float64), *W, 0.9, np.empty_like(Zb), 0, 1)
    with pytest.raises(ValueError, match="weights"):
        fwd(Zb, W[0][:2], W[1], W[2], 0.9, np.empty_like(Zb), 0, 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        fwd(Zb, np.asfortranarray(W[0] + 0.1), W[1], W[2], 0.9, np.empty_like(Zb), 0, 1)


def test_multilayer_mse_in_float32_is_the_same_with_either_kernel_family(monkeypatch):
    """multilayer_mse (3 layers, two models vmapped, λ fixed) in float32 with the IR layer kernels and with the
    numba ones: losses and gradients to float32 rounding."""
    d, B = D - 1, native.LANES + 3
    Lam = jnp.diag(jnp.linspace(1.5, 0.5, d))
    pr = sample_drift_prompts(jax.random.PRNGKey(1), B, gamma=0.9, sigma_w2=1.0, sigma_e2=0.05, n=9, Lam=Lam)
    Z, y = tokens(pr).astype(jnp.float32), pr.target.astype(jnp.float32)
    P = jax.vmap(lambda k: gla.init_gla(k, d, "qkv", 0.15, layers=3, dtype=jnp.float32))(
        jax.random.split(jax.random.PRNGKey(3), 2))
    lam = jnp.asarray([0.9, 0.8], jnp.float32)

    def total(P):
        return jnp.sum(jax.vmap(lambda p, l: gla.multilayer_mse_native(p, Z, y, l))(P, lam) * jnp.asarray([1.0, 2.0], jnp.float32))

    got, used = {}, []
    layer_kernels = _layer_ir.layer_kernels
    monkeypatch.setattr(_layer_ir, "layer_kernels", lambda *a, **k: used.append(a) or layer_kernels(*a, **k))
    for family in ("llvm", "numba"):
        monkeypatch.setattr(native, "FLOAT32_LAYERS", family)
        got[family] = jax.value_and_grad(total)(P)  # not jitted: each family traced afresh
        assert bool(used) == (family == "llvm")
        used.clear()
    (a, ga), (b, gb) = got["llvm"], got["numba"]
    assert 0.1 < float(b) < 100.0  # a model of moderate output, not one dominated by overflow
    assert a.dtype == jnp.float32 and abs(float(a - b)) <= 1e-5 * abs(float(b))
    for x, z in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
        assert x.dtype == jnp.float32
        assert float(jnp.max(jnp.abs(x - z))) <= 1e-5 * float(jnp.max(jnp.abs(z)))


# gating's residual scalar-gated layer (gla_native), at the width of tests/models/test_gla_native.py
DG = 7


def _gated_case(dtype, B=2 * native.LANES + 3, T=9, seed=7):
    rng = np.random.default_rng(seed)
    Z, dO = (rng.standard_normal((B, T, DG)).astype(dtype) for _ in range(2))
    Wq, Wk, Wv = ((0.3 * rng.standard_normal((DG, DG))).astype(dtype) for _ in range(3))
    wg = (1.5 * rng.standard_normal(DG)).astype(dtype)  # some gates near saturation
    return Z, dO, (Wq, Wk, Wv), wg


def _gated_ir(Zb, W, wg, dOb, grad_z):
    """Output, z̄ (blocked; NaN where not written), W̄_q, W̄_k, W̄_v, w̄_g by the IR kernels called directly."""
    dt = Zb.dtype
    nb, _, _, _ = Zb.shape
    fwd, bwd = _layer_ir.gated_layer_kernels(DG, dt, grad_z=grad_z)
    WT = [np.ascontiguousarray(w.T) for w in W]  # the kernels take W_•ᵀ, as gla_native's
    Ob = np.full_like(Zb, np.nan)
    gla_native._run_jobs(fwd, nb, Zb, *WT, wg, Ob)
    dZb, dW, dwg = np.full_like(Zb, np.nan), np.empty((nb, 3, DG, DG), dt), np.empty((nb, DG), dt)
    gla_native._run_jobs(bwd, nb, Zb, *WT, wg, Ob, dOb, dZb, dW, dwg)
    gW = dW.sum(0)
    return Ob, dZb, gW[0].T, gW[1].T, gW[2].T, dwg.sum(0)


@pytest.mark.parametrize("T", [9, 2 * _layer_ir.W_CHUNK + 3])  # the weight gradients' sums: one chunk, and three
def test_gated_ir_kernels_equal_the_token_layout_kernels_in_float64(monkeypatch, T):
    """Outputs, the input cotangent (or none on a first layer), every weight's and the gate weights' gradients,
    against gla_native's token-layout kernels (tested against the naive forms); spare lanes zero; the same bits
    for 1, 2 and 3 threads."""
    Z, dO, W, wg = _gated_case(np.float64, T=T)
    B = Z.shape[0]
    O = gla_native._host_layer_forward(Z, *W, wg, residual=True)
    ref = gla_native._host_layer_backward(Z, *W, wg, O, dO, residual=True)
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(dO)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(gla_native, "thread_count", lambda n=threads: n)
        outs.append(_gated_ir(Zb, W, wg, dOb, True))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    Ob, dZb, *grads = outs[0]
    np.testing.assert_allclose(_blocked.from_blocks(Ob, B), O, rtol=1e-13, atol=1e-13)
    assert not _unblock(Ob)[B:].any()
    np.testing.assert_allclose(_blocked.from_blocks(dZb, B), ref[0], rtol=1e-12, atol=1e-12)
    assert not _unblock(dZb)[B:].any()
    for a, b in zip(grads, ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    _, dZb, *grads = _gated_ir(Zb, W, wg, dOb, False)
    assert np.isnan(dZb).all()  # not written
    for a, b in zip(grads, ref[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def _first_layer_backwards(monkeypatch, Z, dO, W, wg, P, *, one_pass: bool, kept: bool):
    """W̄_q, W̄_k, W̄_v, w̄_g (summed over blocks, the kernels' layout) of a gated first layer (no z̄) reading Z at
    positions P, by the one-pass backward or the two passes (``ONE_PASS_FIRST_LAYER``)."""
    monkeypatch.setattr(_layer_ir, "ONE_PASS_FIRST_LAYER", one_pass)
    _layer_ir.gated_layer_kernels.cache_clear()
    dt = Z.dtype
    nb, Tl = -(-Z.shape[0] // native.LANES), len(P)
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(np.ascontiguousarray(dO[:, :Tl]))
    fwd, bwd = _layer_ir.gated_layer_kernels(DG, dt, grad_z=False, gathered=True, kept=kept)
    WT = [np.ascontiguousarray(w.T) for w in W]
    R = (np.full((nb, Tl, 3, DG, native.LANES), np.nan, dt),) if kept else ()
    Ob = np.full((nb, Tl, DG, native.LANES), np.nan, dt)
    gla_native._run_jobs(fwd, nb, Zb, P, *WT, wg, Ob, *R)
    dW, dwg = np.full((nb, 3, DG, DG), np.nan, dt), np.full((nb, DG), np.nan, dt)
    gla_native._run_jobs(bwd, nb, Zb, P, *WT, wg, Ob, *R, dOb, Zb[:0], dW, dwg)
    _layer_ir.gated_layer_kernels.cache_clear()
    return [*dW.sum(0), dwg.sum(0)]


@pytest.mark.parametrize("T", [9, 2 * _layer_ir.W_CHUNK + 3])
def test_one_pass_first_layer_backward_equals_the_two_passes(monkeypatch, T):
    """The gated first layer's backward in one pass through F_t (``ONE_PASS_FIRST_LAYER``: k̄_t = W_Q F_tᵀ v_t,
    v̄_t = F_t W_Qᵀ k_t, W̄_Q = Σ_t k_t (F_tᵀ v_t)ᵀ) gives the two passes' weight and gate-weight gradients: in
    float64 to 1e-12, with and without kept projections, tokens gathered at positions; in float32 as close to
    float64 as the two passes are (within 2× their error, both within 1e-4 of the largest entry)."""
    rng = np.random.default_rng(5)
    Z, dO, W, wg = _gated_case(np.float64, T=2 * T + 1, seed=5)
    P = np.append(np.sort(rng.choice(2 * T, size=T - 1, replace=False)), 2 * T).astype(np.int64)
    ref = _first_layer_backwards(monkeypatch, Z, dO, W, wg, P, one_pass=False, kept=False)
    assert all(np.isfinite(a).all() and np.abs(a).max() > 0 for a in ref)
    for kept in (False, True):
        got = _first_layer_backwards(monkeypatch, Z, dO, W, wg, P, one_pass=True, kept=kept)
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * float(np.abs(b).max()))
    f32 = [a.astype(np.float32) for a in (Z, dO, *W, wg)]
    errors = {}
    for one_pass in (False, True):
        got = _first_layer_backwards(monkeypatch, f32[0], f32[1], f32[2:5], f32[5], P, one_pass=one_pass, kept=True)
        errors[one_pass] = [float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, ref)]
    for one, two in zip(errors[True], errors[False]):
        assert one <= max(2 * two, 1e-6) and one < 1e-4, errors
    assert errors[True] != errors[False]  # (two forms, not one twice)


def _middle_layer_gate_cotangents(monkeypatch, Z, dO, W, wg, *, q_dot_r: bool):
    """z̄ and w̄_g of a gated layer with an input cotangent, R_t's term ō_t·(o_t − z_t) taken as q_t·q̄_t or from the
    outputs (``Q_DOT_R``)."""
    monkeypatch.setattr(_layer_ir, "Q_DOT_R", q_dot_r)
    _layer_ir.gated_layer_kernels.cache_clear()
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(dO)
    _, dZb, *_, dwg = _gated_ir(Zb, W, wg, dOb, grad_z=True)
    _layer_ir.gated_layer_kernels.cache_clear()
    return _blocked.from_blocks(dZb, Z.shape[0]), dwg


@pytest.mark.parametrize("T", [9, 2 * _layer_ir.W_CHUNK + 3])
def test_gates_term_through_the_query_cotangent_equals_the_outputs_form(monkeypatch, T):
    """R_t's term ō_t·(o_t − z_t) = ō_t·S_t q_t = q_t·q̄_t (``Q_DOT_R``) gives the outputs form's z̄ and w̄_g: in
    float64 to 1e-12; in float32 closer to float64 where the attention's part of o_t is small against the residual
    z_t (W_V scaled by 0.02), where o_t − z_t cancels."""
    Z, dO, W, wg = _gated_case(np.float64, T=T, seed=11)
    ref = _middle_layer_gate_cotangents(monkeypatch, Z, dO, W, wg, q_dot_r=False)
    got = _middle_layer_gate_cotangents(monkeypatch, Z, dO, W, wg, q_dot_r=True)
    for a, b in zip(got, ref):
        assert np.isfinite(b).all() and np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * float(np.abs(b).max()))
    W = (W[0], W[1], 0.02 * W[2])
    ref = _middle_layer_gate_cotangents(monkeypatch, Z, dO, W, wg, q_dot_r=True)
    f32 = [a.astype(np.float32) for a in (Z, dO, *W, wg)]
    errors = {}
    for q_dot_r in (False, True):
        dwg = _middle_layer_gate_cotangents(monkeypatch, f32[0], f32[1], f32[2:5], f32[5], q_dot_r=q_dot_r)[1]
        errors[q_dot_r] = float(np.abs(dwg - ref[1]).max() / np.abs(ref[1]).max())
    assert errors[True] < 0.5 * errors[False], errors


def test_gated_layers_in_float32_run_the_ir_kernels_and_agree_with_numba(monkeypatch):
    """gla_native's blocked layer (multilayer_mse_grid's) in float32 with either kernel family: the same results
    to float32 rounding, the IR kernels used unless FLOAT32_LAYERS says numba."""
    Z, dO, W, wg = _gated_case(np.float32, T=31, seed=8)
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(dO)
    used, kernels = [], _layer_ir.gated_layer_kernels
    monkeypatch.setattr(_layer_ir, "gated_layer_kernels", lambda *a, **k: used.append(a) or kernels(*a, **k))
    got = {}
    for family in ("llvm", "numba"):
        monkeypatch.setattr(gla_native, "FLOAT32_LAYERS", family)
        Ob = gla_native._blocked_layer_forward(Zb, *W, wg)
        got[family] = [Ob, *gla_native._blocked_layer_backward(Zb, *W, wg, Ob, dOb)]
        assert bool(used) == (family == "llvm")
        used.clear()
    for a, b in zip(got["llvm"], got["numba"]):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-6 * float(np.abs(b).max()))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("T", [9, 2 * _layer_ir.W_CHUNK + 3])
def test_gathered_kernels_equal_the_kernels_on_a_copy_of_the_positions(dtype, T):
    """The first layer's kernels and the one-layer query read-out, reading the tokens at positions P of a longer
    blocked prompt in place (``gathered``), give the same bits as the kernels on the blocked copy of those tokens:
    outputs, W̄_q, W̄_k, W̄_v, w̄_g, loss, ū (gla_native's multi-layer grid reads each n̄'s tokens so)."""
    rng = np.random.default_rng(T)
    Z, _, W, wg = _gated_case(dtype, T=2 * T + 1, seed=T)
    B = Z.shape[0]
    P = np.sort(rng.choice(2 * T, size=T - 1, replace=False)).astype(np.int64)
    P = np.append(P, 2 * T)  # the query last
    Zfull, Zsub = _blocked.to_blocks(Z), _blocked.to_blocks(Z, positions=P)
    nb = Zsub.shape[0]
    WT = [np.ascontiguousarray(w.T) for w in W]
    dOb = _blocked.to_blocks(rng.standard_normal((B, T, DG)).astype(dtype))
    y = _blocked.lanes(rng.standard_normal(B).astype(dtype), nb)
    got = {}
    for gathered in (False, True):
        fwd, bwd = _layer_ir.gated_layer_kernels(DG, dtype, grad_z=False, gathered=gathered)
        src = (Zfull, P) if gathered else (Zsub,)
        Ob = np.full_like(Zsub, np.nan)
        gla_native._run_jobs(fwd, nb, *src, *WT, wg, Ob)
        dW, dwg = np.full((nb, 3, DG, DG), np.nan, dtype), np.full((nb, DG), np.nan, dtype)
        gla_native._run_jobs(bwd, nb, *src, *WT, wg, Ob, dOb, Zsub[:0], dW, dwg)
        query = _layer_ir.query_loss_kernel(DG, dtype, gated=True, residual=True, grad_z=False, label=3,
                                            gathered=gathered)
        outs = [np.full(nb, np.nan, dtype)] + [np.full((nb, DG, DG), np.nan, dtype) for _ in range(2)] + [
            np.full((nb, DG), np.nan, dtype) for _ in range(2)]
        args = (*src, y, W[0], W[1], np.ascontiguousarray(W[2][:, 3]), wg, B, *outs)
        gla_native._run_jobs(query, nb, *(args if gathered else args + (None,)))
        got[gathered] = [Ob, dW, dwg, *outs]
    for a, b in zip(got[False], got[True]):
        assert not np.isnan(a).any()
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_kept_projections_change_no_bit(dtype):
    """The gated layer's forward writing q_t, k_t, v_t to R and its backward reading them there (``kept``, the grid
    driver's kernels) give the bits of the kernels that compute them again in the backward: outputs, z̄ (or none),
    W̄_q, W̄_k, W̄_v, w̄_g, for tokens in place and gathered at positions; and R holds W z_t."""
    T = 2 * _layer_ir.W_CHUNK + 3
    rng = np.random.default_rng(11)
    Z, dO, W, wg = _gated_case(dtype, T=2 * T + 1, seed=11)
    P = np.append(np.sort(rng.choice(2 * T, size=T - 1, replace=False)), 2 * T).astype(np.int64)
    Zfull = _blocked.to_blocks(Z)
    nb = Zfull.shape[0]
    WT = [np.ascontiguousarray(w.T) for w in W]
    for grad_z, gathered in ((True, False), (False, False), (False, True)):
        Zin = Zfull if not gathered else _blocked.to_blocks(Z, positions=P)
        src = (Zfull, P) if gathered else (Zfull,)
        Tl = Zin.shape[1]
        dOb = _blocked.to_blocks(dO[:, :Tl])
        got = {}
        for kept in (False, True):
            fwd, bwd = _layer_ir.gated_layer_kernels(DG, dtype, grad_z=grad_z, gathered=gathered, kept=kept)
            R = (np.full((nb, Tl, 3, DG, native.LANES), np.nan, dtype),) if kept else ()
            Ob = np.full_like(Zin, np.nan)
            gla_native._run_jobs(fwd, nb, *src, *WT, wg, Ob, *R)
            dZb = np.full_like(Zin, np.nan) if grad_z else Zin[:0]
            dW, dwg = np.full((nb, 3, DG, DG), np.nan, dtype), np.full((nb, DG), np.nan, dtype)
            gla_native._run_jobs(bwd, nb, *src, *WT, wg, Ob, *R, dOb, dZb, dW, dwg)
            got[kept] = [Ob, dZb, dW, dwg]
            if kept:  # R[blk, t, i, :, lane] = z_t W_i of the lane's prompt (the model's row convention)
                z = np.moveaxis(Zin, -1, 1)  # (blocks, LANES, T, D)
                for i in range(3):
                    ref = np.moveaxis(z @ W[i], 1, -1)
                    np.testing.assert_allclose(R[0][:, :, i], ref, rtol=1e-5 if dtype == np.float32 else 1e-12,
                                               atol=1e-5 if dtype == np.float32 else 1e-12)
        for a, b in zip(got[False], got[True]):
            assert not np.isnan(a).any()
            np.testing.assert_array_equal(a, b)


def test_gathered_kernels_refuse_bad_positions():
    Z, _, W, wg = _gated_case(np.float64, T=6)
    Zb = _blocked.to_blocks(Z)
    with pytest.raises(ValueError, match="no cotangent"):
        _layer_ir.gated_layer_kernels(DG, np.float64, grad_z=True, gathered=True)
    with pytest.raises(ValueError, match="no grid, no token cotangents"):
        _layer_ir.query_loss_kernel(DG, np.float64, gated=True, residual=True, grad_z=True, label=1, gathered=True)
    fwd, _ = _layer_ir.gated_layer_kernels(DG, np.float64, grad_z=False, gathered=True)
    WT = [np.ascontiguousarray(w.T) for w in W]
    for P, match in ((np.array([0, 6], np.int64), "in \\[0, 6\\)"), (np.array([-1, 2], np.int64), "in \\[0, 6\\)"),
                     (np.array([0, 2], np.int32), "int64"), (np.array([0, 1, 2], np.int64), "2 tokens")):
        O = np.empty((Zb.shape[0], 2, DG, native.LANES))
        with pytest.raises(ValueError, match=match):
            fwd(Zb, P, *WT, wg, O, 0, Zb.shape[0])
    with pytest.raises(ValueError, match="gathered tokens"):
        fwd(Zb[:1], np.array([0, 1], np.int64), *WT, wg, np.empty((Zb.shape[0], 2, DG, native.LANES)), 0, 1)


# gating's last layer read at the query (gla_native's query-loss kernel) on the blocked layout


def _query_reference(kind, Z, y, W, wg, label, residual):
    """(loss, W̄_q, W̄_k, ū, w̄_g, z̄ (B, T, D) or None) of one model by gla_native's token-layout numba kernel
    (tested against the naive loss in tests/models/test_gla_native.py)."""
    B, T, Dq = Z.shape
    dt = Z.dtype
    nb = -(-B // gla_native.CHUNK)
    lo = np.empty((1, 1, 1, nb), dt)
    gl = [np.empty((1, 1, 1, nb, Dq, Dq), dt) for _ in range(2)] + [np.empty((1, 1, 1, nb, Dq, 1), dt),
                                                                     np.empty((1, 1, 1, nb, Dq), dt)]
    dZ = np.zeros((1, 1, 1, B, T, Dq), dt) if residual else np.zeros((1,) * 5, dt)
    kernel = gla_native._kernel(kind, Dq, dt.name, residual)
    kernel(Z[None, None], y[None, None], np.arange(T)[None], np.asarray([T]), np.zeros(1, np.int64),
           *(w[None, None, None] for w in W), wg[None, None, None], np.zeros((1, 1, 1, Dq), dt), label, lo, *gl,
           np.zeros((1,) * 5, dt), dZ, 0, nb)
    return (lo.sum(), gl[0].sum(axis=3)[0, 0, 0], gl[1].sum(axis=3)[0, 0, 0], gl[2].sum(axis=3)[0, 0, 0, :, 0],
            gl[3].sum(axis=3)[0, 0, 0], dZ[0, 0, 0] if residual else None)


def _query_ir(kind, Zb, y, W, wg, label, residual, grad_z, threads=2):
    """The same by the IR kernel on the blocked layout, its per-block outputs summed in order; z̄ blocked."""
    B = y.shape[0]
    dt = Zb.dtype
    nb, _, Dq, _ = Zb.shape
    query = _layer_ir.query_loss_kernel(Dq, dt, gated=kind == "scalar", residual=residual, grad_z=grad_z,
                                        label=label)
    loss, gv, gg = np.full(nb, np.nan, dt), np.full((nb, Dq), np.nan, dt), np.full((nb, Dq), np.nan, dt)
    gq, gk = np.full((nb, Dq, Dq), np.nan, dt), np.full((nb, Dq, Dq), np.nan, dt)
    dZ = np.full_like(Zb, np.nan) if grad_z else None
    from iclab.ops._runtime.threads import run_split
    run_split(query, nb, Zb, _blocked.lanes(y, nb), W[0], W[1], np.ascontiguousarray(W[2][:, label]), wg, B, loss,
              gq, gk, gv, gg, dZ, threads=threads)
    return loss.sum(), gq.sum(0), gk.sum(0), gv.sum(0), gg.sum(0), dZ


def _query_case(dtype, Dq, B=2 * native.LANES + 3, T=9, seed=11):
    rng = np.random.default_rng(seed)
    Z = (0.7 * rng.standard_normal((B, T, Dq))).astype(dtype)
    y = rng.standard_normal(B).astype(dtype)
    W = [(0.4 * rng.standard_normal((Dq, Dq))).astype(dtype) for _ in range(3)]
    wg = (1.5 * rng.standard_normal(Dq)).astype(dtype)  # some gates near saturation
    return Z, y, W, wg


@pytest.mark.parametrize("kind", ["scalar", "none"])
@pytest.mark.parametrize("residual, grad_z", [(True, True), (True, False), (False, False)])
def test_query_loss_ir_kernel_equals_the_token_layout_kernel_in_float64(kind, residual, grad_z, monkeypatch):
    """Loss, W̄_q, W̄_k, ū, w̄_g and (a residual stream's last layer) the token cotangents against gla_native's
    token-layout kernel, at a width below one lane group (D = 7); spare lanes zero; w̄_g zero without gates; the
    same bits for 1, 2 and 3 threads; z̄ not written without ``grad_z``."""
    label = 4
    Z, y, W, wg = _query_case(np.float64, DG)
    B = Z.shape[0]
    ref = _query_reference(kind, Z, y, W, wg, label, residual)
    Zb = _blocked.to_blocks(Z)
    outs = [_query_ir(kind, Zb, y, W, wg, label, residual, grad_z, threads=n) for n in (1, 2, 3)]
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            if a is not None:
                np.testing.assert_array_equal(a, b)
    *got, dZb = outs[0]
    for a, b in zip(got, ref[:5]):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    if kind == "none":
        assert not got[4].any()
    if grad_z:
        np.testing.assert_allclose(_blocked.from_blocks(dZb, B), ref[5], rtol=1e-12, atol=1e-12)
        assert not _unblock(dZb)[B:].any()
    else:
        assert dZb is None


@pytest.mark.parametrize("Dq", [16, pytest.param(20, marks=pytest.mark.slow)])
def test_query_loss_ir_kernel_in_float32_at_the_paper_width(Dq):
    """float32 at gating.fig2's width (16: one lane group of the W̄ sums) and beyond (20: two), against the numba
    kernel to float32 rounding."""
    label = 10
    Z, y, W, wg = _query_case(np.float32, Dq, B=3 * native.LANES, T=23, seed=12)
    ref = _query_reference("scalar", Z, y, W, wg, label, True)
    *got, dZb = _query_ir("scalar", _blocked.to_blocks(Z), y, W, wg, label, True, True)
    for a, b in zip(got + [_blocked.from_blocks(dZb, Z.shape[0])], ref):
        assert np.asarray(a).dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(np.abs(b).max()))


def test_query_loss_ir_kernel_refuses_bad_operands():
    Z, y, W, wg = _query_case(np.float64, DG, B=native.LANES, T=3)
    Zb = _blocked.to_blocks(Z)
    with pytest.raises(ValueError, match="residual"):
        _layer_ir.query_loss_kernel(DG, np.float64, gated=True, residual=False, grad_z=True, label=1)
    query = _layer_ir.query_loss_kernel(DG, np.float64, gated=True, residual=True, grad_z=False, label=1)
    nb = Zb.shape[0]
    outs = (np.empty(nb), np.empty((nb, DG, DG)), np.empty((nb, DG, DG)), np.empty((nb, DG)), np.empty((nb, DG)))
    with pytest.raises(ValueError, match="targets"):
        query(Zb, np.zeros((nb + 1, native.LANES)), W[0], W[1], W[2][:, 1].copy(), wg, 16, *outs, None, 0, nb)
    with pytest.raises(ValueError, match="per block"):
        query(Zb, np.zeros((nb, native.LANES)), W[0], W[1], W[2][:, 1].copy(), wg, 16, *outs[:4], outs[4][:0], None,
              0, nb)
    with pytest.raises(ValueError, match="C-contiguous"):
        _query_ir("scalar", Zb.astype(np.float32), y, W, wg, 1, True, False)


def test_multilayer_grid_in_float32_runs_the_ir_query_kernel_and_agrees_with_numba(monkeypatch):
    """gla_native.multilayer_mse_grid in float32 (1 and 2 layers): the IR kernels (layers and query read-out) unless
    FLOAT32_LAYERS says numba; losses and gradients the same to float32 rounding. The members' Python path, whose
    kernel choice is recorded here; the compiled driver (which takes every variant at once) gives its bits
    (test_gla_native's twin test)."""
    monkeypatch.setattr(gla_native, "GRID_DRIVER", False)
    rng = np.random.default_rng(13)
    R, B, T = 1, native.LANES + 5, 9
    Z = jnp.asarray((0.6 * rng.standard_normal((R, B, T, DG))).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((R, B)).astype(np.float32))
    pos, lens = gla_native.subsequence_positions([[0, 2, 5, 8], list(range(T))])
    used, kernels = [], _layer_ir.query_loss_kernel
    monkeypatch.setattr(_layer_ir, "query_loss_kernel", lambda *a, **k: used.append(k) or kernels(*a, **k))
    layer_used, layer_kernels = [], _layer_ir.gated_layer_kernels
    monkeypatch.setattr(_layer_ir, "gated_layer_kernels",
                        lambda *a, **k: layer_used.append(k) or layer_kernels(*a, **k))
    for L in (1, 2):
        layers = [{k: jnp.asarray((0.4 * rng.standard_normal((1, 2) + sh)).astype(np.float32))
                   for k, sh in (("Wq", (DG, DG)), ("Wk", (DG, DG)), ("Wv", (DG, DG)), ("w_g", (DG,)))}
                  for _ in range(L)]
        got = {}
        for family in ("llvm", "numba"):
            monkeypatch.setattr(gla_native, "FLOAT32_LAYERS", family)

            def loss(ls):
                return jnp.sum(gla_native.multilayer_mse_grid(ls, Z, y, positions=pos, lengths=lens, rows=[0],
                                                              label=3))

            got[family] = jax.value_and_grad(loss)(layers)
            assert bool(used) == (family == "llvm") and all(k["grad_z"] == (L > 1) for k in used)
            # the one-layer read-out and the first layer read the prompts' tokens at positions (gathered)
            assert all(k.get("gathered", False) == (L == 1) for k in used)
            if family == "llvm" and L > 1:
                assert {(k["grad_z"], k["gathered"]) for k in layer_used} == {(False, True)}
            used.clear()
            layer_used.clear()
        a, b = (jax.tree_util.tree_leaves(got[f]) for f in ("llvm", "numba"))
        for x, z in zip(a, b):
            assert x.dtype == jnp.float32
            np.testing.assert_allclose(x, z, rtol=0, atol=5e-6 * float(jnp.max(jnp.abs(z))))


@pytest.mark.parametrize("kind", ["scalar", "none"])
def test_query_grid_ir_kernel_equals_the_numba_grid_kernel(kind, monkeypatch):
    """gla_native.query_mse_grid's kernel for scalar and no gates as IR (jobs (s, m, g, block of 16), each
    gathering its prompts' tokens): every job's outputs summed as the callback sums them, against the numba
    kernel (tested against the naive loss) in float64 to rounding; the same bits for 1, 2 and 3 threads; a
    different label or out-of-range lengths refused."""
    rng = np.random.default_rng(14)
    S, R, B, Tmax, M, label = 2, 3, native.LANES + 7, 13, 2, 4
    pos, lens = gla_native.subsequence_positions([[0, 5, 9, 12], list(range(Tmax)), [3, 4, 12]])
    G = lens.size
    Z = 0.7 * rng.standard_normal((S, R, B, Tmax, DG))
    y = rng.standard_normal((S, R, B))
    rows = np.array([2, 0])
    Wq, Wk, Wv = (0.4 * rng.standard_normal((S, M, G, DG, DG)) for _ in range(3))
    Wg = 1.5 * rng.standard_normal((S, M, G, DG))
    h = np.zeros((S, M, G, DG))

    def run(kernel, lanes, threads=2):
        NB = -(-B // lanes)
        out = [np.full((S, M, G, NB), np.nan), np.full((S, M, G, NB, DG, DG), np.nan),
               np.full((S, M, G, NB, DG, DG), np.nan), np.full((S, M, G, NB, DG, 1), np.nan),
               np.full((S, M, G, NB, DG), np.nan), np.zeros((S, M, G, NB, DG))]
        from iclab.ops._runtime.threads import run_split
        run_split(kernel, S * M * G * NB, Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, *out,
                  np.zeros((1,) * 5), threads=threads)
        return [o.sum(axis=3) for o in out[:5]]

    ref = run(gla_native._kernel(kind, DG, "float64"), gla_native.CHUNK)
    ir = _layer_ir.query_grid_kernel(DG, np.float64, gated=kind == "scalar", label=label)
    outs = [run(ir, native.LANES, threads=n) for n in (1, 2, 3)]
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(outs[0], ref):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="label"):
        ir(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label + 1, *[None] * 7, 0, 1)
    with pytest.raises(ValueError, match="out of range"):
        NB = -(-B // native.LANES)
        ir(Z, y, pos, lens + Tmax, rows, Wq, Wk, Wv, Wg, h, label, np.empty((S, M, G, NB)),
           np.empty((S, M, G, NB, DG, DG)), np.empty((S, M, G, NB, DG, DG)), np.empty((S, M, G, NB, DG, 1)),
           np.empty((S, M, G, NB, DG)), None, None, 0, 1)


@pytest.mark.parametrize("gates", ["scalar", "vector"])
def test_query_mse_grid_in_float32_runs_the_ir_kernel_and_agrees_with_numba(gates, monkeypatch):
    """gla_native.query_mse_grid in float32 with scalar gates, and vector gates with a head: the IR grid kernels
    unless FLOAT32_LAYERS says numba; losses and gradients the same to float32 rounding."""
    rng = np.random.default_rng(15)
    R, B, T, M, G = 2, native.LANES + 5, 9, 2, 3
    Z = jnp.asarray((0.6 * rng.standard_normal((R, B, T, DG))).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((R, B)).astype(np.float32))
    pos, lens = gla_native.subsequence_positions([[0, 2, 5, 8], list(range(T)), [1, 8]])
    shapes = (("Wq", (DG, DG)), ("Wk", (DG, DG)), ("Wv", (DG, DG)))
    shapes += (("w_g", (DG,)),) if gates == "scalar" else (("W_g", (DG, DG)), ("h", (DG,)))
    P = {k: jnp.asarray((0.4 * rng.standard_normal((M, G) + sh)).astype(np.float32)) for k, sh in shapes}
    name = "query_grid_kernel" if gates == "scalar" else "vector_grid_kernel"
    used, kernels = [], getattr(_layer_ir, name)
    monkeypatch.setattr(_layer_ir, name, lambda *a, **k: used.append(a) or kernels(*a, **k))
    got = {}
    for family in ("llvm", "numba"):
        monkeypatch.setattr(gla_native, "FLOAT32_LAYERS", family)

        def loss(P):
            return jnp.sum(gla_native.query_mse_grid(P, Z, y, positions=pos, lengths=lens, rows=[1, 0], label=3))

        got[family] = jax.value_and_grad(loss)(P)
        assert bool(used) == (family == "llvm")
        used.clear()
    for x, z in zip(*(jax.tree_util.tree_leaves(got[f]) for f in ("llvm", "numba"))):
        assert x.dtype == jnp.float32
        np.testing.assert_allclose(x, z, rtol=0, atol=5e-6 * float(jnp.max(jnp.abs(z))))


def test_vector_grid_ir_kernel_equals_the_numba_vector_kernel(monkeypatch):
    """Vector gates and a head (gla_native._VECTOR_KERNEL's grid) as IR: every output summed over the jobs as the
    callback sums them, against numba's (tested against the naive loss) in float64 to rounding (the exponential
    is llvm.exp there), in float32 to float32 rounding (the exponential inline); 1, 2 and 3 threads the same bits;
    query_mse_grid in float32 uses it unless FLOAT32_LAYERS says numba."""
    rng = np.random.default_rng(16)
    S, R, B, Tmax, M = 2, 3, native.LANES + 7, 13, 2
    pos, lens = gla_native.subsequence_positions([[0, 5, 9, 12], list(range(Tmax)), [3, 4, 12]])
    G = lens.size
    rows = np.array([2, 0])

    def case(dt):
        Z = (0.7 * rng.standard_normal((S, R, B, Tmax, DG))).astype(dt)
        y = rng.standard_normal((S, R, B)).astype(dt)
        W = [(0.4 * rng.standard_normal((S, M, G, DG, DG))).astype(dt) for _ in range(3)]
        Wg = (2.0 * rng.standard_normal((S, M, G, DG, DG))).astype(dt)  # gates near saturation too
        return Z, y, W, Wg, (0.5 * rng.standard_normal((S, M, G, DG))).astype(dt)

    def run(kernel, lanes, args, threads=2):
        Z, y, W, Wg, h = args
        dt = Z.dtype
        NB = -(-B // lanes)
        out = [np.full((S, M, G, NB), np.nan, dt)] + [np.full((S, M, G, NB, DG, DG), np.nan, dt) for _ in range(4)]
        out.append(np.full((S, M, G, NB, DG), np.nan, dt))
        from iclab.ops._runtime.threads import run_split
        run_split(kernel, S * M * G * NB, Z, y, pos, lens, rows, *W, Wg, h, 0, *out, np.zeros((1,) * 5, dt),
                  threads=threads)
        return [o.sum(axis=3) for o in out]

    for dt, tol in ((np.float64, 1e-13), (np.float32, 2e-6)):
        args = case(dt)
        ref = run(gla_native._kernel("vector", DG, np.dtype(dt).name), gla_native.CHUNK, args)
        ir = _layer_ir.vector_grid_kernel(DG, dt)
        outs = [run(ir, native.LANES, args, threads=n) for n in (1, 2, 3)]
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                np.testing.assert_array_equal(a, b)
        for a, b in zip(outs[0], ref):
            assert a.dtype == dt
            np.testing.assert_allclose(a, b, rtol=0, atol=tol * float(np.abs(b).max()))


def test_inline_exponential_is_within_two_ulp():
    """The vector gates' float32 e^x (x ≤ 0) against e^x in float64: relative error below 2 ulp (2⁻²³) down to
    x = −87, and below 2·10⁻³⁸ absolute beyond."""
    import ctypes

    from iclab.ops._runtime.llvm import compile_function

    ir = _layer_ir._Builder(np.float32)
    ir.lines.append("define void @f(ptr noalias %X, ptr noalias %Y, i64 %n) {")
    ir.label("entry")
    ir.emit("br label %l")
    _layer_ir._loop_head(ir, "l", "entry", "l.body", "0", 1, "%n")
    ir.emit(f"%o = mul i64 %l.i, {native.LANES}")
    ir.store(_layer_ir._exp_nonpositive(ir, ir.load(ir.gep("%X", "%o"), 0)), ir.gep("%Y", "%o"), 0)
    ir.emit("br label %l")
    ir.label("l.done")
    ir.emit("ret void")
    f = compile_function(ir.text(), "f", None, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))
    x = -np.concatenate([np.linspace(0.0, 100.0, 160_000), np.abs(np.random.default_rng(17).standard_normal(160_000))])
    x = x.astype(np.float32)
    y = np.empty_like(x)
    f(x.ctypes.data, y.ctypes.data, x.size // native.LANES)
    ref = np.exp(x.astype(np.float64))
    normal = x >= -87
    assert np.max(np.abs(y[normal] - ref[normal]) / ref[normal]) < 2 * 2.0 ** -23
    assert np.max(np.abs(y[~normal] - ref[~normal])) < 2e-38


def _expf_pair_kernel():
    """``both(x)`` -> (A, B) for float32 x (a multiple of LANES values): the inline expf (A) and ``llvm.exp``, i.e.
    glibc's ``expf`` called per lane (B), computed under the kernels' flush-to-zero."""
    import ctypes

    from iclab.ops._runtime.llvm import compile_function

    L = native.LANES
    ir = _layer_ir._Builder(np.float32)
    ir.lines.append("define void @f(ptr noalias %X, ptr noalias %A, ptr noalias %B, i64 %first, i64 %stop) {")
    ir.label("entry")
    ir.emit("br label %l")
    _layer_ir._loop_head(ir, "l", "entry", "l.body", "%first", 1, "%stop")
    ir.emit(f"%o = mul i64 %l.i, {L}")
    x = ir.load(ir.gep("%X", "%o"), 0)
    ir.store(_layer_ir._expf_glibc(ir, x), ir.gep("%A", "%o"), 0)
    ir.emit(f"%ref = call {ir.V} @llvm.exp.v{L}f32({ir.V} {x})")
    ir.store("%ref", ir.gep("%B", "%o"), 0)
    ir.emit("br label %l")
    ir.label("l.done")
    ir.emit("ret void")
    P, I = ctypes.c_void_p, ctypes.c_int64
    f = compile_function(ir.text(), "f", None, (P, P, P, I, I))

    def both(x):
        x = np.ascontiguousarray(x, np.float32)
        assert x.size % L == 0
        A, B = np.empty_like(x), np.empty_like(x)
        from iclab.ops._runtime.threads import run_split
        run_split(lambda first, stop: f(x.ctypes.data, A.ctypes.data, B.ctypes.data, first, stop), x.size // L,
                  threads=2)  # with the kernels' flush-to-zero
        return A, B

    return both


def _same_floats(A, B):
    return (A.view(np.uint32) == B.view(np.uint32)) | (np.isnan(A) & np.isnan(B))


def test_inline_expf_is_glibc_expf_bit_for_bit():
    """The scalar gates' inline expf (x ≤ 0) against glibc's expf per lane, bit for bit: a million random x in
    [−110, 0], the ends of float32's range (−87.34: the smallest normal result; −103.97: glibc's zero; −110: the
    clamp), −0, −inf, NaN, tiny and subnormal x."""
    both = _expf_pair_kernel()
    rng = np.random.default_rng(23)
    special = np.array([-0.0, 0.0, -np.inf, np.nan, -1e-45, -1e-38, -1e-30, -1e-8, -0.5, -np.log(2), -1.0,
                        -87.33654, -87.33655, -87.3366, -88.0, -103.97, -103.972, -104.0, -110.0, -110.00001,
                        -1e4, -3.4e38], np.float32)
    edges = np.concatenate([(np.float32(v).view(np.uint32) + np.arange(-64, 64)).astype(np.uint32).view(np.float32)
                            for v in (-87.33655, -103.97208, -110.0)])  # 64 floats either side of each end
    x = np.concatenate([-110 * rng.random(1 << 20).astype(np.float32), -np.abs(rng.standard_normal(1 << 16)
                                                                               ).astype(np.float32), special, edges])
    x = np.concatenate([x, np.zeros(-x.size % native.LANES, np.float32)])
    A, B = both(x)
    assert _same_floats(A, B).all(), x[~_same_floats(A, B)][:5]
    assert B[x == -np.inf][0] == 0 and np.isnan(A[np.isnan(x)]).all() and (A[x == -0.0] == 1).all()


@pytest.mark.slow
def test_inline_expf_is_glibc_expf_on_every_float32_in_its_domain():
    """Every float32 from −0 down to −110 (and 2²⁴ beyond): ≈ 1.16·10⁹ values, bit for bit."""
    both = _expf_pair_kernel()
    chunk = 1 << 24
    for start in range(0x80000000, 0xC2DC0000 + chunk, chunk):
        x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        A, B = both(x)
        ok = _same_floats(A, B)
        assert ok.all(), x[~ok][:5]


@pytest.mark.parametrize("T", [9, 40])
def test_float32_gated_kernels_give_the_same_bits_with_the_inline_or_the_called_expf(monkeypatch, T):
    """The gated layer's forward and backward and the query read-out in float32, built with the scalar gates' expf
    inline (the default) and called per lane: the same bits."""
    Z, dO, W, wg = _gated_case(np.float32, T=T, seed=31)
    B = Z.shape[0]
    Zb, dOb = _blocked.to_blocks(Z), _blocked.to_blocks(dO)
    nb = Zb.shape[0]
    y = np.linspace(-1, 1, B).astype(np.float32)
    got = {}
    for inline in (True, False):
        monkeypatch.setattr(_layer_ir, "INLINE_EXPF", inline)
        fwd, bwd = _layer_ir.gated_layer_kernels.__wrapped__(DG, np.float32, grad_z=True)
        WT = [np.ascontiguousarray(w.T) for w in W]
        Ob = np.full_like(Zb, np.nan)
        gla_native._run_jobs(fwd, nb, Zb, *WT, wg, Ob)
        dZb, dW, dwg = np.full_like(Zb, np.nan), np.empty((nb, 3, DG, DG), np.float32), np.empty((nb, DG), np.float32)
        gla_native._run_jobs(bwd, nb, Zb, *WT, wg, Ob, dOb, dZb, dW, dwg)
        query = _layer_ir.query_loss_kernel.__wrapped__(DG, np.float32, gated=True, residual=True, grad_z=True,
                                                         label=2)
        outs = [np.empty(nb, np.float32), np.empty((nb, DG, DG), np.float32), np.empty((nb, DG, DG), np.float32),
                np.empty((nb, DG), np.float32), np.empty((nb, DG), np.float32), np.full_like(Zb, np.nan)]
        gla_native._run_jobs(query, nb, Zb, _blocked.lanes(y, nb), W[0], W[1], np.ascontiguousarray(W[2][:, 2]), wg,
                             B, *outs)
        got[inline] = [Ob, dZb, dW, dwg, *outs]
    for a, b in zip(got[True], got[False]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 5, 16, 21])
def test_transposed_lane_sums_are_the_lane_by_lane_sums_bit_for_bit(dtype, n):
    """The backward's weight-gradient sums over the lanes, four at a time through 4 × 4 transposes (``lane_sums``,
    and ``lane_sums_loop``: four an iteration of a loop, the rest after it), against the sum lane by lane in double
    (``lane_sum``, the numba kernels' order): the same bits, for a partial group, one group and more, at an offset;
    values of mixed magnitude so that the order of the additions shows."""
    import ctypes

    from iclab.ops._runtime.llvm import compile_function

    L = native.LANES
    rng = np.random.default_rng(n)
    X = (rng.standard_normal((n, L)) * 10.0 ** rng.integers(-6, 7, (n, L))).astype(dtype)
    outs = []
    for way in ("lane_sum", "lane_sums", "lane_sums_loop"):
        ir = _layer_ir._Builder(dtype)
        ir.lines.append("define void @f(ptr noalias %X, ptr noalias %Y) {")
        ir.label("entry")
        if way == "lane_sums_loop":
            ir.lane_sums_loop("%X", n, ir.gep("%Y", 3))
        else:
            vecs = [ir.load("%X", i) for i in range(n)]
            if way == "lane_sums":
                ir.lane_sums(vecs, "%Y", 3)
            for i, v in enumerate(vecs if way == "lane_sum" else ()):
                ir.lane_sum(v, "%Y", 3 + i)
        ir.emit("ret void")
        f = compile_function(ir.text(), "f", None, (ctypes.c_void_p, ctypes.c_void_p))
        Y = np.full(n + 6, np.nan, dtype)
        f(X.ctypes.data, Y.ctypes.data)
        outs.append(Y)
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
    assert np.isnan(outs[0][:3]).all() and np.isnan(outs[0][3 + n:]).all() and not np.isnan(outs[0][3:3 + n]).any()
    np.testing.assert_allclose(outs[0][3:3 + n], X.astype(np.float64).sum(axis=1), rtol=1e-6)


def test_scratch_is_aligned_kept_per_thread_and_grown():
    """The kernels' scratch (``_scratch``): on a cache line, the same buffer for the same thread and slot while it
    is large enough, a larger one when not, and another thread's its own (threads run kernels side by side)."""
    import threading

    a = _layer_ir._scratch(7, (10, 16), np.float32)
    assert a % _blocked.ALIGN == 0
    assert _layer_ir._scratch(7, (5, 16), np.float32) == a
    assert _layer_ir._scratch(8, (5, 16), np.float32) != a
    big = _layer_ir._scratch(7, (1000, 16), np.float64)
    assert big % _blocked.ALIGN == 0 and _layer_ir._scratch(7, (10, 16), np.float32) == big
    other = []
    t = threading.Thread(target=lambda: other.append(_layer_ir._scratch(7, (10, 16), np.float32)))
    t.start()
    t.join()
    assert other[0] != big and other[0] % _blocked.ALIGN == 0
