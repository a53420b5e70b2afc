"""The compiled moments kernels against the XLA moments engine and full-batch GD on the prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.engines import moments, moments_native, sampled
from iclab.engines import Diverged
from iclab.models import linattn as m
from iclab.tasks.linreg import covariance, sample_prompts

N, P = 5, 300
TENSOR = {"attn_s": m.tensor_attn_s, "attn_m": m.tensor_attn_m, "mlp": m.tensor_mlp}


def _problem(model: str, D: int, H: int, R: int, seed: int = 0, S: int | None = None):
    """(params, stats) of one seed, or of S seeds stacked (a leading axis), on P prompts."""
    def one(s):
        key = jax.random.PRNGKey(100 * seed + s)
        Lam = covariance(np.linspace(1.0, 0.3, D) / np.linspace(1.0, 0.3, D).sum(), jax.random.fold_in(key, 0))
        pr = sample_prompts(jax.random.fold_in(key, 1), Lam, N, P)
        kinit = jax.random.fold_in(key, 2)
        if model == "attn_s":
            params = m.init_attn_s(kinit, D, H, R, w_init=0.8)
        else:
            params = m.init_attn_m(kinit, D, H, w_init=0.6)
            if model == "mlp":
                params = m.mlp_from_attn_m(params)
        return params, moments.sufficient_statistics(m.cubic_feature(pr), pr.y_q, chunk=128), pr

    if S is None:
        return one(0)
    runs = [one(s) for s in range(S)]
    stack = lambda *a: jnp.stack(a)  # noqa: E731
    params = jax.tree_util.tree_map(stack, *[r[0] for r in runs])
    st = moments.SufficientStatistics(*(jnp.stack([getattr(r[1], f) for r in runs]) for f in ("c", "m", "G")), P)
    return params, st, None


GRID = [("attn_s", 3, 3, 1), ("attn_s", 3, 2, 2), ("attn_s", 4, 3, 2), ("attn_s", 1, 2, 1),
        ("attn_m", 3, 4, 1), ("attn_m", 2, 3, 1), ("mlp", 3, 4, 1)]


@pytest.mark.parametrize("model,D,H,R", GRID)
@pytest.mark.parametrize("batched", [False, True])
def test_kernel_follows_the_xla_moments_engine(model, D, H, R, batched):
    params, st, _ = _problem(model, D, H, R, S=2 if batched else None)
    kw = dict(lr=0.3, n_steps=400, record_every=9, record_params=True, batched=batched)
    ref = moments.full_batch(TENSOR[model], params, st, **kw)
    fast = moments_native.full_batch(model, params, st, **kw)
    loss = np.asarray(ref.loss)
    assert np.all(loss[..., -1] < 0.8 * loss[..., 0])  # the weights moved: the comparison is not trivial
    np.testing.assert_array_equal(fast.step, ref.step)
    np.testing.assert_allclose(fast.t, ref.t, rtol=1e-13)
    np.testing.assert_allclose(fast.loss, loss, rtol=1e-12)
    assert set(fast.params) == set(params)
    for name in params:
        assert fast.params[name].shape == np.asarray(ref.params[name]).shape
        np.testing.assert_allclose(fast.params[name], ref.params[name], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("model", ["attn_s", "attn_m"])
def test_kernel_equals_full_batch_gd_on_the_prompts(model):
    D, H, R = 3, 3, 2 if model == "attn_s" else 1
    params, st, pr = _problem(model, D, H, R, seed=3)
    predict = m.predict_attn_s if model == "attn_s" else m.predict_attn_m
    kw = dict(lr=0.3, n_steps=300, record_every=10, record_params=True)
    ref = sampled.full_batch(lambda p, d: jnp.mean((d.y_q - predict(p, d)) ** 2), params, pr, **kw)
    fast = moments_native.full_batch(model, params, st, **kw)
    assert ref.loss[-1] < 0.8 * ref.loss[0]
    np.testing.assert_allclose(fast.loss, ref.loss, rtol=1e-10)
    for name in params:
        np.testing.assert_allclose(fast.params[name][-1], ref.params[name][-1], rtol=1e-8, atol=1e-12)


def test_kernel_descends_the_symmetrised_gram():
    """∇_T(TᵀGT) = (G + Gᵀ)T: a G stored with an asymmetric part (rounding, or here an antisymmetric
    matrix, which leaves the loss unchanged) must give the XLA engine's autodiff gradient, not 2GT."""
    params, st, _ = _problem("attn_s", 3, 3, 1)
    upper = np.triu(np.ones_like(st.G), 1)
    skewed = st._replace(G=jnp.asarray(np.asarray(st.G) + 0.05 * (upper - upper.T)))
    kw = dict(lr=0.2, n_steps=200, record_every=20, record_params=True)
    ref = moments.full_batch(m.tensor_attn_s, params, skewed, **kw)
    fast = moments_native.full_batch("attn_s", params, skewed, **kw)
    plain = moments_native.full_batch("attn_s", params, st, **kw)
    assert np.all(np.isfinite(ref.loss)) and ref.loss[-1] < 0.8 * ref.loss[0]
    np.testing.assert_allclose(fast.loss, ref.loss, rtol=1e-12)
    np.testing.assert_allclose(fast.params["k"], ref.params["k"], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(fast.params["k"], plain.params["k"], rtol=1e-10, atol=1e-13)


def test_chunks_give_the_same_run_and_report_progress():
    params, st, _ = _problem("attn_s", 3, 3, 1, S=2)
    kw = dict(lr=0.3, n_steps=103, record_every=4, record_params=True, batched=True)
    whole = moments_native.full_batch("attn_s", params, st, **kw)
    seen = []
    chunked = moments_native.full_batch("attn_s", params, st, records_per_chunk=5,
                                        callback=lambda step, obs: seen.append((step, np.asarray(obs["loss"]))), **kw)
    np.testing.assert_array_equal(chunked.loss, whole.loss)  # bit for bit: the kernel just resumes
    for name in params:
        np.testing.assert_array_equal(chunked.params[name], whole.params[name])
    steps = [s for s, _ in seen]
    assert steps == sorted(steps) and steps[-1] == 103 and len(steps) == -(-len(whole.step) // 5)
    np.testing.assert_array_equal(seen[-1][1], whole.loss[:, -1])


def test_kernel_leaves_the_initial_params_alone():
    for model, D in (("attn_s", 3), ("attn_m", 1), ("mlp", 2)):
        params, st, _ = _problem(model, D, 2, 1)
        before = {k: np.array(a) for k, a in params.items()}
        host = {k: np.array(a) for k, a in params.items()}
        moments_native.full_batch(model, host, st, lr=0.3, n_steps=20)
        for k in before:
            np.testing.assert_array_equal(host[k], before[k])
            np.testing.assert_array_equal(np.asarray(params[k]), before[k])


def test_divergence_is_recorded_and_stops_a_guarded_run():
    params, st, _ = _problem("attn_s", 3, 3, 1)
    kw = dict(lr=200.0, n_steps=60, record_every=1)
    ref = moments.full_batch(m.tensor_attn_s, params, st, **kw)
    fast = moments_native.full_batch("attn_s", params, st, **kw)
    bad_ref, bad_fast = ~np.isfinite(np.asarray(ref.loss)), ~np.isfinite(fast.loss)
    assert bad_ref.any() and np.array_equal(bad_fast, bad_ref)  # inf/NaN where XLA has them: no 'nnan'
    def guarded(step, obs):  # a launched run's callback: it asks the loop to stop on divergence
        pass

    guarded.stop_on_divergence, guarded.label = True, "probe"
    with pytest.raises(Diverged) as err:
        moments_native.full_batch("attn_s", params, st, callback=guarded, records_per_chunk=8, **kw)
    assert err.value.step == int(np.argmax(bad_ref))


@pytest.mark.parametrize("kw,match", [
    (dict(model="gla"), "model must be one of"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(n_steps=-1), "n_steps must be >= 0"),
    (dict(record_every=0), "record_every must be >= 1"),
    (dict(records_per_chunk=0), "records_per_chunk must be >= 1"),
])
def test_bad_arguments_are_named(kw, match):
    params, st, _ = _problem("attn_s", 2, 2, 1)
    args = dict(model="attn_s", lr=0.1, n_steps=5) | kw
    with pytest.raises(ValueError, match=match):
        moments_native.full_batch(args.pop("model"), params, st, **args)


def test_seeds_run_side_by_side_as_they_run_alone(monkeypatch):
    from iclab.ops.moments_step import native as kernels

    monkeypatch.setattr(kernels, "thread_count", lambda: 2)  # a pool of threads, whatever ICLAB_THREADS says
    params, st, _ = _problem("attn_s", 3, 3, 1, S=3)
    kw = dict(lr=0.3, n_steps=200, record_every=10, record_params=True)
    together = moments_native.full_batch("attn_s", params, st, batched=True, records_per_chunk=4, **kw)
    for s in range(3):
        alone = moments_native.full_batch("attn_s", {k: a[s] for k, a in params.items()},
                                          moments.SufficientStatistics(st.c[s], st.m[s], st.G[s], st.P), **kw)
        np.testing.assert_array_equal(together.loss[s], alone.loss)
        for name in params:
            np.testing.assert_array_equal(together.params[name][s], alone.params[name])
