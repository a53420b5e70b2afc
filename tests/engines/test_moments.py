"""The moments engine against full-batch GD on the prompts, for every linear model form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.engines import moments, sampled
from iclab.models import linattn as m
from iclab.tasks.linreg import covariance, sample_prompts

D, N, P = 3, 5, 400


def _setup(seed=0):
    key = jax.random.PRNGKey(seed)
    Lam = covariance([0.5, 0.3, 0.2], jax.random.fold_in(key, 0))
    return key, sample_prompts(jax.random.fold_in(key, 1), Lam, N, P)


def _forms(key):
    kinit, kfull = jax.random.split(key)
    attn_m = m.init_attn_m(kinit, D, 4, w_init=0.5)
    attn_s1 = m.init_attn_s(kinit, D, 3, 1, w_init=0.8)
    attn_s2 = m.init_attn_s(kinit, D, 2, 2, w_init=0.8)
    return {
        "attn_m": (m.predict_attn_m, m.tensor_attn_m, m.cubic_feature, attn_m),
        "mlp": (m.predict_mlp, m.tensor_mlp, m.cubic_feature, m.mlp_from_attn_m(attn_m)),
        "attn_s_r1": (m.predict_attn_s, m.tensor_attn_s, m.cubic_feature, attn_s1),
        "attn_s_r2": (m.predict_attn_s, m.tensor_attn_s, m.cubic_feature, attn_s2),
        # Full matrices: every block trainable, the "zero" blocks only zero-initialised, the
        # blocks that never reach ŷ_q random.
        "attn_m_full": (m.predict_attn_m_full, m.tensor_attn_m_full, m.full_feature,
                        m.attn_m_full_from_reduced(attn_m, kfull, 0.3)),
        "attn_s_full": (m.predict_attn_s_full, m.tensor_attn_s_full, m.full_feature,
                        m.attn_s_full_from_reduced(attn_s2, kfull, 0.3)),
    }


@pytest.mark.parametrize("form", ["attn_m", "mlp", "attn_s_r1", "attn_s_r2", "attn_m_full", "attn_s_full"])
def test_tensor_view_reproduces_the_prediction(form):
    key, pr = _setup()
    predict, tensor, feature, params = _forms(key)[form]
    np.testing.assert_allclose(feature(pr) @ tensor(params), predict(params, pr), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("form", ["attn_m", "mlp", "attn_s_r1", "attn_s_r2", "attn_m_full", "attn_s_full"])
def test_moments_trajectory_equals_full_batch_gd(form):
    key, pr = _setup(1)
    predict, tensor, feature, params = _forms(key)[form]
    kw = dict(lr=0.2, n_steps=300, record_every=10, record_params=True)
    mse = lambda p, d: jnp.mean((d.y_q - predict(p, d)) ** 2)  # noqa: E731
    ref = sampled.full_batch(mse, params, pr, **kw)
    fast = moments.full_batch(tensor, params, moments.sufficient_statistics(feature(pr), pr.y_q, chunk=128), **kw)
    assert ref.loss[-1] < 0.7 * ref.loss[0]  # it learned something: the comparison is not trivial
    np.testing.assert_allclose(fast.loss, ref.loss, rtol=1e-10)
    for name in params:
        np.testing.assert_allclose(fast.params[name][-1], ref.params[name][-1], rtol=1e-8, atol=1e-12)


def test_sufficient_statistics_chunking_and_values():
    key, pr = _setup(2)
    z = m.cubic_feature(pr)
    a = moments.sufficient_statistics(z, pr.y_q, chunk=7)
    b = moments.sufficient_statistics(z, pr.y_q, chunk=10_000)
    np.testing.assert_allclose(a.G, b.G, rtol=1e-13)
    np.testing.assert_allclose(a.G, np.asarray(z).T @ np.asarray(z) / P, rtol=1e-12)
    np.testing.assert_allclose(a.m, np.asarray(z).T @ np.asarray(pr.y_q) / P, rtol=1e-12)
    assert float(a.c) == pytest.approx(float(jnp.mean(pr.y_q**2)), rel=1e-13)
    T = jax.random.normal(key, (D * D,))
    assert float(moments.quadratic_loss(T, a)) == pytest.approx(float(jnp.mean((pr.y_q - z @ T) ** 2)), rel=1e-11)


def test_batched_moments_equal_separate_runs():
    key, _ = _setup()
    runs = []
    for s in range(2):
        _, pr = _setup(10 + s)
        params = m.init_attn_s(jax.random.fold_in(key, s), D, 3, 1, 0.8)
        runs.append((params, moments.sufficient_statistics(m.cubic_feature(pr), pr.y_q)))
    stack = lambda trees: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    params = stack([r[0] for r in runs])
    st = moments.SufficientStatistics(*[jnp.stack([getattr(r[1], f) for r in runs]) for f in ("c", "m", "G")], P)
    tr = moments.full_batch(m.tensor_attn_s, params, st, lr=0.2, n_steps=50, record_every=5, batched=True)
    for s, (p, stt) in enumerate(runs):
        single = moments.full_batch(m.tensor_attn_s, p, stt, lr=0.2, n_steps=50, record_every=5)
        np.testing.assert_allclose(tr.loss[s], single.loss, rtol=1e-12)
