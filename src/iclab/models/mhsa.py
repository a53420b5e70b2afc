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
    """Z = [X; Y] (P, D, L) and z_q = [q; 0] (P, D)."""
    Z = jnp.concatenate([X, Y], axis=1)
    zq = jnp.concatenate([q, jnp.zeros(q.shape[:-1] + (Y.shape[1],), q.dtype)], axis=-1)
    return Z, zq


def predict(params, X, Y, q, score: str = "softmax"):
    """Full H-head attention (eq 2.1). X: (P, d, L), Y: (P, d_y, L), q: (P, d) → ŷ_q (P, d_y)."""
    Z, zq = prompt_matrix(X, Y, q)
    d_e = params["K"].shape[1]
    # Contracted query first and tokens last: s = Zᵀ(Kᵀ(Q z_q))/√d_e and O(V(Z a)) cost
    # O(P·H·(d_e·D + D·L)) instead of the O(P·H·d_e·D·L) of forming K Z (same function).
    KQz = jnp.einsum("hed,hef,pf->phd", params["K"], params["Q"], zq, optimize=[(1, 2), (0, 1)])
    a = _activate(jnp.einsum("phd,pdl->phl", KQz, Z) / jnp.sqrt(d_e).astype(Z.dtype), score)
    Za = jnp.einsum("pdl,phl->phd", Z, a)
    return jnp.einsum("hye,hed,phd->py", params["O"], params["V"], Za, optimize=[(1, 2), (0, 1)])


def coordinate_values(values, d_i):
    """Expands per-task values (..., I) to per-coordinate values (..., d) over the blocks J_i."""
    return jnp.repeat(jnp.asarray(values), np.asarray(d_i), axis=-1, total_repeat_length=int(sum(d_i)))


def predict_spectral(spec, X, Y, q, d_i, score: str = "softmax"):
    """Decomposable model: ŷ_i = Σ_h μ_i^(h) Y_i a^(h), a^(h) = act(Xᵀ blockdiag(ω̄^(h)) q)."""
    w = coordinate_values(spec["omega"], d_i)  # (H, d)
    s = jnp.einsum("pdl,hd,pd->phl", X, w, q)
    a = _activate(s, score)
    I = len(d_i)
    return jnp.einsum("hi,pil,phl->pi", spec["mu"], Y[:, :I], a)


def spectral_to_full(spec, d_i, d_y: int, d_e: int):
    """Full weights with the spectral parameters (Def 3.1, balanced; spec §3 concrete form).

    K_X = Q_X = [diag(s); 0] with s = (√d_e ω)^{1/2} per coordinate (so W_X = diag(ω)),
    V = [0, V_Y], V_Y = [diag(√μ); 0] ∈ R^{d_e×d_y}, O = V_Yᵀ (so U_Y = diag(μ)), K_Y = Q_Y = V_X = 0.
    Requires ω, μ ≥ 0 and d_e ≥ max(d, d_y); tasks beyond I (nominal outputs) get μ = 0.
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
    """(W_X, W_Y, U_X, U_Y) per head (eq 2.3, 2.5): W = KᵀQ/√d_e, U = OV; W_Y = K_YᵀQ_X/√d_e."""
    d_e = params["K"].shape[1]
    W = jnp.einsum("hed,hef->hdf", params["K"], params["Q"]) / jnp.sqrt(d_e)
    U = jnp.einsum("hye,hed->hyd", params["O"], params["V"])
    return W[:, :d, :d], W[:, d:, :d], U[:, :, :d], U[:, :, d:]


def read_spectral(params, d_i, Phi=None, Psi=None):
    """(ω̄, μ) per head and task read off full weights: block means of diag(ΦᵀW_XΦ) over J_i and
    the first I diagonal entries of ΨᵀU_YΨ (spec C4). Returns {"omega": (H, I), "mu": (H, I)}."""
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


def spectral_expected_loss(spec, X, q, d_i, lam, sigma2: float, score: str = "softmax"):
    """E_{G,ε}‖ŷ_q − y_q‖² of the decomposable model (Φ = Ψ = I), G and ε integrated out (spec §5.5).

    With a_i = Σ_h μ_i^(h) act(Xᵀ W_X^(h) q) ∈ R^L and X_(i) the rows J_i of X:
        Σ_i (λ_i/d) ‖X_(i) a_i − q_(i)‖² + σ² ‖a_i‖²,
    averaged over the P prompts (X, q): only X and q remain to sample. No ½ (spec A1).

    Args:
        spec: {"omega", "mu"} (H, I); X: (P, d, L); q: (P, d); d_i: (I,) block sizes; lam: (I,) λ_i;
        sigma2: σ²; score: attention score function.
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
