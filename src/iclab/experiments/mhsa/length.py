"""mhsa length generalisation (Sec 5.2, Prop 5.1): train at context length L, test at L̃ ≠ L.

The full H-head model is trained exactly as in ``mhsa.fig1`` (:mod:`iclab.experiments.mhsa._training`: SGD on fresh
prompts of length L from the theory's init, h_i* = i); its final weights are then evaluated on fresh
prompts of lengths L̃ (same task family). Per task i the Monte Carlo loss E(ŷ_i − y_i)² is compared
with the leading order of (5.2), (λ_i d_i/d)(a_i² + ã_i)/(1 + a_i)², a_i = e d_iφ_i/L,
ã_i = e d_iφ_i/L̃ (derived here from E.7), and with the exact loss of the (4.3) weights on the same prompts.
No retraining at L̃: W_X at (4.3) does not depend on L, and only μ_i is off by a quadratic mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.experiments._config import param
from iclab.experiments._plot import COLORS, THEORY_STYLE, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most
from iclab.experiments.mhsa._common import PAPER
from iclab.experiments._memory import largest
from iclab.experiments.mhsa._training import (
    Fig1Config, initial_params, mc_task_errors, monte_carlo_memory, train_fig1, training_memory, winners,
)
from iclab.progress import task
from iclab.theory import mhsa as theory


class LengthConfig(Fig1Config):
    """Fig 1's training settings (every field of ``mhsa.fig1``'s config) plus the test lengths;
    ``eval_prompts`` is the number of test prompts per length L̃."""

    test_ratios: tuple[float, ...] = param((0.5, 2.0, 4.0), "test lengths as multiples L̃/L of the training L",
                                           paper_note="Prop 5.1 has no experiment; L/2, 2L, 4L are our choice")
    anneal_steps: int = param(0, "last steps of training with lr decayed linearly to anneal_final·lr (SGD noise ∝ lr)",
                              paper=None, paper_note="our choice: the theory is population gradient flow (lr → 0)",
                              ge=0, le=10_000_000)
    anneal_final: float = param(0.1, "lr at the last step as a fraction of lr", gt=0, le=1)
    eval_chunk: int = param(1024, "prompts per Monte Carlo chunk (memory bound; chunk means give the SE)",
                            ge=64, le=65_536)

    @model_validator(mode="after")
    def _anneal(self):
        if self.anneal_steps > self.steps:
            raise ValueError(f"anneal_steps must be <= steps = {self.steps} (got {self.anneal_steps})")
        return self


def lr_schedule(config: LengthConfig):
    """lr(k) = lr for k < steps − anneal_steps, then linear down to anneal_final·lr at the last step."""
    c = config
    k0 = c.steps - c.anneal_steps
    slope = (1.0 - c.anneal_final) / max(c.anneal_steps, 1)

    def lr(step):
        frac = jnp.where(step < k0, 1.0, 1.0 - slope * (step - k0 + 1).astype(jnp.float64))
        return c.lr * frac

    return lr


def test_lengths(config: LengthConfig) -> np.ndarray:
    """L̃ = round(ratio·L) for each test ratio (at least 2 tokens)."""
    return np.array([max(2, int(round(r * config.L))) for r in config.test_ratios])


def memory_length(config: LengthConfig) -> tuple[float, str]:
    """Upper estimate of :func:`run_length`'s memory: the training (:func:`iclab.experiments.mhsa._training.
    training_memory`), then the Monte Carlo losses of the trained and the (4.3) weights on chunks of ``eval_chunk``
    prompts of the longest test length (:func:`~iclab.experiments.mhsa._training.monte_carlo_memory`); the larger
    phase."""
    return largest(training_memory(config),
                   monte_carlo_memory(config, L=int(test_lengths(config).max()), chunk=config.eval_chunk, models=2))


def run_length(config: LengthConfig, reporter) -> dict:
    """Trains as Fig 1, then Monte Carlo per-task losses of the trained and of the (4.3) weights at each L̃."""
    c = config
    training = train_fig1(c, reporter, lr=lr_schedule(c))
    ts, d_e, keys, final = training.ts, training.d_e, training.keys, training.final
    S = c.seeds
    sigma2 = c.sigma**2
    w_lim, m_lim = theory.limit_weights(ts.d_i, ts.lam, H=c.H, sigma2=sigma2, L=c.L, omega_off=c.omega0)
    limit = initial_params({"omega": w_lim, "mu": m_lim}, ts, d_e)
    limit = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (S,) + a.shape), limit)
    lengths = test_lengths(c)
    I = c.I
    shape = (S, lengths.size, I)
    out = {k: np.zeros(shape) for k in ("trained", "trained_se", "limit", "limit_se", "diff_se")}
    with task(reporter, f"Monte Carlo per-task loss at {lengths.size} test lengths ({c.eval_prompts} prompts each)",
              lengths.size) as cb:
        for j, Lt in enumerate(lengths):
            # Seed s, length j: prompts from fold_in(fold_in(key_s, 3), j), shared by the trained and (4.3) weights.
            ev = jax.jit(jax.vmap(lambda p, q, k, Lt=int(Lt): mc_task_errors((p, q), ts, Lt, k, c.eval_prompts,
                                                                              c.eval_chunk)))
            ek = jax.vmap(lambda k, j=j: jax.random.fold_in(jax.random.fold_in(k, 3), j))(keys)
            both = np.asarray(ev(final, limit, ek))[..., :I]  # (S, 2, chunks, I)
            tr, lim = both[:, 0], both[:, 1]
            n_ch = tr.shape[1]
            out["trained"][:, j], out["trained_se"][:, j] = tr.mean(1), tr.std(1, ddof=1) / np.sqrt(n_ch)
            out["limit"][:, j], out["limit_se"][:, j] = lim.mean(1), lim.std(1, ddof=1) / np.sqrt(n_ch)
            out["diff_se"][:, j] = (tr - lim).std(1, ddof=1) / np.sqrt(n_ch)
            cb(j + 1, {})
    def leading_order(Lt):
        return theory.length_generalization_task_losses(ts.d_i, ts.lam, sigma2=sigma2, L_train=c.L, L_test=Lt)

    def intrinsic_at(Lt):
        return theory.per_task_optimal_loss(ts.d_i, ts.lam, sigma2=sigma2, L=Lt)

    theory_task = np.array([leading_order(Lt) for Lt in lengths])  # (J, I)
    intrinsic = np.array([intrinsic_at(Lt) for Lt in lengths])
    grid = np.geomspace(0.8 * lengths.min(), 1.25 * lengths.max(), 60)
    readout = training.trajectory.metrics["readout"]
    out.update(
        lengths=lengths, theory=theory_task, intrinsic=intrinsic, L_grid=grid,
        theory_grid=np.array([leading_order(g) for g in grid]),
        intrinsic_grid=np.array([intrinsic_at(g) for g in grid]),
        omega=np.asarray(readout["omega"]), mu=np.asarray(readout["mu"]),
        omega_final=np.asarray(readout["omega"][:, -1]), mu_final=np.asarray(readout["mu"][:, -1]),
        omega_star=w_lim.max(axis=0), mu_star=m_lim.max(axis=0), mu_init=training.mu_init,
        t=np.asarray(training.trajectory.t), loss=np.asarray(training.trajectory.metrics["member_loss"]["full"]),
    )
    return out


def checks_length(config: LengthConfig, a: dict) -> list:
    lengths, L = a["lengths"], config.L
    win = winners(a["mu_init"])
    tasks = np.arange(win.size)
    w_win = a["omega_final"][:, win, tasks]
    m_win = a["mu_final"][:, win, tasks]
    out = [
        check_at_most("trained winners at (4.3): max |ω̄_i*√d_i − 1|, |μ_i*(1 + e d_iφ_i/L)/√d_i − 1| (tasks, seeds)",
                      float(max(np.max(np.abs(w_win / a["omega_star"] - 1)), np.max(np.abs(m_win / a["mu_star"] - 1)))),
                      0.05, "mhsa.fig1's 5 %: the test presumes the model trained at L sits at the convergence point"),
    ]
    excess = (1.0 - 2.0 / config.d_bar) ** (-config.d_bar / 2) / np.e - 1.0 if config.d_bar > 2 else np.inf
    for j, Lt in enumerate(lengths):
        rel = np.abs(a["trained"][:, j] / a["theory"][None, j] - 1)  # (S, I)
        se = float(np.max(a["trained_se"][:, j] / a["trained"][:, j]))
        out.append(check_at_most(
            f"L̃ = {Lt} ({Lt / L:g}L): max_i |trained loss_i / (λ_id_i/d)(a_i²+ã_i)/(1+a_i)² − 1|",
            float(rel.max()), 0.15,
            f"our 15 %; Monte Carlo SE ≤ {se:.1%}. The leading order drops O(L^{{-(1-ε)/2}}) terms: at finite "
            f"d_i, E_q e^(‖W_Xq‖²) = (1 − 2/d_i)^(−d_i/2) exceeds e (by {excess:.1%} at d_i = {config.d_bar}), so the "
            "exact loss sits above it"))
    for j, Lt in enumerate(lengths):
        rel = np.abs(a["trained"][:, j] / a["limit"][:, j] - 1)
        se = float(np.max(a["diff_se"][:, j] / a["limit"][:, j]))
        out.append(check_at_most(
            f"L̃ = {Lt}: max_i |trained loss_i / loss_i of the (4.3) weights − 1| (same prompts)", float(rel.max()), 0.05,
            f"our check that the trained model generalises as the convergence point does (paired SE ≤ {se:.1%}); at "
            "L̃ ≠ L the loss is first order in μ's error (≈ 3× μ's relative error at L̃ = 4L, d_i/L = 0.1-0.2)"))
    return out


def plot_length(config: LengthConfig, a: dict):
    c = config
    fig, axes = figure(ncols=3, width=4.2, height=3.6)
    ax, ax_r, ax_t = axes[0]
    lengths, grid = a["lengths"], a["L_grid"]
    I = a["theory"].shape[1]
    for i in range(I):
        col = COLORS[i]
        ax.plot(grid, a["theory_grid"][:, i], color=col, ls="--", lw=1.0,
                label="(5.2) leading order" if i == 0 else None)
        ax.plot(grid, a["intrinsic_grid"][:, i], color=col, ls=":", lw=0.8,
                label="intrinsic term (4.4) at L̃" if i == 0 else None)
        ax.errorbar(lengths, a["trained"][:, :, i].mean(0), yerr=2 * a["trained_se"][:, :, i].max(0), fmt="o",
                    color=col, ms=4, lw=1.2, label=f"task {i + 1}, trained at L")
        ax.plot(lengths, a["limit"][:, :, i].mean(0), "x", color=col, ms=6,
                label="(4.3) weights, exact (MC)" if i == 0 else None)
        ax_r.plot(lengths, (a["trained"][:, :, i] / a["theory"][None, :, i] - 1).T, "o-", color=col, ms=4,
                  label=f"task {i + 1}")
    ax.axvline(c.L, color="0.6", lw=0.8)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("test length L̃  (training L marked)"), ax.set_ylabel("per-task loss E(ŷ_i − y_i)² (no ½)")
    ax.legend(fontsize=6)
    ax_r.axhspan(-0.15, 0.15, color="0.9", zorder=0, label="±15 %")
    ax_r.axhline(0.0, **THEORY_STYLE)
    ax_r.axvline(c.L, color="0.6", lw=0.8)
    ax_r.set_xscale("log")
    ax_r.set_xlabel("test length L̃"), ax_r.set_ylabel("trained / (5.2) − 1")
    ax_r.legend(fontsize=6)
    for axis in (ax, ax_r):
        axis.set_xticks(list(lengths) + [c.L], [str(v) for v in list(lengths) + [c.L]])
        axis.minorticks_off()
    win = winners(a["mu_init"])
    for i, h in enumerate(win):
        ax_t.plot(a["t"], a["omega"][0, :, h, i] / a["omega_star"][i], color=COLORS[i], lw=1.2,
                  label=f"task {i + 1}: ω̄_i*/d_i^(−1/2)")
        ax_t.plot(a["t"], a["mu"][0, :, h, i] / a["mu_star"][i], color=COLORS[i], lw=1.0, ls="-.",
                  label=f"task {i + 1}: μ_i*/(4.3)")
    ax_t.axhline(1.0, **THEORY_STYLE)
    if c.anneal_steps:
        ax_t.axvspan(a["t"][0] + c.lr * (c.steps - c.anneal_steps), a["t"][-1], color="0.93", zorder=0,
                     label="lr annealed")
    ax_t.set_xlabel("t = Σ lr (training at L)"), ax_t.set_ylabel("winner read-outs / (4.3)")
    ax_t.set_ylim(0, 1.6), ax_t.legend(fontsize=6)
    fig.suptitle(f"mhsa length generalisation: H = {c.H}, I = {c.I}, d_i = {c.d_bar}, trained at L = {c.L} "
                 f"(SGD lr {c.lr:g}, {c.steps} steps, batch {c.batch}); tested at L̃", fontsize=9)
    return fig


register(
    Experiment(
        id="mhsa.length",
        title="Length generalisation: trained at L, tested at L̃ = L/2, 2L, 4L, against (5.2)",
        paper=PAPER,
        reference="Sec 5.2, Prop 5.1, eq (5.2), App. F.1",
        config=LengthConfig,
        presets={
            "quick": {"H": 1, "I": 1, "d_bar": 20, "L": 100, "batch": 1536, "lr": 2.0, "steps": 100,
                      "anneal_steps": 50, "omega0": 0.03, "mu0": 0.1, "eval_prompts": 4096},
            "paper": {"lr": 1.0, "steps": 1000, "anneal_steps": 200, "eval_prompts": 32_768},
        },
        run=run_length,
        checks=checks_length,
        plot=plot_length,
        memory=memory_length,
        notes=[
            "The paper has no length-generalisation experiment. `paper` trains at Fig 1's setting (H = I = 3, "
            "d = 30, L = 100, `mhsa.fig1`'s paper preset, with its last 200 steps annealed) and tests at "
            "L̃ = L/2, 2L, 4L. `quick` trains one head on one task with d = 20, L = 100 (batch 1536, 100 steps, the "
            "last 50 annealed): at d_i = 10 the leading order of (5.2) itself sits several per cent below the exact "
            "loss of the (4.3) weights (our Monte Carlo), which leaves the check's 15 % little room for the training's own "
            "error; at d_i = 20 the gap is smaller. Every training setting the paper leaves unspecified is Fig 1's "
            "(see `mhsa.fig1`).",
            "Theory: (λ_id_i/d)(a_i² + ã_i)/(1 + a_i)² with a_i = e d_iφ_i/L, ã_i = e d_iφ_i/L̃ (derived here from "
            "E.7); (5.2) prints its intrinsic term at L, the text and App. F.1 at L̃ (an erratum).",
            "Why the leading order sits below the exact loss: the exponential-regime factor E_q e^{‖W_Xq‖²} is "
            "(1 − 2/d_i)^{−d_i/2} (3.05 at d_i = 10, 2.87 at d_i = 20), not e. With that factor in place of e the "
            "formula follows our Monte Carlo closely at d_i = 10, L̃ ≥ L.",
            "lr annealing (our choice, `anneal_steps`): at constant lr the minibatch noise leaves the winner's μ a few "
            "per cent off (4.3) and the weights visibly non-decomposable; the loss at L̃ = 4L is first order in μ's "
            "error (≈ 3× it), so without annealing the trained model sits above the (4.3) weights at 4L by more than "
            "the 5 % check allows.",
        ],
    )
)
