"""Gaussian task prior (linattn; mhsa per task): posterior mean against explicit conditioning, Bayes risk
against exact special cases and Monte Carlo (paired, 4 SE), and the posterior mean beating mis-tuned ridge."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.tasks import linreg
from iclab.tasks import multitask_regression as mr

D = 4
# Test data come from numpy generators: jax's threefry sampler costs seconds of compile per shape here.


def _rotation(rng, n):
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def _linreg_prompts(rng, Lam, N, P):
    """linattn's eq 2 (``iclab.tasks.linreg.sample_prompts``): x ~ N(0, Λ), w ~ N(0, I), y = wᵀx."""
    xs = rng.standard_normal((P, N + 1, Lam.shape[0])) @ np.linalg.cholesky(Lam).T
    w = rng.standard_normal((P, Lam.shape[0]))
    ys = np.einsum("pnd,pd->pn", xs, w)
    return linreg.Prompts(x=xs[:, :N], y=ys[:, :N], x_q=xs[:, N], y_q=ys[:, N], w=w)


def _mhsa_prompts(rng, ts, L, P):
    """mhsa's eq 2.4 (``iclab.tasks.multitask_regression.sample_prompts``), drawn with numpy."""
    Phi, Psi = np.asarray(ts.Phi), np.asarray(ts.Psi)
    core = rng.standard_normal((P, ts.d, ts.d_y)) * mr.block_scales(ts) / np.sqrt(ts.d)
    G = np.einsum("ab,pbc,dc->pad", Phi, core, Psi)
    X, q = rng.standard_normal((P, ts.d, L)), rng.standard_normal((P, ts.d))
    Y = np.einsum("pdy,pdl->pyl", G, X) + ts.sigma * rng.standard_normal((P, ts.d_y, L))
    return mr.MultitaskPrompts(X, Y, q, np.einsum("pdy,pd->py", G, q), G)


def _prior(seed=0):
    A = np.random.default_rng(seed).standard_normal((D, D))
    return A @ A.T / D + 0.1 * np.eye(D)


@pytest.mark.parametrize("N", [2, 7])
def test_posterior_mean_is_explicit_gaussian_conditioning(N):
    rng = np.random.default_rng(1)
    x, y, xq = rng.standard_normal((3, N, D)), rng.standard_normal((3, N)), rng.standard_normal((3, D))
    Sw, s2 = _prior(), 0.3
    want = [xq[p] @ Sw @ x[p].T @ np.linalg.solve(x[p] @ Sw @ x[p].T + s2 * np.eye(N), y[p]) for p in range(3)]
    np.testing.assert_allclose(bl.gaussian_posterior_mean(x, y, xq, prior_cov=Sw, sigma2=s2), want, rtol=0, atol=1e-12)
    # isotropic prior: ridge with penalty σ²/σ_w²
    np.testing.assert_allclose(bl.gaussian_posterior_mean(x, y, xq, prior_cov=2.0, sigma2=s2),
                               bl.ridge(x, y, xq, lam=s2 / 2.0), rtol=0, atol=1e-12)


def test_noiseless_limit():
    rng = np.random.default_rng(2)
    Sw = _prior(3)
    # N < D: the minimum-Σ_w⁻¹-norm interpolant Σ_w Xᵀ(XΣ_wXᵀ)⁻¹y, the σ² → 0 limit
    x, y, xq = rng.standard_normal((3, 2, D)), rng.standard_normal((3, 2)), rng.standard_normal((3, D))
    want = [xq[p] @ Sw @ x[p].T @ np.linalg.solve(x[p] @ Sw @ x[p].T, y[p]) for p in range(3)]
    got = bl.gaussian_posterior_mean(x, y, xq, prior_cov=Sw)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)
    np.testing.assert_allclose(bl.gaussian_posterior_mean(x, y, xq, prior_cov=Sw, sigma2=1e-9), got, rtol=0, atol=1e-6)
    # isotropic prior: least squares; N ≥ D: exact recovery whatever the prior
    np.testing.assert_allclose(bl.gaussian_posterior_mean(x, y, xq, prior_cov=3.0), bl.least_squares(x, y, xq),
                               rtol=0, atol=1e-12)
    x, w, xq = rng.standard_normal((3, 9, D)), rng.standard_normal((3, D)), rng.standard_normal((3, D))
    np.testing.assert_allclose(bl.gaussian_posterior_mean(x, np.einsum("pnd,pd->pn", x, w), xq, prior_cov=Sw),
                               np.einsum("pd,pd->p", xq, w), rtol=0, atol=1e-12)


def test_noiseless_bayes_risk_closed_forms_hold_for_every_context():
    rng = np.random.default_rng(6)
    Q = _rotation(rng, D)
    Lam = (Q * linreg.spectrum_eigenvalues("linear", D)) @ Q.T
    pr = _linreg_prompts(rng, Lam, 6, 50)  # linattn's task, N ≥ D
    np.testing.assert_allclose(bl.gaussian_bayes_risk(pr.x, Lam=Lam), 0.0, atol=1e-12)
    np.testing.assert_allclose(bl.gaussian_posterior_mean(pr.x, pr.y, pr.x_q), pr.y_q, rtol=0, atol=1e-11)
    x = np.random.default_rng(4).standard_normal((50, 3, D))  # N < D, Λ = cI, Σ_w = σ_w² I: c σ_w² (D − N)
    np.testing.assert_allclose(bl.gaussian_bayes_risk(x, Lam=0.5 * np.eye(D), prior_cov=2.0), 0.5 * 2.0 * (D - 3),
                               rtol=1e-12)


def _paired_z(errors, risks):
    """z of mean(e − r): E[e | X] = r(X) makes e − r mean zero when the conditional risk is exact."""
    diff = np.asarray(errors) - np.asarray(risks)
    return abs(diff.mean()) / (diff.std(ddof=1) / np.sqrt(diff.size))


def test_bayes_risk_matches_monte_carlo_linattn_and_noisy():
    rng = np.random.default_rng(7)
    Q = _rotation(rng, D)
    Lam = (Q * linreg.spectrum_eigenvalues("inverse", D)) @ Q.T
    pr = _linreg_prompts(rng, Lam, 2, 4000)  # N < D: a nonzero Bayes risk
    err = (bl.gaussian_posterior_mean(pr.x, pr.y, pr.x_q) - pr.y_q) ** 2
    risk = bl.gaussian_bayes_risk(pr.x, Lam=Lam)
    assert _paired_z(err, risk) < 4.0
    # noisy labels, non-isotropic prior: draw w = Cg, y = Xw + σε by hand
    Sw, s2 = _prior(5), 0.5
    w = rng.standard_normal((4000, D)) @ np.linalg.cholesky(Sw).T
    y = np.einsum("pnd,pd->pn", pr.x, w) + np.sqrt(s2) * rng.standard_normal((4000, 2))
    yq = np.einsum("pd,pd->p", pr.x_q, w)
    err = (bl.gaussian_posterior_mean(pr.x, y, pr.x_q, prior_cov=Sw, sigma2=s2) - yq) ** 2
    risk = bl.gaussian_bayes_risk(pr.x, Lam=Lam, prior_cov=Sw, sigma2=s2)
    assert _paired_z(err, risk) < 4.0
    # and the test can fail: a mis-tuned ridge is worse than the posterior mean by many SE
    diff = np.asarray((bl.ridge(pr.x, y, pr.x_q, lam=20 * s2) - yq) ** 2 - err)
    assert diff.mean() > 4 * diff.std(ddof=1) / np.sqrt(diff.size)


# ------------------------------------------------------------------------------------ mhsa


def _brute_mhsa(X, Y, q, ts):
    """Condition vec(G) (d·d_y unknowns) on all L·d_y responses: the whole model at once, no blocks."""
    d, dy = ts.d, ts.d_y
    S = mr.block_scales(ts)
    Phi, Psi = np.asarray(ts.Phi), np.asarray(ts.Psi)
    A = np.einsum("ac,be,ce->abce", Phi, Psi, S).reshape(d * dy, d * dy) / np.sqrt(d)  # vec G = A vec N
    out = []
    for p in range(X.shape[0]):
        # response (j, l) = Σ_a G[a, j] X[a, l] + ε
        Mobs = np.einsum("al,jb->jlab", X[p], np.eye(dy)).reshape(dy * X.shape[2], d * dy) @ A
        Mq = np.einsum("a,jb->jab", q[p], np.eye(dy)).reshape(dy, d * dy) @ A
        K = Mobs @ Mobs.T + ts.sigma ** 2 * np.eye(Mobs.shape[0])
        out.append(Mq @ Mobs.T @ np.linalg.solve(K, Y[p].reshape(-1)))
    return np.array(out)


def test_mhsa_posterior_mean_is_brute_force_conditioning():
    rng = np.random.default_rng(8)
    ts = mr.task_structure((2, 3), (1.5, 0.7), sigma=0.5, d_y=3)
    ts = ts._replace(Phi=jnp.asarray(_rotation(rng, 5)), Psi=jnp.asarray(_rotation(rng, 3)))
    pr = _mhsa_prompts(rng, ts, 4, 3)
    got = bl.mhsa_posterior_mean(pr.X, pr.Y, pr.q, ts=ts)
    assert got.shape == (3, 3)
    np.testing.assert_allclose(got, _brute_mhsa(*(np.asarray(a) for a in (pr.X, pr.Y, pr.q)), ts), rtol=0, atol=1e-10)
    # noiseless with L ≥ d_i: every task recovered, the prediction is the target
    ts0 = ts._replace(sigma=0.0)
    pr0 = _mhsa_prompts(rng, ts0, 4, 3)
    np.testing.assert_allclose(bl.on_prompts(bl.mhsa_posterior_mean, ts=ts0)(pr0), pr0.y_q, rtol=0, atol=1e-10)
    np.testing.assert_allclose(bl.mhsa_bayes_risk(pr0.X, ts=ts0), 0.0, atol=1e-12)


def test_mhsa_bayes_risk_matches_monte_carlo_and_the_theory_module():
    from iclab.theory import mhsa as theory

    ts = mr.homogeneous(2, 3, lam=1.0, sigma=0.6)
    pr = _mhsa_prompts(np.random.default_rng(9), ts, 5, 4000)
    err = jnp.sum((bl.mhsa_posterior_mean(pr.X, pr.Y, pr.q, ts=ts) - pr.y_q) ** 2, axis=-1)
    risk = bl.mhsa_bayes_risk(pr.X, ts=ts)
    assert _paired_z(err, risk) < 4.0
    mc, se = theory.bayes_risk_mc(0, I=2, d_bar=3, lam=1.0, sigma2=0.36, L=5, n=4000)
    r = np.asarray(risk)
    assert abs(r.mean() - mc) < 4 * np.hypot(se, r.std(ddof=1) / np.sqrt(r.size))
