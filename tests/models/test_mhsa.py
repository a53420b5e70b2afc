import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.models import mhsa as m
from iclab.tasks.multitask_regression import sample_prompts, task_structure


def _naive(params, X, Y, q, score):
    """Per-prompt, per-head, per-token loop of eq 2.1 in float64 numpy."""
    K, Q, V, O = (np.asarray(params[k]) for k in ("K", "Q", "V", "O"))
    H, d_e, D = K.shape
    P, d, L = X.shape
    out = np.zeros((P, Y.shape[1]))
    for p in range(P):
        zq = np.concatenate([q[p], np.zeros(Y.shape[1])])
        toks = [np.concatenate([X[p, :, l], Y[p, :, l]]) for l in range(L)]
        for h in range(H):
            s = np.array([toks[l] @ K[h].T @ Q[h] @ zq / np.sqrt(d_e) for l in range(L)])
            if score == "softmax":
                a = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            elif score == "relu":
                a = np.maximum(s, 0) / L
            else:
                a = s / L
            for l in range(L):
                out[p] += a[l] * (O[h] @ V[h] @ toks[l])
    return out


def _setup(H=2, d_i=(2, 3), d_y=3, d_e=6, L=5, P=3, seed=0):
    ts = task_structure(d_i, (1.0, 0.7), sigma=0.3, d_y=d_y)
    pr = sample_prompts(jax.random.PRNGKey(seed), ts, L=L, P=P)
    D = sum(d_i) + d_y
    ks = jax.random.split(jax.random.PRNGKey(seed + 1), 4)
    params = {"K": jax.random.normal(ks[0], (H, d_e, D)), "Q": jax.random.normal(ks[1], (H, d_e, D)),
              "V": jax.random.normal(ks[2], (H, d_e, D)), "O": jax.random.normal(ks[3], (H, d_y, d_e))}
    return pr, params


@pytest.mark.parametrize("score,shape", [("softmax", dict(H=3, d_e=7, L=4)),
                                         ("relu", dict(H=2, d_e=6)), ("linear", dict(H=2, d_e=6))])
def test_vectorised_forward_and_gradient_match_naive_loop(score, shape):
    pr, params = _setup(**shape)
    X, Y, q = (np.asarray(a) for a in (pr.X, pr.Y, pr.q))
    # jitted: one compilation instead of one per primitive in eager mode (same arithmetic)
    predict = jax.jit(lambda p: m.predict(p, pr.X, pr.Y, pr.q, score))
    np.testing.assert_allclose(predict(params), _naive(params, X, Y, q, score), rtol=1e-12, atol=1e-12)
    # gradient of ½-MSE by autograd vs central differences of the naive loop (one direction)
    loss = lambda p: 0.5 * jnp.mean(jnp.sum((m.predict(p, pr.X, pr.Y, pr.q, score) - pr.y_q) ** 2, -1))
    g = jax.jit(jax.grad(loss))(params)
    dirs = jax.tree_util.tree_map(lambda a: jax.random.normal(jax.random.PRNGKey(9), a.shape), params)
    eps = 1e-5
    f = lambda t: 0.5 * np.mean(np.sum((_naive(jax.tree_util.tree_map(lambda a, b: a + t * b, params, dirs),
                                               X, Y, q, score) - np.asarray(pr.y_q)) ** 2, -1))
    fd = (f(eps) - f(-eps)) / (2 * eps)
    an = sum(float(jnp.vdot(g[k], dirs[k])) for k in params)
    assert abs(fd - an) <= 1e-7 * max(1.0, abs(an))


@pytest.mark.parametrize("score", [pytest.param("softmax", marks=pytest.mark.slow), "relu"])
def test_spectral_map_gives_same_output_and_readout_inverts_it(score):
    d_i, d_y, d_e = (2, 3), 3, 7
    ts = task_structure(d_i, (1.0, 0.7), sigma=0.3, d_y=d_y)
    pr = sample_prompts(jax.random.PRNGKey(4), ts, L=6, P=4)
    spec = {"omega": jnp.array([[0.3, 0.05], [0.02, 0.4], [0.1, 0.1]]),
            "mu": jnp.array([[1.5, 0.1], [0.2, 2.0], [0.0, 0.3]])}
    full = m.spectral_to_full(spec, d_i, d_y, d_e)
    ys = m.predict_spectral(spec, pr.X, pr.Y, pr.q, d_i, score)
    yf = m.predict(full, pr.X, pr.Y, pr.q, score)
    np.testing.assert_allclose(yf[:, :2], ys, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(yf[:, 2], 0.0, atol=1e-14)  # nominal output has μ = 0
    back = m.read_spectral(full, d_i)
    np.testing.assert_allclose(back["omega"], spec["omega"], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(back["mu"], spec["mu"], rtol=1e-13, atol=1e-15)
    WX, WY, UX, UY = m.effective_matrices(full, sum(d_i))
    assert float(jnp.abs(WY).max()) == 0.0 and float(jnp.abs(UX).max()) == 0.0
    # balanced: σ(K_X) = σ(Q_X), σ(O) = σ(V_Y)
    np.testing.assert_array_equal(full["K"], full["Q"])
