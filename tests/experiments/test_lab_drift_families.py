"""lab.drift_families: config validation (one line per bad field), a tiny run's shapes and its checks fed known
answers (fast), and the quick preset with its checks (slow)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

import iclab  # noqa: F401  (float64)
from iclab.experiments import get_experiment
from iclab.progress import Reporter

TINY = dict(d=2, n=5, ar1_gammas=[0.9], rotation_omegas=[0.3], trend_sigma_u2=[1e-3], hazards=[0.2],
            lams=[0.8, 1.0], batch=16, steps=3, eval_prompts=200, tune_prompts=20, chunk=100, lms_mus=[0.05, 0.1],
            rls_betas=[0.9, 1.0], record_every=1)


@pytest.fixture(scope="module")
def tiny():
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", TINY)
    return exp, config, exp.run(config, Reporter())


@pytest.mark.parametrize("field, value, words", [
    ("ar1_gammas", [0.9, 1.2], "(0, 1]"),
    ("hazards", [-0.1], "[0, 1]"),
    ("rotation_omegas", [0.0], "(0, 10]"),
    ("families", ["ar1", "ar1"], "repeat"),
    ("families", ["brownian"], "families"),
    ("sigma2", 0.0, "greater than 0"),
    ("d", 3, "even"),
    ("lams", [], "at least 1"),
])
def test_bad_fields_are_refused_naming_the_field(field, value, words):
    exp = get_experiment("lab.drift_families")
    with pytest.raises(ValidationError) as err:
        exp.resolve("quick", {field: value})
    text = str(err.value)
    assert words in text and (field in text or field == "d")


def test_d_may_be_odd_without_rotation():
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", {"d": 3, "families": ["ar1", "trend", "switching"]})
    assert [f for f, _ in config.settings()] == ["ar1", "ar1", "trend", "trend", "switching", "switching"]


def test_tiny_run_shapes_and_plot(tiny):
    exp, config, r = tiny
    G, K, S = 4, 2, 1
    assert r["families"].tolist() == ["ar1", "rotation", "trend", "switching"]
    assert np.allclose(r["strength"], [0.1, 0.3, 1e-3, 0.2])
    assert r["theory_grid"].shape == (G, K) and r["lam_star"].shape == (G,)
    assert r["gla_risk"].shape == (S, G, K) and r["learnt_risk"].shape == (S, G) and r["learned_lam"].shape == (S, G)
    for p in ("ew_star", "lms", "rls", "bayes", "bayes_cond"):
        assert r[f"{p}_mc"].shape == (G,) and np.all(r[f"{p}_se"] > 0)
    assert r["excess_z"].shape == (G, S * K + S + 3) and r["excess_names"].size == S * K + S + 3
    # R*(λ*) is the minimum of R*(λ) over λ: never above the grid's values (closed forms, 1e-12)
    assert np.all(r["risk_star"] <= r["theory_grid"].min(-1) + 1e-12)
    # switching at h has stationary AR(1)'s autocovariance at γ = 1 − h ... here γ = 0.9 vs h = 0.2: different
    assert not np.isclose(r["risk_star"][0], r["risk_star"][3])
    assert len(exp.checks(config, r)) == 6
    assert len(exp.plot(config, r).axes) == G


def test_switching_and_ar1_share_the_closed_form_at_gamma_one_minus_h():
    """The two families have the same autocovariance (1 − h)^|i−j| σ_w² at γ = 1 − h, so the same R*(λ)
    (tasks.switching's docstring); the run's closed forms must agree to rounding."""
    from iclab.experiments.lab import drift_families as df
    from iclab.theory.nonstationary import exponential_weights_risk

    config = get_experiment("lab.drift_families").resolve("quick", {"d": 2, "n": 6})
    lams = np.array([0.5, 0.8, 1.0])
    risks = [exponential_weights_risk(lams, C=df.autocovariance(config, f, v), Lam=config.Lam(), sigma2=config.sigma2)
             for f, v in (("ar1", 0.85), ("switching", 0.15))]
    assert np.allclose(risks[0], risks[1], rtol=1e-12, atol=0)


def test_checks_pass_at_theory_and_fail_when_a_predictor_beats_bayes(tiny):
    exp, config, r = tiny
    perfect = dict(r, gla_risk=np.broadcast_to(r["theory_grid"], r["gla_risk"].shape).copy(),
                   learnt_risk=np.broadcast_to(r["risk_star"], r["learnt_risk"].shape).copy(),
                   gla_ref=np.broadcast_to(r["theory_grid"], r["gla_ref"].shape).copy(),
                   ew_star_mc=r["risk_star"].copy(), bayes_paired_z=np.zeros_like(r["bayes_paired_z"]),
                   excess_z=np.abs(r["excess_z"]) + 5, bayes_cond_mc=0.5 * r["risk_star"])
    assert all(c.passed for c in exp.checks(config, perfect))
    off = dict(perfect, gla_risk=perfect["gla_risk"] * 1.05)
    assert [c.passed for c in exp.checks(config, off)].count(False) == 1
    beaten = dict(perfect, excess_z=perfect["excess_z"] - np.abs(perfect["excess_z"]).max() - 4)
    failed = [c.name for c in exp.checks(config, beaten) if not c.passed]
    assert len(failed) == 1 and "beats Bayes" in failed[0]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_quick_preset_passes_its_checks(seed):
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", {"seed": seed})
    r = exp.run(config, Reporter())
    failed = [c.name for c in exp.checks(config, r) if not c.passed]
    assert not failed, failed
