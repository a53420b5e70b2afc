"""iclab.ops._runtime.llvm: LLVM IR compiled for this CPU and called through ctypes, from several threads at once."""

from __future__ import annotations

import concurrent.futures
import ctypes

import numpy as np

from iclab.ops._runtime.llvm import compile_function, opaque


def _axpy_ir(scale: float) -> str:
    """y[i] += scale · x[i] for i < n, x read through an opaque pointer."""
    return f"""
define void @axpy(ptr noalias %x, ptr noalias %y, i64 %n) {{
entry:
  br label %head
head:
  %i = phi i64 [0, %entry], [%next, %body]
  %c = icmp slt i64 %i, %n
  br i1 %c, label %body, label %done
body:
  {opaque("%xo", "%x")}
  %px = getelementptr double, ptr %xo, i64 %i
  %py = getelementptr double, ptr %y, i64 %i
  %a = load double, ptr %px
  %b = load double, ptr %py
  %s = call double @llvm.fma.f64(double {scale!r}, double %a, double %b)
  store double %s, ptr %py
  %next = add i64 %i, 1
  br label %head
done:
  ret void
}}
declare double @llvm.fma.f64(double, double, double)
"""


def _axpy(scale: float):
    P = ctypes.c_void_p
    return compile_function(_axpy_ir(scale), "axpy", None, (P, P, ctypes.c_int64))


def test_a_compiled_function_computes_what_its_ir_says():
    x, y = np.arange(7.0), np.full(7, 0.5)
    _axpy(2.5)(x.ctypes.data, y.ctypes.data, 5)
    np.testing.assert_array_equal(y, np.r_[0.5 + 2.5 * np.arange(5.0), 0.5, 0.5])
    assert _axpy(2.5) is _axpy(2.5)  # cached per module text


def test_modules_compiled_from_several_threads_at_once():
    scales = [1.0 + k for k in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        fns = list(pool.map(_axpy, [s + 0.125 for s in scales]))
    x = np.linspace(-1.0, 1.0, 9)
    for s, fn in zip(scales, fns):
        y = np.zeros(9)
        fn(x.ctypes.data, y.ctypes.data, 9)
        np.testing.assert_array_equal(y, (s + 0.125) * x)
