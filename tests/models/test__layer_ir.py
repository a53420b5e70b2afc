"""The full-layer kernels as LLVM IR (iclab.models._layer_ir) against their twins, for drift's layer (forget factor
λ) and gating's (scalar gates): the token-layout kernels (tested against the parallel and naive forms) and the numba
kernels on the blocked layout: outputs, the backward with and without z̄ (and λ̄), in float64 (to rounding) and
float32; spare lanes; thread counts; the models' losses with either kernel family in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.models import _blocked, _layer_ir
from iclab.models import gla_forget as gla
from iclab.models import gla_forget_native as native
from iclab.models import gla_native
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


@pytest.mark.parametrize("residual", [True, False])
def test_ir_kernels_equal_the_token_layout_kernels_in_float64(residual):
    Z, dO, W = _operands(np.float64)
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
        return jnp.sum(jax.vmap(lambda p, l: native.multilayer_mse(p, Z, y, l))(P, lam) * jnp.asarray([1.0, 2.0], jnp.float32))

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


def test_gated_ir_kernels_equal_the_token_layout_kernels_in_float64(monkeypatch):
    """Outputs, the input cotangent (or none on a first layer), every weight's and the gate weights' gradients,
    against gla_native's token-layout kernels (tested against the naive forms); spare lanes zero; the same bits
    for 1, 2 and 3 threads."""
    Z, dO, W, wg = _gated_case(np.float64)
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
