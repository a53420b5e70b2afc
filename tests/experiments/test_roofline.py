"""The benches' roofline pieces: XLA's flop count of a compiled function and the matmul peak."""

import jax.numpy as jnp
import numpy as np
import pytest

from iclab.benches._roofline import compiled_flops, matmul_peak_gflops, step_beside_peaks


def test_compiled_flops_counts_a_product_as_2mnk():
    a, b = jnp.ones((24, 40), jnp.float32), jnp.ones((40, 56), jnp.float32)
    assert compiled_flops(lambda x, y: x @ y, a, b) == 2 * 24 * 40 * 56


def test_matmul_peak_is_a_positive_rate():
    assert 0.01 < matmul_peak_gflops(128, seconds=0.05) < 1e5  # GFLOP/s: from a slow CPU to a GPU


def test_step_beside_peaks_pairs_each_round_with_the_faster_peak_beside_it():
    """Rounds of known seconds between known peaks (a fake clock): each round's fraction uses the faster of the
    peaks on either side of it, and the step reported is the median round, not the first or the mean."""
    now, loops = [0.0], iter([0.6, 0.3, 0.9, 0.3, 0.3])  # seconds of each call of `run`
    peaks = iter([100.0, 50.0, 200.0, 100.0, 100.0, 25.0])

    def run():
        now[0] += next(loops)

    floor = 6e9  # flops per step; 3 steps a call: steps of 0.2, 0.1, 0.3, 0.1, 0.1 s
    r = step_beside_peaks(run, steps=3, floor_flops=floor, rounds=5, peak=lambda: next(peaks), clock=lambda: now[0])
    assert r["step_rounds_s"] == pytest.approx([0.2, 0.1, 0.3, 0.1, 0.1])
    assert r["matmul_peak_gflops_at_step"] == [100.0, 50.0, 200.0, 100.0, 100.0, 25.0]
    # GFLOP/s 30, 60, 20, 60, 60 against peaks max(100, 50), max(50, 200), 200, 100, 100
    assert r["fraction_of_matmul_peak_step_rounds"] == pytest.approx([0.3, 0.3, 0.1, 0.6, 0.6])
    assert r["fraction_of_matmul_peak_step"] == pytest.approx(0.3) and r["floor_ratio_step"] == pytest.approx(1 / 0.3)
    assert r["step_s"] == pytest.approx(0.1) and r["achieved_gflops_step"] == pytest.approx(60.0)
    with pytest.raises(ValueError, match="rounds"):
        step_beside_peaks(run, steps=3, floor_flops=floor, rounds=0, peak=lambda: 1.0)


def test_drift_floor_counts_each_model_by_its_layers():
    from iclab.benches.drift import floor_flops_per_prompt

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
    from iclab.benches.drift import bench_drift

    r = bench_drift(steps=1, batch=16, rounds=2)
    assert (r["fig1"]["models"], r["fig1"]["full_layers"]) == (90, 0)
    assert (r["fig2"]["models"], r["fig2"]["full_layers"]) == (16, 15)
    assert {"xla", "native", "native_shared", "native_shared_twin"} <= set(r["fig1"]["forms"])  # fused and its twin
    assert len(r["matmul_peak_gflops_f32_before_after"]) == 2  # measured before and after; the larger divides
    assert r["matmul_peak_gflops_f32"] == max(r["matmul_peak_gflops_f32_before_after"])
    for name in ("fig1", "fig2"):
        entry = r[name]
        for form, f in entry["forms"].items():
            if f["xla_flops_loss_grad"] is not None:
                assert f["xla_flops_loss_grad"] >= entry["floor_flops_per_step"], (name, form)
            assert f["grad_max_rel_diff"] < 1e-4, (name, form)  # float32 rounding of one model in two forms
        assert entry["step_s"] > 0 and 0 < entry["fraction_of_matmul_peak_step"]
        assert len(entry["step_rounds_s"]) == 2 and len(entry["matmul_peak_gflops_at_step"]) == 3  # beside each round
        peaks = entry["matmul_peak_gflops_at_step"]  # each round against the setting's own floor and its peaks
        assert entry["fraction_of_matmul_peak_step_rounds"] == pytest.approx(
            [entry["floor_flops_per_step"] / s / 1e9 / max(peaks[r], peaks[r + 1])
             for r, s in enumerate(entry["step_rounds_s"])])
    kernels = r["native_layer_kernels"]
    for name in ("layer_forward", "layer_backward", "blocked_forward", "blocked_backward_data",
                 "blocked_backward_stream", "ir_forward", "ir_backward_data", "ir_backward_stream"):
        assert kernels[f"{name}_s"] > 0 and kernels[f"{name}_fraction_of_matmul_peak"] > 0, name
    assert sorted(r["readout_callback"]) == ["host_call_s", "kernel_alone_s", "pure_callback_s"]
    assert min(r["readout_callback"].values()) > 0


def test_gating_fig1_floor_counts_each_model_by_its_gating_and_length():
    from iclab.experiments.gating import fig1
    from iclab.benches.gating import fig1_floor_flops_per_step

    cfg = fig1.Fig1Config(d=10, p=5, n_bars=[0, 50], models=["gla"], panels=["a"], vector_panels=[], batch=1, seeds=1)
    D = 16
    # query through the keys 4D², per token: score, label value, gate logit (6D); backward twice the forward
    assert fig1_floor_flops_per_step(cfg, fig1._models(cfg)) == 3 * (4 * D * D + 3 * 6 * D) + 3 * (4 * D * D + 103 * 6 * D)
    vec = cfg.model_copy(update={"models": ["gla_vector"], "vector_panels": ["a"], "n_bars": [50], "seeds": 2})
    assert fig1_floor_flops_per_step(vec, fig1._models(vec)) == 2 * 3 * (4 * D * D + 103 * (2 * D + 4 * D * D))
    wo = cfg.model_copy(update={"models": ["gla_wo", "linatt"], "n_bars": [50], "batch": 3})
    assert fig1_floor_flops_per_step(wo, fig1._models(wo)) == 3 * 3 * (4 * 11 * 11 + 101 * 6 * 11) + \
        3 * 3 * (4 * D * D + 103 * 4 * D)


@pytest.mark.slow
def test_gating_fig1_paper_bench_floor_is_below_what_xla_executes_and_kernels_agree():
    from iclab.benches.gating import bench_fig1_paper

    r = bench_fig1_paper(steps=1, seeds=2, batch=8, rounds=1)
    assert r["models"] == 2 * 16 * 10 and r["step_kernel"] == "native"
    assert r["kernels"]["xla"]["xla_flops_loss_grad"] >= r["floor_flops_per_step"]
    assert r["kernels"]["native"]["grad_max_rel_diff"] < 1e-4  # float32 rounding of one grid in two kernels
    assert r["kernels"]["native"]["loss_rel_diff"] < 1e-5
    assert r["step_s"] > 0 and r["training_estimate_s"] == pytest.approx(10_000 * r["step_s"])


def test_gating_fig2_floor_counts_full_layers_and_the_read_out():
    from iclab.experiments.gating import fig2
    from iclab.benches.gating import fig2_floor_flops_per_step

    D, T = 16, 103
    one = fig2.Fig2Config(d=10, p=5, n_bars=[50], layers=[1], batch=1, seeds=1)
    readout = 3 * (4 * D * D + 6 * T * D)
    assert fig2_floor_flops_per_step(one) == readout
    three = one.model_copy(update={"layers": [3], "batch": 2})
    first, later = T * (24 * D * D + 6 * D), T * (30 * D * D + 6 * D)  # the tokens need no cotangent in layer 1
    assert fig2_floor_flops_per_step(three) == 2 * (first + later + readout + 6 * T * D)
    short = three.model_copy(update={"n_bars": [0]})  # T = 3 < D: the parallel form is the cheaper one
    T = 3
    par = 12 * T * D * D + 12 * T * T * D + 4 * T * D + 18 * T * D * D + 12 * T * T * D + 6 * T * D
    assert fig2_floor_flops_per_step(short) == 2 * (par + 3 * (4 * D * D + 6 * T * D) + 6 * T * D)
    grid = one.model_copy(update={"layers": [1, 2, 3], "n_bars": [0, 50]})
    assert fig2_floor_flops_per_step(grid) == sum(fig2_floor_flops_per_step(one.model_copy(
        update={"layers": [L], "n_bars": [n]})) for L in (1, 2, 3) for n in (0, 50))


@pytest.mark.slow
def test_gating_fig2_paper_bench_kernels_agree():
    from iclab.benches.gating import bench_fig2_paper

    # in float64 the two forms are the same function: agreement far below float32's epsilon is the kernels' check
    exact = bench_fig2_paper(steps=1, seeds=2, batch=8, n_bars=[0, 5], dtype="float64", rounds=1)
    assert exact["kernels"]["native"]["grad_max_rel_diff"] < 1e-9 and exact["kernels"]["native"]["loss_rel_diff"] < 1e-9
    r = bench_fig2_paper(steps=1, seeds=2, batch=8, n_bars=[0, 5], rounds=3)
    assert r["models"] == 2 * 3 * 2 and r["step_kernel"] == "native"
    assert len(r["matmul_peak_gflops_at_step"]) == 4 and min(r["matmul_peak_gflops_at_step"]) > 0  # beside the rounds
    assert r["kernels"]["xla"]["xla_flops_loss_grad"] >= r["floor_flops_per_step"]
    # the paper's float32: each form rounds differently through up to three cubic layers and T-long sums (measured
    # 2e-5 in the loss, 1.3e-4 in the gradients at batch 8); a wrong kernel is caught above, this bounds the
    # float32 rounding at 10^3 epsilons (1.2e-4) for the loss and 10^4 for the gradients
    eps = float(np.finfo(np.float32).eps)
    assert r["kernels"]["native"]["grad_max_rel_diff"] < 1e4 * eps and r["kernels"]["native"]["loss_rel_diff"] < 1e3 * eps
    assert r["step_s"] > 0
