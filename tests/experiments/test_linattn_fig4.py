"""linattn Figs 4/12 (the rank sweep of _rank_sweep): plateau readings and checks on synthetic curves,
config validation and the benchmark's timing. The engine the sweep trains through (shared statistics,
native backend) is tested in tests/engines/test_linreg.py."""

import jax
import numpy as np
import pytest

from iclab.experiments import all_experiments
from iclab.experiments.linattn import _rank_sweep as sweep
from iclab.tasks.linreg import covariance, sample_prompts, spectrum_eigenvalues
from iclab.theory import linattn as theory

LAM = spectrum_eigenvalues("inverse", 8)
LEVELS = theory.plateau_losses(LAM, 1.0 / 31)


def staircase(segments, dt=0.05, ramp=0.2):
    """A loss curve resting on each (value, duration) segment in turn, joined by linear ramps."""
    t, loss, now = [0.0], [segments[0][0]], 0.0
    for i, (value, duration) in enumerate(segments):
        if i:
            now += ramp
            t.append(now), loss.append(value)
        n = max(int(round(duration / dt)), 1)
        for _ in range(n):
            now += dt
            t.append(now), loss.append(value)
    return np.array(t), np.array(loss)


def units(m):  # the escape time 1/(2λ²_{m+1}) of plateau m
    return 1.0 / (2.0 * LAM[m] ** 2)


def rank_curve(R, long=6.0, brief=0.3, final=LEVELS[-1], offset=None, durations=None):
    """Synthetic population loss of a rank-R run: long rests at R | m, brief ones elsewhere
    (``durations``: m -> rest in escape times, overriding those)."""
    segs = []
    for m in range(8):
        rest = (durations or {}).get(m, long if m % R == 0 else brief)
        segs.append((LEVELS[m], rest * units(m)))
        if offset is not None and m == offset[0]:
            segs.insert(-1, (LEVELS[m] + offset[1], 3 * long * units(m)))  # a slower rest off the level, first
    segs.append((final, 20 * units(7)))
    return staircase(segs)


def test_normalized_dwell_measures_rests_in_escape_times():
    t, loss = rank_curve(2)
    dwell = sweep.normalized_dwell(t, loss, LEVELS, LAM, tol=0.008)
    expected = np.array([6.0 if m % 2 == 0 else 0.3 for m in range(8)])
    np.testing.assert_allclose(dwell, expected, rtol=0.05, atol=0.05)


def test_plateau_loss_reads_the_curve_not_the_theory():
    t, loss = staircase([(1.0, 5), (0.5123, 50), (0.2, 5)])
    assert sweep.plateau_loss(t, loss, [1.0, 0.52, 0.2], 1) == pytest.approx(0.5123)
    assert np.isnan(sweep.plateau_loss(t, loss, [1.0, 0.52, 0.2, 0.05], 3))


def test_worst_visited_plateau_and_conspicuous_split():
    t, loss = rank_curve(1, offset=(3, 0.012))
    dwell = sweep.normalized_dwell(t, loss, LEVELS, LAM, tol=0.008)[None]
    value, level = sweep.worst_visited_plateau(t, loss[None], LEVELS, dwell)
    assert level == LEVELS[3] and value == pytest.approx(LEVELS[3] + 0.012)
    assert sweep.conspicuous_split([9.0, 1.0, 5.0, 2.0], 2) == (5.0, 2.0)
    low, high = sweep.conspicuous_split([9.0, 1.0], 1)
    assert low == 1.0 and np.isnan(high)


def _arrays(curves_by_rank):
    t = curves_by_rank[next(iter(curves_by_rank))][0]
    out = {"t": t, "plateau_levels": LEVELS, "eigenvalues": LAM, "ranks": np.array(list(curves_by_rank))}
    for R, (tr, loss) in curves_by_rank.items():
        loss = np.interp(t, tr, loss)[None].repeat(3, axis=0)
        out[f"loss_R{R}"], out[f"pop_R{R}"] = loss, loss
    return out


def _passed(checks):
    return {c.name.split(":")[0] + ":" + c.name.split(":")[1][:12]: c.passed for c in checks}


def test_checks_pass_on_the_theory_s_picture():
    config = sweep.RankSweepConfig(ranks=[2, 4], seeds=3)
    checks = sweep.checks_rank_sweep(config, _arrays({2: rank_curve(2), 4: rank_curve(4)}))
    assert len(checks) == 8 and all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]


def test_checks_fail_on_a_plateau_at_r_not_dividing_m_an_offset_plateau_and_no_convergence():
    config = sweep.RankSweepConfig(ranks=[2], seeds=3)
    long_m3 = rank_curve(2, durations={3: 4.0})  # a plateau at m = 3 (R ∤ m) as long as those at R | m
    failed = [c.name for c in sweep.checks_rank_sweep(config, _arrays({2: long_m3})) if not c.passed]
    assert len(failed) == 1 and "outlast" in failed[0]
    failed = [c.name for c in sweep.checks_rank_sweep(config, _arrays({2: rank_curve(2, offset=(4, 0.012))}))
              if not c.passed]
    assert len(failed) == 1 and "eq 19" in failed[0]
    # Stuck on L(M_7): the final loss misses L(M_8), and the rest at m = 7 (R ∤ m) is the longest.
    failed = [c.name for c in sweep.checks_rank_sweep(config, _arrays({2: rank_curve(2, final=LEVELS[-2])}))
              if not c.passed]
    assert len(failed) == 2 and "outlast" in failed[0] and "final" in failed[1]


def test_config_validation_and_fig12_reuses_the_sweep():
    with pytest.raises(ValueError, match="≤ D"):
        sweep.RankSweepConfig(ranks=[9])
    with pytest.raises(ValueError, match="R·H"):
        sweep.RankSweepConfig(ranks=[1], H=4)
    with pytest.raises(ValueError, match="distinct"):
        sweep.RankSweepConfig(ranks=[2, 2])
    with pytest.raises(ValueError, match="finite"):
        sweep.RankSweepConfig(eigenvalues=[float("inf")] + [0.1] * 7)
    exps = all_experiments()
    f4, f12 = exps["linattn.fig4"], exps["linattn.fig12"]
    assert f4.resolve("paper").ranks == [1, 2, 4, 8] and f12.resolve("paper").ranks == [3, 5, 6, 7]
    assert f12.run is f4.run is sweep.run_rank_sweep and f12.checks is f4.checks and f12.plot is f4.plot
    paper = f4.resolve("paper")
    assert (paper.D, paper.N, paper.H, paper.P, paper.steps, paper.seeds) == (8, 31, 9, 80_000, 20_000, 6)
    assert paper.lr == pytest.approx(0.02 * 31 ** (2 / 3)) and paper.spectrum == "inverse"


def test_standard_error_of_the_training_loss_at_m0():
    Lam = covariance(LAM)
    y = np.asarray(sample_prompts(jax.random.PRNGKey(0), Lam, N=1, P=200_000).y_q)
    assert sweep._se_mean_y2(LAM, 1) == pytest.approx((y**2).std(), rel=0.05)


def test_benchmark_timing_is_the_slope_between_two_runs():
    from iclab.benches import linattn as _bench

    clock = {"now": 0.0}

    def fake(n):  # 0.5 s to compile, 2 ms a step
        clock["now"] += 0.5 + 0.002 * n

    real = _bench.time.perf_counter
    _bench.time.perf_counter = lambda: clock["now"]
    try:
        per_step, overhead = _bench._per_step(fake, 10, 100)
    finally:
        _bench.time.perf_counter = real
    assert per_step == pytest.approx(0.002) and overhead == pytest.approx(0.5)


def test_benchmark_timing_refuses_a_slope_lost_in_the_call_overhead():
    from iclab.benches import linattn as _bench

    clock = {"now": 0.0, "calls": 0}

    def fake(n):  # the call overhead jitters by 0.1 s and hides the steps (1e-9 s each)
        clock["calls"] += 1
        clock["now"] += 1.0 + (0.1 if clock["calls"] <= 2 else 0.0) + 1e-9 * n

    real = _bench.time.perf_counter
    _bench.time.perf_counter = lambda: clock["now"]
    try:
        with pytest.raises(RuntimeError, match="too noisy"):
            _bench._per_step(fake, 10, 100)
    finally:
        _bench.time.perf_counter = real
