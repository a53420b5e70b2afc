import numpy as np
import pytest

from iclab.experiments.linattn import fig10
from iclab.theory import linattn as theory

LAM = np.array([0.4, 0.3, 0.2, 0.1])


def test_eq76_times_chain_from_the_previous_drop():
    t = np.linspace(0, 100, 101)
    v = np.stack([np.full(101, 0.1), np.linspace(0.0, 1.0, 101), np.full(101, 0.5), np.full(101, 0.25)])
    t_end = np.array([10.0, 20.0, 40.0, 80.0])
    pred = fig10.eq76_times(t, v, t_end, LAM)
    # our time is half the paper's: t̂_m − t_(m−1) = 1/(2 λ_m² v_m(t_(m−1)))
    assert pred[0] == pytest.approx(1 / (2 * 0.16 * 0.1))
    assert pred[1] == pytest.approx(10 + 1 / (2 * 0.09 * 0.1))
    assert pred[3] == pytest.approx(40 + theory.attn_s_next_plateau_time(lam=0.1, v_at_tm=0.25) / 2)
    ratio = fig10.duration_ratios(t_end, pred)
    assert ratio[0] == pytest.approx(10 / pred[0]) and ratio[1] == pytest.approx(10 / (pred[1] - 10))


def test_escape_violations():
    t = np.linspace(0, 10, 11)
    v_star = np.array([1.0, 1.0])
    rising = np.stack([np.clip(t - 1, 0, 1), np.clip(t - 5, 0, 1)])[None]  # cross 0.5 at t = 1.5, 5.5
    assert fig10.escape_violations(t, rising, np.array([[2.0, 6.0]]), v_star) == 0
    assert fig10.escape_violations(t, rising, np.array([[1.0, 6.0]]), v_star) == 1  # head 1 rises after t_1
    assert fig10.escape_violations(t, rising, np.array([[2.0, 5.0]]), v_star) == 1
