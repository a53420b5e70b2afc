"""host_call against jax.pure_callback: same results under jit, vmap (each method) and eagerly, with the
operands handed over as numpy arrays (not JAX arrays, whose conversion would copy them again); on the FFI path
the operands in place, the results written in place (``writes_out``), errors raised, stale executables refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.ops._runtime.host import host_call


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


def test_the_ffi_handler_is_in_use():
    # the pinned jaxlib accepts iclab's FFI handler; another may refuse it (then JAX's callback handler copies)
    from iclab.ops._runtime import ffi as _ffi_call

    assert _host_module().FFI and _ffi_call.available()


def _host_module():
    from iclab.ops._runtime import host as _host

    return _host


def test_operands_reach_the_host_function_in_place():
    """On the FFI path the host function reads XLA's operand buffer itself (JAX's handler copies it)."""
    seen = []

    def fn(a):
        seen.append(a.__array_interface__["data"][0])
        return a.sum(axis=0)

    x = jnp.arange(4000.0).reshape(40, 100)
    out = jax.jit(lambda x: host_call(fn, jax.ShapeDtypeStruct((100,), x.dtype), x))(x)
    np.testing.assert_array_equal(out, np.asarray(x).sum(axis=0))
    assert seen == [x.unsafe_buffer_pointer()]


@pytest.mark.parametrize("ffi", [True, False, "pure_callback"])
def test_writes_out_fills_the_results_on_every_path(ffi, monkeypatch):
    """``writes_out``: the function writes its results into ``out`` (XLA's result buffers on the FFI path, fresh
    arrays on JAX's callback path, on ``jax.pure_callback`` where the primitive is missing, and eagerly); the same
    values under jit, vmap and eagerly."""
    if ffi == "pure_callback":
        monkeypatch.setattr(_host_module(), "_PRIM", None)
    else:
        monkeypatch.setattr(_host_module(), "FFI", ffi)
    writes = []

    def fn(a, b, out):
        writes.append(tuple(o.shape for o in out))
        s, rows = out
        s[...] = a * b.sum()
        rows[...] = np.cumsum(a, axis=-1)

    x = jnp.arange(12.0).reshape(3, 4)
    y = jnp.array([0.5, -1.0, 2.0])
    ref = _host(np.asarray(x), np.asarray(y))
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
    for out in (jax.jit(lambda x, y: host_call(fn, shapes, x, y, writes_out=True))(x, y),
                host_call(fn, shapes, x, y, writes_out=True)):
        np.testing.assert_array_equal(out[0], ref["sum"])
        np.testing.assert_array_equal(out[1], ref["rows"])
    xs = jnp.stack([x, -x])
    out = jax.jit(jax.vmap(lambda x: host_call(fn, shapes, x, y, writes_out=True)))(xs)
    np.testing.assert_array_equal(out[1][1], -ref["rows"])
    assert writes[-1] == ((3, 4), (3, 4))  # sequential: once per mapped instance

    def fn_mapped(a, b, out):  # broadcast_all: the mapped axis first on the operands and on out
        writes.append(tuple(o.shape for o in out))
        s, rows = out
        s[...] = a * b.sum(axis=-1)[..., None, None]
        rows[...] = np.cumsum(a, axis=-1)

    out = jax.jit(jax.vmap(lambda x: host_call(fn_mapped, shapes, x, y, writes_out=True,
                                               vmap_method="broadcast_all")))(xs)
    assert writes[-1] == ((2, 3, 4), (2, 3, 4))  # one call for both instances
    for i, sign in enumerate((1, -1)):
        np.testing.assert_array_equal(out[0][i], sign * ref["sum"])
        np.testing.assert_array_equal(out[1][i], sign * ref["rows"])


#: How jax raises an XLA error: JaxRuntimeError from a jitted function's first call, ValueError from its C++ fast path.
_CALL_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


def test_an_exception_in_the_host_function_is_an_error_of_the_call():
    def fn(a):
        raise ValueError("operand 7 out of range")

    with pytest.raises(_CALL_ERRORS, match="ValueError: operand 7 out of range"):
        jax.block_until_ready(jax.jit(lambda x: host_call(fn, jax.ShapeDtypeStruct((), x.dtype), x))(jnp.ones(3)))


def test_an_executable_of_another_process_calls_nothing(monkeypatch):
    """The custom call names its function by an index into this process's registry and a per-process nonce: an
    executable compiled elsewhere (a persistent compilation cache) fails instead of calling another function."""
    from iclab.ops._runtime import ffi as _ffi_call

    calls = []
    f = jax.jit(lambda x: host_call(lambda a: calls.append(1) or a + 1, jax.ShapeDtypeStruct((3,), x.dtype), x))
    np.testing.assert_array_equal(f(jnp.zeros(3)), 1.0)
    monkeypatch.setattr(_ffi_call, "_NONCE", _ffi_call._NONCE ^ 1)
    with pytest.raises(_CALL_ERRORS, match="another process"):
        jax.block_until_ready(f(jnp.zeros(3)))
    assert calls == [1]
