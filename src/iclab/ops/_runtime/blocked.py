"""The blocked token layout of the compiled layer kernels: tokens (B, T, D) as (⌈B/LANES⌉, T, D, LANES).

Prompt b of block i sits in lane b of block i, the last block's spare lanes zero. A kernel that vectorises over
the prompts of a block reads and writes its block in place instead of transposing it in and out (for drift's
layers that transposition was a third of the forward pass). Zero prompts give zero outputs and cotangents in the
layer kernels, so the spare lanes need no masks.
"""

from __future__ import annotations

import functools

import numpy as np

from iclab.ops._runtime.threads import run_split

__all__ = ["ALIGN", "LANES", "aligned_empty", "from_blocks", "lanes", "store_lines", "to_blocks", "unlanes"]

#: Prompts per block: one 512-bit vector of float32.
LANES = 16

#: Bytes of alignment of the kernels' blocked arrays and scratch: one cache line, one 512-bit vector.
ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data start on an ``ALIGN``-byte boundary.

    The kernels load and store whole 64-byte vectors of a block; numpy's arrays from glibc's heap (where
    ``iclab.ops._runtime.malloc`` keeps the training loop's blocks) start on 16-byte boundaries, so three arrays in four had
    every vector split over two cache lines, which slows every vector load and store.
    """
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@functools.cache
def _kernels():
    import numba

    @numba.njit(nogil=True, boundscheck=False, cache=True)
    def take(Z, pos, Zb, first, stop):  # the blocks of Z[:, pos] without an intermediate copy
        B, _, D = Z.shape
        T, CH = Zb.shape[1], Zb.shape[3]
        for blk in range(first, stop):
            b0 = blk * CH
            n = min(CH, B - b0)
            zb = Zb[blk]
            for t in range(T):  # token by token: its (D, CH) tile stays in L1 while every lane is written
                p = pos[t]     # (prompt by prompt, the block's lines would leave L1)
                for b in range(n):
                    for f in range(D):
                        zb[t, f, b] = Z[b0 + b, p, f]
                for b in range(n, CH):
                    for f in range(D):
                        zb[t, f, b] = 0.0

    @numba.njit(nogil=True, boundscheck=False, cache=True)
    def back(Zb, Z, first, stop):
        B, T, D = Z.shape
        CH = Zb.shape[3]
        for blk in range(first, stop):
            b0 = blk * CH
            zb = Zb[blk]
            for b in range(min(CH, B - b0)):
                for t in range(T):
                    for f in range(D):
                        Z[b0 + b, t, f] = zb[t, f, b]

    return take, back


def _transpose_8x8(lines: list, rows: list[str], name: str) -> list[str]:
    """IR lines appended to ``lines`` transposing the 8 × 8 float32 tile of the <8 x float> ``rows``: three rounds
    of two-source shuffles (32-bit, 64-bit, 128-bit interleaves). Returns the columns."""
    V = "<8 x float>"

    def shuffle(out, a, b, mask):
        lines.append(f"  {out} = shufflevector {V} {a}, {V} {b}, <8 x i32> <{', '.join(f'i32 {m}' for m in mask)}>")
        return out

    u = []
    for k in range(4):
        u.append(shuffle(f"%{name}u{2 * k}", rows[2 * k], rows[2 * k + 1], (0, 8, 1, 9, 4, 12, 5, 13)))
        u.append(shuffle(f"%{name}u{2 * k + 1}", rows[2 * k], rows[2 * k + 1], (2, 10, 3, 11, 6, 14, 7, 15)))
    v = []
    for k in (0, 4):  # rows 0-3, then 4-7: columns c and c + 4 of four rows in each v
        v.append(shuffle(f"%{name}v{k}", u[k], u[k + 2], (0, 1, 8, 9, 4, 5, 12, 13)))
        v.append(shuffle(f"%{name}v{k + 1}", u[k], u[k + 2], (2, 3, 10, 11, 6, 7, 14, 15)))
        v.append(shuffle(f"%{name}v{k + 2}", u[k + 1], u[k + 3], (0, 1, 8, 9, 4, 5, 12, 13)))
        v.append(shuffle(f"%{name}v{k + 3}", u[k + 1], u[k + 3], (2, 3, 10, 11, 6, 7, 14, 15)))
    cols = [None] * 8
    for c in range(4):
        cols[c] = shuffle(f"%{name}c{c}", v[c], v[c + 4], (0, 1, 2, 3, 8, 9, 10, 11))
        cols[c + 4] = shuffle(f"%{name}c{c + 4}", v[c], v[c + 4], (4, 5, 6, 7, 12, 13, 14, 15))
    return cols


@functools.cache
def _take_ir_kernel():
    """``take(Z, P, Zb, TZ, T, first, stop)``: the full blocks [first, stop) of float32 tokens Z (B, TZ, 16) at the
    positions P (T int64) into Zb (blocks, T, 16, 16): each token's 16 × 16 tile of a block (its 16 prompts' rows)
    transposed in registers, as four 8 × 8 tiles, instead of :func:`_kernels`' element by element."""
    import ctypes

    from iclab.ops._runtime.llvm import compile_function

    assert LANES == 16
    V = "<8 x float>"
    lines = ["define void @take(ptr noalias %Z, ptr noalias %P, ptr noalias %Zb, i64 %TZ, i64 %T, i64 %first, "
             "i64 %stop) {", "entry:", "  br label %blk",
             "blk:", "  %b = phi i64 [%first, %entry], [%b.n, %t.done]", "  %b.c = icmp slt i64 %b, %stop",
             "  br i1 %b.c, label %blk.body, label %done",
             "blk.body:", "  %b.n = add i64 %b, 1", "  %b0 = mul i64 %b, 16", "  br label %t",
             "t:", "  %t.i = phi i64 [0, %blk.body], [%t.n, %t.body]", "  %t.c = icmp slt i64 %t.i, %T",
             "  br i1 %t.c, label %t.body, label %t.done",
             "t.body:", "  %t.n = add i64 %t.i, 1",
             "  %pp = getelementptr i64, ptr %P, i64 %t.i", "  %p = load i64, ptr %pp",
             "  %bt = mul i64 %b, %T", "  %bt2 = add i64 %bt, %t.i", "  %oo = mul i64 %bt2, 256",
             "  %op = getelementptr float, ptr %Zb, i64 %oo"]
    for r in range(16):  # row r: prompt b0 + r at token p
        lines += [f"  %rb{r} = add i64 %b0, {r}", f"  %rt{r} = mul i64 %rb{r}, %TZ", f"  %rp{r} = add i64 %rt{r}, %p",
                  f"  %ro{r} = mul i64 %rp{r}, 16"]
        for h in range(2):
            lines += [f"  %ra{r}_{h} = add i64 %ro{r}, {8 * h}", f"  %rq{r}_{h} = getelementptr float, ptr %Z, i64 %ra{r}_{h}",
                      f"  %x{r}_{h} = load {V}, ptr %rq{r}_{h}, align 4"]
    for bh in range(2):  # the tile of prompts 8bh.., features 8fh..: its column f' is feature 8fh + f', lanes 8bh..
        for fh in range(2):
            cols = _transpose_8x8(lines, [f"%x{8 * bh + r}_{fh}" for r in range(8)], f"q{bh}{fh}")
            for c, col in enumerate(cols):
                slot = (8 * fh + c) * 16 + 8 * bh
                lines += [f"  %s{bh}{fh}_{c} = getelementptr float, ptr %op, i64 {slot}",
                          f"  store {V} {col}, ptr %s{bh}{fh}_{c}, align 4"]
    lines += ["  br label %t", "t.done:", "  br label %blk", "done:", "  ret void", "}"]
    P, I = ctypes.c_void_p, ctypes.c_int64
    return compile_function("\n".join(lines), "take", None, (P, P, P, I, I, I, I))


#: Whether :func:`to_blocks` transposes float32 tokens of width LANES with the IR kernel (``_take_ir_kernel``; the
#: same values: it moves them; tested): 8 × 8 tiles transposed in registers instead of one value at a time.
#: gating.fig2's step blocks its prompts (10 × 256 × 103 × 16 float32) in each of its three host calls.
IR_TAKE = True


def to_blocks(Z: np.ndarray, *, positions: np.ndarray | None = None, threads: int = 1,
              out: np.ndarray | None = None) -> np.ndarray:
    """Tokens (B, T, D) in the blocked layout (⌈B/LANES⌉, T, D, LANES), the spare lanes zero (a copy); with
    ``positions`` (int64), those tokens only: the blocked layout of ``Z[:, positions]``; written into ``out`` (a
    C-contiguous array of that shape and Z's dtype) if given."""
    B, T, D = Z.shape
    if positions is None:
        positions = np.arange(T)
    positions = np.asarray(positions, np.int64)
    if positions.ndim != 1 or np.any(positions < 0) or np.any(positions >= T):
        raise ValueError(f"token positions must be a 1-D array of indices in [0, {T})")
    shape = (-(-B // LANES), positions.size, D, LANES)
    if out is None:
        Zb = aligned_empty(shape, Z.dtype)
    elif out.shape != shape or out.dtype != Z.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {Z.dtype} array of shape {shape} (got {out.dtype}, {out.shape})")
    else:
        Zb = out
    full = B // LANES if IR_TAKE and Z.dtype == np.float32 and D == LANES and Z.flags.c_contiguous else 0
    if full:
        take = _take_ir_kernel()
        pos = np.ascontiguousarray(positions)
        run_split(lambda first, stop: take(Z.ctypes.data, pos.ctypes.data, Zb.ctypes.data, T, pos.size, first, stop),
                  full, threads=threads)
    if full < Zb.shape[0]:
        run_split(lambda first, stop: _kernels()[0](Z, positions, Zb, full + first, full + stop),
                  Zb.shape[0] - full, threads=threads)
    return Zb


def from_blocks(Zb: np.ndarray, B: int, *, threads: int = 1) -> np.ndarray:
    """The B prompts of a blocked array as tokens (B, T, D) (a copy; inverse of :func:`to_blocks`)."""
    Z = np.empty((B,) + Zb.shape[1:3], Zb.dtype)
    run_split(_kernels()[1], Zb.shape[0], Zb, Z, threads=threads)
    return Z


def lanes(a: np.ndarray, nb: int) -> np.ndarray:
    """(B, ...) per-prompt values as (nb, ..., LANES), the spare lanes zero."""
    out = np.zeros((nb * LANES,) + a.shape[1:], a.dtype)
    out[:a.shape[0]] = a
    blocked = aligned_empty((nb,) + a.shape[1:] + (LANES,), a.dtype)
    blocked[...] = np.moveaxis(out.reshape((nb, LANES) + a.shape[1:]), 1, -1)
    return blocked


def unlanes(a: np.ndarray, B: int) -> np.ndarray:
    """Inverse of :func:`lanes`: (nb, ..., LANES) -> (B, ...)."""
    return np.moveaxis(a, -1, 1).reshape((-1,) + a.shape[1:-1])[:B]


def store_lines(D: int, target: str, value: str) -> list[str]:
    """Generated kernel source (a token-layout kernel's block loop) that writes a block buffer back to tokens
    (B, T, D) prompt by prompt, in contiguous rows: ``target[b0 + b, t, e] = value`` for the block's n prompts
    (``value`` an expression in b, t, e)."""
    return ["        for b in range(n):", "            for t in range(T):", f"                for e in range({D}):",
            f"                    {target}[b0 + b, t, e] = {value}"]
