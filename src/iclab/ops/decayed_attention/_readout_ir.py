"""drift's one-layer GLA read-out loss of a (G, K) grid on the shared layout, with its gradients, as one LLVM IR
kernel (float32 or float64, 16 lanes of either): ``forget.readout_mse_shared``'s host side.

For row g's prompts z_gbt = (x_bt, y_gbt) (t = 0..T-1, the query z_q = z_{T-1} with label 0) and model k of the row
(u = (W_V)_{d+1,:}, M = W^{KQ} = W_Kᵀ W_Q, forget factor λ):

    c = M z_q,   a_t = u·z_t,   s_t = c·z_t,   ω_t = λ^{T-1-t},   ŷ = Σ_t ω_t a_t s_t,
    ℓ = (1/B) Σ_b (ŷ_b − y_b)²,   e_b = 2(ŷ_b − y_b)/B,
    ∂ℓ/∂u = Σ_b e_b Σ_t ω_t s_t z_t,   ∂ℓ/∂M = Σ_b e_b (Σ_t ω_t a_t z_t) z_qᵀ,   ∂ℓ/∂λ = Σ_b e_b Σ_t ω'_t a_t s_t,

ω'_t = (T-1-t) λ^{T-2-t}, both by the recursions ω_{t-1} = λ ω_t and ω'_{t-1} = λ ω'_t + ω_t from ω_{T-1} = 1,
ω'_{T-1} = 0. The naive twin is ``gla_forget.gla_readout`` with JAX's gradient (tests compare them).

Why a kernel: the read-out kernel ``forget.readout_grid_shared`` returns ŷ and the residuals H, J
(∂ŷ/∂c, ∂ŷ/∂u per prompt: 2 × 40 MB at drift.fig1's paper batch), from which XLA forms the gradients; and it
keeps its 2D + 1 accumulators per lane in memory (a read, an FMA and a store each per token). Here a job is a
block of LANES prompts (the lanes), gathered once into a (T, D, LANES) scratch for all G rows (only the label
column is rewritten per row), and each model of the block runs three passes over its tokens: (1) s_t and a_t,
(2) t descending: ω_t, ŷ and ŷ' = ∂ŷ/∂λ, then the loss and e; (3) c̄ = e Σ_t ω_t a_t z_t and ū = e Σ_t ω_t s_t z_t,
2D accumulators. Passes (1) and (3) go over the tokens a chunk at a time (:data:`CHUNK`) for all K models of
the row: a block's tokens (71 KB at drift.fig1's T = 101, D = 11) overflow L1, a chunk's do not, so the K models
read them from L1 instead of each from L2 (the same bits, tested).

Register tiles: both passes work on sub-vectors of one 256-bit register (W = 8 float32 or 4 float64 of the
LANES lanes; AVX2, 16 registers), a LANES-wide vector being 2 or 4 registers. Pass (1) computes :data:`TOKENS`
tokens at a time, so that each c_f and u_f loaded serves their 2·TOKENS chains (rather than two chains a token,
c's D sub-vectors loaded again for each). Pass (3) first writes e ω_t a_t and e ω_t s_t into the slots of a_t
and s_t, then accumulates :data:`COLUMNS` features of c̄ and ū at a time over the chunk's tokens, 2·COLUMNS
accumulators in registers (2D LANES-wide accumulators would be 44 registers at D = 11, spilled and reloaded at
every FMA). Every FMA chain keeps its operands and its order (over f for s_t and a_t, over t for c̄ and ū), so
the tiles change no bit (tested against one token and one feature a tile).

Flops per (prompt, model): 2D² (c), 4TD (a_t, s_t; then the 2D accumulations), the floor's 2(4TD + 4D²) with
M̄'s 2D² (``iclab.benches.drift``); plus O(T) for ω and the sums.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from iclab.ops._runtime.llvm import compile_function
from iclab.ops._runtime.blocked import LANES
from iclab.ops.decayed_attention._layer_ir import (_TYPES, _Builder, _gather, _lane_sums, _loop_head, _pointer, _scratch,
                                    _rows_loop, _splat_i64, _store_lanes)

__all__ = ["readout_mse_kernel"]

#: Per-token slots of the scratch after the gathered tokens: s_t, a_t, ω_t.
_S, _A, _OM = range(3)
_SLOTS = 3

#: Tokens per chunk of passes (1) and (3): chunk · D vectors (22 KB at D = 11 in float32) stay in L1 (48 KB here).
CHUNK = 32

#: Tokens per register tile of pass (1): 2·TOKENS accumulators, c_f, u_f and z_tf in 16 registers.
TOKENS = 4

#: Features per register tile of pass (3): 2·COLUMNS accumulators and the two weights of a token in 16 registers.
COLUMNS = 6

#: Bytes of one vector register (AVX2, this project's CPUs): the register tiles' sub-vectors.
REGISTER_BYTES = 32


class _SubVectors:
    """Sub-vectors of W lanes (one register: W = 8 float32 or 4 float64) of a builder's LANES-wide vectors, the
    h-th of the vector in slot ``slot`` at ``slot``·LANES + h·W scalars. The register tiles are counted in them: a
    LANES-wide vector is LANES / W registers, so 2D LANES-wide accumulators (44 registers at D = 11 in float32)
    spill on a CPU with 16."""

    def __init__(self, ir: _Builder):
        self.ir = ir
        self.W = REGISTER_BYTES // (4 if ir.ty == "float" else 8)
        self.count = LANES // self.W
        self.V = f"<{self.W} x {ir.ty}>"
        self.fma_name = f"llvm.fma.v{self.W}{ir.suffix}"
        declare = f"declare {self.V} @{self.fma_name}({self.V}, {self.V}, {self.V})"
        if declare not in ir.lines:  # (``_Builder.half`` may have declared it)
            ir.lines.insert(0, declare)

    def load(self, base: str, slot: int, h: int) -> str:
        p, r = self.ir.gep(base, slot * LANES + h * self.W), self.ir.tmp()
        self.ir.emit(f"{r} = load {self.V}, ptr {p}, align 4")
        return r

    def store(self, value: str, base: str, slot: int, h: int) -> None:
        self.ir.emit(f"store {self.V} {value}, ptr {self.ir.gep(base, slot * LANES + h * self.W)}, align 4")

    def broadcast(self, base: str, index: int) -> str:
        """base[index] (a scalar) in every lane."""
        p, s, i, r = self.ir.gep(base, index), self.ir.tmp(), self.ir.tmp(), self.ir.tmp()
        self.ir.emit(f"{s} = load {self.ir.ty}, ptr {p}")
        self.ir.emit(f"{i} = insertelement {self.V} undef, {self.ir.ty} {s}, i32 0")
        self.ir.emit(f"{r} = shufflevector {self.V} {i}, {self.V} undef, <{self.W} x i32> zeroinitializer")
        return r

    def chain(self, w: str, x: str, acc: str | None) -> str:
        """acc + w x by one FMA (w x rounded when acc is None: the first term of a dot, as ``_Builder.dot``)."""
        r = self.ir.tmp()
        if acc is None:
            self.ir.emit(f"{r} = fmul {self.V} {w}, {x}")
        else:
            self.ir.emit(f"{r} = call {self.V} @{self.fma_name}({self.V} {w}, {self.V} {x}, {self.V} {acc})")
        return r


def _split(n: int, size: int) -> list[tuple[int, int]]:
    """[0, n) in ⌈n / size⌉ contiguous ranges whose sizes differ by at most one."""
    k = -(-n // size)
    edges = [n * i // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _loop_end(ir: _Builder, name: str) -> None:
    """Closes the loop ``name`` opened by ``_loop_head`` whose latch is the block ``name.end``."""
    ir.emit(f"br label %{name}.end")
    ir.label(f"{name}.end")
    ir.emit(f"br label %{name}")
    ir.label(f"{name}.done")


def readout_mse_ir(D: int, dtype, chunk: int | None = None, tokens: int | None = None,
                   columns: int | None = None) -> str:
    """IR of ``readout(X, Y, y, M, U, lam, loss, gM, gu, glam, SC, G, K, B, T, first, stop, inv_B, two_inv_B)``
    (module docstring) for the blocks [first, stop) of LANES prompts: X (B, T, D-1), Y (G, B, T), y (G, B), M (G,
    K, D, D), U (G, K, D), lam (G, K); per (model, block) outputs loss (G, K, NB), gM (G, K, NB, D, D), gu (G, K,
    NB, D), glam (G, K, NB), NB = ⌈B / LANES⌉; SC one thread's scratch of :func:`scratch_vectors` vectors. Spare
    lanes read zero tokens and targets (masked gathers), so they add nothing.

    Passes (1) and (3) run over ``chunk`` tokens at a time for all K models of a row, so that a chunk's tokens
    (chunk · D vectors) stay in L1 while the K models read them; each model's s_t, a_t, ω_t, e and pass-3
    accumulators wait in the scratch between chunks. Every model's operations and their order are those of one
    model at a time, so the chunking changes no bit (tested). ``chunk``, ``tokens``, ``columns``: None for
    :data:`CHUNK`, :data:`TOKENS` and :data:`COLUMNS` (the register tiles of passes (1) and (3); no bit either)."""
    chunk = CHUNK if chunk is None else int(chunk)
    tokens = TOKENS if tokens is None else int(tokens)
    columns = COLUMNS if columns is None else int(columns)
    for name, value in (("chunk", chunk), ("tokens", tokens), ("columns", columns)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1 (got {value})")
    ir = _Builder(dtype)
    V, ty = ir.V, ir.ty
    IV = f"<{LANES} x i64>"
    ir.lines.append(f"declare {V} @llvm.masked.gather.v{LANES}{ir.suffix}.v{LANES}p0(<{LANES} x ptr>, i32, "
                    f"<{LANES} x i1>, {V})")
    ir.lines.append(f"define void @readout(ptr noalias %X, ptr noalias %Y, ptr noalias %y, ptr noalias %MA, "
                    f"ptr noalias %UA, ptr noalias %lamA, ptr noalias %loss, ptr noalias %gM, ptr noalias %gu, "
                    f"ptr noalias %glam, ptr noalias %SC, i64 %G, i64 %K, i64 %B, i64 %T, i64 %first, i64 %stop, "
                    f"{ty} %inv_B, {ty} %two_inv_B) {{")
    lanes = "<" + ", ".join(f"i64 {b}" for b in range(LANES)) + ">"
    ir.label("entry")
    ir.emit(f"%Bp = add i64 %B, {LANES - 1}")
    ir.emit(f"%NB = udiv i64 %Bp, {LANES}")
    ir.emit(f"%xrow = mul i64 %T, {D - 1}")  # X's stride between prompts
    # the scratch (in scalars): the block's tokens (T, D), then per model its slots (T, 3), its c (D), its e (1)
    # and its pass-3 accumulators (2D), then a scalar slot for the loss
    ir.emit(f"%sab = mul i64 %T, {D * LANES}")
    ir.emit(f"%mst = mul i64 %T, {_SLOTS * LANES}")
    ir.emit("%sasz = mul i64 %K, %mst")
    ir.emit("%cb = add i64 %sab, %sasz")
    ir.emit(f"%csz = mul i64 %K, {D * LANES}")
    ir.emit("%eb = add i64 %cb, %csz")
    ir.emit(f"%esz = mul i64 %K, {LANES}")
    ir.emit("%ab = add i64 %eb, %esz")
    ir.emit(f"%asz = mul i64 %K, {2 * D * LANES}")
    ir.emit("%lso = add i64 %ab, %asz")
    ir.emit(f"%zqo = sub i64 %sab, {D * LANES}")  # the query token
    ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("br label %blk")
    _loop_head(ir, "blk", "entry", "blk.end", "%first", 1, "%stop")
    ir.emit(f"%b0 = mul i64 %blk.i, {LANES}")
    ir.emit("%rem = sub i64 %B, %b0")
    ir.emit(f"%mask = icmp slt {IV} {lanes}, {_splat_i64(ir, '%rem')}")
    ir.emit(f"%prompt = add {IV} {lanes}, {_splat_i64(ir, '%b0')}")
    ir.emit(f"%xo64 = mul {IV} %prompt, {_splat_i64(ir, '%xrow')}")
    ir.emit(f"%xo = trunc {IV} %xo64 to <{LANES} x i32>")  # < 2³¹ (checked)
    ir.emit(f"%yo64 = mul {IV} %prompt, {_splat_i64(ir, '%T')}")
    ir.emit(f"%yo = trunc {IV} %yo64 to <{LANES} x i32>")
    ir.emit(f"%po = trunc {IV} %prompt to <{LANES} x i32>")
    ir.emit("br label %gx")
    # the block's inputs into the scratch, token t at t·D vectors (the label column below, per row)
    _loop_head(ir, "gx", "blk.body", "gx.body", "0", 1, "%T")
    ir.emit(f"%gx.xo = mul i64 %gx.i, {D - 1}")
    src = ir.gep("%X", "%gx.xo")
    ir.emit(f"%gx.zo = mul i64 %gx.i, {D * LANES}")
    dst = ir.gep("%SC", "%gx.zo")
    for f in range(D - 1):
        ir.store(_gather(ir, ir.gep(src, f), "%xo", "%mask"), dst, f)
    ir.emit("br label %gx")
    ir.label("gx.done")
    ir.emit("br label %rg")
    _loop_head(ir, "rg", "gx.done", "rg.end", "0", 1, "%G")
    ir.emit("%rg.yr = mul i64 %rg.i, %B")
    ir.emit("%rg.Yr = mul i64 %rg.yr, %T")
    Yrow = ir.gep("%Y", "%rg.Yr")
    ir.emit("%rg.m0 = mul i64 %rg.i, %K")
    ir.emit("br label %gy")
    _loop_head(ir, "gy", "rg.body", "gy.body", "0", 1, "%T")
    ir.emit(f"%gy.zo = mul i64 %gy.i, {D * LANES}")
    ir.store(_gather(ir, ir.gep(Yrow, "%gy.i"), "%yo", "%mask"), ir.gep("%SC", "%gy.zo"), D - 1)
    ir.emit("br label %gy")
    ir.label("gy.done")
    yv = _gather(ir, ir.gep("%y", "%rg.yr"), "%po", "%mask")
    zqp = ir.gep("%SC", "%zqo")

    def model(loop):
        """Model k = %{loop}.i of the row: its index, weight pointers and scratch pointers (slots, c, e, acc)."""
        ir.emit(f"%{loop}.m = add i64 %rg.m0, %{loop}.i")
        ir.emit(f"%{loop}.mo = mul i64 %{loop}.m, {D * D}")
        ir.emit(f"%{loop}.uo = mul i64 %{loop}.m, {D}")
        ir.emit(f"%{loop}.Mp = getelementptr {ty}, ptr %MA, i64 %{loop}.mo")
        ir.emit(f"%{loop}.Up = getelementptr {ty}, ptr %UA, i64 %{loop}.uo")
        ptrs = {}
        for name, base, size in (("sa", "%sab", "%mst"), ("c", "%cb", D * LANES), ("e", "%eb", LANES),
                                 ("acc", "%ab", 2 * D * LANES)):
            ir.emit(f"%{loop}.{name}0 = mul i64 %{loop}.i, {size}")
            ir.emit(f"%{loop}.{name}1 = add i64 %{loop}.{name}0, {base}")
            ptrs[name] = ir.gep("%SC", f"%{loop}.{name}1")
        return ptrs

    def token(loop, sa):
        ir.emit(f"%{loop}.zo = mul i64 %{loop}.i, {D * LANES}")
        ir.emit(f"%{loop}.so = mul i64 %{loop}.i, {_SLOTS * LANES}")
        return ir.gep("%SC", f"%{loop}.zo"), ir.gep(sa, f"%{loop}.so")

    def chunk_models(chunks, models, entry):
        """Opens the loop over chunks [%chunks.i, %chunks.e) of the tokens (entered from the block ``entry``) and in
        it the loop over the row's models; returns the model's pointers (``model``)."""
        ir.emit(f"br label %{chunks}")
        _loop_head(ir, chunks, entry, f"{chunks}.end", "0", chunk, "%T")
        ir.emit(f"%{chunks}.t = add i64 %{chunks}.i, {chunk}")
        ir.emit(f"%{chunks}.lt = icmp slt i64 %{chunks}.t, %T")
        ir.emit(f"%{chunks}.e = select i1 %{chunks}.lt, i64 %{chunks}.t, i64 %T")
        ir.emit(f"br label %{models}")
        _loop_head(ir, models, f"{chunks}.body", f"{models}.end", "0", 1, "%K")
        return model(models)

    # c = M z_q of every model of the row
    ir.emit("br label %kc")
    _loop_head(ir, "kc", "gy.done", "kc.end", "0", 1, "%K")
    p = model("kc")
    zq = [ir.load(zqp, f) for f in range(D)]
    c = ir.dots([([ir.weight("%kc.Mp", D, f, j) for j in range(D)], zq, None) for f in range(D)])
    for f, x in enumerate(c):
        ir.store(x, p["c"], f)
    _loop_end(ir, "kc")
    # pass 1, chunk by chunk, model by model, sub-vector by sub-vector: s_t = c·z_t, a_t = u·z_t, ``tokens`` tokens a
    # tile (then the chunk's last tokens one at a time), each chain over f from the left as ``ir.dot``'s
    sub = _SubVectors(ir)
    p = chunk_models("c1", "k1", "kc.done")
    prev = "k1.body"
    for h in range(sub.count):
        for L, n, start in ((f"tile{h}", tokens, "%c1.i"), (f"tail{h}", 1, f"%tile{h}.i")):
            ir.emit(f"br label %{L}")
            ir.label(L)
            ir.emit(f"%{L}.i = phi i64 [{start}, %{prev}], [%{L}.n, %{L}.body]")
            ir.emit(f"%{L}.t = add i64 %{L}.i, {n}")
            ir.emit(f"%{L}.c = icmp sle i64 %{L}.t, %c1.e")
            ir.emit(f"br i1 %{L}.c, label %{L}.body, label %{L}.done")
            ir.label(f"{L}.body")
            ir.emit(f"%{L}.n = add i64 %{L}.i, {n}")
            up, cp = ir.opaque("%k1.Up"), ir.opaque(p["c"])  # u and c read in the loop, not hoisted and spilled
            zs, sas = [], []
            for j in range(n):
                ir.emit(f"%{L}.t{j}.i = add i64 %{L}.i, {j}")
                zp, sp = token(f"{L}.t{j}", p["sa"])
                zs.append(zp)
                sas.append(sp)
            s_, a_ = [None] * n, [None] * n
            for f in range(D):
                cf, uf = sub.load(cp, f, h), sub.broadcast(up, f)
                for j in range(n):
                    z = sub.load(zs[j], f, h)
                    s_[j], a_[j] = sub.chain(cf, z, s_[j]), sub.chain(uf, z, a_[j])
            for j in range(n):
                sub.store(s_[j], sas[j], _S, h)
                sub.store(a_[j], sas[j], _A, h)
            ir.emit(f"br label %{L}")
            ir.label(f"{L}.done")
            prev = f"{L}.done"
    _loop_end(ir, "k1")
    _loop_end(ir, "c1")
    # pass 2, model by model, t descending: ω_t (stored), ŷ += ω_t a_t s_t, ŷ' += ω'_t a_t s_t; the loss and e
    ir.emit("br label %k2")
    _loop_head(ir, "k2", "c1.done", "k2.end", "0", 1, "%K")
    p = model("k2")
    ir.emit(f"%lams = load {ty}, ptr {ir.gep('%lamA', '%k2.m')}")
    lam = ir.splat("%lams")
    ir.emit("%o1 = mul i64 %k2.m, %NB")
    ir.emit("%o = add i64 %o1, %blk.i")  # this (model, block)'s output slot
    ir.emit("br label %p2")
    ir.label("p2")
    ir.emit("%p2.i = phi i64 [%Tm1, %k2.body], [%p2.n, %p2.body]")
    one = "<" + ", ".join([f"{ty} 1.0"] * LANES) + ">"
    for name, init in (("om", one), ("omp", "zeroinitializer"), ("yh", "zeroinitializer"),
                       ("dl", "zeroinitializer")):
        ir.emit(f"%{name} = phi {V} [{init}, %k2.body], [%{name}.n, %p2.body]")
    ir.emit("%p2.c = icmp sge i64 %p2.i, 0")
    ir.emit("br i1 %p2.c, label %p2.body, label %p2.done")
    ir.label("p2.body")
    ir.emit("%p2.n = sub i64 %p2.i, 1")
    _, sp = token("p2", p["sa"])
    ir.store("%om", sp, _OM)
    sa = ir.mul(ir.load(sp, _A), ir.load(sp, _S))
    ir.emit(f"%yh.n = call {V} @{ir.fma_name}({V} %om, {V} {sa}, {V} %yh)")
    ir.emit(f"%dl.n = call {V} @{ir.fma_name}({V} %omp, {V} {sa}, {V} %dl)")
    ir.emit(f"%omp.n = call {V} @{ir.fma_name}({V} {lam}, {V} %omp, {V} %om)")
    ir.emit(f"%om.n = fmul {V} {lam}, %om")
    ir.emit("br label %p2")
    ir.label("p2.done")
    err = ir.tmp()
    ir.emit(f"{err} = fsub {V} %yh, {yv}")
    ir.lane_sum(ir.mul(err, err), "%SC", "%lso")
    ls, lsc = ir.tmp(), ir.tmp()
    ir.emit(f"{ls} = load {ty}, ptr {ir.gep('%SC', '%lso')}")
    ir.emit(f"{lsc} = fmul {ty} {ls}, %inv_B")
    ir.emit(f"store {ty} {lsc}, ptr {ir.gep('%loss', '%o')}")
    e = ir.mul(ir.splat("%two_inv_B"), err)
    ir.store(e, p["e"], 0)
    ir.lane_sum(ir.mul(e, "%dl"), "%glam", "%o")
    for i in range(2 * D):  # pass 3's accumulators start at zero (fma(x, z, +0) = x z rounded, as before)
        ir.store("zeroinitializer", p["acc"], i)
    _loop_end(ir, "k2")
    # pass 3, chunk by chunk, model by model: e ω_t a_t and e ω_t s_t into the slots of a_t and s_t, then
    # c̄ = Σ_t (e ω_t a_t) z_t and ū = Σ_t (e ω_t s_t) z_t, ``columns`` features a tile, sub-vector by sub-vector
    p = chunk_models("c3", "k3", "k2.done")
    ev = ir.load(p["e"], 0)
    ir.emit("br label %xs")
    _loop_head(ir, "xs", "k3.body", "xs.body", "%c3.i", 1, "%c3.e")
    _, sp = token("xs", p["sa"])
    eo = ir.mul(ev, ir.load(sp, _OM))
    ir.store(ir.mul(eo, ir.load(sp, _A)), sp, _A)
    ir.store(ir.mul(eo, ir.load(sp, _S)), sp, _S)
    ir.emit("br label %xs")
    ir.label("xs.done")
    prev = "xs.done"
    for h in range(sub.count):
        for ct, (f0, f1) in enumerate(_split(D, columns)):
            fs = range(f0, f1)
            slots = [(_A, f, f) for f in fs] + [(_S, f, D + f) for f in fs]  # (weight's slot, feature, acc slot)
            init = [sub.load(p["acc"], i, h) for _, _, i in slots]
            L = f"acc{h}_{ct}"

            def tokens_of_tile(_, accs, L=L, slots=slots, fs=fs, h=h):  # token %{L}.i of the chunk
                zp, sp = token(L, p["sa"])
                x = {_A: sub.load(sp, _A, h), _S: sub.load(sp, _S, h)}
                new = [None] * len(slots)
                for f in fs:  # z_tf loaded when its two FMAs use it: 2·COLUMNS + 3 registers live
                    z = sub.load(zp, f, h)
                    for j, (w, g, _) in enumerate(slots):
                        if g == f:
                            new[j] = sub.chain(x[w], z, accs[j])
                return new

            accs = _rows_loop(ir, L, prev, "%c3.e", init, tokens_of_tile, start="%c3.i", vector=sub.V)
            for j, (_, _, i) in enumerate(slots):
                sub.store(accs[j], p["acc"], i, h)
            prev = f"{L}.done"
    _loop_end(ir, "k3")
    _loop_end(ir, "c3")
    # each model's gradients of u and W^{KQ}: lane sums of its accumulators
    ir.emit("br label %k4")
    _loop_head(ir, "k4", "c3.done", "k4.end", "0", 1, "%K")
    p = model("k4")
    ir.emit("%o41 = mul i64 %k4.m, %NB")
    ir.emit("%o4 = add i64 %o41, %blk.i")
    ar = ir.opaque(p["acc"])
    acc = [ir.load(ar, i) for i in range(2 * D)]
    dc, du = acc[:D], acc[D:]
    ir.emit(f"%guo = mul i64 %o4, {D}")
    for f0 in range(0, D, LANES):
        part = du[f0:f0 + LANES]
        ir.emit(f"%guo{f0} = add i64 %guo, {f0}")
        _store_lanes(ir, _lane_sums(ir, part), "%gu", f"%guo{f0}", len(part))
    ir.emit(f"%gmo = mul i64 %o4, {D * D}")
    zr = ir.opaque(zqp)
    for f in range(D):
        for j0 in range(0, D, LANES):
            js = range(j0, min(D, j0 + LANES))
            ir.emit(f"%gmo{f}_{j0} = add i64 %gmo, {f * D + j0}")
            _store_lanes(ir, _lane_sums(ir, [ir.mul(dc[f], ir.load(zr, j)) for j in js]), "%gM", f"%gmo{f}_{j0}",
                         len(js))
    _loop_end(ir, "k4")
    _loop_end(ir, "rg")
    _loop_end(ir, "blk")
    ir.emit("ret void")
    return ir.text()


def scratch_vectors(D: int, K: int, T: int) -> int:
    """The vectors of one thread's scratch of :func:`readout_mse_ir`: the tokens (T D), per model its slots (3T),
    c (D), e (1) and pass-3 accumulators (2D), and one for the loss."""
    return T * D + K * (_SLOTS * T + 3 * D + 1) + 1


@functools.cache
def readout_mse_kernel(D: int, dtype=np.float32, chunk: int | None = None, tokens: int | None = None,
                       columns: int | None = None):
    """The kernel of :func:`readout_mse_ir` (``chunk`` tokens per chunk, ``tokens`` and ``columns`` its register
    tiles; None: :data:`CHUNK`, :data:`TOKENS`, :data:`COLUMNS`), compiled on first
    use: ``readout(X, Y, y, M, U, lam, loss, gM, gu, glam, first, stop)`` on numpy arrays (shapes in
    :func:`readout_mse_ir`; C-contiguous, of ``dtype``) over the blocks [first, stop); releases the GIL
    (``iclab.threads.run_split`` runs it on threads)."""
    dtype = np.dtype(dtype)
    scalar = _TYPES[dtype][2]
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = compile_function(readout_mse_ir(D, dtype, chunk, tokens, columns), "readout", None, (P,) * 11 + (I,) * 6 + (scalar, scalar))

    def readout(X, Y, y, M, U, lam, loss, gM, gu, glam, first, stop):
        G, B, T = Y.shape
        K = U.shape[1]
        NB = -(-B // LANES)
        if X.shape != (B, T, D - 1) or y.shape != (G, B) or T < 1:
            raise ValueError(f"read-out operands must be X (B, T, {D - 1}), Y (G, B, T), y (G, B) "
                             f"(got {X.shape}, {Y.shape}, {y.shape})")
        if M.shape != (G, K, D, D) or U.shape != (G, K, D) or lam.shape != (G, K):
            raise ValueError(f"read-out weights must be (G, K, {D}, {D}), (G, K, {D}), (G, K)")
        if loss.shape != (G, K, NB) or gM.shape != (G, K, NB, D, D) or gu.shape != (G, K, NB, D) \
                or glam.shape != (G, K, NB):
            raise ValueError(f"read-out outputs must be per (model, block): (G, K, {NB}) [+ ({D}, {D}) or ({D},)]")
        if B * T * D >= 2 ** 31:  # the gathers' 32-bit offsets
            raise ValueError(f"a batch must have fewer than 2³¹ token entries (got {B} x {T} x {D})")
        SC = _scratch(1, scratch_vectors(D, K, T) * LANES, dtype)
        fn(*(_pointer(a, dtype) for a in (X, Y, y, M, U, lam, loss, gM, gu, glam)), SC, G, K, B, T, first, stop,
           dtype.type(1.0) / dtype.type(B), dtype.type(2.0) / dtype.type(B))

    return readout
