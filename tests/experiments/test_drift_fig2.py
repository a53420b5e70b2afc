"""drift.fig2 on a tiny setting (run → checks → plot structure); its checks fed known answers."""

from __future__ import annotations

import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments import get_experiment
from iclab.progress import Reporter

# The tiny run still compiles the depth-2 training loop and the gradient flow (~90 s on 2 cores):
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
