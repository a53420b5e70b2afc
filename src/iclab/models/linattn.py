"""Linear attention models of the linattn paper (Sec 2.3, 3.1) as pure functions.

Params are dicts of arrays; every ``predict_*`` maps (params, prompts) to ŷ_q of shape (P,).
The paper convention is used throughout: the attention carries the 1/N factor.

- ATTN_M, reduced form (eq M): ŷ_q = Σ_i v_i βᵀ U_i x_q; params ``{"v": (H,), "U": (H, D, D)}``.
- ATTN_M, full-matrix form: ATTN(X) = X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X, ŷ_q its bottom-right
  entry; params ``{"WV": (H, D+1, D+1), "WKQ": (H, D+1, D+1)}``.
- 2-layer linear MLP on the cubic feature z = vec(β x_qᵀ) (eqs 6-7): ŷ_q = w₂ᵀ W₁ z;
  params ``{"w2": (H,), "W1": (H, D²)}``. vec stacks columns: z[jD + i] = β_i x_{q,j}.
- ATTN_S (eq S), separate key and query of rank R, reduced and full-matrix forms; softmax ATTN_M and
  ATTN_S (Sec 2.2) reduced to the blocks that reach ŷ_q.

Each family is registered (bottom of the module) for :mod:`iclab.engines.linreg`: its init, prediction,
effective matrix A (ŷ_q = βᵀA x_q) and tensor T in a fixed feature (ŷ_q = ⟨T, φ⟩) where it has them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from iclab.tasks.linreg import Prompts, context_moment, prompt_matrix

__all__ = [
    "attn_m_full_from_reduced", "attn_s_full_from_reduced", "cubic_feature", "cubic_feature_from_moments",
    "effective_matrix_attn_m", "effective_matrix_attn_s", "effective_matrix_mlp", "full_feature", "init_attn_m",
    "init_attn_s", "mlp_from_attn_m", "next_token_features", "predict_attn_m", "predict_attn_m_full", "predict_attn_s",
    "predict_attn_s_full", "predict_mlp", "predict_softmax_attn_m", "predict_softmax_attn_s", "softmax_readout",
    "tensor_attn_m", "tensor_attn_m_full", "tensor_attn_s", "tensor_attn_s_full", "tensor_mlp",
]


def cubic_feature(prompts: Prompts) -> jax.Array:
    """z = vec(β x_qᵀ) = x_q ⊗ β (eq 42), column-stacking vec: z[jD + i] = β_i x_{q,j}.

    Args:
        prompts: P prompts (x (P, N, D), y (P, N), x_q (P, D)).
    Returns:
        (P, D²) features.
    """
    return cubic_feature_from_moments(context_moment(prompts), prompts.x_q)


def cubic_feature_from_moments(beta: jax.Array, x_q: jax.Array) -> jax.Array:
    """z = x_q ⊗ β (eq 42) from the statistics themselves: z[p, jD + i] = β_i x_{q,j}.

    Args:
        beta: (P, D) β = (1/N) Σ_n y_n x_n (eq 4); x_q: (P, D) queries.
    Returns:
        (P, D²) features.
    """
    return jnp.einsum("pj,pi->pji", x_q, beta).reshape(beta.shape[0], -1)


def predict_attn_m(params, prompts: Prompts) -> jax.Array:
    """ATTN_M reduced form (eq M): ŷ_q = Σ_i v_i βᵀ U_i x_q.

    Args:
        params: v (H,), U (H, D, D).
        prompts: P prompts.
    Returns:
        (P,) predictions ŷ_q.
    """
    beta = context_moment(prompts)
    return jnp.einsum("h,pi,hij,pj->p", params["v"], beta, params["U"], prompts.x_q)


def predict_attn_m_full(params, prompts: Prompts) -> jax.Array:
    """ATTN_M full-matrix form: bottom-right entry of X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X.

    Every block of W^V_i and W^{KQ}_i enters; it equals eq M when the blocks v⃗_i (last row of
    W^V_i but its corner) and u_i (last row of W^{KQ}_i's first D columns) are zero.

    Args:
        params: WV (H, D+1, D+1), WKQ (H, D+1, D+1).
        prompts: P prompts.
    Returns:
        (P,) predictions ŷ_q.
    """
    X = prompt_matrix(prompts)
    N = prompts.x.shape[1]
    gram = jnp.einsum("pan,pbn->pab", X, X) / N
    # Only the query column's last row is read: row D of W^V_i X Xᵀ/N times W^{KQ}_i x̃_q.
    value_row = jnp.einsum("ha,pab->phb", params["WV"][:, -1, :], gram)
    key_query = jnp.einsum("hbc,pc->phb", params["WKQ"], X[:, :, -1])
    return jnp.einsum("phb,phb->p", value_row, key_query)


def predict_mlp(params, prompts: Prompts) -> jax.Array:
    """2-layer linear MLP on the cubic feature: ŷ_q = w₂ᵀ W₁ z (eqs 6-7).

    Args:
        params: w2 (H,), W1 (H, D²).
        prompts: P prompts.
    Returns:
        (P,) predictions ŷ_q.
    """
    return cubic_feature(prompts) @ (params["W1"].T @ params["w2"])


def effective_matrix_attn_m(params) -> jax.Array:
    """A = Σ_i v_i U_i, so that ATTN_M predicts ŷ_q = βᵀ A x_q (eq M).

    Args:
        params: v (H,), U (H, D, D).
    Returns:
        (D, D) effective matrix A.
    """
    return jnp.einsum("h,hij->ij", params["v"], params["U"])


def effective_matrix_mlp(params) -> jax.Array:
    """A with vec(A) = W₁ᵀ w₂ (column-stacking), so that the MLP predicts ŷ_q = βᵀ A x_q (eq 7).

    Args:
        params: w2 (H,), W1 (H, D²).
    Returns:
        (D, D) effective matrix A.
    """
    flat = params["W1"].T @ params["w2"]
    D = int(round(flat.shape[0] ** 0.5))
    return flat.reshape(D, D).T


def init_attn_m(key: jax.Array, D: int, H: int, w_init: float):
    """Eq 34: v_i ~ N(0, w_init²/H), U_i^{dd'} ~ N(0, w_init²/(H D²)); layer norms O(w_init) (eq 35).

    Args:
        key: PRNG key; D: input dimension; H: heads; w_init: init scale.
    Returns:
        {"v": (H,), "U": (H, D, D)}, float64.
    """
    kv, ku = jax.random.split(key)
    v = jax.random.normal(kv, (H,), dtype=jnp.float64) * w_init / jnp.sqrt(H)
    U = jax.random.normal(ku, (H, D, D), dtype=jnp.float64) * w_init / jnp.sqrt(H * D * D)
    return {"v": v, "U": U}


def mlp_from_attn_m(params):
    """The MLP with the same function as ATTN_M: w₂ = (v_i), row i of W₁ = vec(U_i)ᵀ (eq 7).

    Args:
        params: reduced ATTN_M params v (H,), U (H, D, D).
    Returns:
        {"w2": (H,), "W1": (H, D²)}.
    """
    U = params["U"]
    return {"w2": params["v"], "W1": jnp.swapaxes(U, 1, 2).reshape(U.shape[0], -1)}


def attn_m_full_from_reduced(params, key: jax.Array | None = None, scale: float = 1.0):
    """Full-matrix ATTN_M weights realising eq M: v⃗_i = u_i = 0; the * blocks random (or 0).

    Args:
        params: reduced ATTN_M params.
        key: PRNG key for the blocks that never reach ŷ_q (None: zeros).
        scale: standard deviation of those blocks.
    Returns:
        {"WV": (H, D+1, D+1), "WKQ": (H, D+1, D+1)} with the same prediction as ``params``.
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


# ----------------------------------------------------------------------------------------------
# ATTN_S: separate key and query, H heads of rank R (Sec 2.4).


def predict_attn_s(params, prompts: Prompts) -> jax.Array:
    """ATTN_S reduced form (eq S): ŷ_q = Σ_i v_i Σ_r (βᵀk_{i,r})(q_{i,r}ᵀx_q).

    Args:
        params: v (H,), k (H, R, D), q (H, R, D).
        prompts: P prompts.
    Returns:
        (P,) predictions ŷ_q.
    """
    beta = context_moment(prompts)
    kb = jnp.einsum("hrd,pd->phr", params["k"], beta)
    qx = jnp.einsum("hrd,pd->phr", params["q"], prompts.x_q)
    return jnp.einsum("h,phr,phr->p", params["v"], kb, qx)


def effective_matrix_attn_s(params) -> jax.Array:
    """A = Σ_i v_i Σ_r k_{i,r} q_{i,r}ᵀ, so that ATTN_S predicts ŷ_q = βᵀ A x_q (eq S).

    Args:
        params: v (H,), k (H, R, D), q (H, R, D).
    Returns:
        (D, D) effective matrix A.
    """
    return jnp.einsum("h,hri,hrj->ij", params["v"], params["k"], params["q"])


def predict_attn_s_full(params, prompts: Prompts) -> jax.Array:
    """ATTN_S full-matrix form: bottom-right entry of X + Σ_i (1/N) W^V_i X Xᵀ W^Kᵀ_i W^Q_i X.

    Equals eq S when the last row of W^V_i is [0, v_i] and the last column of W^K_i (the scalar k) is 0.

    Args:
        params: WV (H, D+1, D+1), WK (H, R, D+1), WQ (H, R, D+1).
        prompts: P prompts.
    Returns:
        (P,) predictions ŷ_q.
    """
    X = prompt_matrix(prompts)
    N = prompts.x.shape[1]
    gram = jnp.einsum("pan,pbn->pab", X, X) / N
    value_row = jnp.einsum("ha,pab->phb", params["WV"][:, -1, :], gram)
    keys = jnp.einsum("phb,hrb->phr", value_row, params["WK"])
    queries = jnp.einsum("hrc,pc->phr", params["WQ"], X[:, :, -1])
    return jnp.einsum("phr,phr->p", keys, queries)


def init_attn_s(key: jax.Array, D: int, H: int, R: int, w_init: float):
    """Eq 36: v_i ~ N(0, w_init²/H); k_{i,r}, q_{i,r} entries ~ N(0, w_init²/(H R D)); layer norms O(w_init).

    Args:
        key: PRNG key; D: input dimension; H: heads; R: rank of each head; w_init: init scale.
    Returns:
        {"v": (H,), "k": (H, R, D), "q": (H, R, D)}, float64.
    """
    kv, kk, kq = jax.random.split(key, 3)
    sd = w_init / jnp.sqrt(H * R * D)
    return {
        "v": jax.random.normal(kv, (H,), dtype=jnp.float64) * w_init / jnp.sqrt(H),
        "k": jax.random.normal(kk, (H, R, D), dtype=jnp.float64) * sd,
        "q": jax.random.normal(kq, (H, R, D), dtype=jnp.float64) * sd,
    }


def attn_s_full_from_reduced(params, key: jax.Array | None = None, scale: float = 1.0):
    """Full-matrix ATTN_S weights realising eq S: v⃗_i = 0 and scalar k_{i,r} = 0; the blocks
    that never reach ŷ_q (rows of W^V_i but the last, the last column of W^Q_i) random or 0.

    Args:
        params: reduced ATTN_S params v (H,), k, q (H, R, D).
        key: PRNG key for the blocks that never reach ŷ_q (None: zeros).
        scale: standard deviation of those blocks.
    Returns:
        {"WV": (H, D+1, D+1), "WK": (H, R, D+1), "WQ": (H, R, D+1)} with the same prediction.
    """
    v, k, q = params["v"], params["k"], params["q"]
    H, R, D = k.shape
    if key is None:
        WV = jnp.zeros((H, D + 1, D + 1), dtype=k.dtype)
        q_label = jnp.zeros((H, R, 1), dtype=k.dtype)
    else:
        k1, k2 = jax.random.split(key)
        WV = scale * jax.random.normal(k1, (H, D + 1, D + 1), dtype=k.dtype)
        q_label = scale * jax.random.normal(k2, (H, R, 1), dtype=k.dtype)
    WV = WV.at[:, -1, :D].set(0.0).at[:, -1, D].set(v)
    WK = jnp.concatenate([k, jnp.zeros((H, R, 1), dtype=k.dtype)], axis=-1)
    WQ = jnp.concatenate([q, q_label], axis=-1)
    return {"WV": WV, "WK": WK, "WQ": WQ}


# ----------------------------------------------------------------------------------------------
# Softmax attention (Sec 2.2), reduced to the blocks that reach ŷ_q.


def softmax_readout(scores: jax.Array, prompts: Prompts, rho: float) -> jax.Array:
    """Σ_m y_m softmax_m(scores/ρ) over the N+1 keys (context tokens and the query, whose label
    slot is 0), per head.

    Args:
        scores: (P, H, N+1) attention scores of the query; prompts: the P prompts; rho: temperature ρ.
    Returns:
        (P, H) read-outs.
    """
    weights = jax.nn.softmax(scores / rho, axis=-1)
    y = jnp.concatenate([prompts.y, jnp.zeros_like(prompts.y_q)[:, None]], axis=1)
    return jnp.einsum("phn,pn->ph", weights, y)


def _keys_inputs(prompts: Prompts) -> jax.Array:
    return jnp.concatenate([prompts.x, prompts.x_q[:, None, :]], axis=1)  # (P, N+1, D)


def predict_softmax_attn_m(params, prompts: Prompts, rho: float = 1.0) -> jax.Array:
    """Softmax ATTN_M with v⃗ = u = 0 (Sec 2.2): ŷ_q = Σ_i v_i Σ_m y_m softmax_m(x_mᵀ U_i x_q / ρ).

    Args:
        params: v (H,), U (H, D, D).
        prompts: P prompts.
        rho: softmax temperature ρ.
    Returns:
        (P,) predictions ŷ_q.
    """
    scores = jnp.einsum("pnd,hde,pe->phn", _keys_inputs(prompts), params["U"], prompts.x_q)
    return softmax_readout(scores, prompts, rho) @ params["v"]


def predict_softmax_attn_s(params, prompts: Prompts, rho: float = 1.0) -> jax.Array:
    """Softmax ATTN_S with v⃗ = 0, scalar k = 0 (Sec 2.2): scores Σ_r (k_{i,r}ᵀx_m)(q_{i,r}ᵀx_q) / ρ,
    ŷ_q = Σ_i v_i Σ_m y_m softmax_m(scores).

    Args:
        params: v (H,), k (H, R, D), q (H, R, D).
        prompts: P prompts.
        rho: softmax temperature ρ.
    Returns:
        (P,) predictions ŷ_q.
    """
    kx = jnp.einsum("hrd,pnd->phrn", params["k"], _keys_inputs(prompts))
    qx = jnp.einsum("hrd,pd->phr", params["q"], prompts.x_q)
    scores = jnp.einsum("phrn,phr->phn", kx, qx)
    return softmax_readout(scores, prompts, rho) @ params["v"]


# ----------------------------------------------------------------------------------------------
# Linear-in-feature view: ŷ_q = ⟨T(θ), φ(X)⟩ with a fixed feature φ (the moments engine's input).


def full_feature(prompts: Prompts) -> jax.Array:
    """φ = vec(XXᵀ/N) ⊗ x_q, the feature of both full-matrix forms: φ[a, b, c] = (XXᵀ/N)_ab x_{q,c}.

    Args:
        prompts: P prompts.
    Returns:
        (P, (D+1)² D) features.
    """
    X = prompt_matrix(prompts)
    N = prompts.x.shape[1]
    gram = jnp.einsum("pan,pbn->pab", X, X) / N
    return jnp.einsum("pab,pc->pabc", gram, prompts.x_q).reshape(X.shape[0], -1)


def tensor_attn_m(params) -> jax.Array:
    """T with ŷ_q = ⟨T, z⟩ for reduced ATTN_M: vec(Σ_i v_i U_i), column-stacking.

    Args:
        params: v (H,), U (H, D, D).
    Returns:
        (D²,) tensor T.
    """
    return effective_matrix_attn_m(params).T.reshape(-1)


def tensor_attn_s(params) -> jax.Array:
    """T with ŷ_q = ⟨T, z⟩ for reduced ATTN_S: vec(Σ_i v_i Σ_r k_{i,r} q_{i,r}ᵀ), column-stacking.

    Args:
        params: v (H,), k (H, R, D), q (H, R, D).
    Returns:
        (D²,) tensor T.
    """
    return effective_matrix_attn_s(params).T.reshape(-1)


def tensor_mlp(params) -> jax.Array:
    """T with ŷ_q = ⟨T, z⟩ for the MLP: W₁ᵀ w₂ (eq 7).

    Args:
        params: w2 (H,), W1 (H, D²).
    Returns:
        (D²,) tensor T.
    """
    return params["W1"].T @ params["w2"]


def tensor_attn_m_full(params) -> jax.Array:
    """T with ŷ_q = ⟨T, full_feature⟩ for full ATTN_M: T[a,b,c] = Σ_i W^V_i[D,a] W^{KQ}_i[b,c], c < D.

    Args:
        params: WV (H, D+1, D+1), WKQ (H, D+1, D+1).
    Returns:
        ((D+1)² D,) tensor T.
    """
    D = params["WKQ"].shape[-1] - 1
    return jnp.einsum("ha,hbc->abc", params["WV"][:, -1, :], params["WKQ"][:, :, :D]).reshape(-1)


def tensor_attn_s_full(params) -> jax.Array:
    """T with ŷ_q = ⟨T, full_feature⟩ for full ATTN_S: T[a,b,c] = Σ_i W^V_i[D,a] Σ_r W^K_i[r,b] W^Q_i[r,c], c < D.

    Args:
        params: WV (H, D+1, D+1), WK (H, R, D+1), WQ (H, R, D+1).
    Returns:
        ((D+1)² D,) tensor T.
    """
    D = params["WQ"].shape[-1] - 1
    return jnp.einsum("ha,hrb,hrc->abc", params["WV"][:, -1, :], params["WK"], params["WQ"][:, :, :D]).reshape(-1)


# ----------------------------------------------------------------------------------------------
# Next-token loss (eq 23): every prefix of a prompt acts as a query.


def next_token_features(prompts: Prompts, normalization: str = "context") -> tuple[jax.Array, jax.Array]:
    """Cubic features and targets of every (prompt, position) row of the next-token loss (eq 23).

    The N+1 tokens of a prompt (context pairs and the query, whose label is the target y_q) are
    read as one sequence; position n = 2..N+1 is a query with the first n−1 pairs as context:
    z_n = vec(β_n x_nᵀ) = x_n ⊗ β_n (column-stacking, as :func:`cubic_feature`), with
    β_n = (1/(n−1)) Σ_{j<n} y_j x_j (``normalization="context"``, the paper's 1/N) or
    (1/n) Σ_{j<n} y_j x_j (``"tokens"``: the reference code's ``--vary_len``, which divides by the
    token count including the query). The mean squared loss over all P·N rows is the empirical
    next-token loss (1/N_max) Σ_n (y_n − ŷ_n)² averaged over prompts, with N_max = N.

    Args:
        prompts: P prompts of N context pairs (N = N_max).
        normalization: "context" (n−1) or "tokens" (n).
    Returns:
        (z (P, N, D²), y (P, N)): row n−2 belongs to position n.
    """
    if normalization not in ("context", "tokens"):
        raise ValueError(f"normalization must be 'context' or 'tokens' (got {normalization!r})")
    xs = jnp.concatenate([prompts.x, prompts.x_q[:, None, :]], axis=1)  # (P, N+1, D)
    ys = jnp.concatenate([prompts.y, prompts.y_q[:, None]], axis=1)  # (P, N+1)
    n_ctx = jnp.arange(1, xs.shape[1], dtype=xs.dtype)  # context pairs of positions 2..N+1
    sums = jnp.cumsum(ys[:, :-1, None] * xs[:, :-1, :], axis=1)  # Σ_{j<n} y_j x_j, (P, N, D)
    beta = sums / (n_ctx if normalization == "context" else n_ctx + 1.0)[None, :, None]
    x_n = xs[:, 1:, :]
    z = jnp.einsum("pnj,pni->pnji", x_n, beta).reshape(x_n.shape[0], x_n.shape[1], -1)
    return z, ys[:, 1:]


# ----------------------------------------------------------------------------------------------
# The families of this module, registered for the linreg engines (:mod:`iclab.engines.linreg`).


def _init_attn_m(key, *, D: int, H: int, w_init: float, R: int = 1):
    return init_attn_m(key, D, H, w_init)


def _init_attn_s(key, *, D: int, H: int, w_init: float, R: int = 1):
    return init_attn_s(key, D, H, R, w_init)


def _init_mlp(key, *, D: int, H: int, w_init: float, R: int = 1):
    return mlp_from_attn_m(init_attn_m(key, D, H, w_init))  # the same initial function as ATTN_M (eq 7)


def _full_init(reduced_init, build):
    def init(key, *, D: int, H: int, w_init: float, R: int = 1, full_scale: float = 0.0):
        k = jax.random.fold_in(key, 99) if full_scale > 0 else None
        return build(reduced_init(key, D=D, H=H, R=R, w_init=w_init), k, full_scale)

    return init


def _register():
    from iclab.models._family import ModelFamily, register_model

    for family in (
        ModelFamily("attn_m", "linreg", _init_attn_m, predict_attn_m, effective_matrix_attn_m, tensor_attn_m,
                    cubic_feature, full_form="attn_m_full",
                    description="ATTN_M, merged key-query, reduced form (eq M): ŷ_q = Σ_i v_i βᵀ U_i x_q"),
        ModelFamily("attn_s", "linreg", _init_attn_s, predict_attn_s, effective_matrix_attn_s, tensor_attn_s,
                    cubic_feature, full_form="attn_s_full",
                    description="ATTN_S, separate key and query of rank R, reduced form (eq S)"),
        ModelFamily("mlp", "linreg", _init_mlp, predict_mlp, effective_matrix_mlp, tensor_mlp, cubic_feature,
                    description="2-layer linear MLP on the cubic feature z = vec(β x_qᵀ) (eqs 6-7)"),
        ModelFamily("attn_m_full", "linreg", _full_init(_init_attn_m, attn_m_full_from_reduced), predict_attn_m_full,
                    tensor=tensor_attn_m_full, feature=full_feature,
                    description="ATTN_M, full-matrix form: X + Σ_i (1/N) W^V_i X Xᵀ W^KQ_i X"),
        ModelFamily("attn_s_full", "linreg", _full_init(_init_attn_s, attn_s_full_from_reduced), predict_attn_s_full,
                    tensor=tensor_attn_s_full, feature=full_feature,
                    description="ATTN_S, full-matrix form: X + Σ_i (1/N) W^V_i X Xᵀ W^Kᵀ_i W^Q_i X"),
        ModelFamily("softmax_attn_m", "linreg", _init_attn_m, predict_softmax_attn_m, options=("rho",),
                    description="softmax ATTN_M (Sec 2.2), scores x_mᵀ U_i x_q / ρ"),
        ModelFamily("softmax_attn_s", "linreg", _init_attn_s, predict_softmax_attn_s, options=("rho",),
                    description="softmax ATTN_S (Sec 2.2), scores Σ_r (k_{i,r}ᵀx_m)(q_{i,r}ᵀx_q) / ρ"),
    ):
        register_model(family, check=False)  # checked by tests/models/test_family.py, not at every import


_register()
