"""host_call against jax.pure_callback: same results under jit, vmap (each method) and eagerly, with the
operands handed over as numpy arrays (not JAX arrays, whose conversion would copy them again)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab._host import host_call


def _host(a, b):
    return {"sum": (a * b.sum()).astype(a.dtype), "rows": np.cumsum(a, axis=-1)}


def _shapes(a):
    return {"sum": jax.ShapeDtypeStruct(a.shape, a.dtype), "rows": jax.ShapeDtypeStruct(a.shape, a.dtype)}


def _pair(x, y, call):
    return call(_host, _shapes(x), x, y)


def _reference(fn, shapes, *args, vmap_method="sequential"):
    return jax.pure_callback(fn, shapes, *args, vmap_method=vmap_method)


def test_the_fast_path_is_in_use():
    # the pinned JAX has the private lowering helper; a JAX without it falls back to pure_callback (with copies)
    assert host_call.direct


def test_host_call_equals_pure_callback_under_jit_and_eagerly():
    x = jnp.arange(12.0).reshape(3, 4)
    y = jnp.array([0.5, -1.0, 2.0])
    ref = jax.jit(lambda x, y: _pair(x, y, _reference))(x, y)
    for out in (jax.jit(lambda x, y: _pair(x, y, host_call))(x, y), _pair(x, y, host_call)):
        for k in ref:
            np.testing.assert_array_equal(out[k], ref[k])


@pytest.mark.parametrize("vmap_method", ["sequential", "broadcast_all", "expand_dims"])
def test_host_call_vmaps_as_pure_callback(vmap_method):
    calls = []

    def fn(a, b):
        calls.append((a.shape, b.shape))
        return _host(a, b)

    xs = jax.random.normal(jax.random.PRNGKey(0), (5, 3, 4))
    y = jnp.array([0.5, -1.0, 2.0])
    out = jax.jit(jax.vmap(lambda x: host_call(fn, _shapes(x), x, y, vmap_method=vmap_method)))(xs)
    ref = jax.jit(jax.vmap(lambda x: _reference(_host, _shapes(x), x, y, vmap_method=vmap_method)))(xs)
    for k in ref:
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-6)
    # sequential: one call per mapped instance; broadcast_all: one call with the mapped axis first, the unmapped
    # operand broadcast; expand_dims: likewise, the unmapped operand with a leading axis of size 1
    assert calls == {"sequential": [((3, 4), (3,))] * 5, "broadcast_all": [((5, 3, 4), (5, 3))],
                     "expand_dims": [((5, 3, 4), (1, 3))]}[vmap_method]


def test_operands_arrive_as_read_only_numpy_arrays():
    seen = {}

    def fn(a):
        seen.update(type=type(a), writeable=a.flags.writeable)
        return a + 1

    x = jnp.ones((1000, 100), jnp.float32)
    out = jax.jit(lambda x: host_call(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2))(x)
    np.testing.assert_array_equal(out, 3.0)
    # numpy as XLA's handler made it (pure_callback would give a jax.Array, copied from it by device_put)
    assert seen == {"type": np.ndarray, "writeable": False}
