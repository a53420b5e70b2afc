"""Gated linear attention with one global forget factor λ (drift paper, Sec 3, eqs 5-9, 18).

One layer maps tokens z_1..z_T (rows of Z, token-major; T = n+1 with the query last) to

    q_t = W_Q z_t,  k_t = W_K z_t,  v_t = W_V z_t,   S_t = λ S_{t-1} + v_t k_tᵀ (S_0 = 0),  o_t = S_t q_t,

with no softmax, normaliser, feature map, 1/n, MLP or LayerNorm. λ ∈ (0, 1] is ONE scalar shared by
every token; λ = 1 is linear attention (LA). The prediction is ŷ = o_{n+1}(d+1), the label
coordinate of the query's output.

This is the gating paper's GLA (:mod:`iclab.models.gla`) with a data-independent scalar gate,
g_t = λ for every token: the recurrent, unrolled and parallel forms are that module's kernels
(``gla.recurrent``, ``gla.unrolled``, ``gla.parallel``, ``gla.query_weights``) fed with the constant gate,
so each form is written once. Equal forms (all positions):

- recurrent (eqs 5-6): the state recursion above, a ``lax.scan`` over tokens;
- unrolled (eq 7): o_t = (Σ_{i≤t} λ^{t-i} v_i k_iᵀ) q_t = W_V (Σ_{i≤t} λ^{t-i} z_i z_iᵀ) W_Kᵀ W_Q z_t, every
  decay product formed explicitly;
- parallel: O = (D_λ ⊙ Q Kᵀ) V with (D_λ)_{t,s} = λ^{t-s} 1[s ≤ t] (the paper's V (D_λ ⊙ KᵀQ) in
  its column layout), one (T, T) mask shared by the batch; for ``restricted``/``lemma2`` weights (a
  one-row W_V) the one value column is evaluated as o_t(d+1) = q_tᵀ (D_λ (v ⊙ K))_t, the same sum in another order;
- scan: the recurrent form evaluated by an associative scan (log depth, O(T d²) work);
- chunked: the parallel form inside chunks of C tokens and the recurrent state between chunks
  (O(T C d + T d²) work, no (T, T) matrix; ``gla_chunked``);
- native: the recurrent form as compiled CPU kernels with a hand-written backward pass
  (:func:`iclab.ops.forget_layer`, compiled CPU kernels), the fast path for training multi-layer models on a CPU.

``predict(..., form="readout")`` evaluates only ŷ, in O(T d) per prompt: ŷ = Σ_i λ^{n+1-i}
(W_V z_i)_{d+1} (k_iᵀ q_{n+1}); it is the fast path for training one layer.

Parametrisations (params are dicts of arrays; d+1 is the token width):

- ``qkv``: ``{"WQ", "WK", "WV"}``, each (d+1, d+1), the paper's separate projections.
- ``merged``: ``{"WV", "WKQ"}`` with W^KQ = W_Kᵀ W_Q (eq 8): q_t = W^KQ z_t, k_t = z_t.
- ``lemma2``: ``{"U"}`` (d+1, d+1), U = [[U_11, u_12], [u_21ᵀ, u_{-1}]] of Lemma 2: the merged
  weights whose last row of W^V is (u_12ᵀ, u_{-1}), whose first d columns of W^KQ are
  [U_11; u_21ᵀ], and whose other entries (which never reach ŷ, eq 9) are 0.
- ``restricted``: ``{"U11": (d, d), "u_m1": ()}``, Lemma 2 with u_12 = u_21 = 0, the set kept by
  the gradient flow from Assumption 1 (eq 13): ŷ = u_{-1} Gᵀ U_11 x_{n+1}, G = Σ_{i≤n} λ^{n+1-i} y_i x_i.

Any of them may carry ``"theta"`` (a scalar): then the forget factor is learnt as λ = sigmoid(θ)
(an extension the paper only suggests). An explicit ``lam`` argument always wins over θ: this is
how a trained model is evaluated at a test-time λ̄ ≠ λ (eq 18).

The L-layer model (``predict_multilayer``) stacks L layers of one parametrisation with their own
weights and a shared λ, residually: Z ← Z + GLA_l(Z) at every position, read out at Z^{(L)}[n+1, d+1]
(the paper's multi-layer architecture is unspecified; this one is our choice).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from iclab.models import gla as _gla
from iclab.ops import forget_layer, forget_multilayer_mse, forget_readout_grid, forget_readout_grid_shared, \
    forget_readout_mse_shared

__all__ = ["PARAMETRISATIONS", "Form", "Parametrisation", "decay_weights", "decayed_cumsum", "forget_factor",
           "gla_chunked", "gla_layer", "gla_parallel", "gla_readout", "gla_recurrent", "gla_scan", "gla_unrolled", "init_assumption1",
           "init_gla", "lemma2_matrix", "merged_weights", "parametrisation", "predict", "predict_linear_attention",
           "kernel_weights", "multilayer_mse_native", "predict_multilayer", "predict_restricted", "projections",
           "readout_grid", "readout_grid_shared", "readout_mse_shared", "restricted_from_optimum"]

Parametrisation = Literal["qkv", "merged", "lemma2", "restricted"]
Form = Literal["readout", "parallel", "chunked", "recurrent", "scan", "unrolled", "native"]
PARAMETRISATIONS: tuple[str, ...] = ("qkv", "merged", "lemma2", "restricted")


def parametrisation(params) -> Parametrisation:
    """Which parametrisation a param dict uses, read off its keys (``theta`` ignored).

    Args:
        params: a param dict (see the module docstring).
    Returns:
        ``qkv``, ``merged``, ``lemma2`` or ``restricted``.
    Raises:
        ValueError: for any other set of keys.
    """
    keys = set(params) - {"theta"}
    for name, needed in (("qkv", {"WQ", "WK", "WV"}), ("merged", {"WV", "WKQ"}), ("lemma2", {"U"}),
                         ("restricted", {"U11", "u_m1"})):
        if keys == needed:
            return name  # type: ignore[return-value]
    raise ValueError(f"unknown GLA parameters {sorted(params)}: expected one of WQ/WK/WV, WV/WKQ, U, U11/u_m1")


def forget_factor(params, lam=None) -> jax.Array:
    """The forget factor used by a forward pass: ``lam`` if given (test-time λ̄, eq 18), else sigmoid(θ).

    Args:
        params: a param dict, optionally with a trainable ``theta``.
        lam: an explicit forget factor, or None.
    Returns:
        λ as a (scalar) array.
    Raises:
        ValueError: if neither ``lam`` nor ``params["theta"]`` is given.
    """
    if lam is not None:
        return jnp.asarray(lam)
    if "theta" in params:
        return jax.nn.sigmoid(params["theta"])
    raise ValueError("lam is required unless the params carry a trainable 'theta'")


def merged_weights(params) -> tuple[jax.Array, jax.Array]:
    """(W^V, W^KQ = W_Kᵀ W_Q) of any parametrisation (eq 8, Lemma 2 mapping).

    Args:
        params: any parametrisation.
    Returns:
        (W_V, W_KQ), each (d+1, d+1).
    """
    kind = parametrisation(params)
    if kind == "qkv":
        return params["WV"], params["WK"].T @ params["WQ"]
    if kind == "merged":
        return params["WV"], params["WKQ"]
    if kind == "lemma2":
        U = params["U"]
        d = U.shape[-1] - 1
        WV = jnp.zeros_like(U).at[d, :].set(U[:, d])
        WKQ = jnp.zeros_like(U).at[:, :d].set(U[:, :d])
        return WV, WKQ
    U11, u = params["U11"], params["u_m1"]
    d = U11.shape[-1]
    WV = jnp.zeros((d + 1, d + 1), U11.dtype).at[d, d].set(u)
    WKQ = jnp.zeros((d + 1, d + 1), U11.dtype).at[:d, :d].set(U11)
    return WV, WKQ


def lemma2_matrix(params) -> jax.Array:
    """U of Lemma 2 from any parametrisation: U_11 = W^KQ_11, u_12 = w^V_21, u_21 = w^KQ_21, u_{-1} = w^V_{-1}.

    Args:
        params: any parametrisation.
    Returns:
        (d+1, d+1): columns :d are the first d columns of W^KQ, column d is the last row of W^V.
    """
    WV, WKQ = merged_weights(params)
    return jnp.asarray(WKQ).at[:, -1].set(WV[-1, :])


def projections(params, Z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of every token (eq 5): q_t = W_Q z_t, k_t = W_K z_t, v_t = W_V z_t.

    ``qkv`` uses its own W_Q, W_K; every other parametrisation uses k_t = z_t, q_t = W^KQ z_t, which
    gives the same k_iᵀ q_t = z_iᵀ W_Kᵀ W_Q z_t.

    Args:
        params: any parametrisation.
        Z: (..., T, d+1) tokens.
    Returns:
        (Q, K, V), each (..., T, d+1).
    """
    if parametrisation(params) == "qkv":
        return Z @ params["WQ"].T, Z @ params["WK"].T, Z @ params["WV"].T
    WV, WKQ = merged_weights(params)
    return Z @ WKQ.T, Z, Z @ WV.T


def _log_gates(lam, T: int, dtype) -> jax.Array:
    """log g_t = log λ for every token: the constant scalar gate of :mod:`iclab.models.gla`, (T,)."""
    return jnp.broadcast_to(jnp.log(jnp.asarray(lam, dtype)), (T,))


def _gates(lam, T: int, dtype) -> jax.Array:
    """G_t = λ for every token, as the (T, 1, 1) gate matrices of :mod:`iclab.models.gla`."""
    return jnp.broadcast_to(jnp.asarray(lam, dtype), (T, 1, 1))


def decay_weights(T: int, lam) -> jax.Array:
    """λ^{T-1-t} for t = 0..T-1: the weight of token t in the state of the last token.

    ``gla.query_weights`` of the constant gate g_t = λ.

    Args:
        T: number of tokens.
        lam: forget factor λ > 0 (scalar).
    Returns:
        (T,) weights.
    """
    lam = jnp.asarray(lam)
    dtype = lam.dtype if jnp.issubdtype(lam.dtype, jnp.floating) else jnp.result_type(float)
    return _gla.query_weights(_log_gates(lam, T, dtype), "scalar")


def gla_parallel(params, Z: jax.Array, lam=None) -> jax.Array:
    """Parallel form O = (D_λ ⊙ Q Kᵀ) V, (D_λ)_{t,s} = λ^{t-s} 1[s ≤ t]: ``gla.parallel`` with log g_t = log λ.

    For ``restricted``/``lemma2`` params W_V has only its last row, so only the label column of V is passed
    (one value column: no (T, T) score matrix per prompt) and the other columns of O are 0.

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
    Returns:
        O: (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    log_g = _log_gates(lam, Z.shape[-2], jnp.result_type(Q, lam))
    if parametrisation(params) in ("restricted", "lemma2"):
        o = _gla.parallel(Q, K, V[..., -1:], log_g, "scalar")
        return jnp.zeros_like(V).at[..., -1:].set(o)
    return _gla.parallel(Q, K, V, log_g, "scalar")


def gla_recurrent(params, Z: jax.Array, lam=None) -> jax.Array:
    """Recurrent form (eqs 5-6): S_t = λ S_{t-1} + v_t k_tᵀ, o_t = S_t q_t; ``gla.recurrent`` with G_t = λ.

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
    Returns:
        O: (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    return _gla.recurrent(Q, K, V, _gates(lam, Z.shape[-2], jnp.result_type(Q, lam)))


def decayed_cumsum(b: jax.Array, lam, axis: int) -> jax.Array:
    """c_t = λ c_{t-1} + b_t along ``axis`` (c_1 = b_1), by an associative scan: log depth, no λ^{-k}.

    Args:
        b: the increments.
        lam: forget factor λ (scalar).
        axis: the token axis of ``b``.
    Returns:
        c, shaped like ``b``.
    """
    lam = jnp.asarray(lam)
    if not jnp.issubdtype(lam.dtype, jnp.floating):
        lam = lam.astype(float)
    b = jnp.moveaxis(b, axis, 0)
    a = jnp.broadcast_to(lam.astype(b.dtype), (b.shape[0],) + (1,) * (b.ndim - 1))

    def combine(x, y):
        (a1, b1), (a2, b2) = x, y
        return a1 * a2, a2 * b1 + b2

    return jnp.moveaxis(jax.lax.associative_scan(combine, (a, b), axis=0)[1], 0, axis)


def gla_scan(params, Z: jax.Array, lam=None) -> jax.Array:
    """Recurrent form (eqs 5-6) evaluated by an associative scan over tokens instead of a sequential loop.

    S_t = Σ_{i≤t} λ^{t-i} v_i k_iᵀ for every t at once (O(T d²) work, log T depth), o_t = S_t q_t.
    For ``restricted`` and ``lemma2`` params, W_V has only its last row, so only the state's last row
    s_t = Σ_{i≤t} λ^{t-i} (v_i)_{d+1} k_i is formed (O(T d)).

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
    Returns:
        O: (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    if parametrisation(params) in ("restricted", "lemma2"):
        s = decayed_cumsum(V[..., -1:] * K, lam, axis=-2)
        return jnp.zeros_like(V).at[..., -1].set(jnp.sum(s * Q, axis=-1))
    S = decayed_cumsum(V[..., :, None] * K[..., None, :], lam, axis=-3)
    return jnp.einsum("...tij,...tj->...ti", S, Q)


def _chunked(Q: jax.Array, K: jax.Array, V: jax.Array, lam, chunk: int) -> jax.Array:
    """o_t = Σ_{s≤t} λ^{t−s} (q_t·k_s) v_s by chunks of C tokens: causal (C, C) blocks inside a chunk, a (D, D)
    state carried between chunks. Shapes (..., T, D) for Q, K and (..., T, Dv) for V; returns (..., T, Dv)."""
    T, C = Q.shape[-2], min(chunk, Q.shape[-2])
    N = -(-T // C)
    pad = N * C - T  # zero tokens in front: k = v = 0 adds nothing to any state
    lead = Q.shape[:-2]

    def blocks(A):
        A = jnp.pad(A, [(0, 0)] * (A.ndim - 2) + [(pad, 0), (0, 0)])
        return A.reshape(lead + (N, C, A.shape[-1]))

    Qc, Kc, Vc = blocks(Q), blocks(K), blocks(V)
    log_lam = jnp.log(jnp.asarray(lam, Q.dtype))
    r = jnp.arange(C)
    gap = r[:, None] - r[None, :]
    decay = jnp.where(gap >= 0, jnp.exp(jnp.maximum(gap, 0) * log_lam), 0.0).astype(Q.dtype)  # λ^{r−s} 1[s ≤ r]
    inner = jnp.einsum("...nrs,...nsv->...nrv", jnp.einsum("...nrd,...nsd->...nrs", Qc, Kc) * decay, Vc)
    # U_j = Σ_r λ^{C−1−r} v_r k_rᵀ (chunk j's own state); S_j = λ^C S_{j−1} + U_j; chunk j reads S_{j−1}
    U = jnp.einsum("...nrv,...nrd->...nvd", Vc * jnp.exp((C - 1 - r) * log_lam)[:, None].astype(Q.dtype), Kc)
    lam_C = jnp.exp(C * log_lam).astype(Q.dtype)

    def carry(S, U_j):
        return lam_C * S + U_j, S

    _, S_prev = jax.lax.scan(carry, jnp.zeros(lead + U.shape[-2:], Q.dtype), jnp.moveaxis(U, -3, 0))
    outer = jnp.einsum("...nvd,...nrd->...nrv", jnp.moveaxis(S_prev, 0, -3), Qc)
    O = inner + jnp.exp((r + 1) * log_lam)[:, None].astype(Q.dtype) * outer
    return O.reshape(lead + (N * C, V.shape[-1]))[..., pad:, :]


def gla_chunked(params, Z: jax.Array, lam=None, chunk: int = 16) -> jax.Array:
    """Chunked form: the parallel form inside chunks of C tokens, the recurrent state between them.

    For chunk j (tokens jC..jC+C−1, r the position inside it, the sequence padded in front with zero
    tokens to a multiple of C): o_{jC+r} = Σ_{s≤r} λ^{r−s} (q_r·k_s) v_s + λ^{r+1} S_{j−1} q_r, with
    S_j = λ^C S_{j−1} + Σ_r λ^{C−1−r} v_r k_rᵀ. O(T·C·D + T·D²) work per prompt against the parallel
    form's O(T²·D), and no (T, T) score matrix. ``restricted``/``lemma2`` params carry one value column.

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
        chunk: tokens per chunk C (≥ 1; C ≥ T is the parallel form).
    Returns:
        O: (..., T, d+1).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 (got {chunk})")
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    if parametrisation(params) in ("restricted", "lemma2"):
        return jnp.zeros_like(V).at[..., -1:].set(_chunked(Q, K, V[..., -1:], lam, chunk))
    return _chunked(Q, K, V, lam, chunk)


def gla_unrolled(params, Z: jax.Array, lam=None) -> jax.Array:
    """Unrolled form (eq 7) at every position: o_t = (Σ_{i≤t} λ^{t-i} v_i k_iᵀ) q_t = W_V (Σ_{i≤t} λ^{t-i} z_i z_iᵀ) W_Kᵀ W_Q z_t.

    ``gla.unrolled`` with G_t = λ: every decay product λ^{t-i} = G_{i:t} is formed explicitly (O(T³) gate
    products, a reference form).

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
    Returns:
        O: (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    return _gla.unrolled(Q, K, V, _gates(lam, Z.shape[-2], jnp.result_type(Q, lam)))


def gla_readout(params, Z: jax.Array, lam=None) -> jax.Array:
    """ŷ = o_{n+1}(d+1) only: Σ_{i≤n+1} λ^{n+1-i} (W_V z_i)_{d+1} (k_iᵀ q_{n+1}), O(T d) per prompt.

    For ``restricted`` params this is ``predict_restricted`` plus the query's own term
    u_{-1} z_{n+1}(d+1) x_{n+1}ᵀ U_11 x_{n+1}, which vanishes on a prompt (label slot 0) but not inside
    an L-layer model, whose residual stream fills the query's label slot.

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., n+1, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
    Returns:
        (...,) predictions.
    """
    lam = forget_factor(params, lam)
    T = Z.shape[-2]
    kind = parametrisation(params)
    if kind == "restricted":
        U11, u = params["U11"], params["u_m1"]
        xq = Z[..., -1, :-1]
        query = u * Z[..., -1, -1] * jnp.einsum("...i,ij,...j->...", xq, U11, xq)
        return predict_restricted(U11, u, Z, lam) + query
    if kind == "qkv":
        c, v_row = (Z[..., -1, :] @ params["WQ"].T) @ params["WK"], params["WV"][-1]  # c = W_Kᵀ q_{n+1}
    else:
        WV, WKQ = merged_weights(params)
        c, v_row = Z[..., -1, :] @ WKQ.T, WV[-1]
    return jnp.einsum("t,...t,...t->...", decay_weights(T, lam), Z @ v_row, jnp.einsum("...td,...d->...t", Z, c))


def kernel_weights(params) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(W_Q, W_K, W_V) of one layer of any parametrisation as the layer kernels read them: ``qkv`` as they are,
    the others merged as W_Q = W^KQ, W_K = I (q_t = W^KQ z_t, k_t = z_t: the same layer, eq 8). ``jax.vmap`` it
    over a leading layer axis.

    Args:
        params: one layer of any parametrisation (``theta`` ignored).
    Returns:
        (W_Q, W_K, W_V), each (d+1, d+1).
    """
    params = {k: v for k, v in params.items() if k != "theta"}
    if parametrisation(params) == "qkv":
        return params["WQ"], params["WK"], params["WV"]
    WV, WQ = merged_weights(params)
    return WQ, jnp.eye(WQ.shape[-1], dtype=WQ.dtype), WV


def _native_layer(params, Z: jax.Array, lam=None) -> jax.Array:
    """The recurrent form by compiled CPU kernels (:func:`iclab.ops.forget_layer`; its own custom VJP)."""
    WQ, WK, WV = kernel_weights(params)
    return forget_layer(Z, WQ, WK, WV, forget_factor(params, lam), backend="native")


_LAYER_FORMS = {"parallel": gla_parallel, "chunked": gla_chunked, "recurrent": gla_recurrent, "scan": gla_scan,
                "unrolled": gla_unrolled, "native": _native_layer}


def gla_layer(params, Z: jax.Array, lam=None, form: Form = "parallel") -> jax.Array:
    """Outputs o_t of one GLA layer at every position (eqs 5-7) in the given form.

    Args:
        params: any parametrisation (optionally with ``theta``).
        Z: (..., T, d+1) tokens.
        lam: forget factor; None uses sigmoid(params["theta"]).
        form: ``parallel``, ``chunked`` (16 tokens per chunk), ``recurrent``, ``scan``, ``unrolled`` or ``native``
            (the recurrent form in compiled CPU kernels, :func:`iclab.ops.forget_layer`); all equal.
    Returns:
        O: (..., T, d+1).
    """
    if form not in _LAYER_FORMS:
        raise ValueError(f"form must be one of {sorted(_LAYER_FORMS)} for all positions (got {form!r})")
    return _LAYER_FORMS[form](params, Z, lam)


def predict(params, Z: jax.Array, lam=None, form: Form = "readout") -> jax.Array:
    """One-layer GLA prediction ŷ = o_{n+1}(d+1) (eqs 5-7); ``lam`` = λ, or λ̄ at test time (eq 18).

    Args:
        params: any parametrisation (see module docstring), optionally with ``theta``.
        Z: (..., n+1, d+1) tokens with the query's label slot 0.
        lam: forget factor; None uses sigmoid(params["theta"]).
        form: ``readout`` (fast), ``parallel``, ``chunked``, ``recurrent``, ``scan`` or ``unrolled``; all equal.
    Returns:
        (...,) predictions.
    """
    if form == "readout":
        return gla_readout(params, Z, lam)
    return gla_layer(params, Z, lam, form)[..., -1, -1]


def predict_linear_attention(params, Z: jax.Array) -> jax.Array:
    """Linear attention (the λ = 1 model): ŷ = (W_V Zᵀ Z W_Kᵀ W_Q z_{n+1})_{d+1}, written independently of λ.

    Args:
        params: any parametrisation (``theta`` ignored).
        Z: (..., n+1, d+1) tokens.
    Returns:
        (...,) predictions.
    """
    WV, WKQ = merged_weights(params)
    return jnp.einsum("j,...tj,...tk,kl,...l->...", WV[-1], Z, Z, WKQ, Z[..., -1, :])


def predict_restricted(U11: jax.Array, u_m1, Z: jax.Array, lam) -> jax.Array:
    """Assumption-1 form: ŷ = u_{-1} Gᵀ U_11 x_{n+1}, G = Σ_{i≤n} λ^{n+1-i} y_i x_i (the query drops out).

    Args:
        U11: (d, d); u_m1: scalar u_{-1}.
        Z: (..., n+1, d+1) tokens.
        lam: forget factor λ.
    Returns:
        (...,) predictions.
    """
    ell = decay_weights(Z.shape[-2], lam)[:-1]
    G = jnp.einsum("t,...t,...ti->...i", ell, Z[..., :-1, -1], Z[..., :-1, :-1])
    return u_m1 * jnp.einsum("...i,ij,...j->...", G, U11, Z[..., -1, :-1])


# --------------------------------------------------------------------------------------------
# L-layer residual GLA


def predict_multilayer(layers, Z: jax.Array, lam, form: Form = "parallel") -> jax.Array:
    """L-layer residual GLA with a shared λ: Z ← Z + GLA_l(Z) (all positions), ŷ = Z^{(L)}[n+1, d+1].

    Layers 1..L-1 run at every position in ``form``; the last layer is read out at the query only
    (its other outputs never reach ŷ). With L = 1 this is the one-layer prediction, since the
    query's label slot of Z is 0.

    Args:
        layers: one parametrisation's params with a leading layer axis L on every array (a trainable
            ``theta``, if any, is a scalar shared by the layers and not stacked).
        Z: (..., n+1, d+1) tokens.
        lam: shared forget factor, or None for sigmoid(layers["theta"]).
        form: form of the full layers: ``parallel`` (quickest to compile), ``chunked``, ``scan``, ``recurrent``,
            ``unrolled`` or ``native`` (compiled CPU kernels; the fastest at large batches).
    Returns:
        (...,) predictions.
    """
    theta = {"theta": layers["theta"]} if "theta" in layers else {}
    stacked = {k: v for k, v in layers.items() if k != "theta"}
    lam = forget_factor(theta, lam)
    head = jax.tree_util.tree_map(lambda a: a[:-1], stacked)
    last = jax.tree_util.tree_map(lambda a: a[-1], stacked)

    def body(Z, layer):
        return Z + gla_layer(layer, Z, lam, form), None

    Z, _ = jax.lax.scan(body, Z, head)
    return Z[..., -1, -1] + gla_readout(last, Z, lam)


# --------------------------------------------------------------------------------------------
# Initialisation


def init_gla(key: jax.Array, d: int, kind: Parametrisation = "qkv", std: float = 0.1, *, layers: int | None = None,
             theta: float | None = None, dtype=jnp.float64):
    """Random Gaussian init (the paper's "random Gaussian init"; its std is unspecified): every entry N(0, std²).

    ``restricted`` draws U_11 and u_{-1}; ``lemma2`` draws all of U. Each array is drawn from its own key
    (``jax.random.split``) by ``jax.random.normal`` (threefry), NOT the RBG sampler
    :func:`iclab.tasks.standard_normal`: the joint trainer vmaps this init over member keys, and XLA's
    ``rng_bit_generator`` batches over keys by drawing the whole batch from the FIRST key, so an RBG init
    would not be a function of the member's own key (a member trained alone would start elsewhere). The
    init compiles once per run, so threefry's compile time does not matter here.

    Args:
        key: PRNG key.
        d: input dimension (tokens have width d+1).
        kind: the parametrisation.
        std: standard deviation of every entry.
        layers: None for one layer, else every array gets a leading layer axis of this length.
        theta: None, or the initial θ of a trainable forget factor λ = sigmoid(θ).
        dtype: float dtype.
    Returns:
        params dict.
    """
    shapes = {"qkv": {"WQ": (d + 1, d + 1), "WK": (d + 1, d + 1), "WV": (d + 1, d + 1)},
              "merged": {"WV": (d + 1, d + 1), "WKQ": (d + 1, d + 1)},
              "lemma2": {"U": (d + 1, d + 1)},
              "restricted": {"U11": (d, d), "u_m1": ()}}[kind]
    lead = () if layers is None else (layers,)
    keys = jax.random.split(key, len(shapes))
    params = {name: std * jax.random.normal(k, lead + shape, dtype) for k, (name, shape) in zip(keys, shapes.items())}
    if theta is not None:
        params["theta"] = jnp.asarray(theta, dtype)
    return params


def init_assumption1(Theta: jax.Array, sigma: float):
    """Restricted params at Assumption 1 (eq 13): U_11(0) = σ ΘΘᵀ, u_{-1}(0) = σ.

    Args:
        Theta: (d, d) with ‖ΘΘᵀ‖_F = 1 (not re-checked here; see ``iclab.theory.drift.assumption1_init``).
        sigma: initial scale σ.
    Returns:
        ``{"U11", "u_m1"}``.
    """
    Theta = jnp.asarray(Theta)
    return {"U11": sigma * Theta @ Theta.T, "u_m1": jnp.asarray(sigma, Theta.dtype)}


def restricted_from_optimum(U11: jax.Array, u_m1) -> dict:
    """Restricted params from (U_11, u_{-1}), e.g. the Theorem 1 optimum of ``theory.drift.optimal_restricted``.

    Args:
        U11: (d, d); u_m1: scalar u_{-1}.
    Returns:
        ``{"U11", "u_m1"}`` as arrays.
    """
    return {"U11": jnp.asarray(U11), "u_m1": jnp.asarray(u_m1)}


def multilayer_mse_native(layers, Z: jax.Array, y: jax.Array, lam=None) -> jax.Array:
    """Mean squared error of an L-layer residual GLA (:func:`predict_multilayer`) on one batch by the compiled
    kernels, the whole model in one host call (:func:`iclab.ops.forget_multilayer_mse`).

    Args:
        layers: one parametrisation's params with a leading layer axis L (``init_gla(..., layers=L)``; a trainable
            ``theta`` gives λ = sigmoid(θ) when ``lam`` is None).
        Z: (B, T, d+1) tokens, the query last; y: (B,) targets.
        lam: forget factor shared by the layers (None: sigmoid(θ)).
    Returns:
        The scalar loss mean((ŷ − y)²), in Z's dtype.
    """
    lam = forget_factor({"theta": layers["theta"]} if "theta" in layers else {}, lam)
    WQ, WK, WV = jax.vmap(kernel_weights)({k: v for k, v in layers.items() if k != "theta"})
    return forget_multilayer_mse(Z, y, WQ, WK, WV, lam, backend="native")


def readout_grid(Z: jax.Array, u: jax.Array, c: jax.Array, lam: jax.Array) -> jax.Array:
    """The read-out at the query of a (G, K) grid of one-layer models by the compiled kernel: ŷ_gkb =
    Σ_i λ_gk^{n+1−i} (u_gk·z_gbi)(c_gkb·z_gbi) (:func:`iclab.ops.forget_readout_grid`; :func:`gla_readout`'s
    prediction with u = (W_V)_{d+1,:}, c = W^KQ z_q).

    Args:
        Z: (G, B, T, d+1) tokens; u: (G, K, d+1); c: (G, K, B, d+1); lam: (G, K).
    Returns:
        (G, K, B) predictions.
    """
    return forget_readout_grid(Z, u, c, lam, backend="native")


#: The same read-out on the shared layout (the inputs once for every γ), its predictions and its loss with the
#: gradient in one pass (:mod:`iclab.ops`: compiled kernels).
readout_grid_shared = forget_readout_grid_shared
readout_mse_shared = forget_readout_mse_shared
