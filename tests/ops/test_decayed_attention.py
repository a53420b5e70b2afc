"""iclab.ops' decayed-state attention, every backend against the pure-JAX recurrence (ops/decayed_attention/naive.py):
values and gradients in float64, over a grid of shapes; and the backend chosen by the run option."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab import ops
from iclab.ops.decayed_attention import naive

# (B, T, D): one token, and a short prompt of several blocks' worth of lanes; one width, so that the kernels compile
# once (each width is a kernel of its own; the ops' own tests cover more widths)
SHAPES = [(1, 1, 4), (3, 7, 4)]


def _close(a, b, tol=1e-12):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.max(np.abs(b))))
    assert float(np.max(np.abs(a - b))) <= tol * scale, float(np.max(np.abs(a - b))) / scale


def _weights(rng, D, scale=0.4):
    return [jnp.asarray(scale * rng.standard_normal((D, D))) for _ in range(3)]


@pytest.mark.parametrize("B,T,D", SHAPES)
def test_forget_layer_native_equals_the_recurrence(B, T, D):
    rng = np.random.default_rng(B * 100 + T)
    Z = jnp.asarray(rng.standard_normal((B, T, D)))
    WQ, WK, WV = _weights(rng, D)
    lam = 0.83
    _close(ops.forget_layer(Z, WQ, WK, WV, lam, backend="native"), naive.forget_layer(Z, WQ, WK, WV, lam))
    cot = jnp.asarray(rng.standard_normal((B, T, D)))

    def loss(fn):
        return lambda Z, WQ, WK, WV, lam: jnp.sum(cot * fn(Z, WQ, WK, WV, lam))

    got = jax.grad(loss(lambda *a: ops.forget_layer(*a, backend="native")), argnums=(0, 1, 2, 3, 4))(
        Z, WQ, WK, WV, jnp.asarray(lam))
    want = jax.grad(loss(naive.forget_layer), argnums=(0, 1, 2, 3, 4))(Z, WQ, WK, WV, jnp.asarray(lam))
    for g, w in zip(got, want):
        _close(g, w, 1e-11)


@pytest.mark.parametrize("B,T,D", SHAPES)
def test_gated_layer_native_equals_the_recurrence(B, T, D):
    rng = np.random.default_rng(B * 10 + D)
    Z = jnp.asarray(rng.standard_normal((B, T, D)))
    Wq, Wk, Wv = _weights(rng, D)
    w = {"Wq": Wq, "Wk": Wk, "Wv": Wv, "w_g": jnp.asarray(rng.standard_normal(D))}
    _close(ops.gated_layer(Z, w, backend="native"), naive.gated_layer(Z, w))
    cot = jnp.asarray(rng.standard_normal((B, T, D)))
    got = jax.grad(lambda w, Z: jnp.sum(cot * ops.gated_layer(Z, w, backend="native")), argnums=(0, 1))(w, Z)
    want = jax.grad(lambda w, Z: jnp.sum(cot * naive.gated_layer(Z, w)), argnums=(0, 1))(w, Z)
    for k in w:
        _close(got[0][k], want[0][k], 1e-11)
    _close(got[1], want[1], 1e-11)


def test_the_recurrence_is_the_definition():
    """naive.decayed_attention against S_t written out by hand for three tokens (the reference of the reference)."""
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((3, 2)) for _ in range(3))
    d = np.array([0.5, 0.9, 0.7])
    S, want = np.zeros((2, 2)), []
    for t in range(3):
        S = d[t] * S + np.outer(V[t], K[t])
        want.append(S @ Q[t])
    _close(naive.decayed_attention(jnp.asarray(Q), jnp.asarray(K), jnp.asarray(V), jnp.asarray(d)), np.array(want))


@pytest.mark.parametrize("G,K,B,T,D", [(1, 1, 1, 3, 4), (2, 3, 5, 9, 4)])
def test_forget_readout_grid_native_equals_the_sum(G, K, B, T, D):
    rng = np.random.default_rng(G + K + T)
    Z = jnp.asarray(rng.standard_normal((G, B, T, D)))
    u, c = jnp.asarray(rng.standard_normal((G, K, D))), jnp.asarray(rng.standard_normal((G, K, B, D)))
    lam = jnp.asarray(rng.uniform(0.5, 1.0, (G, K)))
    _close(ops.forget_readout_grid(Z, u, c, lam, backend="native"), naive.forget_readout_grid(Z, u, c, lam))
    cot = jnp.asarray(rng.standard_normal((G, K, B)))
    got = jax.grad(lambda u, c, lam: jnp.sum(cot * ops.forget_readout_grid(Z, u, c, lam, backend="native")),
                   argnums=(0, 1, 2))(u, c, lam)
    want = jax.grad(lambda u, c, lam: jnp.sum(cot * naive.forget_readout_grid(Z, u, c, lam)), argnums=(0, 1, 2))(
        u, c, lam)
    for g, w in zip(got, want):
        _close(g, w, 1e-11)


@pytest.mark.parametrize("L", [1, 3])
def test_forget_multilayer_mse_native_equals_the_composed_layers(L):
    rng = np.random.default_rng(L)
    B, T, D = 6, 8, 4
    Z, y = jnp.asarray(rng.standard_normal((B, T, D))), jnp.asarray(rng.standard_normal(B))
    W = [jnp.asarray(0.3 * rng.standard_normal((L, D, D))) for _ in range(3)]
    lam = jnp.asarray(0.9)
    _close(ops.forget_multilayer_mse(Z, y, *W, lam, backend="native"), naive.forget_multilayer_mse(Z, y, *W, lam))
    got = jax.grad(lambda W, lam: ops.forget_multilayer_mse(Z, y, *W, lam, backend="native"), argnums=(0, 1))(W, lam)
    want = jax.grad(lambda W, lam: naive.forget_multilayer_mse(Z, y, *W, lam), argnums=(0, 1))(W, lam)
    for g, w in zip(got[0], want[0]):
        _close(g, w, 1e-10)
    _close(got[1], want[1], 1e-10)


def test_the_backend_in_force_picks_the_form(monkeypatch):
    """backend=None reads the run's backend (iclab.ops.use_backend): xla runs the recurrence, native the kernels."""
    from iclab.ops.decayed_attention import forget

    calls = []
    monkeypatch.setattr(forget, "forget_layer", lambda *a: calls.append("native") or naive.forget_layer(*a))
    monkeypatch.setattr(naive, "forget_layer", lambda *a, real=naive.forget_layer: calls.append("xla") or real(*a))
    Z = jnp.ones((1, 2, 2))
    W = jnp.eye(2)
    with ops.use_backend("xla"):
        ops.forget_layer(Z, W, W, W, 0.5)
    with ops.use_backend("native"):
        ops.forget_layer(Z, W, W, W, 0.5)
    assert calls[0] == "xla" and calls[1] == "native"
    with pytest.raises(ValueError, match="backend must be one of auto, native, xla"):
        ops.forget_layer(Z, W, W, W, 0.5, backend="gpu")
