"""Linear attention models of the linattn paper (Sec 2.3, 3.1) as pure functions.

Params are dicts of arrays; every ``predict_*`` maps (params, prompts) to ŷ_q of shape (P,).
The paper convention is used throughout: the attention carries the 1/N factor.

- ATTN_M, reduced form (eq M): ŷ_q = Σ_i v_i βᵀ U_i x_q; params ``{"v": (H,), "U": (H, D, D)}``.
- ATTN_M, full-matrix form: ATTN(X) = X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X, ŷ_q its bottom-right
  entry; params ``{"WV": (H, D+1, D+1), "WKQ": (H, D+1, D+1)}``.
- 2-layer linear MLP on the cubic feature z = vec(β x_qᵀ) (eqs 6-7): ŷ_q = w₂ᵀ W₁ z;
  params ``{"w2": (H,), "W1": (H, D²)}``. vec stacks columns: z[jD + i] = β_i x_{q,j}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iclab.tasks.linreg import Prompts, context_moment, prompt_matrix


def cubic_feature(prompts: Prompts) -> jax.Array:
    """z = vec(β x_qᵀ) = x_q ⊗ β (eq 42), column-stacking vec. Returns (P, D²)."""
    beta = context_moment(prompts)
    return jnp.einsum("pj,pi->pji", prompts.x_q, beta).reshape(beta.shape[0], -1)


def predict_attn_m(params, prompts: Prompts) -> jax.Array:
    """ATTN_M reduced form (eq M): ŷ_q = Σ_i v_i βᵀ U_i x_q."""
    beta = context_moment(prompts)
    return jnp.einsum("h,pi,hij,pj->p", params["v"], beta, params["U"], prompts.x_q)


def predict_attn_m_full(params, prompts: Prompts) -> jax.Array:
    """ATTN_M full-matrix form: bottom-right entry of X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X.

    Every block of W^V_i and W^{KQ}_i enters; it equals eq M when the blocks v⃗_i (last row of
    W^V_i but its corner) and u_i (last row of W^{KQ}_i's first D columns) are zero.
    """
    X = prompt_matrix(prompts)
    N = prompts.x.shape[1]
    gram = jnp.einsum("pan,pbn->pab", X, X) / N
    # Only the query column's last row is read: row D of W^V_i X Xᵀ/N times W^{KQ}_i x̃_q.
    value_row = jnp.einsum("ha,pab->phb", params["WV"][:, -1, :], gram)
    key_query = jnp.einsum("hbc,pc->phb", params["WKQ"], X[:, :, -1])
    return jnp.einsum("phb,phb->p", value_row, key_query)


def predict_mlp(params, prompts: Prompts) -> jax.Array:
    """2-layer linear MLP on the cubic feature: ŷ_q = w₂ᵀ W₁ z (eqs 6-7)."""
    return cubic_feature(prompts) @ (params["W1"].T @ params["w2"])


def effective_matrix_attn_m(params) -> jax.Array:
    """A = Σ_i v_i U_i, so that ATTN_M predicts ŷ_q = βᵀ A x_q. Returns (D, D)."""
    return jnp.einsum("h,hij->ij", params["v"], params["U"])


def effective_matrix_mlp(params) -> jax.Array:
    """A with vec(A) = W₁ᵀ w₂ (column-stacking), so that the MLP predicts ŷ_q = βᵀ A x_q."""
    flat = params["W1"].T @ params["w2"]
    D = int(round(flat.shape[0] ** 0.5))
    return flat.reshape(D, D).T


def init_attn_m(key: jax.Array, D: int, H: int, w_init: float):
    """Eq 34: v_i ~ N(0, w_init²/H), U_i^{dd'} ~ N(0, w_init²/(H D²)); layer norms O(w_init)."""
    kv, ku = jax.random.split(key)
    v = jax.random.normal(kv, (H,), dtype=jnp.float64) * w_init / jnp.sqrt(H)
    U = jax.random.normal(ku, (H, D, D), dtype=jnp.float64) * w_init / jnp.sqrt(H * D * D)
    return {"v": v, "U": U}


def mlp_from_attn_m(params):
    """The MLP with the same function as ATTN_M: w₂ = (v_i), row i of W₁ = vec(U_i)ᵀ (eq 7)."""
    U = params["U"]
    return {"w2": params["v"], "W1": jnp.swapaxes(U, 1, 2).reshape(U.shape[0], -1)}


def attn_m_full_from_reduced(params, key: jax.Array | None = None, scale: float = 1.0):
    """Full-matrix ATTN_M weights realising eq M: v⃗_i = u_i = 0; the * blocks random (or 0).

    Args:
        params: reduced ATTN_M params.
        key: PRNG key for the blocks that never reach ŷ_q (None: zeros).
        scale: standard deviation of those blocks.
    """
    v, U = params["v"], params["U"]
    H, D, _ = U.shape
    if key is None:
        WV = jnp.zeros((H, D + 1, D + 1), dtype=U.dtype)
        WKQ = jnp.zeros((H, D + 1, D + 1), dtype=U.dtype)
    else:
        k1, k2 = jax.random.split(key)
        WV = scale * jax.random.normal(k1, (H, D + 1, D + 1), dtype=U.dtype)
        WKQ = scale * jax.random.normal(k2, (H, D + 1, D + 1), dtype=U.dtype)
    WV = WV.at[:, -1, :D].set(0.0).at[:, -1, D].set(v)
    WKQ = WKQ.at[:, :D, :D].set(U).at[:, D, :D].set(0.0)
    return {"WV": WV, "WKQ": WKQ}
