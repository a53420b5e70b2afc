"""linattn Fig 3: rank-one ATTN_S learns the eigenvectors of Λ one at a time: D drops to the
eq-19 plateaus, each driven by one head's v_i following eq 21, that head aligning with e_m."""

from __future__ import annotations

import numpy as np

from iclab.experiments._analysis import count_drops
from iclab.experiments._config import param
from iclab.experiments._plot import COLORS, MODEL_COLORS, TIME_LABEL, figure, theory_levels
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most, check_equal
from iclab.experiments.linattn._attn_s import AttnSConfig, OdeAlign, attn_s_memory, plateau_errors, run_attn_s
from iclab.experiments.linattn._common import PAPER


class Fig3Config(AttnSConfig):
    seeds: int = param(6, "random initialisations (each with its own P prompts)", paper=6, ge=1, le=1024)
    ode_align: OdeAlign = param(
        "half_rise", "eq-21 overlay: shifted in time to the simulated half-rise v*/2 (half_rise), or started at "
        "the simulated v_{m}(t_{m−1}) when the previous drop ends (start)", paper=None,
        paper_note="unspecified; eq 21 is autonomous, so half_rise tests its shape and start also its timing "
                   "(the timing is eq 76's, tested in linattn.fig10)",
    )
    show_seed: int = param(0, "seed shown in panels (b) and (c)", ge=0, le=1023)
    log_time: bool = param(False, "logarithmic time axis in panels (a) and (b)", paper=False)


def run_fig3(config: Fig3Config, reporter) -> dict:
    return run_attn_s(config, reporter, R=1, align=config.ode_align)


def alignment_errors(r: dict, prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """For each seed and m = 1..D, at the middle of plateau M_m, the head carrying e_m:
    1 − min(|cos(k, e_m)|, |cos(q, e_m)|) and max(| |v|, ‖k‖, ‖q‖ | / v*_m − 1). NaN where M_m is
    not visited. Returns two (S, D) arrays."""
    ck, cq = r[f"{prefix}cos_k"][:, 1:, :, 0, :], r[f"{prefix}cos_q"][:, 1:, :, 0, :]  # (S, D, H, D)
    S, D = ck.shape[:2]
    mis, dev = np.full((S, D), np.nan), np.full((S, D), np.nan)
    vs = r["v_star"]
    for s in range(S):
        for m in range(D):
            if r[f"{prefix}middle_idx"][s, m + 1] < 0:
                continue
            # the head carrying e_m: largest |v|·|cos(k, e_m)|·|cos(q, e_m)| (a small head may also point along e_m)
            i = int(np.argmax(np.abs(r[f"{prefix}v_middle"][s, m + 1]) * ck[s, m, :, m] * cq[s, m, :, m]))
            mis[s, m] = 1.0 - min(ck[s, m, i, m], cq[s, m, i, m])
            sizes = np.array([abs(r[f"{prefix}v_middle"][s, m + 1, i]), r[f"{prefix}norm_k"][s, m + 1, i, 0],
                              r[f"{prefix}norm_q"][s, m + 1, i, 0]])
            dev[s, m] = np.max(np.abs(sizes / vs[m] - 1.0))
    return mis, dev


def ode_errors(r: dict, prefix: str = "") -> np.ndarray:
    """max_t |v_sim − v_eq21| / v*_m for each seed and direction (where eq 21 is defined): (S, D)."""
    sim, ode = r[f"{prefix}v_learner"], r[f"{prefix}v_ode"]
    err = np.where(np.isfinite(ode), np.abs(sim - ode), np.nan)
    with np.errstate(invalid="ignore"):
        return np.nanmax(err, axis=-1) / r["v_star"][None, :]


def checks_fig3(config: Fig3Config, r: dict) -> list:
    D, levels = config.D, r["plateau_levels"]
    engines = [("", f"{config.engine} engine" + (f", P = {config.P}" if config.engine == "moments" else ""))]
    if "pe_pop" in r:
        engines.append(("pe_", "population engine"))
    out = []
    for prefix, name in engines:
        t, pop = r[f"{prefix}t"], r[f"{prefix}pop"]
        drops = [count_drops(t, c) for c in pop]
        out.append(check_equal(f"{D} drops, every seed ({name}; fewest/most-off seed)",
                               max(drops, key=lambda n: abs(n - D)), D,
                               "count_drops on the exact expected loss of the weights: a drop = a peak of −dL/dt "
                               "separated from the next by a plateau (rate < 10 % of the peaks)"))
        out.append(check_at_most(f"plateau losses = eq 19 ({name}; worst |L − L(M_m)| over plateaus and seeds)",
                                 float(plateau_errors(t, pop, levels).max()), 0.01,
                                 "loss at the slowest record of each plateau, its start and the last record, vs the "
                                 "nearest eq-19 level (our tolerance)"))
    # Alignment is the theory's statement about the population loss; with finite P the weakly determined
    # directions (curvature λ_d a_d ≈ 1e-3 for e_4) tilt by O(P^{-1/2}) more than 1 − 0.99.
    prefix, name = ("pe_", "population engine") if "pe_pop" in r else engines[0]
    mis, dev = alignment_errors(r, prefix)
    out.append(check_at_most(f"after drop m a head has |cos(k, e_m)|, |cos(q, e_m)| > 0.99 ({name}; worst 1 − |cos|)",
                             float(np.nanmax(mis)), 0.01,
                             "at the middle of plateau M_m (half-way between the end of drop m and the start of "
                             "drop m+1; the last record for m = D), the head with the largest |v|·|cos k|·|cos q|"))
    out.append(check_at_most(f"that head has |v| = ‖k‖ = ‖q‖ = v*_m (eq 20; {name}; worst relative deviation)",
                             float(np.nanmax(dev)), 0.01,
                             "v*_m = (λ_m/a_m)^{1/3}; GD has the fixed points of GF; the residue is the slow growth "
                             "of the next head on short plateaus"))
    if config.engine == "moments":
        _, dev_m = alignment_errors(r, "")
        tol = 0.01 + 3.0 / np.sqrt(config.P)
        out.append(check_at_most(f"|v| = ‖k‖ = ‖q‖ = v*_m after drop m (moments engine, P = {config.P}; worst "
                                 "relative deviation)", float(np.nanmax(dev_m)), tol,
                                 f"tolerance 0.01 + 3/√P = {tol:.3f}: at finite P the fixed point follows the sample "
                                 "fourth moments (relative error ≈ 3/√P for Gaussian data), v ∝ a^{-1/3}"))
    err = ode_errors(r, "")
    out.append(check_at_most(f"v_m(t) = eq 21 ({config.ode_align} alignment; worst max_t |Δv|/v*_m over seeds, m)",
                             float(np.nanmax(err)), 0.1,
                             "eq 21 holds on the eq-20 manifold (k = q = v e_m, other heads at rest); from random "
                             "init the head's residual misalignment and imbalance, and a previous head still "
                             "converging on a short plateau, bend the rise by several % of v*"))
    out.append(check_at_most("v_m(t) = eq 21 (median over seeds and m of max_t |Δv|/v*_m)",
                             float(np.nanmedian(err)), 0.02,
                             "typical agreement: GD (lr·6λ²v* ≤ 0.25 per step on e_1) vs GF and the finite-P shift of "
                             "v* (≈ 0.5 %) each cost ≲ 1 %"))
    return out


def _heatmap_rows(r: dict, s: int) -> np.ndarray:
    """Heads ordered by the eigendirection they carry at the end (head of e_1 first), then the rest."""
    order = [int(i) for i in r["learner"][s, :, 0]]
    rest = [i for i in range(r["v"].shape[-1]) if i not in order]
    return np.array(list(dict.fromkeys(order)) + rest)


def plot_fig3(config: Fig3Config, r: dict):
    D, levels, lam = config.D, r["plateau_levels"], r["eigenvalues"]
    s = min(config.show_seed, config.seeds - 1)
    fig, axes = figure(ncols=1, nrows=1, width=13.0, height=7.2)
    axes[0, 0].remove()
    gs = fig.add_gridspec(2, 2 * (D + 1), height_ratios=[1.5, 1.0])
    ax_a = fig.add_subplot(gs[0, : D + 1])
    ax_b = fig.add_subplot(gs[0, D + 1 :])
    t = r["t"]
    for i, c in enumerate(r["loss"]):
        ax_a.plot(t, c, color=MODEL_COLORS["ATTN_S"], lw=1.2, alpha=0.85,
                  label=f"training loss, {config.engine} engine ({config.seeds} seeds)" if i == 0 else None)
    if "pe_loss" in r:
        for i, c in enumerate(r["pe_loss"]):
            ax_a.plot(r["pe_t"], c, color="0.55", lw=0.8, alpha=0.7, label="population engine" if i == 0 else None)
    theory_levels(ax_a, levels, [f"L(M_{m})" for m in range(D + 1)])
    ax_a.plot([], [], color="0.35", ls="--", lw=1.0, label="eq 19")
    ax_a.set_ylabel("loss")
    ax_a.set_title(f"(a) loss: {D} drops to the eq-19 plateaus", fontsize=9)
    ax_a.legend(fontsize=7, loc="upper right", bbox_to_anchor=(0.93, 1.0))
    for m in range(D):
        ax_b.plot(t, r["v_learner"][s, m], color=COLORS[m], lw=1.6, label=f"|v| of the head learning e_{m + 1}")
        ax_b.plot(t, r["v_ode"][s, m], color=COLORS[m], lw=1.2, ls="--")
    ax_b.plot([], [], color="0.35", ls="--", lw=1.0, label=f"eq 21 ({config.ode_align.replace('_', '-')} aligned)")
    ax_b.set_ylabel("|v_i|")
    ax_b.set_title(f"(b) value weights, seed {s}: simulation (solid), eq 21 (dashed)", fontsize=9)
    ax_b.legend(fontsize=7, loc="lower right")
    # (b) ends a little after the shown seed's last drop; (a) spans the run (every seed).
    t_last = r["t_end"][s, -1]
    t_b = min(t[-1], 1.25 * t_last) if np.isfinite(t_last) else t[-1]
    for ax, t_max in ((ax_a, t[-1]), (ax_b, t_b)):
        ax.set_xlabel(TIME_LABEL)
        ax.grid(alpha=0.25)
        if config.log_time:
            ax.set_xscale("log")
            ax.set_xlim(t[1], t_max)
        else:
            ax.set_xlim(0, t_max)
    rows = _heatmap_rows(r, s)
    for m in range(D + 1):
        ax = fig.add_subplot(gs[1, 2 * m : 2 * m + 2])
        idx = r["middle_idx"][s, m]
        if idx < 0:
            ax.set_axis_off()
            ax.set_title(f"M_{m} not visited", fontsize=8)
            continue
        M = r["cos_k"][s, m][rows, 0, :]
        im = ax.imshow(M, cmap="Greys", vmin=0, vmax=1, aspect="equal", interpolation="nearest")
        ax.set_xticks(range(D), [f"e{d + 1}" for d in range(D)], fontsize=7)
        ax.set_yticks(range(len(rows)), [f"k{i + 1}" for i in range(len(rows))], fontsize=7)
        ax.set_title(f"plateau M_{m}, t = {t[idx]:.0f}", fontsize=8)
    fig.colorbar(im, ax=fig.axes[-(D + 1):], fraction=0.02, label="|cos(k_i, e_d)|")
    fig.text(0.01, 0.36, "(c)", fontsize=9)
    fig.suptitle(f"linattn Fig 3: ATTN_S, R = 1, H = {config.H}; D = {D}, N = {config.N}, λ = "
                 f"{np.round(lam, 3).tolist()}; rows of (c): heads in the order they learn", fontsize=10)
    return fig


register(
    Experiment(
        id="linattn.fig3",
        title="Rank-one ATTN_S: D drops to the eq-19 plateaus, v_i following eq 21, head m aligning with e_m",
        paper=PAPER,
        reference="Fig 3; eq 19 (plateau losses), eq 20 (plateau weights, v*), eq 21 (ODE of the learning head)",
        config=Fig3Config,
        presets={
            # quick: 12288 steps = 1536 records, whole 64-record chunks of the loop (one compilation)
            "quick": {"seeds": 2, "steps": 12_288, "record_every": 8},
            "paper": {},
        },
        run=run_fig3,
        checks=checks_fig3,
        plot=plot_fig3,
        memory=attn_s_memory,
        notes=[
            "H = 4 as in the caption (reference code: 5, `--set H=5`). With H = D every head must learn, and a head "
            "whose initial v is small leaves L(M_3) late: the default runs 50k GD steps (t ≈ 9850) so that every "
            "seed finishes; the reference code's 10k steps can end on L(M_3).",
            "P = 80000 as the notebook's Fig 3 runs (`attn_head5_KQdim1_P80000_…`); the README's default is 5000 "
            "(`--set P=5000`). The moments engine makes P cost nothing per step. At P = 5000 a short plateau can "
            "rest farther from eq 19 than the plateau check's 0.01 (its slowest point lies on the sample loss's "
            "shifted saddle).",
            "w_init = 0.06 (eq 36) reproduces the reference code's --init 0.01 on the paper model (weights × N^{1/3}); "
            "lr 0.197 is its 0.02 (no 1/N) on the same step axis (linattn._common).",
            "(b) eq 21 is integrated in paper time t/τ = 2t from the simulated |v_m| at the end of drop m−1 and, by "
            "default, shifted so that it reaches v*_m/2 together with the simulation (eq 21 is autonomous); "
            "`--set ode_align=start` keeps the start time, whose offset is eq 76's timing error (linattn.fig10).",
            "Alignment and |v| = v* are checked on the population engine (the theory's loss). On the moments engine "
            "(finite P) the heads of the weakly determined directions (e_3, e_4) tilt by a few degrees, beyond the "
            "alignment check's 0.99, while the plateau losses stay close to eq 19.",
            "(c) shows |cos(k_i, e_d)| at the middle of each plateau for one seed; rows are the heads in the order "
            "they learn (the paper's heads are permuted the same way). Signs of v, k, q are immaterial (eq 20).",
        ],
    )
)
