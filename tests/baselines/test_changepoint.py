"""The changepoint Bayes predictor (iclab.baselines.changepoint_*): brute-force enumeration of every switch pattern
to 1e-10 (prediction, predictive variance, run-length posterior, evidence), the limits h = 0 (the Gaussian-prior
posterior mean) and h = 1 (the prior mean), and its Monte Carlo risk against the linear trackers on the same
prompts (paired, in standard errors)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab import baselines as bl
from iclab.errors import ConfigError
from iclab.tasks import switching as sw
from iclab.theory import drift as theory


def _log_normal(y, K):
    """log N(y; 0, K), by Cholesky."""
    L = np.linalg.cholesky(K)
    z = np.linalg.solve(L, y)
    return -0.5 * (z @ z) - np.log(np.diag(L)).sum() - 0.5 * len(y) * np.log(2 * np.pi)


def _singular_log_normal(y, K):
    """(deficiency, log density) of y under the singular N(0, K) in the limit of vanishing noise, by the eigen-
    decomposition of K: (−1, −∞) if y is off the range of K; otherwise the number of zero eigenvalues (labels
    determined by the others) and the pseudo-determinant density on the range."""
    lam, V = np.linalg.eigh(K)
    keep = lam > 1e-10 * max(lam.max(), 1.0)
    z = V.T @ y
    if np.linalg.norm(z[~keep]) > 1e-7 * max(np.linalg.norm(y), 1.0):
        return -1, -np.inf
    return int((~keep).sum()), (-0.5 * np.sum(z[keep] ** 2 / lam[keep]) - 0.5 * np.log(lam[keep]).sum()
                                - 0.5 * keep.sum() * np.log(2 * np.pi))


def _brute(x, y, *, hazard, Sigma, sigma2):
    """Predictive mean and variance of y_T given y_<T, the posterior of the last switch at or before T, and
    log p(y_1..y_{T−1}): every switch pattern b_2..b_T (2^{T−1} of them) weighted by its prior probability
    times the Gaussian marginal likelihood of y_1..y_{T−1}, each pattern's segments conditioned by hand.

    σ² = 0 takes the limit σ → 0 of these weights from the singular likelihoods: the patterns under which y_<T
    lies on the range of its covariance with the most labels determined (zero eigenvalues) win, weighed by
    their prior times pseudo-determinant density; the evidence is then +∞ if some label is determined."""
    T = x.shape[0]
    logw, ranks, means, variances, lasts = [], [], [], [], []
    for bits in itertools.product((0, 1), repeat=T - 1):
        b = np.array((1,) + bits)
        seg = np.cumsum(b)  # the segment id of every position
        same = seg[:, None] == seg[None, :]
        K = same * (x @ Sigma @ x.T)  # Cov(y_i, y_j) without noise, all T positions
        Kc = K[:-1, :-1] + sigma2 * np.eye(T - 1)
        kq = K[-1, :-1]
        prior = sum(np.log(hazard) if bi else np.log1p(-hazard) for bi in bits)
        if sigma2 > 0:
            ranks.append(0)
            logw.append(prior + _log_normal(y[:-1], Kc))
            Kinv = np.linalg.inv(Kc)
        else:
            deficiency, logd = _singular_log_normal(y[:-1], Kc) if T > 1 else (0, 0.0)
            ranks.append(deficiency)
            logw.append(prior + logd)
            Kinv = np.linalg.pinv(Kc, rcond=1e-10, hermitian=True) if T > 1 else np.zeros((0, 0))
        means.append(kq @ Kinv @ y[:-1])
        variances.append(K[-1, -1] + sigma2 - kq @ Kinv @ kq)
        lasts.append(np.max(np.nonzero(b)[0]))  # 0-based position of the last switch
    ranks, logw = np.array(ranks), np.array(logw)
    logw = np.where(ranks == ranks.max(), logw, -np.inf)
    p = np.exp(logw - logw.max())
    logev = np.inf if ranks.max() > 0 else logw.max() + np.log(p.sum())
    p /= p.sum()
    mean = p @ np.array(means)
    var = p @ (np.array(variances) + (np.array(means) - mean) ** 2)
    post = np.zeros(T)
    np.add.at(post, np.array(lasts), p)
    return mean, var, post, logev


def _prompts(key, B, *, hazard, sigma2, n, d, prior_cov=1.0, Lam=None):
    Lam = np.eye(d) if Lam is None else Lam
    return sw.sample_switching_prompts(jax.random.PRNGKey(key), B, hazard=hazard, prior_cov=prior_cov,
                                       sigma2=sigma2, n=n, Lam=jnp.asarray(Lam))


# n + 1 = 8 tokens (2^7 = 128 patterns for the last prediction), d = 3; a matrix prior in one case; noise from
# small to large; σ² = 0 with segments shorter than d (d = 8 ≥ 8 tokens) and with longer ones (d = 2: labels
# determined by their segment's first two, at a high and a low hazard and with a matrix prior).
CASES = [  # hazard, σ², prior, d
    (0.2, 0.1, 1.0, 3),
    (0.05, 0.01, 2.0, 3),
    (0.5, 1.0, 1.0, 3),
    (0.3, 0.05, "matrix", 3),
    (0.2, 0.0, 1.0, 8),
    (0.3, 0.0, 1.0, 2),
    (0.05, 0.0, 2.0, 2),
    (0.2, 0.0, "matrix", 2),
]


@pytest.mark.parametrize("hazard,sigma2,prior,d", CASES)
def test_mixture_equals_enumeration_of_every_switch_pattern(hazard, sigma2, prior, d):
    n = 7
    rng = np.random.default_rng(int(1000 * hazard + d))
    A = rng.standard_normal((d, d))
    Sigma = A @ A.T / d + 0.3 * np.eye(d) if prior == "matrix" else prior * np.eye(d)
    prior_cov = Sigma if prior == "matrix" else prior
    pr = _prompts(int(100 * hazard), 3, hazard=hazard, sigma2=sigma2, n=n, d=d, prior_cov=prior_cov)
    x, y = np.asarray(pr.x), np.asarray(pr.y)
    kw = dict(hazard=hazard, prior_cov=prior_cov, sigma2=sigma2)
    f = bl.changepoint_filter(x, y, **kw)
    pred = bl.changepoint_posterior_mean(x[:, :-1], y[:, :-1], x[:, -1], **kw)
    for b in range(3):
        for T in (2, 5, n + 1):  # the a-priori prediction of token T from the T − 1 before it
            mean, var, post, logev = _brute(x[b, :T], y[b, :T], hazard=hazard, Sigma=Sigma, sigma2=sigma2)
            np.testing.assert_allclose(f.predictions[b, T - 1], mean, rtol=0, atol=1e-10)
            np.testing.assert_allclose(f.variances[b, T - 1], var, rtol=0, atol=1e-10)
            # run length r = T − 1 − (0-based position of the last switch)
            np.testing.assert_allclose(f.run_length[b, T - 1, :T], post[::-1], rtol=0, atol=1e-10)
            np.testing.assert_array_equal(f.run_length[b, T - 1, T:], 0.0)
            if T == n + 1:
                np.testing.assert_allclose(pred[b], mean, rtol=0, atol=1e-10)
        # the evidence of all n + 1 labels: the enumeration over one more token, with a dummy query
        xe = np.concatenate([x[b], np.ones((1, d))])
        ye = np.concatenate([y[b], [0.0]])
        *_, logev = _brute(xe, ye, hazard=hazard, Sigma=Sigma, sigma2=sigma2)
        np.testing.assert_allclose(f.log_evidence[b], logev, rtol=0, atol=1e-9)


def test_hazard_zero_is_the_gaussian_prior_posterior_and_hazard_one_ignores_the_context():
    d, n = 3, 12
    A = np.random.default_rng(3).standard_normal((d, d))
    Sigma = A @ A.T / d + 0.2 * np.eye(d)
    pr = _prompts(5, 20, hazard=0.3, sigma2=0.2, n=n, d=d, prior_cov=Sigma)
    x, y, xq = bl.split_prompts(pr)
    for prior in (1.5, Sigma):
        got = bl.changepoint_posterior_mean(x, y, xq, hazard=0.0, prior_cov=prior, sigma2=0.2)
        want = bl.gaussian_posterior_mean(x, y, xq, prior_cov=prior, sigma2=0.2)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(bl.changepoint_posterior_mean(x, y, xq, hazard=0.0, prior_cov=2.0, sigma2=0.2),
                               bl.ridge(x, y, xq, lam=0.1), rtol=0, atol=1e-12)
    f = bl.changepoint_filter(pr.x, pr.y, hazard=0.0, prior_cov=Sigma, sigma2=0.2)
    np.testing.assert_array_equal(f.run_length[:, np.arange(n + 1), np.arange(n + 1)], 1.0)  # s = 1 always
    # h = 1: a fresh task at every token, so nothing in the context is informative: the prior mean 0 and the
    # prior predictive variance x_tᵀΣ_w x_t + σ² at every position, whatever the labels
    f1 = bl.changepoint_filter(pr.x, pr.y * 100.0, hazard=1.0, prior_cov=Sigma, sigma2=0.2)
    np.testing.assert_array_equal(f1.predictions, 0.0)
    np.testing.assert_allclose(f1.variances, np.einsum("btd,de,bte->bt", pr.x, Sigma, pr.x) + 0.2, rtol=1e-12)
    np.testing.assert_array_equal(f1.run_length[:, :, 0], 1.0)
    np.testing.assert_array_equal(bl.changepoint_posterior_mean(x, y, xq, hazard=1.0, prior_cov=Sigma, sigma2=0.2),
                                  0.0)


def test_layouts_dtype_and_bad_input():
    pr = _prompts(7, 6, hazard=0.1, sigma2=0.1, n=10, d=3)
    kw = dict(hazard=0.1, sigma2=0.1)
    want = bl.changepoint_filter(pr.x, pr.y, **kw).predictions[:, -1]
    np.testing.assert_allclose(bl.on_prompts(bl.changepoint_posterior_mean, **kw)(pr), want, rtol=0, atol=1e-12)
    moved = pr._replace(y=pr.y.at[:, -1].add(100.0))  # the target is never read for its own prediction
    np.testing.assert_allclose(bl.changepoint_filter(moved.x, moved.y, **kw).predictions[:, -1], want, rtol=0,
                               atol=1e-12)
    out = bl.changepoint_posterior_mean(*(jnp.asarray(a, jnp.float32) for a in bl.split_prompts(pr)), **kw)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3)
    x, y, xq = bl.split_prompts(pr)
    with pytest.raises(ConfigError, match=r"^hazard: .*\[0, 1\]"):
        bl.changepoint_posterior_mean(x, y, xq, hazard=1.5, sigma2=0.1)
    with pytest.raises(ConfigError, match=r"^sigma2: .*>= 0"):
        bl.changepoint_filter(pr.x, pr.y, hazard=0.1, sigma2=-1.0)
    # noiseless labels beyond d need a positive definite prior; a traced σ² = 0 gives the concrete one's numbers
    with pytest.raises(ConfigError, match=r"^prior_cov: noiseless labels \(sigma2 = 0\) beyond d = 3 need a positive"):
        bl.changepoint_posterior_mean(x, y, xq, hazard=0.1, prior_cov=np.diag([1.0, 1.0, 0.0]), sigma2=0.0)
    traced = jax.jit(lambda s2: bl.changepoint_posterior_mean(x, y, xq, hazard=0.1, sigma2=s2))
    np.testing.assert_allclose(traced(0.0), bl.changepoint_posterior_mean(x, y, xq, hazard=0.1, sigma2=0.0),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(traced(0.1), want, rtol=0, atol=1e-12)


def test_long_prompts_stay_finite_and_normalised():
    # 301 tokens, small noise: the likelihoods of wrong segments underflow any linear-space weight
    long = _prompts(8, 4, hazard=0.02, sigma2=1e-3, n=300, d=3)
    f = bl.changepoint_filter(long.x, long.y, hazard=0.02, sigma2=1e-3)
    assert np.all(np.isfinite(f.predictions)) and np.all(np.isfinite(f.log_evidence))
    np.testing.assert_allclose(f.run_length.sum(-1), 1.0, rtol=0, atol=1e-12)
    # and they track the switches: far below the stationary posterior's (h = 0) errors on the same prompts
    signal = np.einsum("btd,btd->bt", long.x, long.w)
    stationary = bl.changepoint_filter(long.x, long.y, hazard=0.0, sigma2=1e-3)
    err, err0 = (np.mean((np.asarray(g.predictions) - signal) ** 2) for g in (f, stationary))
    assert err < 0.25 * err0, (err, err0)


def test_query_gradient_is_the_mixture_of_segment_means():
    pr = _prompts(9, 4, hazard=0.2, sigma2=0.1, n=6, d=3)
    x, y, xq = bl.split_prompts(pr)
    grad = jax.vmap(jax.grad(lambda xx, yy, q: bl.changepoint_posterior_mean(xx, yy, q, hazard=0.2, sigma2=0.1),
                             argnums=2))(x, y, xq)
    # linear in x_q: ŷ(x_q) = x_qᵀ ∇ŷ
    np.testing.assert_allclose(jnp.sum(grad * xq, -1), bl.changepoint_posterior_mean(x, y, xq, hazard=0.2, sigma2=0.1),
                               rtol=0, atol=1e-12)
    assert np.all(np.isfinite(grad))


H, SIGMA2, D, N, P = 0.1, 0.05, 3, 24, 6000


@pytest.fixture(scope="module")
def mc_prompts():
    return _prompts(11, P, hazard=H, sigma2=SIGMA2, n=N, d=D, Lam=np.diag([1.5, 1.0, 0.5]))


def test_bayes_risk_is_the_mean_squared_error(mc_prompts):
    pr = mc_prompts
    f = bl.changepoint_filter(pr.x, pr.y, hazard=H, sigma2=SIGMA2)
    est = bl.changepoint_bayes_risk(pr.x, pr.y, hazard=H, sigma2=SIGMA2)
    np.testing.assert_allclose(est.mean, np.mean(f.variances, axis=0), rtol=1e-12)
    # E[(ŷ_t − y_t)² | past] = Var[y_t | past]: paired differences have mean 0 at every position (4 SE each)
    diff = np.asarray((f.predictions - pr.y) ** 2 - f.variances)
    se = diff.std(axis=0, ddof=1) / np.sqrt(P)
    assert np.all(np.abs(diff.mean(axis=0)) < 4 * se)
    # the first token is predicted by the prior: risk tr(ΛΣ_w) + σ² exactly in expectation
    assert abs(float(est.mean[0]) - (3.0 + SIGMA2)) < 4 * float(est.se[0])
    assert np.all(np.asarray(est.se) > 0)


def test_noiseless_bayes_risk_is_the_mean_squared_error_and_vanishes_without_switches():
    # σ² = 0, d = 2, 16 tokens: most labels are determined by their segment's first two (module docstring)
    P0, h = 4000, 0.15
    pr = _prompts(12, P0, hazard=h, sigma2=0.0, n=15, d=2)
    f = bl.changepoint_filter(pr.x, pr.y, hazard=h, sigma2=0.0)
    assert np.all(np.isfinite(f.predictions)) and np.all(np.isfinite(f.variances))
    np.testing.assert_allclose(f.run_length.sum(-1), 1.0, rtol=0, atol=1e-12)
    diff = np.asarray((f.predictions - pr.y) ** 2 - f.variances)  # paired: mean 0 at every position (4 SE)
    se = diff.std(axis=0, ddof=1) / np.sqrt(P0)
    assert np.all(np.abs(diff.mean(axis=0)) < 4 * se), (diff.mean(axis=0), se)
    # a label after two of an unbroken segment is predicted exactly unless a switch happens at it: the risk at
    # position t ≥ 3 is at least h·E[x_tᵀw]² = h·d (a switch there) and far below the prior's d
    est = bl.changepoint_bayes_risk(pr.x, pr.y, hazard=h, sigma2=0.0)
    assert np.all(np.asarray(est.mean[2:]) > h * 2.0 - 4 * np.asarray(est.se[2:]))
    assert np.all(np.asarray(est.mean[6:]) < 0.5 * 2.0)
    # without switches every label past the d-th is exact: h = 0 gives zero predictive variance there
    f0 = bl.changepoint_filter(pr.x, np.einsum("btd,bd->bt", pr.x, pr.w[:, 0]), hazard=0.0, sigma2=0.0)
    np.testing.assert_array_equal(f0.variances[:, 2:], 0.0)
    np.testing.assert_allclose(f0.predictions[:, 2:], np.einsum("btd,bd->bt", pr.x, pr.w[:, 0])[:, 2:], rtol=0,
                               atol=1e-9)


def test_no_linear_tracker_beats_the_bayes_predictor_and_ridge_loses_clearly(mc_prompts):
    pr = mc_prompts
    x, y, xq = bl.split_prompts(pr)
    Lam = np.diag([1.5, 1.0, 0.5])
    bayes = bl.changepoint_posterior_mean(x, y, xq, hazard=H, sigma2=SIGMA2)
    signal = jnp.einsum("bd,bd->b", xq, pr.w[:, -1])  # noiseless target: the query's noise is common to all
    err = lambda p: np.asarray((p - signal) ** 2)  # noqa: E731
    e_bayes = err(bayes)
    gamma = 1 - H  # the AR(1) with the same autocovariance C(i, j) = (1 − h)^{|i−j|} (the switching task's)
    ar1 = dict(gamma=gamma, sigma_w2=1.0, sigma_e2=1.0 - gamma**2)
    rivals = {
        "kalman (matched AR(1): the best linear predictor)": bl.kalman_posterior_mean(x, y, xq, **ar1, sigma2=SIGMA2),
        "ridge (stationary Bayes)": bl.gaussian_posterior_mean(x, y, xq, prior_cov=1.0, sigma2=SIGMA2),
    }
    for beta in (0.7, 0.8, 0.9, 0.95):
        rivals[f"rls beta={beta}"] = bl.rls(x, y, xq, beta=beta, delta=1.0)
    lam_star, _ = theory.optimal_forget_factor(**ar1, n=N, Lam=Lam)
    D1, D2, D3, _ = theory.D_sums(lam_star, **ar1, n=N)
    rivals["exponential weights at lambda*"] = bl.wpgd(x, y, xq, P=D1 * np.linalg.inv(theory.Lam_tilde(Lam, D2=D2, D3=D3)),
                                                       omega=bl.exponential_weights(N, lam=lam_star))
    gaps = {}
    for name, pred in rivals.items():
        gap = err(pred) - e_bayes  # paired on the same prompts
        mean, se = gap.mean(), gap.std(ddof=1) / np.sqrt(P)
        gaps[name] = (mean, se)
        assert mean > -3 * se, (name, mean, se)  # the Bayes predictor is never beaten by more than 3 SE
    mean, se = gaps["ridge (stationary Bayes)"]
    assert mean > 10 * se and mean > 0.5 * e_bayes.mean(), gaps  # ridge clearly worse at h = 0.1
    mean, se = gaps["kalman (matched AR(1): the best linear predictor)"]
    assert mean > 4 * se, gaps  # the non-linear mixture beats the best linear predictor
