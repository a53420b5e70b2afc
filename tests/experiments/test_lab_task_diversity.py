"""lab.task_diversity: the config's validation, the per-pool batches, a tiny run's shapes; the quick preset (slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from iclab.engines import seed_keys
from iclab.experiments.lab import task_diversity as td

TINY = dict(task=dict(D=3, N=4), pool_sizes=[3, 0, 1], batch=8, steps=3, transformer=dict(layers=1, width=8, heads=2),
            softmax_heads=1, record_every=1, eval_prompts=48, eval_chunk=32, seeds=2)


def test_config_validates_and_sorts_the_pool_sizes():
    c = td.TaskDiversityConfig(pool_sizes=[64, 0, 1, 4])
    assert c.pool_sizes == [1, 4, 64, 0] and c.max_pool() == 64 and c.finite_sizes() == [1, 4, 64]
    for bad in ([], [1, 1], [-1], [2**25]):
        with pytest.raises(ValidationError, match="pool_sizes"):
            td.TaskDiversityConfig(pool_sizes=bad)
    with pytest.raises(ValidationError, match="width must be a multiple of heads"):
        td.TaskDiversityConfig(transformer=dict(width=30, heads=4))
    with pytest.raises(ValidationError, match="sigma2"):
        td.TaskDiversityConfig(**{"task.sigma2": 0.0})  # dMMSE's posterior needs label noise
    assert td.TaskDiversityConfig(task={"D": 5}).d_e() == 6 and td.TaskDiversityConfig(softmax_width=9).d_e() == 9


def test_each_slice_of_the_batch_draws_its_tasks_from_its_own_pool():
    c = td.TaskDiversityConfig(**{**TINY, "dtype": "float64", "batch": 256})
    keys = seed_keys(0, 1)
    pool = td.pools(c, keys)[0]
    batch = td.batch_sampler(c)(jax.random.PRNGKey(5), pool)
    assert batch.x.shape == (3, 256, 4, 3) and batch.y_q.shape == (3, 256)
    for k, M in enumerate(c.pool_sizes):
        w = np.asarray(batch.w[k])
        dist = np.min(np.abs(w[:, None, :] - np.asarray(pool)[None, :, :]).sum(-1), axis=1)
        if M == 0:  # fresh tasks: none is a pool row
            assert np.all(dist > 1e-6)
        else:  # every task is one of the first M rows, and each of them is drawn
            rows = np.argmin(np.abs(w[:, None, :] - np.asarray(pool)[None, :M, :]).sum(-1), axis=1)
            assert np.all(np.abs(w - np.asarray(pool)[rows]).max(axis=1) == 0) and set(rows) == set(range(M))
    # member k's loss is the mean squared error on slice k alone
    groups = td.model_groups(c)
    params = jax.vmap(lambda k: groups["linear"].init(k, None))(jax.random.split(jax.random.PRNGKey(1), 3))
    losses = groups["linear"].loss(params, batch, None)
    for k in range(3):
        one = jax.tree_util.tree_map(lambda a: a[k], params)
        slice_k = jax.tree_util.tree_map(lambda a: a[k], batch)
        from iclab.models import get_model

        expected = jnp.mean((get_model("attn_m").predict(one, slice_k) - slice_k.y_q) ** 2)
        assert np.isclose(losses[k], expected, rtol=1e-12)


@pytest.mark.slow  # compiles three models' training and every evaluation: half a minute
def test_a_tiny_run_has_every_array_and_its_checks_and_plot():
    c = td.TaskDiversityConfig(**TINY)
    r = td.run_task_diversity(c, None)
    S, K = 2, 3
    for name in ("transformer", "linear", "softmax", "dmmse", "ridge"):
        for dist in ("pool", "fresh"):
            assert r[f"{name}_{dist}"].shape == (S, K) and r[f"{name}_{dist}_se"].shape == (S, K)
    assert np.all(np.isnan(r["dmmse_pool"][:, 2])) and np.all(np.isfinite(r["dmmse_pool"][:, :2]))
    assert np.all(np.isfinite(r["transformer_fresh"])) and np.all(r["ridge_fresh"] > 0)
    # the fresh prompts are shared by every M: ridge's fresh-task error is one number per seed
    assert np.allclose(r["ridge_fresh"], r["ridge_fresh"][:, :1])
    # at M = ∞ the pool is the prior: pool and fresh prompts are the same, and so are the theory's two risks
    assert np.allclose(r["linear_pool"][:, 2], r["linear_fresh"][:, 2])
    assert np.allclose(r["theory_pool"][:, 2], r["theory_fresh"][:, 2])
    assert r["loss_transformer"].shape == (S, len(r["step"]), K)
    assert list(r["pool_sizes"]) == [1, 3, 0]
    checks = td.checks_task_diversity(c, r)
    assert len(checks) == 10 and all(np.isfinite(ch.measured) for ch in checks)
    fig = td.plot_task_diversity(c, r)
    assert len(fig.axes) >= 2
    need, what = td.memory_task_diversity(c)
    assert need > 0 and what


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_quick_preset_passes_its_checks(seed, tmp_path):
    from iclab.launch import run_experiment

    result = run_experiment("lab.task_diversity", "quick", {"seed": seed}, root=tmp_path / "results")
    failed = [(c["name"], c["measured"], c["expected"]) for c in result.checks if not c["passed"]]
    assert not failed, failed
