"""engines.train_family: one call trains a registered family on a task's sampler. The transformer family of every
task (iclab.models.transformer) trains by it in float32 and float64, on its own target; bad arguments are one
ConfigError line."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from iclab.engines import train_family
from iclab.errors import ConfigError
from iclab.models import get_model
from iclab.tasks import drift, linreg, multitask, multitask_regression, pool

N = 4
SMALL = dict(H=1, layers=1, width=16, w_init=0.1)


def _task(task):
    """(family, sizes, sampler(key) -> batch, the target written out by hand) of each task."""
    if task == "linreg":
        return "transformer", dict(D=2), lambda k: linreg.sample_prompts(k, jnp.eye(2), N, 16), lambda b: b.y_q
    if task == "pool":
        tasks = pool.sample_pool(jax.random.PRNGKey(9), 3, 2)
        return "transformer", dict(D=2), lambda k: pool.sample_pool_prompts(k, jnp.eye(2), N, 16, pool=tasks,
                                                                             sigma2=0.01), lambda b: b.y_q
    if task == "multitask":
        return "transformer_multitask", dict(d=2, K=2), lambda k: multitask.sample_multitask(
            k, 16, [N // 2, N // 2], np.eye(2), np.array([0.6, 0.3]), 2), lambda b: b.y_query
    if task == "drift":
        return "transformer_drift", dict(d=2), lambda k: drift.sample_drift_prompts(
            k, 16, gamma=0.9, sigma_w2=1.0, sigma_e2=0.19, n=N, Lam=jnp.eye(2)), lambda b: b.y[:, -1]
    ts = multitask_regression.homogeneous(2, 1, sigma=0.1)
    return "transformer_multitask_regression", dict(d=2, d_y=2), lambda k: multitask_regression.sample_prompts(
        k, ts, N, 16), lambda b: b.y_q


# One task in each dtype in the fast set (each case compiles a transformer's training loop); every task in both
# dtypes in the slow set.
CASES = [pytest.param(task, dtype, id=f"{task}-{name}",
                      marks=[] if (task, name) in {("linreg", "float64"), ("drift", "float32")} else [pytest.mark.slow])
         for task in ("linreg", "pool", "multitask", "drift", "multitask_regression")
         for dtype, name in ((jnp.float32, "float32"), (jnp.float64, "float64"))]


@pytest.mark.parametrize("task, dtype", CASES)
def test_the_transformer_trains_on_every_task_by_one_call(task, dtype):
    """40 Adam steps on one training set of 16 prompts: the training loss falls below half its initial value (a
    wrong or zero gradient leaves it where it starts: the model starts near ŷ = 0, whose loss is E[y²]), the params
    and the loss keep the dtype, and the recorded last loss is the mean squared error of the final params against
    the task's target written out here (so the family trains on its own target)."""
    family, sizes, sample, target = _task(task)
    batch = sample(jax.random.PRNGKey(5))
    tr = train_family(family, lambda key, aux: batch, sizes={**sizes, **SMALL}, lr=0.02, steps=40, seed=3,
                      optimizer=optax.scale_by_adam(), dtype=dtype, record_every=20)
    loss = np.asarray(tr.loss)
    assert loss.shape == (1, 3) and tr.loss.dtype == dtype
    assert loss[0, -1] < 0.5 * loss[0, 0], loss
    final = jax.tree_util.tree_map(lambda a: a[0, 0], tr.final_params[family])
    assert all(leaf.dtype == dtype for leaf in jax.tree_util.tree_leaves(final))
    cast = jax.tree_util.tree_map(lambda a: a.astype(dtype), batch)
    again = jnp.mean((get_model(family).predict(final, cast) - target(cast)) ** 2)
    np.testing.assert_allclose(loss[0, -1], again, rtol=1e-4 if dtype == jnp.float32 else 1e-10)


def test_train_family_members_and_bad_arguments():
    """Members are one per setting; a bad steps, seeds or dtype is one ConfigError line naming it."""
    prompts = linreg.sample_prompts(jax.random.PRNGKey(0), jnp.eye(2), 3, 8)
    run = dict(sizes=dict(D=2, H=2, w_init=0.5), lr=0.05, steps=2)
    tr = train_family("softmax_attn_m", lambda key, aux: prompts, settings={"rho": np.array([0.5, 2.0])}, seeds=2,
                      **run)
    assert tr.metrics["member_loss"]["softmax_attn_m"].shape == (2, 3, 2)
    assert tr.final_params["softmax_attn_m"]["v"].shape[:2] == (2, 2)
    for bad, field in [(dict(steps=0), "steps"), (dict(seeds=0), "seeds"), (dict(dtype=jnp.int32), "dtype")]:
        with pytest.raises(ConfigError, match=f"train_family: {field} must be") as err:
            train_family("transformer", lambda key, aux: prompts, **{**run, **bad})
        assert "\n" not in str(err.value)
