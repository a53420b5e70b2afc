"""gating Fig 1: trained LinAtt, GLA, GLA-wo and GLA-vector against n̄ in four correlation settings, with the
closed forms eq 24 (linear attention) and eq 17 (WPGD optimum), and the restricted models trained on the
exact risk eq 37."""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
from pydantic import field_validator, model_validator

from iclab.experiments._config import param
from iclab.experiments._plot import baseline_lines, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_least, check_at_most
from iclab.experiments.gating._common import (
    COLOR,
    PANEL_NAMES,
    PANELS,
    PAPER,
    Kind,
    TrainConfig,
    baselines_memory,
    bayes_risks,
    block_label,
    evaluate,
    evaluation_memory,
    family_names,
    nbar_blocks,
    put_block,
    restricted_algorithm_match,
    summed_loss,
    theory_refs,
    train_models,
    train_restricted,
    training_memory,
)
from iclab.experiments._memory import largest

PanelName = Literal["a", "b", "c", "d"]


class Fig1Kind(NamedTuple):
    """How Fig 1 shows a registered model family: its label and the closed form it is compared with."""

    label: str
    ref: str


#: The families Fig 1 can train, in member-id order (a kind's code is its position here): the paper's four
#: models. The control variate of each is the optimal predictor of the closed form its class reaches.
FIG1_KINDS = {
    "linatt": Fig1Kind("LinAtt", "att"),
    "gla": Fig1Kind("GLA", "scalar"),
    "gla_wo": Fig1Kind("GLA-wo", "half"),
    "gla_vector": Fig1Kind("GLA-vector", "vector"),
}

# Our tolerance for trained-vs-theory (the paper shows visual overlap, no number): a trained model's excess over
# the optimum of its class comes from finite training (constant-lr Adam fluctuations, gates that reach
# 0 or 1 only asymptotically); the control-variate estimates carry standard errors well below it.
REL_TOL = 0.05
# Restricted models on the exact risk: no sampling noise; the residual is the sigmoid gates' distance from
# 0/1 and unfinished descent, far below 1 %.
RESTRICTED_TOL = 0.01
# Algorithm match (our criterion): a model that implements an algorithm has sensitivity cosine ≥ 0.99 with it,
# and no trained model beats the Bayes risk by more than 3 standard errors.
COSINE_MIN = 0.99
BAYES_Z = 3.0
# The gap of a WPGD predictor near the optimum is, to second order, its excess risk over L*_WPGD (the optimum's
# residual is orthogonal to the class's tangent directions in P and ω; measured: gap ≈ excess within ~20 %), so
# the restricted check's 1 % of excess risk bounds it.
MATCH_TOL = RESTRICTED_TOL
MATCH_TOL_NOTE = ("the gap is, to second order, the excess risk over L*_WPGD, which the restricted check bounds by "
                  f"{RESTRICTED_TOL:.0%}")
#: Panels in which the restricted GLA-vector is matched with the optimal WPGD predictor (a-c, where the paper has
#: GLA = eq 17).
MATCH_PANELS = ("a", "b", "c")
# Max |z| of the reference predictors' raw Monte-Carlo MSE against their closed forms, over all seeds,
# panels, n̄ and classes (≈ 100 correlated comparisons: P(|z| > 4.5) ≈ 7e-6 each).
Z_MAX = 4.5


class Fig1Config(TrainConfig):
    panels: list[PanelName] = param(["a", "b", "c", "d"], "panels: (a) r=(0,1), (b) (.2,.8), (c) (.5,.5), (d) (.8,.2)",
                                    paper=["a", "b", "c", "d"])
    models: list[str] = param(
        ["linatt", "gla", "gla_wo", "gla_vector"], "trained models: registered model families (iclab.models) that "
        "read multitask tokens and that Fig 1 compares with a closed form", paper=["linatt", "gla", "gla_wo", "gla_vector"])
    vector_panels: list[PanelName] = param(
        ["a", "b", "c", "d"], "panels in which GLA-vector is trained", paper=["d"],
        paper_note="unspecified: the text discusses GLA-vector for panel (d) only")
    restarts: int = param(
        1, "independent initialisations per seed of the gated models with delimiters (GLA, GLA-vector) in "
        "restart_panels, trained on the seed's data stream; the figure takes the best of seeds × restarts",
        paper=1, ge=1, le=100, paper_note="the paper reports the best of 10 runs (seeds) for every model")
    restart_panels: list[PanelName] = param(
        ["d"], "panels in which GLA and GLA-vector get `restarts` initialisations", paper=[],
        paper_note="in panel d the gates must open (ω₁ ≥ ω₂) against the weakest initial signal — with every gate "
        "near ½ the model mostly reads the last, less relevant task — so the escape from that plateau is slowest "
        "and most variable there")
    check_from: int = param(5, "smallest n̄ of the trained-vs-theory checks", paper=None,
                            paper_note="unspecified; our choice", ge=0, le=1000)
    monotone_tol: float = param(0.01, "allowed increase of a curve between consecutive n̄ (risk/d), besides 3 SE",
                                ge=0, le=1)
    restricted: bool = param(True, "also train the restricted models (eq 20 + gates on the contexts) on the exact "
                             "risk eq 37 with the population engine", paper=False,
                             paper_note="extension: shows where trained models meet the optimum")
    restricted_steps: int = param(3000, "Adam steps of the restricted models", ge=1, le=1_000_000)
    restricted_lr: float = param(0.02, "Adam learning rate of the restricted models", gt=0, le=10)
    n_match: int = param(1024, "held-out prompts per (seed, panel, n̄) on which the restricted GLA-vector is matched "
                         "with the optimal WPGD predictor and the Bayes risk is averaged", paper=None,
                         paper_note="extension: not in the paper", ge=2, le=1_000_000)

    @field_validator("models")
    @classmethod
    def _known_models(cls, value):
        known = [name for name in family_names() if name in FIG1_KINDS]
        bad = [name for name in value if name not in known]
        if bad or len(set(value)) != len(value):
            raise ValueError(f"models must be distinct names among {', '.join(known)} (got {value})")
        return value

    @model_validator(mode="after")
    def _subsets(self):
        if len(set(self.panels)) != len(self.panels) or not set(self.vector_panels) <= set(self.panels):
            raise ValueError("panels must be distinct and vector_panels a subset of panels")
        if self.p < 3 and self.restricted:
            raise ValueError("p must be >= K + 1 = 3 for the restricted gate constructions (Thms 4-5)")
        return self

    def panel_values(self):
        return [PANELS[PANEL_NAMES.index(n)] for n in self.panels]


def _models(config: Fig1Config) -> dict[str, Kind]:
    out = {}
    all_idx = tuple(range(len(config.panels)))
    for name in config.models:
        idx = tuple(config.panels.index(n) for n in config.vector_panels) if name == "gla_vector" else all_idx
        if name in ("gla", "gla_vector"):
            again = tuple(i for i in idx if config.panels[i] in config.restart_panels)
            idx = idx + again * (config.restarts - 1)
        if idx:
            out[name] = Kind(name, FIG1_KINDS[name].ref, idx, list(FIG1_KINDS).index(name))
    return out


def run_fig1(config: Fig1Config, reporter, *, n_max: int | None = None, classes=None) -> dict:
    """The figure's arrays: every (kind, panel, n̄) trained jointly, evaluated, with the closed forms, the
    restricted models and the baselines. ``n_max`` and ``classes`` are those of the whole grid when
    ``config`` is one shard's (:func:`run_shard_fig1`)."""
    panels = config.panel_values()
    n_max = max(config.n_bars) if n_max is None else n_max
    refs = theory_refs(config.d, config.sigma2, panels, config.n_bars, n_max)
    models = _models(config)
    tr, params = train_models(config, models, panels, reporter, label=f"{len(models)} kinds x {len(panels)} panels "
                              f"x {len(config.n_bars)} n̄ x {config.seeds} seeds", n_max=n_max)
    out = evaluate(config, models, params, panels, refs, reporter, n_max=n_max, classes=classes)
    out.update({
        "n_bars": np.asarray(config.n_bars), "panels": np.asarray(panels),
        "eq17": refs["eq17"] / config.d, "eq24": refs["eq24"] / config.d,
        "eq22": refs["E_scalar"] / config.d, "thm5": refs["E_vector"] / config.d, "halfgate": refs["E_half"] / config.d,
        "train_step": tr.step, "train_loss": tr.loss,
    })
    if config.restricted:
        kinds = [k for k in ("linatt", "gla", "gla_vector") if k in config.models]
        tr_r, pop = train_restricted(config, kinds, panels, steps=config.restricted_steps, lr=config.restricted_lr,
                                     init_std=config.init_std, reporter=reporter, n_max=n_max)
        out.update({f"restricted_{k}": v for k, v in pop.items()})
        if "gla_vector" in kinds:
            match = restricted_algorithm_match(config, "gla_vector", tr_r.final_params["gla_vector"], panels,
                                               N=config.n_match, reporter=reporter)
            for k, v in match.items():
                out[f"match_gla_vector_{k}"] = v if k.startswith("cosine") else v / config.d
    bayes, bayes_se = bayes_risks(config, panels, N=config.n_match)
    out["bayes_risk"], out["bayes_risk_se"] = bayes / config.d, bayes_se / config.d
    return out


def memory_fig1(config: Fig1Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig1`'s memory: the joint training of every (kind, panel, n̄) model
    (:func:`iclab.experiments.gating._common.training_memory`), then their evaluation on n_eval test prompts per
    seed and panel (:func:`~iclab.experiments.gating._common.evaluation_memory`), then the restricted models and
    the held-out baselines (:func:`~iclab.experiments.gating._common.baselines_memory`); the largest phase."""
    models, n_panels = _models(config), len(config.panels)
    restricted = [k for k in ("linatt", "gla", "gla_vector") if k in config.models] if config.restricted else []
    return largest(training_memory(config, models, n_panels),
                   evaluation_memory(config, models, n_panels, len({kind.ref for kind in models.values()})),
                   baselines_memory(config, restricted, n_panels, N=config.n_match))


# Shards: one per (panel, block of n̄). Every array of the figure is indexed by (…, panel, n̄), and a model's
# init and batches depend only on (seed, member id, step) with the member id a function of (kind, panel,
# restart, n̄) (_common.member_id) and the batch drawn at the whole grid's n̄_max, so a shard trains exactly its
# members of the joint run; the restricted models, the held-out match and the Bayes risks are per (panel, n̄)
# too. What the shards share is only the summed training loss, which adds up.


def _shard_table(config: Fig1Config) -> dict[str, tuple[str, list[int]]]:
    return {f"{panel}.{block_label(block)}": (panel, block)
            for panel in config.panels for block in nbar_blocks(config.n_bars)}


def shards_fig1(config: Fig1Config) -> list[str]:
    """One shard per (panel, block of ≤ NBAR_BLOCK consecutive n̄): ``<panel>.n<first>-<last>``."""
    return list(_shard_table(config))


def _shard_config(config: Fig1Config, panel: str, block: list[int]) -> Fig1Config:
    return config.model_copy(update={"panels": [panel], "n_bars": list(block),
                                     "vector_panels": [panel] if panel in config.vector_panels else []})


def _classes(config: Fig1Config) -> list[str]:
    return sorted({kind.ref for kind in _models(config).values()})


def run_shard_fig1(config: Fig1Config, name: str, reporter) -> dict:
    """The arrays of one shard: :func:`run_fig1` on one panel and one block of n̄, at the whole grid's n̄_max
    and reference classes."""
    table = _shard_table(config)
    if name not in table:
        raise ValueError(f"gating.fig1 has no shard {name!r} at this config (shards: {', '.join(table)})")
    panel, block = table[name]
    return run_fig1(_shard_config(config, panel, block), reporter, n_max=max(config.n_bars), classes=_classes(config))


def _runs_per_panel(kind) -> int:
    return max(kind.panels.count(i) for i in set(kind.panels))


def assemble_fig1(config: Fig1Config, parts: dict[str, dict], reporter=None) -> dict:
    """The figure's arrays from every shard's (the layout of :func:`run_fig1`): entries placed at their
    (panel, n̄), a kind's runs (seed s, restart j) at row s·R + j with R of the whole grid, NaN where a kind is
    not trained, the summed training loss added up over the shards."""
    P, G, S = len(config.panels), len(config.n_bars), config.seeds
    rows = {name: _runs_per_panel(kind) for name, kind in _models(config).items()}
    per_run = [(prefix, name) for prefix in ("se_raw_", "risk_", "raw_", "se_") for name in rows]
    out: dict = {}
    for shard, (panel, block) in _shard_table(config).items():
        arrays = parts[shard]
        i = config.panels.index(panel)
        g = config.n_bars.index(block[0])
        cols = slice(g, g + len(block))
        sub_rows = {name: _runs_per_panel(kind) for name, kind in _models(_shard_config(config, panel, block)).items()}
        for key, value in arrays.items():
            if key in ("n_bars", "panels", "train_step", "train_loss"):
                continue
            value = np.asarray(value)
            kind = next((name for prefix, name in per_run if key == prefix + name), None)
            if kind is None:
                put_block(out, key, value[..., 0, :], value.shape[:-2] + (P, G), (..., i, cols))
                continue
            R, r = rows[kind], sub_rows[kind]
            for s in range(S):
                put_block(out, key, value[s * r:(s + 1) * r, 0], (S * R, P, G), (slice(s * R, s * R + r), i, cols))
    out["train_step"], out["train_loss"] = summed_loss([parts[name] for name in _shard_table(config)])
    out["n_bars"], out["panels"] = np.asarray(config.n_bars), np.asarray(config.panel_values())
    return out


def _best_run(r, name) -> np.ndarray:
    """Index of the best run (seeds × restarts) per (panel, n̄), −1 where the kind is not trained; (P, G)."""
    risk = r[f"risk_{name}"]
    return np.where(np.all(np.isnan(risk), axis=0), -1, np.argmin(np.where(np.isnan(risk), np.inf, risk), axis=0))


def _at_best(r, name, key) -> np.ndarray:
    """``key`` (risk, se, raw, se_raw) of the best run per (panel, n̄), NaN where the kind is not trained; (P, G)."""
    k = _best_run(r, name)
    vals = np.take_along_axis(r[f"{key}_{name}"], np.maximum(k, 0)[None], axis=0)[0]
    return np.where(k >= 0, vals, np.nan)


def _best(r, name):
    """Minimum over runs (seeds × restarts; the paper reports the best of 10 runs), (P, G)."""
    return _at_best(r, name, "risk")


def _worst_rel(curve, theory, sel):
    """(worst |curve/theory − 1| over the selected entries, the curve value there)."""
    rel = np.abs(curve / theory - 1.0)
    rel = np.where(sel, rel, -np.inf)
    k = np.unravel_index(np.argmax(rel), rel.shape)
    return float(rel[k]), k


def checks_fig1(config: Fig1Config, r: dict) -> list:
    names = list(config.panels)
    n_bars = np.asarray(config.n_bars)
    big = n_bars >= config.check_from
    checks = []

    def pidx(which):
        return [names.index(n) for n in which if n in names]

    def rel_check(label, name, theory_key, panel_names, note=""):
        idx = pidx(panel_names)
        if f"risk_{name}" not in r or not idx or not big.any():
            return
        sel = np.zeros_like(r[theory_key], dtype=bool)
        sel[np.ix_(idx, np.nonzero(big)[0])] = True
        sel &= np.isfinite(_best(r, name))
        worst, k = _worst_rel(_best(r, name), r[theory_key], sel)
        where = f"panel {names[k[0]]}, n̄ = {n_bars[k[1]]}"
        checks.append(check_at_most(f"{label} (worst relative gap, n̄ ≥ {config.check_from}: {where})", worst, REL_TOL,
                                    note))

    # Sampler and closed forms, no training: the optimal predictors' raw Monte-Carlo risk.
    zs = []
    for cls in ("att", "scalar", "vector", "half"):
        if f"ref_raw_{cls}" in r:
            E = {"att": r["eq24"], "scalar": r["eq22"], "vector": r["thm5"], "half": r["halfgate"]}[cls]
            z = (r[f"ref_raw_{cls}"] - E[None]) / r[f"ref_se_{cls}"]
            zs.append(np.abs(z[:, :, n_bars >= 1]))
    if zs:
        checks.append(check_at_most("optimal predictors' Monte-Carlo risk = eqs 24, 22, Thm 5, ½-gate form (max |z|)",
                                    max(float(np.nanmax(z)) for z in zs), Z_MAX,
                                    "raw MSE of ŷ = xᵀP*Xᵀ(ω*⊙y) on the test prompts against eq 37 at the optimum; "
                                    "tests the sampler (Defs 1-2) and the closed forms, no training"))
    note = ("minimum over runs of the control-variate estimate (module _common); tolerance: our 5 %")
    rel_check("LinAtt = eq 24, all panels", "linatt", "eq24", names, note)
    rel_check("GLA = eq 17, panels a-c", "gla", "eq17", ["a", "b", "c"], note)
    rel_check("GLA = eq 24 (scalar gating cannot up-weight the earlier task), panel d", "gla", "eq24", ["d"], note)
    rel_check("GLA-vector = eq 17, panel d (Thm 5)", "gla_vector", "eq17", ["d"], note)
    rel_check("GLA-vector = eq 17, panels a-c", "gla_vector", "eq17",
              [n for n in ["a", "b", "c"] if n in config.vector_panels], note)
    if "d" in names and "risk_gla_vector" in r and "risk_gla" in r and big.any():
        i = names.index("d")
        gap = (_best(r, "gla")[i] - _best(r, "gla_vector")[i])[big]
        se = np.sqrt(_at_best(r, "gla", "se")[i] ** 2 + _at_best(r, "gla_vector", "se")[i] ** 2)[big]
        theory_gap = (r["eq24"][i] - r["eq17"][i])[big]
        k = int(np.argmax(theory_gap))
        checks.append(check_at_most(
            f"panel d: GLA-vector below GLA by half the eq 24 − eq 17 gap at n̄ = {n_bars[big][k]} "
            "(0.5·gap − measured, ≤ 0)", 0.5 * theory_gap[k] - gap[k], 0.0,
            f"measured gap {gap[k]:.4f} ± {se[k]:.4f}, theory gap {theory_gap[k]:.4f}"))
    rel_check("GLA-wo = WPGD with every gate ½ (derived here), all panels", "gla_wo", "halfgate", names,
              "without delimiters the tokens are mean-zero and the gate has no bias: training settles at w_g ≈ 0, "
              "ω_j = 2^{j−n−1}")
    bcd = pidx(["b", "c", "d"])
    if "risk_gla_wo" in r and "risk_linatt" in r and bcd and big.any():
        margin = (_best(r, "gla_wo") - _best(r, "linatt"))[np.ix_(bcd, np.nonzero(big)[0])]
        k = np.unravel_index(np.argmin(margin), margin.shape)
        checks.append(check_at_most(
            f"GLA-wo above LinAtt, panels b-d, n̄ ≥ {config.check_from} (−min margin; at panel {names[bcd[k[0]]]}, "
            f"n̄ = {n_bars[big][k[1]]})", -float(margin[k]), 0.0,
            "the paper's 'GLA-wo worst'. Not claimed for panel a: there the ½-gate recency weighting helps (the "
            "relevant task is the last block) and GLA-wo lies below LinAtt at small n̄, as its closed form predicts"))
    worst, where = -np.inf, ""
    for name in ("linatt", "gla", "gla_vector"):
        if f"risk_{name}" not in r:
            continue
        best = _best(r, name)
        se = _at_best(r, name, "se")
        for i in range(best.shape[0]):
            if not np.all(np.isfinite(best[i])):
                continue
            inc = np.diff(best[i]) - 3 * np.sqrt(se[i, 1:] ** 2 + se[i, :-1] ** 2)
            k = int(np.argmax(inc))
            if inc[k] > worst:
                worst, where = float(inc[k]), f"{name}, panel {names[i]}, n̄ {n_bars[k]} → {n_bars[k + 1]}"
    checks.append(check_at_most(f"LinAtt, GLA, GLA-vector non-increasing in n̄ (largest increase beyond 3 SE: {where})",
                                worst, config.monotone_tol,
                                "risk/d units; trained models carry a finite-training excess that varies by "
                                f"≲ {config.monotone_tol} between neighbouring n̄. GLA-wo is excluded: its ½-gate "
                                "closed form rises with n̄ in panels c-d (the relevant task recedes)"))
    if config.restricted:
        for name, key, label in (("linatt", "eq24", "eq 24"), ("gla", "eq22", "eq 22 (= eq 17 in a-c, eq 24 in d)"),
                                 ("gla_vector", "thm5", "Thm 5 (= eq 17)")):
            if f"restricted_{name}" not in r:
                continue
            pos = np.broadcast_to(n_bars >= 1, r[key].shape)
            worst, k = _worst_rel(np.min(r[f"restricted_{name}"], axis=0), r[key], pos)
            checks.append(check_at_most(
                f"restricted {FIG1_KINDS[name].label} on the exact risk = {label} (worst relative gap, panel "
                f"{names[k[0]]}, n̄ = {n_bars[k[1]]})", worst, RESTRICTED_TOL,
                "eq 20 weights + gates on the contexts, Adam on eq 37 (population engine), min over seeds"))
    checks += _match_checks(config, r)
    return checks


def _match_checks(config: Fig1Config, r: dict) -> list:
    """Issue 22: the restricted GLA-vector against the optimal WPGD predictor, and the Bayes floor."""
    names = list(config.panels)
    n_bars = np.asarray(config.n_bars)
    out = []
    idx = [names.index(n) for n in MATCH_PANELS if n in names]
    pos = np.nonzero(n_bars >= 1)[0]
    if "match_gla_vector_gap" in r and "restricted_gla_vector" in r and idx and pos.size:
        # the run of least exact risk per (panel, n̄), the protocol of the restricted check above (best of seeds)
        best = np.argmin(r["restricted_gla_vector"], axis=0)[None]

        def at_best(key):
            return np.take_along_axis(r[key], best, axis=0)[0][np.ix_(idx, pos)]

        rel = at_best("match_gla_vector_gap") / at_best("match_gla_vector_opt_risk")
        i, g = np.unravel_index(np.argmax(rel), rel.shape)
        out.append(check_at_most(
            f"restricted GLA-vector = optimal WPGD (eq 17) on held-out prompts, panels a-c, best seed: worst gap "
            f"E(ŷ − ŷ*)² / L*_WPGD (panel {names[idx[i]]}, n̄ = {n_bars[pos[g]]})", float(rel[i, g]), MATCH_TOL,
            f"{config.n_match} prompts per (seed, panel, n̄); gap {at_best('match_gla_vector_gap')[i, g]:.3g} ± "
            f"{at_best('match_gla_vector_gap_se')[i, g]:.2g} (risk/d). Tolerance: {MATCH_TOL_NOTE}"))
        cos = at_best("match_gla_vector_cosine")
        i, g = np.unravel_index(np.argmin(cos), cos.shape)
        out.append(check_at_least(
            f"restricted GLA-vector = optimal WPGD, panels a-c, best seed: worst query-sensitivity cosine (panel "
            f"{names[idx[i]]}, n̄ = {n_bars[pos[g]]})", float(cos[i, g]), COSINE_MIN,
            "mean over held-out prompts of cos(∂ŷ_GLA/∂x_q, ∂ŷ_WPGD*/∂x_q) (von Oswald et al. 2023); our 0.99"))
    if "bayes_risk" in r:
        S = r["bayes_risk"].shape[0]
        bayes = r["bayes_risk"].mean(axis=0)  # the Bayes risk does not depend on the seed's delimiters
        bayes_se = np.sqrt(np.sum(r["bayes_risk_se"] ** 2, axis=0)) / S
        worst, where = np.inf, ""
        for name in FIG1_KINDS:
            for prefix, se_key in (("risk_", f"se_{name}"), ("restricted_", None)):
                if f"{prefix}{name}" not in r:
                    continue
                risk = r[f"{prefix}{name}"]
                se = np.zeros_like(risk) if se_key is None else r[se_key]
                margin = risk - bayes[None] + BAYES_Z * np.sqrt(se ** 2 + bayes_se[None] ** 2)
                margin[..., n_bars < 1] = np.nan  # no context: every predictor is ŷ = 0, risk d + σ² exactly
                if np.all(np.isnan(margin)):
                    continue
                k = np.unravel_index(np.nanargmin(margin), margin.shape)
                if margin[k] < worst:
                    worst = float(margin[k])
                    where = (f"{'restricted ' if se_key is None else ''}{FIG1_KINDS[name].label}, panel {names[k[1]]}, "
                             f"n̄ = {n_bars[k[2]]}: risk {risk[k]:.4f}, Bayes {bayes[k[1:]]:.4f}")
        out.append(check_at_least(
            f"no trained model beats the Bayes risk by more than {BAYES_Z:g} SE, n̄ ≥ 1: min (risk − Bayes + "
            f"{BAYES_Z:g} SE), risk/d ({where})", worst, 0.0,
            "Bayes risk: exact risk given the contexts (iclab.baselines.multitask_bayes_risk) averaged over the "
            f"{config.n_match} held-out prompts per seed; model risks as in the other checks (control variate, or exact "
            "for the restricted models); SE of both combined"))
    return out


def plot_fig1(config: Fig1Config, r: dict):
    names = list(config.panels)
    n_bars = np.asarray(config.n_bars)
    fig, axes = figure(ncols=len(names), width=3.6, height=3.2)
    for i, (ax, name) in enumerate(zip(axes[0], names)):
        r1, r2 = r["panels"][i]
        ax.plot(n_bars, r["eq24"][i], color=COLOR["eq24"], ls="--", lw=1.2, label="$L^*_{ATT}$ (24)")
        ax.plot(n_bars, r["eq17"][i], color=COLOR["eq17"], ls="--", lw=1.2, label="$L^*_{WPGD}$ (17)")
        if "risk_gla_wo" in r:
            ax.plot(n_bars, r["halfgate"][i], color=COLOR["gla_wo"], ls=":", lw=1.2, label="gates ½ (derived)")
        grey = {}
        if "match_gla_vector_alg_risk" in r:
            grey["WPGD* (eq 17), held-out"] = np.mean(r["match_gla_vector_alg_risk"], axis=0)[i]
        if "bayes_risk" in r:
            grey["Bayes"] = np.mean(r["bayes_risk"], axis=0)[i]
        baseline_lines(ax, n_bars, grey, label_at="end")
        for kind, shown in FIG1_KINDS.items():
            if f"risk_{kind}" in r and np.all(np.isfinite(_best(r, kind)[i])):
                ax.plot(n_bars, _best(r, kind)[i], color=COLOR[kind], lw=1.6, marker="o", ms=2.5, label=shown.label)
            if f"restricted_{kind}" in r:
                ax.plot(n_bars, np.min(r[f"restricted_{kind}"], 0)[i], ls="none", marker="s", ms=5, mfc="none",
                        color=COLOR[kind], label=f"{shown.label}, restricted, eq 37" if i == 0 else None)
        ax.set_title(f"({name}) $r_1$ = {r1:g}, $r_2$ = {r2:g}", fontsize=9)
        ax.set_xlabel(r"samples per task $\bar n$")
        if i == 0:
            ax.set_ylabel("test risk / d")
    h, lab = axes[0][0].get_legend_handles_labels()
    axes[0][0].legend(h, lab, fontsize=6, loc="upper right")
    restarts = f"; GLA, GLA-vector × {config.restarts} restarts in panel(s) {','.join(config.restart_panels)}" \
        if config.restarts > 1 and config.restart_panels else ""
    fig.suptitle(f"gating Fig 1: d = {config.d}, p = {config.p}, σ² = {config.sigma2:g}; best of {config.seeds} "
                 f"seeds{restarts}; {config.steps} Adam steps (lr {config.lr:g}, {config.lr_schedule}), batch "
                 f"{config.batch}; squares: restricted models trained on the exact risk; thin grey: baselines on held-out "
                 "prompts", fontsize=8)
    return fig


register(
    Experiment(
        id="gating.fig1",
        title="Trained LinAtt / GLA / GLA-wo / GLA-vector vs n̄ against eq 24 and eq 17, four task correlations",
        paper=PAPER,
        reference="Fig 1 (a)-(d), App B.1; eqs 17, 22, 24, Thms 4-5",
        config=Fig1Config,
        presets={
            "quick": {"d": 5, "p": 5, "n_bars": [0, 2, 5, 10], "vector_panels": ["d"], "restarts": 3, "steps": 1000,
                      "lr": 0.01, "lr_schedule": "cosine", "seeds": 2, "n_eval": 4096, "restricted_steps": 800,
                      "record_every": 100},
            "paper": {"seeds": 10},
        },
        run=run_fig1,
        checks=checks_fig1,
        plot=plot_fig1,
        memory=memory_fig1,
        shards=shards_fig1,
        run_shard=run_shard_fig1,
        assemble=assemble_fig1,
        notes=[
            "Models are unrestricted one-layer GLAs (W_q, W_k, W_v ∈ R^{D×D}, D = d+1+p) with sigmoid gates without "
            "bias: scalar φ(w_gᵀz)1 (GLA, GLA-wo) or vector φ(W_g z)1ᵀ with a linear head (GLA-vector); LinAtt has "
            "G ≡ 1. LinAtt, GLA and GLA-vector read the delimiter prompt (eq 19); GLA-wo reads [x; y] tokens.",
            "Readout: the label coordinate of o_{n+1} (LinAtt, GLA, GLA-wo); hᵀo_{n+1} (GLA-vector, Thm 5).",
            "Contexts c̄_0..c̄_2 ~ N(0, I_p), one draw per seed; the query token carries c̄_0 (unspecified in the paper; "
            "Thm 4's proof needs the query's gate 1).",
            "Risk: best over runs (seeds, and restarts where set) of a control-variate estimate against the optimal "
            "predictor of the compared closed form on the same test prompts (module _common); raw Monte-Carlo MSEs "
            "are stored too.",
            "All models of a seed are trained jointly on the sum of their losses with shared random numbers; "
            "one model per (kind, panel, n̄).",
            "quick: d = 5 (p = 5 as the paper: with p = 3 the three random contexts are often ill-conditioned and "
            "the gates need weights several times larger to open, which 1000 steps do not reach), n̄ ∈ {0, 2, 5, 10}, "
            "GLA-vector in panel d only, 1000 steps at lr 0.01 with cosine decay, best of 2 seeds, and in panel d of "
            "2 seeds × 3 restarts for GLA and GLA-vector, 4096 test prompts (paper: d = 10, p = 5, n̄ = 0..50, 10000 "
            "steps at constant lr 1e-3, best of 10 runs).",
            "Gated models sit on a plateau (gates ≈ ½, risk ≈ that of ŷ = 0) for a random share of the quick "
            "preset's steps before the gates open; a late escape leaves a run far from its optimum, most often "
            "GLA-vector in panel d, hence the best-of-runs protocol and the restarts there.",
            "Init (unspecified): N(0, 0.1²) entries plus 0.3·I on W_q, W_k, W_v (0.3·e_y on the head), each model "
            "from its own key fold_in(fold_in(key_s, 10), member id) (module _common). From a plain Gaussian init "
            "many runs stall in a rank-one saddle (the value reads x, the key reads y).",
            "GLA-wo learns w_g ≈ 0, i.e. every gate ½: its dotted curve is eq 37 at ω_j = 2^{j−n−1} (derived here). This "
            "recency weighting puts GLA-wo BELOW LinAtt in panel a at small n̄ and makes it rise with n̄ in panels "
            "c-d, so 'GLA-wo worst' and 'every curve decreases' are checked in panels b-d and for the other models.",
            "Squares: restricted models (eq 20 weights, gates acting only on the contexts) trained with Adam on the "
            "exact risk eq 37 (population engine), checked against eq 24 / eq 22 / Thm 5 to 1 %.",
            "Algorithm match (extension, not in the paper): the restricted GLA-vector, run as the full one-layer "
            "GLA of Thm 5 (gla.restricted_to_full) on delimiter tokens, against the global WPGD optimum of eq 17 "
            "(theory.wpgd_optimum → iclab.baselines.wpgd on plain arrays) on n_match held-out prompts per (seed, panel, "
            "n̄ ≥ 1) from their own stream, panels a-c: gap E(ŷ − ŷ*)² relative to L*_WPGD and query-sensitivity "
            "cosine ≥ 0.99. Bayes floor: iclab.baselines.multitask_bayes_risk (exact given the contexts) averaged over "
            "the same prompts; no trained model, unrestricted or restricted, below it by more than 3 SE. Thin grey "
            "lines: WPGD*'s held-out risk and the Bayes risk.",
            "Shards (iclab run --executor local|ray): one per panel × block of NBAR_BLOCK consecutive n̄, each the "
            "joint training, evaluation, restricted models and baselines of its members at the whole grid's n̄_max "
            "(so the same batches and init keys as in the joint run); the assembled arrays equal the unsharded "
            "run's to float rounding.",
        ],
    )
)
