import numpy as np

from iclab.experiments._analysis import count_drops, drop_intervals, first_crossing


def _staircase(levels, times, width, t):
    loss = np.full_like(t, levels[0])
    for k, tk in enumerate(times):
        loss -= (levels[k] - levels[k + 1]) / (1 + np.exp(-(t - tk) / width))
    return loss


def test_counts_each_saddle_escape_of_a_staircase():
    t = np.linspace(0, 100, 4001)
    levels = [1.0, 0.64, 0.38, 0.21, 0.136]
    loss = _staircase(levels, [10, 30, 55, 85], 1.0, t)
    assert count_drops(t, loss) == 4
    drops = drop_intervals(t, loss)
    assert all(t[a] < tk < t[b] for (a, b), tk in zip(drops, [10, 30, 55, 85]))


def test_one_drop_with_a_slow_tail_is_one_drop():
    t = np.linspace(0, 100, 4001)
    sig = 1 / (1 + np.exp(-(t - 20)))
    loss = 1.0 - 0.8 * sig - 0.064 * sig * (1 - np.exp(-(t - 20).clip(0) / 30))
    assert count_drops(t, loss) == 1


def test_drops_merge_without_a_plateau_between():
    t = np.linspace(0, 100, 4001)
    loss = _staircase([1.0, 0.6, 0.2], [20, 23], 2.0, t)  # overlapping escapes: no plateau
    assert count_drops(t, loss) == 1
    assert count_drops(t, np.ones_like(t)) == 0


def test_first_crossing():
    t = np.arange(5.0)
    assert first_crossing(t, np.array([3, 2, 1, 0, -1.0]), 0.5) == 3.0
    assert np.isnan(first_crossing(t, np.ones(5), 0.5))
