"""Kernels written as LLVM IR, compiled for this CPU by llvmlite (numba's own code generator) and called by ctypes.

For kernels whose speed depends on what stays in registers: numba's loop vectoriser keeps every value of a
lane loop in memory it cannot prove unaliased, and spills what it hoists. Written as IR over explicit lane
vectors (``<16 x float>``) with ``noalias`` arguments, the same arithmetic keeps its vectors in registers
(``iclab.models._layer_ir``). Compiling takes about a second per kernel, once per process (no disk cache).

A compiled function releases the GIL while it runs (ctypes), so ``iclab.threads.run_split`` runs it on
several threads, each on its own range of jobs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import threading

__all__ = ["compile_function", "opaque"]

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
