"""lab.drift_families: config validation (one line per bad field), a tiny run's shapes and its checks fed known
answers (fast), the registry of drift families (a family of one's own read through it exactly as a built-in one:
fast, and a whole run reproduced: slow), and the quick preset with its checks (slow)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

import iclab  # noqa: F401  (float64)
from iclab.errors import describe_validation_error
from iclab.experiments import get_experiment
from iclab.progress import Reporter

TINY = dict(d=2, n=5, ar1_gammas=[0.9], rotation_omegas=[0.3], trend_sigma_u2=[1e-3], hazards=[0.2],
            lams=[0.8, 1.0], batch=16, steps=3, eval_prompts=200, tune_prompts=20, chunk=100, lms_mus=[0.05, 0.1],
            rls_betas=[0.9, 1.0], record_every=1, train_transformer=True,
            transformer_batch=16)  # the quick preset leaves the transformer out


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
    ("transformer.width", 15, "multiple of transformer.heads"),
    ("transformer_batch", 2000, "at most batch"),
    ("transformer.layers", 0, "greater than or equal to 1"),
])
def test_bad_fields_are_refused_naming_the_field(field, value, words):
    exp = get_experiment("lab.drift_families")
    with pytest.raises(ValidationError) as err:
        exp.resolve("quick", {field: value})
    text = str(err.value) + "\n" + describe_validation_error(err.value, exp.config)   # pydantic's and the CLI's line
    assert words in text and (field in text or field == "d")


def test_d_may_be_odd_without_rotation():
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", {"d": 3, "families": ["ar1", "trend", "switching"]})
    assert [f for f, _ in config.settings()] == ["ar1", "ar1", "trend", "trend", "switching", "switching"]


@pytest.mark.slow  # the tiny run compiles every family's training and Bayes filter: a minute
def test_tiny_run_shapes_and_plot(tiny):
    exp, config, r = tiny
    G, K, S = 4, 2, 1
    assert r["families"].tolist() == ["ar1", "rotation", "trend", "switching"]
    assert np.allclose(r["strength"], [0.1, 0.3, 1e-3, 0.2])
    assert r["theory_grid"].shape == (G, K) and r["lam_star"].shape == (G,)
    assert r["gla_risk"].shape == (S, G, K) and r["learnt_risk"].shape == (S, G) and r["learned_lam"].shape == (S, G)
    for p in ("ew_star", "lms", "rls", "bayes", "bayes_cond"):
        assert r[f"{p}_mc"].shape == (G,) and np.all(r[f"{p}_se"] > 0)
    assert r["transformer_mc"].shape == (S, G) and np.all(r["transformer_se"] > 0)
    assert np.allclose(r["transformer_ratio_bayes"], r["transformer_mc"] / r["bayes_cond_mc"])
    # GLA grid, learnt GLA and transformer of each seed, then exponential weights, LMS and RLS
    assert r["excess_z"].shape == (G, S * K + 2 * S + 3) and r["excess_names"].size == S * K + 2 * S + 3
    assert r["excess_names"][S * K + S] == "transformer seed 0"
    # R*(λ*) is the minimum of R*(λ) over λ: never above the grid's values (closed forms, 1e-12)
    assert np.all(r["risk_star"] <= r["theory_grid"].min(-1) + 1e-12)
    # switching at h has stationary AR(1)'s autocovariance at γ = 1 − h ... here γ = 0.9 vs h = 0.2: different
    assert not np.isclose(r["risk_star"][0], r["risk_star"][3])
    assert len(exp.checks(config, r)) == 8
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


@pytest.mark.slow  # the tiny run compiles every family's training and Bayes filter: a minute
def test_checks_pass_at_theory_and_fail_when_a_predictor_beats_bayes(tiny):
    exp, config, r = tiny
    perfect = dict(r, gla_risk=np.broadcast_to(r["theory_grid"], r["gla_risk"].shape).copy(),
                   learnt_risk=np.broadcast_to(r["risk_star"], r["learnt_risk"].shape).copy(),
                   learned_lam_theory=np.broadcast_to(r["risk_star"], r["learnt_risk"].shape).copy(),
                   transformer_mc=np.broadcast_to(r["prior_risk"], r["transformer_mc"].shape).copy(),
                   gla_ref=np.broadcast_to(r["theory_grid"], r["gla_ref"].shape).copy(),
                   ew_star_mc=r["risk_star"].copy(), bayes_paired_z=np.zeros_like(r["bayes_paired_z"]),
                   excess_z=np.abs(r["excess_z"]) + 5, bayes_cond_mc=0.5 * r["risk_star"])
    assert all(c.passed for c in exp.checks(config, perfect))
    off = dict(perfect, gla_risk=perfect["gla_risk"] * 1.05)
    assert [c.passed for c in exp.checks(config, off)].count(False) == 1
    beaten = dict(perfect, excess_z=perfect["excess_z"] - np.abs(perfect["excess_z"]).max() - 4)
    failed = [c.name for c in exp.checks(config, beaten) if not c.passed]
    assert len(failed) == 1 and "beats Bayes" in failed[0]
    # the transformer 4 SE above ŷ = 0's closed-form risk: its check alone fails
    worse = dict(perfect, transformer_mc=perfect["transformer_mc"] + 4 * r["transformer_se"])
    failed = [c.name for c in exp.checks(config, worse) if not c.passed]
    assert len(failed) == 1 and "ignoring the context" in failed[0]
    # a learnt λ leaving 10 % of its initial excess, its model exact at that λ: the λ check alone fails
    theory = r["risk_star"] + 0.1 * (r["learnt_init_theory"] - r["risk_star"])
    stuck = dict(perfect, learned_lam_theory=theory[None].copy(), learnt_risk=theory[None].copy())
    failed = [c.name for c in exp.checks(config, stuck) if not c.passed]
    assert len(failed) == 1 and "removes its initial excess" in failed[0]
    # ... and its model 5 % above the closed form at its learnt λ: the risk check alone fails
    off_l = dict(perfect, learnt_risk=perfect["learnt_risk"] * 1.05)
    failed = [c.name for c in exp.checks(config, off_l) if not c.passed]
    assert len(failed) == 1 and "within 3 % of R*(λ_learnt)" in failed[0]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_quick_preset_passes_its_checks(seed):
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", {"seed": seed})
    r = exp.run(config, Reporter())
    failed = [c.name for c in exp.checks(config, r) if not c.passed]
    assert not failed, failed


# --------------------------------------------------------------------------------------------
# The registry of drift families: a family of one's own (docs/tutorials/nonstationary.py uses it)


@pytest.fixture
def registry():
    """The registry's public functions; every family registered by a test is removed after it."""
    from iclab.experiments.lab import drift_families as df

    before = set(df.drift_families())
    yield df
    for name in set(df.drift_families()) - before:
        df.unregister_drift_family(name)


def _ar1_copy(df, name="my_ar1"):
    """AR(1) as a user would register it: its state space under a name of its own."""
    from iclab.tasks.state_space import ar1_process

    return df.register_drift_family(df.DriftFamily(
        name, "1 − γ", domain=(0.0, 1.0), strength=lambda v: 1.0 - v,
        process=lambda c, v: ar1_process(c.d, gamma=v, sigma_w2=c.sigma_w2, sigma_e2=(1 - v ** 2) * c.sigma_w2)))


def test_a_registered_state_space_family_gets_ar1s_sampler_closed_form_and_kalman_filter(registry):
    """Registered under another name, AR(1)'s state space must give the built-in row exactly: the same prompts
    from the same key, the same autocovariance (so the same R*(λ)) and the same Bayes predictions."""
    import jax
    import jax.numpy as jnp

    df = registry
    _ar1_copy(df)
    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick", {"d": 2, "n": 6, "families": ["ar1", "my_ar1"], "ar1_gammas": [0.8],
                                   "strengths": {"my_ar1": [0.8]}})
    assert config.settings() == [("ar1", 0.8), ("my_ar1", 0.8)]
    assert df.strength("my_ar1", 0.8) == df.strength("ar1", 0.8) == pytest.approx(0.2)
    assert np.array_equal(df.autocovariance(config, "ar1", 0.8), df.autocovariance(config, "my_ar1", 0.8))
    key = jax.random.PRNGKey(3)
    a, b = (df.sample_row(config, f, 0.8, key, 50, jnp.float64) for f in ("ar1", "my_ar1"))
    assert np.array_equal(np.asarray(a.y), np.asarray(b.y)) and np.array_equal(np.asarray(a.w), np.asarray(b.w))
    for got, want in zip(df._bayes(config, "my_ar1", 0.8, b), df._bayes(config, "ar1", 0.8, a)):
        assert np.array_equal(np.asarray(got), np.asarray(want))


def _switching_copy(df):
    """The switching family's sampler, autocovariance and Bayes predictor, registered under another name."""
    from iclab.tasks.switching import switching_autocovariance

    builtin = df.get_drift_family("switching")
    return df.register_drift_family(df.DriftFamily(
        "my_switching", "hazard h", domain=(0.0, 1.0), sample=builtin.sample, bayes=builtin.bayes,
        autocovariance=lambda c, v: switching_autocovariance(hazard=v, n=c.n, prior_cov=c.sigma_w2)))


def test_a_family_without_a_state_space_is_read_through_its_own_callables(registry):
    import jax
    import jax.numpy as jnp

    df = registry
    _switching_copy(df)
    config = get_experiment("lab.drift_families").resolve("quick", {"d": 2, "n": 6, "families": ["my_switching"],
                                                                    "strengths": {"my_switching": [0.3]}})
    assert config.settings() == [("my_switching", 0.3)] and df.strength("my_switching", 0.3) == 0.3
    assert np.array_equal(df.autocovariance(config, "my_switching", 0.3), df.autocovariance(config, "switching", 0.3))
    key = jax.random.PRNGKey(4)
    a, b = (df.sample_row(config, f, 0.3, key, 50, jnp.float64) for f in ("switching", "my_switching"))
    assert np.array_equal(np.asarray(a.y), np.asarray(b.y))
    for got, want in zip(df._bayes(config, "my_switching", 0.3, b), df._bayes(config, "switching", 0.3, a)):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="not a state-space family"):
        df.state_space(config, "my_switching", 0.3)


@pytest.mark.slow
def test_a_family_of_ones_own_without_a_state_space_runs_like_the_built_in_one(registry, tiny):
    """The switching family's sampler, autocovariance and Bayes predictor registered under another name, in the
    same row of the same config: the run must reproduce the built-in run's arrays exactly (the registry adds no
    randomness and no path of its own)."""
    _switching_copy(registry)
    exp, config, r = tiny
    mine = exp.resolve("quick", {**TINY, "families": ["ar1", "rotation", "trend", "my_switching"],
                                 "strengths": {"my_switching": TINY["hazards"]}})
    got = exp.run(mine, Reporter())
    assert got["families"].tolist() == ["ar1", "rotation", "trend", "my_switching"]
    assert set(got) == set(r)
    for k in r:
        if k != "families":
            assert np.array_equal(got[k], r[k]), k
    assert [c.passed for c in exp.checks(mine, got)] == [c.passed for c in exp.checks(config, r)]
    assert len(exp.plot(mine, got).axes) == 4


@pytest.mark.parametrize("over, words", [
    ({"families": ["my_ar1"]}, "strengths: give the values of my_ar1"),
    ({"families": ["my_ar1"], "strengths": {"my_ar1": [1.5]}}, "strengths[my_ar1] must hold 1 to 8 values in [0, 1]"),
    ({"families": ["my_ar1"], "strengths": {"my_ar1": []}}, "strengths[my_ar1]"),
    ({"strengths": {"ar1": [0.9]}}, "strengths: 'ar1' is not a registered family of one's own"),
    ({"families": ["brownian"]}, "families: brownian not registered"),
])
def test_bad_strengths_are_refused_in_one_line(registry, over, words):
    _ar1_copy(registry)
    with pytest.raises(ValidationError) as err:
        get_experiment("lab.drift_families").resolve("quick", over)
    assert words in str(err.value)


def test_registry_refuses_clashes_and_keeps_the_built_in_families(registry):
    df = registry
    mine = _ar1_copy(df)
    assert df.get_drift_family("my_ar1") is mine
    with pytest.raises(ValueError, match="registered already"):
        _ar1_copy(df)
    assert df.register_drift_family(mine) is mine  # the same object again is no clash
    with pytest.raises(ValueError, match="built in"):
        df.register_drift_family(df.DriftFamily("ar1", "x", process=mine.process), replace=True)
    with pytest.raises(ValueError, match="either process"):
        df.DriftFamily("both", "x", process=mine.process, sample=lambda *a: None)
    with pytest.raises(ValueError, match="needs autocovariance, sample and bayes"):
        df.DriftFamily("half", "x", sample=lambda *a: None)
    df.unregister_drift_family("ar1")  # a built-in family stays
    df.unregister_drift_family("my_ar1")
    assert list(df.drift_families()) == ["ar1", "rotation", "trend", "switching"]
    with pytest.raises(KeyError, match="registered: ar1, rotation, trend, switching"):
        df.get_drift_family("my_ar1")
