"""Closed-form theory of "Training Dynamics of In-Context Learning in Linear Attention".

Zhang, Singh, Latham, Saxe (ICML 2025). Equation numbers are the paper's. Conventions, the same in every
function:

- ``Lam`` is the input covariance Λ (D, D); ``eigenvalues`` (D,) its eigenvalues λ_d and ``eigvecs``
  (D, D) the matching eigenvectors e_d as columns; ``lam`` one eigenvalue (λ_{m+1} of the learning
  direction), ``trace`` trΛ.
- The context length enters only through ``inv_N`` = E(1/N), everywhere: 1/N for a fixed number N of
  context pairs (eq 31), H_{N_max}/N_max for lengths uniform on 1..N_max (eq 30, :func:`harmonic_inv_length`).
- Losses are E(y_q − ŷ_q)², without a ½.
- Time is the paper's t/τ with τ = 1 (gradient flow τ dW/dt = −½ ∂L/∂W). The engines' time t = Σ lr
  of GD on L is half of it: paper time = 2t.
- Scalars that follow each other in a signature are keyword-only.

This module imports nothing from iclab's engines: every function here can be checked without
training anything.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from iclab.tasks.linreg import expected_lambda_hat_sq, population_loss  # the prompts' moments (re-exported here)

__all__ = [
    "all_fixed_points", "attn_m_conserved", "attn_m_effective_matrix", "attn_m_fixed_point",
    "attn_m_gradient_flow_rhs", "attn_m_plateau_time", "attn_m_population_loss", "attn_s_conserved",
    "attn_s_effective_matrix", "attn_s_first_plateau_time", "attn_s_gradient_flow_rhs", "attn_s_next_plateau_time",
    "attn_s_population_loss", "converged_direction", "converged_predictor", "cubic_feature_moments", "eq21_rhs",
    "eq21_solve", "eq70_time", "expected_lambda_hat_sq", "fixed_point_loss", "fixed_point_weights",
    "harmonic_inv_length", "large_N_direction", "mlp_population_loss", "pcr_predictor_matrix", "plateau_ansatz_weights",
    "plateau_direction", "plateau_losses", "population_loss", "v_star", "white_loss", "white_time_course",
]


def harmonic_inv_length(N_max: int) -> float:
    """E(1/N) for a context length N uniform on {1, ..., N_max} (Sec A.1, eq 26):

    E(1/N) = (1/N_max) Σ_{n=1}^{N_max} 1/n = H_{N_max}/N_max (0.129911 for N_max = 31).

    Args:
        N_max: the longest context, ≥ 1.
    Returns:
        float E(1/N), the ``inv_N`` of the other functions.
    """
    if N_max < 1:
        raise ValueError(f"N_max must be >= 1 (got {N_max})")
    return float(sum(1.0 / n for n in range(1, N_max + 1)) / N_max)


def fixed_point_loss(eigenvalues, subset, inv_N):
    """Loss at the fixed point M(S_m) of ATTN_S (eq 63; eq 26 with E(1/N) for random length):

    L(M(S_m)) = trΛ − Σ_{d∈S_m} λ_d [1 + E(1/N)(1 + trΛ/λ_d)]⁻¹.

    Args:
        eigenvalues: (D,) eigenvalues λ_d of Λ.
        subset: indices d (0-based) in S_m.
        inv_N: E(1/N).
    Returns:
        float loss L(M(S_m)).
    """
    lam = np.asarray(eigenvalues, dtype=float)
    tr = lam.sum()
    idx = np.asarray(list(subset), dtype=int)
    if idx.size == 0:
        return float(tr)
    sel = lam[idx]
    return float(tr - np.sum(sel / (1.0 + inv_N * (1.0 + tr / sel))))


def plateau_losses(eigenvalues, inv_N):
    """Losses L(M_0), ..., L(M_D) of the saddles visited from small init (eq 19; eq 26).

    M_m learns the top-m eigendirections: L(M_m) = trΛ − Σ_{d≤m} λ_d [1 + E(1/N)(1 + trΛ/λ_d)]⁻¹,
    with eigenvalues sorted in decreasing order. L(M_0) = trΛ and L(M_D) is the loss of the
    global minimum (eq 11), which ATTN_M reaches in one drop.

    Args:
        eigenvalues: (D,) eigenvalues of Λ, any order.
        inv_N: E(1/N) (1/N for a fixed length N).
    Returns:
        (D+1,) numpy array of plateau losses, non-increasing.
    """
    lam = np.sort(np.asarray(eigenvalues, dtype=float))[::-1]
    return np.array([fixed_point_loss(lam, range(m), inv_N) for m in range(lam.size + 1)])


def cubic_feature_moments(Lam, inv_N):
    """Population moments of the cubic feature z = vec(β x_qᵀ) = x_q ⊗ β (eqs 43-44).

    E(y_q z) = vec(Λ²) and E(z zᵀ) = Λ ⊗ E[Λ̂²] (column-stacking vec; x_q independent of β).

    Args:
        Lam: (D, D) covariance Λ; inv_N: E(1/N).
    Returns:
        (E_yz (D²,), E_zz (D², D²)).
    """
    Lam = jnp.asarray(Lam)
    E_yz = (Lam @ Lam).T.reshape(-1)
    E_zz = jnp.kron(Lam, expected_lambda_hat_sq(Lam, inv_N))
    return E_yz, E_zz


def mlp_population_loss(W, Lam, inv_N):
    """Expected loss of a linear predictor ŷ_q = Wᵀ z on the cubic feature (eqs 8, 43-44):

    L = trΛ − 2 Wᵀ E(y_q z) + Wᵀ E(z zᵀ) W, with W = W₁ᵀ w₂ for the 2-layer MLP.

    Computed from the moments of z, independently of the eq-M route through E[Λ̂²] and A.

    Args:
        W: (D²,) weights on z (W = W₁ᵀw₂ for the MLP; vec(A) column-stacked for eq M).
        Lam: (D, D) covariance Λ; inv_N: E(1/N).
    Returns:
        scalar loss E(y_q − Wᵀz)².
    """
    E_yz, E_zz = cubic_feature_moments(Lam, inv_N)
    return jnp.trace(jnp.asarray(Lam)) - 2.0 * W @ E_yz + W @ E_zz @ W


# ---------------------------------------------------------------------------------------------
# Dynamics and fixed-point theory (Secs 3-5, Apps D-F).
#
# Reduced parametrisations (zero blocks of W^V, W^{KQ}, W^K dropped; eqs M and S, Secs 2.3-2.4):
#   ATTN_M: v (H,), U (H, D, D);        A = Σ_i v_i U_i
#   ATTN_S: v (H,), k, q (H, R, D);     A = Σ_i v_i Σ_r k_{i,r} q_{i,r}ᵀ
# and the predictor is ŷ_q = βᵀ A x_q. Gradient flow is τ dW/dt = −½ ∂L/∂W with τ = 1.
# ---------------------------------------------------------------------------------------------


def _eig_a(lam, inv_N, trace):
    """a_d = λ_d² (1 + (1 + trΛ/λ_d) E(1/N)), the eigenvalues of E[Λ̂²] (eq 32)."""
    return lam**2 * (1.0 + inv_N * (1.0 + trace / lam))


def _G(A, Lam, inv_N):
    """G = Λ² − E[Λ̂²] A Λ = −½ ∂L/∂A (eq 57)."""
    Lam = jnp.asarray(Lam)
    return Lam @ Lam - expected_lambda_hat_sq(Lam, inv_N) @ A @ Lam


def attn_s_effective_matrix(v, k, q):
    """Effective matrix of ATTN_S (eq S): A = Σ_i v_i Σ_r k_{i,r} q_{i,r}ᵀ, so ŷ_q = βᵀ A x_q.

    Args:
        v: (H,) value scalars v_i.
        k: (H, R, D) key vectors k_{i,r} (R = 1 for the rank-one model of Sec 4).
        q: (H, R, D) query vectors q_{i,r}.
    Returns:
        (D, D) matrix A.
    """
    return jnp.einsum("i,ird,ire->de", jnp.asarray(v), jnp.asarray(k), jnp.asarray(q))


def attn_s_population_loss(v, k, q, Lam, inv_N):
    """Population loss of reduced ATTN_S: population_loss(attn_s_effective_matrix(v, k, q)).

    Args:
        v: (H,); k, q: (H, R, D); Lam: (D, D); inv_N: E(1/N).
    Returns:
        scalar E(y_q − ŷ_q)², differentiable in (v, k, q).
    """
    return population_loss(attn_s_effective_matrix(v, k, q), Lam, inv_N)


def attn_m_effective_matrix(v, U):
    """Effective matrix of ATTN_M (eq M): A = Σ_i v_i U_i.

    Args:
        v: (H,) value scalars; U: (H, D, D) merged key-query blocks U_i.
    Returns:
        (D, D) matrix A.
    """
    return jnp.einsum("i,ide->de", jnp.asarray(v), jnp.asarray(U))


def attn_m_population_loss(v, U, Lam, inv_N):
    """Population loss of reduced ATTN_M: population_loss(attn_m_effective_matrix(v, U)).

    Args:
        v: (H,); U: (H, D, D); Lam: (D, D); inv_N: E(1/N).
    Returns:
        scalar loss, differentiable in (v, U).
    """
    return population_loss(attn_m_effective_matrix(v, U), Lam, inv_N)


def attn_m_gradient_flow_rhs(v, U, Lam, inv_N):
    """Explicit population GF vector field of ATTN_M (eq 8, written per head; τ = 1).

    τ U̇_i = v_i G,  τ v̇_i = ⟨U_i, G⟩_F,  G = Λ² − E[Λ̂²] A Λ,  A = Σ_i v_i U_i.

    Args:
        v: (H,); U: (H, D, D); Lam: (D, D); inv_N: E(1/N).
    Returns:
        (dv (H,), dU (H, D, D)) = −½ ∂L/∂(v, U).
    """
    G = _G(attn_m_effective_matrix(v, U), Lam, inv_N)
    v = jnp.asarray(v)
    U = jnp.asarray(U)
    return jnp.einsum("ide,de->i", U, G), v[:, None, None] * G[None]


def attn_s_gradient_flow_rhs(v, k, q, Lam, inv_N):
    """Explicit population GF vector field of ATTN_S, rank R (eq 14 for R = 1, eq 83; τ = 1).

    With Σ = Σ_{i,r} v_i k_{i,r} q_{i,r}ᵀ and G = Λ² − E[Λ̂²] Σ Λ:
        τ v̇_i     = Σ_r k_{i,r}ᵀ G q_{i,r}
        τ k̇_{i,r} = v_i G q_{i,r}
        τ q̇_{i,r} = v_i Gᵀ k_{i,r} = v_i (Λ² − Λ Σᵀ E[Λ̂²]) k_{i,r}.
    The last line corrects the erratum of the printed eq 14c (ΛΣE[Λ̂²] → ΛΣᵀE[Λ̂²]; eq 83c
    has it right): Σ is not symmetric off the fixed points, so the transpose matters.

    Args:
        v: (H,); k, q: (H, R, D); Lam: (D, D); inv_N: E(1/N).
    Returns:
        (dv (H,), dk (H, R, D), dq (H, R, D)) = −½ ∂L/∂(v, k, q).
    """
    v, k, q = jnp.asarray(v), jnp.asarray(k), jnp.asarray(q)
    G = _G(attn_s_effective_matrix(v, k, q), Lam, inv_N)
    dv = jnp.einsum("ird,de,ire->i", k, G, q)
    dk = v[:, None, None] * jnp.einsum("de,ire->ird", G, q)
    dq = v[:, None, None] * jnp.einsum("ed,ire->ird", G, k)
    return dv, dk, dq


def fixed_point_weights(eigenvalues, subset, inv_N, *, H=None, eigvecs=None):
    """Min-norm rank-one ATTN_S weights on the fixed-point manifold M(S_m) (eqs 20, 81).

    Head d ↔ eigenvector e_d (heads permuted as in eq 20): for d ∈ S_m,
        v_d = (λ_d/a_d)^{1/3} = λ_d^{-1/3} (1 + (1 + trΛ/λ_d)E(1/N))^{-1/3},  k_d = q_d = v_d e_d,
    all other heads zero. Then Σ_i v_i k_i q_iᵀ = Σ_{d∈S_m} (λ_d/a_d) e_d e_dᵀ (condition C1,
    eq 18) and (C2), (C3) hold, so the weights are a fixed point of the GF (eq 14).

    Args:
        eigenvalues: (D,) eigenvalues λ_d of Λ, in the order of the eigenvectors (any order).
        subset: 0-based indices d in S_m.
        inv_N: E(1/N) (1/N for a fixed length).
        H: number of heads, ≥ D (default D); heads D..H−1 are zero.
        eigvecs: (D, D) orthonormal eigenvectors as columns; default the identity, i.e.
            Λ = diag(eigenvalues).
    Returns:
        (v (H,), k (H, 1, D), q (H, 1, D)) numpy arrays.
    """
    lam = np.asarray(eigenvalues, dtype=float)
    D = lam.size
    H = D if H is None else int(H)
    if H < D:
        raise ValueError(f"H must be >= D = {D} for the eq-81 weights (got {H})")
    E = np.eye(D) if eigvecs is None else np.asarray(eigvecs, dtype=float)
    v = np.zeros(H)
    k = np.zeros((H, 1, D))
    for d in subset:
        v[d] = (lam[d] / _eig_a(lam[d], inv_N, lam.sum())) ** (1.0 / 3.0)
        k[d, 0] = v[d] * E[:, d]
    return v, k, k.copy()


def plateau_ansatz_weights(eigenvalues, m, *, v_next, inv_N, H=None, eigvecs=None):
    """Eq-20 ansatz on the m-th plateau: heads 1..m at their fixed point, head m+1 at v_next.

    k_i = q_i = v_i e_i with v_i = (λ_i/a_i)^{1/3} for i ≤ m, k_{m+1} = q_{m+1} = v_next e_{m+1},
    other heads zero. This manifold is invariant under the GF and carries eq 21 for v_{m+1}.
    Eigenvalues are used in the given order (pass them sorted decreasingly for the visit order).

    Args:
        eigenvalues: (D,); m: number of learned directions, 0 ≤ m < D; v_next: v_{m+1};
        inv_N: E(1/N); H, eigvecs: as in fixed_point_weights.
    Returns:
        (v (H,), k (H, 1, D), q (H, 1, D)).
    """
    lam = np.asarray(eigenvalues, dtype=float)
    if not 0 <= m < lam.size:
        raise ValueError(f"m must be in [0, {lam.size - 1}] (got {m})")
    v, k, q = fixed_point_weights(lam, range(m), inv_N, H=H, eigvecs=eigvecs)
    E = np.eye(lam.size) if eigvecs is None else np.asarray(eigvecs, dtype=float)
    v[m] = v_next
    k[m, 0] = q[m, 0] = v_next * E[:, m]
    return v, k, q


def all_fixed_points(eigenvalues, inv_N):
    """All 2^D fixed-point functions M(S_m) of ATTN_S with their losses (eqs 16-17, 63).

    Args:
        eigenvalues: (D,) eigenvalues λ_d (0-based indices refer to this order).
        inv_N: E(1/N).
    Returns:
        list of (subset tuple, loss) over all subsets, ordered by size then lexicographically.
    """
    from itertools import combinations

    D = len(eigenvalues)
    return [(S, fixed_point_loss(eigenvalues, S, inv_N))
            for m in range(D + 1) for S in combinations(range(D), m)]


def attn_m_fixed_point(Lam, inv_N):
    """Effective matrix at the stable fixed point M_* of ATTN_M (eqs 9, 11, 46):

    A* = E[Λ̂²]⁻¹ Λ = (Λ + (Λ + trΛ·I) E(1/N))⁻¹ (eq 25 for random lengths).

    Args:
        Lam: (D, D) covariance; inv_N: E(1/N).
    Returns:
        (D, D) matrix A* (the global minimiser of population_loss; also ATTN_S at M_D).
    """
    Lam = jnp.asarray(Lam)
    return jnp.linalg.solve(expected_lambda_hat_sq(Lam, inv_N), Lam)


def converged_predictor(beta, x_q, Lam, inv_N):
    """Converged prediction (eq 11; eq 24 for random lengths): ŷ_q = βᵀ (Λ + (Λ + trΛ·I)E(1/N))⁻¹ x_q
    (→ βᵀΛ⁻¹x_q as N → ∞).

    Args:
        beta: (..., D) context statistic β = (1/N) Σ_n y_n x_n (eq 4).
        x_q: (..., D) query.
        Lam: (D, D); inv_N: E(1/N).
    Returns:
        (...,) predictions.
    """
    Lam = jnp.asarray(Lam)
    D = Lam.shape[0]
    M = Lam + inv_N * (Lam + jnp.trace(Lam) * jnp.eye(D, dtype=Lam.dtype))
    return jnp.einsum("...i,ij,...j->...", jnp.asarray(beta), jnp.linalg.inv(M), jnp.asarray(x_q))


def _white_constants(D, inv_N, c):
    """α = c³(1 + (1+D)E(1/N)) = mᵀE(zzᵀ)m and γ = ‖E(y_q z)‖ = c²√D for Λ = cI (eqs 48-50)."""
    return c**3 * (1.0 + (1.0 + D) * inv_N), c**2 * np.sqrt(D)


def white_time_course(t, D, *, inv_N, w_init, c=1.0):
    """σ(t) of ATTN_M for Λ = cI: ŷ = σ(t) βᵀx_q (eq 10 for c = 1; D.5 generalised).

    s = ‖w₂‖² obeys τṡ = 2s(γ − αs) (eq 48), α = c³(1 + (1+D)E(1/N)), γ = c²√D, so
    s(t) = γe^{2γt}/(α(e^{2γt} − 1) + γ/s(0)), with w₂ᵀW₁ = s(t) mᵀ, m = vec(I)/√D, hence A = σ I with
    σ = s/√D. For c = 1 and fixed N this is eq 10:
    σ = e^{2√Dt}/((1 + (1+D)/N)(e^{2√Dt} − 1) + √D/w_init²). σ(∞) = c²/α (= 1/α for c = 1).
    Exact only for a balanced, aligned init (w₂w₂ᵀ = W₁W₁ᵀ, W₁ = w₂mᵀ), i.e. U_i = v_i I/√D.

    Args:
        t: array of times (τ = 1).
        D: dimension.
        inv_N: E(1/N) (1/N for a fixed length N).
        w_init: initial layer norm, s(0) = ‖w₂(0)‖² = w_init².
        c: Λ = cI.
    Returns:
        array σ(t), same shape as t.
    """
    alpha, gamma = _white_constants(D, inv_N, c)
    t = np.asarray(t, dtype=float)
    s0 = w_init**2
    # Written with e^{−2γt} so that large t does not overflow.
    em = np.exp(-2.0 * gamma * t)
    s = gamma / (alpha * (1.0 - em) + gamma / s0 * em)
    return s / np.sqrt(D)


def white_loss(t, D, *, inv_N, w_init, c=1.0):
    """Loss of ATTN_M for Λ = cI along eq 10 (eq 51; general c derived):

    L(t) = cD − 2σ(t)c²D + σ(t)²αD, α = c³(1 + (1+D)E(1/N)); for fixed N, L(∞) = cD(1+D)/(N+1+D).

    Args:
        t: array of times (τ = 1); D: dimension; inv_N: E(1/N); w_init: initial layer norm; c: Λ = cI
            (exact under the conditions of :func:`white_time_course`).
    Returns:
        array L(t), same shape as t.
    """
    alpha, _ = _white_constants(D, inv_N, c)
    sig = white_time_course(t, D, inv_N=inv_N, w_init=w_init, c=c)
    return c * D - 2.0 * sig * c**2 * D + sig**2 * alpha * D


def eq21_rhs(v, *, lam, a):
    """Right-hand side of eq 21 (= 69, 75): τ v̇ = λ² v² − λ a v⁵.

    Args:
        v: value of v_{m+1} (scalar or array); lam: λ_{m+1};
        a: a_{m+1} = λ²(1 + (1 + trΛ/λ)E(1/N)), the eigenvalue of E[Λ̂²] (eq 32).
    Returns:
        τ v̇, same shape as v.
    """
    return lam**2 * v**2 - lam * a * v**5


def v_star(lam, *, inv_N, trace):
    """Stable fixed point of eq 21: v* = (λ/a)^{1/3} = λ^{-1/3}(1 + (1 + trΛ/λ)E(1/N))^{-1/3} (eq 20).

    Args:
        lam: λ (scalar or array); inv_N: E(1/N); trace: trΛ.
    Returns:
        v*, same shape as lam.
    """
    lam = np.asarray(lam, dtype=float)
    return (lam / _eig_a(lam, inv_N, trace)) ** (1.0 / 3.0)


def eq21_solve(v0, t, *, lam, inv_N, trace, rtol=1e-12, atol=1e-14):
    """Numerical solution of eq 21, τ v̇ = λ² v² − λ a v⁵, from v(0) = v0, evaluated at times t (τ = 1).

    Args:
        v0: initial v_{m+1}.
        t: (T,) non-decreasing times ≥ 0.
        lam: λ_{m+1}; inv_N: E(1/N); trace: trΛ.
        rtol, atol: solve_ivp tolerances (DOP853).
    Returns:
        (T,) numpy array v(t).
    """
    from scipy.integrate import solve_ivp

    a = float(_eig_a(lam, inv_N, trace))
    t = np.asarray(t, dtype=float)
    sol = solve_ivp(lambda _, y: eq21_rhs(y, lam=lam, a=a), (0.0, float(t.max())), [float(v0)],
                    method="DOP853", t_eval=t, rtol=rtol, atol=atol)
    if not sol.success:
        raise RuntimeError(f"eq 21 integration failed: {sol.message}")
    return sol.y[0]


def eq70_time(v, *, lam, inv_N, trace):
    """Implicit solution of eq 21 (eq 70, integrand corrected from v² to v⁵):

    λ² t/τ = (c/6)[ln((c²v² + cv + 1)/(c²v² − 2cv + 1)) − 2√3 arctan((2cv + 1)/√3)] − 1/v + const,
    c = (a/λ)^{1/3} = 1/v*. Returns the right-hand side divided by λ² (const = 0), so that
    eq70_time(v(t)) − eq70_time(v(0)) = t along any solution with 0 < v(0), v(t) on one side of v*.

    Args:
        v: (...) values of v > 0, v ≠ v*; lam: λ; inv_N: E(1/N); trace: trΛ.
    Returns:
        (...) times (τ = 1), up to a common additive constant.
    """
    v = np.asarray(v, dtype=float)
    c = 1.0 / v_star(lam, inv_N=inv_N, trace=trace)
    cv = c * v
    F = (c / 6.0) * (np.log((cv**2 + cv + 1.0) / (cv**2 - 2.0 * cv + 1.0))
                     - 2.0 * np.sqrt(3.0) * np.arctan((2.0 * cv + 1.0) / np.sqrt(3.0))) - 1.0 / v
    return F / lam**2


def attn_m_plateau_time(Lam, w_init):
    """Plateau duration of ATTN_M from small init (eqs 52-54): t ≈ (τ/‖Λ²‖_F) ln(1/w_init).

    Leading order in ln(1/w_init) only (the early linear system ignores the O(1) sigmoid).

    Args:
        Lam: (D, D) covariance; w_init: initial layer norm.
    Returns:
        float duration (τ = 1).
    """
    return float(np.log(1.0 / w_init) / np.linalg.norm(np.asarray(Lam) @ np.asarray(Lam), "fro"))


def attn_s_first_plateau_time(*, lam1, v1_0):
    """First plateau of ATTN_S (eq 71): t₁ ≈ τ/(λ₁² v₁(0)), the blow-up time of τv̇ = λ₁²v².

    Args:
        lam1: largest eigenvalue λ₁; v1_0: initial v₁ (small, > 0).
    Returns:
        float duration (τ = 1).
    """
    return 1.0 / (lam1**2 * v1_0)


def attn_s_next_plateau_time(*, lam, v_at_tm):
    """Duration of plateau m+1 of ATTN_S (eq 76): t_{m+1} − t_m ≈ τ/(λ_{m+1}² v_{m+1}(t_m)).

    Args:
        lam: λ_{m+1}; v_at_tm: v_{m+1} at the end t_m of the previous drop.
    Returns:
        float duration (τ = 1).
    """
    return 1.0 / (lam**2 * v_at_tm)


def pcr_predictor_matrix(eigenvalues, eigvecs, m, inv_N):
    """In-context PCR predictor at the m-th plateau of ATTN_S (eq 22):

    A_m = Σ_{d≤m} λ_d⁻¹ (1 + (1 + trΛ/λ_d)E(1/N))⁻¹ e_d e_dᵀ (top-m eigenvectors), ŷ = βᵀ A_m x_q;
    population_loss(A_m) = L(M_m) (eq 19).

    Args:
        eigenvalues: (D,) eigenvalues; eigvecs: (D, D) matching eigenvectors as columns;
        m: number of learned directions, 0 ≤ m ≤ D; inv_N: E(1/N).
    Returns:
        (D, D) numpy matrix A_m.
    """
    lam = np.asarray(eigenvalues, dtype=float)
    E = np.asarray(eigvecs, dtype=float)
    if not 0 <= m <= lam.size:
        raise ValueError(f"m must be in [0, {lam.size}] (got {m})")
    order = np.argsort(-lam, kind="stable")[:m]
    coef = lam[order] / _eig_a(lam[order], inv_N, lam.sum())
    return (E[:, order] * coef) @ E[:, order].T


def plateau_direction(Lam):
    """Direction of the ATTN_M rows vec(U_i) on the plateau (D.6.2, Fig 9 top):

    vec(Λ²)/‖vec(Λ²)‖ = E(y_q z)/‖E(y_q z)‖ (eq 43; column-stacking vec).

    Args:
        Lam: (D, D) covariance Λ.
    Returns:
        (D²,) unit vector.
    """
    Lam = np.asarray(Lam, dtype=float)
    w = (Lam @ Lam).T.reshape(-1)
    return w / np.linalg.norm(w)


def converged_direction(Lam, inv_N):
    """Direction of the ATTN_M rows at convergence (D.6.2, Fig 9 middle):

    normalised E(y_q zᵀ) E(zzᵀ)⁻¹ = vec((Λ + (Λ + trΛ·I)E(1/N))⁻¹)/‖·‖ (eqs 9, 11, 43-45).

    Args:
        Lam: (D, D) covariance Λ; inv_N: E(1/N).
    Returns:
        (D²,) unit vector.
    """
    E_yz, E_zz = cubic_feature_moments(Lam, inv_N)
    w = np.linalg.solve(np.asarray(E_zz), np.asarray(E_yz))
    return w / np.linalg.norm(w)


def large_N_direction(Lam):
    """N → ∞ limit of converged_direction (Fig 9 bottom): vec(Λ⁻¹)/‖vec(Λ⁻¹)‖.

    Args:
        Lam: (D, D) covariance Λ.
    Returns:
        (D²,) unit vector.
    """
    w = np.linalg.inv(np.asarray(Lam, dtype=float)).T.reshape(-1)
    return w / np.linalg.norm(w)


def attn_m_conserved(v, U):
    """Conserved matrix of ATTN_M under GF (eq 55): w₂w₂ᵀ − W₁W₁ᵀ, W₁ rows = vec(U_i)ᵀ.

    Args:
        v: (H,) = w₂; U: (H, D, D).
    Returns:
        (H, H) matrix, constant in time under gradient flow on any loss of w₂ᵀW₁.
    """
    v = jnp.asarray(v)
    W1 = jnp.asarray(U).reshape(v.shape[0], -1)
    return jnp.outer(v, v) - W1 @ W1.T


def attn_s_conserved(v, k, q):
    """Conserved quantities of ATTN_S under GF (eq 82 for R = 1; eq 88 for rank R).

    ‖k_{i,r}‖² − ‖q_{i,r}‖² for every (i, r), and Σ_r ‖k_{i,r}‖² − v_i² for every head i.

    Args:
        v: (H,); k, q: (H, R, D).
    Returns:
        (kq (H, R), kv (H,)).
    """
    k, q, v = jnp.asarray(k), jnp.asarray(q), jnp.asarray(v)
    kk = jnp.sum(k**2, axis=-1)
    return kk - jnp.sum(q**2, axis=-1), kk.sum(axis=-1) - v**2
