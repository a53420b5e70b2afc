"""gating.fig1: the pure helpers of the experiment, the checks on synthetic results (they pass on the theory
curves and fail when a claim is broken), and one tiny run through run -> checks -> plot."""

import jax
import matplotlib
import numpy as np
import pydantic
import pytest

from iclab.ops import use_backend

from iclab.experiments.gating import _common as C
from iclab.experiments.gating import fig1
from iclab.progress import Reporter
from iclab.theory import wpgd as theory

matplotlib.use("Agg")


def test_half_gate_weights_are_products_of_later_gates():
    # ω_j = Π_{m=j+1}^{n+1} g_m with every g = ½ (query gate included): ω_n = ½, ω_1 = 2^{−n}
    n = 5
    gates = np.full(n + 1, 0.5)  # tokens 1..n and the query
    want = [np.prod(gates[j + 1:]) for j in range(n)]
    assert np.allclose(C.half_gate_weights(n), want, rtol=0, atol=0)


def test_padded_correlation_keeps_the_last_samples_of_each_block():
    n_max, nb = 4, 2
    R, r = C.padded_correlation(n_max, nb, r1=0.2, r2=0.8)
    keep = np.nonzero(C.sample_masks(n_max, [nb])[0])[0]
    assert keep.tolist() == [2, 3, 6, 7]
    R0, r0 = theory.two_task_correlation(nb, r1=0.2, r2=0.8)
    assert np.array_equal(R[np.ix_(keep, keep)], R0) and np.array_equal(r[keep], r0)
    assert not R[np.ix_([0, 1, 4, 5], range(8))].any() and not r[[0, 1, 4, 5]].any()


@pytest.mark.parametrize("dtype, query_context", [("float32", "c0"), ("float64", "zero")])
def test_shared_tokens_are_the_delimiter_prompt_tokens_bit_for_bit(dtype, query_context):
    """The step's tokens built once from the panels' shared inputs equal ``gla.delimiter_prompt``'s per panel, in
    both formats, and follow each panel's own labels."""
    import jax.numpy as jnp

    from iclab.tasks import multitask as mt

    cfg = fig1.Fig1Config(d=3, p=4, n_bars=[0, 2, 5], panels=["a", "b", "d"], vector_panels=["d"], dtype=dtype,
                          query_context=query_context)
    dt = cfg.jnp_dtype()
    factors = jnp.asarray(C.panel_factors(cfg.panel_values()), dt)
    pr = jax.vmap(lambda L: mt.sample_blocks(jax.random.PRNGKey(4), 6, [5, 5], L, None, 0.3, d=3, dtype=dt))(factors)
    contexts = C.sample_contexts(cfg).astype(dt)[0]
    want = C._tokens(pr, contexts, 5, 5, cfg, {"delim", "plain"})
    got = C._shared_tokens(pr, contexts, cfg, {"delim", "plain"})
    assert set(got) == {"delim", "plain"}
    for fmt in want:
        assert got[fmt].shape == want[fmt].shape and got[fmt].dtype == want[fmt].dtype
        np.testing.assert_array_equal(got[fmt], want[fmt], err_msg=fmt)
    assert set(C._shared_tokens(pr, contexts, cfg, {"plain"})) == {"plain"}
    moved = C._shared_tokens(pr._replace(y=pr.y.at[1, 2].add(1.0)), contexts, cfg, {"delim"})["delim"]
    changed = np.any(np.asarray(moved != want["delim"]), axis=(2, 3))  # (P, B): which prompts changed
    assert changed[1, 2] and changed.sum() == 1


def test_theory_refs_classes_meet_their_closed_forms():
    d, n_bars = 4, [0, 1, 3]
    refs = C.theory_refs(d, 0.0, fig1.PANELS, n_bars, max(n_bars))
    assert np.allclose(refs["E_att"], refs["eq24"], rtol=1e-12)
    assert np.allclose(refs["E_vector"], refs["eq17"], rtol=1e-10)  # Thm 5: vector gating reaches eq 17
    # Thm 4, K = 2: scalar gating reaches eq 17 iff r₁ ≤ r₂ (panels a-c), else only eq 24 (panel d)
    assert np.allclose(refs["E_scalar"][:3], refs["eq17"][:3], rtol=1e-10)
    assert np.allclose(refs["E_scalar"][3], refs["eq24"][3], rtol=1e-10)
    # the stored predictors attain the stored risks on the exact risk eq 37 (padded slots carry ω = 0)
    i, g = 1, 2
    R, r = C.padded_correlation(3, 3, r1=fig1.PANELS[i][0], r2=fig1.PANELS[i][1])
    for cls in C.REF_CLASSES:
        E = theory.wpgd_risk(refs[f"P_{cls}"][i, g], refs[f"omega_{cls}"][i, g], np.eye(d), R, r, 0.0)
        assert float(E) == pytest.approx(refs[f"E_{cls}"][i, g], rel=1e-10)


def test_wpgd_predict_is_eq_7():
    rng = np.random.default_rng(0)
    P, om = rng.normal(size=(3, 3)), rng.normal(size=4)
    x, y, xq = rng.normal(size=(2, 4, 3)), rng.normal(size=(2, 4)), rng.normal(size=(2, 3))
    want = [xq[b] @ P @ x[b].T @ (om * y[b]) for b in range(2)]
    assert np.allclose(C.wpgd_predict(P, om, x, y, xq), want, rtol=1e-12)


def test_restarts_repeat_the_gated_models_in_restart_panels_only():
    cfg = fig1.Fig1Config(panels=["a", "d"], vector_panels=["d"], restarts=3, restart_panels=["d"])
    models = fig1._models(cfg)
    assert models["linatt"].panels == (0, 1) and models["gla_wo"].panels == (0, 1)
    assert models["gla"].panels == (0, 1, 1, 1)
    assert models["gla_vector"].panels == (1, 1, 1)
    # member ids: distinct, and a function of (kind, panel, restart, n̄) only, not of the other kinds trained
    ids = np.concatenate([C.member_ids(k, cfg.panel_values(), cfg.n_bars).ravel() for k in models.values()])
    assert np.unique(ids).size == ids.size
    alone = fig1._models(fig1.Fig1Config(**(cfg.model_dump() | {"models": ["gla_vector"], "panels": ["d"]})))
    np.testing.assert_array_equal(C.member_ids(alone["gla_vector"], [fig1.PANELS[3]], cfg.n_bars),
                                  C.member_ids(models["gla_vector"], cfg.panel_values(), cfg.n_bars))


@pytest.mark.parametrize("models, message", [(["gla", "nope"], "models must be distinct names among"),
                                             (["gla_multilayer"], "models must be distinct names among"),
                                             (["gla", "gla"], "models must be distinct")])
def test_models_are_registered_families_with_a_closed_form(models, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        fig1.Fig1Config(models=models)


def test_best_run_ignores_untrained_entries():
    risk = np.array([[[0.5, np.nan]], [[0.4, np.nan]], [[np.nan, np.nan]]])  # (runs, P=1, G=2)
    r = {"risk_m": risk, "se_m": risk / 100}
    assert fig1._best_run(r, "m").tolist() == [[1, -1]]
    assert np.allclose(fig1._at_best(r, "m", "se"), [[0.004, np.nan]], equal_nan=True)


def _synthetic(cfg, gla_vector_d=None):
    """A result dict whose trained curves sit exactly on the curves each model class can reach."""
    n_bars = np.asarray(cfg.n_bars)
    refs = C.theory_refs(cfg.d, cfg.sigma2, cfg.panel_values(), cfg.n_bars, max(cfg.n_bars))
    r = {"n_bars": n_bars, "eq17": refs["eq17"] / cfg.d, "eq24": refs["eq24"] / cfg.d,
         "eq22": refs["E_scalar"] / cfg.d, "thm5": refs["E_vector"] / cfg.d, "halfgate": refs["E_half"] / cfg.d}
    curves = {"linatt": r["eq24"], "gla": r["eq22"], "gla_wo": r["halfgate"], "gla_vector": r["thm5"].copy()}
    if gla_vector_d is not None:
        curves["gla_vector"][3] = gla_vector_d
    for name, curve in curves.items():
        r[f"risk_{name}"] = curve[None].copy()
        r[f"se_{name}"] = np.full_like(curve[None], 1e-4)
    for cls, key in (("att", "eq24"), ("scalar", "eq22"), ("vector", "thm5"), ("half", "halfgate")):
        r[f"ref_raw_{cls}"], r[f"ref_se_{cls}"] = r[key][None] + 1e-3, np.full_like(r[key][None], 1e-3)
    for name, key in (("linatt", "eq24"), ("gla", "eq22"), ("gla_vector", "thm5")):
        r[f"restricted_{name}"] = r[key][None]
    return r


def test_checks_pass_on_the_theory_curves_and_fail_when_vector_gating_does_not_help():
    cfg = fig1.Fig1Config(d=5, n_bars=[0, 5, 10], vector_panels=["a", "b", "c", "d"])
    checks = fig1.checks_fig1(cfg, _synthetic(cfg))
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]
    # GLA-vector stuck at the scalar-gating optimum (eq 24) in panel d: Thm 5's claim is broken
    bad = fig1.checks_fig1(cfg, _synthetic(cfg, gla_vector_d=_synthetic(cfg)["eq24"][3]))
    failed = {c.name.split(" (")[0] for c in bad if not c.passed}
    assert "GLA-vector = eq 17, panel d" in failed
    assert any(name.startswith("panel d: GLA-vector below GLA") for name in failed)


def test_checks_fail_when_gla_wo_beats_linear_attention():
    cfg = fig1.Fig1Config(d=5, n_bars=[0, 5, 10], vector_panels=["d"])
    r = _synthetic(cfg)
    r["risk_gla_wo"] = r["eq24"][None] - 0.01
    failed = [c.name for c in fig1.checks_fig1(cfg, r) if not c.passed]
    assert any(name.startswith("GLA-wo above LinAtt") for name in failed)


def test_plot_of_synthetic_results():
    cfg = fig1.Fig1Config(d=5, n_bars=[0, 5, 10], vector_panels=["d"])
    fig = fig1.plot_fig1(cfg, _synthetic(cfg) | {"panels": np.asarray(fig1.PANELS)})
    assert len(fig.axes) == 4 and all(ax.get_title() for ax in fig.axes)


@pytest.mark.slow  # almost all of it XLA compilation of the joint training loop
def test_tiny_run_checks_and_plot():
    # compile time dominates: two kinds, two panels, two n̄
    cfg = fig1.Fig1Config(d=2, p=3, n_bars=[0, 2], panels=["c", "d"], models=["gla", "gla_vector"],
                          vector_panels=["d"], restarts=2, steps=20, lr=0.01, batch=16, seeds=1, n_eval=256,
                          eval_chunk=256, record_every=10, restricted_steps=10)
    r = fig1.run_fig1(cfg, Reporter())
    assert r["risk_gla"].shape == (2, 2, 2) and np.isnan(r["risk_gla"][1, 0]).all()  # restarts in panel d only
    assert r["risk_gla_vector"].shape == (2, 2, 2) and np.isnan(r["risk_gla_vector"][:, 0]).all()
    assert np.isfinite(r["risk_gla_vector"][:, 1]).all() and np.isfinite(r["restricted_gla"]).all()
    assert "risk_linatt" not in r
    # n̄ = 0: only delimiters and the query; every optimal predictor is ŷ = 0 with risk (d + σ²)/d = 1
    assert np.allclose(r["eq17"][:, 0], 1) and np.allclose(r["eq24"][:, 0], 1)
    checks = fig1.checks_fig1(cfg, r)
    assert checks and all(np.isfinite(c.measured) for c in checks)
    fig = fig1.plot_fig1(cfg, r)
    assert len(fig.axes) == 2


@pytest.mark.slow  # XLA compilation of two training loops
def test_native_kernel_trains_the_same_models_as_xla():
    """The native backend (one token tensor at the largest n̄, each n̄ read at its own positions by the compiled loss)
    against the XLA separate layout: the same members, batches and updates, float64, every Fig 1 family, two
    seeds (the trainer vmaps them through one callback), per-member clipping."""
    base = dict(d=2, p=3, n_bars=[0, 1, 3], panels=["a", "d"], vector_panels=["d"], steps=4, lr=0.05, batch=8,
                seeds=2, record_every=2, dtype="float64", clip_norm=0.5)
    out = {}
    for kernel in ("xla", "native"):
        cfg = fig1.Fig1Config(**base)
        with use_backend(kernel):
            out[kernel] = C.train_models(cfg, fig1._models(cfg), cfg.panel_values(), None)
    (tr_x, par_x), (tr_n, par_n) = out["xla"], out["native"]
    np.testing.assert_allclose(tr_n.loss, tr_x.loss, rtol=1e-11)
    assert set(par_n) == {"linatt", "gla", "gla_wo", "gla_vector"}
    for name in par_x:
        for a, b in zip(jax.tree_util.tree_leaves(par_n[name]), jax.tree_util.tree_leaves(par_x[name])):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=name)
