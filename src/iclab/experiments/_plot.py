"""One plot style for the whole project: theory dashed, simulation solid, fixed colours."""

from __future__ import annotations

# One colour per model / head / task across every figure of the project.
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MODEL_COLORS = {"ATTN_M": COLORS[0], "MLP": COLORS[1], "ATTN_S": COLORS[2]}
THEORY_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.0}
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
