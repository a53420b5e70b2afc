"""The fast normal sampler: the same numbers for a key alone and inside any vmap over keys."""

import jax
import jax.numpy as jnp
import numpy as np

from iclab.tasks import rbg_key, standard_normal


def _keys(n):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(n))


def test_one_key_draws_the_rbg_stream():
    key = _keys(1)[0]
    np.testing.assert_array_equal(standard_normal(key, (4, 3)), jax.random.normal(rbg_key(key), (4, 3)))
    assert standard_normal(key, (2,), jnp.float32).dtype == jnp.float32


def test_vmapped_draws_equal_the_per_key_draws_under_nesting_jit_and_scan():
    keys = _keys(6)
    alone = np.stack([np.asarray(standard_normal(k, (3,))) for k in keys])
    np.testing.assert_array_equal(jax.vmap(lambda k: standard_normal(k, (3,)))(keys), alone)
    nested = jax.jit(jax.vmap(jax.vmap(lambda k: standard_normal(k, (3,)))))(keys.reshape(2, 3, 2))
    np.testing.assert_array_equal(nested.reshape(6, 3), alone)
    # a subset of the keys draws the same rows (plain RBG under vmap would draw them from keys[0])
    np.testing.assert_array_equal(jax.vmap(lambda k: standard_normal(k, (3,)))(keys[2:4]), alone[2:4])

    def loop(k):
        return jax.lax.scan(lambda c, i: (c, standard_normal(jax.random.fold_in(k, i), (2,))), 0, jnp.arange(3))[1]

    np.testing.assert_array_equal(jax.jit(jax.vmap(loop))(keys), np.stack([loop(k) for k in keys]))


def test_an_unbatched_key_beside_batched_values_broadcasts():
    key = _keys(1)[0]
    out = jax.vmap(lambda x: standard_normal(key, (3,)) * x)(jnp.arange(3.0))
    np.testing.assert_array_equal(out, jnp.outer(jnp.arange(3.0), standard_normal(key, (3,))))


def test_draws_are_standard_normal():
    z = np.asarray(standard_normal(_keys(1)[0], (200_000,)))
    assert abs(z.mean()) < 4 / np.sqrt(z.size) and abs(z.var() - 1) < 4 * np.sqrt(2 / z.size)
