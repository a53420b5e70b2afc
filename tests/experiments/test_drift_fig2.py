"""drift.fig2 on a tiny setting (run → checks → plot structure); its checks fed known answers."""

from __future__ import annotations

import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments import get_experiment
from iclab.progress import Reporter

# The tiny run still compiles the depth-2 training loop and the gradient flow (over a minute):
# it runs under `make test-slow`; the quick preset of drift.fig2 exercises the same path.
pytestmark = pytest.mark.slow

TINY = dict(d=3, n=8, depths=[1, 2], lams=[0.85, 0.9], test_m=4, steps=4, batch=8, record_every=2, n_eval=100,
            n_record=20, pl_records=41, pl_t_max=200.0)


@pytest.fixture(scope="module")
def tiny():
    exp = get_experiment("drift.fig2")
    config = exp.resolve("quick", TINY)
    return exp, config, exp.run(config, Reporter())


def test_tiny_run_shapes_checks_and_plot(tiny):
    exp, config, r = tiny
    assert r["train_err"].shape == (1, 2, 2) and r["test_err"].shape == (1, 2, 2)
    assert np.all(r["train_err_se"][:, 0] == 0)  # one restricted layer: exact
    assert np.all(r["train_err_se"][:, 1] > 0)  # two layers: Monte Carlo
    assert r["rec_mse"].shape[:2] == (1, 2) and r["rec_exact_excess_star"].shape == (1, r["rec_step"].size)
    names = [c.name for c in exp.checks(config, r)]
    assert any("deeper no worse" in n for n in names) and any("Lemma 5" in n for n in names)
    assert len(exp.plot(config, r).axes) == 6


def test_depth_checks_fail_on_a_5_percent_excess(tiny):
    exp, config, r = tiny
    perfect = dict(r)
    for name in ("train", "test"):
        perfect[f"{name}_err"] = np.broadcast_to(r[f"theory_{name}"], r[f"{name}_err"].shape).copy()
    perfect["star_err"] = np.array([float(r["err_star"])])
    depth = [c for c in exp.checks(config, perfect) if "deeper" in c.name or c.name.startswith(("(a)", "(c)"))]
    assert len(depth) == 4 and all(c.passed for c in depth)
    worse = dict(perfect, test_err=perfect["test_err"] * np.array([1.0, 1.05])[None, :, None])
    failed = [c.name for c in exp.checks(config, worse) if not c.passed and "deeper" in c.name]
    assert len(failed) == 1 and failed[0].startswith("(b) test")


def test_gradient_flow_reaches_eq46(tiny):
    """The population flow from Assumption 1 ends at u₋₁U₁₁ = D1 Λ̃⁻¹ with u₋₁² = ‖U₁₁‖_F² conserved."""
    _, _, r = tiny
    tgt = r["gf_target_product"]
    assert np.max(np.abs(r["gf_final_product"] - tgt)) < 1e-6 * np.max(np.abs(tgt))
    assert np.max(np.abs(r["gf_balance"])) < 1e-8


def test_deep_model_evidence_names_exploding_spiking_unfinished_and_heavy_tailed_models():
    from iclab.experiments.drift import fig2

    R, K = 20, 2
    flat = np.linspace(1.0, 0.7, R)
    flat[R // 2:] = 0.7  # converged: flat over the second half
    rec = np.broadcast_to(flat[None, None, :, None], (1, 2, R, K))  # (S = 1, depths 1-2, R, K)
    r = {"depths": np.array([1, 2]), "lams": np.array([0.9, 1.0]), "rec_step": np.arange(R) * 10.0,
         "theory_train": np.array([0.7, 0.9]), "rec_mse": rec.copy(), "test_err": np.full((1, 2, K), 0.7),
         "test_err_se": np.full((1, 2, K), 0.01)}
    assert fig2._deep_model_evidence(r, "test", [1]) == ""  # converged, light-tailed: nothing to name
    r["rec_mse"][0, 1, 0, 1] = 1e5  # L = 2, λ = 1 starts exploding
    r["rec_mse"][0, 1, 7, 0] = 1e9  # L = 2, λ = 0.9 spikes at step 70 ...
    r["rec_mse"][0, 1, -3:, 0] = 0.6  # ... and is still descending at the end
    r["test_err_se"][0, 1, 1] = 0.5  # a heavy-tailed estimate
    text = fig2._deep_model_evidence(r, "test", [1])
    assert "exploding at init: L = 2, λ = 1 (first record 1e+05)" in text
    assert "spiked: L = 2, λ = 0.9 (1e+09 at step 70" in text
    assert "still descending: L = 2, λ = 0.9" in text and "λ = 1 (−" not in text
    assert "heavy-tailed test estimate: L = 2, λ = 1 (0.7 ± 0.5)" in text


def test_one_layer_evidence_tells_saddle_models_from_others():
    """A 1-layer model off Theorem 2 is named on the rank-one saddle when its error is within 3 SE of the saddle's
    level (theory.drift.rank_one_saddle_errors), and named apart otherwise; models within tolerance are not named."""
    from iclab.experiments.drift import fig2
    from iclab.theory import drift as theory

    config = get_experiment("drift.fig2").resolve("quick")
    lams = np.array([0.8, 0.9, 1.0])
    thm = np.array([theory.train_error(float(lam), **config.setting(config.gamma)) for lam in lams])
    saddle = theory.rank_one_saddle_errors(0.8, **config.setting(config.gamma))[0]
    err = np.array([saddle + 0.001, thm[1] * 1.01, thm[2] * 1.5])[None, None]  # (S, depths = 1, K)
    r = {"lams": lams, "theory_train": thm, "train_err": err, "train_err_se": np.full(err.shape, 0.005)}
    text = fig2._one_layer_evidence(config, r, 0)
    assert f"saddle (error within 3 SE of its level; see drift.fig1): λ = 0.8 (" in text
    assert "Not at a saddle level: λ = 1 (" in text and "λ = 0.9" not in text
    r["train_err"] = np.broadcast_to(thm, err.shape)
    assert fig2._one_layer_evidence(config, r, 0) == ""
