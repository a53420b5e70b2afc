"""The project-wide baseline style: thin grey lines, named in grey text."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from iclab.experiments._plot import BASELINE_STYLE, THEORY_STYLE, baseline_lines, figure

matplotlib.use("Agg")


@pytest.mark.parametrize("label_at", ["right", "left", "end", "none"])
def test_baseline_lines_draw_levels_and_curves_in_the_baseline_style(label_at):
    fig, axes = figure()
    ax = axes[0, 0]
    x = np.arange(4.0)
    baseline_lines(ax, x, {"level": 0.5, "curve": np.array([np.nan, 1.0, 0.8, 0.6])}, label_at=label_at)
    lines = ax.get_lines()
    assert len(lines) == 2
    for line in lines:
        assert matplotlib.colors.same_color(line.get_color(), BASELINE_STYLE["color"])
        assert line.get_linewidth() == BASELINE_STYLE["linewidth"] and line.get_linestyle() == "-"
    texts = [t.get_text() for t in ax.texts]
    assert texts == ([] if label_at == "none" else ["level", "curve"])
    # thinner than the theory's dashed lines and greyer than any model colour
    assert BASELINE_STYLE["linewidth"] < THEORY_STYLE["linewidth"]
    plt.close(fig)


def test_baseline_lines_skip_the_name_of_an_all_nan_curve():
    fig, axes = figure()
    baseline_lines(axes[0, 0], np.arange(3.0), {"empty": np.full(3, np.nan)}, label_at="end")
    assert len(axes[0, 0].texts) == 0 and len(axes[0, 0].get_lines()) == 1
    plt.close(fig)
