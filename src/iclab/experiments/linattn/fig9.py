"""linattn Fig 9: ATTN_M weights of the Fig 1 run: rank one along vec(Λ²) on the plateau, along
E(y_q zᵀ)E(zzᵀ)⁻¹ at the end (≈ vec(Λ⁻¹) as N → ∞); the eq-55 conservation law."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import model_validator

from iclab.engines import linreg
from iclab.engines.linreg import Engine, LinregSettings, LinregTraining
from iclab.experiments._config import engine_fields, param, setting
from iclab.experiments._memory import records, total
from iclab.experiments._plot import COLORS, TIME_LABEL, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_abs, check_at_most
from iclab.experiments.linattn._common import (
    PAPER,
    CovarianceConfig,
    keys_and_covariances,
    prompts_memory,
    training_spec,
)
from iclab.theory import linattn as theory

#: (array name, model, engine) of the Fig 1 runs re-run with their weights recorded.
RUNS = (("sampled", "attn_m", "sampled"), ("mlp", "mlp", "sampled"), ("population", "attn_m", "population"))


class Fig9Config(CovarianceConfig):
    N: int = param(31, "context pairs per prompt N", paper=31, ge=1, le=100_000)
    linreg: ClassVar = engine_fields(
        LinregSettings,
        H=setting(8, paper=8, le=1024),
        w_init=setting(1e-6, paper=1e-6, paper_note="Fig 1 run; reference code: --init 1e-6", le=10),
        lr=setting(0.031, paper=0.031, paper_note="as linattn.fig1: reference lr 1e-3 without 1/N", le=10),
        steps=setting(6000, paper=6000, paper_note="reference code: 6001 epochs", ge=1, le=10_000_000),
        P=setting(5000, paper=5000, paper_note="reference code default", le=1_000_000),
        record_every=setting(10, le=1_000_000),
    )
    plateau_frac: float = param(0.5, "the plateau snapshot is taken at this fraction of the time the population "
                                "loss takes to fall half-way to L(M_D)", gt=0, lt=1)

    def training(self, model: str, engine: Engine, *, lr_factor: int = 1) -> LinregTraining:
        """The Fig 1 run of one model by one engine, weights recorded; ``lr_factor`` k runs lr/k for k times
        the steps (the same time), recording the end only when k > 1."""
        return training_spec(self, model=model, engine=engine, lr=self.lr / lr_factor, steps=lr_factor * self.steps,
                             record_every=self.record_every if lr_factor == 1 else lr_factor * self.steps,
                             P=self.P if engine == "sampled" else None, record_params=True)

    @model_validator(mode="after")
    def _trainings(self):
        for _, model, engine in RUNS:
            self.training(model, engine)
        self.training("attn_m", "population", lr_factor=2)
        return self


def _rows(U) -> np.ndarray:
    """W₁ of eq 7 from ATTN_M's U: row i = vec(U_i)ᵀ (column stacking). U: (..., H, D, D) → (..., H, D²)."""
    U = np.asarray(U)
    return np.swapaxes(U, -1, -2).reshape(*U.shape[:-2], -1)


def singular_ratio(W1) -> np.ndarray:
    """σ₂/σ₁ of W₁ (..., H, D²) → (...)."""
    sv = np.linalg.svd(np.asarray(W1), compute_uv=False)
    return sv[..., 1] / sv[..., 0]


def row_cosines(W1, direction) -> np.ndarray:
    """|cos| between each row of W₁ (..., H, D²) and a unit direction (D²,) → (..., H)."""
    W1 = np.asarray(W1)
    return np.abs(W1 @ direction) / np.linalg.norm(W1, axis=-1)


def conserved_drift(v, U) -> np.ndarray:
    """max |C(t) − C(0)| of C = w₂w₂ᵀ − W₁W₁ᵀ (eq 55) along a run. v: (S, T, H), U: (S, T, H, D, D) → (S, T)."""
    v, W1 = np.asarray(v), _rows(U)
    C = v[..., :, None] * v[..., None, :] - W1 @ np.swapaxes(W1, -1, -2)
    return np.max(np.abs(C - C[:, :1]), axis=(-2, -1))


def memory_fig9(config: Fig9Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig9`'s memory: the sampled engine's P prompts with their scores and gradients
    (:func:`iclab.experiments.linattn._common.prompts_memory`) and the recorded weights of the three runs, H(1 + D²)
    numbers per record and seed (ATTN_M's v and U, the MLP's w₂ and W₁) beside the losses."""
    values = config.H * (1 + config.D ** 2) + 3
    return total([prompts_memory(config),
                  (3 * records(seeds=config.seeds, steps=config.steps, record_every=config.record_every,
                               values=values), "the recorded weights of the three runs")])


def run_fig9(config: Fig9Config, reporter) -> dict:
    """The Fig 1 run (sampled ATTN_M and MLP, same init and data) and the exact population run,
    weights recorded; plus population GD at lr/2 over the same time for the conservation law."""
    keys, Lams = keys_and_covariances(config)
    common = dict(keys=keys, Lams=Lams, N=config.N, reporter=reporter)
    out = {"Lam": np.asarray(Lams)}
    for name, model, engine in RUNS:
        tr = linreg.train(config.training(model, engine), label=f"{engine} {model}", **common)
        out[f"{name}_t"] = tr.t
        out[f"{name}_loss"] = tr.metrics.get("population", tr.loss)
        if model == "mlp":
            out["mlp_W1"], out["mlp_w2"] = tr.params["W1"], tr.params["w2"]
        else:
            out[f"{name}_U"], out[f"{name}_v"] = tr.params["U"], tr.params["v"]
    out["population_drift"] = conserved_drift(out["population_v"], out["population_U"])
    half = linreg.train(config.training("attn_m", "population", lr_factor=2), label="population attn_m, lr/2",
                        **common)
    out["population_half_lr_drift"] = conserved_drift(half.params["v"], half.params["U"])
    return out


def snapshots(config: Fig9Config, t, loss, levels) -> tuple[np.ndarray, np.ndarray]:
    """Record indices, per seed, of the plateau snapshot (plateau_frac × the half-way crossing time
    of the loss to L(M_D)) and of the end."""
    idx = []
    for c in np.atleast_2d(loss):
        below = np.flatnonzero(c <= 0.5 * (levels[0] + levels[-1]))
        t_half = t[below[0]] if below.size else t[-1]
        idx.append(int(np.searchsorted(t, config.plateau_frac * t_half)))
    return np.array(idx), np.full(len(idx), len(t) - 1)


def directions(r: dict, N: int, s: int):
    """Unit directions for seed s: plateau vec(Λ²), converged E(y_qzᵀ)E(zzᵀ)⁻¹, and vec(Λ⁻¹)."""
    Lam = r["Lam"][s]
    return theory.plateau_direction(Lam), theory.converged_direction(Lam, 1.0 / N), theory.large_N_direction(Lam)


def checks_fig9(config: Fig9Config, r: dict) -> list:
    levels = theory.plateau_losses(config.lambdas(), 1.0 / config.N)
    S = r["Lam"].shape[0]
    stats = {}
    for engine in ("population", "sampled"):
        W1 = _rows(r[f"{engine}_U"])
        plat, end = snapshots(config, r[f"{engine}_t"], r[f"{engine}_loss"], levels)
        ratio, cos_p, cos_c, cos_l = [], [], [], []
        for s in range(S):
            d_plat, d_conv, d_inv = directions(r, config.N, s)
            ratio.append(singular_ratio(W1[s, plat[s]]))
            cos_p.append(row_cosines(W1[s, plat[s]], d_plat).min())
            cos_c.append(row_cosines(W1[s, end[s]], d_conv).min())
            cos_l.append(abs(d_conv @ d_inv))
        stats[engine] = dict(ratio=max(ratio), cos_p=min(cos_p), cos_c=min(cos_c), cos_l=min(cos_l))

    same = np.max(np.abs(_rows(r["sampled_U"]) - r["mlp_W1"])) / np.max(np.abs(r["mlp_W1"]))
    same = max(same, np.max(np.abs(r["sampled_v"] - r["mlp_w2"])) / np.max(np.abs(r["mlp_w2"])))
    pop = stats["population"]
    order = float(np.log2(np.max(r["population_drift"][:, -1]) / np.max(r["population_half_lr_drift"][:, -1])))
    finite_P = (f"finite P = {config.P}: the rows follow the training set's E_P(y_q z) and least-squares solution, "
                "O(1/√P) away from the population directions")
    return [
        check_at_most("ATTN_M heads = MLP rows (max relative difference of U_i vs W₁ and v vs w₂)", same, 1e-10,
                      "same init (eq 7) and data, trained by independent forward passes (eq M vs w₂ᵀW₁z)"),
        check_at_most("plateau: W₁ rank one, σ₂/σ₁ (population, worst seed)", pop["ratio"], 1e-2,
                      "small init + eq 55 conservation: W₁W₁ᵀ ≈ w₂w₂ᵀ (D.7)"),
        check_at_most("plateau: W₁ rank one, σ₂/σ₁ (sampled, worst seed)", stats["sampled"]["ratio"], 1e-2),
        check_abs("plateau: min |cos(row, vec(Λ²))| (population, all heads and seeds)", pop["cos_p"], 1.0, 0.01,
                  "D.6.2: only the E(y_q z) = vec(Λ²) component of the rows grows on the plateau"),
        check_abs("plateau: min |cos(row, vec(Λ²))| (sampled)", stats["sampled"]["cos_p"], 1.0, 0.01, finite_P),
        check_abs("end: min |cos(row, E(y_qzᵀ)E(zzᵀ)⁻¹)| (population)", pop["cos_c"], 1.0, 0.01,
                  "eqs 9, 11: w₂ᵀW₁ = E(y_qzᵀ)E(zzᵀ)⁻¹ and W₁ stays rank one"),
        check_abs("end: min |cos(row, E(y_qzᵀ)E(zzᵀ)⁻¹)| (sampled)", stats["sampled"]["cos_c"], 1.0, 0.01, finite_P),
        check_at_most("end: rows resolve the finite-N correction, (1 − cos to eq 11) / (1 − cos of eq 11 to vec(Λ⁻¹))",
                      (1 - pop["cos_c"]) / (1 - pop["cos_l"]), 0.1,
                      f"population run; eq 11's direction and vec(Λ⁻¹) differ by 1 − cos = {1 - pop['cos_l']:.1e} at "
                      f"N = {config.N}, equal only as N → ∞ (Fig 9 bottom)"),
        check_abs("eq 55 under GD: order p of the drift in lr over a fixed time (log₂ drift(lr)/drift(lr/2))",
                  order, 1.0, 0.1,
                  "GD changes w₂w₂ᵀ − W₁W₁ᵀ by η²(∇_{w₂}∇_{w₂}ᵀ − ∇_{W₁}∇_{W₁}ᵀ) per step (O(lr²)), i.e. O(lr) "
                  "over t/lr steps; exactly conserved under gradient flow"),
    ]


def plot_fig9(config: Fig9Config, r: dict):
    import matplotlib.pyplot as plt

    levels = theory.plateau_losses(config.lambdas(), 1.0 / config.N)
    t = r["sampled_t"]
    W1 = _rows(r["sampled_U"])[0]
    plat, end = snapshots(config, t, r["sampled_loss"], levels)
    d_plat, d_conv, d_inv = directions(r, config.N, 0)
    fig, axes = figure(ncols=2, nrows=3, width=5.6, height=2.9)

    def heat(ax, M, title, xlabel="entry of vec(·), column stacking"):
        M = np.atleast_2d(M)
        lim = np.max(np.abs(M))
        im = ax.imshow(M, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel(xlabel, fontsize=7)
        ax.grid(False)
        if M.shape[0] == 1:
            ax.set_yticks([])
        plt.colorbar(im, ax=ax, fraction=0.04)

    heat(axes[0, 0], W1[plat[0]], f"W₁ (rows vec(U_i)) on the plateau, t = {t[plat[0]]:.1f}")
    axes[0, 0].set_ylabel("head i")
    heat(axes[0, 1], np.sign(d_plat @ W1[plat[0], np.argmax(np.linalg.norm(W1[plat[0]], axis=1))]) * d_plat,
         "E(y_q zᵀ) = vec(Λ²) (unit norm)")
    heat(axes[1, 0], W1[end[0]], f"W₁ at the end, t = {t[end[0]]:.0f}")
    axes[1, 0].set_ylabel("head i")
    heat(axes[1, 1], d_conv, "E(y_q zᵀ)E(zzᵀ)⁻¹ (unit norm)")
    heat(axes[2, 1], d_inv, "vec(Λ⁻¹): the N → ∞ limit (unit norm)")

    ax = axes[2, 0]
    for name, d, color in (("vec(Λ²)", d_plat, COLORS[0]), ("E(yzᵀ)E(zzᵀ)⁻¹", d_conv, COLORS[1])):
        ax.plot(t, row_cosines(W1, d).min(axis=-1), color=color, label=f"min_i |cos(row_i, {name})|")
    ax.axvline(t[plat[0]], color="0.6", lw=0.8)
    ax.set_xlabel(TIME_LABEL, fontsize=7)
    ax.set_ylabel("|cos|")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    ax2.plot(t, r["sampled_loss"][0], color="0.3", lw=1.0, label="population loss")
    ax2.set_ylabel("loss", fontsize=7)
    ax.legend(fontsize=6, loc="center right")
    ax.set_title("alignment of the heads (sampled run, seed 0)", fontsize=8)
    fig.suptitle(f"linattn Fig 9: ATTN_M weights of the Fig 1 run (full-batch GD, P = {config.P}); "
                 f"H = {config.H}, D = {config.D}, N = {config.N}", fontsize=10)
    return fig


register(
    Experiment(
        id="linattn.fig9",
        title="ATTN_M weights: rank one along vec(Λ²) on the plateau, along E(y_qzᵀ)E(zzᵀ)⁻¹ at the end",
        paper=PAPER,
        reference="Fig 9; App D.6.2 (weight directions), eq 55 (conservation), eqs 9, 11, 43-45",
        config=Fig9Config,
        presets={"quick": {"record_every": 20}, "paper": {}},
        run=run_fig9,
        checks=checks_fig9,
        plot=plot_fig9,
        notes=[
            "The Fig 1 setting (linattn.fig1's defaults) re-run with the weights recorded: sampled ATTN_M and the MLP "
            "(the figure), the exact population run (the tight direction checks), and population GD at lr/2 for the "
            "order of the eq-55 drift.",
            "W₁'s row i is vec(U_i)ᵀ with column-stacking vec (eq 7); directions are compared up to sign.",
            "Plateau snapshot: half-way (plateau_frac) through the time the population loss takes to fall half-way "
            "from L(M₀) to L(M_D).",
        ],
        memory=memory_fig9,
    )
)
