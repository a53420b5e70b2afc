"""XLA's RNG bits of an RBG key, bit for bit, from a compiled CPU kernel: :func:`random_bits` and :data:`IMPL`.

JAX's RBG keys draw through XLA's RngBitGenerator, whose default algorithm on the CPU is Philox4x32-10
(:mod:`iclab.ops._runtime.philox`). For a key of words (k0, k1, k2, k3) XLA reads the state s0 = k0 + 2³² k1,
s1 = k2 + 2³² k3 and draws, for the j-th block of four 32-bit words, Philox of the 128-bit counter
(s1 + j) + 2⁶⁴ (s0 + carry) (words from the least significant; carry = 1 where s1 + j wrapped past 2⁶⁴) under
the key (k0, k1); the draw is the blocks' words in order, cut to the shape's size (row-major), and a 64-bit
draw takes words 2m, 2m + 1 as its m-th value's low and high halves (read from XLA's expansion of the op; the
tests compare every case with ``lax.rng_bit_generator``).

Why: XLA expands the generator into elementwise HLO (the ten rounds on 64-bit products) that runs on one thread,
most of gating.fig2's batch (10 seeds × 256 prompts × 1141 normals); the kernel below (numba, the rounds written
out, the whole blocks in a loop without branches, the last block's cut after it) draws them split over the
threads. Only the bits move:
:data:`IMPL` is a JAX PRNG implementation whose ``random_bits`` is this kernel (a host call), so
``jax.random.normal`` and ``uniform`` turn its bits into floats with their own XLA code, as they do the RBG key's,
and the draws are the same bits (tested). Its other functions are the RBG key's. Under vmap one host call draws
every key's words (``broadcast_all``), the keys' blocks one range of jobs split over the threads, not a host call
and a split per key. The whole blocks come eight at a time from an LLVM IR kernel (``IR_BLOCKS``: the rounds on
lanes of blocks, 32 × 32 → 64-bit products by vpmuludq, where numba's loop stays scalar), numba's loop doing the
rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.ops._runtime.host import host_call
from iclab.ops._runtime.numba_cache import compile_kernels
from iclab.ops._runtime.philox import M0, M1, round_key_lines, round_keys, round_lines
from iclab.ops._runtime.threads import run_split, thread_count

__all__ = ["IMPL", "random_bits", "words_of_state"]


def _block_lines() -> str:
    """Source lines (8 spaces in) of Philox block j: its counter (lo + j) + 2⁶⁴ (top + carry), then the rounds."""
    return f'''        c = lo + np.uint64(j)
        h = top + (one if c < lo else np.uint64(0))
        x0 = c & mask
        x1 = c >> hi
        x2 = h & mask
        x3 = h >> hi
{round_lines()}'''


_SOURCE = f'''
def blocks(round_keys, lo, top, out, first, stop):
    """Philox blocks j in [first, stop) of the counter (lo + j) + 2⁶⁴ (top + carry) into out[4j:4j + 4] (uint32,
    cut at out's end): whole blocks in a loop LLVM vectorises (no branch in it), a last partial one after it."""
    n = out.shape[0]
    mask = np.uint64(0xFFFFFFFF)
    hi = np.uint64(32)
    one = np.uint64(1)
{round_key_lines()}
    full = max(first, min(stop, n // 4))
    for j in range(first, full):
{_block_lines()}
        out[4 * j] = np.uint32(x0)
        out[4 * j + 1] = np.uint32(x1)
        out[4 * j + 2] = np.uint32(x2)
        out[4 * j + 3] = np.uint32(x3)
    for j in range(full, stop):  # the last block, cut
{_block_lines()}
        words = (x0, x1, x2)
        for q in range(3):
            if 4 * j + q < n:
                out[4 * j + q] = np.uint32(words[q])
'''


#: Philox blocks a step of the IR kernel computes, one per lane (two AVX2 registers of 64-bit lanes per word).
IR_LANES = 8

#: Whether the whole blocks of eight come from the LLVM IR kernel (``_ir_kernel``: the rounds on lanes of blocks,
#: vpmuludq's 32 × 32 → 64-bit products) rather than numba's loop (its naive twin, scalar: LLVM did not vectorise
#: its 64-bit products); the same words, tested.
IR_BLOCKS = True


def _ir_source() -> str:
    """LLVM IR of ``philox_blocks(rk, lo, top, out, first, count)``: blocks j = first + 8i + l (i < count, l < 8)
    of the counter (lo + j) + 2⁶⁴ (top + carry) under the round keys rk (10 × 2 i64), their words into
    out[4j:4j + 4] (i32)."""
    V, n = f"<{IR_LANES} x i64>", IR_LANES

    def splat(value):
        return "<" + ", ".join(f"i64 {value}" for _ in range(n)) + ">"

    lines = [f"define void @philox_blocks(ptr noalias nocapture readonly %rk, i64 %lo, i64 %top, "
             "ptr noalias nocapture %out, i64 %first, i64 %count) {",
             "entry:",
             f"  %lo0 = insertelement {V} undef, i64 %lo, i32 0",
             f"  %lov = shufflevector {V} %lo0, {V} undef, <{n} x i32> zeroinitializer",
             f"  %top0 = insertelement {V} undef, i64 %top, i32 0",
             f"  %topv = shufflevector {V} %top0, {V} undef, <{n} x i32> zeroinitializer"]
    for r in range(20):
        lines += [f"  %rkp{r} = getelementptr i64, ptr %rk, i64 {r}", f"  %rks{r} = load i64, ptr %rkp{r}",
                  f"  %rki{r} = insertelement {V} undef, i64 %rks{r}, i32 0",
                  f"  %rk{r} = shufflevector {V} %rki{r}, {V} undef, <{n} x i32> zeroinitializer"]
    lines += ["  %any = icmp sgt i64 %count, 0", "  br i1 %any, label %loop, label %done", "loop:",
              "  %i = phi i64 [ 0, %entry ], [ %inext, %loop ]",
              f"  %j8 = mul i64 %i, {n}", "  %j0 = add i64 %first, %j8",
              f"  %j0i = insertelement {V} undef, i64 %j0, i32 0",
              f"  %j0v = shufflevector {V} %j0i, {V} undef, <{n} x i32> zeroinitializer",
              f"  %jv = add {V} %j0v, <" + ", ".join(f"i64 {l}" for l in range(n)) + ">",
              f"  %c = add {V} %lov, %jv",
              f"  %wrap = icmp ult {V} %c, %lov", f"  %carry = zext <{n} x i1> %wrap to {V}",
              f"  %h = add {V} %topv, %carry",
              f"  %x0_0 = and {V} %c, {splat(0xFFFFFFFF)}", f"  %x1_0 = lshr {V} %c, {splat(32)}",
              f"  %x2_0 = and {V} %h, {splat(0xFFFFFFFF)}", f"  %x3_0 = lshr {V} %h, {splat(32)}"]
    for r in range(10):  # x0..x3 < 2³²: LLVM multiplies 32 × 32 bits (vpmuludq)
        a, b = r, r + 1
        lines += [f"  %p0_{a} = mul {V} %x0_{a}, {splat(M0)}", f"  %p1_{a} = mul {V} %x2_{a}, {splat(M1)}",
                  f"  %h0_{a} = lshr {V} %p0_{a}, {splat(32)}", f"  %h1_{a} = lshr {V} %p1_{a}, {splat(32)}",
                  f"  %t0_{a} = xor {V} %h1_{a}, %x1_{a}", f"  %x0_{b} = xor {V} %t0_{a}, %rk{2 * r}",
                  f"  %x1_{b} = and {V} %p1_{a}, {splat(0xFFFFFFFF)}",
                  f"  %t2_{a} = xor {V} %h0_{a}, %x3_{a}", f"  %x2_{b} = xor {V} %t2_{a}, %rk{2 * r + 1}",
                  f"  %x3_{b} = and {V} %p0_{a}, {splat(0xFFFFFFFF)}"]
    W = f"<{n} x i32>"
    lines += [f"  %w{k} = trunc {V} %x{k}_10 to {W}" for k in range(4)]
    pair = ", ".join(f"i32 {l}, i32 {n + l}" for l in range(n))
    lines += [f"  %w01 = shufflevector {W} %w0, {W} %w1, <{2 * n} x i32> <{pair}>",
              f"  %w23 = shufflevector {W} %w2, {W} %w3, <{2 * n} x i32> <{pair}>"]
    quad = ", ".join(f"i32 {2 * l}, i32 {2 * l + 1}, i32 {2 * n + 2 * l}, i32 {2 * n + 2 * l + 1}" for l in range(n))
    lines += [f"  %words = shufflevector <{2 * n} x i32> %w01, <{2 * n} x i32> %w23, <{4 * n} x i32> <{quad}>",
              "  %o = mul i64 %j0, 4", "  %po = getelementptr i32, ptr %out, i64 %o",
              f"  store <{4 * n} x i32> %words, ptr %po, align 4",
              "  %inext = add i64 %i, 1", "  %more = icmp slt i64 %inext, %count",
              "  br i1 %more, label %loop, label %done", "done:", "  ret void", "}"]
    return "\n".join(lines) + "\n"


@functools.cache
def _ir_kernel():
    import ctypes

    from iclab.ops._runtime.llvm import compile_function

    P, I = ctypes.c_void_p, ctypes.c_int64
    return compile_function(_ir_source(), "philox_blocks", None, (P, ctypes.c_uint64, ctypes.c_uint64, P, I, I))


def _blocks(rk, lo, top, out, first: int, stop: int) -> None:
    """Philox blocks [first, stop) of one key into out (uint32, cut at its end): the whole blocks in steps of eight
    by the IR kernel (``IR_BLOCKS``), the rest by numba's."""
    full = max(first, min(stop, out.shape[0] // 4))
    mid = first + (full - first) // IR_LANES * IR_LANES if IR_BLOCKS else first
    if mid > first:
        _ir_kernel()(rk.ctypes.data, int(lo), int(top), out.ctypes.data, first, (mid - first) // IR_LANES)
    if stop > mid:
        _kernel()(rk, lo, top, out, mid, stop)


@functools.cache
def _kernel():
    return compile_kernels(_SOURCE, ["blocks"], label="iclab XLA RngBitGenerator (Philox4x32-10) bits", nogil=True,
                           boundscheck=False)[0]


def words_of_state(words: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` 32-bit words XLA's RngBitGenerator draws from the RBG key ``words`` (4,) uint32 (module
    docstring), on this process's threads.

    Args:
        words: (4,) uint32, the key's data (k0, k1, k2, k3).
        count: words to draw.
    Returns:
        (count,) uint32.
    """
    out = np.empty(count, np.uint32)
    _fill_keys(np.asarray(words, np.uint32).reshape(1, 4), out.reshape(1, -1))
    return out


def _fill_keys(words: np.ndarray, out: np.ndarray) -> None:
    """out[i] (uint32, C-contiguous (keys, count)) = the first count words of the key ``words[i]`` (keys, 4): every
    key's blocks one range of jobs, split over the threads as one (not a split per key)."""
    keys, count = out.shape
    jobs = -(-count // 4)
    if not keys or not jobs:
        return
    state = []
    for k0, k1, k2, k3 in (tuple(int(w) for w in row) for row in words):
        state.append((round_keys(k0, k1), np.uint64(k2 | (k3 << 32)), np.uint64(k0 | (k1 << 32))))

    def run(first, stop):
        for i in range(first // jobs, (stop - 1) // jobs + 1):
            rk, s1, s0 = state[i]
            _blocks(rk, s1, s0, out[i], max(first - i * jobs, 0), min(stop - i * jobs, jobs))

    run_split(run, keys * jobs, threads=min(thread_count(), max(1, keys * jobs // 4096)))  # a small draw: one thread


def _host_bits(words, *, out):
    """The bits of one key, or (vmapped: ``broadcast_all``) of keys (..., 4) into out (..., *shape)."""
    (bits,) = out
    words = np.asarray(words, np.uint32).reshape(-1, 4)
    _fill_keys(words, bits.reshape(words.shape[0], -1).view(np.uint32))


def random_bits(key_data: jax.Array, bit_width: int, shape) -> jax.Array:
    """``random_bits`` of :data:`IMPL`: the RBG key's bits (``lax.rng_bit_generator``'s) of width 32 or 64.

    Args:
        key_data: (4,) uint32.
        bit_width: 32 or 64 (8 and 16: XLA draws them otherwise; refused).
        shape: the draw's shape.
    Returns:
        uint32 or uint64 array of ``shape``.
    """
    if bit_width not in (32, 64):
        raise ValueError(f"the native RBG bits are 32 or 64 bits wide (got {bit_width})")
    dtype = jnp.uint32 if bit_width == 32 else jnp.uint64
    shape = tuple(int(s) for s in shape)
    if 0 in shape:
        return jnp.zeros(shape, dtype)
    return host_call(_host_bits, (jax.ShapeDtypeStruct(shape, dtype),), jnp.asarray(key_data, jnp.uint32),
                     vmap_method="broadcast_all", writes_out=True)[0]


def _impl():
    from jax.extend.random import define_prng_impl, rbg_prng_impl

    rbg = rbg_prng_impl
    return define_prng_impl(key_shape=rbg.key_shape, seed=rbg.seed, split=rbg.split, fold_in=rbg.fold_in,
                            random_bits=random_bits, name="iclab_rbg_native", tag="irn")


#: A JAX PRNG implementation: the RBG key's (key data, seed, split, fold_in), its bits from :func:`random_bits`.
IMPL = _impl()
