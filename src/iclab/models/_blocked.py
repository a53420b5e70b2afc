"""The blocked token layout of the compiled layer kernels: tokens (B, T, D) as (⌈B/LANES⌉, T, D, LANES).

Prompt b of block i sits in lane b of block i, the last block's spare lanes zero. A kernel that vectorises over
the prompts of a block reads and writes its block in place instead of transposing it in and out (for drift's
layers that transposition was a third of the forward pass). Zero prompts give zero outputs and cotangents in the
layer kernels, so the spare lanes need no masks.
"""

from __future__ import annotations

import functools

import numpy as np

from iclab.threads import run_split

__all__ = ["ALIGN", "LANES", "aligned_empty", "from_blocks", "lanes", "store_lines", "to_blocks", "unlanes"]

#: Prompts per block: one 512-bit vector of float32.
LANES = 16

#: Bytes of alignment of the kernels' blocked arrays and scratch: one cache line, one 512-bit vector.
ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data start on an ``ALIGN``-byte boundary.

    The kernels load and store whole 64-byte vectors of a block; numpy's arrays from glibc's heap (where
    ``iclab._malloc`` keeps the training loop's blocks) start on 16-byte boundaries, so three arrays in four had
    every vector split over two cache lines: the gated layer's backward took ≈ 1.3× the time (D = 16, one thread).
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
                p = pos[t]     # (prompt by prompt, 3x slower at D = 16, T = 83: the block's lines left L1)
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
    run_split(_kernels()[0], Zb.shape[0], Z, positions, Zb, threads=threads)
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
