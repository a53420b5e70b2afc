"""drift.bayes (beyond the paper) on a tiny setting: run → checks → plot, checks that fail on wrong answers, the
LMS step search, config validation, and `iclab show` saying that the result goes beyond the paper."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import iclab  # noqa: F401  (float64)
from iclab import baselines as bl
from iclab.experiments import get_experiment
from iclab.experiments.drift import bayes
from iclab.progress import Reporter

TINY = dict(d=3, n=8, gammas=[0.6, 0.95], prompts=600, tune_prompts=300, chunk=300,
            rls_betas=[0.7, 0.9, 1.0])


# The tiny run compiles the whole evaluation twice (tuning and evaluation passes), so slow.
@pytest.fixture(scope="module")
def tiny():
    exp = get_experiment("drift.bayes")
    config = exp.resolve("quick", TINY)
    return exp, config, exp.run(config, Reporter())


@pytest.mark.slow
def test_tiny_run_shapes_checks_and_plot(tiny):
    exp, config, r = tiny
    for k in ("gla", "gla_mc", "kalman", "kalman_mc", "lms", "lms_mc", "rls_mc", "ratio_gla", "lam_star", "rls_beta"):
        assert r[k].shape == (2,), k
    assert r["rls_tune"].shape == (2, 3) and set(r["rls_beta"]) <= {0.7, 0.9, 1.0}
    checks = exp.checks(config, r)
    assert len(checks) == 5 and all(c.passed for c in checks), [(c.name, c.measured) for c in checks]
    # Bayes is optimal: the ratios to it are ≥ 1 up to its Monte-Carlo error, and it lies within its a-priori bounds
    assert np.all(r["ratio_gla"] > 1 - 4 * r["kalman_se"] / r["kalman"])
    assert np.all(r["kalman"] <= r["v_trace"]) and np.all(r["kalman"] >= config.sigma_e2 * config.d)
    assert len(exp.plot(config, r).axes) == 4  # three panels and the twin axis of μ*


@pytest.mark.slow
def test_closed_forms_are_the_theory_functions(tiny):
    _, config, r = tiny
    from iclab.theory import drift as theory

    for i, g in enumerate(config.gammas):
        lam, err = theory.optimal_forget_factor(**config.setting(g))
        assert r["lam_star"][i] == pytest.approx(lam) and r["gla"][i] == pytest.approx(err)
        assert r["lms"][i] == pytest.approx(bl.lms_risk(r["lms_mu"][i], **config.setting(g)), rel=1e-12)


def _arrays():
    """Arrays of a run at two γ as run_bayes stores them (values of the d = 10 quick run, rounded)."""
    se = np.array([0.006, 0.017])
    return {
        "gammas": np.array([0.8, 0.95]),
        "gla": np.array([0.2454, 0.6741]), "gla_mc": np.array([0.2430, 0.6618]), "gla_mc_se": se,
        "lms": np.array([0.2761, 0.7579]), "lms_mc": np.array([0.2717, 0.7706]), "lms_mc_se": se,
        "kalman": np.array([0.2341, 0.4867]), "kalman_se": np.array([4e-5, 2e-4]),
        "kalman_paired_z": np.array([-0.16, 0.66]),
        "gla_excess_z": np.array([1.5, 10.2]), "lms_excess_z": np.array([5.5, 13.8]), "rls_excess_z": np.array([9.3, 11.0]),
        "ratio_gla": np.array([1.048, 1.385]),
    }


def test_checks_pass_on_a_run_and_fail_on_wrong_answers():
    config = bayes.BayesConfig(gammas=[0.8, 0.95])
    r = _arrays()

    def failed(**changes):
        return [c.name for c in bayes.checks_bayes(config, dict(r, **changes)) if not c.passed]

    assert len(bayes.checks_bayes(config, r)) == 5 and failed() == []
    # a closed form off by 6 standard errors of its simulation
    assert any(n.startswith("GLA(λ*) eq-15 predictor, simulated = Theorem 2")
               for n in failed(gla=r["gla_mc"] + 6 * r["gla_mc_se"]))
    assert any(n.startswith("LMS(μ*), simulated") for n in failed(lms=r["lms_mc"] - 6 * r["lms_mc_se"]))
    assert any(n.startswith("Kalman filter's squared error") for n in failed(kalman_paired_z=np.array([0.0, 5.0])))
    # a "Bayes" risk above GLA(λ*) by 4 of its standard errors
    kal = r["kalman"].copy()
    kal[1] = r["gla"][1] + 4 * r["kalman_se"][1]
    assert any(n.startswith("Bayes ≤ GLA(λ*) (Theorem 2)") for n in failed(kalman=kal))
    assert any(n.startswith("Bayes ≤ simulated") for n in failed(rls_excess_z=np.array([1.0, -3.5])))


def test_lms_step_is_the_minimum_of_the_exact_risk():
    config = bayes.BayesConfig(**{**TINY, "lms_mu_bounds": [1e-3, 0.5]})
    for g in (0.6, 0.95):
        mu, risk = bayes.best_lms_step(config, g)
        assert 1e-3 <= mu <= 0.5
        s = config.setting(g)
        assert risk == pytest.approx(bl.lms_risk(mu, **s), rel=1e-12)
        for other in np.geomspace(1e-3, 0.5, 50):
            assert risk <= bl.lms_risk(float(other), **s) + 1e-12


@pytest.mark.parametrize("bad", [{"gammas": [0.5, 1.2]}, {"gammas": []}, {"rls_betas": [0.0]},
                                 {"lms_mu_bounds": [0.1, 0.01]}, {"lms_mu_bounds": [0.1]}, {"prompts": 1}])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValidationError):
        bayes.BayesConfig(**bad)


def test_show_says_it_goes_beyond_the_paper():
    from iclab.cli import app

    res = CliRunner().invoke(app, ["show", "drift.bayes"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "goes beyond the paper" in " ".join(res.output.split())


@pytest.mark.slow
def test_quick_preset_passes_at_seed_1(tmp_path):
    from iclab.launch import run_experiment

    result = run_experiment("drift.bayes", "quick", {"seed": 1}, root=tmp_path)
    assert all(c["passed"] for c in result.checks), [c for c in result.checks if not c["passed"]]
