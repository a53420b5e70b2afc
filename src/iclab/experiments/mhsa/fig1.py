"""mhsa Fig 1: warm-up, emergence and convergence of multi-head softmax attention on I tasks.

The full H-head model (eq 2.1: separate K, Q, V, O per head, no residual, mask or positions) is
trained by gradient descent on fresh Gaussian minibatches of the multi-task regression (2.4) with
the ½-MSE (2.6), from the theory's balanced decomposable initialisation (Def 3.1, Thm 3.3) in which
head i has the largest initial μ on task i (h_i* = i). Recorded on t = Σ lr: the per-head, per-task
read-outs ω̄_i^(h) (block means of diag ΦᵀW_X^(h)Φ) and μ_i^(h) (diagonal of ΨᵀU_Y^(h)Ψ), how far
the weights are from decomposable, and the training loss. Theory (dashed): the reduced ODE (leading order
of D.1/D.2, App. D.3) from the same (ω̄, μ) on τ = 2t/d (derived here for the ½-MSE), the convergence point
(4.3) and GF-ICL (4.1).

Beside it (our devices): the spectral model (dotted), the decomposable weights' balanced factors trained by
the same GD on the exact-expectation loss, on which the time factor c of t = c·τ is fitted; and a companion
full-model run at batch B/k from which the decomposability residue is extrapolated to population GF,
r(B) = a B^{-1/2} + b. The trained setting (config, model init, losses,
joint training) is :mod:`iclab.experiments.mhsa._training`, shared with ``mhsa.length``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from iclab.experiments import Experiment, register
from iclab.experiments._analysis import first_rise
from iclab.experiments._plot import COLORS, THEORY_STYLE, figure, theory_levels
from iclab.experiments.checks import check_at_most, check_equal, check_rel
from iclab.experiments.mhsa._common import PAPER
from iclab.experiments._memory import largest
from iclab.experiments.mhsa._training import (
    Fig1Config, head_width, initial_params, mc_loss, monte_carlo_memory, train_fig1, training_memory, winners,
)
from iclab.progress import task
from iclab.tasks.multitask_regression import target_second_moment
from iclab.theory import mhsa as theory

TIME_LABEL = "t = Σ lr   (reduced time τ = 2t/d)"


def run_fig1(config: Fig1Config, reporter) -> dict:
    """Trains the full model for each seed (vmapped) with the spectral model in its loop, then the
    companion full model at batch B/k, and integrates the reduced ODE beside them."""
    c = config
    ts, d_e, omega0, mu0, keys, tr, final = train_fig1(c, reporter, spectral=True)
    d = ts.d
    sigma2 = c.sigma**2
    # Companion run at batch B/k (own minibatches, stream 4): the residue's batch dependence.
    companion = train_fig1(c, reporter, batch=c.batch // c.companion_batch_divisor, data_stream=4).trajectory

    w_lim, m_lim = theory.limit_weights(ts.d_i, ts.lam, H=c.H, sigma2=sigma2, L=c.L, omega_off=c.omega0)
    limit = initial_params({"omega": w_lim, "mu": m_lim}, ts, d_e)
    eval_keys = jax.vmap(lambda k: jax.random.fold_in(k, 3))(keys)
    with task(reporter, f"Monte Carlo loss ({c.eval_prompts} prompts per seed)", 2) as cb:
        ev = jax.jit(jax.vmap(lambda p, k: mc_loss(p, ts, c.L, k, c.eval_prompts)))
        final_loss, final_se = ev(final, eval_keys)
        cb(1, {})
        # Same prompts as the trained weights' (paired): the difference is free of most MC noise.
        lim_loss, lim_se = ev(jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (c.seeds,) + a.shape), limit),
                              eval_keys)
        cb(2, {})

    tau = 2.0 * np.asarray(tr.t) / d
    ode = theory.solve_reduced_dynamics(tau, ts.d_i, ts.lam, sigma2=sigma2, L=c.L, d_e=d_e, omega0=omega0, mu0=mu0)
    w_star, mu_star = theory.convergence_limit(ts.d_i, ts.lam, sigma2=sigma2, L=c.L)
    out = {
        "t": np.asarray(tr.t), "step": np.asarray(tr.step), "loss": np.asarray(tr.metrics["member_loss"]["full"]),
        "omega": np.asarray(tr.metrics["readout"]["omega"]), "mu": np.asarray(tr.metrics["readout"]["mu"]),
        "omega_init": omega0, "mu_init": mu0,
        "ode_tau": tau, "ode_omega": ode.omega_bar, "ode_mu": ode.mu,
        "omega_star": w_star, "mu_star": mu_star,
        "gf_icl": np.float64(theory.gf_icl(ts.d_i, ts.lam, sigma2=sigma2, L=c.L)),
        "zero_loss": np.float64(target_second_moment(ts)),
        "final_loss": np.asarray(final_loss), "final_loss_se": np.asarray(final_se),
        "limit_loss": np.asarray(lim_loss), "limit_loss_se": np.asarray(lim_se),
    }
    out.update({f"defect_{k}": np.asarray(v) for k, v in tr.metrics["defects"].items()})
    out.update({f"companion_defect_{k}": np.asarray(v) for k, v in companion.metrics["defects"].items()})
    out.update({"spectral_omega": np.asarray(tr.metrics["spectral"]["omega"]),
                "spectral_mu": np.asarray(tr.metrics["spectral"]["mu"])})
    return out


def memory_fig1(config: Fig1Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig1`'s memory: the training at ``batch`` with the spectral model in its loop
    (:func:`iclab.experiments.mhsa._training.training_memory`; the companion run at batch / k is smaller), then
    the Monte Carlo loss on chunks of 2048 prompts per seed (:func:`~iclab.experiments.mhsa._training.
    monte_carlo_memory`); the larger phase."""
    return largest(training_memory(config, spectral=True), monte_carlo_memory(config, L=config.L, chunk=2048))


#: Defects of Def 3.1's condition (i) and of (ii)-(iii), the residue of each being the largest of its defects.
CONDITIONS = {"(i)": ("UX_over_UY", "WY_over_WX"), "(ii)-(iii)": ("WX_offdiag", "UY_offdiag", "WX_block_spread")}


#: Fraction of the records, the last ones, whose residues are averaged (:func:`residue`).
RESIDUE_WINDOW = 0.2


def residue(a: dict, condition: str, prefix: str = "") -> float:
    """Decomposability residue r of one condition: the largest of its defects (over heads and the
    condition's defects), averaged over the last ``RESIDUE_WINDOW`` of the records and over seeds
    (``prefix`` "companion_" for the batch-B/k run).

    Why a late-time mean: the residue fluctuates from record to record, the extrapolation amplifies
    that noise (δb = (√k·δr(B) − δr(B/k))/(√k − 1)), and an extreme over records is both noisier and
    biased upwards; over the last fifth of the records the residue has settled after the emergence
    peak, and the per-seed b scatters several times less than from the final record alone or from
    the max over records."""
    r = np.max(np.stack([np.asarray(a[f"{prefix}defect_{n}"]) for n in CONDITIONS[condition]]), axis=0)  # (S, T)
    n = max(1, int(round(RESIDUE_WINDOW * r.shape[1])))
    return float(np.mean(r[:, -n:]))


def population_residue(r_big: float, r_small: float, k: float) -> float:
    """Infinite-batch residue b from residues at batches B and B/k, assuming r(B) = a B^{-1/2} + b
    (minibatch noise of variance ∝ 1/B drives the non-decomposable parts linearly):
    b = (√k r(B) − r(B/k)) / (√k − 1)."""
    sk = np.sqrt(k)
    return float((sk * r_big - r_small) / (sk - 1))


def noise_scaling_deviation(r_big: float, r_small: float, k: float) -> float:
    """|r(B/k) / (√k r(B)) − 1|: 0 for pure minibatch noise (r ∝ B^{-1/2}); 0 if both residues vanish."""
    if r_big == 0 and r_small == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(abs(np.float64(r_small) / (np.sqrt(k) * r_big) - 1))


def checks_fig1(config: Fig1Config, a: dict) -> list:
    c = config
    win = winners(a["mu_init"])  # (I,)
    I = win.size
    tasks = np.arange(I)
    omega_end, mu_end = a["omega"][:, -1], a["mu"][:, -1]  # (S, H, I)
    w_win, m_win = omega_end[:, win, tasks], mu_end[:, win, tasks]  # (S, I)
    loser = np.ones(omega_end.shape[1:], bool)
    loser[win, tasks] = False
    final_argmax = np.argmax(omega_end, axis=1)  # (S, I)
    n_wrong = int(np.sum(final_argmax != win[None]))
    w_star, mu_star = a["omega_star"], a["mu_star"]
    # The 1e-2 bound holds for population GF; the minibatch residue r(B) is extrapolated to B → ∞ from the
    # companion run at B/k (k from the actual batches, in case k does not divide B).
    B, B_small = c.batch, c.batch // c.companion_batch_divisor
    k = B / B_small
    dec = {}
    for cond in CONDITIONS:
        r_big, r_small = residue(a, cond), residue(a, cond, "companion_")
        dec[cond] = (r_big, r_small, population_residue(r_big, r_small, k), noise_scaling_deviation(r_big, r_small, k))
    raw = {cond: f"r(B = {B}) = {v[0]:.4g}, r(B/k = {B_small}) = {v[1]:.4g}, r(B/k)/r(B) = "
                 f"{v[1] / v[0] if v[0] else float('nan'):.3f} vs √k = {np.sqrt(k):.3f}" for cond, v in dec.items()}
    loss = float(np.mean(a["final_loss"]))
    # Emergence: the winner's ω̄ reaches half its limit d_i^{-1/2}; simulation on t, ODE on τ = 2t/d.
    t, tau = a["t"], a["ode_tau"]
    t_sim = np.array([[first_rise(t, a["omega"][s, :, win[i], i], 0.5 * w_star[i]) for i in tasks]
                      for s in range(a["omega"].shape[0])])
    t_ode = np.array([first_rise(t, a["ode_omega"][:, win[i], i], 0.5 * w_star[i]) for i in tasks])
    # Fit t = c·τ on the spectral model (no minibatch noise from G): the c minimising the
    # squared log-mismatch of the emergence times, c_fit = exp mean log(t_spec/τ_ODE) over tasks and seeds.
    t_spec = np.array([[first_rise(t, a["spectral_omega"][s, :, win[i], i], 0.5 * w_star[i]) for i in tasks]
                       for s in range(a["spectral_omega"].shape[0])])
    tau_ode = np.array([first_rise(tau, a["ode_omega"][:, win[i], i], 0.5 * w_star[i]) for i in tasks])
    c_fit = float(np.exp(np.mean(np.log(t_spec / tau_ode[None]))))
    d = c.I * c.d_bar
    return [
        check_at_most("decomposability (i), population limit: (√k r(B) − r(B/k))/(√k − 1) of r = max ‖U_X‖/‖U_Y‖, "
                      "‖W_Y‖/‖W_X‖ over heads (mean over the last fifth of the records and seeds)", dec["(i)"][2], 1e-2,
                      f"population GF keeps U_X = W_Y = 0 exactly; our tolerance 1e-2; raw {raw['(i)']}"),
        check_at_most("decomposability (ii)-(iii), population limit: (√k r(B) − r(B/k))/(√k − 1) of r = max relative "
                      "off-diagonal of ΦᵀW_XΦ, ΨᵀU_YΨ and spread of diag ΦᵀW_XΦ within blocks", dec["(ii)-(iii)"][2],
                      1e-2, f"'nearly diagonal': the same 1e-2 as (i); raw {raw['(ii)-(iii)']}"),
        check_at_most("decomposability residue is minibatch noise: max over (i), (ii)-(iii) of |r(B/k)/(√k r(B)) − 1|",
                      max(v[3] for v in dec.values()), 0.3,
                      "r ∝ B^{-1/2} within 30 % (r(B/k)/r(B) in [0.7√k, 1.3√k]) licenses the extrapolation; "
                      f"(i): {raw['(i)']}; (ii)-(iii): {raw['(ii)-(iii)']}"),
        check_equal("task allocation: tasks whose final argmax_h ω̄_i^(h) ≠ initial argmax_h μ_i^(h) (all seeds)",
                    n_wrong, 0, "Thm 3.3: each task is won by the head with the largest initial μ"),
        check_at_most("losers: max ω̄_i^(h)/ω_0 over h ≠ h_i*", float(np.max(omega_end[:, loser]) / c.omega0), 2.0,
                      "non-optimal heads keep ω̄ = O(ω_0) (Thm 3.3(i)); our bound 2 ω_0"),
        check_at_most("losers: max |μ_i^(h)|/μ_i* over h ≠ h_i*",
                      float(np.max((np.abs(mu_end) / m_win[:, None, :])[:, loser])), 1e-2,
                      "μ_i^(h) ≤ μ_i* e^{−Ω(√d_e)} (Thm 3.3(i)); our bound 1e-2"),
        check_at_most("winners converge to (4.3): max |ω̄_i*√d_i − 1| (tasks, seeds)",
                      float(np.max(np.abs(w_win / w_star - 1))), 0.05, "our tolerance: 5 % (Thm 3.3(iii), (3.8))"),
        check_at_most("winners converge to (4.3): max |μ_i*(1 + e d_iφ_i/L)/√d_i − 1| (tasks, seeds)",
                      float(np.max(np.abs(m_win / mu_star - 1))), 0.05, "our tolerance: 5 % (Thm 3.3(iii), (3.8))"),
        check_rel("converged loss E‖ŷ−y‖² (Monte Carlo, mean over seeds) vs GF-ICL (4.1)", loss, float(a["gf_icl"]),
                  0.15, "our tolerance: 15 % at L = 100; (4.1) drops O(L^{-(1-ε)/2}) terms, so the exact loss sits a "
                        "few per cent above it"),
        check_at_most("emergence time: max |t_sim/t_ODE − 1| at ω̄_i* = ½d_i^{-1/2}, ODE on t = (d/2)τ",
                      float(np.max(np.abs(t_sim / t_ode[None] - 1))), 0.10,
                      "our tolerance: 10 %; the time factor d/2 is derived here, not fitted"),
        check_rel("time factor c_fit of t = c·τ, fitted on the spectral model's emergence times, vs d/2",
                  c_fit, d / 2, 0.10,
                  f"expected d/2 = {d / 2:g} (derived here; the paper's 't ← 2dt' would give 2d = {2 * d}); "
                      f"per-task t_spec/τ_ODE = {np.array2string(np.mean(t_spec, axis=0) / tau_ode, precision=4)}"),
    ]


def plot_fig1(config: Fig1Config, a: dict):
    c = config
    fig, axes = figure(ncols=4, width=4.0, height=3.4)
    ax_w, ax_m, ax_l, ax_f = axes[0]
    t = a["t"]
    win = winners(a["mu_init"])
    H, I = a["mu_init"].shape
    seed = 0
    for h in range(H):
        for i in range(I):
            star = win[i] == h
            style = dict(color=COLORS[h], lw=1.6 if star else 0.8, alpha=1.0 if star else 0.6)
            lab = f"head {h + 1}" if i == (list(win).index(h) if h in win else 0) else None
            ax_w.plot(t, a["omega"][seed, :, h, i], label=lab, **style)
            ax_m.plot(t, a["mu"][seed, :, h, i], label=lab, **style)
            ax_w.plot(t, a["ode_omega"][:, h, i], color=COLORS[h], ls="--", lw=0.8)
            ax_m.plot(t, a["ode_mu"][:, h, i], color=COLORS[h], ls="--", lw=0.8)
            ax_w.plot(t, a["spectral_omega"][seed, :, h, i], color=COLORS[h], ls=":", lw=1.2)
            ax_m.plot(t, a["spectral_mu"][seed, :, h, i], color=COLORS[h], ls=":", lw=1.2)
    theory_levels(ax_w, [float(a["omega_star"][0])], ["d̄^{-1/2} (4.3)"])
    theory_levels(ax_m, [float(a["mu_star"][0])], ["(4.3)"])
    ax_w.set_ylabel("ω̄_i^(h)  (eigenvalue of W_X^(h))")
    ax_m.set_ylabel("μ_i^(h)  (eigenvalue of U_Y^(h))")
    ax_w.set_title("ω̄: thick = h_i*, thin = others; dashed = ODE, dotted = spectral model", fontsize=8)
    ax_m.set_title("μ: colour = head, all tasks", fontsize=8)
    for s, curve in enumerate(np.atleast_2d(a["loss"])):
        ax_l.plot(t, curve, color=COLORS[0], lw=1.0, alpha=0.8, label=f"{c.seeds} seeds" if s == 0 else None)
    theory_levels(ax_l, [float(a["zero_loss"]) / 2, float(a["gf_icl"]) / 2], ["½E‖y‖² (ŷ = 0)", "½ GF-ICL (4.1)"])
    ax_l.set_ylabel(f"training loss ½‖ŷ − y‖² (batch {c.batch})")
    ax_l.set_yscale("log")
    for ax in (ax_w, ax_m, ax_l):
        ax.set_xlabel(TIME_LABEL, fontsize=8)
    ax_w.legend(fontsize=7)
    final = a["omega"][:, -1].mean(axis=0)  # (H, I)
    width = 0.8 / H
    for h in range(H):
        ax_f.bar(np.arange(I) + (h - (H - 1) / 2) * width, final[h], width, color=COLORS[h], label=f"head {h + 1}")
    ax_f.axhline(float(a["omega_star"][0]), **THEORY_STYLE)
    ax_f.set_xticks(np.arange(I), [f"task {i + 1}" for i in range(I)])
    ax_f.set_ylabel("final ω̄_i^(h)")
    ax_f.legend(fontsize=7)
    fig.suptitle(f"mhsa Fig 1: H = {H}, I = {I}, d = {I * c.d_bar}, L = {c.L}, λ = {c.lam:g}, σ = {c.sigma:g}, "
                 f"d_e = {head_width(c)}; SGD lr {c.lr:g}, batch {c.batch}; final loss {np.mean(a['final_loss']):.4f} "
                 f"vs GF-ICL {float(a['gf_icl']):.4f} (no ½)", fontsize=9)
    return fig


register(
    Experiment(
        id="mhsa.fig1",
        title="Warm-up, emergence and convergence of multi-head softmax attention: one head per task",
        paper=PAPER,
        reference="Fig 1; Def 3.1, Thm 3.3, (4.1), (4.3); App. D.3 reduced ODE",
        config=Fig1Config,
        presets={
            "quick": {"batch": 1024, "lr": 2.0, "steps": 230, "omega0": 0.03, "mu0": 0.1,
                      "eval_prompts": 4096},
            "paper": {"lr": 1.0, "steps": 800, "advantage": 1.0},
        },
        run=run_fig1,
        checks=checks_fig1,
        plot=plot_fig1,
        memory=memory_fig1,
        notes=[
            "Unspecified in the paper, our choices: plain GD (SGD) with a constant lr on fresh Gaussian "
            "minibatches (batch 4096 at `paper`), ½-MSE (2.6), float32 (the data, weights and gradients); d_e = d "
            "(Fig 3's d_e = 30); Φ = Ψ = I; the theory's balanced decomposable init (Thm 3.3) with W_X^(h) = ω_0 I "
            "and U_Y^(h) = μ_0 I, the entry (h = i, task i) raised by (1 + advantage) so that h_i* = i.",
            "Time: t = Σ lr. The reduced ODE (App. D.3, dashed) runs on τ = 2t/d, the factor derived here for the "
            "½-MSE (the paper's 't ← 2dt' is inconsistent); it is not fitted in the plot or in the full model's "
            "emergence-time check. The fit t = c·τ is done on the spectral model (below): c_fit = exp mean "
            "log(t_spec/τ_ODE) of the winners' emergence times (ω̄ at ½ d_i^{-1/2}), checked against d/2, not the "
            "paper's 2d.",
            "Spectral model (dotted): the balanced factors of the decomposable weights, one per (head, "
            "task block) and matrix, trained by the same GD (lr, steps) on ½ of the exact-expectation loss (G and ε "
            "integrated out) of the full model's own minibatch (X, q), jointly with the full model "
            "(iclab.engines.train_members, the sum of the two losses, disjoint parameters). The block factor is the "
            "block's Frobenius norm k_i = √d_i s_i, so that GD on it is the full model's GD restricted to decomposable "
            "weights (a shared s_i would move d_i times too fast); a unit test checks one step against the full model "
            "on a batch whose task vectors integrate G out exactly (agreement to O(lr²)).",
            "Loss values in the checks are E‖ŷ − y‖² without the ½ (the paper's (4.1) convention); the "
            "plotted training loss is the full model's ½-MSE of the next minibatch. The converged loss is Monte Carlo "
            "over `eval_prompts` fresh prompts; the same prompts give the loss of the (4.3) weights for comparison.",
            "The quick preset keeps the paper's d and L and shrinks the batch and the plateau (larger ω_0, μ_0) "
            "instead: at d_i = 10, L = 100 the exact softmax loss is minimised close to (4.3), its value a few per "
            "cent above GF-ICL (4.1) (the O(L^{-(1-ε)/2}) terms (4.1) drops, hence the check's 15 %), while at "
            "smaller d_i and L the exact optimum moves visibly away from (4.3).",
            "Finding: the (4.3) point is a saddle of the full-parameter loss. For fixed ω̄ at (4.3) the loss is "
            "minimised by negative loser μ (E.24), which balanced GF cannot reach (μ = σ(O)σ(V_Y) ≥ 0 while "
            "σ(O)² − σ(V_Y)² = 0 is conserved). Minibatch noise breaks the balance, and after convergence the losers' "
            "μ grow negative exponentially, while the ODE and the spectral model keep decaying. The checks therefore "
            "look at the end of a run that stops when the ODE has nearly converged (τ = 2·lr·steps/d ≈ 31 quick, 53 "
            "paper), inside the window of Thm 3.3(iii); longer runs leave (4.3).",
            "Paper preset init: advantage 1 (the favoured head starts with twice the others' μ), not 0.5; Thm 3.3 "
            "asks only for a Θ(1) relative gap ε. From (ω_0, μ_0, advantage) = (0.01, 0.05, 0.5) the reduced ODE "
            "itself (no sampling) lifts the losers' ω̄ above the loser check's 2 ω_0 during emergence and brings "
            "them back only after the minibatch escape above has begun, so at that init no run length passes both "
            "loser checks with margin; with advantage 1 the ODE's losers stay below 2 ω_0. "
            "`--set advantage=0.5 --set steps=1000` runs from that init.",
            "Decomposability under minibatch noise: the relative non-decomposable parts (U_X, W_Y, off-diagonal and "
            "within-block spread of W_X) are noise-driven and scale like batch^{-1/2}, so the 1e-2 bound, a "
            "statement about population GF, would need batches far beyond the presets' if applied to the raw "
            "residue. We test it on the population limit instead: a companion full-model run at batch B/k "
            "(k = companion_batch_divisor, own minibatches) and r(B) = a B^{-1/2} + b give "
            "b = (√k r(B) − r(B/k))/(√k − 1), checked ≤ 1e-2, with a check that r(B/k)/r(B) is within 30 % of √k "
            "(the noise law that licenses the extrapolation). r is the mean over the last fifth of the records and "
            "the seeds (see `residue`). The B^{-1/2} law holds only approximately, so b is resolved to about the "
            "size of the tolerance: the check rules out a population residue well above 1e-2, not one of a few 1e-3.",
        ],
    )
)
