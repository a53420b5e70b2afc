from functools import lru_cache

import numpy as np
import pytest

from iclab.experiments.linattn import _attn_s, fig3
from iclab.theory import linattn as theory

LAM = np.array([0.4, 0.3, 0.2, 0.1])
N = 31


@lru_cache(maxsize=1)
def _aligned_trajectory(v0=(0.05, 0.04, 0.03, 0.02)):
    """Heads k_d = q_d = v_d e_d (Λ diagonal): A stays diagonal, each v_d follows eq 21 on its own
    (paper time 2t), and the loss is Σ_d λ_d − 2λ_d²c_d + λ_d a_d c_d², c_d = v_d³. Drops near
    t = 62, 139, 417, 2500 (eq 71); records every 0.5 up to t = 600, every 5 after."""
    t = np.concatenate([np.arange(0.0, 600.0, 0.5), np.arange(600.0, 4000.0 + 1e-9, 5.0)])
    v = np.stack([theory.eq21_solve(v0[d], 2 * t, lam=LAM[d], inv_N=1 / N, trace=LAM.sum()) for d in range(4)], axis=1)  # (T, H)
    a = LAM**2 * (1 + (1 + LAM.sum() / LAM) / N)
    c = v**3
    loss = np.sum(LAM - 2 * LAM**2 * c + LAM * a * c**2, axis=1)
    k = v[:, :, None, None] * np.eye(4)[None, :, None, :]  # (T, H, R=1, D)
    return t, loss, v, k


def _result(t, loss, v, k, q=None):
    q = k if q is None else q
    r = _attn_s.readings(t, loss[None], v[None], k[None], q[None], np.diag(LAM)[None], LAM, 1 / N)
    r.update(t=t, loss=loss[None], pop=loss[None], v=v[None], eigenvalues=LAM,
             plateau_levels=theory.plateau_losses(LAM, 1 / N), v_star=theory.v_star(LAM, inv_N=1 / N, trace=LAM.sum()))
    return r


def test_plateau_readings_of_a_staircase():
    t, loss, v, k = _aligned_trajectory()
    levels = theory.plateau_losses(LAM, 1 / N)
    idx = _attn_s.plateau_points(t, loss)
    assert len(idx) == 5
    assert np.max(np.abs(loss[idx] - levels)) < 2e-3
    t_end = _attn_s.drop_end_times(t, loss, levels)
    assert np.all(np.diff(t_end) > 0)
    mid = _attn_s.plateau_middles(t, loss, levels)
    assert np.all(mid >= 0) and np.all(np.diff(t[mid]) > 0) and mid[-1] == len(t) - 1
    # a curve that jumps from L(M_0) to L(M_2) never visits M_1
    skip = np.where(t < 100, levels[0], levels[2])
    assert _attn_s.plateau_middles(t, skip, levels)[1] == -1


def test_cosines_and_learners():
    E = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))[0]
    assert np.allclose(_attn_s.abs_cosines(-2.0 * E[:, 1], E), [0, 1, 0], atol=1e-12)
    k = np.stack([E[:, 2], E[:, 0], E[:, 1]])[:, None, :]  # head i carries e_{(i+2) mod 3}
    assert _attn_s.learner_slots(np.ones(3), k, -k, E)[:, 0].tolist() == [1, 2, 0]


def test_eq21_overlay_start_and_half_rise():
    t = np.linspace(0, 400, 2001)
    vs = theory.v_star(LAM[0], inv_N=1 / N, trace=1.0)
    ode = dict(lam=LAM[0], inv_N=1 / N, trace=1.0)
    sim = theory.eq21_solve(0.03, 2 * t, **ode)
    # half_rise locates v*/2 by linear interpolation between records: error O(dt²)
    for align, tol in (("start", 1e-6), ("half_rise", 1e-3)):
        overlay = _attn_s.eq21_overlay(t, sim, 0.0, align=align, **ode)
        assert np.nanmax(np.abs(overlay - sim)) < tol * vs
    # delayed by 50: the shape still matches (half_rise), the start time does not
    late = np.interp(t - 50, t, sim, left=0.03)
    assert np.nanmax(np.abs(_attn_s.eq21_overlay(t, late, 0.0, align="half_rise", **ode) - late)) < 0.02 * vs
    assert np.nanmax(np.abs(_attn_s.eq21_overlay(t, late, 0.0, align="start", **ode) - late)) > 0.5 * vs


def test_checks_pass_on_the_aligned_trajectory_and_fail_when_a_head_tilts():
    config = fig3.Fig3Config(seeds=1, engine="population", population_beside=False)
    t, loss, v, k = _aligned_trajectory()
    checks = fig3.checks_fig3(config, _result(t, loss, v, k))
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]
    # head 0 tilted by 10° towards e_2 (same norm): the alignment check must fail
    rot = np.eye(4)
    c, s = np.cos(np.radians(10)), np.sin(np.radians(10))
    rot[:2, :2] = [[c, -s], [s, c]]
    tilted = k.copy()
    tilted[:, 0] = k[:, 0] @ rot.T
    failed = {c.name for c in fig3.checks_fig3(config, _result(t, loss, v, tilted)) if not c.passed}
    assert any("cos(k, e_m)" in name for name in failed)


def test_alignment_and_ode_errors_shapes():
    t, loss, v, k = _aligned_trajectory()
    r = _result(t, loss, v, k)
    mis, dev = fig3.alignment_errors(r)
    assert mis.shape == dev.shape == (1, 4)
    assert np.nanmax(mis) < 1e-12 and np.nanmax(dev) < 5e-3
    assert fig3.ode_errors(r).shape == (1, 4)


def test_group_values_and_head_escapes():
    vs = theory.v_star(LAM, inv_N=1 / N, trace=1.0)
    assert np.allclose(_attn_s.group_values(vs, 1), vs)
    assert _attn_s.group_values(vs, 4) == pytest.approx([np.sum(vs**3) ** (1 / 3)])
    t, loss, v, _ = _aligned_trajectory()
    esc = _attn_s.head_escapes(t, loss, v, theory.plateau_losses(LAM, 1 / N), active=0.5)
    assert [e[0] for e in esc] == [0, 1, 2, 3] and [e[2] for e in esc] == [0, 1, 2, 3]
