"""linattn Fig 12: the Fig 4 rank sweep at R = 3, 5, 6, 7 (same run, checks and plot)."""

from __future__ import annotations

from iclab.engines.linreg import LinregSettings
from iclab.experiments._config import engine_grid
from iclab.experiments import Experiment, register
from iclab.experiments.linattn._common import PAPER
from iclab.experiments.linattn._rank_sweep import (
    NOTES, QUICK, RankSweepConfig, checks_rank_sweep, plot_rank_sweep, rank_sweep_memory, run_rank_sweep,
)


class Fig12Config(RankSweepConfig):
    ranks: list[int] = engine_grid(LinregSettings, "R", [3, 5, 6, 7],
                                   "ranks R of the key and query of each head, one panel each",
                                   paper=[3, 5, 6, 7], paper_note="Fig 12 (Fig 4: 1, 2, 4, 8)")


register(
    Experiment(
        id="linattn.fig12",
        title="ATTN_S of rank R = 3, 5, 6, 7 (D = 8): conspicuous plateaus only at L(M_m) with R | m",
        paper=PAPER,
        reference="Fig 12 (App F); Sec 5 (rank R), eq 19 (plateau losses)",
        config=Fig12Config,
        presets={"quick": dict(QUICK), "paper": {}},
        run=run_rank_sweep,
        checks=checks_rank_sweep,
        plot=plot_rank_sweep,
        memory=rank_sweep_memory,
        notes=NOTES,
    )
)
