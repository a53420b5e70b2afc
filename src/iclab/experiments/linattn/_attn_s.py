"""Shared pieces of the ATTN_S figures (Figs 3, 10, 11, 13): one config, one run, the readings of a
trajectory the checks need (plateaus, drop times, head-eigenvector alignment, eq-21 overlay), and the
rank-R escape rule of Figs 11 and 13.

Times are t = Σ lr; the paper's time is t/τ = 2t (linattn._common), so eq 21 is integrated over 2t.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import field_validator, model_validator

from iclab.engines import linreg
from iclab.engines.linreg import LinregTraining
from iclab.experiments._analysis import drop_intervals, first_rise
from iclab.experiments._config import engine_fields, engine_grid, param, setting
from iclab.experiments._memory import records, total
from iclab.experiments.linattn._common import CovarianceConfig, keys_and_covariances, statistics_memory, training_spec
from iclab.theory import linattn as theory

OdeAlign = Literal["half_rise", "start"]


class AttnSConfig(CovarianceConfig):
    """The Fig 3 setup: ATTN_S (reduced form, eq S) from eq-36 init, full-batch GD on P prompts."""

    N: int = param(31, "context pairs per prompt N", paper=31, ge=1, le=100_000)
    linreg: ClassVar = engine_fields(
        LinregTraining,
        H=setting(4, paper=4, paper_note="Fig 3 caption; reference code: --head 5", le=256),
        w_init=setting(
            0.06, paper=None,
            paper_note="unspecified; the reference code's --init 0.01 (K, Q std 0.01/√(R(D+1)), v std 0.01, no 1/N) "
                       "is, mapped to the paper model (weights × N^{1/3}), eq 36 with w ≈ 0.06 (same v·k·q scale)",
            le=10),
        lr=setting(0.197, paper=0.197,
                   paper_note="reference code --lr 0.02 without 1/N ≙ 0.02·N^{2/3} = 0.197 here (linattn._common)",
                   le=10),
        steps=setting(
            50_000, paper=10_000,
            paper_note="reference code: 10001 epochs; with H = 4 a head that starts small leaves L(M_3) late, so the "
                       "default runs 50k (t ≈ 9850) for every seed to finish",
            ge=1, le=10_000_000),
        # the main engine: full-batch GD on P prompts (moments, the paper's figures) or on the exact expected loss
        engine=setting("moments", paper="moments", choices=("moments", "population")),
        P=setting(80_000, paper=80_000,
                  paper_note="the notebook's Fig 3 runs (…_P80000_…); reference README default: 5000", le=1_000_000),
        record_every=setting(5, le=1_000_000),
    )
    population_beside: bool = param(True, "also run population GD (exact expected loss) from the same init")

    def ranks_trained(self) -> list[int]:
        """The ranks R this figure trains (Fig 3: R = 1)."""
        return [1]

    def training(self, R: int, engine: str) -> LinregTraining:
        """ATTN_S of rank R with H heads by one engine: full-batch GD on P prompts (moments, on the
        run's backend) or GD on the exact expected loss (population), weights recorded."""
        moments = engine == "moments"
        return training_spec(self, model="attn_s", engine=engine, R=R, P=self.P if moments else None,
                             backend="auto" if moments else "xla", record_params=True)

    def engines_run(self) -> list[tuple[str, str]]:
        """(array prefix, engine) of each run: the main engine, and population GD beside it."""
        runs = [("", self.engine)]
        if self.population_beside and self.engine != "population":
            runs.append(("pe_", "population"))
        return runs

    @model_validator(mode="after")
    def _trainings(self):
        for R in self.ranks_trained():
            for _, engine in self.engines_run():
                self.training(R, engine)
        return self


# --------------------------------------------------------------------------------------------
# Readings of a trajectory.


def eigenbasis(Lam) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvalues of Λ, decreasing, and the matching eigenvectors e_d as columns: ((D,), (D, D))."""
    lam, E = np.linalg.eigh(np.asarray(Lam, dtype=float))
    order = np.argsort(-lam, kind="stable")
    return lam[order], E[:, order]


def abs_cosines(w, E) -> np.ndarray:
    """|cos(w, e_d)| for every vector w (last axis, D) and eigenvector e_d: (..., D)."""
    w = np.asarray(w, dtype=float)
    norm = np.linalg.norm(w, axis=-1, keepdims=True)
    return np.abs(w @ np.asarray(E)) / np.where(norm > 0, norm, 1.0)


def plateau_points(t, loss) -> np.ndarray:
    """Record indices of the plateaus of a smooth loss curve: the start, the slowest point between
    consecutive drops (deepest valley of −dL/dt, see :func:`drop_intervals`), and the last record.

    Returns (n_drops + 1,) indices; a curve without drops gives [0, T−1].
    """
    drops = drop_intervals(t, loss)
    last = len(np.asarray(loss)) - 1
    if not drops:
        return np.array([0, last])
    return np.array([drops[0][0]] + [end for _, end in drops[:-1]] + [last])


def nearest_levels(values, levels) -> tuple[np.ndarray, np.ndarray]:
    """For each value, the index m of the nearest level and the signed distance value − level[m]."""
    values, levels = np.asarray(values, dtype=float), np.asarray(levels, dtype=float)
    m = np.argmin(np.abs(values[..., None] - levels), axis=-1)
    return m, values - levels[m]


def plateau_errors(t, losses, levels) -> np.ndarray:
    """|L − L(M_m)| at every plateau (:func:`plateau_points`) of every curve, m the nearest eq-19
    level. losses: (S, T). Returns the flat array of errors."""
    return np.concatenate([np.abs(nearest_levels(c[plateau_points(t, c)], levels)[1]) for c in np.atleast_2d(losses)])


def drop_end_times(t, loss, levels, frac: float = 0.9) -> np.ndarray:
    """t_m, m = 1..D: first time the loss has made ``frac`` of the drop from L(M_{m−1}) to L(M_m)
    ("just after the m-th drop", Fig 10). NaN where never reached. Returns (D,)."""
    levels = np.asarray(levels, dtype=float)
    t, loss = np.asarray(t, dtype=float), np.asarray(loss, dtype=float)
    out = np.full(len(levels) - 1, np.nan)
    for m in range(1, len(levels)):
        idx = np.flatnonzero(loss <= levels[m] + (1.0 - frac) * (levels[m - 1] - levels[m]))
        if idx.size:
            out[m - 1] = t[idx[0]]
    return out


def plateau_middles(t, loss, levels, frac: float = 0.9) -> np.ndarray:
    """Record index of the middle of each plateau M_m, m = 0..D: half-way in time between the end
    of drop m (``drop_end_times``; t = 0 for m = 0) and the start of drop m+1 (the loss has made
    1 − frac of it); the last record for m = D and for a plateau the run never leaves. −1 where the
    plateau is not visited (not reached, or drop m+1 starts before drop m ends). Returns (D+1,)."""
    t, loss, levels = np.asarray(t, dtype=float), np.asarray(loss, dtype=float), np.asarray(levels, dtype=float)
    ends = np.concatenate([[t[0]], drop_end_times(t, loss, levels, frac)])
    starts = drop_end_times(t, loss, levels, 1.0 - frac)
    out = np.full(len(levels), -1)
    for m in range(len(levels)):
        if not np.isfinite(ends[m]):
            continue
        if m == len(levels) - 1 or not np.isfinite(starts[m]):
            out[m] = len(t) - 1
        elif starts[m] > ends[m]:
            out[m] = int(np.argmin(np.abs(t - 0.5 * (ends[m] + starts[m]))))
    return out


def learner_slots(v, k, q, E) -> np.ndarray:
    """The (head, rank slot) that carries each eigendirection: argmax over (i, r) of
    |v_i (k_{i,r}·e_d)(q_{i,r}·e_d)|. v: (H,), k, q: (H, R, D), E: (D, D). Returns (D, 2) ints."""
    kd, qd = np.asarray(k) @ E, np.asarray(q) @ E  # (H, R, D)
    strength = np.abs(np.asarray(v)[:, None, None] * kd * qd)
    H, R, D = strength.shape
    flat = strength.reshape(H * R, D).argmax(axis=0)
    return np.stack([flat // R, flat % R], axis=1)


def eq21_overlay(t, v_sim, t_start: float, *, lam: float, inv_N: float, trace: float,
                 align: OdeAlign = "half_rise") -> np.ndarray:
    """The eq-21 solution for a head learning direction λ, on the records t (NaN where undefined).

    Started at v(t_start) = |v_sim(t_start)| (``start``), or the same solution shifted in time so that
    it reaches v*/2 when |v_sim| does (``half_rise``; eq 21 is autonomous, so only its shape is
    tested). Eq 21 is in paper time t/τ = 2t.

    Args:
        t: (T,) record times; v_sim: (T,) simulated v of the head (either sign).
        t_start: time t_m the previous drop ended (0 for the first direction).
        lam: λ_{m+1} of the direction; inv_N: E(1/N); trace: trΛ.
        align: "half_rise" or "start".
    Returns:
        (T,) |v| of eq 21.
    """
    t, v_abs = np.asarray(t, dtype=float), np.abs(np.asarray(v_sim, dtype=float))
    v0 = float(np.interp(t_start, t, v_abs))
    ode = dict(lam=lam, inv_N=inv_N, trace=trace)
    vs = float(theory.v_star(lam, inv_N=inv_N, trace=trace))
    out = np.full(t.shape, np.nan)
    if not v0 > 0 or v0 >= vs:
        return out
    if align == "start":
        keep = t >= t_start
        out[keep] = theory.eq21_solve(v0, 2.0 * (t[keep] - t_start), **ode)
        return out
    t_half_sim = first_rise(t, v_abs, 0.5 * vs)
    if not np.isfinite(t_half_sim):
        return out
    # Half-rise time of eq 21 from v0 (paper time), exactly from eq 70.
    tau_half = float(theory.eq70_time(0.5 * vs, **ode) - theory.eq70_time(v0, **ode))
    t0 = t_half_sim - 0.5 * tau_half
    keep = t >= t0
    out[keep] = theory.eq21_solve(v0, 2.0 * (t[keep] - t0), **ode)
    return out


# --------------------------------------------------------------------------------------------
# One run of the Fig 3 setup at rank R, with everything the checks and plots read.


def readings(t, pop, v, k, q, Lams, lam, inv_N: float, align: OdeAlign = "half_rise") -> dict:
    """What the checks and plots read off one engine's trajectories (S seeds, T records, D directions).

    Args:
        t: (T,); pop: (S, T) exact expected loss of the weights; v: (S, T, H); k, q: (S, T, H, R, D);
        Lams: (S, D, D); lam: (D,) eigenvalues, decreasing; inv_N: 1/N.
    Returns:
        plateau_idx (S, D+1) slowest record of each plateau (−1 padding; see :func:`plateau_points`);
        middle_idx (S, D+1) middle of plateau M_m (:func:`plateau_middles`, −1 if not visited);
        cos_k, cos_q (S, D+1, H, R, D) |cos(k_{i,r}, e_d)| and norm_k, norm_q (S, D+1, H, R) and
        v_middle (S, D+1, H) at the plateau middles; learner (S, D, 2) the (head, slot) carrying e_d at
        the end; v_learner, k_learner, q_learner (S, D, T) its |v|, |k·e_d|, |q·e_d|;
        t_end (S, D) drop end times t_m; v_ode (S, D, T) eq 21 for each learner (R = 1 only).
    """
    S, T, H, R, D = k.shape
    levels = theory.plateau_losses(lam, inv_N)
    out = {"plateau_idx": np.full((S, D + 1), -1), "middle_idx": np.full((S, D + 1), -1),
           "cos_k": np.full((S, D + 1, H, R, D), np.nan), "cos_q": np.full((S, D + 1, H, R, D), np.nan),
           "norm_k": np.full((S, D + 1, H, R), np.nan), "norm_q": np.full((S, D + 1, H, R), np.nan),
           "v_middle": np.full((S, D + 1, H), np.nan), "learner": np.zeros((S, D, 2), dtype=int),
           "v_learner": np.zeros((S, D, T)), "k_learner": np.zeros((S, D, T)), "q_learner": np.zeros((S, D, T)),
           "t_end": np.zeros((S, D)), "v_ode": np.full((S, D, T), np.nan)}
    for s in range(S):
        _, E = eigenbasis(Lams[s])
        idx = plateau_points(t, pop[s])[: D + 1]
        out["plateau_idx"][s, : len(idx)] = idx
        mid = plateau_middles(t, pop[s], levels)
        out["middle_idx"][s] = mid
        ok = mid >= 0
        out["cos_k"][s, ok], out["cos_q"][s, ok] = abs_cosines(k[s, mid[ok]], E), abs_cosines(q[s, mid[ok]], E)
        out["norm_k"][s, ok] = np.linalg.norm(k[s, mid[ok]], axis=-1)
        out["norm_q"][s, ok] = np.linalg.norm(q[s, mid[ok]], axis=-1)
        out["v_middle"][s, ok] = v[s, mid[ok]]
        out["learner"][s] = learner_slots(v[s, -1], k[s, -1], q[s, -1], E)
        out["t_end"][s] = drop_end_times(t, pop[s], levels)
        t_prev = np.concatenate([[0.0], out["t_end"][s]])
        for m in range(D):
            i, r = out["learner"][s, m]
            out["v_learner"][s, m] = np.abs(v[s, :, i])
            out["k_learner"][s, m] = np.abs(k[s, :, i, r] @ E[:, m])
            out["q_learner"][s, m] = np.abs(q[s, :, i, r] @ E[:, m])
            if R == 1 and np.isfinite(t_prev[m]):
                out["v_ode"][s, m] = eq21_overlay(t, v[s, :, i], t_prev[m], lam=lam[m], inv_N=inv_N, trace=lam.sum(),
                                                  align=align)
    return out


def moments_statistics(config: AttnSConfig):
    """The moments engine's statistics of the config's P prompts per seed, to share between runs on the
    same data (a rank sweep); None for the population engine."""
    if config.engine != "moments":
        return None
    keys, Lams = keys_and_covariances(config)
    return linreg.prompt_statistics(keys, Lams, config.N, config.P)


def run_attn_s(config: AttnSConfig, reporter, *, R: int, align: OdeAlign = "half_rise", tag: str = "",
               stats=None) -> dict:
    """Trains ATTN_S (rank R, config.H heads) for config.seeds seeds and reads off its plateaus.

    Returns arrays, every name prefixed by ``tag``: t (T,), step (T,), loss (S, T) the main engine's
    objective, pop (S, T) the exact expected loss of its weights, v (S, T, H), the :func:`readings`
    of the main engine, and, with ``population_beside``, the population engine's loss and readings
    under the prefix ``pe_``; eigenvalues (D,), plateau_levels (D+1,) of eq 19, v_star (D,).
    ``stats``: :func:`moments_statistics` of this config, if already computed.
    """
    keys, Lams = keys_and_covariances(config)
    lam = config.lambdas()
    inv_N = 1.0 / config.N
    S = config.seeds
    name = f"ATTN_S R = {R}, H = {config.H}"
    out = {"eigenvalues": lam, "plateau_levels": theory.plateau_losses(lam, inv_N),
           "v_star": theory.v_star(lam, inv_N=inv_N, trace=lam.sum())}
    for prefix, engine in config.engines_run():
        spec = config.training(R, engine)
        if engine == "moments":
            tr = linreg.train(spec, keys=keys, Lams=Lams, N=config.N, stats=stats, reporter=reporter,
                              label=f"{name}: moments (P = {config.P}, {S} seeds)")
            pop = np.asarray(tr.metrics["population"])
        else:
            tr = linreg.train(spec, keys=keys, Lams=Lams, N=config.N, reporter=reporter,
                              label=f"{name}: population ({S} seeds)")
            pop = np.asarray(tr.loss)
        t = np.asarray(tr.t)
        v, k, q = (np.asarray(tr.params[n]) for n in ("v", "k", "q"))
        out.update({f"{prefix}t": t, f"{prefix}step": np.asarray(tr.step), f"{prefix}loss": np.asarray(tr.loss),
                    f"{prefix}pop": pop, f"{prefix}v": v})
        out.update({f"{prefix}{key}": value for key, value in
                    readings(t, pop, v, k, q, np.asarray(Lams), lam, inv_N, align).items()})
    return {f"{tag}{key}": value for key, value in out.items()}


def attn_s_memory(config: AttnSConfig) -> tuple[float, str]:
    """An upper estimate of a :func:`run_attn_s` run's memory (``Experiment.memory``), every rank of
    ``ranks_trained`` and every engine of ``engines_run``.

    The moments engine's statistics pass (:func:`iclab.experiments.linattn._common.statistics_memory`: the
    P·(N+1)·(D+1) prompts of one seed), and, kept to the end, each run's records: per record and seed the
    losses, the params v (H), k, q (H, R, D) and the readings' (D,) curves v, k, q of the learners and eq 21,
    H·(1 + 2RD) + 4D + 3 float64 numbers (:func:`iclab.experiments._memory.records`). Fig 10's aligned
    population run adds its own records (one seed, H = D heads).

    Returns:
        (bytes, what).
    """
    S, D, H = config.seeds, config.D, config.H
    terms = []
    if any(engine == "moments" for _, engine in config.engines_run()):
        terms += statistics_memory(seeds=S, P=config.P, N=config.N, D=D)
    for R in config.ranks_trained():
        for _, engine in config.engines_run():
            terms.append((records(seeds=S, steps=config.steps, record_every=config.record_every,
                                  values=H * (1 + 2 * R * D) + 4 * D + 3),
                          f"the recorded weights of {S} seed(s) at {config.steps // config.record_every + 1} "
                          f"records (R = {R}, {engine})"))
    if hasattr(config, "aligned_training"):
        terms.append((records(seeds=1, steps=config.steps, record_every=config.record_every,
                              values=D * (1 + 2 * D) + 2), "the aligned run's recorded weights"))
    return total(terms)


def head_escapes(t, loss, v, levels, active: float, frac: float = 0.5) -> list[tuple[int, float, int]]:
    """When each head's v_i escapes zero, and the plateau it leaves (Sec 5, Figs 11, 13).

    A head is active if its final |v_i| exceeds ``active``; it escapes when |v_i| first reaches
    ``frac`` of its final value. The plateau it leaves is the last plateau (:func:`plateau_points`)
    before that time, labelled by the nearest eq-19 level m.

    Args:
        t: (T,); loss: (T,) smooth loss (exact expected loss of the weights); v: (T, H); levels: (D+1,).
    Returns:
        [(head, escape time, m)] in order of escape.
    """
    t, v = np.asarray(t, dtype=float), np.abs(np.asarray(v, dtype=float))
    points = plateau_points(t, loss)
    labels, _ = nearest_levels(np.asarray(loss)[points], levels)
    out = []
    for i in np.flatnonzero(v[-1] > active):
        t_esc = first_rise(t, v[:, i], frac * v[-1, i])
        before = np.flatnonzero(t[points] <= t_esc)
        out.append((int(i), t_esc, int(labels[before[-1]]) if before.size else 0))
    return sorted(out, key=lambda e: e[1])


# --------------------------------------------------------------------------------------------
# Rank-R runs (Figs 11, 13): which plateaus a new head leaves, and the loss / v panels.


class RankConfig(AttnSConfig):
    """The Fig 3 setup at several ranks R, one column each, on the same data (Figs 11, 13)."""

    ranks: list[int] = engine_grid(LinregTraining, "R", [2, 3, 4], "ranks R of the key and query matrices, one column "
                                   "each", paper=[2, 3, 4])
    population_beside: bool = param(False, "also run population GD from the same init (not used here)")
    show_seed: int = param(0, "seed whose v_i are shown", ge=0, le=1023)
    active_frac: float = param(0.5, "a head is active if its final |v_i| exceeds this fraction of min_d v*_d; it "
                               "escapes when |v_i| reaches half its final value", gt=0, lt=1)

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, value):
        if not value:  # each ≥ 1: the engine's bounds of R (engine_grid)
            raise ValueError("ranks must be a non-empty list of integers ≥ 1")
        return value

    def ranks_trained(self) -> list[int]:
        """The ranks R of the columns."""
        return list(self.ranks)


def run_ranks(config: RankConfig, reporter) -> dict:
    """:func:`run_attn_s` at every rank of the config, on the same prompts (one statistics pass), arrays
    prefixed ``R{R}_``; plus ranks (n,)."""
    out = {"ranks": np.array(config.ranks)}
    stats = moments_statistics(config)
    for R in config.ranks:
        out.update(run_attn_s(config, reporter, R=R, tag=f"R{R}_", stats=stats))
    return out


def escape_plateaus(t, losses, vs, levels, active: float) -> list[list[int]]:
    """For each seed, the plateaus m (eq-19 labels) that a new head escapes from (:func:`head_escapes`).
    losses: (S, T); vs: (S, T, H)."""
    return [[m for _, _, m in head_escapes(t, c, v, levels, active)] for c, v in zip(losses, vs)]


def rank_escapes(config: RankConfig, r: dict, R: int) -> list[list[int]]:
    """:func:`escape_plateaus` of the rank-R run stored under ``R{R}_``, a head being active above
    ``active_frac`` · min_d v*_d."""
    tag = f"R{R}_"
    return escape_plateaus(r[f"{tag}t"], r[f"{tag}pop"], r[f"{tag}v"], r[f"{tag}plateau_levels"],
                           config.active_frac * float(np.min(r[f"{tag}v_star"])))


def escape_violations(escapes: list[list[int]], R: int) -> int:
    """Escapes (over seeds) from a plateau M_m with R ∤ m (Sec 5: a new v_i escapes only where R | m)."""
    return sum(m % R != 0 for seed in escapes for m in seed)


def group_values(v_star, R: int) -> np.ndarray:
    """|v| of the heads at convergence when head j carries e_{jR+1} … e_{(j+1)R} (Sec 5; derived here):
    v_j³ = Σ_{d in group j} v*_d³, since each head is balanced (Σ_r ‖k_{i,r}‖² = v_i², eq 88) and
    carries λ_d/a_d = v*_d³ on each of its directions (eq 18). Returns (⌈D/R⌉,)."""
    cubes = np.asarray(v_star, dtype=float) ** 3
    return np.array([cubes[j : j + R].sum() ** (1.0 / 3.0) for j in range(0, len(cubes), R)])


def plot_rank_column(ax_loss, ax_v, r: dict, tag: str, R: int, show_seed: int, engine: str) -> None:
    """Loss (all seeds) above |v_i| (one seed) of a rank-R run stored under ``tag``."""
    from iclab.experiments._plot import COLORS, MODEL_COLORS, THEORY_STYLE, TIME_LABEL, theory_levels

    t, levels = r[f"{tag}t"], r[f"{tag}plateau_levels"]
    D = len(levels) - 1
    for i, c in enumerate(r[f"{tag}loss"]):
        ax_loss.plot(t, c, color=MODEL_COLORS["ATTN_S"], lw=1.1, alpha=0.85,
                     label=f"training loss ({engine}, {len(r[f'{tag}loss'])} seeds)" if i == 0 else None)
    theory_levels(ax_loss, levels, [f"L(M_{m})" for m in range(D + 1)])
    ax_loss.plot([], [], **THEORY_STYLE, label="eq 19")
    ax_loss.set_title(f"R = {R}: conspicuous plateaus at m with R | m", fontsize=9)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize=7, loc="upper right", bbox_to_anchor=(0.9, 1.0))
    s = min(show_seed, len(r[f"{tag}loss"]) - 1)
    v = np.abs(r[f"{tag}v"][s])
    # Heads coloured by escape order (the j-th escaping head carries the j-th group of R directions in the
    # typical run; with repeated eigenvalues the e_d inside a group are interchangeable).
    escapes = head_escapes(t, r[f"{tag}pop"][s], v, levels, 0.5 * float(np.min(r[f"{tag}v_star"])))
    ordinal = {1: "1st", 2: "2nd", 3: "3rd"}
    escaped = [head for head, _, _ in escapes]
    for j, i in enumerate(escaped):
        ax_v.plot(t, v[:, i], color=COLORS[min(j * R, D - 1)], lw=1.5,
                  label=f"head escaping {ordinal.get(j + 1, f'{j + 1}th')}")
    for i in range(v.shape[1]):
        if i not in escaped:
            ax_v.plot(t, v[:, i], color="0.6", lw=0.8)
    for j, g in enumerate(group_values(r[f"{tag}v_star"], R)):
        ax_v.axhline(g, **{**THEORY_STYLE, "color": COLORS[j * R]})
    ax_v.plot([], [], **THEORY_STYLE, label="(Σ_{d in group} v*_d³)^{1/3}, groups of R")
    ax_v.set_title(f"R = {R}: |v_i|, seed {s}", fontsize=9)
    ax_v.set_ylabel("|v_i|")
    ax_v.legend(fontsize=7, loc="lower right")
    for ax in (ax_loss, ax_v):
        ax.set_xlabel(TIME_LABEL)
        ax.set_xlim(0, t[-1])
