"""drift Fig 2: multi-layer GLA against λ at γ = 0.95 (deeper is no worse), and linear convergence
(Adam on sampled prompts; gradient flow of the exact loss from Assumption 1 with the PL rate of Lemma 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.engines import population
from iclab.experiments._config import param
from iclab.experiments._plot import COLORS, THEORY_STYLE, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most
from iclab.experiments.drift._common import (
    PAPER,
    Group,
    TrainConfig,
    eval_prompts,
    evaluation_memory,
    model_errors,
    optimal_predictions,
    train_groups,
    training_memory,
)
from iclab.experiments._memory import largest, records, total
from iclab.progress import task
from iclab.theory import drift as theory

REL_TOL = 0.03  # as drift.fig1: trained vs theory, and "deeper no worse" than the 1-layer optimum
_GRID_RTOL = 1e-9


class Fig2Config(TrainConfig):
    gamma: float = param(0.95, "AR(1) coefficient γ of every panel", paper=0.95, gt=0, le=1.5)
    depths: list[int] = param([1, 2, 3], "numbers of layers L of the residual GLA (must include 1)",
                              paper=None, paper_note="unspecified ('multi-layer GLA')")
    lams: list[float] = param([0.8, 0.85, 0.9, 0.95, 1.0], "forget factors λ (shared by the layers) of panels (a-b)",
                              paper=None, paper_note="unspecified")
    test_m: int = param(50, "test prompt length m of panel (b) (test-time λ̄ = λ, γ̄ = γ)", paper=None,
                        paper_note="unspecified", ge=1, le=10_000)
    conv_lam: float = param(0.85, "λ (one of `lams`) of the depth convergence panel (d)", paper=0.85, gt=0, le=1.5)
    n_record: int = param(2000, "fixed prompts on which the loss is recorded along training (panels c-d)",
                          paper=None, paper_note="the paper plots the training loss", ge=10, le=1_000_000)
    pl_sigma_frac: float = param(0.5, "Assumption-1 init scale σ as a fraction of the eq-49 bound", gt=0, lt=1)
    pl_t_max: float = param(10.0, "gradient-flow horizon t of panel (e)", gt=0, le=1e7)
    pl_records: int = param(201, "gradient-flow record times", ge=3, le=100_000)

    @model_validator(mode="after")
    def _grids(self):
        if 1 not in self.depths or any(L < 1 for L in self.depths):
            raise ValueError("depths must be >= 1 and include 1")
        if not any(abs(v - self.conv_lam) < _GRID_RTOL for v in self.lams):
            raise ValueError(f"lams must include conv_lam = {self.conv_lam}")
        if any(not (0 < v <= 1.5) for v in self.lams):
            raise ValueError("lams must lie in (0, 1.5]")
        return self


def _eval_key(config, j):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(config.seed), 30_000), j)


def _layers(L):
    return None if L == 1 else L


def _group(L):
    return f"L{L}"


def _theory(config: Fig2Config) -> dict:
    """Theorem 2/3 curves and λ* (no training)."""
    g = config.gamma
    lams = np.asarray(config.lams)
    setting = config.setting(g)
    lam_star, err_star = theory.optimal_forget_factor(**setting)
    out = {"lams": lams, "depths": np.asarray(config.depths), "lam_star": np.float64(lam_star),
           "err_star": np.float64(err_star)}
    fine = np.linspace(min(0.5, lams.min()), max(1.0, lams.max()), 401)
    out["lam_fine"] = fine
    out["theory_train_fine"] = theory.train_error(fine, **setting)
    out["theory_train"] = theory.train_error(lams, **setting)
    # (b) tests at λ̄ = λ, γ̄ = γ, the training σ's, length m
    test = config.test_setting(g, config.test_m)
    out["theory_test_fine"] = np.array([theory.test_error(l, **setting, lam_bar=l, **test) for l in fine])
    out["theory_test"] = np.array([theory.test_error(l, **setting, lam_bar=l, **test) for l in lams])
    return out


def _members(config: Fig2Config) -> list[tuple[int, int]]:
    """Every trained (depth L, λ index k), in the order of their member ids (depth by depth); the model at λ* is
    member len(depths)·K."""
    return [(L, k) for L in config.depths for k in range(len(config.lams))]


def _train(config: Fig2Config, reporter, members: list[tuple[int, int]], star: bool) -> dict:
    """Trains the given (depth, λ index) models, and the 1-layer model at λ* if ``star``, each with its member id in
    the whole figure's grid (so a subset follows the trajectory it follows inside the grid, to float rounding), and
    evaluates them. Returns per-member arrays: ``members`` (M, 2) and ``rec_mse`` (S, records, M), ``train_err``,
    ``train_err_se``, ``test_err``, ``test_err_se`` (S, M); with ``star`` also the λ* model's arrays."""
    g = config.gamma
    lams = np.asarray(config.lams)
    depths = list(config.depths)
    K, S = lams.size, config.seeds
    Lam, setting = config.Lam(), config.setting(g)
    lam_star, err_star = theory.optimal_forget_factor(**setting)
    groups, order = {}, []
    for L in depths:
        ks = [k for (L2, k) in members if L2 == L]
        if ks:
            groups[_group(L)] = Group(lams[ks][None], _layers(L), ids=np.array([[depths.index(L) * K + k for k in ks]]))
            order += [(L, k) for k in ks]
    if star:
        groups["star"] = Group(np.array([[lam_star]]), ids=np.array([[len(depths) * K]]))
    Z_rec, y_rec = eval_prompts(config, _eval_key(config, 0), config.n_record, g)
    exact = config.parametrisation == "restricted"
    tr, params = train_groups(config, np.array([g]), groups, eval_set=(Z_rec[None], y_rec[None]), record_params=exact,
                              reporter=reporter,
                              label=f"GLA, {len(order)} of depths {depths} × {K} λ{' + 1 layer at λ*' if star else ''} "
                                    f"({S} seed{'s' * (S > 1)})")
    out = {"rec_step": tr.step, "members": np.array(order, dtype=np.int64).reshape(-1, 2)}
    evals = tr.metrics["eval"]
    out["rec_mse"] = np.stack([evals[_group(L)][:, :, 0, [k2 for (L2, k2) in order if L2 == L].index(k)]
                               for (L, k) in order], axis=-1) if order else np.zeros((S, len(tr.step), 0))
    # final errors: train (length n) and test (length m, λ̄ = λ): exact for one restricted layer, else
    # estimated beside the 1-layer optimum on shared fresh prompts (``model_errors``)
    for j, (name, m) in enumerate((("train", None), ("test", config.test_m))):
        E = theory.train_error(lams, **setting) if name == "train" else np.array(
            [theory.test_error(l, **setting, lam_bar=l, **config.test_setting(g, m)) for l in lams])
        err, se = np.zeros((S, len(order))), np.zeros((S, len(order)))
        for L in depths:
            ks = [k for (L2, k) in order if L2 == L]
            if not ks:
                continue
            cols = [order.index((L, k)) for k in ks]
            for s in range(S):
                p = jax.tree_util.tree_map(lambda a: a[s, 0], params[_group(L)])
                e = model_errors(config, p, lams[ks], g, lams[ks], E[ks], _eval_key(config, 1 + j), m=m,
                                 layers=_layers(L))
                err[s, cols], se[s, cols] = e["err"], e["err_se"]
        out[f"{name}_err"], out[f"{name}_err_se"] = err, se
    if not star:
        return out
    out["rec_mse_star"] = evals["star"][:, :, 0, 0]  # (S, T)
    # panel (c): beside the eq-15 optimum's MSE on the same fixed prompts
    y_rec = np.asarray(y_rec)
    out["rec_opt"] = np.array([np.mean((optimal_predictions(config, Z_rec, l, g, [l])[0] - y_rec) ** 2) for l in lams])
    out["rec_opt_star"] = np.mean((optimal_predictions(config, Z_rec, lam_star, g, [lam_star])[0] - y_rec) ** 2)
    if exact:
        # exact population excess 2(L̃ − L̃*) of the recorded weights (eq 42 / Corollary 1, which carry ½): noise-free
        D1s, D2s, D3s, _ = theory.D_sums(lam_star, gamma=g, **config.process())
        at_star = dict(D1=D1s, Lam_t=theory.Lam_tilde(Lam, D2=D2s, D3=D3s), Lam=Lam)
        rec = tr.params["star"]
        U, u = np.asarray(rec["U11"])[:, :, 0, 0], np.asarray(rec["u_m1"])[:, :, 0, 0]
        Lmin = theory.min_half_reduced_loss(**at_star)
        out["rec_exact_excess_star"] = np.array([[2 * (theory.half_reduced_loss(U[s, k], u[s, k], **at_star) - Lmin)
                                                  for k in range(U.shape[1])] for s in range(U.shape[0])])
    star_err = [model_errors(config, jax.tree_util.tree_map(lambda a: a[s, 0], params["star"]), [lam_star], g,
                             [lam_star], [err_star], _eval_key(config, 1)) for s in range(S)]
    out["star_err"] = np.array([e["err"][0] for e in star_err])
    out["star_err_se"] = np.array([e["err_se"][0] for e in star_err])
    return out


def memory_fig2(config: Fig2Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig2`'s memory: the joint training of every (depth, λ) model and the λ* one
    (:func:`iclab.experiments.drift._common.training_memory`, with the full layers' (n+1)² scores and the
    n_record prompts evaluated at every record), the Monte Carlo evaluation of the deepest models on n_eval
    prompts of n + 1 (train) and test_m + 1 (test) tokens, and the gradient flow's recorded (U_11, u_{-1}),
    d² + 3 float64 numbers at each of pl_records times. The phases follow each other: the largest is the need."""
    K, depths = len(config.lams), list(config.depths)
    models = len(depths) * K + 1
    training = total(training_memory(config, G=1, models=models, deep_layers=K * sum(L - 1 for L in depths),
                                     eval_prompts=config.n_record, eval_models=models))
    deep = max(depths) > 1
    return largest(training, *(evaluation_memory(n=config.n_eval, T=T, d=config.d, models=K, deep=deep)
                               for T in (config.n + 1, config.test_m + 1)),
                   (records(seeds=1, steps=config.pl_records, record_every=1, values=config.d ** 2 + 3),
                    "the gradient flow's recorded weights"))


def _flow(config: Fig2Config, reporter) -> dict:
    """Panels (e-f): gradient flow of the exact loss (Lemma 3) from Assumption 1, at λ*: the population engine."""
    g = config.gamma
    Lam = config.Lam()
    lam_star, _ = theory.optimal_forget_factor(**config.setting(g))
    D1, D2, D3, _ = theory.D_sums(lam_star, gamma=g, **config.process())
    Lt = theory.Lam_tilde(Lam, D2=D2, D3=D3)
    rng = np.random.default_rng(config.seed)
    Theta = rng.standard_normal((config.d, config.d))
    Theta /= np.sqrt(np.linalg.norm(Theta @ Theta.T))
    sigma = config.pl_sigma_frac * theory.init_scale_bound(D1=D1, Lam_t=Lt)
    U0, u0 = theory.assumption1_init(Theta, sigma)
    aux = {"D1": jnp.float64(D1), "Lt": jnp.asarray(Lt), "Lam": jnp.asarray(Lam)}
    with task(reporter, "gradient flow from Assumption 1 (population)", config.pl_records - 1) as cb:
        gf = population.gradient_flow(
            lambda p, a: theory.half_reduced_loss_jax(p["U11"], p["u_m1"], D1=a["D1"], Lam_t=a["Lt"], Lam=a["Lam"]),
            {"U11": jnp.asarray(U0), "u_m1": jnp.float64(u0)}, aux, t_max=config.pl_t_max, n_records=config.pl_records,
            metrics={"balance": lambda p, a: p["u_m1"] ** 2 - jnp.sum(p["U11"] ** 2), "u": lambda p, a: p["u_m1"]},
            record_params=True, callback=cb)
    return {
        "gf_t": gf.t,
        "gf_gap": np.asarray(gf.loss) - theory.min_half_reduced_loss(D1=D1, Lam_t=Lt, Lam=Lam),
        "gf_balance": np.asarray(gf.metrics["balance"]),
        "gf_u": np.asarray(gf.metrics["u"]),
        "gf_final_product": np.asarray(gf.params["u_m1"][-1] * gf.params["U11"][-1]),
        "gf_target_product": D1 * np.linalg.inv(Lt),
        "pl_alpha": np.float64(theory.pl_constant(sigma, Theta, D1=D1, Lam_t=Lt, Lam=Lam)),
        "u_lower_bound": np.float64(theory.u_lower_bound(sigma, Theta, D1=D1, Lam_t=Lt, Lam=Lam)),
    }


def _assemble(config: Fig2Config, parts: list[dict]) -> dict:
    """The figure's training arrays from parts of ``_train`` (each model in exactly one part; one part with λ*):
    ``rec_mse`` (S, depths, records, K) and ``{train,test}_err{,_se}`` (S, depths, K), the λ* model's arrays."""
    depths, K = list(config.depths), len(config.lams)
    first = parts[0]
    S, R = first["rec_mse"].shape[:2]
    dtype = next((p["rec_mse"].dtype for p in parts if p["rec_mse"].shape[-1]), first["rec_mse"].dtype)
    out = {"rec_step": first["rec_step"], "rec_mse": np.full((S, len(depths), R, K), np.nan, dtype)}
    for name in ("train_err", "train_err_se", "test_err", "test_err_se"):
        out[name] = np.full((S, len(depths), K), np.nan)
    for part in parts:
        for col, (L, k) in enumerate(np.asarray(part["members"]).reshape(-1, 2)):
            i = depths.index(int(L))
            out["rec_mse"][:, i, :, k] = part["rec_mse"][:, :, col]
            for name in ("train_err", "train_err_se", "test_err", "test_err_se"):
                out[name][:, i, k] = part[name][:, col]
        out.update({key: value for key, value in part.items()
                    if key.endswith("_star") or key in ("rec_opt", "star_err", "star_err_se")})
    return out


def run_fig2(config: Fig2Config, reporter) -> dict:
    out = _theory(config)
    # training: every depth × λ, and one 1-layer model at λ*, on shared batches
    out.update(_assemble(config, [_train(config, reporter, _members(config), star=True)]))
    out.update(_flow(config, reporter))
    return out


def shards_fig2(config: Fig2Config) -> list[str]:
    """One shard per trained (depth L, λ): ``L<L>.lam<λ>``, and ``star``: the 1-layer model at λ*, the theory and
    the gradient flow (panels c, e-f)."""
    return [f"L{L}.lam{config.lams[k]:g}" for L, k in _members(config)] + ["star"]


def run_shard_fig2(config: Fig2Config, name: str, reporter) -> dict:
    """The arrays of one shard: ``_train`` of its model (its member id as in the whole grid), or for ``star`` the
    λ* model, the theory and the gradient flow."""
    table = dict(zip(shards_fig2(config), _members(config) + [None]))
    if name not in table:
        raise ValueError(f"drift.fig2 has no shard {name!r} at this config (shards: {', '.join(table)})")
    if name == "star":
        return {**_theory(config), **_train(config, reporter, [], star=True), **_flow(config, reporter)}
    return _train(config, reporter, [table[name]], star=False)


def assemble_fig2(config: Fig2Config, parts: dict[str, dict], reporter=None) -> dict:
    """The figure's arrays (the layout of :func:`run_fig2`) from every shard's."""
    star = parts["star"]
    out = {key: star[key] for key in _theory(config)}
    out.update(_assemble(config, [parts["star"]] + [parts[name] for name in shards_fig2(config)[:-1]]))
    out.update({key: star[key] for key in star if key.startswith("gf_") or key in ("pl_alpha", "u_lower_bound")})
    return out


#: A deep model whose recorded training loss exceeds this multiple of its first record after the first record
#: diverged on the way (a loss spike of Adam on the cubic residual layers), whatever its final error; one whose first
#: record exceeds this multiple of the 1-layer optimum started from an exploding output.
SPIKE = 100.0
#: A model whose mean recorded loss over the last 10 % of the run lies this much below its mean over 60-70 % is still
#: descending: its final error is an unfinished training's (the 1-layer models' record-to-record noise is ≈ 1 %).
STILL_FALLING = 0.02
#: A Monte-Carlo error whose standard error exceeds this share of it is dominated by a few prompts (heavy tails of a
#: deep model's polynomial output); its point estimate says little.
HEAVY_TAIL = 0.25


def _deep_model_evidence(r: dict, name: str, deep: list[int]) -> str:
    """The evidence behind a failing 'deeper no worse' check, from the stored trajectories: the deep models that
    started from an exploding output (first record > SPIKE × the 1-layer optimum), whose training loss spiked later
    (max over the later records > SPIKE × the first), that are still descending at the end (STILL_FALLING), and, for
    ``name``'s error, whose estimate is heavy-tailed (SE > HEAVY_TAIL of the value)."""
    depths, lams, steps = list(r["depths"]), r["lams"], r["rec_step"]
    R = len(steps)
    found = {"exploding at init": [], "spiked": [], "still descending": [], f"heavy-tailed {name} estimate": []}
    for s in range(r["rec_mse"].shape[0]):
        for i in deep:
            for k in range(len(lams)):
                rec = r["rec_mse"][s, i, :, k]
                if np.all(np.isnan(rec)):
                    continue
                tag = f"L = {depths[i]}, λ = {lams[k]:g}" + (f", seed {s}" if r["rec_mse"].shape[0] > 1 else "")
                if rec[0] > SPIKE * r["theory_train"][k]:
                    found["exploding at init"].append(f"{tag} (first record {rec[0]:.3g})")
                t = 1 + int(np.nanargmax(rec[1:]))
                if rec[t] > SPIKE * rec[0]:
                    found["spiked"].append(f"{tag} ({rec[t]:.3g} at step {steps[t]:.0f}, last {rec[-1]:.3g})")
                if R >= 10:  # fewer records give no window to compare (and an empty mean)
                    late, mid = np.nanmean(rec[-(R // 10):]), np.nanmean(rec[int(0.6 * R):int(0.7 * R)])
                    if late < (1 - STILL_FALLING) * mid:
                        found["still descending"].append(f"{tag} (−{1 - late / mid:.1%} over the last 30 % of the run)")
                err, se = r[f"{name}_err"][s, i, k], r[f"{name}_err_se"][s, i, k]
                if se > HEAVY_TAIL * err:
                    found[f"heavy-tailed {name} estimate"].append(f"{tag} ({err:.3g} ± {se:.3g})")
    return "".join(f" Deep models {what}: " + "; ".join(v) + "." for what, v in found.items() if v)


def _one_layer_evidence(config: Fig2Config, r: dict, i1: int) -> str:
    """Names each 1-layer model more than REL_TOL from Theorem 2 and says whether its train error sits on a level of
    the rank-one stationary point of the full weights (``theory.drift.rank_one_saddle_errors``; drift.fig1's
    finding): within 3 standard errors of one, or not."""
    on, off = [], []
    S = r["train_err"].shape[0]
    for s in range(S):
        for k, lam in enumerate(r["lams"]):
            err, se, thm = r["train_err"][s, i1, k], r["train_err_se"][s, i1, k], r["theory_train"][k]
            if abs(err / thm - 1) <= REL_TOL:
                continue
            tag = f"λ = {lam:g}" + (f", seed {s}" if S > 1 else "")
            levels = np.asarray(theory.rank_one_saddle_errors(float(lam), **config.setting(config.gamma)))
            j = int(np.argmin(np.abs(levels - err)))
            if abs(levels[j] - err) <= 3 * se:
                on.append(f"{tag} ({err:.4g} ± {se:.2g}; saddle level {levels[j]:.4g}, Theorem 2 {thm:.4g})")
            else:
                off.append(f"{tag} ({err:.4g} ± {se:.2g}; nearest saddle level {levels[j]:.4g}, Theorem 2 {thm:.4g})")
    text = ""
    if on:
        text += " On the rank-one saddle (error within 3 SE of its level; see drift.fig1): " + "; ".join(on) + "."
    if off:
        text += " Not at a saddle level: " + "; ".join(off) + "."
    return text


def checks_fig2(config: Fig2Config, r: dict) -> list:
    depths, lams = list(r["depths"]), r["lams"]
    i1 = depths.index(1)
    out = []
    rel1 = np.abs(r["train_err"][:, i1] / r["theory_train"][None] - 1)
    out.append(check_at_most("(a) 1-layer trained train error = Theorem 2 at every λ (worst relative gap)", rel1.max(),
                             REL_TOL, "exact population error for restricted weights, else estimated beside the eq-15 optimum on "
                             "shared prompts (see drift.fig1)." + _one_layer_evidence(config, r, i1)))
    for name, label in (("train", "(a) train"), ("test", f"(b) test (m = {config.test_m}, λ̄ = λ)")):
        deep = [i for i, L in enumerate(depths) if L > 1]
        if deep:
            ratio = r[f"{name}_err"][:, deep] / r[f"theory_{name}"][None, None] - 1
            s, j, k = np.unravel_index(np.argmax(ratio), ratio.shape)
            out.append(check_at_most(
                f"{label}: deeper no worse than the 1-layer optimum (worst relative excess, L = {depths[deep[j]]}, "
                f"λ = {lams[k]:g})", ratio.max(), REL_TOL,
                "L-layer trained error vs Theorem 2/3 of the 1-layer optimum (Fig 2a-b: deeper is no worse); tolerance as (a)."
                + _deep_model_evidence(r, name, deep)))
    out.append(check_at_most("(c) 1-layer GLA trained at λ* = Theorem 2 err(λ*) (worst seed; relative gap)",
                             float(np.max(np.abs(r["star_err"] / r["err_star"] - 1))), REL_TOL))
    gap, t = r["gf_gap"], r["gf_t"]
    live = gap > 1e-12 * gap[0]
    bound = np.exp(-r["pl_alpha"] * t) * gap[0]
    out.append(check_at_most("(e) gradient flow: L̃(t) − L̃* ≤ e^{−αt}(L̃(0) − L̃*) (Lemma 6, eq 54; worst ratio)",
                             float(np.max(gap[live] / bound[live])), 1.0 + 1e-9,
                             f"α = {r['pl_alpha']:.3g} from the reconstructed constants [R] of eq 54"))
    k = np.flatnonzero(live)
    k = k[k >= np.argmax(gap < 1e-2 * gap[0])]
    slope = np.polyfit(t[k], np.log(gap[k]), 1)[0] if k.size >= 3 else 0.0
    out.append(check_at_most("(e) linear convergence: fitted d log(L̃ − L̃*)/dt after the plateau ≤ −α", slope,
                             -float(r["pl_alpha"]), "log-gap slope over the records with 1e-12 < gap/gap(0) < 1e-2"))
    out.append(check_at_most("(e) Lemma 5: |u₋₁² − ‖U₁₁‖_F²| along the flow (max)", float(np.max(np.abs(r["gf_balance"]))),
                             1e-8, "zero at Assumption 1 and conserved by the flow"))
    out.append(check_at_most("(e) u₋₁(t) ≥ eq-50 lower bound (min of u − bound)", -float(np.min(r["gf_u"] - r["u_lower_bound"])),
                             0.0))
    tgt = r["gf_target_product"]
    out.append(check_at_most("(e) limit u₋₁U₁₁ = D1 Λ̃⁻¹ (eq 46; max relative deviation)",
                             float(np.max(np.abs(r["gf_final_product"] - tgt)) / np.max(np.abs(tgt))), 1e-6))
    return out


def plot_fig2(config: Fig2Config, r: dict):
    depths, lams = list(r["depths"]), r["lams"]
    fig, axes = figure(ncols=3, nrows=2, width=4.6, height=3.5)
    for ax, name, title in ((axes[0, 0], "train", f"(a) train error, γ = {config.gamma:g}"),
                            (axes[0, 1], "test", f"(b) test error, m = {config.test_m}, λ̄ = λ")):
        ax.plot(r["lam_fine"], r[f"theory_{name}_fine"], **THEORY_STYLE, label="1-layer optimum (Thm 2/3)")
        for i, L in enumerate(depths):
            ax.plot(lams, r[f"{name}_err"][:, i].mean(0), "-o", color=COLORS[i % len(COLORS)], ms=3,
                    label=f"L = {L}, trained")
        ax.set_xlabel("forget factor λ")
        ax.set_ylabel(f"{name} error")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    step = r["rec_step"]
    ax = axes[0, 2]
    if "rec_exact_excess_star" in r:
        for s, e in enumerate(np.atleast_2d(r["rec_exact_excess_star"])):
            ax.semilogy(step, e, color=COLORS[0], lw=1.4, label="AdamW, exact population excess" if s == 0 else None)
        ax.set_ylabel("E(ŷ − y)² − err(λ*)  (exact, eq 42)")
    else:
        for s, e in enumerate(np.atleast_2d(r["rec_mse_star"])):
            ax.semilogy(step, e, color=COLORS[0], lw=1.4, label="AdamW, MSE on fixed prompts" if s == 0 else None)
        ax.axhline(float(r["rec_opt_star"]), **THEORY_STYLE, label="eq-15 optimum, same prompts")
        ax.set_ylabel("MSE")
    ax.set_xlabel("optimiser step")
    ax.set_title(f"(c) 1 layer at λ* = {float(r['lam_star']):.4f}", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    kc = int(np.argmin(np.abs(lams - config.conv_lam)))
    for i, L in enumerate(depths):
        for s, e in enumerate(r["rec_mse"][:, i, :, kc]):
            ax.semilogy(step, e, color=COLORS[i % len(COLORS)], lw=1.2, label=f"L = {L}" if s == 0 else None)
    ax.axhline(float(r["rec_opt"][kc]), **THEORY_STYLE, label="1-layer optimum, same prompts")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("MSE on fixed prompts")
    ax.set_title(f"(d) depths at λ = {config.conv_lam:g}", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    t, gap = r["gf_t"], r["gf_gap"]
    live = gap > 0
    ax.semilogy(t[live], gap[live], color=COLORS[0], lw=1.4, label="gradient flow (population engine)")
    ax.semilogy(t, np.exp(-r["pl_alpha"] * t) * gap[0], **THEORY_STYLE, label=f"PL bound e^(−αt), α = {float(r['pl_alpha']):.2g}")
    ax.set_xlabel("t (gradient-flow time)")
    ax.set_ylabel("L̃(t) − L̃*")
    ax.set_title("(e) exact loss from Assumption 1 at λ*", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    ax.plot(t, r["gf_u"], color=COLORS[0], label="u₋₁(t)")
    ax.axhline(float(r["u_lower_bound"]), **THEORY_STYLE, label="eq-50 lower bound")
    ax.plot(t, r["gf_balance"], color=COLORS[1], label="u₋₁² − ‖U₁₁‖²_F (Lemma 5)")
    ax.set_xlabel("t (gradient-flow time)")
    ax.set_title("(f) Lemmas 5-6 along the flow", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"drift Fig 2: depth and convergence (d = {config.d}, n = {config.n}, γ = {config.gamma:g}; "
                 f"{config.parametrisation} weights, AdamW, {config.steps} steps × {config.batch} prompts)", fontsize=9)
    return fig


register(
    Experiment(
        id="drift.fig2",
        title="Deeper GLA is no worse than the 1-layer optimum; training converges linearly (PL)",
        paper=PAPER,
        reference="Fig 2; Theorem 1, Lemmas 3-6 (eqs 42-54)",
        config=Fig2Config,
        presets={
            "quick": {"depths": [1, 2], "lams": [0.85, 0.95], "batch": 250, "steps": 200, "lr": 2e-2, "lr_schedule": "cosine",
                      "parametrisation": "restricted", "init_std": 0.03, "n_eval": 1000, "n_record": 500,
                      "record_every": 25},
            "paper": {"record_every": 20},
        },
        run=run_fig2,
        checks=checks_fig2,
        plot=plot_fig2,
        memory=memory_fig2,
        shards=shards_fig2,
        run_shard=run_shard_fig2,
        assemble=assemble_fig2,
        notes=[
            "Multi-layer architecture (unspecified): L layers with their own weights and a shared λ, residual "
            "Z ← Z + GLA_l(Z) at every position, read out at the query's label slot.",
            "Depths, the λ grid and the test length m (50) are unspecified; (b) tests at λ̄ = λ, γ̄ = γ.",
            "(c) shows the exact population excess of the recorded weights (restricted weights) or else the MSE on fixed "
            "prompts; (d) the MSE on fixed prompts beside the 1-layer optimum's on the same prompts (the training loss "
            "itself carries O(1/√B) noise); (e-f) integrate the exact reduced loss (eq 42) from Assumption 1 with the "
            "population engine; α of eq 54 uses constants reconstructed from the OCR [R] and is a loose bound.",
            "quick: depths 1-2, λ ∈ {0.85, 0.95}, restricted weights (init std 0.03), cosine lr, 200 steps × 250 "
            "prompts; one restricted layer is evaluated exactly (theory.drift.restricted_error), two layers by Monte "
            "Carlo beside the 1-layer optimum on 1000 prompts.",
            "quick's peak lr is 2e-2, twice the paper's: from the small init the 2-layer model converges slowly, and at "
            "1e-2 some seeds leave it a few % above the 1-layer "
            "optimum after 200 steps, failing 'deeper no worse' by non-convergence, not by depth; at 2e-2 every probed "
            "seed converges, at no extra cost (the same lr makes drift.fig1's (b-d) worse, so it stays there).",
        ],
    )
)
