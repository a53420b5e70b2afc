"""The pure-JAX references of decayed-state attention: a per-token recurrence, the form every fast one is
tested against (values and gradients, ``tests/ops``), and the form the ``xla`` backend runs.

    S_t = d_t S_{t−1} + v_t k_tᵀ  (S_0 = 0),   o_t = S_t q_t,

one state S per prompt, scanned over the T tokens (``lax.scan``): O(T D²) work and no (T, T) matrix.
Conventions follow the two papers: the drift paper's layer projects q_t = W_Q z_t (``Z @ W_Qᵀ``) and decays by
a constant λ; the gating paper's projects q_t = W_qᵀ z_t (``Z @ W_q``) and decays by the scalar gate
d_t = σ(w_gᵀ z_t).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["decayed_attention", "forget_layer", "forget_multilayer_mse", "forget_readout_grid", "gated_layer"]


def decayed_attention(Q: jax.Array, K: jax.Array, V: jax.Array, decay: jax.Array) -> jax.Array:
    """o_t = S_t q_t with S_t = d_t S_{t−1} + v_t k_tᵀ, by a scan over the tokens.

    Args:
        Q, K, V: (..., T, D) queries, keys and values.
        decay: (..., T) the per-token decays d_t (broadcast against Q's leading axes).
    Returns:
        O: (..., T, D).
    """
    batch = Q.shape[:-2]
    decay = jnp.broadcast_to(decay, batch + Q.shape[-2:-1])
    S0 = jnp.zeros(batch + (V.shape[-1], K.shape[-1]), jnp.result_type(Q, K, V, decay))

    def step(S, qkvd):
        q, k, v, d = qkvd
        S = d[..., None, None] * S + v[..., :, None] * k[..., None, :]
        return S, jnp.einsum("...ij,...j->...i", S, q)

    moved = [jnp.moveaxis(a, len(batch), 0) for a in (Q, K, V, decay)]
    _, O = jax.lax.scan(step, S0, tuple(moved))
    return jnp.moveaxis(O, 0, -2)


def forget_layer(Z: jax.Array, WQ: jax.Array, WK: jax.Array, WV: jax.Array, lam) -> jax.Array:
    """One layer with a forget factor: d_t = λ, q_t = W_Q z_t, k_t = W_K z_t, v_t = W_V z_t.

    Args:
        Z: (..., T, D) tokens; WQ, WK, WV: (D, D); lam: λ (a scalar).
    Returns:
        O: Z's shape.
    """
    lam = jnp.asarray(lam)
    return decayed_attention(Z @ WQ.T, Z @ WK.T, Z @ WV.T, jnp.broadcast_to(lam, Z.shape[:-1]).astype(Z.dtype))


def gated_layer(Z: jax.Array, weights) -> jax.Array:
    """One scalar-gated layer: d_t = σ(w_gᵀ z_t), q_t = W_qᵀ z_t, k_t = W_kᵀ z_t, v_t = W_vᵀ z_t.

    Args:
        Z: (..., T, D) tokens; weights: ``{"Wq", "Wk", "Wv"}`` (D, D) and ``"w_g"`` (D,).
    Returns:
        O: Z's shape.
    """
    return decayed_attention(Z @ weights["Wq"], Z @ weights["Wk"], Z @ weights["Wv"],
                             jax.nn.sigmoid(Z @ weights["w_g"]))


def forget_readout_grid(Z: jax.Array, u: jax.Array, c: jax.Array, lam: jax.Array) -> jax.Array:
    """Predictions at the query of a (G, K) grid of one-layer models: ŷ_gkb = Σ_t λ_gk^{T−1−t} (u_gk·z_gbt)(c_gkb·z_gbt).

    Args:
        Z: (G, B, T, D) tokens of the B prompts of each row g; u: (G, K, D) value read-out rows;
        c: (G, K, B, D) query vectors per prompt; lam: (G, K) forget factors.
    Returns:
        (G, K, B) predictions.
    """
    T = Z.shape[-2]
    powers = lam[..., None] ** jnp.arange(T - 1, -1, -1, dtype=Z.dtype)  # (G, K, T)
    values = jnp.einsum("gbtd,gkd->gkbt", Z, u)
    scores = jnp.einsum("gbtd,gkbd->gkbt", Z, c)
    return jnp.einsum("gkt,gkbt->gkb", powers, values * scores)


def forget_multilayer_mse(Z: jax.Array, y: jax.Array, WQ: jax.Array, WK: jax.Array, WV: jax.Array, lam) -> jax.Array:
    """Mean squared error of an L-layer residual model: Z ← Z + layer_l(Z) for l < L at every position, then
    ŷ = z_T[−1] + (o_T)[−1] of the last layer at the query.

    Args:
        Z: (B, T, D) tokens, the query last; y: (B,) targets; WQ, WK, WV: (L, D, D); lam: λ shared by the layers.
    Returns:
        The scalar loss mean((ŷ − y)²).
    """
    for layer in range(WQ.shape[0] - 1):
        Z = Z + forget_layer(Z, WQ[layer], WK[layer], WV[layer], lam)
    q = Z[..., -1, :] @ WQ[-1].T  # (B, D)
    c = jnp.einsum("bd,de->be", q, WK[-1])  # k_t·q_T = z_tᵀ W_Kᵀ q_T
    yhat = Z[..., -1, -1] + forget_readout_grid(Z[None], WV[-1][-1][None, None], c[None, None], jnp.asarray(lam)
                                                .reshape(1, 1))[0, 0]
    return jnp.mean((yhat - y) ** 2)
