"""drift.fig1 on a tiny setting (run → checks → plot structure) and its evaluation helpers.

The quick preset itself runs in tests/experiments/test_quick_presets.py; here the checks are fed
arrays whose answer is known (Theorem 2/3 themselves, then a 5 % error) so they are shown able to fail.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments._registry import get_experiment
from iclab.experiments.drift import _common, fig1
from iclab.progress import Reporter
from iclab.theory import drift as theory

TINY = dict(d=3, n=8, gammas=[0.9, 0.95], lams=[0.8, 0.9, 1.0], lam_bars=[0.8, 0.9, 1.0], test_ms=[4, 8],
            steps=4, batch=8, record_every=2, n_eval=100)


@pytest.fixture(scope="module")
def tiny():
    exp = get_experiment("drift.fig1")
    config = exp.resolve("quick", TINY)
    return exp, config, exp.run(config, Reporter())


def test_tiny_run_shapes_checks_and_plot(tiny):
    exp, config, r = tiny
    G, K, B, M = 2, 3, 3, 2
    assert r["trained_err"].shape == (1, G, K) and r["test_err"].shape == (1, M, B)
    assert bool(r["exact_eval"]) and np.all(r["trained_err_se"] == 0)  # restricted weights: exact evaluation
    assert r["learned_lam"].shape == (1, G) and np.all((r["learned_lam"] > 0) & (r["learned_lam"] < 1))
    np.testing.assert_allclose(r["theory_grid"][1], theory.train_error(np.array(TINY["lams"]), 0.95, 1.0, 0.01, 8,
                                                                       np.eye(3)), rtol=1e-12)
    checks = exp.checks(config, r)
    names = [c.name for c in checks]
    assert any(n.startswith("(a) trained GLA error = Theorem 2") for n in names)
    assert any(n.startswith("(b-d) trained test error = Theorem 3") for n in names)
    assert not any("table" in n for n in names)  # the spec table applies to d = 10, n = 100 only
    fig = exp.plot(config, r)
    assert len(fig.axes) == 4


def _perfect(config, r):
    """The arrays of a run whose trained models ARE the Theorem 1 optimum."""
    out = dict(r)
    out["trained_err"] = np.broadcast_to(r["theory_grid"], r["trained_err"].shape).copy()
    out["test_err"] = np.broadcast_to(r["test_theory_grid"], r["test_err"].shape).copy()
    out["learned_lam"] = r["lam_star"][None].copy()
    out["learned_lam_theory_err"] = r["err_star"][None].copy()
    return out


def test_checks_pass_on_theory_and_fail_on_a_5_percent_error(tiny):
    exp, config, r = tiny
    perfect = _perfect(config, r)
    assert all(c.passed for c in exp.checks(config, perfect)), [c.name for c in exp.checks(config, perfect) if not c.passed]
    off = dict(perfect, trained_err=perfect["trained_err"] * 1.05)  # uniform: every argmin stays where it is
    failed = [c.name for c in exp.checks(config, off) if not c.passed]
    assert len(failed) == 1 and failed[0].startswith("(a) trained GLA error = Theorem 2")
    off = dict(perfect, test_err=perfect["test_err"] * 0.95)
    failed = [c.name for c in exp.checks(config, off) if not c.passed]
    assert len(failed) == 1 and failed[0].startswith("(b-d) trained test error")


def test_model_errors_exact_and_monte_carlo_at_the_optimum():
    """At Theorem 1's weights both evaluations return the theory: exactly (restricted) and with zero
    difference to the optimum on shared prompts (merged weights, Monte Carlo path)."""
    config = fig1.Fig1Config(**TINY)
    lam, gamma = 0.9, 0.95
    D1, D2, D3, _ = theory.D_sums(lam, gamma, **config.process())
    U11, u = theory.optimal_restricted(D1, theory.Lam_tilde(config.Lam(), D2, D3))
    E = theory.train_error(lam, gamma, Lam=config.Lam(), **config.process())
    Et = theory.test_error(lam, gamma, Lam=config.Lam(), lam_bar=0.8, m=4, **config.process())
    key = _common.seed_keys(config)[0]
    exact = _common.model_errors(config, {"U11": jnp.asarray(U11)[None], "u_m1": jnp.asarray([u])}, [lam], gamma,
                                 [0.8], [Et], key, m=4)
    assert exact["err"][0] == pytest.approx(Et, rel=1e-12) and exact["err_se"][0] == 0
    W_V, W_KQ = theory.optimal_weights(D1, theory.Lam_tilde(config.Lam(), D2, D3))
    mc = _common.model_errors(config, {"WV": jnp.asarray(W_V)[None], "WKQ": jnp.asarray(W_KQ)[None]}, [lam], gamma,
                              [lam], [E], key)
    assert mc["err"][0] == pytest.approx(E, rel=1e-10) and mc["err_se"][0] < 1e-10 * E
    assert abs(mc["opt"][0] - E) < 5 * mc["opt_se"][0]  # the optimum's raw MSE on the prompts vs Theorem 2


def test_config_rejects_grids_without_linear_attention_or_shift_model():
    with pytest.raises(ValueError, match="include 1.0"):
        fig1.Fig1Config(**{**TINY, "lams": [0.8, 0.9]})
    with pytest.raises(ValueError, match="shift_gamma"):
        fig1.Fig1Config(**{**TINY, "gammas": [0.9]})
