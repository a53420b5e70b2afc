"""mhsa Fig 3: emergence dynamics of the optimal head, (3.4), (3.6) and the right-hand side of (3.6).

(a) the two-variable system (3.4) from τ = τ_0 with (ω̄*, μ*) = (ω_0, μ_0); (b) the reduced
equation (3.6) (μ* at its quasi-equilibrium (3.5)) from ω̄* = ω_0; (c) the rate (3.6) against ω̄*:
slow, then fast, then zero at the fixed point d_i^{-1/2}. Reduced time τ (t = (d/2)τ for the ½-MSE).
"""

from __future__ import annotations

import numpy as np

from iclab.experiments._analysis import first_rise
from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._memory import FLOAT64
from iclab.experiments._plot import COLORS, THEORY_STYLE, figure
from iclab.experiments import Experiment, register
from iclab.experiments.checks import check_at_most, check_equal
from iclab.experiments.mhsa._common import PAPER
from iclab.progress import task
from iclab.theory import mhsa as theory


class Fig3Config(ExperimentConfig):
    d_i: int = param(10, "task dimension d_i", paper=10, ge=1, le=10_000)
    lam: float = param(1.0, "signal λ_i", paper=1.0, gt=0, le=1e3)
    phi: float = param(1.0, "φ_i = 1 + SNR_i^{-1}", paper=1.0, ge=1, le=1e3)
    L: int = param(100, "context length L", paper=100, ge=1, le=1_000_000)
    d_e: int = param(30, "head width d_e", paper=30, ge=1, le=100_000)
    tau0: float = param(4.0, "start time τ_0", paper=4.0, paper_note="arbitrary shift", ge=0, le=1e4)
    omega0: float = param(0.01, "initial ω̄*", paper=0.01, gt=0, lt=1)
    mu0: float = param(1.0, "initial μ* of panel (a)", paper=1.0, gt=0, le=1e3)
    tau_max: float = param(60.0, "end time τ", paper_note="x-range unspecified", gt=0, le=1e6)
    n_t: int = param(600, "time samples", ge=10, le=1_000_000)
    rk4_steps: int = param(6000, "steps of the independent fixed-step RK4 cross-check of (3.4)", ge=100, le=10_000_000)


def _rk4(f, y0, t):
    """Classical fixed-step RK4 on the grid t (the brute-force cross-check)."""
    y = np.empty((t.size, y0.size))
    y[0] = y0
    for k in range(t.size - 1):
        h, yk = t[k + 1] - t[k], y[k]
        k1 = f(yk)
        k2 = f(yk + 0.5 * h * k1)
        k3 = f(yk + 0.5 * h * k2)
        k4 = f(yk + h * k3)
        y[k + 1] = yk + h / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y


def _setting(c: Fig3Config) -> dict:
    """The single-task constants of (3.4)-(3.6) as keyword arguments of the theory."""
    return dict(d_i=c.d_i, lam=c.lam, phi=c.phi, L=c.L, d_e=c.d_e)


def run_fig3(config: Fig3Config, reporter) -> dict:
    c = config
    args = _setting(c)
    tau = np.linspace(c.tau0, c.tau_max, c.n_t)
    with task(reporter, "ODEs (3.4), (3.6)", 3) as cb:
        w34, m34 = theory.solve_emergence(tau, **args, omega0=c.omega0, mu0=c.mu0)
        cb(1, {})
        w36 = theory.solve_omega_reduced(tau, **args, omega0=c.omega0)
        cb(2, {})
        t_rk = np.linspace(c.tau0, c.tau_max, c.rk4_steps + 1)
        y_rk = _rk4(lambda y: np.array(theory.emergence_field(y[0], y[1], **args)), np.array([c.omega0, c.mu0]), t_rk)
        cb(3, {})
    grid = np.linspace(1e-4, 1.3 / np.sqrt(c.d_i), 800)
    return {"tau": tau, "omega_34": w34, "mu_34": m34, "omega_36": w36,
            "mu_36": theory.mu_quasi_equilibrium(w36, d_i=c.d_i, phi=c.phi, L=c.L),
            "rk4_final": y_rk[-1], "omega_grid": grid, "rate": theory.omega_reduced_rate(grid, **args),
            "T0": np.float64(theory.emergence_time(lam=c.lam, phi=c.phi, L=c.L, d_e=c.d_e, omega0=c.omega0))}


def memory_fig3(config: Fig3Config) -> tuple[float, str]:
    """Upper estimate of :func:`run_fig3`'s memory, float64: the RK4 cross-check's grid and its (ω̄, μ) path,
    3 numbers per step, and the adaptive solvers' outputs and dense interpolants on the n_t times (16 per time)."""
    return (float(FLOAT64 * (3 * (config.rk4_steps + 1) + 16 * config.n_t)),
            f"the {config.rk4_steps + 1}-step RK4 path and the {config.n_t} ODE samples")


def checks_fig3(config: Fig3Config, a: dict) -> list:
    c = config
    args = _setting(c)
    w_star = 1.0 / np.sqrt(c.d_i)
    mu_star = np.sqrt(c.d_i) / (1.0 + np.e * c.d_i * c.phi / c.L)
    tau = a["tau"]
    hit_err = []
    for f in (0.5, 0.9, 0.99):
        t_ode = first_rise(tau, a["omega_36"], f * w_star) - c.tau0
        t_quad = theory.omega_reduced_hitting_time(f * w_star, **args, omega0=c.omega0)
        hit_err.append(abs(t_ode / t_quad - 1))
    rk = a["rk4_final"]
    g, rate = a["omega_grid"], a["rate"]
    below, above = g < w_star * (1 - 1e-9), g > w_star * (1 + 1e-9)
    small = 1e-3
    lin = theory.omega_reduced_rate(small, **args) / (c.lam * c.L * small**2 / (np.sqrt(c.d_e) * c.phi))
    return [
        check_at_most("(3.4): adaptive solver = fixed-step RK4 at τ_max (max relative gap)",
                      float(np.max(np.abs(rk / np.array([a["omega_34"][-1], a["mu_34"][-1]]) - 1))), 1e-6,
                      f"RK4 with {c.rk4_steps} steps, an independent integrator"),
        check_at_most("(3.6): hitting times of 0.5/0.9/0.99·d_i^{-1/2}, solver vs quadrature ∫dω̄/(3.6) (max rel.)",
                      float(max(hit_err)), 1e-3, "D.49; the solver's sampled path is interpolated linearly"),
        check_at_most("(3.4) converges to (4.3): max(|ω̄√d_i − 1|, |μ(1+e d_iφ/L)/√d_i − 1|) at τ_max",
                      float(max(abs(a["omega_34"][-1] / w_star - 1), abs(a["mu_34"][-1] / mu_star - 1))), 0.01,
                      "(3.4) has the fixed point ω̄ = d_i^{-1/2}, μ = ω̄/(ω̄² + eφ/L) = (4.3) exactly; 1% allows for τ_max"),
        check_equal("(3.6) rate > 0 below d_i^{-1/2} and < 0 above", bool(np.all(rate[below] > 0) and np.all(rate[above] < 0)), True),
        check_at_most("small-ω̄ limit: (3.6) / (λLω̄²/(√d_e φ)) − 1 at ω̄ = 1e-3 (T_0's blow-up rate)",
                      float(abs(lin - 1)), 0.01, "Sec 3.2: ∂ω̄ ≈ λLω̄²/(√d_eφ) for small ω̄; corrections O(Lω̄²/φ) = 1e-4·L"),
    ]


def plot_fig3(config: Fig3Config, a: dict):
    c = config
    fig, axes = figure(ncols=3, width=4.2)
    ax0, ax1, ax2 = axes[0]
    tau = a["tau"]
    w_star = 1 / np.sqrt(c.d_i)
    ax0.plot(tau, a["omega_34"], color=COLORS[0], label="ω̄* (3.4)")
    ax0b = ax0.twinx()
    ax0b.plot(tau, a["mu_34"], color=COLORS[1], label="μ* (3.4)")
    ax0b.set_ylabel("μ*", color=COLORS[1])
    ax0.axhline(w_star, **THEORY_STYLE)
    ax0.axvline(c.tau0 + float(a["T0"]), color="0.7", lw=0.8)
    ax0.set_xlabel("τ"), ax0.set_ylabel("ω̄*", color=COLORS[0])
    ax0.set_title(f"(a) (3.4) from (ω̄, μ) = ({c.omega0:g}, {c.mu0:g})", fontsize=9)
    ax1.plot(tau, a["omega_36"], color=COLORS[0], label="ω̄* (3.6)")
    ax1.plot(tau, a["omega_34"], color=COLORS[0], lw=0.8, alpha=0.5, label="ω̄* (3.4)")
    ax1.axhline(w_star, **THEORY_STYLE, label="d_i^{-1/2}")
    ax1.axvline(c.tau0 + float(a["T0"]), color="0.7", lw=0.8, label="τ_0 + T_0")
    ax1.set_xlabel("τ"), ax1.set_ylabel("ω̄*"), ax1.legend(fontsize=7)
    ax1.set_title(f"(b) (3.6) from ω̄ = {c.omega0:g}", fontsize=9)
    ax2.plot(a["omega_grid"], a["rate"], color=COLORS[0])
    ax2.axhline(0, color="0.7", lw=0.8), ax2.axvline(w_star, **THEORY_STYLE)
    ax2.set_xlabel("ω̄*"), ax2.set_ylabel("∂_τ ω̄* (3.6)")
    ax2.set_title("(c) right-hand side of (3.6)", fontsize=9)
    fig.suptitle(f"mhsa Fig 3: d_i = {c.d_i}, d_e = {c.d_e}, L = {c.L}, λ = {c.lam:g}, φ = {c.phi:g}; T_0 = {float(a['T0']):.2f}",
                 fontsize=10)
    return fig


register(
    Experiment(
        id="mhsa.fig3",
        title="Emergence of the optimal head: (3.4), the reduced ODE (3.6) and its rate",
        paper=PAPER,
        reference="Fig 3; eqs (3.4)-(3.6), D.49, Thm 3.3",
        config=Fig3Config,
        presets={"quick": {"rk4_steps": 3000}, "paper": {}},
        run=run_fig3,
        checks=checks_fig3,
        plot=plot_fig3,
        memory=memory_fig3,
        notes=[
            "(3.4)'s ω̄* equation is the corrected form of App. D.3/(D.47) ((3.4) prints it garbled).",
            "τ is the reduced time; the ½-MSE flow has t = (d/2)τ (derived here; Thm D.11's 't ← 2dt' is inconsistent). "
            "The τ_0 = 4 start is the paper's arbitrary shift.",
        ],
    )
)
