"""linattn Fig 12: the Fig 4 rank sweep at R = 3, 5, 6, 7 (config only; the logic is tested with Fig 4)."""

import pytest

from iclab.experiments.linattn import _rank_sweep, fig12


def test_fig12_config_is_the_sweep_at_ranks_3_5_6_7():
    config = fig12.Fig12Config()
    assert config.ranks == [3, 5, 6, 7]
    assert config.model_dump(exclude={"ranks"}) == _rank_sweep.RankSweepConfig().model_dump(exclude={"ranks"})
    with pytest.raises(ValueError, match="R·H"):
        fig12.Fig12Config(H=2)  # R = 3: 3·2 < D = 8
