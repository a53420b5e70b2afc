"""Host calls through an XLA FFI handler of our own: the operands reach the host function without a copy.

JAX's CPU callback handler (``xla_ffi_python_cpu_callback``) wraps each operand in a numpy array made from the
buffer's pointer without an owner, which numpy makes by copying: drift.fig1's read-out call copied its 111 MB of
tokens and 20 MB of query vectors at every step, a large part of the call. Here one FFI
handler, registered once for the process (``iclab_host_call``), is a ctypes callback: it reads XLA's call frame
(the C structs of ``xla/ffi/api/c_api.h``, API 0.3), views each operand buffer as a read-only numpy array in place,
calls the host function and copies its results into the result buffers.

Which host function: the custom call carries two scalar attributes, the function's index in this process's
registry and a per-process nonce; an executable from another process (a persistent compilation cache) names
another process's registry, and the call then fails with an error instead of calling the wrong function. An
exception in the host function becomes an XLA error with its message (``jax.errors.JaxRuntimeError``; from a
jitted function's C++ fast path a ``ValueError``).
"""

from __future__ import annotations

import ctypes as C
import os
import threading
import traceback

import numpy as np

__all__ = ["available", "lowering"]


class _ExtensionBase(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.c_void_p)]


class _Version(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("major", C.c_int), ("minor", C.c_int)]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _Version), ("traits", C.c_uint32),
                ("state_type_id", C.c_int64)]


class _MetadataExtension(C.Structure):
    _fields_ = [("base", _ExtensionBase), ("metadata", C.POINTER(_Metadata))]


class _Args(C.Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("args", C.POINTER(C.c_void_p))]


class _Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("names", C.POINTER(C.c_void_p)), ("attrs", C.POINTER(C.c_void_p))]


class _CallFrame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(_ExtensionBase)), ("api", C.c_void_p),
                ("ctx", C.c_void_p), ("stage", C.c_int), ("args", _Args), ("rets", _Args), ("attrs", _Attrs),
                ("future", C.c_void_p)]


class _Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("dtype", C.c_int),
                ("data", C.c_void_p), ("rank", C.c_int64), ("dims", C.POINTER(C.c_int64))]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.POINTER(C.c_uint64))]


class _ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("message", C.c_char_p),
                ("errc", C.c_int)]


_ERROR_CREATE = C.CFUNCTYPE(C.c_void_p, C.POINTER(_ErrorCreateArgs))


class _Api(C.Structure):  # the head of XLA_FFI_Api, up to XLA_FFI_Error_Create
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("api_version", _Version),
                ("internal_api", C.c_void_p), ("error_create", _ERROR_CREATE)]


_METADATA_EXTENSION, _EXECUTE, _ATTR_SCALAR, _INTERNAL = 1, 3, 3, 13
_API_MAJOR, _API_MINOR = 0, 3  # the c_api.h this follows (jaxlib 0.10)
_TARGET = "iclab_host_call"
#: A process's registry: index -> (host function, operand avals, result avals).
_REGISTRY: list = []
_LOCK = threading.Lock()
_NONCE = int.from_bytes(os.urandom(8), "little") >> 2  # below 2⁶³: MLIR converts it through int64


def _error(frame, message: str):
    api = C.cast(frame.api, C.POINTER(_Api)).contents
    args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message.encode("utf-8", "replace")[:4000], _INTERNAL)
    return api.error_create(C.byref(args))


def _view(ptr: int, aval) -> np.ndarray:
    dtype = np.dtype(aval.dtype)
    n = int(np.prod(aval.shape, dtype=np.int64))
    if n == 0:
        return np.empty(aval.shape, dtype)
    return np.ctypeslib.as_array(C.cast(ptr, C.POINTER(C.c_uint8)), (n * dtype.itemsize,)).view(dtype).reshape(
        aval.shape)


def _handler(frame_ptr):
    frame = frame_ptr.contents
    ext = frame.extension_start
    if ext and ext.contents.type == _METADATA_EXTENSION:  # XLA asks which API the handler speaks
        meta = C.cast(ext, C.POINTER(_MetadataExtension)).contents.metadata.contents
        meta.api_version = _Version(C.sizeof(_Version), None, _API_MAJOR, _API_MINOR)
        meta.traits = 0
        return None
    if frame.stage != _EXECUTE:
        return None
    try:
        attrs = frame.attrs
        values = {}
        for i in range(attrs.size):
            if attrs.types[i] != _ATTR_SCALAR:
                raise RuntimeError("iclab_host_call: unexpected attribute")
            name = C.cast(attrs.names[i], C.POINTER(C.c_void_p * 2)).contents
            key = C.string_at(name[0], name[1]).decode()
            values[key] = C.cast(attrs.attrs[i], C.POINTER(_Scalar)).contents.value[0]
        if values.get("nonce") != _NONCE or not 0 <= values.get("index", -1) < len(_REGISTRY):
            raise RuntimeError("iclab_host_call: this executable was compiled by another process (a persistent "
                               "compilation cache?); clear the cache or disable it for iclab's native kernels")
        fn, avals_in, avals_out = _REGISTRY[values["index"]]
        if frame.args.size != len(avals_in) or frame.rets.size != len(avals_out):
            raise RuntimeError("iclab_host_call: operand count differs from the lowering's")
        ins = []
        for i, aval in enumerate(avals_in):
            a = _view(C.cast(frame.args.args[i], C.POINTER(_Buffer)).contents.data, aval)
            a.flags.writeable = False
            ins.append(a)
        rets = [_view(C.cast(frame.rets.args[i], C.POINTER(_Buffer)).contents.data, aval)
                for i, aval in enumerate(avals_out)]
        if getattr(fn, "writes_out", False):  # the function writes XLA's result buffers itself
            fn(*ins, out=tuple(rets))
            return None
        results = fn(*ins)
        if len(results) != len(avals_out):
            raise RuntimeError(f"iclab_host_call: {len(results)} results, expected {len(avals_out)}")
        for i, (r, aval) in enumerate(zip(results, avals_out)):
            r = np.asarray(r)
            if r.shape != tuple(aval.shape) or r.dtype != np.dtype(aval.dtype):
                raise RuntimeError(f"iclab_host_call: result {i} is {r.dtype}{list(r.shape)}, expected "
                                   f"{np.dtype(aval.dtype)}{list(aval.shape)}")
            np.copyto(rets[i], r)
        return None
    except BaseException as e:  # noqa: BLE001 - every failure must reach XLA as an error, never as garbage
        last = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
        where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
        return _error(frame, f"{type(e).__name__}: {e}{where}")


_HANDLER_TYPE = C.CFUNCTYPE(C.c_void_p, C.POINTER(_CallFrame))
_STATE: dict = {}


def available() -> bool:
    """Whether the handler is registered with XLA (registered on first use; False where this jaxlib refuses it)."""
    with _LOCK:
        if "ok" not in _STATE:
            try:
                import jax

                handler = _HANDLER_TYPE(_handler)
                jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(handler), platform="cpu", api_version=1)
                _STATE["handler"] = handler  # kept alive: XLA holds its address
                _STATE["ok"] = True
            except Exception:  # noqa: BLE001 - another JAX: the caller falls back to JAX's callback
                _STATE["ok"] = False
        return _STATE["ok"]


def lowering(ctx, *args, fn, avals_in, avals_out):
    """MLIR of a call of ``fn`` (numpy arrays in, a sequence of arrays out) on the operands ``args``."""
    import jax

    with _LOCK:
        _REGISTRY.append((fn, tuple(avals_in), tuple(avals_out)))
        index = len(_REGISTRY) - 1
    ctx.module_context.add_host_callback(fn)  # JAX then treats the module as one with host callbacks
    return jax.ffi.ffi_lowering(_TARGET)(ctx, *args, index=np.uint64(index), nonce=np.uint64(_NONCE))
