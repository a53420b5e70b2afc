"""drift.baselines on a tiny setting (run → checks → plot structure); its checks fed known answers."""

from __future__ import annotations

import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.experiments import get_experiment
from iclab.experiments.drift import baselines
from iclab.progress import Reporter

TINY = dict(d=3, n=8, gammas=[0.9, 0.95], trials=20, chunk=20, length=60, window=10, steps=4, batch=8, n_eval=100)


@pytest.fixture(scope="module")
def tiny():
    exp = get_experiment("drift.baselines")
    config = exp.resolve("quick", TINY)
    return exp, config, exp.run(config, Reporter())


def test_tiny_run_shapes_checks_and_plot(tiny):
    exp, config, r = tiny
    assert r["gla_err"].shape == (1, 2) and np.all(r["gla_err_se"] == 0)
    assert r["lms"].shape == (2,) and np.all(r["lms_se"] > 0) and np.all(r["rls"] > 0)
    assert np.isnan(r["paper_lms"]).tolist() == [True, False]  # γ = 0.9 is not in the paper's table, 0.95 is
    names = [c.name for c in exp.checks(config, r)]
    assert len(names) == 4 and not any("paper's reported" in n for n in names)  # d = 3: no paper comparison
    assert r["saddle_star"].shape == (2, 3) and r["rank_one_share"].shape == (1, 2)
    assert len(exp.plot(config, r).axes) == 2


def test_checks_pass_at_theory_and_fail_when_a_filter_wins(tiny):
    exp, config, r = tiny
    perfect = dict(r, gla_err=r["err_star"][None].copy(), lms=10 * r["err_star"], rls=10 * r["err_star"])
    assert all(c.passed for c in exp.checks(config, perfect))
    beaten = dict(perfect, rls=np.array([10.0, 0.9]) * r["err_star"])
    failed = [c.name for c in exp.checks(config, beaten) if not c.passed]
    assert len(failed) == 2 and all("below" in n for n in failed)


def test_window_must_fit_in_the_sequence():
    with pytest.raises(ValueError, match="window"):
        baselines.BaselinesConfig(**{**TINY, "window": 100, "length": 50})


@pytest.mark.parametrize("normals", ["ziggurat", "box_muller"])
def test_filters_on_native_sequences_match_xla_within_standard_errors(normals):
    """The filtered sequences from the compiled sampler (another generator, the same process; either of its
    normals): the LMS and RLS errors agree with those on XLA's sequences at 4 standard errors of their difference
    (independent draws)."""
    import jax

    config = baselines.BaselinesConfig(**{**TINY, "trials": 1500, "chunk": 750, "length": 120, "window": 40})
    key = jax.random.PRNGKey(7)
    out = {s: baselines._filter_errors(config, key, kernel="xla", sampler=s, normals=normals) for s in ("xla", "native")}
    for name in ("lms", "rls"):
        a, b = out["xla"], out["native"]
        assert a[name].shape == (2,)
        assert np.all(np.abs(a[name] - b[name]) < 4 * np.hypot(a[f"{name}_se"], b[f"{name}_se"])), name
        assert np.all(a[name] != b[name])  # other generators: other numbers


@pytest.mark.parametrize("sampler", ["xla", "native"])
def test_native_filters_equal_xla_filters_on_the_same_sequences(sampler):
    """The native kernel runs LMS/RLS by the compiled kernel, xla by theory.drift's scans: the same errors and standard
    errors to float rounding, on the same sequences; each γ's errors are those of that γ drawn alone (common random
    numbers across γ)."""
    import jax

    config = baselines.BaselinesConfig(**{**TINY, "trials": 45, "chunk": 20})
    key = jax.random.PRNGKey(3)
    out = {k: baselines._filter_errors(config, key, kernel=k, sampler=sampler) for k in ("xla", "native")}
    for name in ("lms", "lms_se", "rls", "rls_se"):
        np.testing.assert_allclose(out["native"][name], out["xla"][name], rtol=1e-9, err_msg=name)
    alone = baselines._filter_errors(config.model_copy(update={"gammas": [0.95]}), key, kernel="xla", sampler=sampler)
    np.testing.assert_allclose(alone["rls"], out["xla"]["rls"][1:], rtol=1e-12)
