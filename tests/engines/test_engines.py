"""Engines against naive loops: GD, t = Σ lr, gradient flow, minibatches, vmap over seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from iclab.engines import population, record_steps, sampled


def _quadratic(params, aux):
    r = params["a"] @ aux["M"] - aux["b"]
    return 0.5 * jnp.sum(r**2) + 0.1 * jnp.sum(params["c"] ** 4)


def _problem(seed=0):
    k = jax.random.PRNGKey(seed)
    aux = {"M": jax.random.normal(k, (3, 4)) / 2, "b": jax.random.normal(jax.random.fold_in(k, 1), (4,))}
    params = {"a": jax.random.normal(jax.random.fold_in(k, 2), (3,)), "c": jnp.array([0.5, -0.3])}
    return params, aux


def test_record_steps_include_the_last_step():
    np.testing.assert_array_equal(record_steps(10, 3), [0, 3, 6, 9, 10])
    np.testing.assert_array_equal(record_steps(9, 3), [0, 3, 6, 9])


@pytest.mark.parametrize("n_steps,record_every", [(7, 1), (100, 7), (200, 10)])
def test_population_gd_equals_a_naive_loop(n_steps, record_every):
    params, aux = _problem()
    lr = 0.05
    tr = population.gradient_descent(_quadratic, params, aux, lr=lr, n_steps=n_steps, record_every=record_every,
                                     record_params=True)
    p = params
    naive = {0: float(_quadratic(p, aux))}
    for k in range(1, n_steps + 1):
        g = jax.grad(_quadratic)(p, aux)
        p = jax.tree_util.tree_map(lambda x, y: x - lr * y, p, g)
        naive[k] = float(_quadratic(p, aux))
    np.testing.assert_array_equal(tr.step, record_steps(n_steps, record_every))
    np.testing.assert_allclose(tr.loss, [naive[int(s)] for s in tr.step], rtol=1e-13)
    np.testing.assert_allclose(tr.t, lr * tr.step, rtol=1e-14)
    np.testing.assert_allclose(tr.params["a"][-1], p["a"], rtol=1e-13)
    assert tr.loss.dtype == np.float64 and tr.params["a"].dtype == np.float64


def test_time_axis_sums_a_schedule():
    params, aux = _problem()
    schedule = optax.linear_schedule(0.1, 0.01, 50)
    tr = population.gradient_descent(_quadratic, params, aux, lr=schedule, n_steps=60, record_every=5)
    expected = np.cumsum([0.0] + [float(schedule(k)) for k in range(60)])
    np.testing.assert_allclose(tr.t, expected[tr.step.astype(int)], rtol=1e-12)


def test_any_optax_optimiser_matches_its_own_loop():
    params, aux = _problem()
    tr = population.gradient_descent(_quadratic, params, aux, lr=1e-2, n_steps=30, optimizer=optax.scale_by_adam(),
                                     record_every=30)
    opt = optax.adam(1e-2)
    state, p = opt.init(params), params
    for _ in range(30):
        updates, state = opt.update(jax.grad(_quadratic)(p, aux), state, p)
        p = optax.apply_updates(p, updates)
    assert tr.loss[-1] == pytest.approx(float(_quadratic(p, aux)), rel=1e-12)


def test_batched_runs_equal_separate_runs():
    runs = [_problem(s) for s in range(3)]
    stack = lambda trees: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    params, aux = stack([r[0] for r in runs]), stack([r[1] for r in runs])
    tr = population.gradient_descent(_quadratic, params, aux, lr=0.05, n_steps=40, record_every=4, batched=True)
    assert tr.loss.shape == (3, 11)
    for s, (p, a) in enumerate(runs):
        single = population.gradient_descent(_quadratic, p, a, lr=0.05, n_steps=40, record_every=4)
        np.testing.assert_allclose(tr.loss[s], single.loss, rtol=1e-13)


def test_gradient_flow_matches_the_exponential_solution():
    """dθ/dt = −∇L for L = ½ θᵀKθ has θ(t) = exp(−Kt) θ₀."""
    K = jnp.diag(jnp.array([2.0, 0.5, 0.1]))
    loss = lambda p, aux: 0.5 * p @ aux @ p  # noqa: E731
    theta0 = jnp.array([1.0, -2.0, 3.0])
    tr = population.gradient_flow(loss, theta0, K, t_max=5.0, n_records=41, record_params=True)
    exact = np.exp(-np.outer(tr.t, np.diag(K))) * np.asarray(theta0)
    # Global error of a local rtol = 1e-10 integration over ~10 time constants: ~1e-10 absolute.
    np.testing.assert_allclose(tr.params, exact, rtol=0, atol=1e-9)
    np.testing.assert_allclose(tr.loss, 0.5 * np.sum(np.diag(K) * exact**2, axis=1), rtol=0, atol=1e-9)
    assert np.all(np.isnan(tr.step))


@pytest.mark.slow
def test_batched_gradient_flow_equals_separate_flows():
    runs = [_problem(s) for s in range(2)]
    stack = lambda trees: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
    tr = population.gradient_flow(_quadratic, stack([r[0] for r in runs]), stack([r[1] for r in runs]),
                                  t_max=3.0, n_records=40, batched=True)
    assert tr.loss.shape == (2, 40)
    for s, (p, a) in enumerate(runs):
        single = population.gradient_flow(_quadratic, p, a, t_max=3.0, n_records=40)
        np.testing.assert_allclose(tr.loss[s], single.loss, rtol=1e-9)


def test_gradient_descent_approaches_gradient_flow_as_lr_shrinks():
    params, aux = _problem()
    flow = population.gradient_flow(_quadratic, params, aux, t_max=2.0, n_records=3)
    errs = []
    for lr in (0.02, 0.01):
        gd = population.gradient_descent(_quadratic, params, aux, lr=lr, n_steps=int(round(2.0 / lr)),
                                         record_every=int(round(1.0 / lr)))
        errs.append(abs(gd.loss[-1] - flow.loss[-1]))
    assert errs[1] < 0.6 * errs[0]  # first order in lr


def test_full_batch_equals_a_naive_loop_over_data():
    k = jax.random.PRNGKey(3)
    data = {"x": jax.random.normal(k, (50, 3)), "y": jax.random.normal(jax.random.fold_in(k, 1), (50,))}
    mse = lambda w, d: jnp.mean((d["x"] @ w - d["y"]) ** 2)  # noqa: E731
    w0 = jnp.zeros(3)
    tr = sampled.full_batch(mse, w0, data, lr=0.1, n_steps=25, record_every=25,
                            metrics={"norm": lambda w, d: jnp.sum(w**2)}, record_params=True)
    w = np.zeros(3)
    X, y = np.asarray(data["x"]), np.asarray(data["y"])
    for _ in range(25):
        w = w - 0.1 * 2 * X.T @ (X @ w - y) / 50
    np.testing.assert_allclose(tr.params[-1], w, rtol=1e-12)
    assert tr.metrics["norm"][-1] == pytest.approx(np.sum(w**2), rel=1e-12)


def test_minibatch_is_reproducible_and_fresh_each_step():
    def sampler(key, aux):
        x = jax.random.normal(key, (16, 2))
        return {"x": x, "y": x @ aux}

    mse = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    w_true = jnp.array([1.0, -2.0])
    kw = dict(lr=0.05, n_steps=120, record_every=10)
    a = sampled.minibatch(mse, jnp.zeros(2), sampler, jax.random.PRNGKey(0), w_true, **kw)
    b = sampled.minibatch(mse, jnp.zeros(2), sampler, jax.random.PRNGKey(0), w_true, **kw)
    c = sampled.minibatch(mse, jnp.zeros(2), sampler, jax.random.PRNGKey(1), w_true, **kw)
    np.testing.assert_array_equal(a.loss, b.loss)
    assert np.abs(a.loss - c.loss).max() > 0
    assert a.loss[-1] < 1e-3 * a.loss[0]  # learns w_true from fresh batches


def _loop_problem():
    from iclab.engines._loop import LoopState

    params, aux = _problem()
    opt = optax.adam(1e-2)

    def step(s):
        updates, o = opt.update(jax.grad(_quadratic)(s.params, s.aux), s.opt_state, s.params)
        return s._replace(params=optax.apply_updates(s.params, updates), opt_state=o, step=s.step + 1)

    def observe(s):
        return {"loss": _quadratic(s.params, s.aux), "t": s.step.astype(float), "a": s.params["a"]}

    return step, observe, LoopState(params, opt.init(params), jnp.asarray(0), jnp.asarray(0.0), aux, None)


@pytest.mark.parametrize("chunk_seconds,records_per_chunk", [(0.0, 64), (1e9, 5), (1e9, 64)])
def test_a_loop_gives_the_same_numbers_whatever_its_chunks(chunk_seconds, records_per_chunk):
    """One record per chunk (chunk_seconds 0), 5, or 64 at most: bit for bit the same records and final
    state, and one progress report per chunk."""
    from iclab.engines._loop import run_loop

    step, observe, state = _loop_problem()
    reports = []
    steps, obs, final = run_loop(step, observe, state, 203, 3, callback=lambda k, o: reports.append(k),
                                 chunk_seconds=chunk_seconds, records_per_chunk=records_per_chunk)
    ref_steps, ref, ref_final = run_loop(step, observe, state, 203, 3)
    np.testing.assert_array_equal(steps, ref_steps)
    for k in ref:
        np.testing.assert_array_equal(obs[k], ref[k], err_msg=k)
    np.testing.assert_array_equal(final.params["a"], ref_final.params["a"])
    # the first record; chunks of 1 record, then (chunk_seconds huge) of records_per_chunk; the last step
    n_full = 203 // 3
    if chunk_seconds == 0:
        expected = [0] + [3 * (i + 1) for i in range(n_full)] + [203]
    else:
        done = [1] + list(range(1 + records_per_chunk, n_full, records_per_chunk)) + [n_full]
        expected = [0] + [3 * d for d in done] + [203]
    assert reports == expected
    # and the naive loop of the same steps
    s = state
    for _ in range(203):
        s = step(s)
    np.testing.assert_allclose(final.params["a"], s.params["a"], rtol=1e-13)
