"""gating.bayes (beyond the paper): the closed forms it compares, its checks fed right and wrong answers, config
validation, `iclab show`, and (slow) a tiny run end to end."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import iclab  # noqa: F401  (float64)
from iclab.experiments import get_experiment
from iclab.experiments.gating import bayes
from iclab.progress import Reporter
from iclab.theory import wpgd as theory

TINY = dict(d=3, panels=[[0.0, 1.0], [0.8, 0.2]], rhos=[0.0, 0.5, 1.0], n_bars=[2, 4], prompts=400, chunk=400)


def test_closed_forms_of_the_paper_setting():
    config = bayes.GatingBayesConfig()
    # n̄ = 5 < d: Bayes = d − r² n̄ (independent tasks, σ = 0); WPGD and scalar gating are eq 17 / eq 22
    cf = bayes.closed_forms(config, np.array([0.0, 1.0]), 5)
    assert cf["bayes_closed"] == pytest.approx(10 - 5)
    assert cf["wpgd"] / 10 == pytest.approx(0.6875, abs=5e-5)  # eq 17 / d at (0, 1), n̄ = 5 (reference table)
    assert cf["scalar"] == pytest.approx(cf["wpgd"], rel=1e-10)  # r₁ ≤ r₂: scalar gating reaches eq 17
    # (0.8, 0.2): scalar gating = linear attention (eq 24) > eq 17 (Thm 4, K = 2)
    cf = bayes.closed_forms(config, np.array([0.8, 0.2]), 5)
    assert cf["scalar"] == pytest.approx(cf["att"], rel=1e-10) and cf["scalar"] > cf["wpgd"] + 0.1
    assert cf["bayes_closed"] == pytest.approx(10 - 0.68 * 5)
    # n̄ ≥ d with r₁² + r₂² = 1: noiseless blocks reveal β exactly; WPGD does not
    cf = bayes.closed_forms(config, np.array([0.0, 1.0]), 20)
    assert cf["bayes_closed"] == pytest.approx(0.0, abs=1e-12) and cf["wpgd"] / 10 == pytest.approx(0.3548, abs=5e-5)
    # an unrelated query task: every predictor predicts 0
    cf = bayes.closed_forms(config, np.array([0.0, 0.0]), 5)
    assert cf["wpgd"] == cf["scalar"] == cf["bayes_closed"] == 10 and not np.any(cf["wpgd_P"])


def test_label_noise_has_no_closed_bayes_form():
    config = bayes.GatingBayesConfig(sigma2=0.5)
    cf = bayes.closed_forms(config, np.array([0.0, 1.0]), 5)
    assert np.isnan(cf["bayes_closed"]) and cf["wpgd"] == pytest.approx(
        theory.wpgd_optimal_risk(np.eye(10), *theory.two_task_correlation(5, r1=0.0, r2=1.0), 0.5))


def _arrays(config):
    """Arrays as run_gating_bayes stores them, with the simulations exactly at their closed forms."""
    rs = config.task_rs()
    N, (A, Q) = len(config.n_bars), rs.shape[:2]
    out = {k: np.zeros((N, A, Q)) for k in ("wpgd", "scalar", "bayes_closed")}
    for i, nb in enumerate(config.n_bars):
        for a in range(A):
            for q in range(Q):
                cf = bayes.closed_forms(config, rs[a, q], nb)
                for k in out:
                    out[k][i, a, q] = cf[k]
    se = np.full((N, A, Q), 0.02)
    z = np.full((N, A, Q), 0.5)
    return {**out, "bayes": out["bayes_closed"].copy(), "bayes_se": np.zeros((N, A, Q)),
            "wpgd_mc": out["wpgd"] + se, "wpgd_mc_se": se, "scalar_mc": out["scalar"] - se, "scalar_mc_se": se,
            "bayes_paired_z": z, "wpgd_excess_z": 10 * z, "scalar_excess_z": 10 * z}


def test_checks_pass_on_right_answers_and_fail_on_wrong_ones():
    config = bayes.GatingBayesConfig(**{**TINY, "d": 10, "n_bars": [5]})
    r = _arrays(config)

    def failed(**changes):
        return [c.name for c in bayes.checks_gating_bayes(config, dict(r, **changes)) if not c.passed]

    assert len(bayes.checks_gating_bayes(config, r)) == 6 and failed() == []
    assert any(n.startswith("optimal WPGD") for n in failed(wpgd_mc=r["wpgd"] + 5 * r["wpgd_mc_se"]))
    assert any(n.startswith("scalar gating optimum") for n in failed(scalar_mc=r["scalar"] - 5 * r["scalar_mc_se"]))
    bad = r["bayes_paired_z"].copy()
    bad[0, 1, 2] = -4.5
    assert any(n.startswith("Bayes posterior mean's squared error") for n in failed(bayes_paired_z=bad))
    assert any(n.startswith("mean exact conditional Bayes risk") for n in failed(bayes=r["bayes"] + 1e-6))
    # a "Bayes" closed form above the WPGD optimum
    wrong = r["bayes_closed"].copy()
    wrong[0, 0, 2] = r["wpgd"][0, 0, 2] + 1e-3
    assert any(n.startswith("Bayes ≤ optimal WPGD ≤ scalar gating") for n in failed(bayes_closed=wrong))
    bad = r["scalar_excess_z"].copy()
    bad[0, 0, 1] = -3.2
    assert any(n.startswith("Bayes ≤ simulated") for n in failed(scalar_excess_z=bad))


@pytest.mark.parametrize("bad", [{"rhos": [0.0, 1.2]}, {"rhos": []}, {"panels": [[0.8, 0.8]]}, {"panels": [[1.0]]},
                                 {"n_bars": [0]}, {"prompts": 1}])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValidationError):
        bayes.GatingBayesConfig(**bad)


def test_show_says_it_goes_beyond_the_paper():
    from iclab.cli import app

    res = CliRunner().invoke(app, ["show", "gating.bayes"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "goes beyond the paper" in " ".join(res.output.split())


# One compile per n̄ (the block sizes are static), so slow.
@pytest.mark.slow
def test_tiny_run_end_to_end():
    exp = get_experiment("gating.bayes")
    config = exp.resolve("quick", TINY)
    r = exp.run(config, Reporter())
    assert r["wpgd"].shape == (2, 2, 3) and r["ratio_wpgd"].shape == (2, 2, 3)
    checks = exp.checks(config, r)
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]
    # n̄ = 4 ≥ d = 3, panel (0, 1), ρ = 1: the Bayes risk is 0 and simulated as roundoff; no ratio there
    assert r["bayes"][1, 0, 2] == pytest.approx(0.0, abs=1e-10) and r["bayes_mc"][1, 0, 2] < 1e-18
    assert np.isnan(r["ratio_wpgd"][1, 0, 2]) and np.all(r["gap_wpgd"] >= -1e-12)
    # ρ = 0 is simulated once and shared by the panels
    assert np.all(r["wpgd_mc"][:, 0, 0] == r["wpgd_mc"][:, 1, 0])
    assert len(exp.plot(config, r).axes) == 4


@pytest.mark.slow
def test_quick_preset_passes_at_seed_1(tmp_path):
    from iclab.launch import run_experiment

    result = run_experiment("gating.bayes", "quick", {"seed": 1}, root=tmp_path)
    assert all(c["passed"] for c in result.checks), [c for c in result.checks if not c["passed"]]
