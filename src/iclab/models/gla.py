"""Gated linear attention with matrix gates (gating paper, Sec 2 eq GLA, Secs 5.1-5.2, App A, App D.1).

One layer maps tokens z_1..z_T (rows of Z, token-major; the query z_T last) to

    q_i = W_qᵀ z_i,  k_i = W_kᵀ z_i,  v_i = W_vᵀ z_i,   S_i = G_i ⊙ S_{i−1} + v_i k_iᵀ (S_0 = 0),  o_i = S_i q_i,

with G_i = G(z_i) ∈ R^{D×D}. Three equal forms at every position:

- recurrent (eq GLA): the state recursion, a ``lax.scan`` over tokens (the naive reference);
- unrolled (App D.1): S_i = Σ_{j≤i} G_{j:i} ⊙ v_j k_jᵀ with G_{j:i} = G_{j+1} ⊙ … ⊙ G_i formed explicitly;
- parallel (masked): o_i = Σ_{j≤i} (exp(c_i − c_j) ⊙ v_j k_jᵀ) q_i with c_i = Σ_{m≤i} log G_m, i.e. the
  attention scores QKᵀ times a gate mask, for training speed.

``last`` is the parallel form evaluated at the query only (ŷ needs nothing else): O(T·D) per prompt for
scalar gates, O(T·D²) for vector gates. It is the fast path for training one layer.

Gates (Sec 5.2, sigmoid φ as in the experiments): ``none`` G ≡ 1 (causal linear attention); ``scalar``
G(z) = φ(w_gᵀz) 1 1ᵀ (Thm 4); ``vector`` G(z) = φ(W_g z) 1ᵀ, row r scaled by φ(W_g z)_r (Thm 5). The
gates carry no bias, as in the paper. Any explicit matrix gates can be passed to the kernels.

Tokens (eq 19): z = [x; y; c] ∈ R^{D}, D = d + 1 + p, the label y at index ``label`` = d; the query's label
slot is 0. ``delimiter_prompt`` lays out K task blocks, each followed by a delimiter d_k = [0; 0; c̄_k],
and the query (context c̄_0 by default: the paper leaves it unspecified; Thm 4's proof needs the query's gate 1).

Params are dicts of arrays: ``Wq``, ``Wk``, ``Wv`` (D, D), plus ``w_g`` (D,) for scalar or ``W_g`` (D, D)
for vector gating, plus an optional linear head ``h`` (D,). The prediction is ŷ = hᵀ o_T with a head,
else the label coordinate (o_T)_{d+1} (Thm 1's readout).

Padding: a token ``mask`` (0/1 per token) removes tokens exactly: a masked token has v k ᵀ = 0 and gate 1,
so the outputs at the other positions equal those of the prompt without it. Prompts of different lengths
(different n̄) then share one shape and can be vmapped.

Restricted constructions: ``restricted_params`` (eq 9 / eq 20), ``construction2_params`` (eqs 27-29),
``scalar_gate_for_weights`` (Thm 4, App F.1 step 3) and ``vector_gate_for_weights`` (Thm 5). The compact
restricted parametrisation ``{"P_k", "P_q", "w_c"}`` (scalar) / ``{"P_k", "P_q", "W_c", "u", "h"}``
(vector) maps to full params with ``restricted_to_full`` and to its WPGD weights with
``restricted_wpgd`` (Thm 1: ŷ = xᵀ P Xᵀ(ω ⊙ y) for scalar gates, with P = P_q P_kᵀ).

L layers (eq 25): Z_{ℓ+1} = Z_ℓ + GLA_ℓ(Z_ℓ) at every position (no MLP, no norm), each layer with its own
weights and gates computed from its own input; ŷ read at the query's label slot of the last Z.

Model families (:mod:`iclab.models` registry; ``predict(params, Z, mask=None, *, label)``,
``init(key, *, D, std, dtype, ...)``): ``linatt`` (G ≡ 1), ``gla`` (scalar gates), ``gla_vector`` (vector
gates and a head) and ``gla_multilayer`` (L residual scalar-gated layers, ``init(..., layers=L)``) read the
delimiter prompts of eq 19 (task :data:`DELIMITED`); ``gla_wo`` (scalar gates) reads plain [x; y] tokens
without delimiters (task :data:`PLAIN`), Fig 1's GLA-wo.
"""

from __future__ import annotations

from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from iclab.models._family import ModelFamily, register_model
from iclab.ops import LANES, gated_layer, subsequence_positions
from iclab.ops import gated_multilayer_mse_grid as multilayer_mse_grid
from iclab.ops import gated_multilayer_mse_grids as multilayer_mse_grids
from iclab.ops import gated_query_mse_grid as query_mse_grid
from iclab.tasks import standard_normal

__all__ = ["DELIMITED", "GATINGS", "LANES", "PLAIN", "Form", "Gating", "construction2_params", "cumulative_gates",
           "delimiter_prompt", "gate_logits", "gate_matrices", "gating", "gla_layer", "init_multilayer", "init_params",
           "log_gates", "multilayer_outputs", "parallel", "predict", "predict_last", "predict_multilayer",
           "multilayer_mse_grid", "multilayer_mse_grids", "projections", "query_mse_grid", "query_weights",
           "recurrent", "restricted_params", "restricted_to_full", "restricted_wpgd", "scalar_gate_for_weights",
           "subsequence_positions", "token_layout", "unrolled", "vector_gate_for_weights"]

Gating = Literal["none", "scalar", "vector"]
Form = Literal["last", "parallel", "recurrent", "unrolled", "native"]
GATINGS: tuple[str, ...] = ("none", "scalar", "vector")


# --------------------------------------------------------------------------------------------
# Gates


def gating(params) -> Gating:
    """Which gate a param dict carries: ``scalar`` (w_g, Thm 4), ``vector`` (W_g, Thm 5) or ``none`` (G ≡ 1).

    Args:
        params: one layer's param dict.
    Returns:
        ``"scalar"``, ``"vector"`` or ``"none"``.
    """
    if "w_g" in params and "W_g" in params:
        raise ValueError("params must carry at most one of w_g (scalar gating) and W_g (vector gating)")
    return "scalar" if "w_g" in params else "vector" if "W_g" in params else "none"


def gate_logits(params, Z: jax.Array):
    """Pre-activations of the gates: w_gᵀz_i (scalar) or W_g z_i (vector).

    Args:
        params: one layer's param dict; Z: (..., T, D) tokens.
    Returns:
        (..., T) scalar or (..., T, D) vector logits; None without gating.
    """
    kind = gating(params)
    if kind == "scalar":
        return Z @ params["w_g"]
    if kind == "vector":
        return Z @ params["W_g"].T
    return None


def log_gates(params, Z: jax.Array, mask=None):
    """log φ(·) of the sigmoid gates, φ(a) = 1/(1 + e^{−a}); 0 (gate 1) at masked tokens.

    Args:
        params: one layer's param dict; Z: (..., T, D) tokens; mask: optional (..., T) 0/1 token mask.
    Returns:
        (..., T) scalar or (..., T, D) vector log gates; None without gating.
    """
    a = gate_logits(params, Z)
    if a is None:
        return None
    lg = jax.nn.log_sigmoid(a)
    if mask is not None:
        m = jnp.asarray(mask)
        lg = jnp.where((m if gating(params) == "scalar" else m[..., None]) > 0, lg, 0.0)
    return lg


def gate_matrices(params, Z: jax.Array, mask=None) -> jax.Array:
    """G_i as arrays broadcastable to (..., T, D, D): scalar (..., T, 1, 1), vector (..., T, D, 1), none ones.

    Computed as φ(·) itself (not exp of log φ), so the recurrent and unrolled forms share no arithmetic
    with the parallel one. Masked tokens get G = 1.

    Args:
        params: one layer's param dict; Z: (..., T, D) tokens; mask: optional (..., T) 0/1 token mask.
    Returns:
        G_i: (..., T, 1, 1) scalar, (..., T, D, 1) vector, or (..., T, 1, 1) ones without gating.
    """
    kind = gating(params)
    if kind == "none":
        return jnp.ones(Z.shape[:-1] + (1, 1), Z.dtype)
    g = jax.nn.sigmoid(gate_logits(params, Z))
    if mask is not None:
        m = jnp.asarray(mask)
        g = jnp.where((m if kind == "scalar" else m[..., None]) > 0, g, 1.0)
    return g[..., None, None] if kind == "scalar" else g[..., :, None]


# --------------------------------------------------------------------------------------------
# Kernels on (Q, K, V, gates); Q, K, V: (..., T, D)


def recurrent(Q, K, V, G) -> jax.Array:
    """S_i = G_i ⊙ S_{i−1} + v_i k_iᵀ, o_i = S_i q_i (eq GLA), a scan over tokens.

    Args:
        Q, K, V: (..., T, D).
        G: gates broadcastable to (..., T, D, D).
    Returns:
        O: (..., T, D).
    """
    batch = Q.shape[:-2]
    G = jnp.broadcast_to(G, batch + (Q.shape[-2],) + G.shape[-2:])
    S0 = jnp.zeros(batch + (V.shape[-1], K.shape[-1]), jnp.result_type(Q, K, V, G))

    def step(S, qkvg):
        q, k, v, g = qkvg
        S = g * S + v[..., :, None] * k[..., None, :]
        return S, jnp.einsum("...ij,...j->...i", S, q)

    moved = [jnp.moveaxis(a, len(batch), 0) for a in (Q, K, V, G)]
    _, O = jax.lax.scan(step, S0, tuple(moved))
    return jnp.moveaxis(O, 0, -2)


def cumulative_gates(G, T: int) -> jax.Array:
    """G_{j:i} = G_{j+1} ⊙ … ⊙ G_i for j ≤ i (G_{i:i} = 1), 0 for j > i, as explicit products (App D.1).

    O(T³ D²): a reference form.

    Args:
        G: gates, (..., T, Dv, Dk) or broadcastable to it (e.g. (T, 1, 1) for one scalar gate per token).
        T: number of tokens.
    Returns:
        (..., T_i, T_j, Dv, Dk) cumulative gates.
    """
    idx = jnp.arange(T)
    # factor[i, j, m] = G_m if j < m ≤ i else 1
    inside = (idx[None, :, None] < idx[None, None, :]) & (idx[None, None, :] <= idx[:, None, None])
    Gm = G[..., None, None, :, :, :]  # (..., 1, 1, T_m, Dv, Dk)
    factors = jnp.where(inside[..., None, None], Gm, 1.0)
    prods = jnp.prod(factors, axis=-3)
    return jnp.where((idx[None, :] <= idx[:, None])[..., None, None], prods, 0.0)


def unrolled(Q, K, V, G) -> jax.Array:
    """o_i = (Σ_{j≤i} G_{j:i} ⊙ v_j k_jᵀ) q_i (App D.1), with every G_{j:i} formed explicitly.

    Args:
        Q, K, V: (..., T, D); G: broadcastable to (..., T, D, D).
    Returns:
        O: (..., T, D).
    """
    Gp = cumulative_gates(G, Q.shape[-2])
    return jnp.einsum("...ijab,...ja,...jb,...ib->...ia", Gp, V, K, Q)


def parallel(Q, K, V, log_g=None, kind: Gating = "none", causal: bool = True) -> jax.Array:
    """Masked parallel form: o_i = Σ_{j≤i} (exp(c_i − c_j) ⊙ v_j k_jᵀ) q_i, c_i = Σ_{m≤i} log G_m.

    For scalar gates this is O = (W ⊙ QKᵀ) V with the decay mask W_ij = exp(c_i − c_j) 1[j ≤ i]; a data-independent
    gate (``log_g`` of shape (T,), e.g. the drift paper's forget factor, log g_t = log λ) gives one (T, T) mask
    shared by the batch. With ONE value column (Dv = 1) the same sum is taken in the other order,
    o_i = q_iᵀ Σ_j W_ij v_j k_j: no (T, T) score matrix per prompt.

    Args:
        Q, K: (..., T, Dk); V: (..., T, Dv).
        log_g: log gates, (..., T) for ``scalar``, (..., T, Dv) for ``vector`` (row-wise), (..., T, Dv, Dk) for
            ``matrix``; None for ``none``. Leading axes broadcast against those of Q, K, V.
        kind: ``none``, ``scalar``, ``vector`` or ``matrix``.
        causal: False only without gates: every token attends to all (the Sec 2 non-causal form).
    Returns:
        O: (..., T, Dv).
    """
    T = Q.shape[-2]
    idx = jnp.arange(T)
    tri = idx[None, :] <= idx[:, None]  # [i, j]: j ≤ i
    if kind == "none":
        scores = jnp.einsum("...ic,...jc->...ij", Q, K)
        if causal:
            scores = jnp.where(tri, scores, 0.0)
        return scores @ V
    if not causal:
        raise ValueError("causal=False is defined only without gates (kind='none')")
    upto = jnp.asarray(np.triu(np.ones((T, T))), log_g.dtype)  # [m, i] = 1 if m ≤ i: c_i = Σ_{m≤i} log G_m
    c = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(log_g, -1 if kind == "scalar" else -2 if kind == "vector" else -3, -1),
                                   upto, axes=1), -1, -1 if kind == "scalar" else -2 if kind == "vector" else -3)
    if kind == "scalar":
        diff = c[..., :, None] - c[..., None, :]
        # the exponent is zeroed above the diagonal before exp: exp of a positive sum could overflow
        w = jnp.where(tri, jnp.exp(jnp.where(tri, diff, 0.0)), 0.0)
        if V.shape[-1] == 1:
            return jnp.sum(jnp.einsum("...ij,...jc->...ic", w, V * K) * Q, axis=-1, keepdims=True)
        return (jnp.einsum("...ic,...jc->...ij", Q, K) * w) @ V
    if kind == "vector":
        diff = c[..., :, None, :] - c[..., None, :, :]  # (..., i, j, r)
        w = jnp.where(tri[..., None], jnp.exp(jnp.where(tri[..., None], diff, 0.0)), 0.0)
        return jnp.einsum("...ij,...ijr,...jr->...ir", jnp.einsum("...ic,...jc->...ij", Q, K), w, V)
    if kind == "matrix":
        diff = c[..., :, None, :, :] - c[..., None, :, :, :]  # (..., i, j, r, s)
        m = tri[..., None, None]
        w = jnp.where(m, jnp.exp(jnp.where(m, diff, 0.0)), 0.0)
        return jnp.einsum("...ijrs,...jr,...js,...is->...ir", w, V, K, Q)
    raise ValueError(f"kind must be one of none, scalar, vector, matrix (got {kind!r})")


def query_weights(log_g, kind: Gating) -> jax.Array | None:
    """Weights of every token in the query's state: ω_j = exp(Σ_{m=j+1}^{T} log g_m) = g_{j:T} (eq 11).

    The sum is taken directly (a product with a strictly-triangular 0/1 matrix, not a difference of prefix
    sums; XLA's CPU cumsum is a slow reduce-window). A constant gate g_t = λ gives ω_j = λ^{T−j}.

    Args:
        log_g: log gates, (..., T) for ``scalar`` or (..., T, D) for ``vector``.
        kind: ``none``, ``scalar`` or ``vector``.
    Returns:
        (..., T) or (..., T, D) weights; None for ``none``.
    """
    if kind == "none":
        return None
    T = log_g.shape[-1 if kind == "scalar" else -2]
    after = jnp.asarray(np.tril(np.ones((T, T)), -1), log_g.dtype)  # [m, j] = 1 if m > j
    if kind == "scalar":
        return jnp.exp(log_g @ after)
    return jnp.exp(jnp.einsum("...md,mj->...jd", log_g, after))


# --------------------------------------------------------------------------------------------
# Model: one layer, prediction, L layers


def projections(params, Z: jax.Array, mask=None):
    """q_i = W_qᵀz_i, k_i = W_kᵀz_i, v_i = W_vᵀz_i as rows; v = 0 at masked tokens (so v kᵀ = 0 there).

    Args:
        params: Wq, Wk, Wv (D, D); Z: (..., T, D) tokens; mask: optional (..., T) 0/1 token mask.
    Returns:
        (Q, K, V), each (..., T, D).
    """
    V = Z @ params["Wv"]
    if mask is not None:
        V = V * jnp.asarray(mask, V.dtype)[..., None]
    return Z @ params["Wq"], Z @ params["Wk"], V


def gla_layer(params, Z: jax.Array, mask=None, form: Form = "parallel") -> jax.Array:
    """Outputs o_i of one GLA layer at every position. Z: (..., T, D) -> O: (..., T, D).

    Args:
        params: Wq, Wk, Wv (+ w_g or W_g).
        Z: tokens; mask: optional (..., T) 0/1 token mask.
        form: ``parallel``, ``recurrent`` or ``unrolled`` (all equal), or ``native`` (the compiled CPU kernels of
            :func:`iclab.ops.gated_layer`: scalar gates, no mask).
    Returns:
        O: (..., T, D), o_i = S_i q_i.
    """
    if form == "native":
        if mask is not None:
            raise ValueError("form 'native' reads prompts without a token mask (use the separate n̄ layout)")
        return gated_layer(Z, params, backend="native")
    Q, K, V = projections(params, Z, mask)
    if form == "parallel":
        return parallel(Q, K, V, log_gates(params, Z, mask), gating(params))
    if form == "recurrent":
        return recurrent(Q, K, V, gate_matrices(params, Z, mask))
    if form == "unrolled":
        return unrolled(Q, K, V, gate_matrices(params, Z, mask))
    raise ValueError(f"form must be one of parallel, recurrent, unrolled, native for all positions (got {form!r})")


def _readout(params, o, label: int):
    return o @ params["h"] if "h" in params else o[..., label]


def predict_last(params, Z: jax.Array, mask=None, *, label: int) -> jax.Array:
    """ŷ from the query's output only: o_T = Σ_j (w_j ⊙ v_j)(k_jᵀ q_T), w_j = Π_{m>j} g_m. Z: (..., T, D) -> (...,).

    k_jᵀ q_T = z_jᵀ (W_k q_T) costs O(D) per token; with scalar gates and the label readout only the label
    column of W_v is used, so the whole prediction is O(T·D) per prompt.

    Args:
        params: Wq, Wk, Wv (+ w_g or W_g) (+ h); Z: (..., T, D), the query last; mask: optional (..., T).
        label: index d of the label coordinate.
    Returns:
        (...,) predictions, equal to ``predict(..., form="parallel")``.
    """
    kind = gating(params)
    u = Z[..., -1, :] @ params["Wq"] @ params["Wk"].T  # W_k q_T, so that k_jᵀ q_T = z_jᵀ u
    kq = jnp.einsum("...td,...d->...t", Z, u)
    if mask is not None:
        kq = kq * jnp.asarray(mask, kq.dtype)
    w = query_weights(log_gates(params, Z, mask), kind)
    if kind != "vector" and "h" not in params:
        v = Z @ params["Wv"][:, label]
        a = kq * v if w is None else w * kq * v
        return jnp.sum(a, axis=-1)
    V = Z @ params["Wv"]
    a = V * kq[..., None] if w is None else (w[..., None] if kind == "scalar" else w) * V * kq[..., None]
    return _readout(params, jnp.sum(a, axis=-2), label)


def predict(params, Z: jax.Array, mask=None, *, label: int, form: Form = "last") -> jax.Array:
    """One-layer GLA prediction ŷ = hᵀo_T or (o_T)_{label}. Z: (..., T, D) -> (...,).

    Args:
        params: Wq, Wk, Wv (+ w_g or W_g) (+ h).
        Z: tokens with the query last, its label slot 0; mask: optional (..., T) token mask.
        label: index d of the label coordinate.
        form: ``last`` (fast), ``parallel``, ``recurrent`` or ``unrolled``; all equal.
    Returns:
        (...,) predictions ŷ.
    """
    if form == "last":
        return predict_last(params, Z, mask, label=label)
    return _readout(params, gla_layer(params, Z, mask, form)[..., -1, :], label)


def predict_multilayer(layers: Sequence[dict], Z: jax.Array, mask=None, *, label: int,
                       form: Form = "parallel") -> jax.Array:
    """L-layer residual GLA (eq 25): Z_{ℓ+1} = Z_ℓ + GLA_ℓ(Z_ℓ), ŷ = (Z_{L+1})_{T, label} (or hᵀ of the last o_T).

    Layers 1..L−1 run at every position in ``form``; the last only at the query (``last``) unless ``form``
    asks otherwise. Each layer computes its gates from its own input. With L = 1 this is ``predict``
    (the query's label slot of Z_1 is 0). Layers carry no head: the readout is the label slot.

    Args:
        layers: list of L param dicts (no ``h``).
        Z: (..., T, D); mask: optional (..., T); label: label index d.
        form: ``parallel``, ``recurrent``, ``unrolled`` or ``native`` for the full layers (the last is read at the
            query in the ``last`` form after ``parallel`` and ``native``).
    Returns:
        (...,) predictions.
    """
    if any("h" in p for p in layers):
        raise ValueError("predict_multilayer reads the label slot; layers must not carry a head h")
    for p in layers[:-1]:
        Z = Z + gla_layer(p, Z, mask, form)
    last_form = "last" if form in ("parallel", "native") else form
    return Z[..., -1, label] + predict(layers[-1], Z, mask, label=label, form=last_form)


def multilayer_outputs(layers: Sequence[dict], Z: jax.Array, mask=None, form: Form = "parallel") -> list:
    """[Z_1, Z_2, ..., Z_{L+1}] of eq 25, Z_{ℓ+1} = Z_ℓ + GLA_ℓ(Z_ℓ), at every position (the App A recursion).

    Args:
        layers: list of L param dicts; Z: (..., T, D); mask: optional (..., T); form: as in ``gla_layer``.
    Returns:
        list of L + 1 arrays (..., T, D).
    """
    out = [Z]
    for p in layers:
        Z = Z + gla_layer(p, Z, mask, form)
        out.append(Z)
    return out


# --------------------------------------------------------------------------------------------
# Initialisation


def _param_shapes(D: int, gating: Gating, head: bool) -> dict:
    shapes = {"Wq": (D, D), "Wk": (D, D), "Wv": (D, D)}
    if gating == "scalar":
        shapes["w_g"] = (D,)
    elif gating == "vector":
        shapes["W_g"] = (D, D)
    elif gating != "none":
        raise ValueError(f"gating must be one of none, scalar, vector (got {gating!r})")
    if head:
        shapes["h"] = (D,)
    return shapes


def _unflatten(flat, shapes: dict) -> dict:
    offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes.values()])
    return {name: flat[..., offsets[i]:offsets[i + 1]].reshape(flat.shape[:-1] + shape)
            for i, (name, shape) in enumerate(shapes.items())}


def init_params(key: jax.Array, D: int, gating: Gating = "none", *, head: bool = False, std: float = 0.1,
                dtype=jnp.float64) -> dict:
    """Unrestricted params, every entry N(0, std²) (the paper's init is unspecified).

    One normal draw through :func:`iclab.tasks.standard_normal` (an RBG key: every threefry sampling site
    costs seconds of compile time on CPU, and inits are vmapped over thousands of members).

    Args:
        key: PRNG key; D: token width d + 1 + p; gating: none, scalar (w_g) or vector (W_g).
        head: add a linear head h (used with vector gating, Thm 5).
        std: init standard deviation.
        dtype: float dtype of the params.
    Returns:
        params dict: Wq, Wk, Wv (D, D), w_g (D,) or W_g (D, D), h (D,).
    """
    shapes = _param_shapes(D, gating, head)
    size = sum(int(np.prod(shape)) for shape in shapes.values())
    return _unflatten(std * standard_normal(key, (size,), dtype), shapes)


def init_multilayer(key: jax.Array, D: int, layers: int, gating: Gating = "scalar", *, std: float = 0.1,
                    dtype=jnp.float64) -> list:
    """L layers of unrestricted params for ``predict_multilayer`` (eq 25), every entry N(0, std²), no head.

    Args:
        key: PRNG key (one draw for all layers); D: token width; layers: L ≥ 1.
        gating: each layer's gate (its own w_g or W_g).
        std: init standard deviation; dtype: float dtype.
    Returns:
        list of L param dicts.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1 (got {layers})")
    shapes = _param_shapes(D, gating, False)
    size = sum(int(np.prod(shape)) for shape in shapes.values())
    flat = std * standard_normal(key, (layers, size), dtype)
    return [_unflatten(flat[l], shapes) for l in range(layers)]


# --------------------------------------------------------------------------------------------
# Delimiter prompts (eq 19)


def token_layout(block_sizes: Sequence[int], delimiters: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the data tokens (n,) and of the delimiters (K,) in a prompt of eq 19 (query last).

    Without delimiters the K positions are empty and T = n + 1.

    Args:
        block_sizes: (n_1, ..., n_K); delimiters: whether d_k follows block k.
    Returns:
        (data positions (n,), delimiter positions (K,) or (0,)), int arrays.
    """
    data, delims, pos = [], [], 0
    for nk in block_sizes:
        data.extend(range(pos, pos + int(nk)))
        pos += int(nk)
        if delimiters:
            delims.append(pos)
            pos += 1
    return np.asarray(data, dtype=int), np.asarray(delims, dtype=int)


def delimiter_prompt(x, y, x_query, block_sizes: Sequence[int], contexts=None, *, delimiters: bool = True,
                     query_context: int | None = 0, mask=None):
    """Tokens of eq 19: [Z_1; d_1; …; Z_K; d_K; z_{n+1}], z = [x; y; c], d_k = [0; 0; c̄_k], query [x; 0; c_q].

    Args:
        x: (..., n, d) context inputs, blocks stacked in order; y: (..., n); x_query: (..., d).
        block_sizes: (n_1, ..., n_K), summing to n.
        contexts: (K+1, p) context vectors c̄_0..c̄_K, or None for plain [x; y] tokens (p = 0, no delimiters).
        delimiters: insert d_k after block k (needs contexts).
        query_context: index k of the query's context c̄_k (default 0; unspecified in the paper), or None for c = 0.
        mask: optional (..., n) 0/1 validity of the context samples (padding).
    Returns:
        (Z (..., T, D), token mask (..., T) or None), T = n + K + 1 (n + 1 without delimiters), D = d + 1 + p.
    """
    x, y, x_query = jnp.asarray(x), jnp.asarray(y), jnp.asarray(x_query)
    n = x.shape[-2]
    if sum(int(m) for m in block_sizes) != n:
        raise ValueError(f"block_sizes must sum to n = {n} (got {list(block_sizes)})")
    if contexts is None and delimiters:
        raise ValueError("delimiters need contexts (K+1, p)")
    batch = x.shape[:-2]
    dt = x.dtype
    if contexts is None:
        data = jnp.concatenate([x, y[..., None]], axis=-1)
        query = jnp.concatenate([x_query, jnp.zeros(batch + (1,), dt)], axis=-1)
        Z = jnp.concatenate([data, query[..., None, :]], axis=-2)
        tok_mask = None if mask is None else jnp.concatenate(
            [jnp.broadcast_to(jnp.asarray(mask, dt), batch + (n,)), jnp.ones(batch + (1,), dt)], -1)
        return Z, tok_mask
    contexts = jnp.asarray(contexts, dt)
    K, p = len(block_sizes), contexts.shape[-1]
    if contexts.shape[0] != K + 1:
        raise ValueError(f"contexts must have K + 1 = {K + 1} rows c̄_0..c̄_K (got {contexts.shape[0]})")
    d = x.shape[-1]
    # Each token's row of (x, y) and of the contexts by one gather per field: rows n (the query) and n + 1 (a
    # delimiter's zeros) appended to the samples, context row K + 1 a zero for query_context=None. XLA runs
    # this as one pass over the tokens; the blocks' concatenation (slices, rows and broadcasts) would take two
    # (the same values).
    rows, crows, mpieces, start = [], [], [], 0
    for k, nk in enumerate(block_sizes):
        rows += range(start, start + nk)
        crows += [0] * nk
        start += nk
        if delimiters:
            rows.append(n + 1)
            crows.append(k + 1)
    rows.append(n)
    crows.append(K + 1 if query_context is None else query_context)
    rows, crows = np.asarray(rows), np.asarray(crows)
    xs = jnp.concatenate([x, x_query[..., None, :], jnp.zeros(batch + (1, d), dt)], axis=-2)[..., rows, :]
    ys = jnp.concatenate([y, jnp.zeros(batch + (2,), dt)], axis=-1)[..., rows]
    cs = jnp.concatenate([contexts, jnp.zeros((1, p), dt)])[crows]
    Z = jnp.concatenate([xs, ys[..., None], jnp.broadcast_to(cs, batch + cs.shape)], axis=-1)
    if mask is None:
        return Z, None
    mask = jnp.broadcast_to(jnp.asarray(mask, dt), batch + (n,))
    ones = jnp.ones(batch + (1,), dt)
    start = 0
    for nk in block_sizes:
        mpieces.append(mask[..., start:start + nk])
        start += nk
        if delimiters:
            mpieces.append(ones)
    mpieces.append(ones)
    return Z, jnp.concatenate(mpieces, axis=-1)


# --------------------------------------------------------------------------------------------
# Restricted constructions


def restricted_params(P_k, P_q, p: int = 0, value: float = 1.0) -> dict:
    """Eq 9 (p = 0) and eq 20 (p > 0): W_k = [[P_k, 0], [0, 0]], W_q = [[P_q, 0], [0, 0]], W_v = value·e_y e_yᵀ.

    Then v_i = [0; value·y_i; 0], k_i = [P_kᵀx_i; 0], q_i = [P_qᵀx_i; 0].

    Args:
        P_k, P_q: (d, d); p: context width (0: plain [x; y] tokens); value: the W_v corner.
    Returns:
        dict Wq, Wk, Wv, each (D, D), D = d + 1 + p.
    """
    P_k, P_q = jnp.asarray(P_k), jnp.asarray(P_q)
    d = P_k.shape[0]
    D = d + 1 + p
    Wk = jnp.zeros((D, D), P_k.dtype).at[:d, :d].set(P_k)
    Wq = jnp.zeros((D, D), P_q.dtype).at[:d, :d].set(P_q)
    Wv = jnp.zeros((D, D), P_k.dtype).at[d, d].set(value)
    return {"Wq": Wq, "Wk": Wk, "Wv": Wv}


def construction2_params(P_k, P_q, u, p: int = 0, h=None) -> dict:
    """Construction 2 (eqs 27-29): eq 9's W_k, W_q and W_v = [0_{D×d} u 0_{D×p}]ᵀ, so v_i = y_i u.

    Output row r is xᵀP_q(XP_k ⊙ Ω_r)ᵀy with Ω_r = u_r[g^r_{j:T}]; with head h, ŷ = hᵀo_T (eq 29).

    Args:
        P_k, P_q: (d, d); u: (D,); p: context width; h: optional (D,) head.
    Returns:
        dict Wq, Wk, Wv (D, D) (+ h).
    """
    params = restricted_params(P_k, P_q, p)
    d = jnp.asarray(P_k).shape[0]
    params["Wv"] = jnp.zeros_like(params["Wv"]).at[d, :].set(jnp.asarray(u))
    if h is not None:
        params["h"] = jnp.asarray(h)
    return params


def _solve_context_logits(contexts, targets):
    # w̃ with c̄_kᵀ w̃ = target_k; exact when c̄_0..c̄_K are linearly independent (needs K + 1 ≤ p).
    C = np.asarray(contexts, dtype=float)
    w, *_ = np.linalg.lstsq(C, np.asarray(targets, dtype=float), rcond=None)
    if np.max(np.abs(C @ w - targets)) > 1e-8 * max(1.0, np.max(np.abs(targets))):
        raise ValueError("contexts c̄_0..c̄_K must be linearly independent (needs K + 1 <= p) to realise the gates")
    return w


def scalar_gate_for_weights(contexts, block_weights, d: int, logit: float = 40.0) -> jax.Array:
    """w_g = [0_{d+1}; w̃] realising block weights 0 ≤ ω_1 ≤ … ≤ ω_K ≤ 1 with scalar gates (Thm 4, App F.1).

    Gate φ(w̃ᵀc̄_0) ≈ 1 on data tokens and the query (logit ``logit``) and ω_k/ω_{k+1} at d_k (ω_{K+1} = 1;
    App F.1's "ω_k/ω_{k:K}" is garbled), so block k's weight Π_{m≥k} ω_m/ω_{m+1} = ω_k.
    Ratios 0 and 1 use logits ∓``logit``.

    Args:
        contexts: (K+1, p) c̄_0..c̄_K; block_weights: (K,) non-decreasing in [0, 1]; d: input dimension.
        logit: |gate logit| standing for a gate of 1 (or 0).
    Returns:
        (d+1+p,) w_g.
    """
    w = np.asarray(block_weights, dtype=float)
    if np.any(w < 0) or np.any(w > 1) or np.any(np.diff(w) < 0):
        raise ValueError(f"block_weights must satisfy 0 <= ω_1 <= ... <= ω_K <= 1 (got {w.tolist()})")
    ratios = w / np.append(w[1:], 1.0)
    ratios = np.where(np.append(w[1:], 1.0) == 0, 0.0, ratios)
    with np.errstate(divide="ignore"):
        lg = np.log(ratios) - np.log1p(-np.minimum(ratios, 1.0))
    lg = np.clip(np.nan_to_num(lg, nan=-logit, posinf=logit, neginf=-logit), -logit, logit)
    wt = _solve_context_logits(contexts, np.concatenate([[logit], lg]))
    return jnp.concatenate([jnp.zeros(d + 1), jnp.asarray(wt)])


def vector_gate_for_weights(contexts, block_weights, d: int, logit: float = 40.0):
    """(W_g, u, h) realising ANY real block weights ω_1..ω_K with vector gates (Thm 5).

    ω = Σ_k (ω_k − ω_{k−1}) 1[block ≥ k] (ω_0 = 0): channel k−1 (row k−1 of the state) has gate ≈ 1 on
    every token except ≈ 0 at d_{k−1}, u_{k−1} = 1 and h_{k−1} = ω_k − ω_{k−1}; other rows have u = h = 0.

    Args:
        contexts: (K+1, p) c̄_0..c̄_K (K + 1 ≤ p); block_weights: (K,); d: input dimension.
        logit: |gate logit| standing for a gate of 1 (or 0).
    Returns:
        (W_g (D, D), u (D,), h (D,)), D = d + 1 + p.
    """
    w = np.asarray(block_weights, dtype=float)
    C = np.asarray(contexts, dtype=float)
    K, p = w.shape[0], C.shape[1]
    D = d + 1 + p
    if K > D:
        raise ValueError(f"vector gating needs K <= D channels (got K = {K}, D = {D})")
    W_g, u, h = np.zeros((D, D)), np.zeros(D), np.zeros(D)
    prev = 0.0
    for k in range(1, K + 1):
        targets = np.full(K + 1, logit)
        if k > 1:
            targets[k - 1] = -logit  # gate ≈ 0 at d_{k−1}: blocks before k drop out of channel k−1
        W_g[k - 1, d + 1:] = _solve_context_logits(C, targets)
        u[k - 1], h[k - 1] = 1.0, w[k - 1] - prev
        prev = w[k - 1]
    return jnp.asarray(W_g), jnp.asarray(u), jnp.asarray(h)


def restricted_to_full(rparams, d: int, p: int) -> dict:
    """Full params of a restricted model: eq 20 with gate rows [0_{d+1}; w̃] (Thms 4-5).

    Scalar: {P_k, P_q, w_c (p,)} -> W from eq 20, w_g = [0; w_c]. Vector: {P_k, P_q, W_c (D, p), u (D,), h (D,)}
    -> construction 2 with W_g = [0_{D×(d+1)} W_c] and head h. Ungated: {P_k, P_q}.

    Args:
        rparams: restricted params; d: input dimension; p: context width.
    Returns:
        full params for ``predict``.
    """
    if "W_c" in rparams:
        params = construction2_params(rparams["P_k"], rparams["P_q"], rparams["u"], p, rparams["h"])
        Wc = rparams["W_c"]
        params["W_g"] = jnp.concatenate([jnp.zeros((Wc.shape[0], d + 1), Wc.dtype), Wc], axis=1)
        return params
    params = restricted_params(rparams["P_k"], rparams["P_q"], p)
    if "w_c" in rparams:
        params["w_g"] = jnp.concatenate([jnp.zeros(d + 1, rparams["w_c"].dtype), rparams["w_c"]])
    return params


def restricted_wpgd(rparams, contexts, block_sizes: Sequence[int], *, query_context: int | None = 0, mask=None):
    """(P, ω) of the restricted model: ŷ = xᵀ P Xᵀ(ω ⊙ y) (Thm 1 / eq 11; eq 29 for vector gates).

    P = P_q P_kᵀ; ω_j = Π_{m>j} g_m (scalar) or Σ_r h_r u_r Π_{m>j} g^r_m (vector), the gates being those
    of the token sequence of eq 19; ω = 1 without gates. Gates depend only on the contexts, so ω is the
    same for every prompt. Differentiable: the population engine trains through eq 37 with it.

    Args:
        rparams: restricted params (see ``restricted_to_full``).
        contexts: (K+1, p); block_sizes: (n_1..n_K); query_context as in ``delimiter_prompt``.
        mask: optional (n,) 0/1 validity of samples: padded samples get ω = 0 and gate 1.
    Returns:
        (P (d, d), ω (n,)).
    """
    P = rparams["P_q"] @ rparams["P_k"].T
    n = sum(int(m) for m in block_sizes)
    dt = P.dtype
    if "w_c" not in rparams and "W_c" not in rparams:
        omega = jnp.ones(n, dt)
        return P, (omega if mask is None else omega * jnp.asarray(mask, dt))
    contexts = jnp.asarray(contexts, dt)
    data_pos, delim_pos = token_layout(block_sizes)
    T = n + len(block_sizes) + 1
    cq = jnp.zeros(contexts.shape[-1], dt) if query_context is None else contexts[query_context]
    ctx = jnp.zeros((T, contexts.shape[-1]), dt).at[data_pos].set(contexts[0]).at[delim_pos].set(contexts[1:])
    ctx = ctx.at[T - 1].set(cq)
    tok_mask = None
    if mask is not None:
        tok_mask = jnp.ones(T, dt).at[data_pos].set(jnp.asarray(mask, dt))
    if "w_c" in rparams:
        lg = jax.nn.log_sigmoid(ctx @ rparams["w_c"])
        if tok_mask is not None:
            lg = jnp.where(tok_mask > 0, lg, 0.0)
        omega = query_weights(lg, "scalar")[data_pos]
    else:
        lg = jax.nn.log_sigmoid(ctx @ rparams["W_c"].T)  # (T, D)
        if tok_mask is not None:
            lg = jnp.where(tok_mask[:, None] > 0, lg, 0.0)
        omega = query_weights(lg, "vector")[data_pos] @ (rparams["h"] * rparams["u"])
    return P, (omega if mask is None else omega * jnp.asarray(mask, dt))


# --------------------------------------------------------------------------------------------
# Model families

#: Task of the families that read delimiter prompts (eq 19, ``delimiter_prompt`` with contexts): D = d + 1 + p.
DELIMITED = "multitask_delimited"
#: Task of the families that read plain [x; y] tokens (``delimiter_prompt`` without contexts): D = d + 1.
PLAIN = "multitask_plain"


def _one_layer_init(kind: Gating, head: bool):
    def init(key, *, D: int, std: float = 0.1, dtype=jnp.float64, **unused):
        return init_params(key, D, kind, head=head, std=std, dtype=dtype)

    return init


def _multilayer_init(key, *, D: int, layers: int, std: float = 0.1, dtype=jnp.float64, **unused):
    return init_multilayer(key, D, layers, "scalar", std=std, dtype=dtype)


for _family in (
    ModelFamily("linatt", DELIMITED, _one_layer_init("none", False), predict, options=("form",),
                description="causal linear attention (G ≡ 1) on delimiter prompts (eq 19); ŷ = (o_T)_{d+1}"),
    ModelFamily("gla", DELIMITED, _one_layer_init("scalar", False), predict, options=("form",),
                description="GLA with scalar gates φ(w_gᵀz) on delimiter prompts (Thm 4); ŷ = (o_T)_{d+1}"),
    ModelFamily("gla_wo", PLAIN, _one_layer_init("scalar", False), predict, options=("form",),
                description="GLA with scalar gates φ(w_gᵀz) on [x; y] tokens without delimiters (Fig 1 GLA-wo)"),
    ModelFamily("gla_vector", DELIMITED, _one_layer_init("vector", True), predict, options=("form",),
                description="GLA with vector gates φ(W_g z)1ᵀ and a linear head on delimiter prompts (Thm 5); "
                            "ŷ = hᵀo_T"),
    ModelFamily("gla_multilayer", DELIMITED, _multilayer_init, predict_multilayer, options=("form",),
                description="L-layer residual GLA (eq 25), scalar gates per layer, on delimiter prompts; "
                            "init(..., layers=L)"),
):
    register_model(_family)
del _family
