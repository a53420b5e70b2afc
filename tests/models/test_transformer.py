"""The standard transformer (iclab.models.transformer): its batched form against the per-token loop, outputs and
gradients in float64; causality; and training on in-context linear regression towards the Bayes risk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.models import get_model
from iclab.models import transformer as tf
from iclab.tasks import linreg


def _prompt(key, D, N, P=None):
    Lam = jnp.eye(D)
    pr = linreg.sample_prompts(key, Lam, N, P or 1)
    return pr if P else jax.tree_util.tree_map(lambda a: a[0], pr)


@pytest.mark.parametrize("layers, heads, width, max_tokens", [(1, 1, 4, 0), (2, 2, 4, 5)])
def test_outputs_and_gradients_equal_the_per_token_loop(layers, heads, width, max_tokens):
    D, N = 3, 2
    params = tf.init_transformer(jax.random.PRNGKey(0), D=D, H=heads, layers=layers, width=width, w_init=0.5,
                                 max_tokens=max_tokens)
    # non-trivial LayerNorm scales and biases, so that every parameter matters
    params = jax.tree_util.tree_map(lambda a: a + 0.1 * jax.random.normal(jax.random.PRNGKey(a.size), a.shape),
                                    params)
    pr = _prompt(jax.random.PRNGKey(1), D, N)
    Z = tf.linreg_tokens(pr.x, pr.y, pr.x_q)
    assert Z.shape == (2 * N + 1, D + 1)
    fast, naive = tf.outputs(params, Z), jax.jit(tf.naive_outputs)(params, Z)
    np.testing.assert_allclose(fast, naive, rtol=1e-10, atol=1e-10)
    assert np.ptp(np.asarray(fast)) > 1e-3  # the outputs differ by position: the comparison is not of constants

    def loss(form):
        return lambda p: jnp.sum(jnp.sin(jnp.arange(1, Z.shape[0] + 1)) * form(p, Z))

    # (jitted: the loop's few thousand scalar operations run op by op would take minutes)
    g_fast, g_naive = jax.grad(loss(tf.outputs))(params), jax.jit(jax.grad(loss(tf.naive_outputs)))(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_fast), jax.tree_util.tree_leaves(g_naive)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10, err_msg=jax.tree_util.keystr(path))
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree_util.tree_leaves(g_fast) if g.size)


def test_a_token_sees_only_the_tokens_before_it():
    D, N = 2, 4
    params = tf.init_transformer(jax.random.PRNGKey(2), D=D, H=2, layers=2, width=8, w_init=0.5)
    pr = _prompt(jax.random.PRNGKey(3), D, N)
    Z = tf.linreg_tokens(pr.x, pr.y, pr.x_q)
    changed = Z.at[5].add(1.0)  # the third context input
    before, after = tf.outputs(params, Z), tf.outputs(params, changed)
    np.testing.assert_array_equal(before[:5], after[:5])
    assert np.all(np.abs(np.asarray(before[5:] - after[5:])) > 0)


def test_tokens_and_the_registered_family():
    pr = _prompt(jax.random.PRNGKey(4), 2, 2, P=3)
    Z = np.asarray(tf.linreg_tokens(pr.x, pr.y, pr.x_q))
    np.testing.assert_array_equal(Z[:, 0, :2], pr.x[:, 0])
    np.testing.assert_array_equal(Z[:, 1, 2], pr.y[:, 0])
    np.testing.assert_array_equal(Z[:, 1, :2], 0.0)
    np.testing.assert_array_equal(Z[:, 4, :2], pr.x_q)
    family = get_model("transformer")
    params = family.init(jax.random.PRNGKey(5), D=2, H=2, w_init=0.02)
    assert params["blocks"]["qkv"].shape == (2, 32, 3, 2, 16)
    assert family.predict(params, pr).shape == (3,)
    assert family.engines == ("sampled",)
    with pytest.raises(ValueError, match="multiple of H"):
        tf.init_transformer(jax.random.PRNGKey(0), D=2, H=3, width=8)
    with pytest.raises(ValueError, match="positional embeddings"):
        tf.outputs(tf.init_transformer(jax.random.PRNGKey(0), D=2, max_tokens=3), Z[0])
