"""gating.fig2: joint training (a subset of the grid alone, per-model clipping, the padded n̄ layout), the depth
checks on synthetic results (pass when deeper is lower, fail when a deeper model is above or diverged), config
validation and the plot. The quick preset runs in the slow set (tests/experiments/test_quick_presets.py)."""

import jax
import matplotlib
import numpy as np
import pydantic
import pytest

from iclab.ops import use_backend

from iclab.experiments.gating import _common as C
from iclab.experiments.gating import fig2
from iclab.progress import Reporter

matplotlib.use("Agg")


@pytest.mark.slow  # three small joint trainings, mostly XLA compilation
def test_a_depth_trained_alone_follows_the_joint_grid_with_per_model_clipping():
    # the 2-layer models trained beside the 1-layer ones = trained alone: ids fix the init, the batch does not
    # depend on which models train, and each model's gradient is clipped by its own norm (a global norm over
    # the grid would couple the depths)
    base = dict(d=2, p=3, n_bars=[1, 3], steps=6, lr=0.05, batch=8, seeds=2, record_every=3, dtype="float64")
    panels = [C.PANELS[0]]

    def final(layers, clip_norm):
        cfg = fig2.Fig2Config(layers=layers, clip_norm=clip_norm, **base)
        return C.train_models(cfg, fig2._models(cfg), panels, None)[1]["gla_2"]

    both, alone, unclipped = final([1, 2], 0.05), final([2], 0.05), final([2], 0.0)
    for a, b, u in zip(*(jax.tree_util.tree_leaves(t) for t in (alone, both, unclipped))):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert not np.allclose(jax.tree_util.tree_leaves(alone)[0], jax.tree_util.tree_leaves(unclipped)[0])  # clipped


def _synthetic(config, risks: dict, se: float = 0.002):
    """Results with the given best-seed risk curves (one seed), SE ``se`` everywhere."""
    n = np.asarray(config.n_bars)
    refs = C.theory_refs(config.d, config.sigma2, [C.PANELS[0]], config.n_bars, max(config.n_bars))
    out = {"n_bars": n, "layers": np.asarray(config.layers), "eq17": refs["eq17"] / config.d,
           "eq24": refs["eq24"] / config.d}
    for L, curve in risks.items():
        out[f"risk_gla_{L}"] = np.asarray(curve, float)[None, None, :]
        out[f"se_gla_{L}"] = np.full((1, 1, len(n)), se)
    return out


@pytest.fixture
def config():
    return fig2.Fig2Config(d=5, p=5, n_bars=[0, 5, 10], seeds=1)


def test_checks_pass_when_deeper_is_lower(config):
    eq17 = _synthetic(config, {})["eq17"][0]
    r = _synthetic(config, {1: eq17 * 1.01, 2: eq17 * 0.9, 3: eq17 * 0.8})
    checks = fig2.checks_fig2(config, r)
    assert len(checks) == 4 and all(c.passed for c in checks), [(c.name, c.measured) for c in checks]


def test_checks_fail_when_a_deeper_model_is_above(config):
    eq17 = _synthetic(config, {})["eq17"][0]
    r = _synthetic(config, {1: eq17, 2: eq17 * 1.1, 3: eq17 * 0.8})
    failed = [c.name for c in fig2.checks_fig2(config, r) if not c.passed]
    assert len(failed) == 1 and failed[0].startswith("2 layers not above 1")


def test_checks_fail_when_the_deepest_model_diverged_despite_its_huge_standard_error(config):
    eq17 = _synthetic(config, {})["eq17"][0]
    r = _synthetic(config, {1: eq17, 2: eq17 * 0.9, 3: [1.0, 1e12, 1e9]})
    r["se_gla_3"][...] = [[[1e-4, 1e12, 1e9]]]
    failed = {c.name.split(" (")[0] for c in fig2.checks_fig2(config, r) if not c.passed}
    assert "3 layers not above 2" in failed
    assert any(name.startswith("3 layers strictly below 1") for name in failed)


def test_checks_fail_when_the_one_layer_model_misses_eq_17(config):
    eq17 = _synthetic(config, {})["eq17"][0]
    r = _synthetic(config, {1: eq17 * 1.2, 2: eq17 * 1.1, 3: eq17})
    failed = [c.name for c in fig2.checks_fig2(config, r) if not c.passed]
    assert any(name.startswith("1-layer GLA = eq 17") for name in failed)


@pytest.mark.parametrize("layers", [[], [2, 1], [1, 1], [0, 1], [1, 9]])
def test_layers_must_be_increasing_depths_in_range(layers):
    with pytest.raises(pydantic.ValidationError, match="layers"):
        fig2.Fig2Config(layers=layers)


def test_plot_of_synthetic_results(config):
    eq17 = _synthetic(config, {})["eq17"][0]
    fig = fig2.plot_fig2(config, _synthetic(config, {1: eq17, 2: eq17 * 0.9, 3: eq17 * 0.8}))
    assert fig.axes[0].get_yscale() == "log" and len(fig.axes[0].lines) == 5


@pytest.mark.slow  # nearly all XLA compilation (two layouts × train + evaluate)
def test_padded_nbar_layout_trains_and_evaluates_the_same_models_as_separate_prompts():
    # float64 so that the two layouts agree to rounding: masked tokens carry v = 0 and gate 1 exactly;
    # one multi-layer kind: every layer reads the mask
    base = dict(d=2, p=3, n_bars=[0, 1, 3], steps=4, lr=0.05, batch=8, seeds=1, n_eval=128, eval_chunk=128,
                record_every=2, dtype="float64", layers=[2], clip_norm=0.5)
    models = {"gla_2": fig2._kind(2)}
    panels = [C.PANELS[1]]
    out = {}
    for layout in ("separate", "padded"):
        cfg = fig2.Fig2Config(nbar_layout=layout, **base)
        tr, params = C.train_models(cfg, models, panels, Reporter())
        refs = C.theory_refs(cfg.d, cfg.sigma2, panels, cfg.n_bars, max(cfg.n_bars))
        out[layout] = (tr.loss, params, C.evaluate(cfg, models, params, panels, refs))
    (loss_s, par_s, ev_s), (loss_p, par_p, ev_p) = out["separate"], out["padded"]
    np.testing.assert_allclose(loss_p, loss_s, rtol=1e-10)
    for a, b in zip(jax.tree_util.tree_leaves(par_p), jax.tree_util.tree_leaves(par_s)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    assert not np.allclose(jax.tree_util.tree_leaves(par_s["gla_2"])[0][0, 0, 1],
                           jax.tree_util.tree_leaves(par_s["gla_2"])[0][0, 0, 2])  # the n̄ models differ
    for k in ev_s:
        np.testing.assert_allclose(ev_p[k], ev_s[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.slow  # XLA compilation of two training loops
def test_native_layer_kernels_train_the_same_models_as_xla():
    """The native backend (every n̄'s prompt cut out of one tensor at the largest n̄, full layers by the compiled
    gated-layer kernels) against the XLA separate layout: the same members, batches and updates, float64, depths
    1-3, two seeds, per-model clipping."""
    base = dict(d=2, p=3, n_bars=[0, 1, 3], steps=3, lr=0.05, batch=8, seeds=2, record_every=1, dtype="float64",
                layers=[1, 2, 3], clip_norm=0.5)
    out = {}
    for kernel in ("xla", "native"):
        cfg = fig2.Fig2Config(**base)
        with use_backend(kernel):
            out[kernel] = C.train_models(cfg, fig2._models(cfg), [C.PANELS[0]], None)
    (tr_x, par_x), (tr_n, par_n) = out["xla"], out["native"]
    np.testing.assert_allclose(tr_n.loss, tr_x.loss, rtol=1e-11)
    for name in par_x:
        for a, b in zip(jax.tree_util.tree_leaves(par_n[name]), jax.tree_util.tree_leaves(par_x[name])):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=name)


def test_native_kernel_refuses_families_it_does_not_compute():
    from iclab.models import ModelFamily, register_model, unregister_model, gla

    register_model(ModelFamily("toy_gla_native_refusal", gla.DELIMITED, lambda key, **kw: {}, gla.predict))
    try:
        cfg = fig2.Fig2Config(d=2, p=3, n_bars=[0, 1], steps=1, batch=2, seeds=1, layers=[1])
        with use_backend("native"), pytest.raises(ValueError, match="the native backend trains"):
            C.train_models(cfg, {"toy": C.Kind("toy_gla_native_refusal", "scalar", (0,), 0)}, [C.PANELS[0]], None)
    finally:
        unregister_model("toy_gla_native_refusal")
