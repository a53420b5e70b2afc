"""gating.fig1, algorithm match: the restricted GLA-vector against optimal WPGD on held-out prompts, and the Bayes floor.

The model side runs the full GLA (``gla.restricted_to_full``) on delimiter tokens and the algorithm runs on plain
arrays, so a model matched with its OWN WPGD form (``gla.restricted_wpgd``) must give gap 0 and cosine 1: that tests
the two layouts against each other. The Bayes risk is checked against the closed form for independent tasks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab import baselines
from iclab.engines import seed_keys
from iclab.experiments.gating import _common as C
from iclab.experiments.gating import fig1
from iclab.models import gla
from iclab.theory import wpgd as theory

SMALL = dict(d=3, p=3, n_bars=[0, 2, 4], panels=["a", "c", "d"], vector_panels=["d"], seeds=1)


@pytest.mark.slow  # compiles the GLA's Jacobians on delimiter tokens
def test_restricted_gla_vector_on_tokens_is_its_own_wpgd_and_the_optimum_has_its_risk():
    config = fig1.Fig1Config(**SMALL)
    contexts = C.sample_contexts(config)[0]
    key_s = seed_keys(config.seed, 1)[0]
    rp = C._restricted_init("vector", config.d, config.p, 0.5)(jax.random.PRNGKey(3))
    nb, panel = 4, (0.5, 0.5)
    prompts = C.match_prompts(config, key_s, panel, nb, 2000)
    P, omega = gla.restricted_wpgd(rp, contexts, [nb] * C.K, query_context=config.qc())
    own = C._restricted_match(rp, contexts, P, omega, prompts, family="gla_vector", n_bar=nb, d=config.d,
                              qc=config.qc())
    assert float(own["gap"]) < 1e-20 and float(own["cosine"]) == pytest.approx(1.0, abs=1e-10)
    R, r = theory.two_task_correlation(nb, r1=panel[0], r2=panel[1])
    opt = theory.wpgd_optimum(np.eye(config.d), R, r, 0.0)
    vs_opt = C._restricted_match(rp, contexts, jnp.asarray(opt.P), jnp.asarray(opt.omega), prompts,
                                 family="gla_vector", n_bar=nb, d=config.d, qc=config.qc())
    assert float(vs_opt["gap"]) > 0.01 * opt.risk  # a random restricted model is far from the optimum
    assert abs(float(vs_opt["alg_risk"]) - opt.risk) < 4 * float(vs_opt["alg_risk_se"])  # eq 17 by Monte Carlo


@pytest.mark.slow  # one compilation per n̄
def test_restricted_algorithm_match_shapes_and_bayes_risk_closed_form():
    config = fig1.Fig1Config(**SMALL)
    panels = config.panel_values()
    S, P_, G = 1, len(panels), len(config.n_bars)
    init = C._restricted_init("vector", config.d, config.p, 0.5)
    keys = jax.random.split(jax.random.PRNGKey(0), S * P_ * G)
    rparams = jax.tree_util.tree_map(lambda a: a.reshape((S, P_, G) + a.shape[1:]), jax.vmap(init)(keys))
    m = C.restricted_algorithm_match(config, "gla_vector", rparams, panels, N=256)
    assert m["gap"].shape == (S, P_, G) and np.all(np.isnan(m["gap"][..., 0]))  # n̄ = 0: no context, no match
    assert np.all(m["gap"][..., 1:] > 0) and np.all(np.abs(m["cosine"][..., 1:]) <= 1 + 1e-12)
    mean, se = C.bayes_risks(config, panels, N=64)
    for i, (r1, r2) in enumerate(panels):
        for g, nb in enumerate(config.n_bars):
            want = baselines.independent_tasks_bayes_risk(block_sizes=[nb, nb], task_r=[r1, r2], d=config.d)
            assert mean[0, i, g] == pytest.approx(want, abs=1e-9)  # noiseless: the same for every context
            assert se[0, i, g] < 1e-9


def _arrays(config):
    panels = config.panel_values()
    S, P_, G = config.seeds, len(panels), len(config.n_bars)
    opt = np.full((S, P_, G), 0.5)
    nan0 = np.where(np.asarray(config.n_bars) >= 1, 1.0, np.nan)
    return {
        "restricted_gla_vector": np.full((S, P_, G), 0.5),
        "match_gla_vector_gap": 1e-5 * nan0 * np.ones((S, P_, G)), "match_gla_vector_gap_se": 1e-6 * np.ones((S, P_, G)),
        "match_gla_vector_opt_risk": opt * nan0, "match_gla_vector_cosine": 0.999 * nan0 * np.ones((S, P_, G)),
        "bayes_risk": np.full((S, P_, G), 0.3), "bayes_risk_se": np.zeros((S, P_, G)),
    }


def test_match_checks_pass_on_consistent_arrays_and_fail_when_a_claim_breaks():
    config = fig1.Fig1Config(**SMALL)
    r = _arrays(config)
    checks = fig1._match_checks(config, r)
    assert len(checks) == 3 and all(c.passed for c in checks), [c.name for c in checks if not c.passed]

    def failed(**change):
        return [c.name for c in fig1._match_checks(config, {**r, **change}) if not c.passed]

    gap = r["match_gla_vector_gap"].copy()
    gap[0, 1, 2] = 0.02 * 0.5  # panel c, n̄ = 4: 2 % of L*_WPGD
    f = failed(match_gla_vector_gap=gap)
    assert len(f) == 1 and "panel c, n̄ = 4" in f[0]
    gap = r["match_gla_vector_gap"].copy()
    gap[0, 2, 2] = 0.5  # panel d is not matched (MATCH_PANELS: a-c)
    assert failed(match_gla_vector_gap=gap) == []
    cos = r["match_gla_vector_cosine"].copy()
    cos[0, 0, 1] = 0.98
    f = failed(match_gla_vector_cosine=cos)
    assert len(f) == 1 and "cosine" in f[0]
    f = failed(bayes_risk=np.full_like(r["bayes_risk"], 0.6))  # the restricted model below the Bayes risk
    assert len(f) == 1 and f[0].startswith("no trained model beats the Bayes risk")
