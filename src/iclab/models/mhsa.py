"""Multi-head attention of the mhsa paper (eq 2.1) and its decomposable (spectral) form (Def 3.1).

Full model, params ``{"K", "Q", "V": (H, d_e, D), "O": (H, d_y, d_e)}``, D = d + d_y, tokens as
columns Z = [X; Y] ∈ R^{D×L}, query z_q = [q; 0]:
    ŷ_q = Σ_h O^(h) V^(h) Z a^(h),  s^(h) = Zᵀ K^(h)ᵀ Q^(h) z_q / √d_e,
with a = softmax(s) (the paper), relu(s)/L or s/L (linear attention, the L ≫ d limit (5.1)).
No residual, mask, LayerNorm or positions.

Spectral model (Φ = Ψ = I), params ``{"omega": (H, I), "mu": (H, I)}`` = per-head, per-task
(ω̄_i^(h), μ_i^(h)): W_X^(h) = blockdiag(ω̄_i^(h) I_{d_i}), U_Y^(h) = diag(μ^(h)), U_X = W_Y = 0, so
p^(h) = softmax(Xᵀ W_X^(h) q) and ŷ_i = Σ_h μ_i^(h) Y_i p^(h) (end of §3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SCORES", "coordinate_values", "effective_matrices", "predict", "predict_spectral", "prompt_matrix",
           "read_spectral", "spectral_expected_loss", "spectral_to_full"]

#: Attention score functions: softmax (the paper), relu(s)/L, and s/L (linear attention, the L ≫ d limit (5.1)).
SCORES = ("softmax", "relu", "linear")


def _activate(s, score: str):
    L = s.shape[-1]
    if score == "softmax":
        return jax.nn.softmax(s, axis=-1)
    if score == "relu":
        return jax.nn.relu(s) / L
    if score == "linear":
        return s / L
    raise ValueError(f"score must be one of {SCORES} (got {score!r})")


def prompt_matrix(X, Y, q):
    """Tokens as columns: Z = [X; Y] and the query token z_q = [q; 0] (eq 2.1).

    Args:
        X: (P, d, L) covariates; Y: (P, d_y, L) responses; q: (P, d) queries.
    Returns:
        (Z, z_q): (P, D, L) and (P, D), D = d + d_y.
    """
    Z = jnp.concatenate([X, Y], axis=1)
    zq = jnp.concatenate([q, jnp.zeros(q.shape[:-1] + (Y.shape[1],), q.dtype)], axis=-1)
    return Z, zq


def predict(params, X, Y, q, score: str = "softmax"):
    """Full H-head attention (eq 2.1): ŷ_q = Σ_h O^(h) V^(h) Z a^(h), a^(h) = act(Zᵀ K^(h)ᵀ Q^(h) z_q / √d_e).

    Args:
        params: {"K", "Q", "V": (H, d_e, D), "O": (H, d_y, d_e)}, D = d + d_y.
        X: (P, d, L) covariates; Y: (P, d_y, L) responses; q: (P, d) queries.
        score: one of :data:`SCORES`.
    Returns:
        (P, d_y) predictions ŷ_q.
    """
    Z, zq = prompt_matrix(X, Y, q)
    d_e = params["K"].shape[1]
    # Contracted query first and tokens last: s = Zᵀ(Kᵀ(Q z_q))/√d_e and O(V(Z a)) cost
    # O(P·H·(d_e·D + D·L)) instead of the O(P·H·d_e·D·L) of forming K Z (same function).
    KQz = jnp.einsum("hed,hef,pf->phd", params["K"], params["Q"], zq, optimize=[(1, 2), (0, 1)])
    a = _activate(jnp.einsum("phd,pdl->phl", KQz, Z) / jnp.sqrt(d_e).astype(Z.dtype), score)
    Za = jnp.einsum("pdl,phl->phd", Z, a)
    return jnp.einsum("hye,hed,phd->py", params["O"], params["V"], Za, optimize=[(1, 2), (0, 1)])


def coordinate_values(values, d_i):
    """Per-task values v_i expanded to per-coordinate values: v_j = v_i for j in the block J_i.

    Args:
        values: (..., I) per-task values; d_i: (I,) block sizes.
    Returns:
        (..., d) per-coordinate values, d = Σ d_i.
    """
    return jnp.repeat(jnp.asarray(values), np.asarray(d_i), axis=-1, total_repeat_length=int(sum(d_i)))


def predict_spectral(spec, X, Y, q, d_i, score: str = "softmax"):
    """Decomposable model (Def 3.1, Φ = Ψ = I): ŷ_i = Σ_h μ_i^(h) Y_i a^(h),
    a^(h) = act(Xᵀ blockdiag(ω̄_i^(h) I_{d_i}) q).

    Args:
        spec: {"omega", "mu"} (H, I) read-outs ω̄_i^(h), μ_i^(h).
        X: (P, d, L) covariates; Y: (P, d_y, L) responses (d_y ≥ I; the first I rows are the tasks');
        q: (P, d) queries; d_i: (I,) block sizes; score: one of :data:`SCORES`.
    Returns:
        (P, I) predictions of the I task outputs.
    """
    w = coordinate_values(spec["omega"], d_i)  # (H, d)
    s = jnp.einsum("pdl,hd,pd->phl", X, w, q)
    a = _activate(s, score)
    I = len(d_i)
    return jnp.einsum("hi,pil,phl->pi", spec["mu"], Y[:, :I], a)


def spectral_to_full(spec, d_i, d_y: int, d_e: int):
    """Full weights with the spectral parameters (Def 3.1, balanced, as Thm 3.3's init; the concrete form for
    Φ = Ψ = I is derived here).

    K_X = Q_X = [diag(s); 0] with s = (√d_e ω)^{1/2} per coordinate (so W_X = diag(ω)),
    V = [0, V_Y], V_Y = [diag(√μ); 0] ∈ R^{d_e×d_y}, O = V_Yᵀ (so U_Y = diag(μ)), K_Y = Q_Y = V_X = 0.
    Requires ω, μ ≥ 0 and d_e ≥ max(d, d_y); tasks beyond I (nominal outputs) get μ = 0.

    Args:
        spec: {"omega", "mu"} (H, I); d_i: (I,) block sizes; d_y: output dimension (≥ I); d_e: head width.
    Returns:
        {"K", "Q", "V": (H, d_e, D), "O": (H, d_y, d_e)}, D = d + d_y, with Φ = Ψ = I.
    """
    d = int(sum(d_i))
    omega, mu = jnp.asarray(spec["omega"]), jnp.asarray(spec["mu"])
    H, I = mu.shape
    if d_e < max(d, d_y):
        raise ValueError(f"need d_e >= max(d, d_y) (got d_e={d_e}, d={d}, d_y={d_y})")
    s = jnp.sqrt(jnp.sqrt(d_e) * coordinate_values(omega, d_i))  # (H, d)
    KX = jnp.zeros((H, d_e, d)).at[:, jnp.arange(d), jnp.arange(d)].set(s)
    KQ = jnp.concatenate([KX, jnp.zeros((H, d_e, d_y))], axis=2)
    mu_full = jnp.concatenate([mu, jnp.zeros((H, d_y - I))], axis=1)
    VY = jnp.zeros((H, d_e, d_y)).at[:, jnp.arange(d_y), jnp.arange(d_y)].set(jnp.sqrt(mu_full))
    V = jnp.concatenate([jnp.zeros((H, d_e, d)), VY], axis=2)
    return {"K": KQ, "Q": KQ, "V": V, "O": jnp.swapaxes(VY, 1, 2)}


def effective_matrices(params, d: int):
    """Effective matrices per head (eq 2.3, 2.5): W = KᵀQ/√d_e, U = OV, split at the covariate/response boundary.

    W_X = K_XᵀQ_X/√d_e, W_Y = K_YᵀQ_X/√d_e (only the query's covariate part enters, z_q = [q; 0]),
    U_X = O V_X, U_Y = O V_Y.

    Args:
        params: full weights (see :func:`predict`); d: covariate dimension.
    Returns:
        (W_X (H, d, d), W_Y (H, d_y, d), U_X (H, d_y, d), U_Y (H, d_y, d_y)).
    """
    d_e = params["K"].shape[1]
    W = jnp.einsum("hed,hef->hdf", params["K"], params["Q"]) / jnp.sqrt(d_e)
    U = jnp.einsum("hye,hed->hyd", params["O"], params["V"])
    return W[:, :d, :d], W[:, d:, :d], U[:, :, :d], U[:, :, d:]


def read_spectral(params, d_i, Phi=None, Psi=None):
    """(ω̄, μ) per head and task read off full weights (to compare training with the reduced ODE):
    ω̄_i^(h) = mean_{j∈J_i} (ΦᵀW_X^(h)Φ)_jj, μ_i^(h) = (ΨᵀU_Y^(h)Ψ)_ii for the first I outputs.

    Args:
        params: full weights (see :func:`predict`); d_i: (I,) block sizes;
        Phi: (d, d) covariate basis (None: I); Psi: (d_y, d_y) output basis (None: I).
    Returns:
        {"omega": (H, I), "mu": (H, I)}.
    """
    d = int(sum(d_i))
    WX, _, _, UY = effective_matrices(params, d)
    if Phi is not None:
        WX = jnp.einsum("da,hde,eb->hab", Phi, WX, Phi)
    if Psi is not None:
        UY = jnp.einsum("da,hde,eb->hab", Psi, UY, Psi)
    diag = jnp.diagonal(WX, axis1=1, axis2=2)
    edges = np.concatenate([[0], np.cumsum(d_i)])
    omega = jnp.stack([diag[:, a:b].mean(axis=1) for a, b in zip(edges[:-1], edges[1:])], axis=1)
    return {"omega": omega, "mu": jnp.diagonal(UY, axis1=1, axis2=2)[:, :len(d_i)]}


def spectral_expected_loss(spec, X, q, d_i, lam, *, sigma2: float, score: str = "softmax"):
    """E_{G,ε}‖ŷ_q − y_q‖² of the decomposable model (Φ = Ψ = I), G and ε integrated out (derived here; one
    head: App E.5-E.12).

    With a_i = Σ_h μ_i^(h) act(Xᵀ W_X^(h) q) ∈ R^L and X_(i) the rows J_i of X:
        Σ_i (λ_i/d) ‖X_(i) a_i − q_(i)‖² + σ² ‖a_i‖²,
    averaged over the P prompts (X, q): only X and q remain to sample. No ½: (2.6) has one, but the paper's
    quoted losses (λ_id_i/d, Table 1, E.1) have none.

    Args:
        spec: {"omega", "mu"} (H, I); X: (P, d, L); q: (P, d); d_i: (I,) block sizes; lam: (I,) per-task
        signals λ_i; sigma2: σ²; score: one of :data:`SCORES`.
    Returns:
        scalar loss.
    """
    d = int(sum(d_i))
    w = coordinate_values(spec["omega"], d_i)  # (H, d)
    p = _activate(jnp.einsum("pdl,hd,pd->phl", X, w, q), score)
    a = jnp.einsum("hi,phl->pil", spec["mu"], p)  # (P, I, L)
    Xa = jnp.einsum("pdl,pdl->pd", X, coordinate_values(jnp.swapaxes(a, 1, 2), d_i).swapaxes(1, 2))
    lam_coord = coordinate_values(jnp.asarray(lam, dtype=X.dtype), d_i)  # (d,)
    bias = jnp.sum(lam_coord * (Xa - q) ** 2, axis=-1) / d
    return jnp.mean(bias + sigma2 * jnp.sum(a**2, axis=(1, 2)))
