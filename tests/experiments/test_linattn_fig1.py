"""linattn Fig 1: the runs its config specifies (the engine itself is tested in tests/engines/test_linreg.py)."""

import pytest

from iclab.experiments.linattn import fig1, fig9


def test_fig1_trains_both_models_by_both_engines_with_gd_or_gradient_flow():
    config = fig1.Fig1Config(P=300, steps=100, record_every=10)
    pop, samp = config.training("mlp", "population"), config.training("mlp", "sampled")
    assert (pop.engine, pop.integrator, pop.P, pop.H, pop.lr) == ("population", "gd", None, 8, 0.031)
    assert (samp.engine, samp.integrator, samp.P, samp.steps, samp.record_every) == ("sampled", "gd", 300, 100, 10)
    flow = fig1.Fig1Config(population_method="gf").training("attn_m", "population")
    assert flow.integrator == "gf" and flow.steps * flow.lr == pytest.approx(6000 * 0.031)
    assert fig1.Fig1Config(population_method="gf").training("attn_m", "sampled").integrator == "gd"


def test_fig9_halves_the_learning_rate_over_the_same_time():
    config = fig9.Fig9Config(steps=100, record_every=10)
    full, half = config.training("attn_m", "population"), config.training("attn_m", "population", lr_factor=2)
    assert half.lr * half.steps == pytest.approx(full.lr * full.steps) and half.record_every == half.steps == 200
    assert full.record_params and config.training("mlp", "sampled").P == 5000
