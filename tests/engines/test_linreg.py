"""iclab.engines.linreg: the moments statistics, the three engines against each other (same prompts, same
trajectory), gradient flow, explicit inits, expected-loss overrides, given prompts and extra metrics, and
the run-time arguments train refuses. The specification's own validation and a new family are tested in
tests/models/test_family.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from iclab.engines import linreg, moments, seed_keys
from iclab.engines.linreg import LinregTraining
from iclab.errors import ConfigError
from iclab.models import linattn as models
from iclab.tasks.linreg import context_moment, covariance, sample_prompts, sample_query_moments
from iclab.theory import linattn as theory


def _keys(S):
    return seed_keys(4, S)


def _spec(model="attn_s", engine="moments", **kw):
    fields = dict(model=model, engine=engine, H=3, R=2 if model == "attn_s" else 1, w_init=0.3, lr=0.2, steps=20,
                  record_every=20, P=None if engine == "population" else 400)
    fields.update(kw)
    return LinregTraining(**fields)


# ---------------------------------------------------------------------------------------------
# The moments statistics.


@pytest.mark.parametrize("form", ["reduced", "full"])
def test_prompt_statistics_are_those_of_train_s_prompts(form):
    keys, N, P = _keys(2), 5, 1000
    Lams = jnp.stack([covariance([0.5, 0.3, 0.2], jax.random.fold_in(k, 7)) for k in keys])
    feature = models.full_feature if form == "full" else models.cubic_feature
    st = linreg.prompt_statistics(keys, Lams, N, P, feature=feature, chunk=300)  # 1000 = 3·300 + 100: padded
    for s in range(2):
        data = sample_prompts(jax.random.fold_in(keys[s], 2), Lams[s], N, P)
        ref = moments.sufficient_statistics(feature(data), data.y_q)
        for name in ("c", "m", "G"):
            np.testing.assert_allclose(getattr(st, name)[s], getattr(ref, name), rtol=1e-12, atol=1e-14)
    assert st.P == P and st.G.shape == (2,) + ref.G.shape


def test_direct_statistics_are_those_of_sample_query_moments():
    keys, N, P = _keys(2), 5, 1000
    Lams = jnp.broadcast_to(covariance([0.5, 0.3, 0.2]), (2, 3, 3))
    st = linreg.prompt_statistics(keys, Lams, N, P, method="direct", chunk=300)
    q = sample_query_moments(jax.random.fold_in(keys[1], 2), Lams[1], N, P)
    z = models.cubic_feature_from_moments(q.beta, q.x_q)
    np.testing.assert_allclose(st.G[1], z.T @ z / P, rtol=1e-12)
    np.testing.assert_allclose(st.m[1], z.T @ q.y_q / P, rtol=1e-12)
    with pytest.raises(ValueError, match="full-matrix"):
        linreg.prompt_statistics(keys, Lams, N, P, feature=models.full_feature, method="direct")
    with pytest.raises(ValueError, match="method"):
        linreg.prompt_statistics(keys, Lams, N, P, method="exact")


def test_cubic_feature_from_moments_is_the_cubic_feature():
    pr = sample_prompts(jax.random.PRNGKey(1), covariance([0.5, 0.3, 0.2]), N=4, P=6)
    np.testing.assert_array_equal(models.cubic_feature_from_moments(context_moment(pr), pr.x_q),
                                  models.cubic_feature(pr))


# ---------------------------------------------------------------------------------------------
# The engines against each other.


def test_train_with_shared_statistics_follows_the_sampled_engine():
    keys, N, P = _keys(2), 5, 400
    Lams = jnp.broadcast_to(covariance([0.5, 0.3, 0.2]), (2, 3, 3))
    stats = linreg.prompt_statistics(keys, Lams, N, P)
    common = dict(keys=keys, Lams=Lams, N=N)
    shared = linreg.train(_spec(engine="moments"), stats=stats, **common)
    ref = linreg.train(_spec(engine="sampled"), **common)
    np.testing.assert_allclose(shared.loss, ref.loss, rtol=1e-12)
    np.testing.assert_allclose(shared.metrics["population"], ref.metrics["population"], rtol=1e-12)
    with pytest.raises(ValueError, match="differs"):
        linreg.train(_spec(engine="moments", P=P + 1), stats=stats, **common)
    with pytest.raises(ValueError, match="moments"):
        linreg.train(_spec(engine="sampled"), stats=stats, **common)


@pytest.mark.parametrize("model", ["attn_s", "attn_m", "mlp"])
def test_train_native_backend_follows_the_xla_backend(model):
    keys, N = _keys(2), 5
    Lams = jnp.broadcast_to(covariance([0.5, 0.3, 0.2]), (2, 3, 3))
    stats = linreg.prompt_statistics(keys, Lams, N, 300)
    spec = _spec(model, w_init=0.5, lr=0.3, steps=150, record_every=10, P=300, record_params=True)
    # a metric of the caller, recorded in the XLA loop and read off the recorded weights by the native one
    norm = {"v_norm": lambda p, aux: jnp.sum(p[next(iter(p))] ** 2) * aux["scale"]}
    common = dict(keys=keys, Lams=Lams, N=N, stats=stats, metrics=norm, extra={"scale": jnp.full((2,), 2.0)})
    ref = linreg.train(spec, **common)
    fast = linreg.train(spec.model_copy(update={"backend": "native"}), **common)
    bare = linreg.train(spec.model_copy(update={"backend": "native", "record_params": False}), **common)
    np.testing.assert_allclose(fast.loss, ref.loss, rtol=1e-12)
    for name in ("population", "v_norm"):
        np.testing.assert_allclose(fast.metrics[name], ref.metrics[name], rtol=1e-10)
    assert np.asarray(ref.metrics["population"])[:, -1].max() < np.asarray(ref.metrics["population"])[:, 0].min()
    for name in ref.params:
        np.testing.assert_allclose(fast.params[name], ref.params[name], rtol=1e-10, atol=1e-13)
    assert bare.params is None
    np.testing.assert_array_equal(bare.loss, fast.loss)


def test_population_engine_descends_population_objective_and_sampled_records_it():
    keys, N = _keys(2), 6
    Lams = jnp.stack([covariance([0.5, 0.3, 0.2], jax.random.fold_in(k, 7)) for k in keys])
    spec = _spec("attn_m", engine="population", steps=30, record_every=10, record_params=True)
    tr = linreg.train(spec, keys=keys, Lams=Lams, N=N)
    objective = linreg.population_objective(spec)
    for s in range(2):
        for i in range(tr.loss.shape[1]):
            p = jax.tree_util.tree_map(lambda a: a[s, i], tr.params)
            A = models.effective_matrix_attn_m(p)
            L = theory.population_loss(A, Lams[s], 1.0 / N)
            assert float(objective(p, {"Lam": Lams[s], "inv_N": 1.0 / N})) == pytest.approx(float(L), rel=1e-14)
            assert tr.loss[s, i] == pytest.approx(float(L), rel=1e-12)
    assert np.all(np.diff(tr.loss, axis=1) < 0)
    with pytest.raises(ValueError, match="effective matrix"):
        linreg.population_objective(_spec("softmax_attn_m", engine="sampled", R=1))


@pytest.mark.slow
def test_expected_loss_replaces_the_fixed_length_loss():
    keys, N = _keys(1), 6
    Lams = covariance([0.5, 0.3, 0.2])[None]
    kappa = theory.harmonic_inv_length(N)  # E(1/N) of lengths uniform on 1..N

    def random_length(A, Lam):
        return theory.population_loss(A, Lam, kappa)

    spec = _spec("attn_m", engine="population", steps=20, record_every=5)
    a = linreg.train(spec, keys=keys, Lams=Lams, N=N, expected_loss=random_length)
    b = linreg.train(spec, keys=keys, Lams=Lams, N=N)
    A0 = models.effective_matrix_attn_m(_init(spec, keys, 3))
    assert a.loss[0, 0] == pytest.approx(float(theory.population_loss(A0, Lams[0], kappa)), rel=1e-12)
    assert b.loss[0, 0] == pytest.approx(float(theory.population_loss(A0, Lams[0], 1.0 / N)), rel=1e-12)
    assert a.loss[0, -1] != pytest.approx(b.loss[0, -1], rel=1e-3)
    # the moments engine's "population" metric follows it too
    mom = linreg.train(_spec("attn_m", steps=0, P=50), keys=keys, Lams=Lams, N=N, expected_loss=random_length)
    assert mom.metrics["population"][0, 0] == pytest.approx(a.loss[0, 0], rel=1e-12)


def _init(spec, keys, D):
    """Seed 0's initial params as train draws them."""
    return jax.tree_util.tree_map(lambda a: a[0], jax.vmap(
        lambda k: linreg.init_params(spec, jax.random.fold_in(k, 1), D))(keys))


def test_given_prompts_and_params0_replace_the_drawn_ones():
    keys, N, P = _keys(2), 5, 64
    Lams = jnp.broadcast_to(covariance([0.5, 0.3, 0.2]), (2, 3, 3))
    spec = _spec(engine="sampled", P=P, steps=10, record_every=5)
    drawn = linreg.train(spec, keys=keys, Lams=Lams, N=N)
    prompts = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, P))(keys, Lams)
    params0 = jax.vmap(lambda k: linreg.init_params(spec, jax.random.fold_in(k, 1), 3))(keys)
    given = linreg.train(spec, Lams=Lams, N=N, prompts=prompts, params0=params0)  # no keys needed
    np.testing.assert_allclose(given.loss, drawn.loss, rtol=1e-12)
    other = jax.tree_util.tree_map(lambda a: 2.0 * a, params0)
    assert not np.allclose(linreg.train(spec, Lams=Lams, N=N, prompts=prompts, params0=other).loss, drawn.loss)
    with pytest.raises(ValueError, match="differs"):
        linreg.train(spec.model_copy(update={"P": P + 1}), Lams=Lams, N=N, prompts=prompts, params0=params0)
    with pytest.raises(ValueError, match="keys"):
        linreg.train(spec, Lams=Lams, N=N, params0=params0)  # the prompts must be drawn
    with pytest.raises(ValueError, match="sampled"):
        linreg.train(_spec(engine="moments", P=P), keys=keys, Lams=Lams, N=N, prompts=prompts)
    with pytest.raises(ValueError, match="extra"):
        linreg.train(spec, keys=keys, Lams=Lams, N=N, extra={"Lam": Lams})


# ---------------------------------------------------------------------------------------------
# Gradient flow.


@pytest.mark.slow
def test_gradient_flow_is_the_small_lr_limit_of_gradient_descent():
    keys, N = _keys(2), 6
    Lams = jnp.broadcast_to(covariance([0.5, 0.3, 0.2]), (2, 3, 3))
    flow = _spec("attn_m", engine="population", integrator="gf", lr=0.5, steps=8, record_every=2, w_init=0.5)
    gf = linreg.train(flow, keys=keys, Lams=Lams, N=N)
    np.testing.assert_allclose(gf.t, np.linspace(0.0, 4.0, 5))  # t = steps·lr, every record_every·lr
    assert np.all(np.isnan(gf.step))
    errors = []
    for k in (1, 4):  # GD at lr/k over the same time: the gap to the flow shrinks ∝ lr
        gd = linreg.train(flow.model_copy(update={"integrator": "gd", "lr": 0.5 / k, "steps": 8 * k,
                                                  "record_every": 2 * k}), keys=keys, Lams=Lams, N=N)
        np.testing.assert_allclose(gd.t, gf.t)
        errors.append(np.max(np.abs(gd.loss - gf.loss)))
    assert errors[1] < errors[0] / 3 and errors[0] > 0
    ts = np.array([0.0, 0.5, 4.0])
    at = linreg.train(flow, keys=keys, Lams=Lams, N=N, ts=ts)
    np.testing.assert_allclose(at.t, ts)
    np.testing.assert_allclose(at.loss[:, -1], gf.loss[:, -1], rtol=1e-8)


def test_gradient_flow_refuses_what_it_has_no_use_for():
    keys = _keys(1)
    Lams = covariance([0.6, 0.4])[None]
    flow = _spec("attn_m", engine="population", integrator="gf")
    with pytest.raises(ValueError, match="optimiser"):
        linreg.train(flow, keys=keys, Lams=Lams, N=4, optimizer=optax.scale_by_adam())
    with pytest.raises(ValueError, match="optimiser"):
        linreg.train(flow, keys=keys, Lams=Lams, N=4, lr=optax.cosine_decay_schedule(0.1, 10))
    with pytest.raises(ValueError, match="ts"):
        linreg.train(flow.model_copy(update={"integrator": "gd"}), keys=keys, Lams=Lams, N=4, ts=np.array([0.0, 1.0]))
    with pytest.raises(ConfigError, match="integrator 'gf'"):  # a bad specification: one line (iclab.ConfigError)
        _spec("attn_m", engine="sampled", integrator="gf")


def test_native_backend_refuses_what_it_cannot_run():
    common = dict(H=2, R=1, w_init=0.5, lr=0.1, steps=5, record_every=5, P=50)
    for kw in (dict(engine="sampled"), dict(engine="population"), dict(engine="moments", form="full")):
        with pytest.raises(ConfigError, match="native"):
            LinregTraining(model="attn_s", backend="native", **common, **kw)
    with pytest.raises(ConfigError, match="native"):
        LinregTraining(model="softmax_attn_s", engine="sampled", backend="native", **common)
    with pytest.raises(ConfigError, match="backend"):
        LinregTraining(model="attn_s", engine="moments", backend="gpu", **common)
    spec = LinregTraining(model="attn_s", engine="moments", backend="native", **common)
    keys = _keys(1)
    with pytest.raises(ValueError, match="native"):
        linreg.train(spec, keys=keys, Lams=covariance([0.6, 0.4])[None], N=4, optimizer=optax.scale_by_adam())
