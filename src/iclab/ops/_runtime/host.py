"""Host calls from jitted JAX code without ``jax.pure_callback``'s copies of the operands: ``host_call``.

The compiled CPU kernels (numba) of ``ops.drift_sampler.native``, ``ops.decayed_attention.gated`` and
``ops.decayed_attention.forget`` run inside jitted code as host callbacks. XLA's callback handler hands the
callback its operands as numpy arrays (one copy); ``jax.pure_callback`` then copies every operand into a
fresh JAX array (``device_put`` in its implementation), and ``np.asarray`` of such an array copies it
again: at drift's paper batch (tokens of 5 × 5000 × 101 × 11 float32, 111 MB) the copies cost the read-out
kernel's call several times the kernel itself. ``host_call`` lowers to the same XLA custom call but gives the
function the handler's numpy arrays (read-only) as they are, one copy instead of three.
The results are copied into XLA's buffers as before.

It uses JAX's private ``emit_python_callback`` (through :mod:`iclab.ops._runtime.jax_private`); where it is missing or its
signature differs (another JAX version), ``host_call`` is ``jax.pure_callback`` (same results, with the
copies). ``host_call.direct`` says which path is in use.

XLA's callback handler itself copies every operand (it makes each numpy array from the buffer's pointer without
an owner, and numpy copies such data) and copies the results into XLA's buffers. Where this jaxlib accepts it,
the primitive lowers instead to iclab's own FFI handler (``iclab.ops._runtime.ffi``, ``FFI``): the host function reads
the operand buffers in place, and with ``writes_out`` writes the result buffers itself: drift.fig1's read-out
call (111 MB of tokens, 20 MB of query vectors, 40 MB of results) then copies nothing.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["host_call"]


def _direct_lowering():
    """The private lowering helper, or None where this JAX lacks it (or its arguments changed)."""
    from iclab.ops._runtime.jax_private import PrivateJaxMissing, private

    try:
        emit_python_callback = private("callback", "emit_python_callback")
        from jax.extend.core import Primitive
        from jax.interpreters import batching, mlir
    except (ImportError, PrivateJaxMissing):
        return None
    names = set(inspect.signature(emit_python_callback).parameters)
    if not {"ctx", "callback", "token", "operands", "operand_avals", "result_avals", "has_side_effect",
            "returns_token"} <= names:
        return None
    return emit_python_callback, Primitive, batching, mlir


class _Fn:
    """The host function and the pytree of its results (a static parameter of the primitive: compared by
    identity of the function, so one jitted graph per kernel). ``writes_out``: the function writes its results
    into ``out`` (a tuple of arrays, the flattened results), the result buffers themselves on the FFI path."""

    def __init__(self, fn, tree, writes_out: bool = False):
        self.fn, self.tree, self.writes_out = fn, tree, writes_out

    def __call__(self, *arrays, out=None):
        if self.writes_out:
            self.fn(*arrays, out=out)
            return out
        return tuple(np.asarray(r) for r in jax.tree_util.tree_leaves(self.fn(*arrays)))

    def with_fresh_out(self, avals):
        """A callable of the operands alone: fresh result arrays of ``avals`` (a path without result buffers)."""
        if not self.writes_out:
            return self
        return lambda *arrays: self(*arrays, out=tuple(np.empty(a.shape, a.dtype) for a in avals))

    def __eq__(self, other):
        return (isinstance(other, _Fn) and self.fn is other.fn and self.tree == other.tree
                and self.writes_out == other.writes_out)

    def __hash__(self):
        return hash((id(self.fn), self.tree, self.writes_out))


def _build():
    found = _direct_lowering()
    if found is None:
        return None
    emit_python_callback, Primitive, batching, mlir = found
    prim = Primitive("iclab_host_call")
    prim.multiple_results = True

    def abstract(*avals, fn, out, vmap_method):
        return out

    def impl(*args, fn, out, vmap_method):  # outside jit: call the function on host arrays
        return [jnp.asarray(r, o.dtype) for r, o in zip(fn.with_fresh_out(out)(*(np.asarray(a) for a in args)), out)]

    def lowering(ctx, *args, fn, out, vmap_method):
        from iclab.ops._runtime import ffi as _ffi_call

        if FFI and _ffi_call.available():
            return _ffi_call.lowering(ctx, *args, fn=fn, avals_in=ctx.avals_in, avals_out=ctx.avals_out)
        result, _, _ = emit_python_callback(ctx, fn.with_fresh_out(ctx.avals_out), None, list(args), ctx.avals_in,
                                            ctx.avals_out, has_side_effect=False, returns_token=False)
        return result

    def batch(args, dims, *, fn, out, vmap_method):
        """vmap as ``jax.pure_callback`` does: ``broadcast_all`` gives the function every operand with the
        mapped axis first (unmapped ones broadcast); ``expand_dims`` likewise, but the unmapped ones with a
        leading axis of size 1 (not copied: the function broadcasts); ``sequential`` calls it once per mapped
        instance."""
        n = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        if vmap_method in ("broadcast_all", "expand_dims"):
            full = [jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (n,) + a.shape)
                    if vmap_method == "broadcast_all" else jnp.expand_dims(a, 0) for a, d in zip(args, dims)]
            out_n = tuple(jax.core.ShapedArray((n,) + o.shape, o.dtype) for o in out)
            return prim.bind(*full, fn=fn, out=out_n, vmap_method=vmap_method), [0] * len(out)
        if vmap_method != "sequential":
            raise NotImplementedError(f"host_call: vmap_method {vmap_method!r} (sequential, broadcast_all or "
                                      "expand_dims)")
        mapped = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

        def one(xs):
            it = iter(xs)
            ops = [a if d is None else next(it) for a, d in zip(args, dims)]
            return prim.bind(*ops, fn=fn, out=out, vmap_method=vmap_method)

        return list(jax.lax.map(one, mapped)), [0] * len(out)

    prim.def_impl(impl)
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lowering, platform="cpu")
    batching.primitive_batchers[prim] = batch
    return prim


#: Lower host calls to iclab's own FFI handler (``iclab.ops._runtime.ffi``: the operands without a copy) where this JAX
#: accepts it; False: to JAX's callback handler.
FFI = True

_PRIM = _build()


def host_call(fn, result_shape_dtypes, *args, vmap_method: str = "sequential", writes_out: bool = False):
    """``jax.pure_callback(fn, result_shape_dtypes, *args, vmap_method=...)`` without copying the operands.

    Args:
        fn: numpy function of the operands (it receives them as read-only numpy arrays).
        result_shape_dtypes: pytree of ``jax.ShapeDtypeStruct`` of fn's results.
        *args: array operands.
        vmap_method: ``sequential`` (one call per mapped instance), ``broadcast_all`` (one call, every
            operand with the mapped axis first) or ``expand_dims`` (one call, the unmapped operands with a
            leading axis of size 1), as in ``jax.pure_callback``.
        writes_out: fn is called as ``fn(*operands, out=arrays)`` and writes every element of its results into
            ``arrays`` (the leaves of ``result_shape_dtypes``, in order; on the FFI path XLA's result buffers, so
            that nothing is copied afterwards) instead of returning them. Under vmap with ``broadcast_all`` or
            ``expand_dims`` the arrays have the mapped axes first (fn sees them on its operands too).
    Returns:
        fn's results, as arrays in the pytree of ``result_shape_dtypes``.
    """
    leaves, tree = jax.tree_util.tree_flatten(result_shape_dtypes)
    if _PRIM is None or jax.default_backend() != "cpu":
        fn_ = _Fn(fn, tree, writes_out)
        ranks = [np.ndim(a) for a in args]

        def call(*a):  # under vmap the operands (and so the results) carry the mapped axes first
            lead = a[0].shape[:np.ndim(a[0]) - ranks[0]] if a else ()
            return fn_.with_fresh_out([jax.ShapeDtypeStruct(lead + tuple(s.shape), s.dtype) for s in leaves])(*a)

        return jax.pure_callback(lambda *a: jax.tree_util.tree_unflatten(tree, list(call(*a))), result_shape_dtypes,
                                 *args, vmap_method=vmap_method)
    out = tuple(jax.core.ShapedArray(tuple(s.shape), s.dtype) for s in leaves)
    results = _PRIM.bind(*(jnp.asarray(a) for a in args), fn=_Fn(fn, tree, writes_out), out=out,
                         vmap_method=vmap_method)
    return jax.tree_util.tree_unflatten(tree, list(results))


host_call.direct = _PRIM is not None
