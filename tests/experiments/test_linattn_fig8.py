"""linattn Fig 8: checks on synthetic curves (one drop vs several) and config validation."""

import numpy as np
import pytest

from iclab.experiments.linattn import fig8
from iclab.tasks.linreg import spectrum_eigenvalues
from iclab.theory import linattn as theory

LAM = spectrum_eigenvalues("inverse", 8)
LEVELS = theory.plateau_losses(LAM, 1.0 / 127)


def sigmoid_steps(t, levels, times, width):
    """A loss falling from levels[0] through levels[1:] with a sigmoid drop at each of ``times``."""
    loss = np.full_like(t, levels[0])
    for (a, b), t0 in zip(zip(levels[:-1], levels[1:]), times):
        loss -= (a - b) / (1.0 + np.exp(-(t - t0) / width))
    return loss


def arrays(m_drops, s_drops):
    t_m, t_s = np.linspace(0, 800, 1601), np.linspace(0, 8000, 1601)
    m = sigmoid_steps(t_m, np.linspace(LEVELS[0], LEVELS[-1], m_drops + 1), np.linspace(100, 400, m_drops), 5.0)
    s = sigmoid_steps(t_s, list(LEVELS[: s_drops]) + [LEVELS[-1]], np.linspace(200, 6000, s_drops), 20.0)
    out = {"t_m": t_m, "t_s": t_s, "eigenvalues": LAM, "plateau_levels": LEVELS}
    for H in (9, 1):
        out[f"loss_M{H}"] = out[f"pop_M{H}"] = np.stack([m, m])
    for R in (1, 2):
        out[f"loss_S{R}"] = out[f"pop_S{R}"] = np.stack([s, s])
    return out


def test_checks_pass_when_attn_m_drops_once_and_attn_s_steps_down_the_eq19_levels():
    checks = fig8.checks_fig8(fig8.Fig8Config(seeds=2), arrays(1, 8))
    assert len(checks) == 12 and all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]


def test_checks_fail_when_attn_m_drops_twice_or_attn_s_once():
    failed = [c.name for c in fig8.checks_fig8(fig8.Fig8Config(seeds=2), arrays(2, 1)) if not c.passed]
    assert sum("one drop" in n for n in failed) == 2 and sum("several drops" in n for n in failed) == 2


def test_config_validation():
    with pytest.raises(ValueError, match="R·H_s"):
        fig8.Fig8Config(ranks_s=[1], H_s=4)
    with pytest.raises(ValueError, match="distinct"):
        fig8.Fig8Config(heads_m=[9, 9])
    config = fig8.Fig8Config()
    assert config.N == 127 and config.spectrum == "inverse" and config.lr_s == pytest.approx(0.02 * 127 ** (2 / 3))
