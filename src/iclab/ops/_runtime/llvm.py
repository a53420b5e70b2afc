"""Kernels written as LLVM IR, compiled for this CPU by llvmlite (numba's own code generator) and called by ctypes.

For kernels whose speed depends on what stays in registers: numba's loop vectoriser keeps every value of a
lane loop in memory it cannot prove unaliased, and spills what it hoists. Written as IR over explicit lane
vectors (``<16 x float>``) with ``noalias`` arguments, the same arithmetic keeps its vectors in registers
(``iclab.ops.decayed_attention._layer_ir``). Compiling takes about a second per kernel, once per process (no disk cache).

A compiled function releases the GIL while it runs (ctypes), so ``iclab.threads.run_split`` runs it on
several threads, each on its own range of jobs.

:func:`denormals_flushed` / :func:`restore_denormals` set and restore the calling thread's denormal mode
(x86-64's MXCSR flush-to-zero and denormals-are-zero), which ``run_split`` sets around every kernel run: XLA
sets it on the threads running its CPU code (a jitted call and its host callbacks), a thread started
elsewhere (the kernel pool, a test) does not have it, so without this a float32 kernel's bits and speed
depended on the thread it ran on (a subnormal operand costs a microcode assist of ≈ 100 cycles).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import threading

__all__ = ["compile_function", "denormals_flushed", "opaque", "restore_denormals", "wide_registers"]

_ENGINES: dict[str, object] = {}  # keeps each module's machine code alive for the life of the process
# LLVM's global context is not thread-safe, and two host callbacks of one jitted step may ask for kernels at once
_LOCK = threading.Lock()


@functools.cache
def _target_machine():
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                        features=llvm.get_host_cpu_features().flatten(), opt=3)


@functools.cache
def wide_registers() -> bool:
    """Whether this CPU has AVX-512: 32 vector registers of 512 bits, so that a vector of 16 float32 (the layer
    kernels' ``LANES``) is one register, where AVX2's 16 registers of 256 bits take two for it. The kernels are
    compiled for this CPU, and their register tiles are sized for the registers it has
    (``iclab.ops.decayed_attention._layer_ir``)."""
    import llvmlite.binding as llvm

    return bool(llvm.get_host_cpu_features().get("avx512f", False))


def compile_function(text: str, name: str, restype, argtypes: tuple):
    """The function ``name`` of the LLVM IR module ``text``, optimised at -O3 for this CPU, as a ctypes function
    with the given result and argument types (cached per (text, name, types) for the process; thread-safe)."""
    with _LOCK:
        return _compile(text, name, restype, argtypes)


@functools.lru_cache(maxsize=None)
def _compile(text: str, name: str, restype, argtypes: tuple):
    import llvmlite.binding as llvm

    tm = _target_machine()
    module = llvm.parse_assembly(text)
    module.verify()
    builder = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(module, builder)
    engine = llvm.create_mcjit_compiler(module, tm)
    engine.finalize_object()
    _ENGINES[hashlib.sha256(text.encode()).hexdigest() + name] = engine
    return ctypes.CFUNCTYPE(restype, *argtypes)(engine.get_function_address(name))


def opaque(result: str, pointer: str) -> str:
    """An IR line giving ``result`` = ``pointer`` through an empty asm statement, which LLVM can neither see
    through nor hoist: loads from ``result`` stay where they are written (folded into the arithmetic as memory
    operands) instead of being hoisted out of a loop, merged with loads elsewhere and spilled."""
    return f'{result} = call ptr asm sideeffect "", "=r,0"(ptr {pointer})'


#: MXCSR's flush-to-zero (bit 15: subnormal results become 0) and denormals-are-zero (bit 6: subnormal
#: operands read as 0) flags, the mode XLA computes in on the CPU.
FTZ_DAZ = 0x8040

_MXCSR_IR = f"""
declare void @llvm.x86.sse.ldmxcsr(ptr)
declare void @llvm.x86.sse.stmxcsr(ptr)
define i32 @flush() {{
entry:
  %p = alloca i32
  call void @llvm.x86.sse.stmxcsr(ptr %p)
  %old = load i32, ptr %p
  %new = or i32 %old, {FTZ_DAZ}
  %same = icmp eq i32 %new, %old
  br i1 %same, label %done, label %set
set:
  store i32 %new, ptr %p
  call void @llvm.x86.sse.ldmxcsr(ptr %p)
  br label %done
done:
  ret i32 %old
}}
define void @restore(i32 %old) {{
entry:
  %p = alloca i32
  store i32 %old, ptr %p
  call void @llvm.x86.sse.ldmxcsr(ptr %p)
  ret void
}}
"""


@functools.cache
def _mxcsr():
    """(flush, restore) compiled for this CPU, or None off x86-64 (where the mode is left as it is)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return (compile_function(_MXCSR_IR, "flush", ctypes.c_uint32, ()),
            compile_function(_MXCSR_IR, "restore", None, (ctypes.c_uint32,)))


def denormals_flushed() -> int | None:
    """Sets flush-to-zero and denormals-are-zero on the calling thread (x86-64's MXCSR; module docstring).

    Returns:
        The thread's previous MXCSR where the flags were not both set already (give it to
        :func:`restore_denormals`), else None (nothing to restore; also off x86-64, where nothing is set).
    """
    fns = _mxcsr()
    if fns is None:
        return None
    old = fns[0]()
    return None if old & FTZ_DAZ == FTZ_DAZ else old


def restore_denormals(old: int | None) -> None:
    """Restores the calling thread's MXCSR returned by :func:`denormals_flushed` (None: nothing to do)."""
    if old is not None:
        _mxcsr()[1](old)
