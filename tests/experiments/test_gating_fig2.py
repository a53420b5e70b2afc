"""gating.fig2: per-model gradient clipping, the depth checks on synthetic results (pass when deeper is lower,
fail when a deeper model is above or diverged), config validation and the plot. The quick preset runs in the
slow set (tests/experiments/test_quick_presets.py)."""

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import pydantic
import pytest

from iclab.experiments.gating import _common as C
from iclab.experiments.gating import fig2
from iclab.progress import Reporter

matplotlib.use("Agg")


def test_clip_per_model_equals_global_norm_clipping_of_each_model_alone():
    rng = np.random.default_rng(0)
    # two kinds; leading axes (panel, n̄) = (2, 3); one kind a 2-layer list of dicts
    updates = {
        "gla_1": {"Wq": jnp.asarray(0.5 * rng.standard_normal((2, 3, 4, 4))),
                  "w_g": jnp.asarray(rng.standard_normal((2, 3, 4)))},
        "gla_2": [{"Wq": jnp.asarray(3 * rng.standard_normal((2, 3, 4, 4)))},
                  {"Wq": jnp.asarray(0.01 * rng.standard_normal((2, 3, 4, 4)))}],
    }
    max_norm = 3.0
    got, _ = C.clip_per_model(max_norm, lead=2).update(updates, optax.EmptyState())
    ref_tx = optax.clip_by_global_norm(max_norm)
    clipped_some = unclipped_some = False
    for kind, tree in updates.items():
        for i in range(2):
            for g in range(3):
                one = jax.tree_util.tree_map(lambda a: a[i, g], tree)
                want, _ = ref_tx.update(one, ref_tx.init(one))
                have = jax.tree_util.tree_map(lambda a: a[i, g], got[kind])
                for w, h in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(have)):
                    np.testing.assert_allclose(h, w, rtol=1e-12, atol=1e-15)
                norm = optax.tree.norm(one)
                clipped_some |= bool(norm > max_norm)
                unclipped_some |= bool(norm <= max_norm)
    assert clipped_some and unclipped_some  # both branches exercised


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


@pytest.mark.slow  # ~17 s on 2 cores, nearly all XLA compilation (two layouts × train + evaluate)
def test_padded_nbar_layout_trains_and_evaluates_the_same_models_as_separate_prompts():
    # float64 so that the two layouts agree to rounding: masked tokens carry v = 0 and gate 1 exactly;
    # one multi-layer kind: every layer reads the mask
    base = dict(d=2, p=3, n_bars=[0, 1, 3], steps=4, lr=0.05, batch=8, seeds=1, n_eval=128, eval_chunk=128,
                record_every=2, dtype="float64", layers=[2], clip_norm=0.5)
    models = {"gla_2": (fig2._spec(2), (0,))}
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
