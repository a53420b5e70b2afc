"""linattn.fig1, algorithm match: trained ATTN_M against eq 11's predictor (one PGD step) on held-out prompts.

ATTN_M at the fixed point A* IS eq 11's predictor (gap 0, cosine 1); away from it the held-out gap is the
excess population loss L(A) − L(A*) (ŷ = βᵀAx_q is linear in A), and a rescaled A* keeps cosine 1. The checks
pass on the fixed point and fail on a model away from it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments.linattn import fig1
from iclab.experiments.linattn._common import keys_and_covariances
from iclab.theory import linattn as theory

# Mostly compiling the held-out evaluation (Jacobians, the sandwich's eigendecompositions)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matched():  # compiles the held-out evaluation (Jacobians included): a few seconds
    config = fig1.Fig1Config(rotate=True, n_eval=2000, P=5000)
    keys, Lams = keys_and_covariances(config)
    Lam = np.asarray(Lams[0])
    A = np.asarray(theory.attn_m_fixed_point(Lam, 1.0 / config.N))
    R = np.random.default_rng(1).standard_normal(A.shape)
    B = A + 0.3 * np.linalg.norm(A) / np.linalg.norm(R) * R  # not symmetric: tests the transpose convention

    def attn_m(M):  # one head, v = 1, U = M; leading seed axis
        return {"v": jnp.ones((1, 1)), "U": jnp.asarray(M)[None, None]}

    r = fig1.algorithm_match_arrays(config, keys, Lams, {"population": attn_m(A), "sampled": attn_m(B)})
    r["plateau_levels"] = theory.plateau_losses(config.lambdas(), 1.0 / config.N)
    return config, Lam, A, B, r


def test_gap_is_zero_at_the_fixed_point_and_the_excess_loss_away_from_it(matched):
    config, Lam, A, B, r = matched
    pop, samp = fig1.MATCH_RUNS.index("population"), fig1.MATCH_RUNS.index("sampled")
    LD = r["plateau_levels"][-1]
    assert r["match_gap"][pop, 0] < 1e-20 and r["match_cosine"][pop, 0] == pytest.approx(1.0, abs=1e-12)
    excess = float(theory.population_loss(B, Lam, 1.0 / config.N) - theory.population_loss(A, Lam, 1.0 / config.N))
    assert excess > 0.01 * LD
    assert abs(r["match_gap"][samp, 0] - excess) < 4 * r["match_gap_se"][samp, 0]  # Pythagoras
    assert r["match_cosine"][samp, 0] < 0.99
    # eq 11's Monte Carlo risk is L(M_D); N ≥ D noiseless pairs: the Bayes risk is 0 for every context
    assert abs(r["match_risk_eq11"][pop, 0] - LD) < 4 * r["match_risk_eq11_se"][pop, 0]
    assert abs(r["match_bayes_risk"]).max() < 1e-12 and r["match_risk_bayes"].max() < 1e-20
    assert r["match_excess"][pop, 0] == pytest.approx(r["match_risk_model"][pop, 0], abs=1e-12)
    assert r["match_risk_gd1"][pop, 0] > r["match_risk_eq11"][pop, 0]  # eq 11's preconditioner beats plain GD


def test_match_checks_pass_at_the_fixed_point_and_fail_away_from_it(matched):
    config, _, _, _, r = matched
    checks = fig1._match_checks(config, r)
    assert [c.name.split(" ")[0] for c in checks] == ["population", "sampled", "trained", "no"]
    # A*: gap 0; B: far beyond a least-squares fit's excess on P prompts, and its sensitivities point elsewhere
    assert [c.passed for c in checks] == [True, False, False, True]
    assert fig1._match_checks(config, {k: v for k, v in r.items() if not k.startswith("match_")}) == []
