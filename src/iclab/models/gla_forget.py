"""Gated linear attention with one global forget factor λ (drift paper, Sec 3, eqs 5-9, 18).

One layer maps tokens z_1..z_T (rows of Z, token-major; T = n+1 with the query last) to

    q_t = W_Q z_t,  k_t = W_K z_t,  v_t = W_V z_t,   S_t = λ S_{t-1} + v_t k_tᵀ (S_0 = 0),  o_t = S_t q_t,

with no softmax, normaliser, feature map, 1/n, MLP or LayerNorm. λ ∈ (0, 1] is ONE scalar shared by
every token; λ = 1 is linear attention (LA). The prediction is ŷ = o_{n+1}(d+1), the label
coordinate of the query's output. Three equal forms (all positions):

- recurrent (eq 5-6): the state recursion above, a ``lax.scan`` over tokens;
- unrolled (eq 7): o_t = W_V (Σ_{i≤t} λ^{t-i} z_i z_iᵀ) W_Kᵀ W_Q z_t;
- parallel: O = (D_λ ⊙ Q Kᵀ) V with (D_λ)_{t,s} = λ^{t-s} 1[s ≤ t] (the paper's V (D_λ ⊙ KᵀQ) in
  its column layout); for ``restricted``/``lemma2`` weights (a one-row W_V) evaluated as
  o_t(d+1) = q_tᵀ (D_λ (v ⊙ K))_t, the same sum in another order.

``scan`` is the recurrent form evaluated by an associative scan (log depth, O(T d²) work).

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
(the paper's multi-layer architecture is unspecified; spec §3).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from iclab.tasks.drift import standard_normal

Parametrisation = Literal["qkv", "merged", "lemma2", "restricted"]
Form = Literal["readout", "parallel", "recurrent", "scan", "unrolled"]
PARAMETRISATIONS: tuple[str, ...] = ("qkv", "merged", "lemma2", "restricted")


def parametrisation(params) -> Parametrisation:
    """Which parametrisation a param dict uses (by its keys)."""
    keys = set(params) - {"theta"}
    for name, needed in (("qkv", {"WQ", "WK", "WV"}), ("merged", {"WV", "WKQ"}), ("lemma2", {"U"}),
                         ("restricted", {"U11", "u_m1"})):
        if keys == needed:
            return name  # type: ignore[return-value]
    raise ValueError(f"unknown GLA parameters {sorted(params)}: expected one of WQ/WK/WV, WV/WKQ, U, U11/u_m1")


def forget_factor(params, lam=None) -> jax.Array:
    """The forget factor used by a forward pass: ``lam`` if given (test-time λ̄, eq 18), else sigmoid(θ).

    Raises:
        ValueError: if neither ``lam`` nor ``params["theta"]`` is given.
    """
    if lam is not None:
        return jnp.asarray(lam)
    if "theta" in params:
        return jax.nn.sigmoid(params["theta"])
    raise ValueError("lam is required unless the params carry a trainable 'theta'")


def merged_weights(params) -> tuple[jax.Array, jax.Array]:
    """(W^V, W^KQ = W_Kᵀ W_Q), each (d+1, d+1), of any parametrisation (eq 8, Lemma 2 mapping)."""
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

    Returns:
        (d+1, d+1): columns :d are the first d columns of W^KQ, column d is the last row of W^V.
    """
    WV, WKQ = merged_weights(params)
    return jnp.asarray(WKQ).at[:, -1].set(WV[-1, :])


def projections(params, Z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of every token (eq 5), each (..., T, d+1).

    ``qkv`` uses its own W_Q, W_K; every other parametrisation uses k_t = z_t, q_t = W^KQ z_t, which
    gives the same k_iᵀ q_t = z_iᵀ W_Kᵀ W_Q z_t.
    """
    if parametrisation(params) == "qkv":
        return Z @ params["WQ"].T, Z @ params["WK"].T, Z @ params["WV"].T
    WV, WKQ = merged_weights(params)
    return Z @ WKQ.T, Z, Z @ WV.T


def _as_float(lam) -> jax.Array:
    lam = jnp.asarray(lam)
    return lam if jnp.issubdtype(lam.dtype, jnp.floating) else lam.astype(float)


def decay_mask(T: int, lam) -> jax.Array:
    """(D_λ)_{t,s} = λ^{t-s} for s ≤ t, else 0; shape (T, T) (token-major: row t is the query)."""
    lam = _as_float(lam)
    idx = jnp.arange(T)
    lag = idx[:, None] - idx[None, :]
    # exponent clipped to ≥ 0 before masking: λ^{-k} would overflow (and poison gradients) for small λ
    return jnp.where(lag >= 0, lam ** jnp.maximum(lag, 0).astype(lam.dtype), 0.0).astype(lam.dtype)


def decay_weights(T: int, lam) -> jax.Array:
    """λ^{T-1-t} for t = 0..T-1: the weight of token t in the state of the last token, (T,)."""
    lam = _as_float(lam)
    return lam ** jnp.arange(T - 1, -1, -1).astype(lam.dtype)


def gla_parallel(params, Z: jax.Array, lam=None) -> jax.Array:
    """Parallel form O = (D_λ ⊙ Q Kᵀ) V. Z: (..., T, d+1). Returns O: (..., T, d+1)."""
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    D = decay_mask(Z.shape[-2], lam)
    if parametrisation(params) in ("restricted", "lemma2"):
        # W_V has only its last row, so only the label coordinate of O is nonzero, and by associativity
        # ((D_λ ⊙ QKᵀ) v)_t = q_tᵀ Σ_s (D_λ)_{t,s} v_s k_s: one GEMM with D_λ, no (T, T) score matrix per prompt.
        s_t = jnp.einsum("ts,...sd->...td", D, V[..., -1:] * K)
        return jnp.zeros_like(V).at[..., -1].set(jnp.sum(s_t * Q, axis=-1))
    scores = jnp.einsum("...td,...sd->...ts", Q, K) * D
    return jnp.einsum("...ts,...sd->...td", scores, V)


def gla_recurrent(params, Z: jax.Array, lam=None) -> jax.Array:
    """Recurrent form (eqs 5-6): S_t = λ S_{t-1} + v_t k_tᵀ, o_t = S_t q_t. Z: (..., T, d+1) -> O (..., T, d+1)."""
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    S0 = jnp.zeros(Z.shape[:-2] + (V.shape[-1], K.shape[-1]), jnp.result_type(Z, lam))

    def step(S, qkv):
        q, k, v = qkv
        S = lam * S + v[..., :, None] * k[..., None, :]
        return S, jnp.einsum("...ij,...j->...i", S, q)

    _, O = jax.lax.scan(step, S0, (jnp.moveaxis(Q, -2, 0), jnp.moveaxis(K, -2, 0), jnp.moveaxis(V, -2, 0)))
    return jnp.moveaxis(O, 0, -2)


def decayed_cumsum(b: jax.Array, lam, axis: int) -> jax.Array:
    """c_t = λ c_{t-1} + b_t along ``axis`` (c_1 = b_1), by an associative scan: log depth, no λ^{-k}."""
    lam = _as_float(lam)
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
    s_t = Σ_{i≤t} λ^{t-i} (v_i)_{d+1} k_i is formed (O(T d)). Z: (..., T, d+1) -> O (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    Q, K, V = projections(params, Z)
    if parametrisation(params) in ("restricted", "lemma2"):
        s = decayed_cumsum(V[..., -1:] * K, lam, axis=-2)
        return jnp.zeros_like(V).at[..., -1].set(jnp.sum(s * Q, axis=-1))
    S = decayed_cumsum(V[..., :, None] * K[..., None, :], lam, axis=-3)
    return jnp.einsum("...tij,...tj->...ti", S, Q)


def gla_unrolled(params, Z: jax.Array, lam=None) -> jax.Array:
    """Unrolled form (eq 7) at every position: o_t = W_V (Σ_{i≤t} λ^{t-i} z_i z_iᵀ) W_Kᵀ W_Q z_t.

    Forms the (d+1)×(d+1) state of every prefix explicitly: O(T² d²) per prompt, a reference form.
    Z: (..., T, d+1) -> O (..., T, d+1).
    """
    lam = forget_factor(params, lam)
    WV, WKQ = merged_weights(params)
    S = jnp.einsum("ts,...si,...sj->...tij", decay_mask(Z.shape[-2], lam), Z, Z)
    return jnp.einsum("ij,...tjk,kl,...tl->...ti", WV, S, WKQ, Z)


def gla_readout(params, Z: jax.Array, lam=None) -> jax.Array:
    """ŷ = o_{n+1}(d+1) only: Σ_{i≤n+1} λ^{n+1-i} (W_V z_i)_{d+1} (k_iᵀ q_{n+1}), O(T d) per prompt.

    For ``restricted`` params this is ``predict_restricted`` plus the query's own term
    u_{-1} z_{n+1}(d+1) x_{n+1}ᵀ U_11 x_{n+1}, which vanishes on a prompt (label slot 0) but not inside
    an L-layer model, whose residual stream fills the query's label slot.

    Z: (..., n+1, d+1) -> (...,).
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


_LAYER_FORMS = {"parallel": gla_parallel, "recurrent": gla_recurrent, "scan": gla_scan, "unrolled": gla_unrolled}


def gla_layer(params, Z: jax.Array, lam=None, form: Form = "parallel") -> jax.Array:
    """Outputs o_t of one GLA layer at every position in the given form. Z: (..., T, d+1)."""
    if form not in _LAYER_FORMS:
        raise ValueError(f"form must be one of {sorted(_LAYER_FORMS)} for all positions (got {form!r})")
    return _LAYER_FORMS[form](params, Z, lam)


def predict(params, Z: jax.Array, lam=None, form: Form = "readout") -> jax.Array:
    """One-layer GLA prediction ŷ = o_{n+1}(d+1) (eqs 5-7); ``lam`` = λ, or λ̄ at test time (eq 18).

    Args:
        params: any parametrisation (see module docstring), optionally with ``theta``.
        Z: (..., n+1, d+1) tokens with the query's label slot 0.
        lam: forget factor; None uses sigmoid(params["theta"]).
        form: ``readout`` (fast), ``parallel``, ``recurrent``, ``scan`` or ``unrolled``; all equal.
    Returns:
        (...,) predictions.
    """
    if form == "readout":
        return gla_readout(params, Z, lam)
    return gla_layer(params, Z, lam, form)[..., -1, -1]


def predict_linear_attention(params, Z: jax.Array) -> jax.Array:
    """Linear attention (the λ = 1 model): ŷ = (W_V Zᵀ Z W_Kᵀ W_Q z_{n+1})_{d+1}, written independently of λ.

    Z: (..., n+1, d+1) -> (...,).
    """
    WV, WKQ = merged_weights(params)
    return jnp.einsum("j,...tj,...tk,kl,...l->...", WV[-1], Z, Z, WKQ, Z[..., -1, :])


def predict_restricted(U11: jax.Array, u_m1, Z: jax.Array, lam) -> jax.Array:
    """Assumption-1 form: ŷ = u_{-1} Gᵀ U_11 x_{n+1}, G = Σ_{i≤n} λ^{n+1-i} y_i x_i (the query drops out).

    Z: (..., n+1, d+1) -> (...,).
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
        form: form of the full layers: ``parallel`` (quickest to compile), ``scan``, ``recurrent`` or ``unrolled``.
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

    ``restricted`` draws U_11 and u_{-1}; ``lemma2`` draws all of U. With ``layers`` every array gets a
    leading layer axis. ``theta`` adds a trainable forget factor λ = sigmoid(θ) with that initial θ.

    Returns:
        params dict.
    """
    shapes = {"qkv": {"WQ": (d + 1, d + 1), "WK": (d + 1, d + 1), "WV": (d + 1, d + 1)},
              "merged": {"WV": (d + 1, d + 1), "WKQ": (d + 1, d + 1)},
              "lemma2": {"U": (d + 1, d + 1)},
              "restricted": {"U11": (d, d), "u_m1": ()}}[kind]
    lead = () if layers is None else (layers,)
    keys = jax.random.split(key, len(shapes))
    params = {name: std * standard_normal(k, lead + shape, dtype) for k, (name, shape) in zip(keys, shapes.items())}
    if theta is not None:
        params["theta"] = jnp.asarray(theta, dtype)
    return params


def init_assumption1(Theta: jax.Array, sigma: float):
    """Restricted params at Assumption 1 (eq 13): U_11(0) = σ ΘΘᵀ, u_{-1}(0) = σ (u_12 = u_21 = 0).

    Θ: (d, d) with ‖ΘΘᵀ‖_F = 1 (not re-checked here; see ``iclab.theory.drift.assumption1_init``).
    """
    Theta = jnp.asarray(Theta)
    return {"U11": sigma * Theta @ Theta.T, "u_m1": jnp.asarray(sigma, Theta.dtype)}


def restricted_from_optimum(U11: jax.Array, u_m1) -> dict:
    """Restricted params from (U_11, u_{-1}), e.g. the Theorem 1 optimum of ``theory.drift.optimal_restricted``."""
    return {"U11": jnp.asarray(U11), "u_m1": jnp.asarray(u_m1)}
