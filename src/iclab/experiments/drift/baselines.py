"""drift LMS/RLS baseline (Sec 5): adaptive filters against GLA at its optimal forget factor λ*."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.baselines import filter_tail_errors
from iclab.experiments._config import param
from iclab.experiments._plot import COLORS, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most, check_equal
from iclab.engines import backend
from iclab.experiments.drift._common import (
    NORMALS,
    PAPER,
    PAPER_GAMMAS,
    TrainConfig,
    evaluation_memory,
    model_errors,
    prompt_bytes,
    rank_one_route_share,
    saddle_check,
    train_grid,
    training_memory,
)
from iclab.experiments._memory import FLOAT64, largest, total
from iclab.progress import task
from iclab.tasks.drift import sample_drift_prompts
from iclab.tasks.drift import sample_shared_batch
from iclab.theory import drift as theory

REL_TOL = 0.03  # trained GLA vs Theorem 2, as in drift.fig1
# The paper's LMS/RLS protocol is partly unspecified (error definition, ŵ_0, P_0): a simulation with the
# protocol used here differs from the reported numbers by up to 14 %.
PAPER_BASELINE_RTOL = 0.2


class BaselinesConfig(TrainConfig):
    gammas: list[float] = param(list(PAPER_GAMMAS), "AR(1) coefficients γ", paper=list(PAPER_GAMMAS))
    lms_mu: float = param(0.01, "LMS step size μ", paper=0.01, gt=0, le=10)
    rls_beta: float = param(0.98, "RLS forget factor β", paper=0.98, gt=0, le=1)
    rls_delta: float = param(100.0, "RLS initial P_0 = δ I", paper=None, paper_note="unspecified", gt=0, le=1e12)
    length: int = param(1000, "length of each filtered sequence", paper=1000, ge=2, le=1_000_000)
    trials: int = param(10_000, "Monte-Carlo sequences per γ", paper=10_000, ge=1, le=10_000_000)
    window: int = param(100, "the error is the a-priori squared error averaged over the last `window` steps (≤ length)",
                        paper=None, paper_note="unspecified", ge=1, le=1_000_000)
    chunk: int = param(2000, "sequences filtered at once (memory)", ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _window(self):
        if self.window > self.length:
            raise ValueError(f"window must be <= length (got {self.window} > {self.length})")
        return self


@functools.partial(jax.jit, static_argnames=("length", "chunk", "sampler", "normals"))
def _chunk_streams(key, Lam, gammas, sigma_w2, sigma_e2, *, length, chunk, sampler="xla", normals="ziggurat"):
    """``chunk`` filtered sequences of ``length`` steps of every process γ_g, the inputs shared (common random
    numbers): x (chunk, length, d), y (G, chunk, length).

    As the training batches are drawn (the backend): ``native`` draws them with the compiled sampler's shared
    layout (its last label is the target y_{n+1}), ``xla`` with ``sample_drift_prompts``."""
    if sampler == "native":
        X, Y, target = sample_shared_batch(key, chunk, gamma=gammas, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=length - 1,
                                           Lam=Lam, dtype=Lam.dtype, normals=normals)
        return X, Y.at[..., -1].set(target)
    pr = sample_drift_prompts(key, chunk, gamma=gammas, sigma_w2=sigma_w2, sigma_e2=sigma_e2, n=length - 1, Lam=Lam)
    return pr.x[0], pr.y


@functools.partial(jax.jit, static_argnames=("window",))
def _xla_tail_errors(x, y, mu, beta, delta, *, window):
    """The filters by ``theory.drift``'s scans: per-sequence a-priori errors over the last ``window`` steps, (G, B)
    each (``baselines.filter_tail_errors``' naive twin)."""
    def errors(y_g):
        lms = theory.lms_predictions(x, y_g, mu=mu)
        rls = theory.rls_predictions(x, y_g, beta=beta, delta=delta)
        return (jnp.mean((lms - y_g)[:, -window:] ** 2, axis=-1), jnp.mean((rls - y_g)[:, -window:] ** 2, axis=-1))

    return jax.lax.map(errors, y)


def _filter_errors(config: BaselinesConfig, key, *, kernel=None, sampler=None, normals: str = NORMALS) -> dict:
    """Mean a-priori error of LMS and RLS over the last `window` steps at every γ, and its standard error over
    trials: dict of (G,) arrays. The filters run by the backend's form (``kernel``; None: the run's backend):
    ``native``, the compiled kernel ``baselines.filter_tail_errors``; ``xla``, ``theory.drift``'s scans (equal to
    float rounding, tested). The sequences are drawn by ``sampler`` (None: the backend) with ``normals``."""
    native = (kernel or backend()) == "native"
    Lam = jnp.asarray(config.Lam())
    gammas = jnp.asarray(config.gammas, Lam.dtype)
    per_trial = {"lms": [], "rls": []}
    for c in range(-(-config.trials // config.chunk)):
        x, y = _chunk_streams(jax.random.fold_in(key, c), Lam, gammas, config.sigma_w2, config.sigma_e2,
                              length=config.length, chunk=config.chunk, sampler=sampler or backend(), normals=normals)
        if native:
            lms, rls = filter_tail_errors(x, y, mu=config.lms_mu, beta=config.rls_beta, delta=config.rls_delta,
                                          window=config.window)
        else:
            lms, rls = _xla_tail_errors(x, y, config.lms_mu, config.rls_beta, config.rls_delta, window=config.window)
        per_trial["lms"].append(np.asarray(lms))
        per_trial["rls"].append(np.asarray(rls))
    out = {}
    for name, v in per_trial.items():
        v = np.concatenate(v, axis=1)[:, : config.trials]
        out[name], out[f"{name}_se"] = v.mean(axis=1), v.std(axis=1) / np.sqrt(v.shape[1])
    return out


def memory_baselines(config: BaselinesConfig) -> tuple[float, str]:
    """Upper estimate of :func:`run_baselines`'s memory: one chunk of filtered sequences, ``chunk`` × ``length``
    float64 steps of every γ (:func:`iclab.experiments.drift._common.prompt_bytes`) with the filters' moved
    inputs and predictions, and every trial's LMS and RLS errors; then the training of the G GLA models at λ*;
    then their Monte Carlo evaluation (phases that follow each other: the largest is the need)."""
    G, d, B, T = len(config.gammas), config.d, config.chunk, config.length
    chunks = -(-config.trials // B)
    filters = total([(prompt_bytes(G=G, B=B, T=T, d=d, item=FLOAT64) + FLOAT64 * B * T * (4 * d + 6),
                      f"a chunk of {B} filtered sequences × {T} steps of {G} γ, float64"),
                     (4.0 * FLOAT64 * G * chunks * B, "every trial's LMS and RLS errors")])
    return largest(filters, total(training_memory(config, G=G, models=G)),
                   evaluation_memory(n=config.n_eval, T=config.n + 1, d=d, models=1))


def run_baselines(config: BaselinesConfig, reporter) -> dict:
    gam = np.asarray(config.gammas)
    opt = [theory.optimal_forget_factor(**config.setting(g)) for g in gam]
    lam_star = np.array([o[0] for o in opt])
    out = {"gammas": gam, "lam_star": lam_star, "err_star": np.array([o[1] for o in opt]),
           "err_la": np.array([theory.train_error(1.0, **config.setting(g)) for g in gam])}

    base = jax.random.fold_in(jax.random.PRNGKey(config.seed), 20_000)
    with task(reporter, f"LMS and RLS ({config.trials} sequences × {config.length} steps, every γ)", 1) as cb:
        out.update(_filter_errors(config, jax.random.fold_in(base, 0)))
        cb(1, {})

    S = config.seeds
    _, params = train_grid(config, gam, lam_star[:, None], reporter=reporter, label="GLA at λ* (one per γ)")
    est = {k: np.zeros((S, gam.size)) for k in ("err", "err_se")}
    for i, g in enumerate(gam):
        for s in range(S):
            p = jax.tree_util.tree_map(lambda a: a[s, i], params)
            e = model_errors(config, p, lam_star[i : i + 1], g, lam_star[i : i + 1], out["err_star"][i : i + 1],
                             jax.random.fold_in(base, 100 + i))
            est["err"][s, i], est["err_se"][s, i] = e["err"][0], e["err_se"][0]
    out.update({f"gla_{k}": v for k, v in est.items()})
    # the rank-one saddle of full weights at each λ* and each model's route share (see drift.fig1)
    out["saddle_star"] = np.stack([theory.rank_one_saddle_errors(l, **config.setting(g)) for l, g in zip(lam_star, gam)])
    out["rank_one_share"] = rank_one_route_share(params)[..., 0]  # (S, G)
    out["paper_lms"] = np.array([dict(zip(theory.PAPER_LMS_RLS["gamma"], theory.PAPER_LMS_RLS["lms"])).get(float(g), np.nan)
                                 for g in gam])
    out["paper_rls"] = np.array([dict(zip(theory.PAPER_LMS_RLS["gamma"], theory.PAPER_LMS_RLS["rls"])).get(float(g), np.nan)
                                 for g in gam])
    return out


def _paper_protocol(config: BaselinesConfig) -> bool:
    return ((config.d, config.sigma_w2, config.sigma_e2, config.eigenvalues, config.lms_mu, config.rls_beta, config.length)
            == (10, 1.0, 0.01, None, 0.01, 0.98, 1000))


def checks_baselines(config: BaselinesConfig, r: dict) -> list:
    gam = r["gammas"]
    gla = r["gla_err"]
    rel = np.abs(gla / r["err_star"][None] - 1)
    best = np.minimum(r["lms"], r["rls"])
    # one-sided comparison at 3 standard errors of both estimates
    margin = 3 * np.sqrt(r["gla_err_se"] ** 2 + np.where(r["lms"] < r["rls"], r["lms_se"], r["rls_se"])[None] ** 2)
    ratio = (gla + margin) / best[None]
    i = np.unravel_index(np.argmax(ratio), ratio.shape)
    out = [
        check_at_most("trained GLA(λ*) = Theorem 2 err(λ*) (worst γ, seed; relative gap)", rel.max(), REL_TOL,
                      "trained error: exact for restricted weights, else estimated beside the eq-15 optimum (drift.fig1)"),
    ]
    if "saddle_star" in r:
        out.append(saddle_check(gla, r["err_star"], r["saddle_star"], r["rank_one_share"], [f"γ = {g:g}" for g in gam],
                                REL_TOL))
    out += [
        check_at_most(f"GLA(λ*) below LMS and RLS at every γ: worst (GLA + 3 SE)/min(LMS, RLS) (γ = {gam[i[1]]})",
                      ratio.max(), 1.0, "the paper's claim; simulated filters with our protocol"),
        check_equal("GLA(λ*) below both filters, count of γ (worst seed)", int(np.min(np.sum(gla < best[None], axis=-1))),
                    len(gam)),
    ]
    if _paper_protocol(config) and np.all(np.isfinite(r["paper_lms"])):
        out.append(check_at_most("GLA(λ*) below the paper's reported LMS and RLS (worst GLA/min(reported))",
                                 float(np.max(gla / np.minimum(r["paper_lms"], r["paper_rls"])[None])), 1.0))
        for name in ("lms", "rls"):
            dev = np.abs(r[name] / r[f"paper_{name}"] - 1)
            j = int(np.argmax(dev))
            out.append(check_at_most(f"simulated {name.upper()} ≈ paper's reported value (worst relative gap, γ = {gam[j]})",
                                     dev.max(), PAPER_BASELINE_RTOL,
                                     "error definition, ŵ_0 and P_0 unspecified by the paper; a simulation "
                                     "with this protocol (a-priori error over the last 100 steps, ŵ_0 = 0, P_0 = 100 I) is "
                                     "within 14 % of the reported numbers"))
    return out


def plot_baselines(config: BaselinesConfig, r: dict):
    gam = r["gammas"]
    fig, axes = figure(ncols=2, width=5.2, height=3.8)
    ax = axes[0, 0]
    ax.errorbar(gam, r["lms"], yerr=r["lms_se"], fmt="-o", color=COLORS[1], ms=4, label=f"LMS (μ = {config.lms_mu:g}), simulated")
    ax.errorbar(gam, r["rls"], yerr=r["rls_se"], fmt="-s", color=COLORS[2], ms=4, label=f"RLS (β = {config.rls_beta:g}), simulated")
    if np.all(np.isfinite(r["paper_lms"])):
        ax.plot(gam, r["paper_lms"], "o", mfc="none", color=COLORS[1], ms=8, label="LMS, paper")
        ax.plot(gam, r["paper_rls"], "s", mfc="none", color=COLORS[2], ms=8, label="RLS, paper")
    ax.plot(gam, r["gla_err"].mean(0), "-*", color=COLORS[0], ms=10, label="GLA(λ*), trained")
    ax.plot(gam, r["err_star"], "--", color=COLORS[0], lw=1.0, label="GLA(λ*), Theorem 2")
    ax.plot(gam, r["err_la"], ":", color=COLORS[3], lw=1.2, label="LA (λ = 1), Theorem 2")
    ax.set_xlabel("AR(1) coefficient γ")
    ax.set_ylabel("error E(ŷ − y)²")
    ax.set_title(f"filters over {config.length} steps vs GLA with n = {config.n} context pairs", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    best = np.minimum(r["lms"], r["rls"])
    ax.plot(gam, r["gla_err"].mean(0) / best, "-*", color=COLORS[0], ms=10, label="GLA(λ*) / min(LMS, RLS)")
    ax.plot(gam, r["err_la"] / best, ":", color=COLORS[3], label="LA (Thm 2) / min(LMS, RLS)")
    ax.axhline(1.0, color="0.35", lw=0.8)
    ax.set_xlabel("AR(1) coefficient γ")
    ax.set_ylabel("error relative to the better filter")
    ax.set_title("below 1: better than both filters", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"drift Sec 5 baseline: LMS / RLS vs GLA at λ* (d = {config.d}, σ_w² = {config.sigma_w2:g}, "
                 f"σ_e² = {config.sigma_e2:g})", fontsize=10)
    return fig


register(
    Experiment(
        id="drift.baselines",
        title="GLA at λ* beats the LMS and RLS adaptive filters at every drift rate",
        paper=PAPER,
        reference="Sec 5, LMS/RLS comparison (reported numbers in the text); Theorem 2",
        config=BaselinesConfig,
        presets={
            "quick": {"trials": 500, "chunk": 500, "batch": 250, "steps": 200, "lr_schedule": "cosine",
                      "parametrisation": "restricted", "init_std": 0.03, "n_eval": 3000},
            "paper": {},
        },
        run=run_baselines,
        checks=checks_baselines,
        plot=plot_baselines,
        memory=memory_baselines,
        notes=[
            "The filters run on sequences of 1000 steps of the same AR(1) process (w_0 ~ N(0, σ_w² I)); the error is the "
            "a-priori squared error averaged over the last 100 steps, ŵ_0 = 0, RLS P_0 = 100 I (paper: unspecified). The "
            "γ's sequences share their inputs and innovations (common random numbers, one draw per chunk), as the "
            "training batches do.",
            "GLA is trained at the continuous λ* of Theorem 2 (n = 100 context pairs), one model per γ, as in drift.fig1.",
            "quick: restricted weights (init std 0.03), evaluated exactly (theory.drift.restricted_error), cosine lr, "
            "200 × 250 prompts, 500 filtered sequences per γ.",
            "paper: full q/k/v weights from a random Gaussian init, as in drift.fig1. A model can stall on the rank-one "
            "stationary point of the full weights (drift.fig1's notes; theory.drift.rank_one_saddle_errors), and then "
            "GLA(λ*) is not below the filters at that γ; the check on stalled models says which. "
            "`--set parametrisation=restricted` trains Theorem 1's weights, which have no such point.",
        ],
    )
)
