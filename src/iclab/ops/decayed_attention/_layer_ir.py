"""The float32 kernels of the paper presets as LLVM IR: the full GLA layers (recurrent form) on the blocked layout,
gating's last layer read at the query (``query_loss_kernel``) and its grids of one-layer models read at the query
(``query_grid_kernel``, ``vector_grid_kernel``; the sections at the end of this module).

drift's layer (a forget factor λ; ``layer_kernels``, twin of ``forget._layer_source``) and gating's
residual scalar-gated layer (``gated_layer_kernels``, twin of ``gated._gated_layer_source``), with the numba
kernels' call signatures (``blocked=True``), for one block of ``LANES`` prompts at a time, every value a vector
of the block's lanes. For tokens z_t (t = 0..T-1) of width D, W_Q, W_K, W_V (D, D) and a decay d_t (λ, or the
gate g_t = φ(w_gᵀ z_t)):

    q_t = W_Q z_t,  k_t = W_K z_t,  v_t = W_V z_t,  S_t = d_t S_{t-1} + v_t k_tᵀ,  o_t = [z_t +] S_t q_t.

Backward, given ō_t: pass 1 (t ascending) q̄_t = S_tᵀ ō_t and z̄_t = [ō_t +] W_Qᵀ q̄_t; pass 2 (t descending)
E_t = d_{t+1} E_{t+1} + ō_t q_tᵀ, k̄_t = E_tᵀ v_t, v̄_t = E_t k_t, z̄_t += W_Kᵀ k̄_t + W_Vᵀ v̄_t and, for λ̄,
X_t = λ X_{t+1} + E_{t+1}, λ̄ = Σ_t v_tᵀ X_t k_t (for the gates, ``backward_ir``); then W̄_Q = Σ_t q̄_t z_tᵀ,
W̄_K = Σ_t k̄_t z_tᵀ, W̄_V = Σ_t v̄_t z_tᵀ.

What differs from the numba kernels is where values live, not the arithmetic (the same operations in the same
order; drift's forward and pass 1 give the same bits):
- the weights are read as scalars broadcast at each use (through ``iclab.ops._runtime.llvm.opaque``): hoisted out of the
  token loop, 3D² broadcast vectors (23 KB at D = 11) would be spilled to the stack and crowd the state out of L1;
- every pass runs a token's rows of S (or E) as a loop (``_rows_loop``), not unrolled, the state in memory (the
  forward's on the stack) and q_t, k_t re-read per row as memory operands: unrolled (the forward's state in the
  token loop's phis), LLVM moves every row's state update ahead of the sums that read it and spills the state
  to the stack;
- the weight gradients are not accumulated per token (3D² loads and stores of accumulators per token): q̄_t, k̄_t,
  v̄_t go to a scratch and each W̄ is summed after pass 2 in register tiles of ``W_ROWS`` × ``W_COLUMNS``
  accumulators, over chunks of ``W_CHUNK`` tokens (a chunk's z_t stay in L1 for every tile, where the whole
  block's z_t would come from L2 for each tile);
- the code is loops, not straight lines: the projections q_t, k_t, v_t, the token cotangent z̄_t and the
  weight-gradient tiles are runtime loops over their outputs (``_units_loop``), each output's chain a loop over
  its terms (``_inner_chains``), and the backward's passes update S_t (E_t) ``STATE_COLUMNS`` columns at a time,
  so that the q̄_t (k̄_t) they carry stay in registers (all D would spill with AVX2's 16 registers of 8 float32,
  where a LANES vector of 16 takes two);
- every array a kernel reads or writes by vectors starts on a cache line (``_blocked.aligned_empty``): on the
  16-byte boundaries glibc's heap gives, vector loads straddle cache lines;
- the scalar gates' exponential is glibc's ``expf`` computed inline (``_expf_glibc``, equal to it on every
  float32 it is given) in the forward, the backward's first pass and the query read-outs, not 16 calls per
  vector;
- the weight gradients' sums over the lanes (≈ 3D² per block) are transposed and added four at a time
  (``_Builder.lane_sums``), in the order of the lane-by-lane sums;
- a first layer (and a one-layer read-out) may read its tokens at positions P of a longer blocked prompt
  (``gathered``), so that gating.fig2's models of every n̄ share one blocked copy of their prompts.
In float64 (16 doubles are two registers) the numba kernels stay the models'.

Why loops: on some hosts straight-line code beyond a few hundred instructions runs at a fraction of the rate of
the same FMAs in a small loop, while loops lose nothing elsewhere; so the kernels' hot code is loops and their
register tiles fit AVX2's register file. Every chain keeps its operands and its order, so a loop's shape changes
no bit (``test_loop_shapes_of_the_layer_kernels_change_no_bit``).

The projections read the weights and z_t directly, two rows an iteration (``PROJECTION_ROWS``: 12 independent FMA
chains, where one row's 6 wait on the FMA latency); pass 2 of the gated backward prefetches O_{t-1} (its first
load of O_t is otherwise where it waits), and pass 1 computes its expf inline.

Gating's layer may keep its projections (``kept``, the grid driver's kernels): the forward writes q_t, k_t, v_t of
every block and token to R (blocks, T, 3, D, LANES) and the backward's first pass reads them there instead of
computing them again (3D² of its ≈ 16D² vector operations a token); the same FMAs in the same order, so the same
bits (tested). The stores cost the forward a little (R stays in L2 for a block); non-temporal stores to R would
make the backward read it back from memory.

With AVX2 (16 registers of 8 float32) the gated backward's rows loops run on half vectors (``HALF_LANES``: each
slice of columns a loop per half of the lanes, 8 float32 a register, ``HALF_COLUMNS`` columns a slice), and the
weight gradients' sums over the lanes go four at a time through 4 × 4 transposes in double, in a loop
(``_Builder.lane_sums``, ``lane_sums_loop``); the same bits (tested). With AVX-512 (32 registers of 16 float32, a
LANES vector in one) LLVM, compiling for the CPU it runs on, keeps a LANES vector in one register, so the sizes that
depend on the register file follow it (``iclab.ops._runtime.llvm.wide_registers``): the gated backward's rows loops
run on whole vectors and both backwards update 4 columns of the state a slice (``STATE_COLUMNS``); the same bits
(tested with both shapes).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import threading

import numpy as np

from iclab.ops._runtime.llvm import compile_function, opaque, wide_registers
from iclab.ops._runtime.blocked import LANES, aligned_empty

__all__ = ["gated_layer_kernels", "layer_kernels"]

#: Lanes of a half vector (``_Builder.half``): 8 float32, one AVX2 register.
HALF = LANES // 2

_TYPES = {np.dtype(np.float32): ("float", "f32", ctypes.c_float), np.dtype(np.float64): ("double", "f64", ctypes.c_double)}


class _Builder:
    """Straight-line LLVM IR over vectors of LANES values of one scalar type (SSA names %rN)."""

    def __init__(self, dtype: np.dtype):
        self.ty, suffix, _ = _TYPES[np.dtype(dtype)]
        self.V = f"<{LANES} x {self.ty}>"
        self.fma_name = f"llvm.fma.v{LANES}{suffix}"
        self.lines = [f"declare {self.V} @{self.fma_name}({self.V}, {self.V}, {self.V})",
                      f"declare {self.V} @llvm.exp.v{LANES}{suffix}({self.V})",
                      f"declare {self.V} @llvm.fabs.v{LANES}{suffix}({self.V})",
                      f"declare {self.V} @llvm.maxnum.v{LANES}{suffix}({self.V}, {self.V})",
                      f"declare {self.V} @llvm.rint.v{LANES}{suffix}({self.V})",
                      "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"]
        self.suffix, self.itemsize = suffix, np.dtype(dtype).itemsize
        self.width, self.lane0 = LANES, 0  # vectors of `width` lanes from lane `lane0` of each slot (``half``)
        self._n = itertools.count()
        self._opaque = {}
        self._block = None
        #: The job whose outputs a block kernel writes: its loop's index, unless the loop visits jobs in another
        #: order (``_grid_job``'s blocked grids).
        self.job = "%blk.i"

    def tmp(self) -> str:
        return f"%r{next(self._n)}"

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def label(self, name: str) -> None:
        self.lines.append(f"{name}:")
        self._block = name

    def opaque(self, pointer: str) -> str:
        r = self.tmp()
        self.emit(opaque(r, pointer))
        return r

    def fma(self, a: str, b: str, c: str) -> str:
        r = self.tmp()
        self.emit(f"{r} = call {self.V} @{self.fma_name}({self.V} {a}, {self.V} {b}, {self.V} {c})")
        return r

    def mul(self, a: str, b: str) -> str:
        r = self.tmp()
        self.emit(f"{r} = fmul {self.V} {a}, {b}")
        return r

    def add(self, a: str, b: str) -> str:
        r = self.tmp()
        self.emit(f"{r} = fadd {self.V} {a}, {b}")
        return r

    def gep_i64(self, base: str, offset) -> str:
        r = self.tmp()
        self.emit(f"{r} = getelementptr i64, ptr {base}, i64 {offset}")
        return r

    def gep(self, base: str, offset) -> str:
        r = self.tmp()
        self.emit(f"{r} = getelementptr {self.ty}, ptr {base}, i64 {offset}")
        return r

    def affine(self, index, scale: int, add: int = 0):
        """index·scale + add: a constant if ``index`` is one, else an i64 value (a runtime loop's index)."""
        if isinstance(index, int):
            return index * scale + add
        r = self.tmp()
        self.emit(f"{r} = mul i64 {index}, {scale}")
        if add:
            a = self.tmp()
            self.emit(f"{a} = add i64 {r}, {add}")
            r = a
        return r

    def load(self, base: str, slot) -> str:
        """The vector at ``base`` + slot·LANES scalars (``slot`` a constant or an i64 value; within :meth:`half`,
        its half)."""
        p, r = self.gep(base, self.affine(slot, LANES, self.lane0)), self.tmp()
        self.emit(f"{r} = load {self.V}, ptr {p}, align 4")
        return r

    def store(self, value: str, base: str, slot) -> None:
        p = self.gep(base, self.affine(slot, LANES, self.lane0))
        self.emit(f"store {self.V} {value}, ptr {p}, align 4")

    def prefetch(self, base: str, slots: int) -> None:
        """Prefetches (for reading, into every cache level) the cache lines of ``slots`` vectors from ``base``."""
        size = LANES * self.itemsize
        for line in range(0, slots * size, 64):
            p = self.tmp()
            self.emit(f"{p} = getelementptr i8, ptr {base}, i64 {line}")
            self.emit(f"call void @llvm.prefetch.p0(ptr {p}, i32 0, i32 3, i32 1)")

    def splat(self, scalar: str) -> str:
        i, r = self.tmp(), self.tmp()
        self.emit(f"{i} = insertelement {self.V} undef, {self.ty} {scalar}, i32 0")
        self.emit(f"{r} = shufflevector {self.V} {i}, {self.V} undef, <{self.width} x i32> zeroinitializer")
        return r

    @contextlib.contextmanager
    def half(self, h: int):
        """Within it, vectors are the lanes h·HALF … (h + 1)·HALF − 1 of each slot (HALF lanes: one AVX2 register
        of float32, where a LANES vector takes two): every load, store and operation of the code emitted inside,
        the same operations on half the lanes. A loop over the lanes' two halves so written keeps twice the values
        in registers. (``_readout_ir._SubVectors`` indexes such sub-vectors explicitly, for register tiles.)"""
        saved = self.V, self.fma_name, self.width, self.lane0
        self.V, self.fma_name = f"<{HALF} x {self.ty}>", f"llvm.fma.v{HALF}{self.suffix}"
        declare = f"declare {self.V} @{self.fma_name}({self.V}, {self.V}, {self.V})"
        if declare not in self.lines:  # (``_readout_ir._SubVectors`` may have declared it)
            self.lines.insert(0, declare)
        self.width, self.lane0 = HALF, h * HALF
        try:
            yield
        finally:
            self.V, self.fma_name, self.width, self.lane0 = saved

    def half_of(self, vector: str, h: int) -> str:
        """Lanes h·HALF … (h + 1)·HALF − 1 of a LANES vector (its types written out: the same inside :meth:`half`
        and outside it)."""
        r = self.tmp()
        mask = ", ".join(f"i32 {h * HALF + i}" for i in range(HALF))
        self.emit(f"{r} = shufflevector <{LANES} x {self.ty}> {vector}, <{LANES} x {self.ty}> undef, "
                  f"<{HALF} x i32> <{mask}>")
        return r

    def weight(self, W: str, D: int, e, f, *, opaque: bool = True) -> str:
        """W[e, f] broadcast, read in the current block through an opaque copy of W (not hoisted, not spilled);
        e or f may be an i64 value (a runtime loop's index). ``opaque=False`` reads W itself where e or f is a
        loop's index (an address that moves with the loop cannot be hoisted out of it; at constant e and f the
        opaque copy stays)."""
        if not opaque and not (isinstance(e, int) and isinstance(f, int)):
            base = W
        else:
            key = (W, self._block)
            if key not in self._opaque:
                self._opaque[key] = self.opaque(W)
            base = self._opaque[key]
        if isinstance(e, int) and isinstance(f, int):
            offset = e * D + f
        elif isinstance(f, int):
            offset = self.affine(e, D, f)
        elif isinstance(e, int):
            base, offset = self.gep(base, e * D), f  # e constant, f a value
        else:
            base, offset = self.gep(base, self.affine(e, D)), f
        p, s = self.gep(base, offset), self.tmp()
        self.emit(f"{s} = load {self.ty}, ptr {p}")
        return self.splat(s)

    def dot(self, ws, xs, start: str | None = None) -> str:
        """start + Σ_i ws_i xs_i as a chain of FMAs from the left (the numba kernels' contraction order)."""
        acc = start
        for w, x in zip(ws, xs):
            acc = self.mul(w, x) if acc is None else self.fma(w, x, acc)
        return acc

    def dots(self, chains, group: int = 16) -> list[str]:
        """[:meth:`dot` (ws, xs, start) for each chain], the same FMAs chain by chain (the same bits), emitted
        interleaved by ``group`` chains at a time: their independent FMAs side by side in the instruction stream
        instead of one chain's dependent FMAs back to back."""
        out = []
        for g0 in range(0, len(chains), group):
            part = chains[g0:g0 + group]
            accs = [start for _, _, start in part]
            for i in range(max(len(ws) for ws, _, _ in part)):
                for r, (ws, xs, _) in enumerate(part):
                    if i < len(ws):
                        accs[r] = self.mul(ws[i], xs[i]) if accs[r] is None else self.fma(ws[i], xs[i], accs[r])
            out += accs
        return out

    def lane_sum(self, vector: str, base: str, offset) -> None:
        """Stores at base[offset] the sum of the vector's lanes, in lane order and in double (as the numba
        kernels' ``acc = 0.0`` loops)."""
        acc = "0.0"
        for b in range(LANES):
            x = self.tmp()
            self.emit(f"{x} = extractelement {self.V} {vector}, i32 {b}")
            if self.ty == "float":
                xd = self.tmp()
                self.emit(f"{xd} = fpext float {x} to double")
                x = xd
            a = self.tmp()
            self.emit(f"{a} = fadd double {acc}, {x}")
            acc = a
        if self.ty == "float":
            r = self.tmp()
            self.emit(f"{r} = fptrunc double {acc} to float")
            acc = r
        self.emit(f"store {self.ty} {acc}, ptr {self.gep(base, offset)}")

    def lane_sums(self, vectors: list[str], base: str, offset) -> None:
        """base[offset + i] = :meth:`lane_sum` of ``vectors[i]`` (the same sums in the same order: the same bits),
        four at a time in a vector of doubles: for each four lanes of the four vectors, their values widened to
        double and transposed (4 × 4: a vector per lane, holding the four sums' values), then added to the four
        sums lane after lane. With AVX2 this is about 270 instructions for 16 sums, where transposing the 16 vectors
        16 × 16 in float32 needs about 430, 100 of them spills."""
        D4 = "<4 x double>"
        for g0 in range(0, len(vectors), 4):
            group = list(vectors[g0:g0 + 4])
            n = len(group)
            group += [group[-1]] * (4 - n)  # (sums not stored)
            acc = "zeroinitializer"  # 0.0 + x_0 + x_1 + …, as lane_sum
            for c in range(0, LANES, 4):
                quad = []
                for v in group:
                    x = self.tmp()
                    self.emit(f"{x} = shufflevector {self.V} {v}, {self.V} undef, <4 x i32> "
                              f"<i32 {c}, i32 {c + 1}, i32 {c + 2}, i32 {c + 3}>")
                    if self.ty == "float":
                        y = self.tmp()
                        self.emit(f"{y} = fpext <4 x float> {x} to {D4}")
                        x = y
                    quad.append(x)

                def shuffle(a, b, mask):
                    r = self.tmp()
                    self.emit(f"{r} = shufflevector {D4} {a}, {D4} {b}, <4 x i32> "
                              f"<{', '.join(f'i32 {m}' for m in mask)}>")
                    return r

                t0, t1 = shuffle(quad[0], quad[1], (0, 4, 2, 6)), shuffle(quad[0], quad[1], (1, 5, 3, 7))
                t2, t3 = shuffle(quad[2], quad[3], (0, 4, 2, 6)), shuffle(quad[2], quad[3], (1, 5, 3, 7))
                for lane in (shuffle(t0, t2, (0, 1, 4, 5)), shuffle(t1, t3, (0, 1, 4, 5)),
                             shuffle(t0, t2, (2, 3, 6, 7)), shuffle(t1, t3, (2, 3, 6, 7))):  # lanes c … c + 3
                    a = self.tmp()
                    self.emit(f"{a} = fadd {D4} {acc}, {lane}")
                    acc = a
            if self.ty == "float":
                r = self.tmp()
                self.emit(f"{r} = fptrunc {D4} {acc} to <4 x float>")
                acc = r
            p = self.gep(base, offset if g0 == 0 else self._offset(offset, g0))
            if n == 4:
                self.emit(f"store <4 x {self.ty}> {acc}, ptr {p}, align 4")
            else:
                for i in range(n):
                    x = self.tmp()
                    self.emit(f"{x} = extractelement <4 x {self.ty}> {acc}, i32 {i}")
                    self.emit(f"store {self.ty} {x}, ptr {self.gep(p, i)}")

    def lane_sums_loop(self, src: str, n: int, base: str) -> None:
        """base[i] = the sum of the lanes of vector i of ``src`` (i < n), as :meth:`lane_sums`: four sums an
        iteration of a runtime loop, the rest after it (a gated backward's ≈ 800 sums at D = 16 as straight-line code
        would be ≈ 15 thousand instructions; the loop keeps its code about 2 thousand)."""
        full = n - n % 4
        if full:
            name = f"ls{next(self._n)}"
            self.emit(f"br label %{name}")
            _loop_head(self, name, self._block, f"{name}.body", "0", 4, str(full))
            i = f"%{name}.i"
            self.lane_sums([self.load(src, self.affine(i, 1, k)) for k in range(4)], base, i)
            self.emit(f"br label %{name}")
            self.label(f"{name}.done")
        if full < n:
            self.lane_sums([self.load(src, k) for k in range(full, n)], base, full)

    def _offset(self, offset, add: int) -> str:
        if isinstance(offset, int):
            return str(offset + add)
        r = self.tmp()
        self.emit(f"{r} = add i64 {offset}, {add}")
        return r

    def text(self) -> str:
        return "\n".join(self.lines + ["}"])


#: Tokens per chunk of the weight gradients' sums (backward_ir): a chunk's tokens (W_CHUNK · D vectors) stay in L1
#: while every tile of rows sums them.
W_CHUNK = 16


def acc_vectors(D: int) -> int:
    """Vectors of backward_ir's scratch ACC: S (or E) and X (2D²), later the weight gradients' accumulators
    (3D² + D)."""
    return max(2 * D * D, 3 * D * D + D)


#: Outputs of the backward's token cotangent z̄_t an iteration of its loop (``_units_loop``): its chains are long
#: (D or 2D FMAs), so one alone would wait on each FMA's latency.
Z_UNITS = 4


#: Columns of S_t (E_t) a rows loop of the backward's passes updates, its q̄_t (k̄_t) entries carried in registers:
#: all D carried spill with AVX2 (16 registers of 8 float32; a LANES vector of 16 takes two), so 2 columns there.
#: With AVX-512 (``wide_registers``: 32 registers, a LANES vector in one) 4 columns fit; all of them spill again.
#: gating's half vectors: ``HALF_LANES``.
STATE_COLUMNS = 4 if wide_registers() else 2


def _slices(D: int, halves: bool = False) -> list[tuple[int, int]]:
    """The column slices [j0, j1) of the backward's rows loops (``STATE_COLUMNS`` wide, ``HALF_COLUMNS`` when the
    loops run on half vectors; the last narrower)."""
    c = HALF_COLUMNS if halves else STATE_COLUMNS
    return [(j0, min(D, j0 + c)) for j0 in range(0, D, c)]


#: Whether the gated backward's rows loops (both passes) run on half vectors (``_Builder.half``: 8 lanes, one AVX2
#: register), each slice of columns a loop per half, ``HALF_COLUMNS`` columns a slice: the same operations per
#: lane, in the same order (the same bits; tested). Half the registers per value, so the slices are wider (with
#: AVX2). With AVX-512 a LANES vector is one register and the loops run on whole vectors, ``STATE_COLUMNS``
#: columns a slice.
HALF_LANES = not wide_registers()
HALF_COLUMNS = 4


#: Vectors per token of the gated backward's scratch DA: ā_t, and g_t, 1 − g_t from pass 1 for pass 2.
DA_SLOTS = 3


#: A weight-gradient tile of ``backward_ir``'s sums W̄_i[e, f] = Σ_t ḡ_{i,t}[e] z_t[f]: W_ROWS rows e × W_COLUMNS
#: columns f, their accumulators in registers over a chunk's tokens. With AVX2 (16 registers of 8 float32, two per
#: LANES vector) 1 × 6 keeps its accumulators and operands in registers; larger tiles (2 × 16: 32 accumulators)
#: spill.
W_ROWS = 1
W_COLUMNS = 6


def _gates(ir: _Builder, z, D: int):
    """(g, 1 − g) = (φ(a), φ(−a)) of a = w_gᵀ z, as the numba kernels compute them (from x = e^{−|a|}: no
    overflow): g = 1/(1 + x) where a ≥ 0, else x/(1 + x)."""
    V, sfx = ir.V, ir.suffix
    a = ir.dot([ir.weight("%wg", D, 0, f) for f in range(D)], z)
    r = [ir.tmp() for _ in range(8)]
    ir.emit(f"{r[0]} = call {V} @llvm.fabs.v{LANES}{sfx}({V} {a})")
    ir.emit(f"{r[1]} = fneg {V} {r[0]}")
    if ir.ty == "float" and INLINE_EXPF:  # glibc's expf inline: no 16 calls
        r[2] = _expf_glibc(ir, r[1])
    else:
        ir.emit(f"{r[2]} = call {V} @llvm.exp.v{LANES}{sfx}({V} {r[1]})")
    one = ir.splat("1.0")
    ir.emit(f"{r[3]} = fadd {V} {one}, {r[2]}")
    ir.emit(f"{r[4]} = fdiv {V} {one}, {r[3]}")
    ir.emit(f"{r[5]} = fmul {V} {r[2]}, {r[4]}")
    ir.emit(f"{r[6]} = fcmp oge {V} {a}, zeroinitializer")
    ir.emit(f"{r[7]} = select <{LANES} x i1> {r[6]}, {V} {r[4]}, {V} {r[5]}")
    sm = ir.tmp()
    ir.emit(f"{sm} = select <{LANES} x i1> {r[6]}, {V} {r[5]}, {V} {r[4]}")
    return r[7], sm


#: Whether the float32 kernels' scalar gates compute glibc's expf inline (:func:`_expf_glibc`; the same bits) or
#: call it per lane (``llvm.exp``): inline, a vector's 16 exponentials are one vector computation instead of 16
#: calls.
INLINE_EXPF = True


def _sub(ir: _Builder, a: str, b: str) -> str:
    r = ir.tmp()
    ir.emit(f"{r} = fsub {ir.V} {a}, {b}")
    return r


def _loop_head(ir: _Builder, name: str, entry: str, latch: str, start: str, step: int, bound: str) -> str:
    """Opens the block ``name`` of a loop over %name from ``start`` by ``step`` (< bound, or ≥ 0 going down);
    returns the label of its body (the caller emits the body, then ``br label %name``)."""
    ir.label(name)
    ir.emit(f"%{name}.i = phi i64 [{start}, %{entry}], [%{name}.n, %{latch}]")
    cond = f"icmp slt i64 %{name}.i, {bound}" if step > 0 else f"icmp sge i64 %{name}.i, 0"
    ir.emit(f"%{name}.c = {cond}")
    ir.emit(f"br i1 %{name}.c, label %{name}.body, label %{name}.done")
    ir.label(f"{name}.body")
    ir.emit(f"%{name}.n = add i64 %{name}.i, {step}")
    return f"{name}.body"


def _rows_loop(ir: _Builder, name: str, entry: str, n, init: list[str], body, *, start="0",
               vector: str | None = None) -> list[str]:
    """A loop over rows e = start..n-1 (not unrolled; ``start`` and ``n`` constants or i64 values) entered from
    the block ``entry``, carrying the vectors ``init`` (of type ``vector``, None for the builder's) in phis:
    ``body(e, carried)`` emits one row's straight-line IR (``e`` = %{name}.i, an i64 value) and returns the carried
    vectors' next values. Returns the carried vectors after the last row; ends in the block ``name.done``. A
    row's operations stay together: unrolled, LLVM's scheduler moved every row's state update ahead of the
    accumulations that consume it and spilled the state to the stack."""
    V = ir.V if vector is None else vector
    ir.emit(f"br label %{name}")
    ir.label(name)
    ir.emit(f"%{name}.i = phi i64 [{start}, %{entry}], [%{name}.n, %{name}.body]")
    carried = [f"%{name}.c{i}" for i in range(len(init))]
    at = len(ir.lines)
    ir.emit(f"%{name}.c = icmp slt i64 %{name}.i, {n}")
    ir.emit(f"br i1 %{name}.c, label %{name}.body, label %{name}.done")
    ir.label(f"{name}.body")
    ir.emit(f"%{name}.n = add i64 %{name}.i, 1")
    new = body(f"%{name}.i", carried)
    ir.emit(f"br label %{name}")
    ir.lines[at:at] = [f"  {c} = phi {V} [{a}, %{entry}], [{b}, %{name}.body]" for c, a, b in zip(carried, init, new)]
    ir.label(f"{name}.done")
    return carried


def _units_loop(ir: _Builder, name: str, n: int, per: int, body) -> None:
    """Units u = 0..n-1 of straight-line IR, ``per`` units an iteration of a runtime loop (not unrolled), the
    last n mod per after it with constant indices: ``body(units)`` emits the IR of the units (i64 values or
    constants) in the current block. Ends in a block of its own (``name.done`` or the tail's).

    Why loops: on some hosts straight-line code beyond a few hundred instructions runs at a fraction of the rate
    of the same FMAs in a small loop, while a tight FMA loop keeps its speed; the layers' projections unrolled are
    3D² FMAs of straight-line code. Looped, they give the same bits."""
    full = n - n % per
    if full:
        entry = ir._block
        ir.emit(f"br label %{name}")
        _loop_head(ir, name, entry, f"{name}.latch", "0", per, str(full))
        body([ir.affine(f"%{name}.i", 1, r) for r in range(per)])
        ir.emit(f"br label %{name}.latch")
        ir.label(f"{name}.latch")  # the body may end in a block of its own (a loop inside)
        ir.emit(f"br label %{name}")
        ir.label(f"{name}.done")
    if full < n:
        body(list(range(full, n)))


def _projections(ir: _Builder, name: str, zp: str, out: str, D: int) -> None:
    """q_t, k_t, v_t = W z_t for W = W_Q, W_K, W_V (chains over f from the left, as the numba kernels) into
    out's slots i·D + e: ``PROJECTION_ROWS`` rows e of the three an iteration of a loop over the rows
    (``_units_loop``), their terms f an inner loop (``_inner_chains``), z_t[f] read from zp once per term, the
    weights read directly (their addresses move with e and f)."""

    def rows(units):
        ws = [(e, i, W) for e in units for i, W in enumerate(("%WQ", "%WK", "%WV"))]

        def terms(f):
            zf = ir.load(zp, f)
            return [[(ir.weight(W, D, e, f, opaque=False), zf)] for e, _, W in ws]

        res = _inner_chains(ir, f"{name}.f", D, [None] * len(ws), terms)
        for (e, i, _), x in zip(ws, res):
            ir.store(x, out, ir.affine(e, 1, i * D))

    _units_loop(ir, name, D, PROJECTION_ROWS, rows)


#: Rows e of q_t, k_t and v_t an iteration of :func:`_projections`' loop: 2 rows are 12 register chains of FMAs
#: (6 with one row: each iteration waits on an FMA's latency). The weights and z_t are read directly, not through
#: opaque copies, which cost a register move per operand and fill the front end's dispatch width. The same bits.
PROJECTION_ROWS = 2


def _inner_chains(ir: _Builder, name: str, n: int, starts: list, terms) -> list[str]:
    """Chains c_r = start_r + Σ_{u < n} Σ_(w, x) ∈ terms(u)[r] w·x, the products of each u in order (a dot from
    the left: the first product a multiply when start_r is None), the terms u ≥ 1 a runtime loop carrying the
    chains (``_rows_loop``; u an i64 value there). A loop of a few FMAs per chain instead of n unrolled: see
    :func:`_units_loop`."""

    def step(u, accs):
        out = []
        for acc, products in zip(accs, terms(u)):
            for w, x in products:
                acc = ir.mul(w, x) if acc is None else ir.fma(w, x, acc)
            out.append(acc)
        return out

    first = step(0, starts)
    if n == 1:
        return first
    return _rows_loop(ir, f"{name}{len(ir.lines)}", ir._block, n, first, step, start="1")


#: The extra arguments of a kernel whose input tokens are gathered (``gathered=True``): the positions P (int64) and
#: Z's tokens per block TZ.
_GATHER_ARGS = ", ptr noalias %P, i64 %TZ"


def _gathered_token(ir: _Builder, D: int, loop: str) -> str:
    """The pointer to token P[t] (t = %{loop}.i) of block %blk.i of Z (blocks, TZ, D, LANES)."""
    ir.emit(f"%{loop}.pp = getelementptr i64, ptr %P, i64 %{loop}.i")
    ir.emit(f"%{loop}.pt = load i64, ptr %{loop}.pp")
    ir.emit(f"%{loop}.zb = mul i64 %blk.i, %TZ")
    ir.emit(f"%{loop}.zt = add i64 %{loop}.zb, %{loop}.pt")
    ir.emit(f"%{loop}.zo = mul i64 %{loop}.zt, {D * LANES}")
    return ir.gep("%Z", f"%{loop}.zo")


def forward_ir(D: int, residual: bool, dtype, gated: bool = False, gathered: bool = False, kept: bool = False) -> str:
    """IR of ``forward(Z, WQ, WK, WV, lam, O, T, first, stop)``: O = the layer's outputs for blocks [first, stop)
    of Z (blocks, T, D, LANES). ``gated``: ``lam`` is w_g (D,), and S_t = g_t S_{t-1} + v_t k_tᵀ with
    g_t = φ(w_gᵀ z_t). The state S (D² vectors) lives on the stack, a token's rows updated one loop iteration
    each (``_rows_loop``) with q_t, k_t read from the stack as memory operands: carried by the token loop's phis
    instead, LLVM spilled most of it (≈ 1000 stack loads and stores a token at D = 16).

    ``gathered``: two more arguments, ``(…, first, stop, P, TZ)``: the layer's input token t is token P[t] (int64)
    of Z (blocks, TZ, D, LANES), so that models reading subsequences of one prompt share its blocked copy
    (:func:`_gathered_token`).

    ``kept``: one more argument after O, ``(…, O, R, T, …)``: q_t, k_t, v_t of every block and token written to R
    (blocks, T, 3, D, LANES), which :func:`backward_ir` with ``kept`` reads instead of computing them again."""
    ir = _Builder(dtype)
    decay_arg = "ptr noalias %wg" if gated else f"{ir.ty} %lam"
    kept_arg = ", ptr noalias %R" if kept else ""
    ir.lines.append(f"define void @forward(ptr noalias %Z, ptr noalias %WQ, ptr noalias %WK, ptr noalias %WV, "
                    f"{decay_arg}, ptr noalias %O{kept_arg}, i64 %T, i64 %first, i64 %stop"
                    f"{_GATHER_ARGS if gathered else ''}) {{")
    ir.label("entry")
    ir.emit(f"%S = alloca {ir.V}, i64 {D * D}, align 64")
    ir.emit(f"%QK = alloca {ir.V}, i64 {3 * D}, align 64")  # q_t, k_t, v_t
    lam = None if gated else ir.splat("%lam")
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "t.done", "%first", 1, "%stop")
    ir.emit("%base = mul i64 %blk.i, %T")
    for i in range(D * D):
        ir.store("zeroinitializer", "%S", i)
    ir.emit("br label %t")
    _loop_head(ir, "t", "blk.body", "fr.done", "0", 1, "%T")
    ir.emit(f"%off = mul i64 %t.i, {D * LANES}")
    ir.emit(f"%boff = mul i64 %base, {D * LANES}")
    ir.emit("%toff = add i64 %boff, %off")
    zp = _gathered_token(ir, D, "t") if gathered else ir.gep("%Z", "%toff")
    op = ir.gep("%O", "%toff")
    z = [ir.load(zp, f) for f in range(D)]
    decay = _gates(ir, z, D)[0] if gated else lam
    if kept:  # this token's q_t, k_t, v_t in R ((blk·T + t)·3D vectors on), where the backward reads them
        ir.emit("%roff = mul i64 %toff, 3")
        qkv = ir.gep("%R", "%roff")
    else:
        qkv = "%QK"
    _projections(ir, "pj", zp, qkv, D)

    def row(e, _):  # S_t[e] = g_t S_{t-1}[e] + v_t[e] k_t, o_t[e] = [z_t[e] +] S_t[e]·q_t
        ir.emit(f"%fr.so = mul i64 {e}, {D * LANES}")
        ir.emit(f"%fr.vo = mul i64 {e}, {LANES}")
        qk, Sr = ir.opaque(qkv), ir.gep("%S", "%fr.so")
        ve = ir.load(ir.gep(qk, "%fr.vo"), 2 * D)
        acc = ir.load(ir.gep(zp, "%fr.vo"), 0) if residual else None
        for j in range(D):
            s = ir.fma(ve, ir.load(qk, D + j), ir.mul(decay, ir.load(Sr, j)))
            ir.store(s, Sr, j)
            acc = ir.mul(s, ir.load(qk, j)) if acc is None else ir.fma(s, ir.load(qk, j), acc)
        ir.store(acc, ir.gep(op, "%fr.vo"), 0)
        return []

    _rows_loop(ir, "fr", ir._block, D, [], row)
    ir.emit("br label %t")
    ir.label("t.done")
    ir.emit("br label %blk")
    ir.label("blk.done")
    ir.emit("ret void")
    return ir.text()


def backward_ir(D: int, residual: bool, grad_z: bool, grad_lam: bool, dtype, gated: bool = False,
                gathered: bool = False, kept: bool = False) -> str:
    """IR of ``backward(Z, WQ, WK, WV, lam, dO, dZ, dW, dlam, QKV, G, ACC, T, first, stop)`` for blocks
    [first, stop): dZ (blocks, T, D, LANES) the input cotangent (if ``grad_z``; [dO +] W_Qᵀq̄ + W_Kᵀk̄ + W_Vᵀv̄),
    dW[blk] (3, D, D) the block's W̄_Q, W̄_K, W̄_V, dlam[blk] its λ̄ (0 unless ``grad_lam``). Scratch of one
    thread: QKV and G (T, 3, D, LANES) (q, k, v and q̄, k̄, v̄ per token), ACC (``acc_vectors(D)``, LANES) (S or E,
    and X; then the weight gradients' accumulators between chunks of tokens).

    ``gated`` (residual only; ``gated``'s scalar-gated layer, g_t = φ(a_t), a_t = w_gᵀ z_t): ``backward(Z, WQ,
    WK, WV, wg, O, dO, dZ, dW, dwg, QKV, G, DA, ACC, T, first, stop)`` with O the forward's outputs, DA (T, 3, LANES)
    scratch (ā_t, and g_t, 1 − g_t kept from pass 1 for pass 2, so that pass 2 does not compute them again; the
    same bits); E_t = g_{t+1} E_{t+1} + ō_t q_tᵀ, and the gates through the cumulative log gates
    (``gated._gated_layer_source``):
    R_t = Σ_{u≥t} (ō_u·(o_u − z_u) − k_u·k̄_u) (ō_u·(o_u − z_u) as q_u·q̄_u after pass 1: :data:`Q_DOT_R`),
    ā_t = (1 − g_t) R_t, w̄_g = Σ_t ā_t z_t, z̄_t += ā_t w_g; dwg[blk] (D) the block's w̄_g.

    ``gathered`` (without ``grad_z``: the first layer, which reads data): Z read at positions, as in
    :func:`forward_ir` (the arguments P, TZ last); O, dO and the scratch keep the layer's T tokens.

    A gated layer without ``grad_z`` (a first layer) runs pass 2 alone, through F_t in E_t's place
    (:data:`ONE_PASS_FIRST_LAYER`): G's q̄_t slots hold m_t = F_tᵀ v_t (p_t = W_Qᵀ k_t before it), and W̄_Q's tiles
    sum k_t m_tᵀ.

    ``kept``: QKV is not scratch but the q_t, k_t, v_t of every block and token (blocks, T, 3, D, LANES) that
    :func:`forward_ir` with ``kept`` wrote (the same FMAs in the same order: the same values), so pass 1 does not
    compute them again (3D² of the backward's ≈ 16D² vector operations a token)."""
    if gated and (grad_lam or not residual):
        raise ValueError("the gated layer kernels are residual and have no λ")
    if gathered and grad_z:
        raise ValueError("gathered tokens are data: they take no cotangent")
    extra = _GATHER_ARGS if gathered else ""
    ir = _Builder(dtype)
    zero = "zeroinitializer"
    if gated:
        ir.lines.append(f"define void @backward(ptr noalias %Z, ptr noalias %WQ, ptr noalias %WK, ptr noalias %WV, "
                        f"ptr noalias %wg, ptr noalias %O, ptr noalias %dO, ptr noalias %dZ, ptr noalias %dW, "
                        f"ptr noalias %dlam, ptr noalias %QKV, ptr noalias %G, "
                        f"ptr noalias %DA, ptr noalias %ACC, i64 %T, i64 %first, i64 %stop{extra}) {{")
    else:
        ir.lines.append(f"define void @backward(ptr noalias %Z, ptr noalias %WQ, ptr noalias %WK, ptr noalias %WV, "
                        f"{ir.ty} %lam, ptr noalias %dO, ptr noalias %dZ, ptr noalias %dW, ptr noalias %dlam, "
                        f"ptr noalias %QKV, ptr noalias %G, ptr noalias %ACC, i64 %T, i64 %first, "
                        f"i64 %stop{extra}) {{")
    DD = D * D
    ir.label("entry")
    lam = None if gated else ir.splat("%lam")
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "sum.done", "%first", 1, "%stop")
    ir.emit("%boff = mul i64 %blk.i, %T")
    ir.emit(f"%base = mul i64 %boff, {D * LANES}")
    for i in range((1 if gated else 2) * DD):  # S, and X for λ̄
        ir.store(zero, "%ACC", i)
    one_pass = gated and not grad_z and ONE_PASS_FIRST_LAYER
    if one_pass:  # F zeroed with S above
        ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("br label %p2" if one_pass else "br label %p1")

    def token_pointers(loop):
        ir.emit(f"%{loop}.off = mul i64 %{loop}.i, {DA_SLOTS * LANES}")  # DA's offset (ā_t, g_t, 1 − g_t)
        ir.emit(f"%{loop}.zoff = mul i64 %{loop}.i, {D * LANES}")
        ir.emit(f"%{loop}.toff = add i64 %base, %{loop}.zoff")
        ir.emit(f"%{loop}.soff = mul i64 %{loop}.i, {3 * D * LANES}")
        if kept:  # the forward's q_t, k_t, v_t: (blk·T + t)·3D vectors into QKV
            ir.emit(f"%{loop}.koff = mul i64 %{loop}.toff, 3")
        zp = _gathered_token(ir, D, loop) if gathered else ir.gep("%Z", f"%{loop}.toff")
        return (zp, ir.gep("%dO", f"%{loop}.toff"), ir.gep("%dZ", f"%{loop}.toff"),
                ir.gep("%QKV", f"%{loop}.koff" if kept else f"%{loop}.soff"), ir.gep("%G", f"%{loop}.soff"))

    if not one_pass:
        _two_pass_first(ir, D, residual, grad_z, gated, kept, lam, token_pointers)
    _pass2(ir, D, grad_z, grad_lam, gated, kept, one_pass, lam, token_pointers, "blk.body" if one_pass else "p1.done")
    _weight_gradient_sums(ir, D, gated, grad_lam, one_pass, token_pointers)
    ir.emit("br label %sum.done")
    ir.label("sum.done")
    ir.emit("br label %blk")
    ir.label("blk.done")
    ir.emit("ret void")
    return ir.text()


#: Whether a gated first layer (no z̄: its tokens are data) runs its backward in one pass, t descending, through
#: F_t = Σ_{u≥t} Γ(t, u) ō_u z_uᵀ = g_{t+1} F_{t+1} + ō_t z_tᵀ (Γ(t, u) = g_{t+1}⋯g_u) instead of E_t: E_t = F_t W_Qᵀ,
#: so with m_t = F_tᵀ v_t and p_t = W_Qᵀ k_t, k̄_t = E_tᵀ v_t = W_Q m_t, v̄_t = E_t k_t = F_t p_t and
#: W̄_Q = Σ_t q̄_t z_tᵀ = Σ_t Σ_{s≤t} Γ(s, t) k_s v_sᵀ ō_t z_tᵀ = Σ_s k_s m_sᵀ. Pass 1 (S_t computed again and
#: q̄_t = S_tᵀ ō_t: 3 of the backward's 10 D² vector operations a token, and a sweep over the block's operands) is
#: gone; p_t and k̄_t cost D² each. Not the bits of the two passes (other sums): float64 agrees with the token-layout
#: kernels to 1e-12 and float32 as close to float64 as the two passes (tested). It saves most where a call's
#: operands come from L3 (many blocks a call); one block a call just after its forward (as the grid driver calls
#: it) has its operands in L2, where pass 1 is cheap. drift's layer keeps its two passes: there (D = 11) λ̄ needs
#: X^F_t = λ X^F_{t+1} + F_{t+1} on top, and the one pass is slower.
ONE_PASS_FIRST_LAYER = True


def _weight_products(ir: _Builder, name: str, D: int, x, out: str, offset: int, *, transposed: bool) -> None:
    """out[offset + u] = Σ_i W_Q[i, u] x(i) (``transposed``) or Σ_i W_Q[u, i] x(i), u = 0..D-1, each a chain over i
    from the left, ``Z_UNITS`` outputs an iteration (``_units_loop``); x(i) loads the i-th operand (i an i64 value
    or a constant)."""

    def outputs(units):
        def terms(i):
            xi = x(i)
            return [[(ir.weight("%WQ", D, i, u) if transposed else ir.weight("%WQ", D, u, i), xi)] for u in units]

        for u, acc in zip(units, _inner_chains(ir, f"{name}.i", D, [None] * len(units), terms)):
            ir.store(acc, out, ir.affine(u, 1, offset))

    _units_loop(ir, name, D, Z_UNITS, outputs)


def _two_pass_first(ir: _Builder, D: int, residual: bool, grad_z: bool, gated: bool, kept: bool, lam, token_pointers):
    """:func:`backward_ir`'s pass 1, t ascending: S_t, q̄_t = S_tᵀ ō_t, z̄_t = [ō_t +] W_Qᵀ q̄_t (and g_t, 1 − g_t
    kept in DA); ends in the block ``p1.done`` with E zeroed and %Tm1 = T − 1."""
    zero = "zeroinitializer"
    _loop_head(ir, "p1", "blk.body", "p1.latch", "0", 1, "%T")
    zp, dop, dzp, sp, gp = token_pointers("p1")
    z = [ir.load(zp, f) for f in range(D)]
    if gated:  # g_t and 1 − g_t kept for pass 2
        decay, sm = _gates(ir, z, D)
        ir.store(decay, ir.gep("%DA", "%p1.off"), 1)
        ir.store(sm, ir.gep("%DA", "%p1.off"), 2)
    else:
        decay = lam
    if not kept:
        _projections(ir, "p1j", zp, sp, D)

    # S_t's rows one loop iteration each (_rows_loop), over one slice of STATE_COLUMNS columns j at a time: k_t,
    # v_t[e], ō_t[e] read from memory, the slice's q̄_t[j] in the phis, stored after it
    halves = HALF_LANES and gated
    for j0, j1 in _slices(D, halves):
        def row(e, dq, j0=j0, j1=j1, decay=decay):
            so, vo = ir.affine(e, D * LANES), ir.affine(e, LANES)
            kv = ir.opaque(sp)  # not the registers the projections left: they would crowd q̄ out
            Sr = ir.gep("%ACC", so)
            ve, doe = ir.load(ir.gep(kv, vo), 2 * D), ir.load(ir.gep(dop, vo), 0)
            dq = list(dq)
            for n, j in enumerate(range(j0, j1)):
                s = ir.fma(ve, ir.load(kv, D + j), ir.mul(decay, ir.load(Sr, j)))
                ir.store(s, Sr, j)
                dq[n] = ir.fma(s, doe, dq[n])
            return dq

        for h in (0, 1) if halves else (None,):
            with ir.half(h) if halves else contextlib.nullcontext():
                body = row if h is None else functools.partial(row, decay=ir.half_of(decay, h))
                dq = _rows_loop(ir, f"p1r{j0}" + ("" if h is None else f"h{h}"), ir._block, D, [zero] * (j1 - j0),
                                body)
                for n, j in enumerate(range(j0, j1)):
                    ir.store(dq[n], gp, j)
    if grad_z:  # z̄_t[f] = [ō_t[f] +] Σ_e W_Q[e, f] q̄_t[e], Z_UNITS f a loop iteration, q̄_t read from memory

        def zbar(units):
            def terms(e):
                dq_e = ir.load(ir.opaque(gp), e)
                return [[(ir.weight("%WQ", D, e, f), dq_e)] for f in units]

            starts = [ir.load(dop, f) if residual else None for f in units]
            for f, x in zip(units, _inner_chains(ir, "p1z.e", D, starts, terms)):
                ir.store(x, dzp, f)

        _units_loop(ir, "p1z", D, Z_UNITS, zbar)
    ir.emit("br label %p1.latch")
    ir.label("p1.latch")
    ir.emit("br label %p1")
    ir.label("p1.done")
    for e in range(D):
        for j in range(D):
            ir.store(zero, "%ACC", e * D + j)
    ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("br label %p2")


#: Whether the gated backward's pass 2 (after pass 1) takes the gates' term ō_t·(o_t − z_t) = ō_t·S_t q_t of R_t as
#: q_t·q̄_t (q̄_t = S_tᵀ ō_t, in G from pass 1) rather than from the outputs: o_t − z_t subtracts the residual
#: stream from the layer's output, which cancels where the attention's part of o_t is small against z_t; and O is
#: not read again. At gating.fig2's init (10 seeds, against float64 at the same data) the middle layers' w̄_g
#: error is 1.2·10⁻⁴ of its largest entry against 1.8·10⁻⁴ from the outputs (a compensated sum of R_t on top: no
#: closer; XLA's float32 parallel form 2.3·10⁻⁵), and the backward reads less. The one-pass first layer has no q̄_t
#: and keeps the outputs form.
Q_DOT_R = True


def _pass2(ir: _Builder, D: int, grad_z: bool, grad_lam: bool, gated: bool, kept: bool, one_pass: bool, lam,
           token_pointers, entry: str):
    """:func:`backward_ir`'s pass 2, t descending, entered from the block ``entry``: E_t, k̄_t = E_tᵀ v_t,
    v̄_t = E_t k_t, z̄_t += W_Kᵀ k̄_t + W_Vᵀ v̄_t, λ̄ and the gates' ā_t. ``one_pass`` (a gated first layer, no z̄):
    F_t in E's place and no pass before it (:data:`ONE_PASS_FIRST_LAYER`)."""
    V, zero, DD = ir.V, "zeroinitializer", D * D
    halves = HALF_LANES and gated
    ir.label("p2")
    p2latch = "p2.latch"  # the token loop's last block
    ir.emit(f"%p2.i = phi i64 [%Tm1, %{entry}], [%p2.n, %{p2latch}]")
    ir.emit(";p2.phis")  # where the phis below go (a declaration inserted later moves indices)
    ir.emit("%p2.c = icmp sge i64 %p2.i, 0")
    ir.emit("br i1 %p2.c, label %p2.body, label %p2.done")
    ir.label("p2.body")
    ir.emit("%p2.n = sub i64 %p2.i, 1")
    zp, dop, dzp, sp, gp = token_pointers("p2")
    decay = lam
    if gated:  # E_t = g_{t+1} E_{t+1} + ō_t q_tᵀ (g_T = 0), and R's running sum (phis inserted below)
        # O_{t-1}'s lines prefetched: pass 2 runs down the tokens and O was last read in pass 1, so its first load
        # a token would miss the cache (the other streams gain nothing from a prefetch)
        if one_pass or not Q_DOT_R:
            ir.emit(f"%p2.pf = sub i64 %p2.toff, {D * LANES}")
            ir.prefetch(ir.gep("%O", "%p2.pf"), D)
        decay = "%gnext"
        if one_pass:  # g_t, 1 − g_t here (no pass 1 to keep them), q, k, v (unless kept) and p_t = W_Qᵀ k_t in G
            gt, sm = _gates(ir, [ir.load(zp, f) for f in range(D)], D)
            if not kept:
                _projections(ir, "p2j", zp, sp, D)
            _weight_products(ir, "p2p", D, lambda e: ir.load(ir.opaque(sp), ir.affine(e, 1, D)), gp, 0,
                             transposed=True)
        else:
            gt, sm = ir.load(ir.gep("%DA", "%p2.off"), 1), ir.load(ir.gep("%DA", "%p2.off"), 2)
    do = [ir.load(dop, f) for f in range(D)]

    # E_t's rows one loop iteration each, over one slice of STATE_COLUMNS columns j at a time: the slice's k̄_t[j]
    # in the phis (stored after it), v̄_t[e] = Σ_j E_t[e, j] k_t[j] (and λ̄'s row sum Σ_j X_t[e, j] k_t[j], in ACC's
    # slots 2D² + e) continued slice after slice in memory, λ̄'s sum over rows in the last slice's phis
    for j0, j1 in _slices(D, halves):
        last = j1 == D

        def row(e, carried, j0=j0, j1=j1, last=last, decay=decay):
            so, vo = ir.affine(e, D * LANES), ir.affine(e, LANES)
            rp = ir.opaque(sp)  # q_t, k_t as memory operands of this row's FMAs
            if one_pass:  # F_t = g_{t+1} F_{t+1} + ō_t z_tᵀ: z_t for q_t, p_t for k_t, m_t = F_tᵀ v_t for k̄_t
                zr, pr = ir.opaque(zp), ir.opaque(gp)
                q = [ir.load(zr, j) for j in range(j0, j1)]
                k = [ir.load(pr, j) for j in range(j0, j1)]
            else:
                q = [ir.load(rp, j) for j in range(j0, j1)]
                k = [ir.load(rp, D + j) for j in range(j0, j1)]
            ve, doe = ir.load(ir.gep(rp, vo), 2 * D), ir.load(ir.gep(dop, vo), 0)
            Er = ir.gep("%ACC", so)
            old = [ir.load(Er, j) for j in range(j0, j1)]
            dk = list(carried[:j1 - j0])
            out = []
            if grad_lam:
                Xr, x = ir.gep("%ACC", ir.affine(e, D * LANES, DD * LANES)), []
                for n, j in enumerate(range(j0, j1)):
                    x.append(ir.fma(lam, ir.load(Xr, j), old[n]))
                    ir.store(x[-1], Xr, j)
                xk = ir.dot(x, k, None if j0 == 0 else ir.load("%ACC", ir.affine(e, 1, 2 * DD)))
                if last:
                    out = [ir.fma(ve, xk, carried[-1])]
                else:
                    ir.store(xk, "%ACC", ir.affine(e, 1, 2 * DD))
            new = []
            for n, j in enumerate(range(j0, j1)):
                new.append(ir.fma(doe, q[n], ir.mul(decay, old[n])))
                ir.store(new[-1], Er, j)
                dk[n] = ir.fma(new[-1], ve, dk[n])
            vp = ir.gep(gp, vo)
            ir.store(ir.dot(new, k, None if j0 == 0 else ir.load(vp, 2 * D)), vp, 2 * D)  # v̄_t[e], so far
            return dk + out

        init = [zero] * (j1 - j0) + (["%gl"] if grad_lam and last else [])  # (halves: gated, no λ̄)
        for h in (0, 1) if halves else (None,):
            with ir.half(h) if halves else contextlib.nullcontext():
                body = row if h is None else functools.partial(row, decay=ir.half_of(decay, h))
                out = _rows_loop(ir, f"p2r{j0}" + ("" if h is None else f"h{h}"), ir._block, D, init, body)
                for n, j in enumerate(range(j0, j1)):  # (one pass: m_t[j] over p_t[j], read by this slice alone)
                    ir.store(out[n], gp, j if one_pass else D + j)
    gl = out[-1] if grad_lam else None
    if one_pass:  # k̄_t = W_Q m_t
        _weight_products(ir, "p2k", D, lambda f: ir.load(ir.opaque(gp), f), gp, D, transposed=False)
    gk = ir.opaque(gp)
    dk = [ir.load(gk, D + e) for e in range(D)]
    at = ir.lines.index("  ;p2.phis")
    if grad_lam:
        ir.lines.insert(at, f"  %gl = phi {V} [{zero}, %{entry}], [{gl}, %{p2latch}]")
    if gated:
        ir.lines[at:at] = [f"  %gnext = phi {V} [{zero}, %{entry}], [{gt}, %{p2latch}]",
                           f"  %R = phi {V} [{zero}, %{entry}], [%R.n, %{p2latch}]"]
    if gated:  # R_t = R_{t+1} + ō_t·(o_t − z_t) − k_t·k̄_t, ā_t = (1 − g_t) R_t; ō_t·(o_t − z_t) = q_t·q̄_t
        if one_pass or not Q_DOT_R:  # (one pass: no q̄_t)
            op = ir.gep("%O", "%p2.toff")
            oo = ir.dot(do, [_sub(ir, ir.load(op, f), ir.load(zp, f)) for f in range(D)])
        else:
            oo = ir.dot([ir.load(sp, j) for j in range(D)], [ir.load(gp, j) for j in range(D)])
        k = [ir.load(sp, D + j) for j in range(D)]
        ir.emit(f"%R.n = fadd {V} %R, {_sub(ir, oo, ir.dot(k, dk))}")
        da = ir.mul(sm, "%R.n")
        ir.store(da, ir.gep("%DA", "%p2.off"), 0)
    if grad_z:  # z̄_t[f] += [ā_t w_g[f] +] Σ_e (W_K[e, f] k̄_t[e] + W_V[e, f] v̄_t[e]), k̄_t, v̄_t from memory

        def zbar(units):
            def terms(e):
                gb = ir.opaque(gp)
                dk_e, dv_e = ir.load(gb, ir.affine(e, 1, D)), ir.load(gb, ir.affine(e, 1, 2 * D))
                return [[(ir.weight("%WK", D, e, f), dk_e), (ir.weight("%WV", D, e, f), dv_e)] for f in units]

            starts = [ir.mul(da, ir.weight("%wg", D, 0, f)) if gated else None for f in units]
            for f, acc in zip(units, _inner_chains(ir, "p2z.e", D, starts, terms)):
                ir.store(ir.add(ir.load(dzp, f), acc), dzp, f)

        _units_loop(ir, "p2z", D, Z_UNITS, zbar)
    ir.emit("br label %p2.latch")
    ir.label("p2.latch")
    ir.emit("br label %p2")
    ir.label("p2.done")


def _weight_gradient_sums(ir: _Builder, D: int, gated: bool, grad_lam: bool, one_pass: bool, token_pointers):
    """:func:`backward_ir`'s sums of a block's weight gradients after pass 2 (entered from ``p2.done``), written
    to dW[blk] and dlam[blk] (λ̄, or w̄_g)."""
    V, zero, DD = ir.V, "zeroinitializer", D * D
    # W̄_i[e, f] = Σ_t ḡ_{i,t}[e] z_t[f], in tiles of rows whose accumulators are the token loop's phis, over
    # chunks of W_CHUNK tokens: every tile of a chunk re-reads the chunk's z_t from L1 (not the whole block's from
    # L2), the accumulators kept in ACC between chunks (the same FMAs in the same order: the same bits)
    ir.emit(f"%wo = mul i64 %blk.i, {3 * DD}")
    wp = ir.gep("%dW", "%wo")
    if gated:
        ir.emit(f"%gwo = mul i64 %blk.i, {D}")
        gwp = ir.gep("%dlam", "%gwo")
    # ACC's slot of W̄_i[e, f]'s accumulator is ρ·D + f, ρ = i·D + e the row of ḡ_{i,t}[e] in the scratch G; w̄_g's
    # (from DA's ā_t) follow at 3D² + f. The first chunk's tiles start from zero, the others from ACC (zeroing ACC
    # first would be a memset of 50 kB a block at D = 16, a large part of a short prompt's backward)
    ir.emit("br label %wc")
    _loop_head(ir, "wc", "p2.done", "wc.latch", "0", W_CHUNK, "%T")
    ir.emit("%wc.first = icmp eq i64 %wc.i, 0")
    ir.emit("%wc.f = icmp slt i64 %wc.n, %T")
    ir.emit("%wc.end = select i1 %wc.f, i64 %wc.n, i64 %T")
    count = itertools.count()

    def tile(rhos, gate: bool = False, keys: bool = False):  # rows ρ (constants or values) over the chunk's tokens
        # (a runtime loop); ``keys`` (one pass): W̄_Q[e, f] = Σ_t k_t[e] m_t[f], rows ρ = e of k_t, columns of G's m_t
        for f0 in range(0, D, W_COLUMNS):  # each slice of columns a token loop of its own
            cols = range(f0, min(D, f0 + W_COLUMNS))
            name = f"w{next(count)}"
            slots = [[ir.affine(rho, D, f) for f in cols] for rho in rhos] if not gate else [
                [3 * DD + f for f in cols]]
            ir.emit(f"br i1 %wc.first, label %{name}.z, label %{name}.l")
            ir.label(f"{name}.l")
            start = [[ir.load("%ACC", slot) for slot in row] for row in slots]
            ir.emit(f"br label %{name}")
            ir.label(f"{name}.z")
            ir.emit(f"br label %{name}")
            ir.label(name)
            ir.emit(f"%{name}.i = phi i64 [%wc.i, %{name}.z], [%wc.i, %{name}.l], [%{name}.n, %{name}.body]")
            acc = [[f"%{name}.a{r}_{f}" for f in cols] for r in range(len(slots))]
            at = len(ir.lines)
            ir.emit(f"%{name}.c = icmp slt i64 %{name}.i, %wc.end")
            ir.emit(f"br i1 %{name}.c, label %{name}.body, label %{name}.done")
            ir.label(f"{name}.body")
            ir.emit(f"%{name}.n = add i64 %{name}.i, 1")
            zp, _, _, sp, gp = token_pointers(name)
            if gate:
                g = [ir.load(ir.gep("%DA", f"%{name}.off"), 0)]
            else:
                g = [ir.load(sp, ir.affine(rho, 1, D)) if keys else ir.load(gp, rho) for rho in rhos]
            new = []
            for r in range(len(slots)):
                zr = ir.opaque(gp if keys else zp)  # z_t (m_t) re-read per row: memory operands, the registers
                # left to the accumulators
                new.append([ir.fma(g[r], ir.load(zr, f), acc[r][n]) for n, f in enumerate(cols)])
            ir.emit(f"br label %{name}")
            ir.lines[at:at] = [f"  {acc[r][n]} = phi {V} [{zero}, %{name}.z], [{start[r][n]}, %{name}.l], "
                               f"[{new[r][n]}, %{name}.body]" for r in range(len(slots)) for n in range(len(cols))]
            ir.label(f"{name}.done")
            for r, row in enumerate(slots):
                for n, slot in enumerate(row):
                    ir.store(acc[r][n], "%ACC", slot)

    # the tiles of ρ = 0..3D-1 a runtime loop (as fast as the unrolled copies, and a fraction of the code to
    # compile), then w̄_g's
    if one_pass:
        _units_loop(ir, "wq", D, W_ROWS, functools.partial(tile, keys=True))
        _units_loop(ir, "wt", 2 * D, W_ROWS, lambda units: tile([ir.affine(u, 1, D) for u in units]))
    else:
        _units_loop(ir, "wt", 3 * D, W_ROWS, tile)
    if gated:
        tile([None], gate=True)
    ir.emit("br label %wc.latch")
    ir.label("wc.latch")
    ir.emit("br label %wc")
    ir.label("wc.done")
    ir.lane_sums_loop("%ACC", 3 * DD, wp)  # W̄_i[e, f]'s accumulator is ACC's slot (i·D + e)·D + f
    if gated:
        ir.lane_sums([ir.load("%ACC", 3 * DD + f) for f in range(D)], gwp, 0)
    if grad_lam:
        ir.lane_sum("%gl", "%dlam", "%blk.i")
    elif not gated:  # (gated: %dlam is dwg, written by its tile above)
        ir.emit(f"store {ir.ty} 0.0, ptr {ir.gep('%dlam', '%blk.i')}")


_SCRATCH = threading.local()


def _scratch(slot: int, shape, dtype) -> int:
    """The address of this thread's scratch buffer ``slot``, ``ALIGN``-byte aligned, room for ``shape`` of
    ``dtype``: kept between calls (grown when too small), as every kernel writes its scratch before reading it.
    gating.fig2 calls ≈ 500 kernels a step, and allocating the scratch each call would be a noticeable part of a
    call."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf[0].size < nbytes:
        arr = aligned_empty(max(nbytes, 1), np.uint8)
        buf = bufs[slot] = (arr, arr.ctypes.data)
    return buf[1]


def _pointer(a: np.ndarray, dtype) -> int:
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise ValueError(f"layer kernel operand must be C-contiguous {dtype} (got {a.dtype}, {a.shape})")
    return a.ctypes.data


@functools.cache
def layer_kernels(D: int, residual: bool, dtype, *, grad_z: bool = True, grad_lam: bool = True):
    """(forward, backward) for width D, compiled on first use (≈ 1 s each): Python callables with the numba
    blocked kernels' signatures, ``forward(Z, WQ, WK, WV, lam, O, first, stop)`` and
    ``backward(Z, WQ, WK, WV, lam, dO, dZ, dW, dlam, first, stop)`` (``forget._layer_source``), that
    release the GIL (``iclab.threads.run_split`` runs them on threads)."""
    dtype = np.dtype(dtype)
    scalar = _TYPES[dtype][2]
    P, I = ctypes.c_void_p, ctypes.c_int64
    fwd = compile_function(forward_ir(D, residual, dtype), "forward", None, (P, P, P, P, scalar, P, I, I, I))
    bwd = compile_function(backward_ir(D, residual, grad_z, grad_lam, dtype), "backward", None,
                           (P, P, P, P, scalar) + (P,) * 7 + (I, I, I))

    def check_weights(*W):
        if any(w.shape != (D, D) for w in W):
            raise ValueError(f"layer weights must be ({D}, {D}) (got {[w.shape for w in W]})")

    def forward(Z, WQ, WK, WV, lam, O, first, stop):
        check_weights(WQ, WK, WV)
        if Z.shape[1:] != (Z.shape[1], D, LANES) or O.shape != Z.shape:
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) (got {Z.shape}, {O.shape})")
        fwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV)), lam, _pointer(O, dtype), Z.shape[1], first, stop)

    def backward(Z, WQ, WK, WV, lam, dO, dZ, dW, dlam, first, stop):
        T = Z.shape[1]
        check_weights(WQ, WK, WV)
        if Z.shape[1:] != (T, D, LANES) or dO.shape != Z.shape or (grad_z and dZ.shape != Z.shape):
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) (got {Z.shape}, {dO.shape})")
        QKV, G = _scratch(0, (T, 3, D, LANES), dtype), _scratch(1, (T, 3, D, LANES), dtype)
        ACC = _scratch(2, (acc_vectors(D), LANES), dtype)
        dz = _pointer(dZ, dtype) if grad_z else 0
        bwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV)), lam,
            *(_pointer(a, dtype) for a in (dO,)), dz, *(_pointer(a, dtype) for a in (dW, dlam)), QKV, G, ACC,
            T, first, stop)

    return forward, backward


@functools.cache
def gated_layer_kernels(D: int, dtype, *, grad_z: bool = True, gathered: bool = False, kept: bool = False):
    """(forward, backward) of ``gated``'s residual scalar-gated layer on the blocked layout, with the numba
    kernels' signatures (``gated._gated_layer_source`` with ``blocked=True``): ``forward(Z, WQ, WK, WV, wg, O,
    first, stop)``, ``backward(Z, WQ, WK, WV, wg, O, dO, dZ, dW, dwg, first, stop)`` (weights transposed, as
    there).

    ``gathered`` (without ``grad_z``): ``forward(Z, P, WQ, …)`` and ``backward(Z, P, WQ, …)`` read the layer's
    input token t as token P[t] (P int64, C-contiguous) of Z (blocks, TZ, D, LANES); O, dO have the layer's
    len(P) tokens. Many models reading subsequences of one prompt then share one blocked copy of it.

    ``kept``: ``forward(Z, …, O, R, first, stop)`` also writes q_t, k_t, v_t to R (blocks, T, 3, D, LANES), and
    ``backward(Z, …, O, R, dO, …)`` reads them there (:func:`backward_ir`): the same bits as without."""
    dtype = np.dtype(dtype)
    P, I = ctypes.c_void_p, ctypes.c_int64
    extra = (P, I) if gathered else ()
    fwd = compile_function(forward_ir(D, True, dtype, gated=True, gathered=gathered, kept=kept), "forward", None,
                           (P,) * (7 if kept else 6) + (I, I, I) + extra)
    bwd = compile_function(backward_ir(D, True, grad_z, False, dtype, gated=True, gathered=gathered, kept=kept),
                           "backward", None, (P,) * 14 + (I, I, I) + extra)
    if kept:
        return _kept_gated_kernels(D, dtype, fwd, bwd, grad_z, gathered)

    def _gated_scratch(T):  # QKV, G, DA, ACC
        return (_scratch(0, (T, 3, D, LANES), dtype), _scratch(1, (T, 3, D, LANES), dtype),
                _scratch(2, (T, DA_SLOTS, LANES), dtype), _scratch(3, (acc_vectors(D), LANES), dtype))

    def check(Z, WQ, WK, WV, wg, *tokens):
        if any(w.shape != (D, D) for w in (WQ, WK, WV)) or wg.shape != (D,):
            raise ValueError(f"layer weights must be ({D}, {D}) and ({D},) (got {[w.shape for w in (WQ, WK, WV, wg)]})")
        if Z.shape[1:] != (Z.shape[1], D, LANES) or any(a.shape != Z.shape for a in tokens):
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) (got {Z.shape})")

    def forward(Z, WQ, WK, WV, wg, O, first, stop):
        check(Z, WQ, WK, WV, wg, O)
        fwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV, wg, O)), Z.shape[1], first, stop)

    def backward(Z, WQ, WK, WV, wg, O, dO, dZ, dW, dwg, first, stop):
        check(Z, WQ, WK, WV, wg, O, dO, *((dZ,) if grad_z else ()))
        T = Z.shape[1]
        dz = _pointer(dZ, dtype) if grad_z else 0
        bwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV, wg, O, dO)), dz,
            *(_pointer(a, dtype) for a in (dW, dwg)), *_gated_scratch(T), T, first, stop)

    forward.raw, backward.raw = fwd, bwd  # the ctypes functions (iclab.ops.decayed_attention._grid_driver calls them)
    if not gathered:
        return forward, backward

    def gathered_forward(Z, P, WQ, WK, WV, wg, O, first, stop):
        check(O, WQ, WK, WV, wg)
        TZ = _check_gathered(Z, P, O.shape[0], O.shape[1], D)
        fwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV, wg, O)), O.shape[1], first, stop, P.ctypes.data, TZ)

    def gathered_backward(Z, P, WQ, WK, WV, wg, O, dO, dZ, dW, dwg, first, stop):
        check(O, WQ, WK, WV, wg, dO)
        TZ = _check_gathered(Z, P, O.shape[0], O.shape[1], D)
        T = O.shape[1]
        bwd(*(_pointer(a, dtype) for a in (Z, WQ, WK, WV, wg, O, dO)), 0,
            *(_pointer(a, dtype) for a in (dW, dwg)), *_gated_scratch(T), T, first, stop, P.ctypes.data, TZ)

    gathered_forward.raw, gathered_backward.raw = fwd, bwd
    return gathered_forward, gathered_backward


def _kept_gated_kernels(D: int, dtype, fwd, bwd, grad_z: bool, gathered: bool):
    """:func:`gated_layer_kernels`'s Python callables with ``kept``: R (blocks, T, 3, D, LANES) after O, in both."""

    def tokens_of(Z, P, O):
        if gathered:
            _check_gathered(Z, P, O.shape[0], O.shape[1], D)
            return (P.ctypes.data, Z.shape[1])
        if Z.shape[1:] != (Z.shape[1], D, LANES) or O.shape != Z.shape:
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) (got {Z.shape}, {O.shape})")
        return ()

    def check(O, R, *tokens):
        if O.ndim != 4 or O.shape[2:] != (D, LANES) or any(a.shape != O.shape for a in tokens):
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) (got {O.shape})")
        if R.shape != (O.shape[0], O.shape[1], 3, D, LANES):
            raise ValueError(f"kept projections must be {(O.shape[0], O.shape[1], 3, D, LANES)} (got {R.shape})")

    def weights(WQ, WK, WV, wg):
        if any(w.shape != (D, D) for w in (WQ, WK, WV)) or wg.shape != (D,):
            raise ValueError(f"layer weights must be ({D}, {D}) and ({D},) (got {[w.shape for w in (WQ, WK, WV, wg)]})")
        return [_pointer(a, dtype) for a in (WQ, WK, WV, wg)]

    def forward(Z, *args):
        P, (WQ, WK, WV, wg, O, R, first, stop) = (args[0], args[1:]) if gathered else (None, args)
        check(O, R)
        extra = tokens_of(Z, P, O)
        fwd(_pointer(Z, dtype), *weights(WQ, WK, WV, wg), _pointer(O, dtype), _pointer(R, dtype), O.shape[1],
            first, stop, *extra)

    def backward(Z, *args):
        P, (WQ, WK, WV, wg, O, R, dO, dZ, dW, dwg, first, stop) = (args[0], args[1:]) if gathered else (None, args)
        check(O, R, dO, *((dZ,) if grad_z else ()))
        extra = tokens_of(Z, P, O)
        T = O.shape[1]
        G = _scratch(1, (T, 3, D, LANES), dtype)
        DA, ACC = _scratch(2, (T, DA_SLOTS, LANES), dtype), _scratch(3, (acc_vectors(D), LANES), dtype)
        bwd(_pointer(Z, dtype), *weights(WQ, WK, WV, wg), _pointer(O, dtype), _pointer(dO, dtype),
            _pointer(dZ, dtype) if grad_z else 0, _pointer(dW, dtype), _pointer(dwg, dtype), _pointer(R, dtype), G,
            DA, ACC, T, first, stop, *extra)

    forward.raw, backward.raw = fwd, bwd
    return forward, backward


def _check_gathered(Z: np.ndarray, P: np.ndarray, blocks: int, T: int, D: int) -> int:
    """Checks Z (blocks, TZ, D, LANES) read at positions P for a kernel's ``blocks`` blocks of T tokens: P int64,
    C-contiguous, of length T, every position in [0, TZ) (the kernels do not check). Returns TZ."""
    if Z.ndim != 4 or Z.shape[2:] != (D, LANES) or Z.shape[0] != blocks:
        raise ValueError(f"gathered tokens must be ({blocks}, TZ, {D}, {LANES}) (got {Z.shape})")
    if not Z.flags.c_contiguous:
        raise ValueError("gathered tokens must be C-contiguous")
    if P.dtype != np.int64 or P.ndim != 1 or not P.flags.c_contiguous or P.shape[0] != T or T < 1:
        raise ValueError(f"positions must be C-contiguous int64 of the kernel's {T} tokens (got {P.dtype}, {P.shape})")
    if P.size and (P.min() < 0 or P.max() >= Z.shape[1]):
        raise ValueError(f"positions must lie in [0, {Z.shape[1]})")
    return Z.shape[1]


# --------------------------------------------------------------------------------------------
# The last layer read at the query (gated's scalar-gated or ungated query-loss kernel, blocked layout)


def _bit_reversed(n: int) -> list[int]:
    bits = n.bit_length() - 1
    return [int(f"{i:0{bits}b}"[::-1], 2) for i in range(n)]


def _lane_sums(ir: _Builder, vectors: list[str]) -> str:
    """One vector whose lane i is the sum of the lanes of ``vectors[i]`` (at most LANES of them, the rest taken
    as zero): a butterfly of 15 additions and 30 shuffles for 16 vectors instead of 16 · 15 scalar additions.
    Each step adds two vectors' halves of every block of 2h lanes, x's in the block's first half and y's in its
    second; the sources come out in bit-reversed lane order, so they go in bit-reversed."""
    vecs = list(vectors) + ["zeroinitializer"] * (LANES - len(vectors))
    cur = [vecs[k] for k in _bit_reversed(LANES)]
    h = LANES // 2
    while len(cur) > 1:
        nxt = []
        for x, y in zip(cur[::2], cur[1::2]):
            first = [l if l % (2 * h) < h else LANES + l for l in range(LANES)]
            second = [l + h if l % (2 * h) < h else LANES + l - h for l in range(LANES)]
            a, b = ir.tmp(), ir.tmp()
            for r, mask in ((a, first), (b, second)):
                ir.emit(f"{r} = shufflevector {ir.V} {x}, {ir.V} {y}, <{LANES} x i32> "
                        f"<{', '.join(f'i32 {m}' for m in mask)}>")
            nxt.append(ir.add(a, b))
        cur, h = nxt, h // 2
    return cur[0]


def _gather(ir: _Builder, base: str, offsets: str, mask: str) -> str:
    """The LANES values at base[offsets] (a <LANES x i32> vector: one 16-lane gather instruction, where 64-bit
    offsets take two), zero where ``mask`` is false."""
    p, r = ir.tmp(), ir.tmp()
    ir.emit(f"{p} = getelementptr {ir.ty}, ptr {base}, <{LANES} x i32> {offsets}")
    ir.emit(f"{r} = call {ir.V} @llvm.masked.gather.v{LANES}{ir.suffix}.v{LANES}p0(<{LANES} x ptr> {p}, i32 4, "
            f"<{LANES} x i1> {mask}, {ir.V} zeroinitializer)")
    return r


def _splat_i64(ir: _Builder, scalar: str) -> str:
    i, r = ir.tmp(), ir.tmp()
    ir.emit(f"{i} = insertelement <{LANES} x i64> undef, i64 {scalar}, i32 0")
    ir.emit(f"{r} = shufflevector <{LANES} x i64> {i}, <{LANES} x i64> undef, <{LANES} x i32> zeroinitializer")
    return r


def _store_lanes(ir: _Builder, vector: str, base: str, offset: str, count: int) -> None:
    """base[offset + i] = lane i of the vector, i < count."""
    p = ir.gep(base, offset)
    if count == LANES:
        ir.emit(f"store {ir.V} {vector}, ptr {p}, align 4")
        return
    for i in range(count):
        x = ir.tmp()
        ir.emit(f"{x} = extractelement {ir.V} {vector}, i32 {i}")
        ir.emit(f"store {ir.ty} {x}, ptr {ir.gep(p, i)}")


def _close_blocks(ir: _Builder) -> str:
    """Ends a query kernel's block loop (its latch ``blk.end``) and the function; returns the IR."""
    ir.emit("br label %blk.end")
    ir.label("blk.end")
    ir.emit("br label %blk")
    ir.label("blk.done")
    ir.emit("ret void")
    return ir.text()


def _grid_entry(ir: _Builder, D: int) -> None:
    """A grid kernel's constants (entry block, after %qc): %NB blocks per prompt row, %zbo the job's blocked
    tokens in SC after q, c and the loss's slot, %zrow Z's stride between prompts."""
    ir.emit(f"%Bp = add i64 %B, {LANES - 1}")
    ir.emit(f"%NB = udiv i64 %Bp, {LANES}")
    ir.emit(f"%zbo = add i64 %qc, {(2 * D + 1) * LANES}")
    ir.emit(f"%zrow = mul i64 %Tmax, {D}")


def _query_keys(ir: _Builder, D: int, zb: str, QC: str, gathered: bool = False) -> tuple[str, list[str]]:
    """q_j = Σ_f W_Q[f, j] z_T[f] and c_f = Σ_j W_K[f, j] q_j of the block's query token, stored at QC (q, then c);
    returns (the query token's pointer, its D vectors). %zqo2: the query token's offset in the block (``gathered``:
    the query is token P[T − 1] of the block at ``zb``)."""
    ir.emit(f"%zqo = mul i64 %T, {D * LANES}")
    ir.emit(f"%zqo2 = sub i64 %zqo, {D * LANES}")
    if gathered:
        ir.emit("%zqt = sub i64 %T, 1")
        ir.emit("%zqpp = getelementptr i64, ptr %P, i64 %zqt")
        ir.emit("%zqpt = load i64, ptr %zqpp")
        ir.emit(f"%zqoz = mul i64 %zqpt, {D * LANES}")
    zqp = ir.gep(zb, "%zqoz" if gathered else "%zqo2")
    zq = [ir.load(zqp, f) for f in range(D)]
    q = [ir.dot([ir.weight("%Wq", D, f, j) for f in range(D)], zq) for j in range(D)]
    c = [ir.dot([ir.weight("%Wk", D, f, j) for j in range(D)], q) for f in range(D)]
    for i, x in enumerate(q + c):
        ir.store(x, QC, i)
    return zqp, zq


def _block_loss(ir: _Builder, D: int, err: str) -> str:
    """loss[blk] = Σ_lanes err² · inv_B (summed in a scratch slot after q and c); returns e = 2 err / B."""
    ty = ir.ty
    ir.emit(f"%lso = add i64 %qc, {2 * D * LANES}")
    ir.lane_sum(ir.mul(err, err), "%SC", "%lso")
    ls, lsc = ir.tmp(), ir.tmp()
    ir.emit(f"{ls} = load {ty}, ptr {ir.gep('%SC', '%lso')}")
    ir.emit(f"{lsc} = fmul {ty} {ls}, %inv_B")
    ir.emit(f"store {ty} {lsc}, ptr {ir.gep('%loss', ir.job)}")
    return ir.mul(ir.splat("%two_inv_B"), err)


def _token_sums(ir: _Builder, name: str, prev: str, D: int, token, products, names) -> list[str]:
    """A loop ``name`` over the tokens t < %T (entered from the block ``prev``) accumulating D vectors
    acc_i += a_i b_i, (a_i, b_i) = ``products(*token(name))``; the accumulators are the loop's phis (named by
    ``names(i)``). Returns them; ends in the block ``name.done``."""
    V, zero = ir.V, "zeroinitializer"
    ir.emit(f"br label %{name}")
    ir.label(name)
    ir.emit(f"%{name}.i = phi i64 [0, %{prev}], [%{name}.n, %{name}.body]")
    acc = [names(i) for i in range(D)]
    at = len(ir.lines)
    ir.emit(f"%{name}.c = icmp slt i64 %{name}.i, %T")
    ir.emit(f"br i1 %{name}.c, label %{name}.body, label %{name}.done")
    ir.label(f"{name}.body")
    ir.emit(f"%{name}.n = add i64 %{name}.i, 1")
    new = [ir.fma(a, b, acc[i]) for i, (a, b) in enumerate(products(*token(name)))]
    ir.emit(f"br label %{name}")
    ir.lines[at:at] = [f"  {acc[i]} = phi {V} [{zero}, %{prev}], [{new[i]}, %{name}.body]" for i in range(D)]
    ir.label(f"{name}.done")
    return acc


def _key_query_grads(ir: _Builder, D: int, dc, QC: str, zqp: str) -> list[str]:
    """q̄_j = Σ_f W_K[f, j] c̄_f; W̄_K[f, j] = Σ_lanes c̄_f q_j and W̄_Q[f, j] = Σ_lanes z_T[f] q̄_j written at
    %gk, %gq + %wo, 16 sums at a time. Returns q̄."""
    dq = [ir.dot([ir.weight("%Wk", D, f, j) for f in range(D)], dc) for j in range(D)]
    qs = ir.opaque(QC)
    zqr = ir.opaque(zqp)
    for f in range(D):
        for j0 in range(0, D, LANES):
            js = range(j0, min(D, j0 + LANES))
            ir.emit(f"%gko{f}_{j0} = add i64 %wo, {f * D + j0}")
            _store_lanes(ir, _lane_sums(ir, [ir.mul(dc[f], ir.load(qs, j)) for j in js]), "%gk", f"%gko{f}_{j0}",
                         len(js))
            _store_lanes(ir, _lane_sums(ir, [ir.mul(ir.load(zqr, f), dq[j]) for j in js]), "%gq", f"%gko{f}_{j0}",
                         len(js))
    return dq


def _block_prompts(ir: _Builder) -> None:
    """The lanes of block %jb of a row of B prompts: %b0 its first prompt, %mask its lanes that hold one, %prompt
    their indices, %zoff their offsets in a row of Z (prompts %zrow scalars apart, as 32-bit offsets)."""
    IV = f"<{LANES} x i64>"
    lanes = "<" + ", ".join(f"i64 {b}" for b in range(LANES)) + ">"
    ir.emit(f"%b0 = mul i64 %jb, {LANES}")
    ir.emit("%rem = sub i64 %B, %b0")
    ir.emit(f"%mask = icmp slt {IV} {lanes}, {_splat_i64(ir, '%rem')}")
    ir.emit(f"%prompt = add {IV} {lanes}, {_splat_i64(ir, '%b0')}")
    ir.emit(f"%zoff64 = mul {IV} %prompt, {_splat_i64(ir, '%zrow')}")
    ir.emit(f"%zoff = trunc {IV} %zoff64 to <{LANES} x i32>")  # within one row of Z: < 2³¹ (checked)


def _gather_tokens(ir: _Builder, D: int, zrowp: str, zb: str, *, positions: bool) -> None:
    """A loop ``gz`` (from ``blk.body``, ending in ``gz.done``) over t < %T storing at zb + t·D vectors the D
    masked 16-lane gathers of token t of the block's prompts (lanes %zoff, %mask of :func:`_block_prompts`) in the
    row of Z at zrowp; ``positions``: token pos[%pg + t] instead of t."""
    ir.emit("br label %gz")
    _loop_head(ir, "gz", "blk.body", "gz.body", "0", 1, "%T")
    if positions:
        ir.emit("%gz.pi = add i64 %pg, %gz.i")
        ir.emit(f"%gz.p = load i64, ptr {ir.gep_i64('%pos', '%gz.pi')}")
    ir.emit(f"%gz.po = mul i64 {'%gz.p' if positions else '%gz.i'}, {D}")
    src = ir.gep(zrowp, "%gz.po")
    ir.emit(f"%gz.zo = mul i64 %gz.i, {D * LANES}")
    dst = ir.gep(zb, "%gz.zo")
    for f in range(D):
        ir.store(_gather(ir, ir.gep(src, f), "%zoff", "%mask"), dst, f)
    ir.emit("br label %gz")
    ir.label("gz.done")


def _grid_job(ir: _Builder, D: int, pointers, blocked: bool = False) -> tuple[str, str]:
    """The start of a grid kernel's job (in the block after ``blk.body``): job = ((s·M + m)·G + g)·NB + block, as
    the numba kernels'; %T = lens[g]; the model's weight pointers (``pointers``: (name, argument, entries per
    model, offset)); the job's prompts' tokens ``pos[g, :T]`` gathered into the scratch at %zbo (T, D, LANES), the
    spare lanes zero. Needs %NB, %zrow (= Tmax·D) and %zbo from the entry block. Returns (that scratch's pointer,
    the targets y[s, r, block] as a vector); ends in the block ``gz.done``.

    ``blocked``: Z is the blocked copy (S, RZ, NB, Tmax, D, LANES) of the prompts (spare lanes zero), nothing is
    gathered, and the pointer returned is the job's block of it, whose token t the kernel reads at position
    %P[t] (%P = pos[g]); the loop visits the jobs block by block, ((s·NB + block)·M + m)·G + g, so that a
    block's tokens stay in cache while every model reads them, and the outputs go to job ((s·M + m)·G + g)·NB +
    block as in the gathered form (``ir.job``). Why: gathered, every job (every model) copies its block's tokens
    into its scratch again, a store and a later load of T·D vectors per job."""
    IV, ty = f"<{LANES} x i64>", ir.ty
    if blocked:  # visited as ((s·NB + block)·M + m)·G + g: a block's models one after the other, its tokens hot
        decode = ("%jg = urem i64 %blk.i, %G", "%u1 = udiv i64 %blk.i, %G", "%jm = urem i64 %u1, %M",
                  "%u2 = udiv i64 %u1, %M", "%jb = urem i64 %u2, %NB", "%js = udiv i64 %u2, %NB")
    else:
        decode = ("%jb = urem i64 %blk.i, %NB", "%j1 = udiv i64 %blk.i, %NB", "%jg = urem i64 %j1, %G",
                  "%j2 = udiv i64 %j1, %G", "%jm = urem i64 %j2, %M", "%js = udiv i64 %j2, %M")
    for line in decode + ("%mo = mul i64 %js, %M", "%mo2 = add i64 %mo, %jm", "%mo3 = mul i64 %mo2, %G",
                          "%model = add i64 %mo3, %jg"):
        ir.emit(line)
    if blocked:  # the job's outputs where the gathering kernel wrote them: job ((s·M + m)·G + g)·NB + block
        ir.emit("%job0 = mul i64 %model, %NB")
        ir.emit("%job = add i64 %job0, %jb")
        ir.job = "%job"
    ir.emit(f"%T = load i64, ptr {ir.gep_i64('%lens', '%jg')}")
    ir.emit(f"%r = load i64, ptr {ir.gep_i64('%rows', '%jm')}")
    _block_prompts(ir)
    ir.emit(f"%yoff = trunc {IV} %prompt to <{LANES} x i32>")
    ir.emit("%sr = mul i64 %js, %R")
    ir.emit("%sr2 = add i64 %sr, %r")
    ir.emit("%yrow = mul i64 %sr2, %B")  # y[s, r, :]
    ir.emit("%zr = urem i64 %r, %RZ")  # Z's row: r, or 0 where one row of Z serves every row of y
    ir.emit("%zs = mul i64 %js, %RZ")
    ir.emit("%zs2 = add i64 %zs, %zr")
    ir.emit("%zs3 = mul i64 %zs2, %B")
    ir.emit("%zro = mul i64 %zs3, %zrow")  # Z[s, r % RZ] (Tmax·D per prompt)
    for i, (name, base, size, offset) in enumerate(pointers):
        ir.emit(f"%wo{i} = mul i64 %model, {size}")
        ir.emit(f"%wp{i} = add i64 %wo{i}, {offset}")
        ir.emit(f"{name} = getelementptr {ty}, ptr {base}, i64 %wp{i}")
    ir.emit("%pg = mul i64 %jg, %Tmax")
    if blocked:  # the job's block of Z[s, r % RZ]: ((s·RZ + r % RZ)·NB + block)·Tmax tokens of D vectors
        ir.emit("%zbk = mul i64 %zs2, %NB")
        ir.emit("%zbk2 = add i64 %zbk, %jb")
        ir.emit("%zbk3 = mul i64 %zbk2, %Tmax")
        ir.emit(f"%zbro = mul i64 %zbk3, {D * LANES}")
        ir.emit("%P = getelementptr i64, ptr %pos, i64 %pg")
        zb = ir.gep("%Z", "%zbro")
        ir.emit("br label %gz.done")
        ir.label("gz.done")
        return zb, _gather(ir, ir.gep("%y", "%yrow"), "%yoff", "%mask")
    zb = ir.gep("%SC", "%zbo")
    zrowp = ir.gep("%Z", "%zro")
    _gather_tokens(ir, D, zrowp, zb, positions=True)
    return zb, _gather(ir, ir.gep("%y", "%yrow"), "%yoff", "%mask")


def grid_blocks_ir(D: int, dtype) -> str:
    """IR of ``blocks(Z, Zb, B, T, first, stop)``: the prompts Z (P, B, T, D) in the blocked layout Zb (P, NB, T, D,
    LANES), NB = ⌈B / LANES⌉, the spare lanes zero, for the units [first, stop) of (row p, block): one masked
    16-lane gather per token entry, as each grid job made for itself (:func:`_grid_job`)."""
    ir = _Builder(dtype)
    V = ir.V
    ir.lines.append(f"declare {V} @llvm.masked.gather.v{LANES}{ir.suffix}.v{LANES}p0(<{LANES} x ptr>, i32, "
                    f"<{LANES} x i1>, {V})")
    ir.lines.append("define void @blocks(ptr noalias %Z, ptr noalias %Zb, i64 %B, i64 %T, i64 %first, i64 %stop) {")
    ir.label("entry")
    ir.emit(f"%Bp = add i64 %B, {LANES - 1}")
    ir.emit(f"%NB = udiv i64 %Bp, {LANES}")
    ir.emit(f"%zrow = mul i64 %T, {D}")
    ir.emit("%zp = mul i64 %B, %zrow")  # a row p of Z
    ir.emit(f"%zbu = mul i64 %T, {D * LANES}")  # a unit of Zb
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "blk.end", "%first", 1, "%stop")
    ir.emit("%jb = urem i64 %blk.i, %NB")
    ir.emit("%jp = udiv i64 %blk.i, %NB")
    _block_prompts(ir)
    ir.emit("%zro = mul i64 %jp, %zp")
    ir.emit("%zbo = mul i64 %blk.i, %zbu")
    zrowp, zb = ir.gep("%Z", "%zro"), ir.gep("%Zb", "%zbo")
    _gather_tokens(ir, D, zrowp, zb, positions=False)
    return _close_blocks(ir)


@functools.cache
def grid_blocks_kernel(D: int, dtype):
    """:func:`grid_blocks_ir` compiled on first use: ``blocks(Z, Zb, first, stop)`` on numpy arrays Z (P, B, T, D)
    and Zb (P, ⌈B/LANES⌉, T, D, LANES) (C-contiguous, of ``dtype``) over the units [first, stop) of (p, block)."""
    dtype = np.dtype(dtype)
    P_, I = ctypes.c_void_p, ctypes.c_int64
    fn = compile_function(grid_blocks_ir(D, dtype), "blocks", None, (P_, P_, I, I, I, I))

    def blocks(Z, Zb, first, stop):
        P, B, T, _ = Z.shape
        if Z.shape[3] != D or Zb.shape != (P, -(-B // LANES), T, D, LANES):
            raise ValueError(f"grid blocks: Z (P, B, T, {D}) into Zb (P, ⌈B/{LANES}⌉, T, {D}, {LANES}) (got {Z.shape}, "
                             f"{Zb.shape})")
        if B * T * D >= 2 ** 31:
            raise ValueError(f"a row of Z must have fewer than 2³¹ entries (got {B} x {T} x {D})")
        fn(_pointer(Z, dtype), _pointer(Zb, dtype), B, T, first, stop)

    return blocks


def query_loss_ir(D: int, dtype, *, gated: bool, residual: bool, grad_z: bool, label: int,
                  grid: bool = False, gathered: bool = False, blocked: bool = False) -> str:
    """IR of ``query(Z, y, Wq, Wk, u, wg, loss, gq, gk, gv, gg, dZ, SC, T, first, stop, inv_B, two_inv_B)``: the
    query-loss kernel of ``gated`` (its module docstring: ŷ = [z_T[label] +] Σ_t ω_t s_t v_t, s_t = z_tᵀc,
    c = W_K W_Qᵀ z_T, v_t = z_tᵀu with u = (W_V)_{:,label}, ω_t = Π_{u>t} φ(w_gᵀz_u) or 1) for blocks [first, stop)
    of Z (blocks, T, D, LANES), the prompts in lanes (spare lanes zero tokens and zero targets), y (blocks, LANES).
    Per block: loss[blk] = Σ_b (ŷ − y)² · inv_B, gq[blk], gk[blk] (D, D) the block's W̄_Q, W̄_K, gv[blk], gg[blk]
    (D) its ū and w̄_g, and (``grad_z``) the token cotangents dZ (blocks, T, D, LANES). SC: one thread's scratch
    (T, 8, LANES) plus 2D + 1 vectors.

    The numba kernel's operations (its order except where lanes are summed); every per-token value a vector of
    the block's prompts, in registers: pass 1 (t ascending) s_t, v_t and the gates; pass 2 (descending) ω_t and ŷ;
    pass 3 (ascending) the rows' cotangents c̄_t = e ω_t v_t, ū_t = e ω_t s_t, w̄_t = e φ(−a_t) P_t (P_t the prefix
    sum of ω s v) and z̄_t; then c̄ = Σ_t c̄_t z_t, ū, w̄_g likewise, one loop each with D accumulators; W̄_K = Σ_b c̄ qᵀ
    and W̄_Q = Σ_b z_T q̄ᵀ, q̄ = W_Kᵀ c̄, summed over the lanes 16 at a time (:func:`_lane_sums`).

    ``grid``: the kernel of a grid of one-layer models on the token layout, ``query(Z, y, pos, lens, rows, Wq, Wk,
    Wv, Wg, loss, gq, gk, gv, gg, SC, R, B, Tmax, M, G, first, stop, inv_B, two_inv_B)`` with the numba kernel's
    operands (Z (S, R, B, Tmax, D), y (S, R, B), weights (S, M, G, …); no residual read-out, no z̄) and its jobs
    (s, m, g, block) of LANES prompts, outputs per job; each job first gathers its prompts' tokens
    ``pos[g, :lens[g]]`` into a blocked scratch after SC's other slots (masked gathers), then runs the passes
    above. ``blocked`` (with ``grid``): Z is the blocked copy (S, R or 1, NB, Tmax, D, LANES) of the prompts, and
    the passes read token pos[g, t] of the job's block in place (:func:`_grid_job`): the same values, the same
    bits.

    ``gathered`` (not with ``grid`` or ``grad_z``): the arguments P, TZ last, token t of the prompt being token P[t]
    of Z (blocks, TZ, D, LANES), as in :func:`forward_ir`."""
    if gathered and (grid or grad_z):
        raise ValueError("a gathered query kernel reads a blocked copy of data: no grid, no token cotangents")
    if grad_z and not residual:
        raise ValueError("token cotangents are those of a residual stream's last layer")
    if grid and residual:
        raise ValueError("the grid kernel reads one-layer models (no residual read-out)")
    ir = _Builder(dtype)
    V, zero, ty = ir.V, "zeroinitializer", ir.ty
    if grid:
        ir.lines += [f"declare {V} @llvm.masked.gather.v{LANES}{ir.suffix}.v{LANES}p0(<{LANES} x ptr>, i32, "
                     f"<{LANES} x i1>, {V})"]
        ir.lines.append(f"define void @query(ptr noalias %Z, ptr noalias %y, ptr noalias %pos, ptr noalias %lens, "
                        f"ptr noalias %rows, ptr noalias %WqA, ptr noalias %WkA, ptr noalias %WvA, ptr noalias %WgA, "
                        f"ptr noalias %loss, ptr noalias %gq, ptr noalias %gk, ptr noalias %gv, ptr noalias %gg, "
                        f"ptr noalias %SC, i64 %R, i64 %RZ, i64 %B, i64 %Tmax, i64 %M, i64 %G, i64 %first, i64 %stop, "
                        f"{ty} %inv_B, {ty} %two_inv_B) {{")
    else:
        ir.lines.append(f"define void @query(ptr noalias %Z, ptr noalias %y, ptr noalias %Wq, ptr noalias %Wk, "
                        f"ptr noalias %u, ptr noalias %wg, ptr noalias %loss, ptr noalias %gq, ptr noalias %gk, "
                        f"ptr noalias %gv, ptr noalias %gg, ptr noalias %dZ, ptr noalias %SC, i64 %T, i64 %first, "
                        f"i64 %stop, {ty} %inv_B, {ty} %two_inv_B{_GATHER_ARGS if gathered else ''}) {{")
    ST, VT, GT, SM, OM, XC, XU, XW = range(8)  # the scratch's per-token slots
    ir.label("entry")
    one = ir.splat("1.0")
    ir.emit(f"%qc = mul i64 {'%Tmax' if grid else '%T'}, {8 * LANES}")  # q and c after the per-token slots
    QC = ir.gep("%SC", "%qc")
    if grid:
        _grid_entry(ir, D)
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "blk.end", "%first", 1, "%stop")
    if grid:
        zb, yv = _grid_job(ir, D, (("%Wq", "%WqA", D * D, 0), ("%Wk", "%WkA", D * D, 0),
                                   ("%u", "%WvA", D * D, label), ("%wg", "%WgA", D, 0)), blocked)
        first_pass = "gz.done"
    else:
        ir.emit(f"%boff = mul i64 %blk.i, {'%TZ' if gathered else '%T'}")
        ir.emit(f"%base = mul i64 %boff, {D * LANES}")
        zb = ir.gep("%Z", "%base")
        first_pass = "blk.body"
    dzb = ir.gep("%dZ", "%base") if grad_z else None
    indirect = gathered or blocked  # token t is token %P[t] of the block at zb
    zqp, zq = _query_keys(ir, D, zb, QC, indirect)
    ir.emit("br label %p1")

    def u_at(f):  # u = (W_V)_{:,label}: a column of the model's W_V in the grid, a vector of its own otherwise
        return ir.weight("%u", D, f, 0) if grid else ir.weight("%u", D, 0, f)

    def token(loop):
        ir.emit(f"%{loop}.zo = mul i64 %{loop}.i, {D * LANES}")
        ir.emit(f"%{loop}.so = mul i64 %{loop}.i, {8 * LANES}")
        if indirect:  # token P[t] of the block
            ir.emit(f"%{loop}.pp = getelementptr i64, ptr %P, i64 %{loop}.i")
            ir.emit(f"%{loop}.pt = load i64, ptr %{loop}.pp")
            ir.emit(f"%{loop}.zg = mul i64 %{loop}.pt, {D * LANES}")
        return ir.gep(zb, f"%{loop}.zg" if indirect else f"%{loop}.zo"), ir.gep("%SC", f"%{loop}.so"), f"%{loop}.zo"

    # pass 1: s_t = c·z_t, v_t = u·z_t, the gates of a_t = w_g·z_t
    _loop_head(ir, "p1", first_pass, "p1.body", "0", 1, "%T")
    zp, sp, _ = token("p1")
    z = [ir.load(zp, f) for f in range(D)]
    cs = ir.opaque(QC)
    ir.store(ir.dot([ir.load(cs, D + f) for f in range(D)], z), sp, ST)
    ir.store(ir.dot([u_at(f) for f in range(D)], z), sp, VT)
    if gated:
        g, sm = _gates(ir, z, D)
        ir.store(g, sp, GT)
        ir.store(sm, sp, SM)
    ir.emit("br label %p1")
    ir.label("p1.done")
    ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("br label %p2")
    # pass 2, t descending: ω_t (ob before its gate), ŷ += ω_t s_t v_t
    ir.label("p2")
    ir.emit("%p2.i = phi i64 [%Tm1, %p1.done], [%p2.n, %p2.body]")
    yh0 = zq[label] if residual else zero
    ir.emit(f"%ob = phi {V} [{one}, %p1.done], [%ob.n, %p2.body]")
    ir.emit(f"%yh = phi {V} [{yh0}, %p1.done], [%yh.n, %p2.body]")
    ir.emit("%p2.c = icmp sge i64 %p2.i, 0")
    ir.emit("br i1 %p2.c, label %p2.body, label %p2.done")
    ir.label("p2.body")
    ir.emit("%p2.n = sub i64 %p2.i, 1")
    _, sp, _ = token("p2")
    ir.store("%ob", sp, OM)
    st, vt = ir.load(sp, ST), ir.load(sp, VT)
    ir.emit(f"%yh.n = call {V} @{ir.fma_name}({V} {ir.mul('%ob', st)}, {V} {vt}, {V} %yh)")
    if gated:
        ir.emit(f"%ob.n = fmul {V} %ob, {ir.load(sp, GT)}")
    else:
        ir.emit(f"%ob.n = fadd {V} %ob, {zero}")
    ir.emit("br label %p2")
    ir.label("p2.done")
    if not grid:
        ir.emit(f"%yo = mul i64 %blk.i, {LANES}")
        yv = ir.load(ir.gep("%y", "%yo"), 0)
    err = _sub(ir, "%yh", yv)
    e = _block_loss(ir, D, err)
    ir.emit("br label %p3")
    # pass 3, t ascending: the rows' cotangents (and P_t's prefix sum), z̄_t
    _loop_head(ir, "p3", "p2.done", "p3.body", "0", 1, "%T")
    at = len(ir.lines) - 5
    zp, sp, zo = token("p3")
    om, st, vt = ir.load(sp, OM), ir.load(sp, ST), ir.load(sp, VT)
    eo = ir.mul(e, om)
    xc, xu = ir.mul(eo, vt), ir.mul(eo, st)
    ir.store(xc, sp, XC)
    ir.store(xu, sp, XU)
    if gated:
        xw = ir.mul(ir.mul(e, ir.load(sp, SM)), "%pre")
        ir.store(xw, sp, XW)
        ir.emit(f"%pre.n = call {V} @{ir.fma_name}({V} {ir.mul(om, st)}, {V} {vt}, {V} %pre)")
        ir.lines.insert(at + 1, f"  %pre = phi {V} [{zero}, %p2.done], [%pre.n, %p3.body]")
    if grad_z:
        dzp = ir.gep(dzb, zo)
        cs = ir.opaque(QC)
        for f in range(D):
            acc = ir.mul(xu, u_at(f))
            acc = ir.fma(xc, ir.load(cs, D + f), acc)
            if gated:
                acc = ir.fma(xw, ir.weight("%wg", D, 0, f), acc)
            ir.store(acc, dzp, f)
    ir.emit("br label %p3")
    ir.label("p3.done")
    # ū_f, w̄_f, c̄_f = Σ_t x_t z_t[f]: one loop each, D accumulators (phis); ū and w̄_g summed over the lanes
    # before the next loop, so that only c̄'s accumulators stay live
    ir.emit(f"%vo = mul i64 {ir.job}, {D}")
    prev = "p3.done"
    for slot, name in ((XU, "du"),) + (((XW, "dw"),) if gated else ()) + ((XC, "dc"),):

        def row(zp, sp, slot=slot):  # x_t times z_t
            x, zr = ir.load(sp, slot), ir.opaque(zp)
            return [(x, ir.load(zr, f)) for f in range(D)]

        acc = _token_sums(ir, name, prev, D, lambda loop: token(loop)[:2], row, names=lambda f, n=name: f"%{n}{f}")
        prev = f"{name}.done"
        if name != "dc":
            out = "%gv" if name == "du" else "%gg"
            for f0 in range(0, D, LANES):
                part = acc[f0:f0 + LANES]
                ir.emit(f"%{name}.o{f0} = add i64 %vo, {f0}")
                _store_lanes(ir, _lane_sums(ir, part), out, f"%{name}.o{f0}", len(part))
    if not gated:
        gp = ir.gep("%gg", "%vo")
        for f in range(D):
            ir.emit(f"store {ty} 0.0, ptr {ir.gep(gp, f)}")
    dc = acc
    ir.emit(f"%wo = mul i64 {ir.job}, {D * D}")
    dq = _key_query_grads(ir, D, dc, QC, zqp)
    if grad_z:  # the query's cotangent through q (z̄_T += W_Q q̄) and the residual read-out's label slot
        ir.emit(f"%zqd = getelementptr {ty}, ptr {dzb}, i64 %zqo2")
        for f in range(D):
            a = ir.add(ir.load("%zqd", f), ir.dot([ir.weight("%Wq", D, f, j) for j in range(D)], dq))
            ir.store(ir.add(a, e) if residual and f == label else a, "%zqd", f)
    return _close_blocks(ir)


@functools.cache
def query_loss_kernel(D: int, dtype, *, gated: bool, residual: bool, grad_z: bool, label: int,
                      gathered: bool = False):
    """The query-loss kernel of :func:`query_loss_ir`, compiled on first use: ``query(Z, y, Wq, Wk, u, wg, B, loss,
    gq, gk, gv, gg, dZ, first, stop)`` on blocks [first, stop) of Z (blocks, T, D, LANES) with y (blocks, LANES)
    (spare lanes zero), Wq, Wk (D, D) as the model's, u = (W_V)_{:,label} and w_g (D,), B the prompts (the mean's
    divisor); writes loss (blocks,), gq, gk (blocks, D, D), gv, gg (blocks, D) and, with ``grad_z``, dZ (Z's shape;
    ignored without). Releases the GIL (``iclab.threads.run_split`` runs it on threads).

    ``gathered`` (without ``grad_z``): ``query(Z, P, y, Wq, …)``, token t of the prompts being token P[t] (int64)
    of Z (blocks, TZ, D, LANES), as :func:`gated_layer_kernels`'s."""
    dtype = np.dtype(dtype)
    scalar = _TYPES[dtype][2]
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = compile_function(query_loss_ir(D, dtype, gated=gated, residual=residual, grad_z=grad_z, label=label,
                                        gathered=gathered),
                          "query", None, (P,) * 13 + (I, I, I, scalar, scalar) + ((P, I) if gathered else ()))

    def query(Z, y, Wq, Wk, u, wg, B, loss, gq, gk, gv, gg, dZ, first, stop, *gather):
        nb, T = (Z.shape[0], gather[0].shape[0]) if gathered else Z.shape[:2]
        if gathered:
            TZ = _check_gathered(Z, gather[0], nb, T, D)
        if Z.shape[2:] != (D, LANES) or y.shape != (nb, LANES) or T < 1:
            raise ValueError(f"blocked tokens must be (blocks, T, {D}, {LANES}) and targets (blocks, {LANES}) "
                             f"(got {Z.shape}, {y.shape})")
        if Wq.shape != (D, D) or Wk.shape != (D, D) or u.shape != (D,) or wg.shape != (D,):
            raise ValueError(f"query weights must be ({D}, {D}) and ({D},)")
        if (loss.shape != (nb,) or gq.shape != (nb, D, D) or gk.shape != (nb, D, D) or gv.shape != (nb, D)
                or gg.shape != (nb, D) or (grad_z and dZ.shape != Z.shape)):
            raise ValueError("query-loss outputs must be per block: (blocks,), (blocks, D, D) x 2, (blocks, D) x 2")
        SC = _scratch(0, (T * 8 + 2 * D + 1) * LANES, dtype)
        one = dtype.type(1.0)
        fn(*(_pointer(a, dtype) for a in (Z, y, Wq, Wk, u, wg, loss, gq, gk, gv, gg)),
           _pointer(dZ, dtype) if grad_z else 0, SC, T, first, stop, one / dtype.type(B),
           dtype.type(2.0) / dtype.type(B), *((gather[0].ctypes.data, TZ) if gathered else ()))

    query.raw = fn  # the ctypes function (iclab.ops.decayed_attention._grid_driver calls it)
    if not gathered:
        return query

    def gathered_query(Z, P, y, Wq, Wk, u, wg, B, loss, gq, gk, gv, gg, first, stop):
        return query(Z, y, Wq, Wk, u, wg, B, loss, gq, gk, gv, gg, None, first, stop, P)

    gathered_query.raw = fn
    return gathered_query


@functools.cache
def query_grid_kernel(D: int, dtype, *, gated: bool, label: int, blocked: bool = False):
    """:func:`query_loss_ir` with ``grid``, compiled on first use, with the numba grid kernel's signature
    (``gated._COMMON``): ``kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv, gg, gh,
    dZ, first, stop)`` over jobs (s, m, g, block) of LANES prompts, outputs per job (loss (S, M, G, NB), gq, gk
    (…, NB, D, D), gv (…, NB, D, 1), gg (…, NB, D), NB = ⌈B / LANES⌉); h, gh, dZ unused (no head, no residual
    read-out), ``label`` fixed at compilation (checked). ``blocked``: Z is the prompts' blocked copy (S, R or 1,
    NB, Tmax, D, LANES) (``gated.grid_blocks``)."""
    dtype = np.dtype(dtype)
    scalar = _TYPES[dtype][2]
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = compile_function(query_loss_ir(D, dtype, gated=gated, residual=False, grad_z=False, label=label, grid=True,
                                        blocked=blocked), "query", None, (P,) * 15 + (I,) * 8 + (scalar, scalar))

    def kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label_, loss, gq, gk, gv, gg, gh, dZ, first, stop):
        if label_ != label:
            raise ValueError(f"this kernel reads label {label} (got {label_})")
        _call_grid(fn, D, dtype, 8 + D, Z, y, pos, lens, rows, ((Wq, (D, D)), (Wk, (D, D)), (Wv, (D, D)), (Wg, (D,))),
                   ((loss, ()), (gq, (D, D)), (gk, (D, D)), (gv, (D, 1)), (gg, (D,))), first, stop, blocked)

    return kernel


def _call_grid(fn, D: int, dtype, width: int, Z, y, pos, lens, rows, weights, outputs, first: int, stop: int,
               blocked: bool = False) -> None:
    """Checks a grid kernel's operands (``weights`` and ``outputs``: (array, trailing shape) pairs, after (S, M, G)
    and (S, M, G, NB)) and calls it with a scratch of ``width`` vectors per token of T_max, then 2D + 1. Z has the
    R rows of y or one row that every row of y reads; ``blocked``: Z is their blocked copy (S, RZ, NB, Tmax, D,
    LANES)."""
    if blocked:
        if Z.ndim != 6 or y.ndim != 3 or Z.shape[5] != LANES or Z.shape[2] != -(-y.shape[2] // LANES):
            raise ValueError(f"a blocked grid's Z must be (S, R or 1, ⌈B/{LANES}⌉, Tmax, {D}, {LANES}) for y (S, R, "
                             f"B) (got {Z.shape}, {y.shape})")
        Z5 = Z.shape[:2] + (y.shape[2],) + Z.shape[3:5]
    else:
        Z5 = Z.shape
    S, RZ, B, Tmax, _ = Z5
    R = y.shape[1] if y.ndim == 3 else RZ
    M, G = rows.shape[0], lens.shape[0]
    NB = -(-B // LANES)
    if Z5[4] != D or y.shape != (S, R, B) or RZ not in (1, R) or pos.shape != (G, Tmax):
        raise ValueError(f"grid operands must be Z (S, R or 1, B, Tmax, {D}), y (S, R, B), pos (G, Tmax)")
    for a, tail in weights:
        if a.shape != (S, M, G) + tail:
            raise ValueError(f"grid weights must be (S, M, G) + {tail} (got {a.shape})")
    for a, tail in outputs:
        if a.shape != (S, M, G, NB) + tail:
            raise ValueError(f"grid outputs must be (S, M, G, {NB}) + {tail} per job (got {a.shape})")
    if np.any(lens < 1) or np.any(lens > Tmax) or np.any(rows < 0) or np.any(rows >= R):
        raise ValueError("grid lengths or rows out of range")
    if B * Tmax * D >= 2 ** 31:  # the gathers' 32-bit offsets within one row of Z
        raise ValueError(f"a row of Z must have fewer than 2³¹ entries (got {B} x {Tmax} x {D})")
    SC = aligned_empty((Tmax * width + 2 * D + 1) * LANES, dtype)
    index = np.dtype(np.int64)
    fn(_pointer(Z, dtype), _pointer(y, dtype), *(_pointer(a, index) for a in (pos, lens, rows)),
       *(_pointer(a, dtype) for a, _ in weights + outputs), _pointer(SC, dtype), R, RZ, B, Tmax, M, G, first, stop,
       dtype.type(1.0) / dtype.type(B), dtype.type(2.0) / dtype.type(B))


# --------------------------------------------------------------------------------------------
# Vector gates: gated's grid kernel for φ(W_g z) gates and a head (``gated._VECTOR_KERNEL``)

#: Taylor coefficients 1/k! of e^r, k = 7..0 (Horner's order): on |r| ≤ ln 2 / 2 the truncation error is below
#: 0.35⁸/8! ≈ 6·10⁻⁹, a tenth of float32's half ulp.
_EXP_TAYLOR = tuple(1.0 / float(np.prod(np.arange(1, k + 1, dtype=float))) for k in range(7, -1, -1))
_EXP_CONSTANTS = (-87.0, 1.4426950408889634, 0.693145751953125, 1.4286068203094172e-06) + _EXP_TAYLOR


def _hex(value: float) -> str:
    """A float32 constant in LLVM's exact form (the double whose value is the float32 rounding)."""
    return "0x%016X" % np.float64(np.float32(value)).view(np.uint64)


def _exp_nonpositive(ir: _Builder, x: str) -> str:
    """e^x for float32 lanes x ≤ 0, inline (``llvm.exp`` is 16 calls of the scalar ``expf`` per vector, and the
    vector gates need D of them per token): x = n ln 2 + r (n = round(x / ln 2), ln 2 split in two so that n ln 2's
    leading part is exact), e^r by its Taylor polynomial, times 2ⁿ built in the exponent bits; x is raised to −87
    first (e^−87 ≈ 1.6·10⁻³⁸), so a smaller x gives e^−87, within 2·10⁻³⁸ of the true value. Within 1.3 ulp of
    e^x (tested)."""
    V, I = ir.V, f"<{LANES} x i32>"
    if not any(line.startswith("@exp.c") for line in ir.lines):
        ir.lines.insert(0, f"@exp.c = private constant [{len(_EXP_CONSTANTS)} x float] "
                           f"[{', '.join('float ' + _hex(v) for v in _EXP_CONSTANTS)}]")
    table = ir.opaque("@exp.c")  # read at each use, as the weights: hoisted, the 12 constants would take registers

    def c(v):
        p, r = ir.gep(table, _EXP_CONSTANTS.index(v)), ir.tmp()
        ir.emit(f"{r} = load float, ptr {p}")
        return ir.splat(r)

    xc, nf, neg, ni, e, sh, bits = (ir.tmp() for _ in range(7))
    ir.emit(f"{xc} = call {V} @llvm.maxnum.v{LANES}f32({V} {x}, {V} {c(-87.0)})")
    ir.emit(f"{nf} = call {V} @llvm.rint.v{LANES}f32({V} {ir.mul(xc, c(1.4426950408889634))})")
    ir.emit(f"{neg} = fneg {V} {nf}")
    r = ir.fma(neg, c(1.4286068203094172e-06), ir.fma(neg, c(0.693145751953125), xc))
    p = c(_EXP_TAYLOR[0])
    for coef in _EXP_TAYLOR[1:]:
        p = ir.fma(p, r, c(coef))
    ir.emit(f"{ni} = fptosi {V} {nf} to {I}")
    ir.emit(f"{e} = add {I} {ni}, <{', '.join(['i32 127'] * LANES)}>")
    ir.emit(f"{sh} = shl {I} {e}, <{', '.join(['i32 23'] * LANES)}>")
    ir.emit(f"{bits} = bitcast {I} {sh} to {V}")
    return ir.mul(p, bits)


def _exp2f_table() -> tuple[int, ...]:
    """glibc's ``__exp2f_data.tab``: the bits of 2^(i/32) (correctly rounded doubles) less i << 47, i < 32."""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 60
        powers = [float(Decimal(2) ** (Decimal(i) / Decimal(32))) for i in range(32)]
    return tuple((int(np.float64(v).view(np.uint64)) - (i << 47)) % 2**64 for i, v in enumerate(powers))


#: glibc's expf constants (sysdeps/ieee754/flt-32/e_expf.c, e_exp2f_data.c; N = 32): 32/ln 2, the rounding shift
#: 1.5·2⁵², the scaled cubic's coefficients C₀, C₁, C₂; then 1, and −110 (below which e^x is 0 in float32)
_EXPF_CONSTANTS = (float.fromhex("0x1.71547652b82fep+0") * 32, float.fromhex("0x1.8p+52"),
                   float.fromhex("0x1.c6af84b912394p-5") / 32**3, float.fromhex("0x1.ebfce50fac4f3p-3") / 32**2,
                   float.fromhex("0x1.62e42ff0c52d6p-1") / 32, 1.0, -110.0)


def _expf_glibc(ir: _Builder, x: str) -> str:
    """e^x for float32 lanes x ≤ 0 (or NaN), inline, bit for bit glibc's ``expf`` (its FMA build, which
    ``llvm.exp`` called 16 times per vector: about a third of the gated layers' forward and the query read-out's
    time, with every live vector spilled around each call). In double: z = x·32/ln 2, k = round(z) by the shift,
    r = z − k, s = 2^(k/32) from the 32-entry table and k's high bits in the exponent, e^x ≈ s·(C₀r³ + C₁r² + C₂r + 1)
    rounded once to float. x < −110 reads as −110 (e^x is 0 in float32 there, as glibc's; NaN stays NaN). The tests
    compare it with ``expf`` on every float32 in [−110, 0] and beyond, under the kernels' flush-to-zero."""
    V, D16, I64 = ir.V, f"<{LANES} x double>", f"<{LANES} x i64>"
    if not any(line.startswith("@expf.c") for line in ir.lines):
        bits = ", ".join(f"double 0x{int(np.float64(v).view(np.uint64)):016X}" for v in _EXPF_CONSTANTS)
        tab = ", ".join(f"i64 {t - 2**64 if t >= 2**63 else t}" for t in _exp2f_table())
        ir.lines[:0] = [f"@expf.c = private constant [{len(_EXPF_CONSTANTS)} x double] [{bits}]",
                        f"@expf.tab = private constant [32 x i64] [{tab}]",
                        f"declare {I64} @llvm.masked.gather.v{LANES}i64.v{LANES}p0(<{LANES} x ptr>, i32, "
                        f"<{LANES} x i1>, {I64})",
                        f"declare {D16} @llvm.fma.v{LANES}f64({D16}, {D16}, {D16})"]
    table = ir.opaque("@expf.c")

    def c(v):
        p, r, i, sp = ir.tmp(), ir.tmp(), ir.tmp(), ir.tmp()
        ir.emit(f"{p} = getelementptr double, ptr {table}, i64 {_EXPF_CONSTANTS.index(v)}")
        ir.emit(f"{r} = load double, ptr {p}")
        ir.emit(f"{i} = insertelement {D16} undef, double {r}, i32 0")
        ir.emit(f"{sp} = shufflevector {D16} {i}, {D16} undef, <{LANES} x i32> zeroinitializer")
        return sp

    def op(text):
        r = ir.tmp()
        ir.emit(f"{r} = {text}")
        return r

    def fma(a, b, acc):
        return op(f"call {D16} @llvm.fma.v{LANES}f64({D16} {a}, {D16} {b}, {D16} {acc})")

    low = op(f"fcmp olt {V} {x}, {ir.splat(_hex(-110.0))}")
    xc = op(f"select <{LANES} x i1> {low}, {V} {ir.splat(_hex(-110.0))}, {V} {x}")
    xd = op(f"fpext {V} {xc} to {D16}")
    shift = c(_EXPF_CONSTANTS[1])
    # z = x·32/ln 2 fused into both of its uses, k + shift and r = z − k, as GCC contracts glibc's source
    kd = fma(c(_EXPF_CONSTANTS[0]), xd, shift)
    ki = op(f"bitcast {D16} {kd} to {I64}")
    k = op(f"fsub {D16} {kd}, {shift}")
    r = fma(c(_EXPF_CONSTANTS[0]), xd, op(f"fneg {D16} {k}"))
    idx = op(f"and {I64} {ki}, <{', '.join(['i64 31'] * LANES)}>")
    ptrs = op(f"getelementptr i64, ptr @expf.tab, {I64} {idx}")
    t = op(f"call {I64} @llvm.masked.gather.v{LANES}i64.v{LANES}p0(<{LANES} x ptr> {ptrs}, i32 8, "
           f"<{LANES} x i1> <{', '.join(['i1 true'] * LANES)}>, {I64} undef)")
    high = op(f"shl {I64} {ki}, <{', '.join(['i64 47'] * LANES)}>")  # k's high bits into the exponent
    t = op(f"add {I64} {t}, {high}")
    s2 = op(f"bitcast {I64} {t} to {D16}")
    p = fma(c(_EXPF_CONSTANTS[2]), r, c(_EXPF_CONSTANTS[3]))
    r2 = op(f"fmul {D16} {r}, {r}")
    y = fma(c(_EXPF_CONSTANTS[4]), r, c(_EXPF_CONSTANTS[5]))
    y = fma(p, r2, y)
    y = op(f"fmul {D16} {y}, {s2}")
    return op(f"fptrunc {D16} {y} to {V}")


def _sigmoid_pair(ir: _Builder, a: str) -> tuple[str, str]:
    """(φ(a), φ(−a)) as :func:`_gates` computes them from x = e^{−|a|}, the exponential inline in float32."""
    V, sfx = ir.V, ir.suffix
    r = [ir.tmp() for _ in range(7)]
    ir.emit(f"{r[0]} = call {V} @llvm.fabs.v{LANES}{sfx}({V} {a})")
    ir.emit(f"{r[1]} = fneg {V} {r[0]}")
    if ir.ty == "float":
        x = _exp_nonpositive(ir, r[1])
    else:
        x = r[2]
        ir.emit(f"{x} = call {V} @llvm.exp.v{LANES}{sfx}({V} {r[1]})")
    one = ir.splat("1.0")
    ir.emit(f"{r[3]} = fadd {V} {one}, {x}")
    ir.emit(f"{r[4]} = fdiv {V} {one}, {r[3]}")
    ir.emit(f"{r[5]} = fmul {V} {x}, {r[4]}")
    ir.emit(f"{r[6]} = fcmp oge {V} {a}, zeroinitializer")
    g, sm = ir.tmp(), ir.tmp()
    ir.emit(f"{g} = select <{LANES} x i1> {r[6]}, {V} {r[4]}, {V} {r[5]}")
    ir.emit(f"{sm} = select <{LANES} x i1> {r[6]}, {V} {r[5]}, {V} {r[4]}")
    return g, sm


def vector_query_ir(D: int, dtype, blocked: bool = False) -> str:
    """IR of gated's grid kernel for vector gates and a head, ``query(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg,
    h, loss, gq, gk, gv, gg, gh, SC, R, B, Tmax, M, G, first, stop, inv_B, two_inv_B)``: ŷ = Σ_t s_t Σ_j h_j ω_tj
    v_tj with v_t = W_Vᵀ z_t, ω_tj = Π_{u>t} φ(W_g z_u)_j, s_t = z_tᵀ c, c = W_K W_Qᵀ z_T (``gated``'s module
    docstring), jobs (s, m, g, block of LANES prompts) as :func:`query_loss_ir` with ``grid`` (the prompts
    gathered into SC), outputs per job: loss, W̄_Q, W̄_K, W̄_V, W̄_g (D, D) and h̄ (D).

    The numba kernel's arithmetic with the prompts in lanes (it runs rows of D gates and four BLAS products):
    pass 1 (t ascending) s_t, v_t, the gate logits and φ, φ(−·) (the exponential inline in float32); pass 2
    (descending) ω_t and ŷ (summed over t and j at once, where numba sums each j over t first); pass 3
    (ascending) h̄'s sums, the prefix sums P_tj = Σ_{u<t} h_j ω_uj v_uj s_u, and the rows' cotangents
    X^g_tj = e φ(−a_tj) P_tj, X^v_tj = e h_j ω_tj s_t, c̄_t = e Σ_j h_j ω_tj v_tj; then c̄ = Σ_t c̄_t z_t,
    W̄_V[f, j] = Σ_t z_tf X^v_tj and W̄_g[j, f] = Σ_t X^g_tj z_tf in register tiles of one row, summed over the
    lanes by :func:`_lane_sums`; W̄_K, W̄_Q as in :func:`query_loss_ir`."""
    if D > LANES:
        raise ValueError(f"the vector-gate kernel is built for D ≤ {LANES} (got {D})")
    ir = _Builder(dtype)
    V, zero, ty = ir.V, "zeroinitializer", ir.ty
    ir.lines += [f"declare {V} @llvm.masked.gather.v{LANES}{ir.suffix}.v{LANES}p0(<{LANES} x ptr>, i32, "
                 f"<{LANES} x i1>, {V})"]
    ir.lines.append(f"define void @query(ptr noalias %Z, ptr noalias %y, ptr noalias %pos, ptr noalias %lens, "
                    f"ptr noalias %rows, ptr noalias %WqA, ptr noalias %WkA, ptr noalias %WvA, ptr noalias %WgA, "
                    f"ptr noalias %hA, ptr noalias %loss, ptr noalias %gq, ptr noalias %gk, ptr noalias %gv, "
                    f"ptr noalias %gg, ptr noalias %gh, ptr noalias %SC, i64 %R, i64 %RZ, i64 %B, i64 %Tmax, i64 %M, "
                    f"i64 %G, i64 %first, i64 %stop, {ty} %inv_B, {ty} %two_inv_B) {{")
    # per-token scratch slots: s, v (D), φ (D), φ(−·) (D), ω (D); then X^v (D) and X^g (D) overwrite v and φ,
    # c̄_t the s slot's twin
    W = 4 * D + 2
    ST, XC, VJ, GJ, SMJ, OMJ = 0, 1, 2, 2 + D, 2 + 2 * D, 2 + 3 * D
    ir.label("entry")
    one = ir.splat("1.0")
    ir.emit(f"%qc = mul i64 %Tmax, {W * LANES}")
    QC = ir.gep("%SC", "%qc")
    _grid_entry(ir, D)
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "blk.end", "%first", 1, "%stop")
    zb, yv = _grid_job(ir, D, (("%Wq", "%WqA", D * D, 0), ("%Wk", "%WkA", D * D, 0), ("%Wv", "%WvA", D * D, 0),
                               ("%Wg", "%WgA", D * D, 0), ("%h", "%hA", D, 0)), blocked)
    zqp, _ = _query_keys(ir, D, zb, QC, blocked)
    ir.emit("br label %p1")

    def token(loop):
        ir.emit(f"%{loop}.zo = mul i64 %{loop}.i, {D * LANES}")
        ir.emit(f"%{loop}.so = mul i64 %{loop}.i, {W * LANES}")
        if blocked:  # token P[t] of the job's block (_grid_job)
            ir.emit(f"%{loop}.pp = getelementptr i64, ptr %P, i64 %{loop}.i")
            ir.emit(f"%{loop}.pt = load i64, ptr %{loop}.pp")
            ir.emit(f"%{loop}.zo2 = mul i64 %{loop}.pt, {D * LANES}")
            return ir.gep(zb, f"%{loop}.zo2"), ir.gep("%SC", f"%{loop}.so")
        return ir.gep(zb, f"%{loop}.zo"), ir.gep("%SC", f"%{loop}.so")

    # pass 1: s_t, v_t = W_Vᵀ z_t, the gates of W_g z_t
    _loop_head(ir, "p1", "gz.done", "p1.body", "0", 1, "%T")
    zp, sp = token("p1")
    z = [ir.load(zp, f) for f in range(D)]
    cs = ir.opaque(QC)
    ir.store(ir.dot([ir.load(cs, D + f) for f in range(D)], z), sp, ST)
    for j in range(D):
        ir.store(ir.dot([ir.weight("%Wv", D, f, j) for f in range(D)], z), sp, VJ + j)
    for j in range(D):
        g, sm = _sigmoid_pair(ir, ir.dot([ir.weight("%Wg", D, j, f) for f in range(D)], z))
        ir.store(g, sp, GJ + j)
        ir.store(sm, sp, SMJ + j)
    ir.emit("br label %p1")
    ir.label("p1.done")
    ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("br label %p2")
    # pass 2, t descending: ω_tj (before the gate of t), ŷ += Σ_j h_j ω_tj v_tj s_t
    ir.label("p2")
    ir.emit("%p2.i = phi i64 [%Tm1, %p1.done], [%p2.n, %p2.body]")
    ob = [f"%ob{j}" for j in range(D)]
    at = len(ir.lines)
    ir.emit(f"%yh = phi {V} [{zero}, %p1.done], [%yh.n, %p2.body]")
    ir.emit("%p2.c = icmp sge i64 %p2.i, 0")
    ir.emit("br i1 %p2.c, label %p2.body, label %p2.done")
    ir.label("p2.body")
    ir.emit("%p2.n = sub i64 %p2.i, 1")
    _, sp = token("p2")
    sv = ir.load(sp, ST)
    ya = None
    obn = []
    for j in range(D):
        ir.store(ob[j], sp, OMJ + j)
        hv = ir.mul(ir.weight("%h", D, 0, j), ir.mul(ob[j], ir.load(sp, VJ + j)))
        ya = hv if ya is None else ir.add(ya, hv)
        obn.append(ir.mul(ob[j], ir.load(sp, GJ + j)))
    ir.emit(f"%yh.n = call {V} @{ir.fma_name}({V} {ya}, {V} {sv}, {V} %yh)")
    ir.emit("br label %p2")
    ir.lines[at:at] = [f"  {ob[j]} = phi {V} [{one}, %p1.done], [{obn[j]}, %p2.body]" for j in range(D)]
    ir.label("p2.done")
    err = _sub(ir, "%yh", yv)
    e = _block_loss(ir, D, err)
    ir.emit("br label %p3")
    # pass 3, t ascending: h̄'s sums dh_j, the prefix sums P_j, the rows' cotangents
    ir.label("p3")
    ir.emit("%p3.i = phi i64 [0, %p2.done], [%p3.n, %p3.body]")
    pre, dh = [f"%pre{j}" for j in range(D)], [f"%dh{j}" for j in range(D)]
    at = len(ir.lines)
    ir.emit("%p3.c = icmp slt i64 %p3.i, %T")
    ir.emit("br i1 %p3.c, label %p3.body, label %p3.done")
    ir.label("p3.body")
    ir.emit("%p3.n = add i64 %p3.i, 1")
    _, sp = token("p3")
    sv = ir.load(sp, ST)
    es = ir.mul(e, sv)
    a, pren, dhn = None, [], []
    for j in range(D):
        o = ir.load(sp, OMJ + j)
        ov = ir.mul(o, ir.load(sp, VJ + j))
        hj = ir.weight("%h", D, 0, j)
        a = ir.mul(hj, ov) if a is None else ir.fma(hj, ov, a)
        dhn.append(ir.fma(ov, sv, dh[j]))
        ir.store(ir.mul(ir.mul(e, ir.load(sp, SMJ + j)), pre[j]), sp, GJ + j)  # X^g over φ
        pren.append(ir.fma(ir.mul(hj, ov), sv, pre[j]))
        ir.store(ir.mul(ir.mul(es, hj), o), sp, VJ + j)  # X^v over v
    ir.store(ir.mul(e, a), sp, XC)
    ir.emit("br label %p3")
    ir.lines[at:at] = ([f"  {pre[j]} = phi {V} [{zero}, %p2.done], [{pren[j]}, %p3.body]" for j in range(D)]
                       + [f"  {dh[j]} = phi {V} [{zero}, %p2.done], [{dhn[j]}, %p3.body]" for j in range(D)])
    ir.label("p3.done")
    ir.emit(f"%vo = mul i64 {ir.job}, {D}")
    _store_lanes(ir, _lane_sums(ir, [ir.mul(e, dh[j]) for j in range(D)]), "%gh", "%vo", D)
    ir.emit(f"%wo = mul i64 {ir.job}, {D * D}")
    # W̄_V[f, :] = Σ_t z_tf X^v_t, W̄_g[j, :] = Σ_t X^g_tj z_t: one row per loop, D accumulators (phis); then c̄
    prev = "p3.done"
    rows = [("v", f, VJ) for f in range(D)] + [("g", j, GJ) for j in range(D)] + [("c", 0, XC)]
    for kind, row, slot in rows:
        name = f"{kind}{row}"

        def products(zp, sp, kind=kind, row=row, slot=slot):
            if kind == "v":  # z_tf times the row X^v_t
                x, rp = ir.load(zp, row), ir.opaque(sp)
                return [(x, ir.load(rp, slot + j)) for j in range(D)]
            x, zr = ir.load(sp, slot + (row if kind == "g" else 0)), ir.opaque(zp)  # X^g_tj (or c̄_t) times z_t
            return [(x, ir.load(zr, f)) for f in range(D)]

        acc = _token_sums(ir, name, prev, D, token, products, names=lambda f, n=name: f"%{n}.a{f}")
        prev = f"{name}.done"
        if kind != "c":
            ir.emit(f"%{name}.o = add i64 %wo, {row * D}")
            _store_lanes(ir, _lane_sums(ir, acc), "%gv" if kind == "v" else "%gg", f"%{name}.o", D)
    _key_query_grads(ir, D, acc, QC, zqp)
    return _close_blocks(ir)


@functools.cache
def vector_grid_kernel(D: int, dtype, blocked: bool = False):
    """:func:`vector_query_ir` compiled on first use, with the numba vector kernel's signature
    (``gated._VECTOR_KERNEL``): ``kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv, gg,
    gh, dZ, first, stop)`` over jobs (s, m, g, block) of LANES prompts, outputs per job (loss (S, M, G, NB), gq, gk,
    gv, gg (…, NB, D, D), gh (…, NB, D), NB = ⌈B / LANES⌉); label and dZ unused (a head reads the values). ``blocked``: Z is the prompts' blocked
    copy, as :func:`query_grid_kernel`'s."""
    dtype = np.dtype(dtype)
    scalar = _TYPES[dtype][2]
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = compile_function(vector_query_ir(D, dtype, blocked), "query", None, (P,) * 17 + (I,) * 8 + (scalar, scalar))

    def kernel(Z, y, pos, lens, rows, Wq, Wk, Wv, Wg, h, label, loss, gq, gk, gv, gg, gh, dZ, first, stop):
        _call_grid(fn, D, dtype, 4 * D + 2 + D, Z, y, pos, lens, rows,
                   ((Wq, (D, D)), (Wk, (D, D)), (Wv, (D, D)), (Wg, (D, D)), (h, (D,))),
                   ((loss, ()), (gq, (D, D)), (gk, (D, D)), (gv, (D, D)), (gg, (D, D)), (gh, (D,))), first, stop,
                   blocked)

    return kernel
