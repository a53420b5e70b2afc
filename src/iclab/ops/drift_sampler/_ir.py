"""The drifting task's training batch drawn by one LLVM IR kernel over lanes of prompts: Philox words, Box-Muller
normals, the AR(1) recursion and the labels, four prompts to a vector.

For prompt b (lane of a vector) and the AR(1) processes g (``ops.drift_sampler.native``'s model, eqs 2-3):

    x_i = L ξ_i,   w_0 = σ_w ε_0,   w_i = γ_g w_{i-1} + σ_e ε_i,   y_gi = ⟨w_i, x_i⟩,   i = 0..T-1,

written as the shared layout: xs (B, T, d) the inputs, ys (G, B, T) the labels (the query's 0), tg (G, B) the query's
label. The normals: Philox4x32-10 (Salmon et al. 2011) under the JAX key's two words, the counter (b, i, k, 0) for
block k = 0..⌈d/2⌉-1 of position i (ξ_i from the first d words, ε_i from the next d) and (b, 0, k, 1) for ε_0;
each pair of words (w₁, w₂) gives two normals by Box-Muller,

    u₁ = (w₁ + ½) 2⁻³²,  u₂ = (w₂ + ½) 2⁻³²,  r = √(−2 ln u₁),  (z₁, z₂) = (r cos 2πu₂, r sin 2πu₂),

with ln by its exponent and 2 atanh((m−1)/(m+1)) (m ∈ [√½, √2), ten terms), and cos, sin on [−π/4, π/4] by their
Taylor polynomials (to φ¹⁶ and φ¹⁵) after reducing 4u₂ to its nearest quarter turn: a few ulp from numpy's
functions (tested). r ≤ √(64 ln 2) = 6.66: a 32-bit u₁ truncates the normal's tail beyond 6.66 σ, which holds
2.7·10⁻¹¹ of its mass (one draw in 3.7·10¹⁰).

``reference`` is the naive twin in numpy: the same operations in the same order (no fused multiply-adds), so the
same bits (tested).

Why: the ziggurat kernel (``ops.drift_sampler.native``, numba) spends most of drift.fig1's batch in scalar code, a table
read and a branch per normal, slow-path walks for 14 % of its streams, and a scalar AR(1) chain per prompt. Here
every step is straight-line vector code over four prompts: the five Philox blocks of a position, ten Box-Muller
pairs (one division and one square root each; the polynomials by Estrin's scheme, whose dependency chains are half
Horner's), the recursion with each process's w in an L1 scratch, and the writes as scattered stores (a small part
of the kernel's time).
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from iclab.ops._runtime.llvm import compile_function
from iclab.ops._runtime.philox import M0 as _M0, M1 as _M1

__all__ = ["LANES", "reference", "sample", "sampler_kernel"]

#: Prompts per vector: four float64 in an AVX2 register.
LANES = 4
#: Box-Muller pairs whose instructions are interleaved, as are a position's Philox blocks (no effect on the bits;
#: little on the speed, 1 to 10 tried).
INTERLEAVE = 2

_OUT = {np.dtype(np.float32): ("float", "f32", 4), np.dtype(np.float64): ("double", "f64", 8)}
#: atanh(s)/s = Σ_k s^{2k}/(2k+1), k = 0..9 (|s| ≤ 0.1716: the first term left out ≈ 10⁻¹⁵).
_ATANH = [1.0 / (2 * k + 1) for k in range(10)]
#: sin φ = φ Σ_k (−1)^k φ^{2k}/(2k+1)!, k = 0..7; cos φ = Σ_k (−1)^k φ^{2k}/(2k)!, k = 0..8 (|φ| ≤ π/4).
_SIN = [(-1) ** k / math.factorial(2 * k + 1) for k in range(8)]
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(9)]
_SQRT2 = math.sqrt(2.0)
_LN2 = math.log(2.0)
_HALF_PI = math.pi / 2


def _f(x: float) -> str:
    """A double literal for IR (its exact bits, hexadecimal)."""
    return "0x%016X" % np.float64(x).view(np.uint64)


class _IR:
    """Lines of one IR function over <LANES x double> (V) and <LANES x i64> (IV) values."""

    def __init__(self):
        self.lines: list[str] = []
        self.n = 0
        self.V, self.IV = f"<{LANES} x double>", f"<{LANES} x i64>"

    def t(self) -> str:
        self.n += 1
        return f"%v{self.n}"

    def interleaved(self, streams) -> list:
        """Runs each function of ``streams`` (no arguments; each emits an independent chain of instructions) and
        interleaves their lines round robin, so that neighbouring instructions are independent and the chains'
        latencies can overlap (the streams must not open blocks). Returns their results."""
        outs, bufs = [], []
        for fn in streams:
            start = len(self.lines)
            outs.append(fn())
            bufs.append(self.lines[start:])
            del self.lines[start:]
        for k in range(max(map(len, bufs), default=0)):
            for buf in bufs:
                if k < len(buf):
                    self.lines.append(buf[k])
        return outs

    def emit(self, s: str) -> None:
        self.lines.append("  " + s)

    def label(self, s: str) -> None:
        self.lines.append(f"{s}:")

    def op(self, kind: str, a: str, b: str, ty: str | None = None) -> str:
        r = self.t()
        self.emit(f"{r} = {kind} {ty or self.V} {a}, {b}")
        return r

    def fconst(self, x: float) -> str:
        return "<" + ", ".join(f"double {_f(x)}" for _ in range(LANES)) + ">"

    def iconst(self, x: int) -> str:
        return "<" + ", ".join(f"i64 {x}" for _ in range(LANES)) + ">"

    def splat(self, scalar: str, ty: str = "double") -> str:
        vt = f"<{LANES} x {ty}>"
        a, r = self.t(), self.t()
        self.emit(f"{a} = insertelement {vt} undef, {ty} {scalar}, i32 0")
        self.emit(f"{r} = shufflevector {vt} {a}, {vt} undef, <{LANES} x i32> zeroinitializer")
        return r

    def cast(self, kind: str, a: str, src: str, dst: str) -> str:
        r = self.t()
        self.emit(f"{r} = {kind} {src} {a} to {dst}")
        return r

    def select(self, mask: str, a: str, b: str, ty: str | None = None) -> str:
        r = self.t()
        ty = ty or self.V
        self.emit(f"{r} = select <{LANES} x i1> {mask}, {ty} {a}, {ty} {b}")
        return r

    def philox(self, c0: str, c1: str, c2: str, c3: str, keys: list[tuple[str, str]]) -> list[str]:
        """Philox4x32-10 of the counters (IV values < 2³²) under the round keys (splatted IV pairs): four IV words."""
        IV, mask = self.IV, self.iconst(0xFFFFFFFF)
        x0, x1, x2, x3 = c0, c1, c2, c3
        for ka, kb in keys:
            p0 = self.op("mul", x0, self.iconst(_M0), IV)  # 32 × 32 bits: LLVM knows the high halves are zero
            p1 = self.op("mul", x2, self.iconst(_M1), IV)
            h1 = self.op("lshr", p1, self.iconst(32), IV)
            h0 = self.op("lshr", p0, self.iconst(32), IV)
            n0 = self.op("xor", self.op("xor", h1, x1, IV), ka, IV)
            n2 = self.op("xor", self.op("xor", h0, x3, IV), kb, IV)
            x0, x1, x2, x3 = n0, self.op("and", p1, mask, IV), n2, self.op("and", p0, mask, IV)
        return [x0, x1, x2, x3]

    def poly(self, coeffs, x: str) -> str:
        """Σ_k coeffs[k] x^k by Estrin's scheme (pairs c_2j + c_2j+1 x, then in x², x⁴, ...): a dependency chain of
        depth log₂ of Horner's, the same operations as ``_poly_np``."""
        terms = [self.fconst(c) for c in coeffs]
        power = x
        while len(terms) > 1:
            nxt = [self.op("fadd", terms[j], self.op("fmul", terms[j + 1], power)) for j in range(0, len(terms) - 1, 2)]
            if len(terms) % 2:
                nxt.append(terms[-1])
            terms = nxt
            if len(terms) > 1:
                power = self.op("fmul", power, power)
        return terms[0]

    def uniform(self, w: str) -> str:
        """(w + ½) 2⁻³² for words w < 2³² (exactly: w as a double by the 2⁵² bias trick)."""
        bits = self.op("or", w, self.iconst(0x4330000000000000), self.IV)
        wd = self.op("fsub", self.cast("bitcast", bits, self.IV, self.V), self.fconst(2.0 ** 52))
        return self.op("fmul", self.op("fadd", wd, self.fconst(0.5)), self.fconst(2.0 ** -32))

    def log(self, u: str) -> str:
        """ln u for u in (0, 1) normal doubles: e ln 2 + 2 atanh((m−1)/(m+1)), m ∈ [√½, √2)."""
        IV = self.IV
        bits = self.cast("bitcast", u, self.V, IV)
        mbits = self.op("or", self.op("and", bits, self.iconst(0x000FFFFFFFFFFFFF), IV),
                        self.iconst(0x3FF0000000000000), IV)
        m = self.cast("bitcast", mbits, IV, self.V)
        e = self.op("lshr", bits, self.iconst(52), IV)  # biased exponent (u > 0)
        big = self.op("fcmp ogt", m, self.fconst(_SQRT2))
        m = self.select(big, self.op("fmul", m, self.fconst(0.5)), m)
        e = self.op("add", e, self.cast("zext", big, f"<{LANES} x i1>", IV), IV)
        # e − 1023 as a double: (e + 2⁵²'s bits) − 2⁵² − 1023, exact
        ed = self.op("fsub", self.cast("bitcast", self.op("or", e, self.iconst(0x4330000000000000), IV), IV, self.V),
                     self.fconst(2.0 ** 52 + 1023.0))
        s = self.op("fdiv", self.op("fsub", m, self.fconst(1.0)), self.op("fadd", m, self.fconst(1.0)))
        s2 = self.op("fmul", s, s)
        p = self.poly(_ATANH, s2)
        lnm = self.op("fmul", self.op("fmul", s, p), self.fconst(2.0))
        return self.op("fadd", self.op("fmul", ed, self.fconst(_LN2)), lnm)

    def cos_sin(self, u: str) -> tuple[str, str]:
        """(cos 2πu, sin 2πu) for u in (0, 1): 4u = k + f with k the nearest integer, φ = f π/2, the quarter turn k
        applied to (cos φ, sin φ)."""
        x = self.op("fmul", u, self.fconst(4.0))
        r = self.t()
        self.emit(f"{r} = call {self.V} @llvm.rint.v{LANES}f64({self.V} {x})")
        phi = self.op("fmul", self.op("fsub", x, r), self.fconst(_HALF_PI))
        p2 = self.op("fmul", phi, phi)
        sn = self.op("fmul", phi, self.poly(_SIN, p2))
        cs = self.poly(_COS, p2)
        q = self.cast("fptosi", r, self.V, f"<{LANES} x i32>")
        I32 = f"<{LANES} x i32>"
        one = "<" + ", ".join("i32 1" for _ in range(LANES)) + ">"
        two = "<" + ", ".join("i32 2" for _ in range(LANES)) + ">"
        zero = "zeroinitializer"
        swap = self.op("icmp ne", self.op("and", q, one, I32), zero, I32)
        negc = self.op("icmp ne", self.op("and", self.op("add", q, one, I32), two, I32), zero, I32)
        negs = self.op("icmp ne", self.op("and", q, two, I32), zero, I32)
        c0 = self.select(swap, sn, cs)
        s0 = self.select(swap, cs, sn)
        c1 = self.select(negc, self.op("fsub", self.fconst(-0.0), c0), c0)
        s1 = self.select(negs, self.op("fsub", self.fconst(-0.0), s0), s0)
        return c1, s1

    def normals(self, words: list[str]) -> list[str]:
        """Two normals per pair of words (Box-Muller, module docstring)."""
        out = []
        for a, b in zip(words[0::2], words[1::2]):
            r = self.t()
            lg = self.log(self.uniform(a))
            self.emit(f"{r} = call {self.V} @llvm.sqrt.v{LANES}f64({self.V} {self.op('fmul', lg, self.fconst(-2.0))})")
            c, s = self.cos_sin(self.uniform(b))
            out += [self.op("fmul", r, c), self.op("fmul", r, s)]
        return out


def sampler_ir(d: int, dtype, full: bool = False, tokens: bool = False) -> str:
    """The module of ``sample(keys, chol, gam, sw, se, W, xs, ys, tg, first, stop, B, G, T, diag)``: prompts
    [first, stop) of the batch (module docstring); keys the (10, 2) round keys (i64), W a scratch of G·d·LANES doubles,
    diag ≠ 0 when chol (d, d) is diagonal. ``full``: stop − first is a multiple of LANES (no lane left empty).
    ``tokens``: the tokens layout instead of the shared one, Z (G, B, T, d+1) = [x_i, y_gi] (the query's label 0) in
    the place of xs (ys unused)."""
    ot, osuf, osize = _OUT[np.dtype(dtype)]
    ir = _IR()
    V, IV = ir.V, ir.IV
    OV, PV, MV = f"<{LANES} x {ot}>", f"<{LANES} x ptr>", f"<{LANES} x i1>"
    ids = "<" + ", ".join(f"i64 {j}" for j in range(LANES)) + ">"

    def load_scalar(base, index):
        p, r = ir.t(), ir.t()
        ir.emit(f"{p} = getelementptr double, ptr {base}, i64 {index}")
        ir.emit(f"{r} = load double, ptr {p}, align 8")
        return r

    def wslot(g, e):
        o = ir.t()
        ir.emit(f"{o} = mul i64 {g}, {d * LANES}")
        p = ir.t()
        ir.emit(f"{p} = getelementptr double, ptr %W, i64 {o}")
        q = ir.t()
        ir.emit(f"{q} = getelementptr double, ptr {p}, i64 {e * LANES}")
        return q

    def scatter(value, pointers, convert=True):
        v = value
        if ot != "double" and convert:
            v = ir.cast("fptrunc", value, V, OV)
        ir.emit(f"call void @llvm.masked.scatter.v{LANES}{osuf}.v{LANES}p0({OV} {v}, {PV} {pointers}, i32 {osize}, "
                f"{MV} %mask)")

    def draw(i: str, flag: int, n: int) -> list[str]:
        """n normals (n even) of position i: block by block, its words turned into normals at once (all words
        first would keep 20 vectors alive and spill)."""
        iv = ir.op("and", ir.splat(i, "i64"), ir.iconst(0xFFFFFFFF), IV)

        blocks = ir.interleaved([functools.partial(ir.philox, "%bv", iv, ir.iconst(k), ir.iconst(flag), keys)
                                 for k in range((n + 3) // 4)])
        words = [w for block in blocks for w in block][:n]
        z = []
        for j in range(0, n, 2 * INTERLEAVE):
            for out in ir.interleaved([functools.partial(ir.normals, words[q:q + 2]) for q in range(j, min(n, j + 2 * INTERLEAVE), 2)]):
                z += out
        return z

    ir.lines += [
        f"declare void @llvm.masked.scatter.v{LANES}{osuf}.v{LANES}p0({OV}, {PV}, i32 immarg, {MV})",
        f"declare {V} @llvm.rint.v{LANES}f64({V})",
        f"declare {V} @llvm.sqrt.v{LANES}f64({V})",
        "define void @sample(ptr noalias nocapture readonly %keys, ptr noalias nocapture readonly %chol, "
        "ptr noalias nocapture readonly %gam, ptr noalias nocapture readonly %sw, ptr noalias nocapture readonly %se, "
        "ptr noalias nocapture %W, ptr noalias nocapture %xs, ptr noalias nocapture %ys, ptr noalias nocapture %tg, "
        "i64 %first, i64 %stop, i64 %B, i64 %G, i64 %T, i64 %diag) {",
    ]
    ir.label("entry")
    keys = []
    for r in range(10):
        pa, pb = ir.t(), ir.t()
        ir.emit(f"{pa} = getelementptr i64, ptr %keys, i64 {2 * r}")
        ir.emit(f"{pb} = getelementptr i64, ptr %keys, i64 {2 * r + 1}")
        a, b = ir.t(), ir.t()
        ir.emit(f"{a} = load i64, ptr {pa}, align 8")
        ir.emit(f"{b} = load i64, ptr {pb}, align 8")
        # masked: LLVM then knows every Philox product is 32 × 32 bits (one vpmuludq)
        keys.append((ir.op("and", ir.splat(a, "i64"), ir.iconst(0xFFFFFFFF), IV),
                     ir.op("and", ir.splat(b, "i64"), ir.iconst(0xFFFFFFFF), IV)))
    ir.emit("%Tm1 = sub i64 %T, 1")
    ir.emit("%isdiag = icmp ne i64 %diag, 0")
    Td = ir.t()
    ir.emit(f"{Td} = mul i64 %T, {d}")
    ir.emit("%none = icmp sge i64 %first, %stop")
    ir.emit("br i1 %none, label %exit, label %lg")

    # ---- lane groups: prompts b .. b + LANES - 1
    ir.label("lg")
    ir.emit("%b = phi i64 [%first, %entry], [%b.next, %ti.done]")
    ir.emit("%rem = sub i64 %stop, %b")
    if full:  # every lane a prompt: the scatters' mask a constant, so LLVM stores each lane without a test
        ir.emit(f"%mask = icmp eq {IV} zeroinitializer, zeroinitializer")
    else:
        ir.emit(f"%mask = icmp slt {IV} {ids}, {ir.splat('%rem', 'i64')}")
    bv = ir.op("add", ir.splat("%b", "i64"), ids, IV)
    ir.emit(f"%bv = and {IV} {bv}, {ir.iconst(0xFFFFFFFF)}")  # prompts < 2³² (checked by the caller)
    ir.emit(f"%bTd = mul {IV} %bv, {ir.splat(Td, 'i64')}")
    eps0 = draw("0", 1, 2 * ((d + 1) // 2))[:d]
    ir.emit("br label %w0")
    ir.label("w0")  # w_0 = σ_w ε_0 of every process, into W (G, d, LANES)
    ir.emit("%g0 = phi i64 [0, %lg], [%g0.next, %w0]")
    swg = ir.splat(load_scalar("%sw", "%g0"))
    for e in range(d):
        ir.emit(f"store {V} {ir.op('fmul', swg, eps0[e])}, ptr {wslot('%g0', e)}, align 8")
    ir.emit("%g0.next = add i64 %g0, 1")
    ir.emit("%g0.more = icmp slt i64 %g0.next, %G")
    ir.emit("br i1 %g0.more, label %w0, label %ti")

    # ---- positions i: ξ_i, ε_i; x_i = L ξ_i; every process's w_i and y_gi
    ir.label("ti")
    ir.emit("%i = phi i64 [0, %w0], [%i.next, %gl.done]")
    z = draw("%i", 0, 2 * d)
    xi, eps = z[:d], z[d:2 * d]
    ioff = ir.t()
    ir.emit(f"{ioff} = mul i64 %i, {d}")
    rowp = ir.t()
    ir.emit(f"{rowp} = getelementptr {ot}, ptr %xs, {IV} {ir.op('add', '%bTd', ir.splat(ioff, 'i64'), IV)}")
    ir.emit("br i1 %isdiag, label %xd, label %xf")
    forms = {}
    for form in ("xd", "xf"):
        ir.label(form)
        xsf = []
        for e in range(d):
            if form == "xd":
                x = ir.op("fmul", ir.splat(load_scalar("%chol", e * d + e)), xi[e])
            else:
                x = "zeroinitializer"
                for f in range(e + 1):
                    x = ir.op("fadd", x, ir.op("fmul", ir.splat(load_scalar("%chol", e * d + f)), xi[f]))
            xsf.append(x)
        forms[form] = xsf
        ir.emit("br label %xw")
    ir.label("xw")
    x = []
    for e in range(d):
        r = ir.t()
        ir.emit(f"{r} = phi {V} [{forms['xd'][e]}, %xd], [{forms['xf'][e]}, %xf]")
        x.append(r)
    if not tokens:
        for e in range(d):
            pe = ir.t()
            ir.emit(f"{pe} = getelementptr {ot}, {PV} {rowp}, i64 {e}")
            scatter(x[e], pe)
    ir.emit("%last = icmp eq i64 %i, %Tm1")
    ir.emit("br label %gl")

    ir.label("gl")
    ir.emit("%g = phi i64 [0, %xw], [%g.next, %gl.end]")
    gamma = ir.splat(load_scalar("%gam", "%g"))
    sig = ir.splat(load_scalar("%se", "%g"))
    y = "zeroinitializer"
    for e in range(d):
        p = wslot("%g", e)
        wv = ir.t()
        ir.emit(f"{wv} = load {V}, ptr {p}, align 8")
        w = ir.op("fadd", ir.op("fmul", gamma, wv), ir.op("fmul", sig, eps[e]))
        ir.emit(f"store {V} {w}, ptr {p}, align 8")
        y = ir.op("fadd", y, ir.op("fmul", w, x[e]))
    gB = ir.t()
    ir.emit(f"{gB} = mul i64 %g, %B")
    gbv = ir.op("add", ir.splat(gB, "i64"), "%bv", IV)
    yoff = ir.op("add", ir.op("mul", gbv, ir.splat("%T", "i64"), IV), ir.splat("%i", "i64"), IV)  # (g B + b) T + i
    if tokens:  # Z[g, b, i, :d] = x_i, the label at Z[g, b, i, d]
        zrow = ir.t()
        ir.emit(f"{zrow} = getelementptr {ot}, ptr %xs, {IV} {ir.op('mul', yoff, ir.iconst(d + 1), IV)}")
        for e in range(d):
            pe = ir.t()
            ir.emit(f"{pe} = getelementptr {ot}, {PV} {zrow}, i64 {e}")
            scatter(x[e], pe)
        ir.emit(f"%yp = getelementptr {ot}, {PV} {zrow}, i64 {d}")
    else:
        ir.emit(f"%yp = getelementptr {ot}, ptr %ys, {IV} {yoff}")
    ir.emit("br i1 %last, label %tlast, label %tmid")
    ir.label("tmid")
    scatter(y, "%yp")
    ir.emit("br label %gl.end")
    ir.label("tlast")
    scatter("zeroinitializer", "%yp", convert=False)
    tp = ir.t()
    ir.emit(f"{tp} = getelementptr {ot}, ptr %tg, {IV} {gbv}")
    scatter(y, tp)
    ir.emit("br label %gl.end")
    ir.label("gl.end")
    ir.emit("%g.next = add i64 %g, 1")
    ir.emit("%g.more = icmp slt i64 %g.next, %G")
    ir.emit("br i1 %g.more, label %gl, label %gl.done")
    ir.label("gl.done")
    ir.emit("%i.next = add i64 %i, 1")
    ir.emit("%i.more = icmp slt i64 %i.next, %T")
    ir.emit("br i1 %i.more, label %ti, label %ti.done")
    ir.label("ti.done")
    ir.emit(f"%b.next = add i64 %b, {LANES}")
    ir.emit("%b.more = icmp slt i64 %b.next, %stop")
    ir.emit("br i1 %b.more, label %lg, label %exit")
    ir.label("exit")
    ir.emit("ret void")
    ir.lines.append("}")
    return "\n".join(ir.lines) + "\n"


@functools.cache
def sampler_kernel(d: int, dtype, full: bool = False, tokens: bool = False):
    """``sampler_ir``'s function compiled for this CPU (once per process, about a second), a ctypes function of the
    addresses (keys, chol, gam, sw, se, W, xs or Z, ys, tg) and (first, stop, B, G, T, diag); it releases the GIL."""
    P, I = ctypes.c_void_p, ctypes.c_int64
    return compile_function(sampler_ir(d, np.dtype(dtype), full, tokens), "sample", None, (P,) * 9 + (I,) * 6)


def sample(round_keys, chol, gamma, sigma_w, sigma_e, out, first: int, stop: int) -> None:
    """Prompts [first, stop) of the batch into ``out``: (xs (B, T, d), ys (G, B, T), tg (G, B)) or, tokens,
    (Z (G, B, T, d+1), tg (G, B)); C-contiguous arrays of one float dtype, float64 parameters (gamma, sigma_w, sigma_e
    (G,), chol (d, d)), round_keys (10, 2). The lanes of full vectors by one kernel, the rest by its masked form."""
    tokens = len(out) == 2
    main, tg = out[0], out[-1]
    ys = main if tokens else out[1]
    G, B = tg.shape
    d = chol.shape[0]
    T = main.shape[2] if tokens else main.shape[1]
    if B >= 2 ** 32 or T >= 2 ** 32:
        raise ValueError(f"the sampler's counters hold prompts and positions below 2³² (got B={B}, T={T})")
    arrays = [np.ascontiguousarray(a, np.int64 if k == 0 else np.float64)
              for k, a in enumerate((round_keys, chol, gamma, sigma_w, sigma_e))]
    for a in out:
        if not a.flags.c_contiguous or a.dtype != main.dtype:
            raise ValueError("the sampler's outputs must be C-contiguous arrays of one dtype")
    W = np.empty(G * d * LANES)
    pointers = [a.ctypes.data for a in arrays] + [W.ctypes.data, main.ctypes.data, ys.ctypes.data, tg.ctypes.data]
    diag = int(bool(np.all(arrays[1] == np.diag(np.diag(arrays[1])))))
    mid = first + (stop - first) // LANES * LANES
    if mid > first:
        sampler_kernel(d, main.dtype, True, tokens)(*pointers, first, mid, B, G, T, diag)
    if stop > mid:
        sampler_kernel(d, main.dtype, False, tokens)(*pointers, mid, stop, B, G, T, diag)


# ------------------------------------------------------------------------------------------------
# the naive twin


def _philox_np(c0, c1, c2, c3, round_keys):
    """Philox4x32-10 on uint64 arrays of 32-bit values (broadcast): four word arrays."""
    mask = np.uint64(0xFFFFFFFF)
    x0, x1, x2, x3 = (np.asarray(c, np.uint64) for c in (c0, c1, c2, c3))
    x0, x1, x2, x3 = np.broadcast_arrays(x0, x1, x2, x3)
    for ka, kb in round_keys:
        p0 = x0 * np.uint64(_M0)
        p1 = x2 * np.uint64(_M1)
        x0, x1, x2, x3 = (p1 >> np.uint64(32)) ^ x1 ^ np.uint64(ka), p1 & mask, (p0 >> np.uint64(32)) ^ x3 ^ np.uint64(kb), \
            p0 & mask
    return x0, x1, x2, x3


def _poly_np(coeffs, x):
    """``_IR.poly`` in numpy: Estrin's scheme, the same operations in the same order."""
    terms = [np.full_like(x, c) for c in coeffs]
    power = x
    while len(terms) > 1:
        nxt = [terms[j] + terms[j + 1] * power for j in range(0, len(terms) - 1, 2)]
        if len(terms) % 2:
            nxt.append(terms[-1])
        terms = nxt
        if len(terms) > 1:
            power = power * power
    return terms[0]


def _log_np(u):
    bits = u.view(np.uint64)
    m = ((bits & np.uint64(0x000FFFFFFFFFFFFF)) | np.uint64(0x3FF0000000000000)).view(np.float64)
    e = (bits >> np.uint64(52)).astype(np.float64) - 1023.0
    big = m > _SQRT2
    m = np.where(big, m * 0.5, m)
    e = e + big
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = _poly_np(_ATANH, s2)
    return e * _LN2 + s * p * 2.0


def _cos_sin_np(u):
    x = u * 4.0
    r = np.rint(x)
    phi = (x - r) * _HALF_PI
    p2 = phi * phi
    sn = phi * _poly_np(_SIN, p2)
    cs = _poly_np(_COS, p2)
    q = r.astype(np.int64)
    swap, negc, negs = (q & 1) != 0, ((q + 1) & 2) != 0, (q & 2) != 0
    c0, s0 = np.where(swap, sn, cs), np.where(swap, cs, sn)
    return np.where(negc, -c0, c0), np.where(negs, -s0, s0)


def normals_np(words):
    """Box-Muller normals of word arrays (..., 2m) → (..., 2m), as the kernel computes them."""
    w = np.asarray(words, np.uint64).astype(np.float64)
    u = (w + 0.5) * 2.0 ** -32
    u1, u2 = u[..., 0::2], u[..., 1::2]
    r = np.sqrt(_log_np(u1) * -2.0)
    c, s = _cos_sin_np(u2)
    out = np.empty(w.shape)
    out[..., 0::2], out[..., 1::2] = r * c, r * s
    return out


def reference(round_keys, chol, gamma, sigma_w, sigma_e, B: int, T: int, dtype=np.float32):
    """(xs, ys, tg) of the kernel for the whole batch, in numpy (the naive twin: module docstring)."""
    d = chol.shape[0]
    G = len(gamma)
    nblk = (d + 1) // 2
    b = np.arange(B, dtype=np.uint64)[:, None]

    def draw(i, flag, blocks):
        ws = [_philox_np(b, np.uint64(i), np.uint64(k), np.uint64(flag), round_keys) for k in range(blocks)]
        words = np.concatenate([np.stack(w, axis=-1) for w in ws], axis=-1)[:, 0, :]
        return normals_np(words[:, :words.shape[1] // 2 * 2])

    xs, ys, tg = np.empty((B, T, d), dtype), np.empty((G, B, T), dtype), np.empty((G, B), dtype)
    eps0 = draw(0, 1, (d + 3) // 4)[:, :d]
    w = np.stack([sigma_w[g] * eps0 for g in range(G)])  # (G, B, d)
    diag = bool(np.all(chol == np.diag(np.diag(chol))))
    for i in range(T):
        z = draw(i, 0, nblk)
        xi, eps = z[:, :d], z[:, d:2 * d]
        x = np.empty((B, d))
        for e in range(d):
            if diag:
                x[:, e] = chol[e, e] * xi[:, e]
            else:
                acc = np.zeros(B)
                for f in range(e + 1):
                    acc = acc + chol[e, f] * xi[:, f]
                x[:, e] = acc
        xs[:, i] = x
        for g in range(G):
            y = np.zeros(B)
            for e in range(d):
                w[g, :, e] = gamma[g] * w[g, :, e] + sigma_e[g] * eps[:, e]
                y = y + w[g, :, e] * x[:, e]
            if i == T - 1:
                ys[g, :, i] = 0.0
                tg[g] = y
            else:
                ys[g, :, i] = y
    return xs, ys, tg
