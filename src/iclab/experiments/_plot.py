"""One plot style for the whole project: theory dashed, simulation solid, baselines thin grey, fixed colours."""

from __future__ import annotations

import numpy as np

# One colour per model / head / task across every figure of the project.
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MODEL_COLORS = {"ATTN_M": COLORS[0], "MLP": COLORS[1], "ATTN_S": COLORS[2]}
THEORY_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.0}
#: Baselines and the theory's algorithm evaluated on held-out prompts (least squares, GD, the Bayes
#: posterior mean, the predictor a paper says its model implements): thin grey solid lines in every figure.
BASELINE_STYLE = {"color": "0.6", "linestyle": "-", "linewidth": 0.8}
TIME_LABEL = "t = Σ lr   (paper time t/τ = 2t)"


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A figure with a grid of axes in the project style (Agg backend: files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # imported here: a reused result needs no plotting

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, constrained_layout=True)
    for ax in axes.flat:
        ax.grid(alpha=0.25)
    return fig, axes


def theory_levels(ax, levels, labels=None) -> None:
    """Dashed horizontal lines at the theory's plateau levels, labelled at the right edge."""
    for i, level in enumerate(levels):
        ax.axhline(level, **THEORY_STYLE, zorder=1)
        if labels is not None:
            ax.annotate(labels[i], xy=(1.0, level), xycoords=("axes fraction", "data"), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=7, color="0.35")


def baseline_lines(ax, x, curves, *, label_at: str = "right") -> None:
    """Baselines as thin grey lines (``BASELINE_STYLE``), each named in small grey text.

    Args:
        ax: the axes.
        x: (K,) abscissae of the curves (unused for scalar levels).
        curves: {name: y}, y a scalar (a horizontal level across the axes) or a (K,) curve over x (NaN: no point).
        label_at: where each name goes: "right" (beside the right edge of the axes, like ``theory_levels``),
            "left" (inside the axes, above the line's left end), "end" (inside, above its last finite point)
            or "none".
    """
    for name, y in curves.items():
        y = np.asarray(y, dtype=float)
        if y.ndim == 0:
            ax.axhline(float(y), **BASELINE_STYLE, zorder=1)
            ends = {"left": (0.0, float(y)), "right": (1.0, float(y)), "end": (1.0, float(y))}
            coords = ("axes fraction", "data")
        else:
            xs = np.asarray(x, dtype=float)
            ax.plot(xs, y, **BASELINE_STYLE, zorder=1)
            finite = np.nonzero(np.isfinite(y))[0]
            if finite.size == 0:
                continue
            first, last = finite[0], finite[-1]
            ends = {"left": (xs[first], y[first]), "right": (1.0, y[last]), "end": (xs[last], y[last])}
            coords = ("axes fraction" if label_at == "right" else "data", "data")
        if label_at == "none" or not np.isfinite(ends[label_at][1]):
            continue
        offset, ha, va = {"right": ((3, 0), "left", "center"), "left": ((2, 1), "left", "bottom"),
                          "end": ((-2, 1), "right", "bottom")}[label_at]
        ax.annotate(name, xy=ends[label_at], xycoords=coords, xytext=offset, textcoords="offset points", ha=ha,
                    va=va, fontsize=6, color=BASELINE_STYLE["color"])
