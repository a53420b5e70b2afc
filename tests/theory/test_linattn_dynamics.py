"""linattn dynamics and fixed-point theory (Secs 3-5, Apps D-F) against gradient flow.

Gradient flows here are integrated with scipy on −½∇L, where ∇L is jax autodiff of the closed-form
population loss (independent of the explicit vector fields and of the closed-form solutions under
test). Expected numbers come from independent reference computations or from computations written out in this file.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.optimize import brentq

from iclab.theory import linattn as th

LAM4 = np.array([0.4, 0.3, 0.2, 0.1])
N31 = 31


def _rotation(D, seed):
    Q, R = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, D)))
    return Q * np.sign(np.diag(R))


def _cov(lam, seed):
    E = _rotation(len(lam), seed)
    return E @ np.diag(lam) @ E.T, E


def _lhat2(Lam, N):
    """E[Λ̂²] written out from eq 31, independently of th.expected_lambda_hat_sq."""
    return Lam @ Lam + (Lam + np.trace(Lam) * np.eye(len(Lam))) @ Lam / N


def _eq63(lam, S, N):
    """Eq 63 written out: trΛ − Σ_{d∈S} λ_d³/a_d with a_d the eigenvalues of E[Λ̂²] (eq 32)."""
    lam = np.asarray(lam)
    a = np.linalg.eigvalsh(_lhat2(np.diag(lam), N))  # ascending; compare on sorted λ
    a_of = dict(zip(np.sort(lam), a))
    return lam.sum() - sum(lam[d] ** 3 / a_of[lam[d]] for d in S)


def _unflatten(y, shapes):
    out, i = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(y[i:i + n].reshape(s))
        i += n
    return out


def _autodiff_flow(loss, shapes):
    """τẏ = −½∇L(y) on flattened parameters, ∇ by jax autodiff."""
    g = jax.jit(jax.grad(lambda y: loss(*_unflatten(y, shapes))))
    return lambda t, y: -0.5 * np.asarray(g(jnp.asarray(y)))


def _explicit_flow(rhs, shapes):
    f = jax.jit(lambda y: jnp.concatenate([d.reshape(-1) for d in rhs(*_unflatten(y, shapes))]))
    return lambda t, y: np.asarray(f(jnp.asarray(y)))


def _integrate(f, y0, t_eval, rtol=1e-11, atol=1e-13):
    sol = solve_ivp(f, (0.0, float(t_eval[-1])), np.asarray(y0, dtype=float), method="DOP853",
                    t_eval=t_eval, rtol=rtol, atol=atol)
    assert sol.success, sol.message
    return sol.y.T


def _flat(*arrays):
    return np.concatenate([np.asarray(a, dtype=float).reshape(-1) for a in arrays])


# --- explicit vector fields (eqs 8, 14, 83) ------------------------------------------------------


@pytest.mark.parametrize("H,R,D", [(4, 1, 4), (3, 2, 4), (2, 3, 3)])
def test_attn_s_explicit_rhs_matches_autodiff(H, R, D):
    """Eq 14 / 83 written out equals −½ autodiff of L(Σ v k qᵀ) to 1e-12; the printed eq 14c does not."""
    rng = np.random.default_rng(H * 10 + R)
    Lam, _ = _cov(rng.uniform(0.1, 1.0, D), seed=R)
    v, k, q = rng.standard_normal(H), rng.standard_normal((H, R, D)), rng.standard_normal((H, R, D))
    grads = jax.grad(th.attn_s_population_loss, argnums=(0, 1, 2))(v, k, q, Lam, 1 / 7)
    rhs = th.attn_s_gradient_flow_rhs(v, k, q, Lam, 1 / 7)
    for g, r in zip(grads, rhs):
        assert r.shape == g.shape
        np.testing.assert_allclose(r, -0.5 * np.asarray(g), rtol=0, atol=1e-12 * max(1.0, np.abs(g).max()))
    # The erratum: eq 14c as printed uses Λ² − ΛΣE[Λ̂²] (no transpose); it is wrong off the fixed points.
    Sig = np.einsum("i,ird,ire->de", v, k, q)
    G_printed = Lam @ Lam - Lam @ Sig @ _lhat2(Lam, 7)
    dq_printed = v[:, None, None] * np.einsum("de,ire->ird", G_printed, k)
    assert np.abs(dq_printed - rhs[2]).max() > 1e-3


def test_attn_m_explicit_rhs_matches_autodiff():
    """Eq 8 per head (τU̇_i = v_iG, τv̇_i = ⟨U_i, G⟩) equals −½ autodiff to 1e-12."""
    rng = np.random.default_rng(1)
    Lam, _ = _cov([0.5, 0.3, 0.2], seed=2)
    v, U = rng.standard_normal(5), rng.standard_normal((5, 3, 3))
    grads = jax.grad(th.attn_m_population_loss, argnums=(0, 1))(v, U, Lam, 1 / 4)
    for g, r in zip(grads, th.attn_m_gradient_flow_rhs(v, U, Lam, 1 / 4)):
        np.testing.assert_allclose(r, -0.5 * np.asarray(g), rtol=0, atol=1e-12 * max(1.0, np.abs(g).max()))


def test_effective_matrices_match_loops():
    rng = np.random.default_rng(3)
    v, k, q, U = (rng.standard_normal(3), rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 4)),
                  rng.standard_normal((3, 4, 4)))
    A_s = sum(v[i] * np.outer(k[i, r], q[i, r]) for i in range(3) for r in range(2))
    A_m = sum(v[i] * U[i] for i in range(3))
    np.testing.assert_allclose(th.attn_s_effective_matrix(v, k, q), A_s, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(th.attn_m_effective_matrix(v, U), A_m, rtol=1e-13, atol=1e-13)


# --- zero blocks ----------------------------------------------------------------------------------


def _full_model_batch(seed, D, N, P):
    """Antithetic prompts X: (2P, D+1, N+1); the second half has w → −w on the same x's (then the
    zero blocks' gradients vanish exactly)."""
    rng = np.random.default_rng(seed)
    Lam, _ = _cov(rng.uniform(0.2, 1.0, D), seed)
    x = rng.multivariate_normal(np.zeros(D), Lam, size=(P, N + 1))  # last token = query
    w = rng.standard_normal((P, D))
    x, w = np.concatenate([x, x]), np.concatenate([w, -w])
    y = np.einsum("pnd,pd->pn", x, w)
    X = np.concatenate([x.transpose(0, 2, 1), y[:, None, :]], axis=1)
    X[:, D, N] = 0.0  # query label slot
    return X, y[:, N]


def _attn_m_full(WV, WKQ, X):
    """ŷ_q = bottom-right of X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X (Sec 2.3); the residual adds 0 there."""
    N = X.shape[-1] - 1
    out = jnp.einsum("iab,pbn,pcn,icd,pd->pa", WV, X, X, WKQ, X[:, :, N]) / N
    return out[:, -1]


def _attn_s_full(WV, WK, WQ, X):
    """Sec 2.4 with rank-R W^K_i, W^Q_i ∈ R^{R×(D+1)}: W^Kᵀ W^Q replaces W^{KQ}."""
    return _attn_m_full(WV, jnp.einsum("irc,ird->icd", WK, WQ), X)


def test_zero_block_gradients_vanish():
    """v⃗_i, u_i (ATTN_M) and v⃗_i, scalar k_{i,r} (ATTN_S) get zero gradient at 0 (D.1, F.1).

    The population statement follows from w → −w symmetry, so on antithetic batches the empirical
    gradient of those blocks is 0 to rounding; without the antithetic half it is not.
    """
    D, N, P, H, R = 3, 5, 200, 2, 2
    X, yq = _full_model_batch(0, D, N, P)
    rng = np.random.default_rng(1)
    WV = rng.standard_normal((H, D + 1, D + 1))
    WV[:, D, :D] = 0.0  # v⃗_i
    WKQ = rng.standard_normal((H, D + 1, D + 1))
    WKQ[:, D, :D] = 0.0  # u_i
    WK, WQ = rng.standard_normal((H, R, D + 1)), rng.standard_normal((H, R, D + 1))
    WK[:, :, D] = 0.0  # scalar k_{i,r}

    # Forward sanity: the full models reduce to eq M and eq S.
    x, xq = X[:, :D, :N], X[:, :D, N]
    beta = np.einsum("pdn,pn->pd", x, X[:, D, :N]) / N
    eqM = np.einsum("i,pd,ide,pe->p", WV[:, D, D], beta, WKQ[:, :D, :D], xq)
    np.testing.assert_allclose(_attn_m_full(WV, WKQ, X), eqM, rtol=1e-11, atol=1e-11)
    eqS = np.einsum("i,pd,ird,ire,pe->p", WV[:, D, D], beta, WK[:, :, :D], WQ[:, :, :D], xq)
    np.testing.assert_allclose(_attn_s_full(WV, WK, WQ, X), eqS, rtol=1e-11, atol=1e-11)

    def lm(WV, WKQ, X, yq):
        return jnp.mean((yq - _attn_m_full(WV, WKQ, X)) ** 2)

    def ls(WV, WK, WQ, X, yq):
        return jnp.mean((yq - _attn_s_full(WV, WK, WQ, X)) ** 2)

    gV, gKQ = jax.grad(lm, argnums=(0, 1))(WV, WKQ, X, yq)
    scale = np.abs(gV).max()
    assert scale > 1e-2
    assert np.abs(gV[:, D, :D]).max() <= 1e-12 * scale
    assert np.abs(gKQ[:, D, :D]).max() <= 1e-12 * scale
    gV, gK, _ = jax.grad(ls, argnums=(0, 1, 2))(WV, WK, WQ, X, yq)
    assert np.abs(gV[:, D, :D]).max() <= 1e-12 * scale
    assert np.abs(gK[:, :, D]).max() <= 1e-12 * scale
    # Not vacuous: one half of the antithetic pair alone gives a non-zero gradient.
    gV1, gKQ1 = jax.grad(lm, argnums=(0, 1))(WV, WKQ, X[:P], yq[:P])
    assert np.abs(gV1[:, D, :D]).max() > 1e-3 and np.abs(gKQ1[:, D, :D]).max() > 1e-3


# --- eq 11 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [2, 5, 31])
def test_eq11_identity_on_random_prompts(N):
    """E(y_q zᵀ)E(zzᵀ)⁻¹z = βᵀ(Λ + (Λ + trΛ·I)/N)⁻¹x_q for sampled prompts (eqs 11, 43-46)."""
    D = 3
    Lam, _ = _cov([0.6, 0.3, 0.1], seed=N)
    rng = np.random.default_rng(N)
    P = 50
    x = rng.multivariate_normal(np.zeros(D), Lam, size=(P, N))
    xq = rng.multivariate_normal(np.zeros(D), Lam, size=P)
    w = rng.standard_normal((P, D))
    beta = np.einsum("pnd,pn->pd", x, np.einsum("pnd,pd->pn", x, w)) / N
    z = np.stack([np.kron(xq[p], beta[p]) for p in range(P)])  # column-stacking vec(β x_qᵀ)
    E_yz = (Lam @ Lam).T.reshape(-1)
    E_zz = np.kron(Lam, _lhat2(Lam, N))
    y_mlp = z @ np.linalg.solve(E_zz, E_yz)
    np.testing.assert_allclose(th.converged_predictor(beta, xq, Lam, 1 / N), y_mlp, rtol=1e-10, atol=1e-10)
    A_star = th.attn_m_fixed_point(Lam, 1 / N)
    np.testing.assert_allclose(np.einsum("pd,de,pe->p", beta, A_star, xq), y_mlp, rtol=1e-10, atol=1e-10)
    assert th.converged_predictor(beta[0], xq[0], Lam, 1 / N) == pytest.approx(y_mlp[0], rel=1e-10)
    # L(A*) = eq 19 with m = D (= eq 63 with S = everything).
    assert float(th.population_loss(A_star, Lam, 1 / N)) == pytest.approx(_eq63([0.6, 0.3, 0.1], range(3), N),
                                                                          abs=1e-12)


def test_fig9_directions():
    """Plateau direction vec(Λ²), converged direction vec((Λ + (Λ+trΛ)/N)⁻¹), N → ∞: vec(Λ⁻¹)."""
    Lam, _ = _cov(LAM4, seed=4)
    u = (Lam @ Lam).reshape(-1)
    np.testing.assert_allclose(th.plateau_direction(Lam), u / np.linalg.norm(u), atol=1e-14)
    M = np.linalg.inv(Lam + (Lam + np.eye(4)) / N31)  # trΛ = 1
    np.testing.assert_allclose(th.converged_direction(Lam, 1 / N31), M.reshape(-1) / np.linalg.norm(M),
                               atol=1e-12)
    Li = np.linalg.inv(Lam)
    np.testing.assert_allclose(th.large_N_direction(Lam), Li.reshape(-1) / np.linalg.norm(Li), atol=1e-14)
    np.testing.assert_allclose(th.converged_direction(Lam, 1e-9), th.large_N_direction(Lam), atol=1e-7)
    # At finite N the two differ visibly (Fig 9 middle vs bottom).
    assert np.abs(th.converged_direction(Lam, 1 / N31) - th.large_N_direction(Lam)).max() > 1e-2


# --- the 2^D fixed points ------------------------------------------------------------------------


def test_all_fixed_points_are_stationary_with_eq63_losses():
    """Eq-81 weights for every S_m ⊆ {1..D}: zero gradient, L = eq 63, 2^D distinct losses (eqs 16-18, 60)."""
    D, N, H = 4, 7, 5
    Lam, E = _cov(LAM4, seed=5)
    grad = jax.jit(jax.grad(th.attn_s_population_loss, argnums=(0, 1, 2)))
    fps = th.all_fixed_points(LAM4, 1 / N)
    assert len(fps) == 2**D and len({S for S, _ in fps}) == 2**D
    for S, loss in fps:
        v, k, q = th.fixed_point_weights(LAM4, S, 1 / N, H=H, eigvecs=E)
        assert v.shape == (H,) and k.shape == q.shape == (H, 1, D)
        for g in grad(v, k, q, Lam, 1 / N):
            assert np.abs(g).max() <= 1e-12
        L = float(th.attn_s_population_loss(v, k, q, Lam, 1 / N))
        assert L == pytest.approx(_eq63(LAM4, S, N), abs=1e-12)
        assert loss == pytest.approx(L, abs=1e-12)
        # (C1): Σ v k qᵀ = Σ_{d∈S} (λ_d/a_d) e_d e_dᵀ; at the fixed point G = Σ_{d∉S} λ_d² e_d e_dᵀ (eq 60).
        A = th.attn_s_effective_matrix(v, k, q)
        a = LAM4**2 * (1 + (1 + 1 / LAM4) / N)
        C1 = sum(LAM4[d] / a[d] * np.outer(E[:, d], E[:, d]) for d in S) if S else np.zeros((D, D))
        np.testing.assert_allclose(A, C1, atol=1e-13)
        G = Lam @ Lam - _lhat2(Lam, N) @ np.asarray(A) @ Lam
        out = [d for d in range(D) if d not in S]
        G60 = sum(LAM4[d] ** 2 * np.outer(E[:, d], E[:, d]) for d in out) if out else np.zeros((D, D))
        np.testing.assert_allclose(G, G60, atol=1e-13)
    losses = np.sort([L for _, L in fps])
    assert np.diff(losses).min() > 1e-4  # distinct eigenvalues ⇒ distinct losses


def test_fixed_point_weights_are_min_norm():
    """Eq 81: among (s v, t k, q/(s t)) realising the same Σ, s = t = 1 minimises ‖v‖² + ‖k‖² + ‖q‖²."""
    v, k, q = th.fixed_point_weights(LAM4, (0, 2), 1 / N31)
    n0 = np.sum(v**2) + np.sum(k**2) + np.sum(q**2)
    for s, t in itertools.product([0.9, 1.0, 1.1], repeat=2):
        vs, ks, qs = s * v, t * k, q / (s * t)
        np.testing.assert_allclose(th.attn_s_effective_matrix(vs, ks, qs), th.attn_s_effective_matrix(v, k, q),
                                   atol=1e-14)
        if (s, t) != (1.0, 1.0):
            assert np.sum(vs**2) + np.sum(ks**2) + np.sum(qs**2) > n0
    with pytest.raises(ValueError):
        th.fixed_point_weights(LAM4, (0,), 1 / N31, H=3)


# --- eq 22: PCR ----------------------------------------------------------------------------------


def test_pcr_predictor_losses_are_plateau_losses():
    """population_loss(A_m) = L(M_m) (eq 19) = the reference numbers; A_m = ATTN_S at M_m (eq 22)."""
    Lam, E = _cov(LAM4, seed=6)
    perm = [2, 0, 3, 1]  # eigenpairs in any order
    ref = [1, 0.64058, 0.37737, 0.20980, 0.13600]  # eq 19, computed independently
    for m in range(5):
        A = th.pcr_predictor_matrix(LAM4[perm], E[:, perm], m, 1 / N31)
        L = float(th.population_loss(A, Lam, 1 / N31))
        assert L == pytest.approx(_eq63(LAM4, range(m), N31), abs=1e-12)
        assert L == pytest.approx(th.plateau_losses(LAM4, 1 / N31)[m], abs=1e-12)
        assert L == pytest.approx(ref[m], abs=6e-6)
        v, k, q = th.fixed_point_weights(LAM4, range(m), 1 / N31, eigvecs=E)
        np.testing.assert_allclose(th.attn_s_effective_matrix(v, k, q), A, atol=1e-13)
        # N → ∞: A_m Λ is the projector on the top-m eigenvectors (ŷ → wᵀ P_m x_q).
        P_m = E[:, :m] @ E[:, :m].T
        np.testing.assert_allclose(th.pcr_predictor_matrix(LAM4, E, m, 0.0) @ Lam, P_m, atol=1e-13)
    np.testing.assert_allclose(th.pcr_predictor_matrix(LAM4, E, 4, 1 / N31), th.attn_m_fixed_point(Lam, 1 / N31),
                               atol=1e-12)


# --- reference numbers ---------------------------------------------------------------------------


def test_reference_numbers():
    """Reference numbers: v* = 1.3097, 1.4300, 1.6120, 1.9470 and ‖Λ²‖_F = .18815 for λ = (.4,.3,.2,.1), N = 31."""
    # 4-decimal reference values; the exact v*_2 = (λ/a)^{1/3} = 1.43005.. is printed truncated (1.4300), so the
    # tolerance is a little over half a unit in the last place.
    np.testing.assert_allclose(th.v_star(LAM4, inv_N=1 / N31, trace=1.0), [1.3097, 1.4300, 1.6120, 1.9470], atol=6e-5)
    Lam, _ = _cov(LAM4, seed=7)
    assert 1.0 / th.attn_m_plateau_time(Lam, np.exp(-1.0)) == pytest.approx(0.18815, abs=5e-6)
    # v* is the positive root of eq 21's right-hand side.
    a = LAM4**2 * (1 + (1 + 1 / LAM4) / N31)
    assert np.abs(th.eq21_rhs(th.v_star(LAM4, inv_N=1 / N31, trace=1.0), lam=LAM4, a=a)).max() < 1e-15
    # Λ = I/4 global minimum .13889 and Λ = I, D = 4: D(1+D)/(N+1+D) = .55556 (via eq 51 at t = ∞).
    assert th.white_loss(1e4, 4, inv_N=1 / N31, w_init=0.1, c=0.25) == pytest.approx(0.13889, abs=5e-6)
    assert th.white_loss(1e4, 4, inv_N=1 / N31, w_init=0.1) == pytest.approx(0.55556, abs=5e-6)


# --- eq 21 against the full gradient flow ---------------------------------------------------------


@pytest.mark.parametrize("m", [0, 1, 3])
def test_eq21_matches_population_gradient_flow(m):
    """GF of L(v, k, q) started on the eq-20 manifold stays on it, and v_{m+1} follows eq 21 (≤1e-8)."""
    D, H, N = 4, 4, N31
    Lam, E = _cov(LAM4, seed=8)
    v0 = 0.05
    v, k, q = th.plateau_ansatz_weights(LAM4, m, v_next=v0, inv_N=1 / N, H=H, eigvecs=E)
    shapes = [(H,), (H, 1, D), (H, 1, D)]
    f = _autodiff_flow(lambda v, k, q: th.attn_s_population_loss(v, k, q, Lam, 1 / N), shapes)
    lam = LAM4[m]
    T = 1.0 / (lam**2 * v0) + 40.0 / (3 * lam**2 * th.v_star(lam, inv_N=1 / N, trace=1.0))  # escape + ~40 e-folds
    t = np.linspace(0.0, T, 200)
    Y = _integrate(f, _flat(v, k, q), t)
    v_gf = Y[:, m]
    v_ode = th.eq21_solve(v0, t, lam=lam, inv_N=1 / N, trace=1.0)
    assert np.abs(v_gf - v_ode).max() <= 1e-8
    assert v_ode[-1] == pytest.approx(th.v_star(lam, inv_N=1 / N, trace=1.0), abs=1e-8)
    assert v_ode[len(t) // 4] < 0.2  # the run does include the plateau and the rise
    # The manifold is invariant: k_{m+1} = q_{m+1} = v_{m+1} e_{m+1}, the other heads unchanged.
    for y, vt in zip(Y[::20], v_gf[::20]):
        vv, kk, qq = _unflatten(y, shapes)
        np.testing.assert_allclose(kk[m, 0], vt * E[:, m], atol=1e-8)
        np.testing.assert_allclose(qq[m, 0], vt * E[:, m], atol=1e-8)
        np.testing.assert_allclose(np.delete(vv, m), np.delete(v, m), atol=1e-8)


def test_eq70_implicit_solution():
    """Eq 70 (integrand v⁵): eq70_time(v(t)) − eq70_time(v0) = t below and above v*; dF/dv = 1/v̇."""
    lam, N, tr = 0.3, N31, 1.0
    vs = th.v_star(lam, inv_N=1 / N, trace=tr)
    a = lam**2 * (1 + (1 + tr / lam) / N)
    for v0, T in [(0.05, 240.0), (2.5 * vs, 20.0)]:  # both end within ~1e-4 of v*
        t = np.linspace(0.0, T, 101)
        vt = th.eq21_solve(v0, t, lam=lam, inv_N=1 / N, trace=tr)
        assert np.abs(vt - vs).min() > 1e-5  # keep away from the logarithmic singularity at v*
        np.testing.assert_allclose(th.eq70_time(vt, lam=lam, inv_N=1 / N, trace=tr) - th.eq70_time(v0, lam=lam, inv_N=1 / N, trace=tr), t,
                                   rtol=1e-8, atol=1e-7)
    # Derivative by central differences against 1/eq-21 rhs, at points on both sides of v*.
    for v in [0.02, 0.5, 0.9 * vs, 1.2 * vs, 3.0]:
        h = 1e-6 * v
        dF = (th.eq70_time(v + h, lam=lam, inv_N=1 / N, trace=tr) - th.eq70_time(v - h, lam=lam, inv_N=1 / N, trace=tr)) / (2 * h)
        assert dF == pytest.approx(1.0 / th.eq21_rhs(v, lam=lam, a=a), rel=1e-6)


# --- plateau durations (eqs 54, 71, 76) ----------------------------------------------------------


def test_attn_s_plateau_time_leading_order():
    """Eq 71: time for v₁ to reach v*/2 is 1/(λ₁²v₁(0)) + O(1) as v₁(0) → 0 (eq 76: same law)."""
    lam, N = 0.4, N31
    vs = th.v_star(lam, inv_N=1 / N, trace=1.0)
    a = lam**2 * (1 + (1 + 1 / lam) / N)

    def t_half(v0):
        ev = lambda t, y: y[0] - vs / 2  # noqa: E731
        ev.terminal = True
        sol = solve_ivp(lambda t, y: th.eq21_rhs(y, lam=lam, a=a), (0, 10 / (lam**2 * v0)), [v0], method="DOP853",
                        events=ev, rtol=1e-12, atol=1e-15)
        return sol.t_events[0][0]

    v0s = [1e-2, 1e-3, 1e-4]
    excess = [t_half(v0) - th.attn_s_first_plateau_time(lam1=lam, v1_0=v0) for v0 in v0s]
    # O(1) remainder: converges (differences shrink ∝ v0) and is small next to the plateau.
    assert abs(excess[2] - excess[1]) < 0.2 * abs(excess[1] - excess[0]) + 1e-6
    assert abs(excess[2]) < 1e-3 * th.attn_s_first_plateau_time(lam1=lam, v1_0=1e-4)
    # The same remainder from eq 70 directly.
    ex70 = th.eq70_time(vs / 2, lam=lam, inv_N=1 / N, trace=1.0) - th.eq70_time(1e-4, lam=lam, inv_N=1 / N, trace=1.0) - 1 / (lam**2 * 1e-4)
    assert ex70 == pytest.approx(excess[2], abs=1e-6)
    assert th.attn_s_next_plateau_time(lam=0.2, v_at_tm=0.03) == pytest.approx(1 / (0.04 * 0.03), rel=1e-15)


def test_attn_m_plateau_time_leading_order():
    """Eq 54 for Λ = I: the half-rise time of eq 10 is ln(1/w_init)/‖Λ²‖_F + O(1)."""
    D, N = 4, N31
    alpha = 1 + (1 + D) / N

    def t_half(w):
        return brentq(lambda t: th.white_time_course(t, D, inv_N=1 / N, w_init=w) - 0.5 / alpha, 0.0, 100.0, xtol=1e-14)

    ws = [1e-4, 1e-8, 1e-16]
    excess = [t_half(w) - th.attn_m_plateau_time(np.eye(D), w) for w in ws]
    assert abs(excess[2] - excess[1]) < 1e-6
    # From eq 10: α(e^{2√D t} − 1) = √D/w² at the half point ⇒ remainder ln(√D/α)/(2√D) as w → 0.
    assert excess[2] == pytest.approx(np.log(np.sqrt(D) / alpha) / (2 * np.sqrt(D)), abs=1e-6)


# --- eq 10 against the ATTN_M gradient flow -------------------------------------------------------


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_white_time_course_matches_gradient_flow(c):
    """Λ = cI, aligned balanced init U_i = v_i I/√D: A(t) = σ(t) I with σ from eq 10 (≤1e-8); eq 51."""
    D, H, N = 3, 4, 7
    Lam = c * np.eye(D)
    rng = np.random.default_rng(9)
    w_init = 0.05
    v = rng.standard_normal(H)
    v *= w_init / np.linalg.norm(v)
    U = v[:, None, None] * np.eye(D)[None] / np.sqrt(D)
    shapes = [(H,), (H, D, D)]
    f = _autodiff_flow(lambda v, U: th.attn_m_population_loss(v, U, Lam, 1 / N), shapes)
    gamma = c**2 * np.sqrt(D)
    t = np.linspace(0.0, (np.log(1 / w_init**2) + 30) / (2 * gamma), 150)
    Y = _integrate(f, _flat(v, U), t)
    sig = th.white_time_course(t, D, inv_N=1 / N, w_init=w_init, c=c)
    alpha = c**3 * (1 + (1 + D) / N)
    for y, s, tt in zip(Y, sig, t):
        A = np.asarray(th.attn_m_effective_matrix(*_unflatten(y, shapes)))
        np.testing.assert_allclose(A, s * np.eye(D), rtol=0, atol=1e-8)
        assert th.white_loss(tt, D, inv_N=1 / N, w_init=w_init, c=c) == pytest.approx(float(th.population_loss(A, Lam, 1 / N)),
                                                                   abs=1e-8)
    assert sig[0] == pytest.approx(w_init**2 / np.sqrt(D), rel=1e-14)
    assert sig[-1] == pytest.approx(c**2 / alpha, rel=1e-10)  # = 1/α for c = 1 (eq 10)
    np.testing.assert_allclose(sig[-1] * np.eye(D), th.attn_m_fixed_point(Lam, 1 / N), rtol=1e-10)
    L_inf = c * D * (1 + D) / (N + 1 + D)  # D(1+D)/(N+1+D) for c = 1
    assert th.white_loss(np.inf, D, inv_N=1 / N, w_init=w_init, c=c) == pytest.approx(L_inf, rel=1e-12)
    # Not vacuous: an unaligned init of the same norms does not follow eq 10.
    U_bad = rng.standard_normal((H, D, D))
    U_bad *= np.linalg.norm(v) / np.linalg.norm(U_bad)
    Yb = _integrate(f, _flat(v, U_bad), t, rtol=1e-8, atol=1e-10)
    sig_b = [np.trace(th.attn_m_effective_matrix(*_unflatten(y, shapes))) / D for y in Yb]
    assert np.abs(np.asarray(sig_b) - sig).max() > 1e-3


# --- conservation laws ---------------------------------------------------------------------------


def test_attn_m_conservation_eq55():
    """w₂w₂ᵀ − W₁W₁ᵀ is constant under the ATTN_M gradient flow (eq 55), to 1e-8."""
    D, H, N = 3, 3, 5
    Lam, _ = _cov([0.6, 0.3, 0.1], seed=10)
    rng = np.random.default_rng(10)
    v, U = 0.7 * rng.standard_normal(H), 0.3 * rng.standard_normal((H, D, D))
    shapes = [(H,), (H, D, D)]
    f = _explicit_flow(lambda v, U: th.attn_m_gradient_flow_rhs(v, U, Lam, 1 / N), shapes)
    t = np.linspace(0, 40.0, 5)
    Y = _integrate(f, _flat(v, U), t)
    C0 = th.attn_m_conserved(v, U)
    for y in Y[1:]:
        np.testing.assert_allclose(th.attn_m_conserved(*_unflatten(y, shapes)), C0, atol=1e-8)
    L = [float(th.attn_m_population_loss(*_unflatten(y, shapes), Lam, 1 / N)) for y in Y]
    assert L[-1] < L[0] - 0.1  # the weights did move


@pytest.mark.parametrize("R", [1, 2])
def test_attn_s_conservation_eq82_eq88(R):
    """‖k_{i,r}‖² − ‖q_{i,r}‖² and Σ_r‖k_{i,r}‖² − v_i² are constant under the ATTN_S GF (eqs 82, 88)."""
    D, H, N = 4, 3, 6
    Lam, _ = _cov(LAM4, seed=11)
    rng = np.random.default_rng(11 + R)
    v, k, q = 0.8 * rng.standard_normal(H), 0.6 * rng.standard_normal((H, R, D)), 0.6 * rng.standard_normal((H, R, D))
    shapes = [(H,), (H, R, D), (H, R, D)]
    f = _explicit_flow(lambda v, k, q: th.attn_s_gradient_flow_rhs(v, k, q, Lam, 1 / N), shapes)
    t = np.linspace(0, 60.0, 5)
    Y = _integrate(f, _flat(v, k, q), t)
    kq0, kv0 = th.attn_s_conserved(v, k, q)
    assert kq0.shape == (H, R) and kv0.shape == (H,)
    for y in Y[1:]:
        kq, kv = th.attn_s_conserved(*_unflatten(y, shapes))
        np.testing.assert_allclose(kq, kq0, atol=1e-8)
        np.testing.assert_allclose(kv, kv0, atol=1e-8)
    vT, kT, _ = _unflatten(Y[-1], shapes)
    assert float(th.attn_s_population_loss(*_unflatten(Y[-1], shapes), Lam, 1 / N)) < \
        float(th.attn_s_population_loss(v, k, q, Lam, 1 / N)) - 0.05
    if R > 1:
        # Eq 88 needs the sum over r: a single ‖k_{i,r}‖² − v_i² is not conserved.
        drift = (np.sum(kT[:, 0] ** 2, -1) - vT**2) - (np.sum(k[:, 0] ** 2, -1) - v**2)
        assert np.abs(drift).max() > 1e-3
