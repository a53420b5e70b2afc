"""gating Bayes gap (beyond the paper): the best a one-layer GLA can do (the gating optima of eq 22 and Thm 5) against
the Bayes-optimal predictor of the same multitask data model, as the query task's correlation with the context tasks
grows.

Data (App B.1, K = 2): β₁, β₂ ~ N(0, I_d) independent, β = r₁β₁ + r₂β₂ + √(1 − r₁² − r₂²) ξ, n̄ samples per task
block, x ~ N(0, I_d), y = xᵀβ_k + σε; the correlation is scaled along each of Fig 1's panels, r = ρ·(r₁, r₂)
(ρ = 1 is the paper's panel, ρ = 0 an unrelated query task).

- Optimal WPGD, L*_WPGD (eq 17 / Thm 2, ``theory.wpgd.wpgd_optimum``): the vector-gated GLA's optimum (Thm 5).
- Scalar gating with delimiters, L*_GLA (eq 22 / Thm 4, ``theory.wpgd.scalar_gating_optimum``).
- Bayes: the posterior mean of x_qᵀβ given both blocks (``iclab.baselines.multitask_posterior_mean``); its exact
  conditional risk given the inputs is ``multitask_bayes_risk``, and for σ = 0 its closed form is
  d − Σ_k r_k² min(n̄, d) (``independent_tasks_bayes_risk``): noiseless labels reveal β_k on the span of its block.

Every predictor is also simulated on the same sampled prompts (mean and standard error of the per-prompt squared
error, ``iclab.baselines.mean_and_se``, as ``mc_risk`` computes it), and checked against its closed form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import field_validator, model_validator

from iclab import baselines as bl
from iclab.experiments import Experiment, register
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._memory import FLOAT64, total
from iclab.experiments._plot import COLORS, figure
from iclab.experiments.checks import check_at_least, check_at_most
from iclab.experiments.gating._common import PANELS, PAPER
from iclab.progress import task
from iclab.tasks import multitask as mt
from iclab.theory import wpgd as theory

#: A closed form against the Monte-Carlo mean of its own predictor: |z| ≤ 4 (false alarm ~6e-5 per comparison).
Z_AGREE = 4.0
#: Bayes optimality, one-sided: no predictor may beat the Bayes risk by more than 3 standard errors.
Z_BAYES = 3.0
#: For σ = 0 the Bayes risk can be exactly 0 (n̄ ≥ d and r₁² + r₂² = 1): its squared errors are then float64
#: roundoff (~1e-25), so every standard error is floored at this fraction of tr Σ + σ² before forming a z-score.
SE_FLOOR = 1e-10
#: Closed forms of nested optimisation problems (Bayes ≤ WPGD ≤ scalar gating) compared to roundoff.
NESTED_TOL = 1e-9
#: The mean exact conditional Bayes risk against its closed form d − Σ r_k² min(n̄, d) (float64 SVD roundoff).
CLOSED_RTOL = 1e-8
PREDICTORS = ("wpgd", "scalar", "bayes")


class GatingBayesConfig(ExperimentConfig):
    d: int = param(10, "input dimension d", paper=10, ge=1, le=64)
    sigma2: float = param(0.0, "label-noise variance σ² (context and target)", paper=0.0, ge=0, le=1e4)
    panels: list[list[float]] = param([list(p) for p in PANELS], "directions (r₁, r₂) of the query-task "
                                      "correlation; r = ρ·(r₁, r₂)", paper=[list(p) for p in PANELS],
                                      paper_note="Fig 1 (a)-(d), at ρ = 1")
    rhos: list[float] = param([round(0.1 * i, 1) for i in range(11)], "correlation scales ρ (the x-axis)",
                              paper=1.0, paper_note="the paper has ρ = 1 only; this experiment is not in the paper")
    n_bars: list[int] = param([2, 5, 10, 20, 50], "samples per task n̄ (one panel each)", paper="0..50")
    prompts: int = param(20_000, "Monte-Carlo prompts per (panel, ρ, n̄)", ge=2, le=10_000_000)
    chunk: int = param(2000, "prompts evaluated at once (memory: ~chunk·2n̄·3d·8 bytes per array)", ge=2,
                       le=1_000_000)

    @field_validator("rhos")
    @classmethod
    def _rhos(cls, value):
        if not value or any(not 0 <= v <= 1.5 for v in value):
            raise ValueError("rhos must be a non-empty list of values in [0, 1.5]")
        return value

    @field_validator("n_bars")
    @classmethod
    def _n_bars(cls, value):
        if not value or any(n < 1 or n > 200 for n in value):
            raise ValueError("n_bars must be a non-empty list of integers in [1, 200]")
        return value

    @model_validator(mode="after")
    def _correlations(self):
        for p in self.panels:
            if len(p) != 2:
                raise ValueError(f"every panel must be a pair (r₁, r₂) (got {p})")
            for rho in self.rhos:
                r = rho * np.asarray(p, dtype=float)
                if r @ r > 1.0 + 1e-10:
                    raise ValueError(f"panels × rhos must satisfy r₁² + r₂² <= 1 (got ρ = {rho} × {p})")
        return self

    def task_rs(self) -> np.ndarray:
        """(panels, rhos, 2) query correlations r = ρ·(r₁, r₂)."""
        return np.asarray(self.rhos, dtype=float)[None, :, None] * np.asarray(self.panels, dtype=float)[:, None, :]


def closed_forms(config: GatingBayesConfig, r_task, n_bar: int) -> dict:
    """Risks (not divided by d) of optimal WPGD, scalar gating, linear attention and Bayes, and the two optima's
    (P, ω), at one query correlation r_task = (r₁, r₂) and n̄."""
    d, s2 = config.d, config.sigma2
    M = d + s2
    Sigma = np.eye(d)
    R, r = theory.two_task_correlation(n_bar, r1=float(r_task[0]), r2=float(r_task[1]))
    out = {"bayes_closed": (bl.independent_tasks_bayes_risk(block_sizes=[n_bar] * 2, task_r=r_task, d=d)
                            if s2 == 0 else np.nan)}
    if not np.any(r):  # an unrelated query task: ŷ = 0 is optimal for every predictor
        zero = (np.zeros((d, d)), np.zeros(2 * n_bar))
        return {**out, "wpgd": M, "scalar": M, "att": M, "wpgd_P": zero[0], "wpgd_omega": zero[1],
                "scalar_P": zero[0], "scalar_omega": zero[1]}
    opt = theory.wpgd_optimum(Sigma, R, r, s2)
    sc = theory.scalar_gating_optimum(Sigma, R, r, s2, [n_bar] * 2)
    return {**out, "wpgd": opt.risk, "scalar": sc.risk, "att": theory.linear_attention_risk(Sigma, R, r, s2),
            "wpgd_P": opt.P, "wpgd_omega": opt.omega, "scalar_P": sc.P, "scalar_omega": sc.omega}


@functools.partial(jax.jit, static_argnames=("sizes", "B", "d"))
def _squared_errors(key, factors, P_w, om_w, P_s, om_s, sigma2, *, sizes, B, d):
    """Per-prompt squared errors of the three predictors and the exact conditional Bayes risks, (S, B) each, on B
    prompts per setting (one task factor each, the same key: common random numbers across settings)."""

    def one(args):
        L, Pw, ow, Ps, os_ = args
        pr = mt.sample_blocks(key, B, sizes, L, None, jnp.sqrt(sigma2), d=d)
        x, y, x_q, t = pr.x, pr.y, pr.x_query, pr.y_query
        bayes = bl.multitask_posterior_mean(x, y, x_q, block_sizes=sizes, factor=L, sigma2=sigma2)
        return {"wpgd": (bl.wpgd(x, y, x_q, P=Pw, omega=ow) - t) ** 2,
                "scalar": (bl.wpgd(x, y, x_q, P=Ps, omega=os_) - t) ** 2,
                "bayes": (bayes - t) ** 2,
                "bayes_cond": bl.multitask_bayes_risk(x, block_sizes=sizes, factor=L, sigma2=sigma2)}

    return jax.lax.map(one, (factors, P_w, om_w, P_s, om_s))


def memory_gating_bayes(config: GatingBayesConfig) -> tuple[float, str]:
    """Upper estimate of :func:`run_gating_bayes`'s memory, float64: one chunk of prompts at the largest n̄ (2n̄
    samples of width d + 1, 10 copies, with the Bayes posterior's (3d)² covariances, 6 copies, per prompt), and
    the four per-prompt squared errors of every (panel, ρ) setting, kept in chunks and concatenated."""
    n, d = max(config.n_bars), config.d
    B = -(-config.prompts // -(-config.prompts // config.chunk))
    settings = len(config.panels) * len(config.rhos)
    return total([(FLOAT64 * B * (10 * (2 * n + 1) * (d + 1) + 6 * (3 * d) ** 2),
                   f"a chunk of {B} prompts of 2·{n} samples"),
                  (2.0 * FLOAT64 * 4 * settings * config.prompts,
                   f"the per-prompt squared errors of {config.prompts} prompts × {settings} settings")])


def _mean_se(v) -> tuple[float, float]:
    est = bl.mean_and_se(v)
    return float(est.mean), float(est.se)


def run_gating_bayes(config: GatingBayesConfig, reporter) -> dict:
    rs = config.task_rs()  # (A, Q, 2)
    A, Q = rs.shape[:2]
    N = len(config.n_bars)
    M = config.d + config.sigma2
    shape = (N, A, Q)
    names = ("wpgd", "scalar", "att", "bayes_closed", "bayes", "bayes_se", "bayes_paired_z",
             *(f"{p}_mc" for p in PREDICTORS), *(f"{p}_mc_se" for p in PREDICTORS),
             "wpgd_excess_z", "scalar_excess_z")
    out = {k: np.zeros(shape) for k in names}
    key = jax.random.PRNGKey(config.seed)
    with task(reporter, f"closed forms and {config.prompts} prompts per (panel, ρ, n̄)", N) as cb:
        for i, nb in enumerate(config.n_bars):
            # settings with the same r (every panel at ρ = 0) are simulated once
            uniq, inverse = np.unique(rs.reshape(-1, 2), axis=0, return_inverse=True)
            inverse = inverse.reshape(A, Q)
            cf = [closed_forms(config, r, nb) for r in uniq]
            for k in ("wpgd", "scalar", "att", "bayes_closed"):
                out[k][i] = np.array([c[k] for c in cf])[inverse]
            stack = {k: jnp.asarray(np.stack([c[k] for c in cf])) for k in ("wpgd_P", "wpgd_omega", "scalar_P",
                                                                           "scalar_omega")}
            factors = jnp.asarray(np.stack([mt.two_task_factor(r1=float(r[0]), r2=float(r[1])) for r in uniq]))
            n_chunks = -(-config.prompts // config.chunk)
            B = -(-config.prompts // n_chunks)
            parts = []
            for c in range(n_chunks):
                e = _squared_errors(jax.random.fold_in(jax.random.fold_in(key, nb), c), factors, stack["wpgd_P"],
                                    stack["wpgd_omega"], stack["scalar_P"], stack["scalar_omega"], config.sigma2,
                                    sizes=(nb, nb), B=B, d=config.d)
                parts.append({k: np.asarray(v) for k, v in e.items()})
            e = {k: np.concatenate([p[k] for p in parts], axis=-1)[:, : config.prompts] for k in parts[0]}
            floor = SE_FLOOR * M
            per = {}
            for p in PREDICTORS:
                per[f"{p}_mc"], per[f"{p}_mc_se"] = np.array([_mean_se(v) for v in e[p]]).T
            per["bayes"], per["bayes_se"] = np.array([_mean_se(v) for v in e["bayes_cond"]]).T
            per["bayes_paired_z"] = np.array([_paired_z(a, b, floor) for a, b in zip(e["bayes"], e["bayes_cond"])])
            for p in ("wpgd", "scalar"):
                per[f"{p}_excess_z"] = np.array([_paired_z(a, b, floor) for a, b in zip(e[p], e["bayes_cond"])])
            for k, v in per.items():
                out[k][i] = v[inverse]
            cb(i + 1, {})
    out["n_bars"] = np.asarray(config.n_bars)
    out["rhos"] = np.asarray(config.rhos, dtype=float)
    out["panels"] = np.asarray(config.panels, dtype=float)
    bayes = np.where(np.isfinite(out["bayes_closed"]), out["bayes_closed"], out["bayes"])
    out["gap_wpgd"] = out["wpgd"] - bayes
    out["gap_scalar"] = out["scalar"] - bayes
    with np.errstate(divide="ignore", invalid="ignore"):
        # no ratio where the Bayes risk is 0 (noiseless, n̄ ≥ d, r₁² + r₂² = 1: β is recovered exactly)
        out["ratio_wpgd"] = np.where(bayes > SE_FLOOR * M, out["wpgd"] / bayes, np.nan)
        out["ratio_scalar"] = np.where(bayes > SE_FLOOR * M, out["scalar"] / bayes, np.nan)
    return out


def _paired_z(a, b, floor: float) -> float:
    m, se = _mean_se(np.asarray(a) - np.asarray(b))
    return m / max(se, floor)


def _where(config: GatingBayesConfig, idx) -> str:
    i, a, q = idx
    p = config.panels[a]
    return f"n̄ = {config.n_bars[i]}, r = {config.rhos[q]:g}·({p[0]:g}, {p[1]:g})"


def checks_gating_bayes(config: GatingBayesConfig, r: dict) -> list:
    M = config.d + config.sigma2
    floor = SE_FLOOR * M
    out = []
    for name, key, what in (("optimal WPGD (Thm 2; = vector gating, Thm 5), simulated = closed form", "wpgd", "eq 37"),
                            ("scalar gating optimum (eq 22), simulated = closed form", "scalar", "eq 37 at eq 22's ω")):
        z = np.abs(r[f"{key}_mc"] - r[key]) / np.maximum(r[f"{key}_mc_se"], floor)
        idx = np.unravel_index(np.argmax(z), z.shape)
        out.append(check_at_most(f"{name} (max |z|; {_where(config, idx)})", float(z[idx]), Z_AGREE,
                                 f"{what} vs the Monte-Carlo mean of {config.prompts} prompts, 4 standard errors"))
    z = np.abs(r["bayes_paired_z"])
    idx = np.unravel_index(np.argmax(z), z.shape)
    out.append(check_at_most(f"Bayes posterior mean's squared error = its exact conditional risk (paired, max |z|; "
                             f"{_where(config, idx)})", float(z[idx]), Z_AGREE,
                             "E[(ŷ − y)² | X] = multitask_bayes_risk exactly; 4 SE of the per-prompt difference "
                             f"(SE floored at {SE_FLOOR:g}·(d + σ²): a zero Bayes risk leaves roundoff)"))
    closed = np.isfinite(r["bayes_closed"])
    if np.any(closed):
        rel = np.abs(r["bayes"] - r["bayes_closed"])[closed] / M
        out.append(check_at_most("mean exact conditional Bayes risk = d − Σ r_k² min(n̄, d) (σ = 0; max |difference|/"
                                 "(d + σ²))", float(rel.max()), CLOSED_RTOL,
                                 "the conditional risk is the same for almost every context: float64 roundoff only"))
        bayes, slack = r["bayes_closed"], NESTED_TOL * M
    else:
        bayes, slack = r["bayes"] - Z_BAYES * r["bayes_se"], NESTED_TOL * M
    excess = np.maximum(bayes - r["wpgd"], r["wpgd"] - r["scalar"])
    idx = np.unravel_index(np.argmax(excess), excess.shape)
    out.append(check_at_most(f"Bayes ≤ optimal WPGD ≤ scalar gating (closed forms; max excess/(d + σ²); "
                             f"{_where(config, idx)}); optimal WPGD − Bayes up to "
                             f"{np.max(r['wpgd'] - np.where(closed, r['bayes_closed'], r['bayes'])) / config.d:.4f}·d",
                             float(excess[idx] / M), slack / M,
                             "nested: Bayes is optimal, free ω ⊃ monotone block ω (σ > 0: Bayes from its 3 SE bound)"))
    zs = np.stack([r["wpgd_excess_z"], r["scalar_excess_z"]])
    idx = np.unravel_index(np.argmin(zs), zs.shape)
    out.append(check_at_least(f"Bayes ≤ simulated optimal WPGD and scalar gating: min paired z "
                              f"({('WPGD', 'scalar')[idx[0]]}, {_where(config, idx[1:])})", float(zs[idx]), -Z_BAYES,
                              "per-prompt (ŷ − y)² minus the exact conditional Bayes risk, one-sided 3 SE"))
    return out


def plot_gating_bayes(config: GatingBayesConfig, r: dict):
    N = len(config.n_bars)
    rho = r["rhos"]
    d = config.d
    fig, axes = figure(ncols=N, nrows=2, width=3.8, height=3.3)
    bayes = np.where(np.isfinite(r["bayes_closed"]), r["bayes_closed"], r["bayes"])
    for i, nb in enumerate(config.n_bars):
        ax, ax2 = axes[0, i], axes[1, i]
        for a, p in enumerate(config.panels):
            c = COLORS[a % len(COLORS)]
            lab = f"({p[0]:g}, {p[1]:g})"
            ax.plot(rho, r["wpgd"][i, a] / d, "--", color=c, lw=1.0)
            ax.plot(rho, r["scalar"][i, a] / d, ":", color=c, lw=1.6)
            ax.plot(rho, bayes[i, a] / d, "-", color=c, lw=2.2, alpha=0.35)
            ax.errorbar(rho, r["wpgd_mc"][i, a] / d, yerr=r["wpgd_mc_se"][i, a] / d, fmt="o", color=c, ms=3,
                        label=f"{lab}" if i == 0 else None)
            ax.errorbar(rho, r["bayes_mc"][i, a] / d, yerr=r["bayes_mc_se"][i, a] / d, fmt="s", mfc="none", color=c,
                        ms=3.5)
            ax2.plot(rho, r["gap_wpgd"][i, a] / d, "--o", color=c, ms=3, lw=1.0, label=f"{lab}: WPGD − Bayes")
            ax2.plot(rho, r["gap_scalar"][i, a] / d, ":", color=c, lw=1.6,
                     label="dotted: scalar GLA − Bayes" if a == len(config.panels) - 1 else None)
        ax.set_title(f"n̄ = {nb}", fontsize=9)
        ax.set_xlabel("correlation scale ρ  (r = ρ·(r₁, r₂))")
        ax.set_ylabel("risk / d")
        ax2.set_xlabel("correlation scale ρ  (r = ρ·(r₁, r₂))")
        ax2.set_ylabel("(optimum − Bayes) / d")
        if i == 0:
            ax.legend(fontsize=6.5, title="panel (r₁, r₂)", title_fontsize=6.5)
            ax2.legend(fontsize=6)
    fig.suptitle(f"gating, beyond the paper: the gating optima vs the Bayes-optimal predictor (d = {d}, "
                 f"σ² = {config.sigma2:g}, {config.prompts} prompts per point)\n"
                 "dashed: optimal WPGD = vector GLA (Thm 2/5); dotted: scalar GLA (eq 22); wide pale: Bayes; "
                 "o / □: simulated WPGD / Bayes (± SE)", fontsize=8)
    return fig


register(
    Experiment(
        id="gating.bayes",
        title="Beyond the paper: the gating optima (eq 22, Thm 5) against the Bayes-optimal predictor, vs task correlation",
        paper=PAPER,
        reference="not in the paper; eqs 17, 22, 37 (Thms 2, 4, 5) against the exact Bayes predictor of App B.1's model",
        config=GatingBayesConfig,
        presets={
            "quick": {"rhos": [0.0, 0.25, 0.5, 0.75, 1.0], "n_bars": [5, 20], "prompts": 2000, "chunk": 2000},
            "paper": {},
        },
        run=run_gating_bayes,
        checks=checks_gating_bayes,
        plot=plot_gating_bayes,
        memory=memory_gating_bayes,
        notes=[
            "This result goes beyond the paper: the paper's optimum (eq 17 = the vector-gated GLA, Thm 5; eq 22 for "
            "scalar gating) is the best one-layer GLA, never compared with the Bayes-optimal predictor of its own data "
            "model. The data model is App B.1's (K = 2 independent tasks, Σ = I, σ = 0, d = 10); the correlation "
            "scale ρ (r = ρ·(r₁, r₂) along each Fig 1 panel), the n̄ values and the Monte-Carlo sizes are ours.",
            "Bayes: Gaussian conditioning of both task vectors on both blocks (iclab.baselines.multitask_*); for σ = 0 "
            "its risk is d − Σ r_k² min(n̄, d) for almost every context, 0 when n̄ ≥ d and r₁² + r₂² = 1. WPGD, "
            "restricted to one gradient step with a fixed preconditioner, cannot invert the context's Gram matrix, "
            "so the gap stays open however large n̄ is.",
            "Prompts share their random numbers across panels and ρ (common random numbers); `seeds` is not used "
            "(nothing is trained; `prompts` sets the Monte-Carlo size).",
        ],
    )
)
