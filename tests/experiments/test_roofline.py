"""The benches' roofline pieces: XLA's flop count of a compiled function and the matmul peak."""

import jax.numpy as jnp
import pytest

from iclab.experiments._roofline import compiled_flops, matmul_peak_gflops


def test_compiled_flops_counts_a_product_as_2mnk():
    a, b = jnp.ones((24, 40), jnp.float32), jnp.ones((40, 56), jnp.float32)
    assert compiled_flops(lambda x, y: x @ y, a, b) == 2 * 24 * 40 * 56


def test_matmul_peak_is_a_positive_rate():
    assert 0.01 < matmul_peak_gflops(128, seconds=0.05) < 1e5  # GFLOP/s: from a slow CPU to a GPU


def test_drift_floor_counts_each_model_by_its_layers():
    from iclab.experiments.drift._bench import floor_flops_per_prompt

    T, D = 101, 11
    readout = 4 * T * D + 4 * D * D
    assert floor_flops_per_prompt(T, D, [1]) == 2 * readout  # the tokens need no gradient
    assert floor_flops_per_prompt(T, D, [2]) == 24 * T * D * D + 3 * readout
    assert floor_flops_per_prompt(T, D, [3]) == 24 * T * D * D + 30 * T * D * D + 3 * readout
    assert floor_flops_per_prompt(T, D, [1, 2, 3]) == sum(floor_flops_per_prompt(T, D, [L]) for L in (1, 2, 3))


@pytest.mark.slow
def test_drift_bench_floor_is_below_what_xla_executes_and_forms_agree():
    """The floor is a lower bound of the work of the experiments' own loss (XLA's count of the compiled loss and
    gradient is at least the floor, in every form); the forms of fig2's full layers are one model."""
    from iclab.experiments.drift._bench import bench_drift

    r = bench_drift(steps=1, batch=16)
    assert (r["fig1"]["models"], r["fig1"]["full_layers"]) == (90, 0)
    assert (r["fig2"]["models"], r["fig2"]["full_layers"]) == (16, 15)
    for name in ("fig1", "fig2"):
        entry = r[name]
        for form, f in entry["forms"].items():
            if f["xla_flops_loss_grad"] is not None:
                assert f["xla_flops_loss_grad"] >= entry["floor_flops_per_step"], (name, form)
            assert f["grad_max_rel_diff"] < 1e-4, (name, form)  # float32 rounding of one model in two forms
        assert entry["step_s"] > 0 and 0 < entry["fraction_of_matmul_peak_step"]
