import numpy as np

from iclab.experiments.linattn import fig13
from iclab.theory import linattn as theory


def test_eq19_levels_of_the_repeated_spectrum():
    levels = theory.plateau_losses(np.array(fig13.Fig13Config().eigenvalues), 1 / 31)
    assert np.allclose(levels, [1, 0.68873, 0.37746, 0.25720, 0.13694], atol=5e-6)


def test_visited_levels_skips_and_labels():
    levels = np.array([1.0, 0.7, 0.4, 0.25, 0.1])
    t = np.linspace(0, 40, 4001)

    def staircase(steps):
        loss = np.full_like(t, levels[0])
        for t0, m in steps:
            loss = np.where(t > t0, levels[m], loss)
        # smooth sigmoid drops so that −dL/dt has isolated peaks
        return np.convolve(loss, np.ones(41) / 41, mode="same")

    every = staircase([(5, 1), (12, 2), (20, 3), (30, 4)])
    skipped = staircase([(5, 2), (20, 4)])
    visits = fig13.visited_levels(t[50:-50], np.stack([every, skipped])[:, 50:-50], levels)
    assert visits == [[0, 1, 2, 3, 4], [0, 2, 4]]
