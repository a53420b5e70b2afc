"""drift Fig 1: GLA's train error against λ for several drift rates γ (a), and the λ = 0.9 model
tested at other prompt lengths m against the test-time forget factor λ̄ (b-d)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.experiments._config import param
from iclab.experiments._plot import COLORS, baseline_lines, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_abs, check_at_least, check_at_most, check_equal
from iclab.experiments.drift._common import (
    PAPER,
    PAPER_GAMMAS,
    RANK_ONE_SHARE,
    SPEC_TABLE,
    TrainConfig,
    eq15_algorithm_match,
    eval_prompts,
    evaluation_memory,
    kalman_risk,
    model_errors,
    rank_one_route_share,
    saddle_check,
    train_grid,
    training_memory,
)
from iclab.experiments._memory import FLOAT64, largest, total
from iclab.theory import drift as theory

# Tolerance of every trained-vs-theory comparison (our 3 %; the paper gives none): AdamW with a constant lr keeps
# the weights fluctuating around the optimum, which costs an excess error of order 1 % at the
# paper's batch; the estimates themselves carry a standard error of about 0.1-0.3 %.
REL_TOL = 0.03
_GRID_RTOL = 1e-9
# Algorithm match (our criterion): a model that implements an algorithm has query-sensitivity cosine ≥ 0.99 with
# it; no trained model beats the Bayes risk by more than 3 standard errors; Monte Carlo twins agree within 4 SE.
COSINE_MIN = 0.99
BAYES_Z = 3.0
Z_MC = 4.0
#: fold_in stream (of PRNGKey(seed)) of the held-out prompts of the algorithm match and the Kalman filter; the
#: evaluation prompts of panels (a-d) use 10_000.
MATCH_STREAM = 20_000


def _grid(lo, hi, k):
    return [round(float(v), 10) for v in np.linspace(lo, hi, k)]


class Fig1Config(TrainConfig):
    gammas: list[float] = param(list(PAPER_GAMMAS), "AR(1) coefficients γ of panel (a), one trained sweep each",
                                paper=list(PAPER_GAMMAS),
                                paper_note="'several γ'; the γ of the paper's LMS/RLS table")
    lams: list[float] = param(_grid(0.6, 1.0, 17), "forget factors λ trained in panel (a); must include 1 (LA)",
                              paper=None, paper_note="unspecified")
    shift_gamma: float = param(0.95, "γ (one of `gammas`) of the model tested in panels (b-d)", paper=0.95,
                               paper_note="unspecified; our choice", gt=0, le=1.5)
    shift_lam: float = param(0.9, "training λ (one of `lams`) of the model tested in panels (b-d)", paper=0.9,
                             gt=0, le=1.5)
    test_ms: list[int] = param([10, 50, 100], "test prompt lengths m of panels (b-d)", paper=[10, 50, 100])
    lam_bars: list[float] = param(_grid(0.6, 1.0, 17), "test-time forget factors λ̄ of panels (b-d)",
                                  paper=None, paper_note="unspecified; x-axis read as λ̄ (our reading)")
    test_gamma: float | None = param(None, "test γ̄ of panels (b-d); null: the training γ", paper=None,
                                     paper_note="unspecified", gt=0, le=1.5)
    learn_lam: bool = param(True, "also train one GLA per γ with a learnt λ = sigmoid(θ) (extension)",
                            paper=False, paper_note="not in the paper: λ is swept there")
    learn_lam_init: float = param(0.5, "initial λ of the learnt-λ models", gt=0, lt=1)
    n_match: int = param(1000, "held-out prompts per γ on which every trained model is matched with eq 15's predictor "
                         "and the Kalman filter's Bayes risk is averaged", paper=None,
                         paper_note="extension: not in the paper", ge=2, le=1_000_000)

    @model_validator(mode="after")
    def _grids(self):
        if not any(abs(v - 1.0) < _GRID_RTOL for v in self.lams):
            raise ValueError("lams must include 1.0 (linear attention)")
        if not any(abs(v - self.shift_lam) < _GRID_RTOL for v in self.lams):
            raise ValueError(f"lams must include shift_lam = {self.shift_lam}")
        if not any(abs(v - self.shift_gamma) < _GRID_RTOL for v in self.gammas):
            raise ValueError(f"gammas must include shift_gamma = {self.shift_gamma}")
        if any(not (0 < v <= 1.5) for v in self.lams + self.lam_bars):
            raise ValueError("lams and lam_bars must lie in (0, 1.5]")
        if any(not (0 < v <= 1.5) for v in self.gammas):
            raise ValueError("gammas must lie in (0, 1.5]")
        if any(m < 1 for m in self.test_ms):
            raise ValueError("test_ms must be >= 1")
        return self


def _eval_key(config, j, stream: int = 10_000):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), stream), j)


def run_fig1(config: Fig1Config, reporter) -> dict:
    gam = np.asarray(config.gammas)
    lams = np.asarray(config.lams)
    G, K, S = gam.size, lams.size, config.seeds
    out: dict = {"gammas": gam, "lams": lams}

    # theory: Theorem 2 on a fine grid and at the sweep's λ; λ* by scalar minimisation
    fine = np.linspace(min(0.5, lams.min()), max(1.0, lams.max()), 401)
    out["lam_fine"] = fine
    out["theory_fine"] = np.stack([theory.train_error(fine, **config.setting(g)) for g in gam])
    out["theory_grid"] = np.stack([theory.train_error(lams, **config.setting(g)) for g in gam])
    opt = [theory.optimal_forget_factor(**config.setting(g)) for g in gam]
    out["lam_star"] = np.array([o[0] for o in opt])
    out["err_star"] = np.array([o[1] for o in opt])
    out["err_la"] = np.array([theory.train_error(1.0, **config.setting(g)) for g in gam])

    # training: every (γ, λ) model in one vmapped run; an extra column of learnt-λ models (extension)
    grid = np.tile(lams, (G, 1))
    learn = np.zeros((G, K), bool)
    if config.learn_lam:
        grid = np.concatenate([grid, np.full((G, 1), config.learn_lam_init)], axis=1)
        learn = np.concatenate([learn, np.ones((G, 1), bool)], axis=1)
    _, params = train_grid(config, gam, grid, learn=learn, reporter=reporter,
                           label=f"GLA sweep ({G} γ × {K} λ{' + learnt λ' if config.learn_lam else ''}, {S} seed"
                                 f"{'s' * (S > 1)})")
    if config.learn_lam:
        learned = np.asarray(jax.nn.sigmoid(params["theta"][:, :, K]))
        out["learned_lam"] = learned
        out["learned_lam_theory_err"] = np.stack([[theory.train_error(float(v), **config.setting(g))
                                                   for v, g in zip(row, gam)] for row in learned])
        params = jax.tree_util.tree_map(lambda a: a[:, :, :K], params)
        params.pop("theta")

    # the rank-one saddle of full weights (theory.drift.rank_one_saddle_errors) and each model's route share
    out["saddle_grid"] = np.stack([theory.rank_one_saddle_errors(lams, **config.setting(g)) for g in gam])  # (G, K, d)
    out["saddle_fine"] = np.stack([theory.rank_one_saddle_errors(fine, **config.setting(g)).min(-1) for g in gam])
    out["rank_one_share"] = rank_one_route_share(params)  # (S, G, K)
    out["exact_eval"] = np.bool_(config.parametrisation == "restricted")
    est: dict = {}
    for g in range(G):
        key = _eval_key(config, g)
        for s in range(S):
            p = jax.tree_util.tree_map(lambda a: a[s, g], params)
            e = model_errors(config, p, lams, gam[g], lams, out["theory_grid"][g], key)
            for k, v in e.items():
                est.setdefault(k, np.zeros((S, G, K)))[s, g] = v
    out.update({f"trained_{k}": v for k, v in est.items()})
    out.update(_baseline_arrays(config, gam, lams, params))

    # panels (b-d): the (shift_gamma, shift_lam) model at test lengths m and test-time λ̄ (eq 18)
    g0 = int(np.argmin(np.abs(gam - config.shift_gamma)))
    k0 = int(np.argmin(np.abs(lams - config.shift_lam)))
    gbar = config.shift_gamma if config.test_gamma is None else config.test_gamma
    lbs = np.asarray(config.lam_bars)
    ms = np.asarray(config.test_ms)
    fine_b = np.linspace(min(0.5, lbs.min()), max(1.0, lbs.max()), 401)
    out.update(lam_bars=lbs, test_ms=ms, lam_bar_fine=fine_b)
    train = config.setting(gam[g0])
    out["test_theory_fine"] = np.stack([theory.test_error(lams[k0], **train, lam_bar=fine_b,
                                                          **config.test_setting(gbar, int(m))) for m in ms])
    out["test_theory_grid"] = np.stack([theory.test_error(lams[k0], **train, lam_bar=lbs,
                                                          **config.test_setting(gbar, int(m))) for m in ms])
    test: dict = {}
    for j, m in enumerate(ms):
        for s in range(S):
            p = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[s, g0, k0], (lbs.size,) + a.shape[3:]), params)
            e = model_errors(config, p, np.full(lbs.size, lams[k0]), gam[g0], lbs, out["test_theory_grid"][j],
                             _eval_key(config, 100 + j), gamma_eval=gbar, m=int(m))
            for k, v in e.items():
                test.setdefault(k, np.zeros((S, ms.size, lbs.size)))[s, j] = v
    out.update({f"test_{k}": v for k, v in test.items()})

    return out


def memory_fig1(config: Fig1Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig1`'s memory: the joint training of every (γ, λ) model
    (:func:`iclab.experiments.drift._common.training_memory`), the largest Monte Carlo evaluation (panel a: K
    models on n_eval prompts of n + 1 tokens; panels b-d: one model at every λ̄ on prompts of m + 1 tokens), and
    the held-out match: n_match float64 prompts with the Kalman filter's (n_match, d, d) covariances and
    eq 15's predictions of every model. The phases follow each other: the largest is the need."""
    G, K, d = len(config.gammas), len(config.lams), config.d
    n = config.n_match
    return largest(total(training_memory(config, G=G, models=G * (K + int(config.learn_lam)))),
                   evaluation_memory(n=config.n_eval, T=config.n + 1, d=d, models=K),
                   evaluation_memory(n=config.n_eval, T=max(config.test_ms) + 1, d=d, models=len(config.lam_bars)),
                   (FLOAT64 * n * (8 * (config.n + 1) * (d + 1) + 6 * d * d + 8 * K),
                    f"the {n} held-out prompts of the algorithm match and the Kalman filter"))


def _baseline_arrays(config: Fig1Config, gam, lams, params) -> dict:
    """Issue 22 on panel (a): every trained (γ, λ) model against eq 15's predictor at its λ, and the Kalman
    filter (the Bayes predictor), on ``n_match`` held-out prompts per γ from the MATCH_STREAM.

    Returns:
        match_gap, match_gap_se, match_cosine, match_cosine_se (S, G, K): E(ŷ − ŷ_eq15)² (no ½) and the mean
        query-sensitivity cosine; match_alg_risk, match_alg_risk_se (S, G, K): eq 15's Monte Carlo error at each
        λ (the same for every seed); kalman_risk, kalman_risk_se (G,): the exact Bayes risk given the contexts,
        averaged; kalman_mc, kalman_mc_se (G,): the Kalman prediction's squared error on the same prompts, and
        kalman_mc_diff, kalman_mc_diff_se (G,) its excess over the exact risk, paired per prompt.
    """
    S, G, K = config.seeds, len(gam), len(lams)
    out = {f"match_{k}": np.zeros((S, G, K)) for k in ("gap", "gap_se", "cosine", "cosine_se", "alg_risk", "alg_risk_se")}
    out.update({f"kalman_{k}": np.zeros(G) for k in ("risk", "risk_se", "mc", "mc_se", "mc_diff", "mc_diff_se")})
    for g in range(G):
        Z, y = eval_prompts(config, _eval_key(config, g, MATCH_STREAM), config.n_match, gam[g])
        kal = kalman_risk(config, float(gam[g]), Z, y)
        out["kalman_risk"][g], out["kalman_risk_se"][g] = kal["bayes"], kal["bayes_se"]
        out["kalman_mc"][g], out["kalman_mc_se"][g] = kal["bayes_mc"], kal["bayes_mc_se"]
        out["kalman_mc_diff"][g], out["kalman_mc_diff_se"][g] = kal["mc_minus_bayes"], kal["mc_minus_bayes_se"]
        for s in range(S):
            p = jax.tree_util.tree_map(lambda a: a[s, g], params)
            for k, v in eq15_algorithm_match(config, p, lams, float(gam[g]), Z, y).items():
                out[f"match_{k}"][s, g] = v
    return out


def _spec_setting(config: Fig1Config) -> bool:
    return (config.d, config.n, config.sigma_w2, config.sigma_e2, config.eigenvalues) == (10, 100, 1.0, 0.01, None)


def checks_fig1(config: Fig1Config, r: dict) -> list:
    gam, lams = r["gammas"], r["lams"]
    E = r["theory_grid"]
    cv = r["trained_err"]
    spacing = float(np.max(np.diff(np.sort(lams))))
    k1 = int(np.argmin(np.abs(lams - 1.0)))
    rel = np.abs(cv / E[None] - 1)
    s, g, k = np.unravel_index(np.argmax(rel), rel.shape)
    exact = bool(r["exact_eval"])
    how = ("exact population error of the trained restricted weights (theory.drift.restricted_error)" if exact else
           "Thm 2 + mean[(ŷ−y)² − (ŷ_opt−y)²] on shared fresh prompts (standard error ≤ "
           f"{np.max(r['trained_err_se'] / E[None]):.2%})")
    out = [
        check_at_most(f"(a) trained GLA error = Theorem 2 at every (γ, λ) (worst relative gap, at γ = {gam[g]}, "
                      f"λ = {lams[k]:.3f})", rel.max(), REL_TOL, f"trained error: {how}; tolerance: our 3 %"),
    ]
    if "saddle_grid" in r:
        S = cv.shape[0]
        out.append(saddle_check(cv.reshape(S, -1), E.reshape(-1), r["saddle_grid"].reshape(E.size, -1),
                                r["rank_one_share"].reshape(S, -1),
                                [f"γ = {gv:g}, λ = {lv:g}" for gv in gam for lv in lams], REL_TOL))
    if not exact:
        z_opt = np.abs(r["trained_opt"] - E[None]) / r["trained_opt_se"]
        out.append(check_at_most("(a) Monte Carlo error of the eq-15 optimum = Theorem 2 (worst |z| over γ, λ)",
                                 z_opt.max(), 4.0, "raw MSE of the closed-form optimal predictor on the evaluation "
                                 "prompts, in standard errors; tests the sampler against the theory without training"))
    # the starred λ: grid argmin of each sweep
    lam_hat = lams[np.argmin(cv, axis=-1)]  # (S, G)
    err_hat = np.min(cv, axis=-1)
    out += [
        check_equal("(a) trained λ* < 1 for every γ (worst seed)", int(np.min(np.sum(lam_hat < 1.0, axis=-1))), len(gam)),
        check_equal("(a) trained err(λ*) < err(λ = 1) for every γ (worst seed)",
                    int(np.min(np.sum(err_hat < cv[..., k1], axis=-1))), len(gam)),
    ]
    th_at_hat = E[np.arange(len(gam))[None, :], np.argmin(cv, axis=-1)]  # Theorem 2 at the trained λ*, (S, G)
    out.append(check_at_most("(a) Theorem 2 at the trained λ* ≤ (1 + 3 %) × its minimum over the grid (worst γ, seed)",
                             float(np.max(th_at_hat / E.min(axis=-1)[None] - 1)), REL_TOL,
                             "the U is flat near λ*: the trained argmin may move to where the curve lies within the "
                             "trained errors' few-‰ excess of its grid minimum"))
    if _spec_setting(config) and all(float(v) in SPEC_TABLE for v in gam):
        tab = np.array([SPEC_TABLE[float(v)] for v in gam])
        star_grid = lams[np.argmin(E, axis=-1)]
        out += [
            check_at_most("(a) trained λ* (argmin of the trained errors on the grid): |λ − table λ*| ≤ grid spacing "
                          "(worst γ, seed)", float(np.max(np.abs(lam_hat - tab[None, :, 0]))), spacing,
                          "reference table (Theorem 2 minimised over λ); the trained argmin can only land on the grid"),
            check_at_most("(a) starred λ of the Theorem 2 curve on the grid: |λ − table λ*| ≤ grid spacing (worst γ)",
                          float(np.max(np.abs(star_grid - tab[:, 0]))), spacing,
                          "reference table: Theorem 2 minimised over λ (d = 10, n = 100, Λ = I)"),
            check_abs("(a) λ* (Theorem 2 minimised over λ) = table (worst γ)",
                      float(r["lam_star"][np.argmax(np.abs(r["lam_star"] - tab[:, 0]))]),
                      float(tab[np.argmax(np.abs(r["lam_star"] - tab[:, 0])), 0]), 1e-4),
            check_abs("(a) err(λ*) (Theorem 2) = table (worst γ)",
                      float(r["err_star"][np.argmax(np.abs(r["err_star"] - tab[:, 1]))]),
                      float(tab[np.argmax(np.abs(r["err_star"] - tab[:, 1])), 1]), 1e-4),
            check_abs("(a) err(λ = 1), linear attention (Theorem 2) = table (worst γ)",
                      float(r["err_la"][np.argmax(np.abs(r["err_la"] - tab[:, 2]))]),
                      float(tab[np.argmax(np.abs(r["err_la"] - tab[:, 2])), 2]), 1e-4),
        ]
    # panels (b-d)
    Et = r["test_theory_grid"]
    relt = np.abs(r["test_err"] / Et[None] - 1)
    s, j, k = np.unravel_index(np.argmax(relt), relt.shape)
    lbs = r["lam_bars"]
    out.append(check_at_most(f"(b-d) trained test error = Theorem 3 at every (m, λ̄) (worst relative gap, at m = "
                             f"{r['test_ms'][j]}, λ̄ = {lbs[k]:.3f})", relt.max(), REL_TOL,
                             "same estimator as (a), with the eq-18 optimum at λ̄"))
    if not exact:
        zt = np.abs(r["test_opt"] - Et[None]) / r["test_opt_se"]
        out.append(check_at_most("(b-d) Monte Carlo error of the eq-18 optimum = Theorem 3 (worst |z|)", zt.max(), 4.0))
    sp_b = float(np.max(np.diff(np.sort(lbs))))
    best_tr = lbs[np.argmin(r["test_err"], axis=-1)]
    best_th = lbs[np.argmin(Et, axis=-1)]
    out.append(check_at_most("(b-d) best test-time λ̄ of the trained model = Theorem 3's, each m (worst |Δλ̄|)",
                             float(np.max(np.abs(best_tr - best_th[None]))), sp_b,
                             "tolerance: one grid spacing of λ̄"))
    if "learned_lam" in r:
        ex = r["learned_lam_theory_err"] / r["err_star"][None] - 1
        i = np.unravel_index(np.argmax(ex), ex.shape)
        out.append(check_at_most(f"(ext) learnt λ = sigmoid(θ) is near-optimal: Theorem 2 at it ≤ (1 + 1 %) err(λ*) "
                                 f"(worst: γ = {gam[i[1]]}, λ = {r['learned_lam'][i]:.4f} vs λ* = {r['lam_star'][i[1]]:.4f})",
                                 float(ex.max()), 0.01,
                                 "the loss is flat in λ near λ*, so λ itself is only loosely pinned; 1 % of err(λ*) is "
                                 "a third of the weights' tolerance"))
    out += _match_checks(config, r)
    return out


def _match_checks(config: Fig1Config, r: dict) -> list:
    """Issue 22: the trained GLA at λ* against eq 15's predictor, and the Kalman filter's Bayes floor."""
    if "match_gap" not in r:
        return []
    gam, lams, E = r["gammas"], r["lams"], r["theory_grid"]
    G = len(gam)
    ks = np.array([int(np.argmin(np.abs(lams - v))) for v in r["lam_star"]])  # the grid λ nearest λ*, per γ
    at = (slice(None), np.arange(G), ks)
    rel = r["match_gap"][at] / E[np.arange(G), ks][None]  # (S, G)
    s, g = np.unravel_index(np.argmax(rel), rel.shape)
    out = [check_at_most(
        f"(a) trained GLA at λ* = eq 15's predictor on held-out prompts: worst gap E(ŷ − ŷ_eq15)² / Thm 2 error "
        f"(γ = {gam[g]:g}, grid λ = {lams[ks[g]]:g} nearest λ* = {r['lam_star'][g]:.4f}, seed {s})",
        float(rel[s, g]), REL_TOL,
        f"{config.n_match} held-out prompts per γ; gap {r['match_gap'][at][s, g]:.3g} ± {r['match_gap_se'][at][s, g]:.2g}. "
        "ŷ = Gᵀ(u₋₁U₁₁)x is linear in the matrix u₋₁U₁₁ and eq 15 is the error's minimiser over it, so the expected gap "
        "IS the excess error (Pythagoras): the 3 % of the error check bounds it")]
    cos = r["match_cosine"][at]
    s, g = np.unravel_index(np.argmin(cos), cos.shape)
    out.append(check_at_least(
        f"(a) trained GLA at λ* = eq 15's predictor: worst query-sensitivity cosine (γ = {gam[g]:g}, seed {s})",
        float(cos[s, g]), COSINE_MIN,
        "mean over held-out prompts of cos(∂ŷ_GLA/∂x_q, ∂ŷ_eq15/∂x_q) (von Oswald et al. 2023); our 0.99"))
    if bool(r["exact_eval"]):
        z = (r["match_gap"] - (r["trained_err"] - E[None])) / r["match_gap_se"]
        i = np.unravel_index(np.argmax(np.abs(z)), z.shape)
        # The worst of z.size z-scores: a family-wise threshold (Bonferroni at 1e-3 over all models, never
        # below Z_MC), or a correct match would fail by chance once models are many.
        from scipy.stats import norm

        z_max = max(Z_MC, float(norm.isf(1e-3 / (2 * z.size))))
        out.append(check_at_most(
            f"(a) held-out gap = exact excess error err − Thm 2 at every (γ, λ) (worst |z| of {z.size}, "
            f"γ = {gam[i[1]]:g}, λ = {lams[i[2]]:g})", float(np.abs(z[i])), z_max,
            "Pythagoras for the restricted class (previous check): the Monte Carlo gap on held-out prompts against "
            "theory.drift.restricted_error of the same weights, in standard errors of the gap; tests the algorithm "
            "match and the layouts against the closed form. Threshold: two-sided Bonferroni at 1e-3 over the models"))
    zk = r["kalman_mc_diff"] / r["kalman_mc_diff_se"]
    g = int(np.argmax(np.abs(zk)))
    out.append(check_at_most(
        f"(a) Kalman filter's Monte Carlo error = its exact Bayes risk (worst |z|, γ = {gam[g]:g})", float(np.abs(zk[g])),
        Z_MC, "squared error of iclab.baselines.kalman_posterior_mean minus kalman_bayes_risk, paired per held-out "
        "prompt: tests that the filter's AR(1) model is the sampler's, without training"))
    err, err_se = r["trained_err"], r["trained_err_se"]
    margin = err - r["kalman_risk"][None, :, None] + BAYES_Z * np.sqrt(err_se ** 2 + r["kalman_risk_se"][None, :, None] ** 2)
    i = np.unravel_index(np.argmin(margin), margin.shape)
    out.append(check_at_least(
        f"(a) no trained GLA beats the Bayes risk (Kalman filter) by more than {BAYES_Z:g} SE: min (err − Bayes + "
        f"{BAYES_Z:g} SE) (γ = {gam[i[1]]:g}, λ = {lams[i[2]]:g}: err {err[i]:.4f}, Bayes {r['kalman_risk'][i[1]]:.4f})",
        float(margin[i]), 0.0,
        "Bayes risk: the exact risk given the context inputs (iclab.baselines.kalman_bayes_risk) averaged over the "
        "held-out prompts of each γ"))
    return out


def plot_fig1(config: Fig1Config, r: dict):
    gam, lams = r["gammas"], r["lams"]
    cv = r["trained_err"].mean(axis=0)
    fig, axes = figure(ncols=2, nrows=2, width=5.2, height=3.8)
    ax = axes[0, 0]
    for i, g in enumerate(gam):
        c = COLORS[i % len(COLORS)]
        ax.plot(r["lam_fine"], r["theory_fine"][i], "--", color=c, lw=1.0)
        ax.plot(lams, cv[i], "-o", color=c, ms=3, lw=1.4, label=f"γ = {g:g}")
        if "saddle_fine" in r and np.any(r["rank_one_share"][:, i] >= RANK_ONE_SHARE):
            # models resting on the rank-one saddle of full weights: its level (dotted) and a ring on each
            ax.plot(r["lam_fine"], r["saddle_fine"][i], ":", color=c, lw=0.9)
            stuck = np.any(r["rank_one_share"][:, i] >= RANK_ONE_SHARE, axis=0)
            ax.plot(lams[stuck], cv[i, stuck], "o", mfc="none", mec="k", ms=7, mew=0.8)
        kk = int(np.argmin(cv[i]))
        ax.plot(lams[kk], cv[i, kk], "*", color=c, ms=14, mec="k", mew=0.6, zorder=5)
        ax.plot(r["lam_star"][i], r["err_star"][i], "x", color="k", ms=5, zorder=6)
        if "kalman_risk" in r:
            baseline_lines(ax, lams, {f"Kalman, γ = {g:g}": r["kalman_risk"][i]}, label_at="right")
            baseline_lines(ax, lams, {"eq 15, held-out": r["match_alg_risk"][0, i]}, label_at="none")  # legend title
        if "learned_lam" in r:
            ax.plot(r["learned_lam"][:, i], r["learned_lam_theory_err"][:, i], "v", color=c, mec="k", mew=0.5, ms=6, zorder=6)
    ax.set_xlabel("forget factor λ")
    ax.set_ylabel("train error E(ŷ − y)²")
    ax.set_title("(a) train error vs λ; ★ trained λ*, × Thm 2 λ*" + (", ▼ learnt λ" if "learned_lam" in r else ""),
                 fontsize=9)
    saddles = "saddle_fine" in r and np.any(r["rank_one_share"] >= RANK_ONE_SHARE)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.45 * (hi - lo))  # headroom: the legend sits above the curves, not on the largest γ's
    ax.legend(fontsize=7, ncol=2, title_fontsize=7, loc="upper center", title="solid: trained GLA, dashed: Thm 2"
              + ("\nthin grey: Bayes (Kalman), eq 15 on held-out prompts" if "kalman_risk" in r else "")
              + ("\n○ on the rank-one saddle, dotted: its level" if saddles else ""))
    gi = int(np.argmin(np.abs(gam - config.shift_gamma)))
    c = COLORS[gi % len(COLORS)]
    tc = r["test_err"].mean(axis=0)
    for j, m in enumerate(r["test_ms"]):
        ax = axes.flat[j + 1] if j < 3 else None
        if ax is None:
            break
        ax.plot(r["lam_bar_fine"], r["test_theory_fine"][j], "--", color=c, lw=1.0, label="Theorem 3")
        ax.plot(r["lam_bars"], tc[j], "-o", color=c, ms=3, lw=1.4, label="trained GLA")
        kk = int(np.argmin(tc[j]))
        ax.plot(r["lam_bars"][kk], tc[j, kk], "*", color=c, ms=14, mec="k", mew=0.6, zorder=5)
        ax.axvline(config.shift_lam, color="0.6", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("test-time forget factor λ̄")
        ax.set_ylabel("test error")
        ax.set_title(f"({'bcd'[j]}) trained at λ = {config.shift_lam:g}, γ = {config.shift_gamma:g}; test m = {m}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"drift Fig 1: GLA under AR(1) drift (d = {config.d}, n = {config.n}, σ_w² = {config.sigma_w2:g}, "
                 f"σ_e² = {config.sigma_e2:g}; {config.parametrisation} weights, AdamW, {config.steps} steps × "
                 f"{config.batch} prompts)", fontsize=9)
    return fig


register(
    Experiment(
        id="drift.fig1",
        title="GLA's train error is U-shaped in λ with λ* < 1 (Thm 2); test-time λ̄ (Thm 3)",
        paper=PAPER,
        reference="Fig 1; Theorems 1-3 (eqs 15-19)",
        config=Fig1Config,
        presets={
            "quick": {"lams": _grid(0.6, 1.0, 9), "lam_bars": _grid(0.6, 1.0, 17), "batch": 250, "steps": 600,
                      "lr_schedule": "cosine", "parametrisation": "restricted", "init_std": 0.03, "n_eval": 3000, "record_every": 50,
                      "theta_lr_factor": 10.0},
            "paper": {},
        },
        run=run_fig1,
        checks=checks_fig1,
        plot=plot_fig1,
        memory=memory_fig1,
        notes=[
            "Λ = I, the λ grid, the init std (0.1), β2 and the test setting of (b-d) are unspecified; (b-d) use the λ = 0.9 model "
            "trained at γ = 0.95, tested with γ̄ = γ and the training σ's, against the test-time λ̄ (eq 18).",
            "One run trains every (γ, λ) model (engines.train_members): their losses are summed (AdamW acts elementwise, so "
            "each model gets its own updates), all share each step's random numbers (common random numbers across γ), "
            "and each model has its own init key.",
            "Trained errors: restricted weights (quick) are evaluated exactly, by their population error in closed form "
            "(theory.drift.restricted_error, from E[GGᵀ] = Λ̃Λ and E[Gwᵀ] = D1Λ); other weights (paper) beside the "
            "closed-form optimum on the same fresh prompts: Thm 2/3 + mean[(ŷ−y)² − (ŷ_opt−y)²], whose standard error is "
            "far below the 3 % tolerance.",
            "quick trains the restricted (U₁₁, u₋₁) weights (init std 0.03) with a cosine-decayed lr on 600 × 250 "
            "prompts: from a random init of the full weights, some models first settle on the rank-one path u₁₂u₂₁ᵀ "
            "(u₋₁ ≈ 0), a saddle they leave only after many more steps than quick affords.",
            "(b-d) are sensitive to the scale of u₋₁U₁₁ at first order (away from λ̄ = λ the optimum is not stationary "
            "for the test error), the train error only at second order: a small shortfall of the scale costs little "
            "train error but an order of magnitude more test error at λ̄ = 1. The scale converges slowly from a small "
            "init, so quick takes 600 steps of 250 prompts (with 300 the direction of u₋₁U₁₁ does not converge at "
            "γ = 0.8, where eq 15 explains ~12 % of the label variance: the query-sensitivity cosine stays below 0.99).",
            "▼ (extension, not in the paper): λ = sigmoid(θ) learnt with the weights from λ = 0.5 (quick: θ's lr ×10).",
            "Finding (paper preset, full q/k/v weights): the paper says its random Gaussian init 'consistently converges to "
            "a global minimum'. At its AdamW settings some models do not within 2000 steps: they rest on the "
            "rank-one stationary point of the full weights, ŷ = Gᵀ(u₁₂u₂₁ᵀ)x (u₁₂ the x-part of W_V's last row, u₂₁ the "
            "label row of W_KᵀW_Q; u₋₁, U₁₁ ≈ 0), whose error E_k = D4 trΛ − D1²μ_k²/Λ̃_k keeps one of Theorem 2's d "
            "gains (theory.drift.rank_one_saddle_errors; derived, tested against the exact restricted error and Monte "
            "Carlo of the full model). Leaving it needs u₋₁ and U₁₁ to grow together (the gradient of each is "
            "proportional to the other), which Adam's noise-normalised steps did not do within 2000 steps. Seen for "
            "q/k/v, merged and Lemma-2 weights alike, at init std 0.03, 0.1 and 0.2, mostly at λ ≤ 0.8; a stalled "
            "model stays there without weight decay too. The check 'models "
            "more than 3 % above Theorem 2 that are not on a rank-one saddle' tells each stalled model by its error "
            "and its weights (≥ 90 % of the label route through u₁₂u₂₁ᵀ); the plot rings them and draws the saddle "
            "level dotted.",
            "`--set parametrisation=restricted` trains Theorem 1's (U₁₁, u₋₁) from a random Gaussian init at the same "
            "settings: no second route, and every model converges.",
            "Algorithm match (extension, not in the paper): every trained (γ, λ) model against eq 15's predictor "
            "at its λ — WPGD with ω_i = λ^{n+1−i} and P = D1Λ̃⁻¹ (iclab.baselines.exponential_weights, wpgd) on the "
            "tokens' context and query (split_drift_tokens) — on n_match held-out prompts per γ from their own stream: "
            "gap ≤ 3 % of Theorem 2 and query-sensitivity cosine ≥ 0.99 at the grid λ nearest λ*; for restricted "
            "weights the expected gap is the exact excess error (Pythagoras), checked at every (γ, λ) within 4 SE. "
            "Bayes floor: the Kalman filter (iclab.baselines.kalman_bayes_risk, exact given the contexts, averaged; its "
            "Monte Carlo twin checked within 4 SE); no trained model below it by more than 3 SE. Thin grey lines: the "
            "Kalman risk of each γ and eq 15's held-out error.",
        ],
    )
)
