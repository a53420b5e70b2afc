import pytest

from iclab.experiments.linattn import fig11


def test_escape_violations_and_pattern_misses():
    # R = 2, D = 4: new heads may escape M_0 and M_2 only
    good = [[0, 2], [0, 2], [0, 0]]
    assert fig11.escape_violations(good, 2) == 0
    assert fig11.escape_violations([[0, 1], [0, 3]], 2) == 2
    assert fig11.pattern_misses(good, 2, 4) == pytest.approx(1 / 3)  # the third seed has no escape at M_2
    assert fig11.pattern_misses([[0, 3]], 3, 4) == 0.0
    assert fig11.pattern_misses([[0]], 4, 4) == 0.0


def test_config_rejects_bad_ranks():
    with pytest.raises(ValueError, match="ranks"):
        fig11.Fig11Config(ranks=[])
    with pytest.raises(ValueError, match="ranks"):
        fig11.Fig11Config(ranks=[0, 2])
