"""sample_query_moments: (β, x_q, y_q, w) drawn from their exact joint law without the contexts."""

import jax
import numpy as np
import pytest

from iclab.tasks.linreg import (
    QueryMoments, context_moment, covariance, sample_prompts, sample_query_moments, spectrum_eigenvalues,
)
from iclab.theory import linattn as theory


def _rotated(D=4, seed=1):
    return covariance(spectrum_eigenvalues("inverse", D), jax.random.PRNGKey(seed))


def test_shapes_dtype_and_noiseless_query_label():
    Lam = _rotated()
    q = sample_query_moments(jax.random.PRNGKey(0), Lam, N=7, P=13)
    assert isinstance(q, QueryMoments)
    assert q.beta.shape == q.x_q.shape == q.w.shape == (13, 4) and q.y_q.shape == (13,)
    assert q.beta.dtype == np.float64
    np.testing.assert_allclose(q.y_q, np.einsum("pd,pd->p", q.x_q, q.w), atol=1e-13)


def test_one_dimension_gives_beta_as_lambda_hat_times_w():
    # D = 1: β = Λ̂ w with Λ̂ = λ Q/N, Q ~ χ²_N: β/w > 0 and E[β/(λw)] = 1, Var = 2/N.
    lam, N, P = 0.7, 5, 100_000
    q = sample_query_moments(jax.random.PRNGKey(3), covariance([lam]), N=N, P=P)
    ratio = np.asarray(q.beta[:, 0] / (lam * q.w[:, 0]))
    assert ratio.min() > 0
    assert abs(ratio.mean() - 1.0) < 5 * np.sqrt(2.0 / N / P)
    assert abs(ratio.var() - 2.0 / N) < 0.05 * 2.0 / N


@pytest.mark.parametrize("N", [1, 3, 31])
def test_second_moment_of_beta_is_eq_31(N):
    # E[ββᵀ] = E[Λ̂ w wᵀ Λ̂] = E[Λ̂²] = Λ² + (Λ + trΛ·I)Λ/N (eq 31), entry-wise at 5 standard errors.
    Lam = _rotated()
    P = 200_000
    beta = np.asarray(sample_query_moments(jax.random.PRNGKey(N), Lam, N=N, P=P).beta)
    outer = beta[:, :, None] * beta[:, None, :]
    se = outer.std(axis=0) / np.sqrt(P)
    assert np.all(np.abs(outer.mean(axis=0) - np.asarray(theory.expected_lambda_hat_sq(Lam, 1.0 / N))) < 5 * se)


def test_joint_law_matches_context_moment_of_sampled_prompts():
    # Two-sample comparison with β of real prompts: moments that mix β, w, x_q and y_q, and a
    # fourth moment of β (sensitive to the χ² and √Q parts), at 5 combined standard errors.
    Lam, N, P = _rotated(), 4, 100_000
    q = sample_query_moments(jax.random.PRNGKey(5), Lam, N=N, P=P)
    pr = sample_prompts(jax.random.PRNGKey(6), Lam, N=N, P=P)
    ref = QueryMoments(beta=context_moment(pr), x_q=pr.x_q, y_q=pr.y_q, w=pr.w)

    def stats(s):
        b, x, y, w = (np.asarray(a) for a in s)
        return np.column_stack([b[:, 0] * w[:, 0], b[:, 1] * w[:, 0], (b * b).sum(1) ** 2,
                                (b * x).sum(1) * y, b[:, 2] * b[:, 3]])

    a, r = stats(q), stats(ref)
    se = np.sqrt(a.var(axis=0) / P + r.var(axis=0) / P)
    assert np.all(np.abs(a.mean(axis=0) - r.mean(axis=0)) < 5 * se)
