"""gating.optimum (theory only): small configs through run -> checks -> plot, and checks that can fail."""

from functools import lru_cache

import matplotlib
import numpy as np
import pytest
from pydantic import ValidationError

from iclab.experiments.gating import optimum
from iclab.progress import Reporter

matplotlib.use("Agg")


@lru_cache(maxsize=1)
def _paper_setting():
    cfg = optimum.OptimumConfig(n_bars=[0, 1, 5, 10, 20, 50], bfgs_n_bars=[1], bfgs_restarts=1)
    return cfg, optimum.run_optimum(cfg, Reporter())


def test_paper_setting_reproduces_the_spec_table():
    cfg, r = _paper_setting()
    checks = optimum.checks_optimum(cfg, r)
    assert checks[0].name.startswith("reference table")
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]
    assert np.allclose(r["wpgd"][:, 0], 1) and np.allclose(r["att"][:, 0], 1)  # n̄ = 0: ŷ = 0
    assert len(optimum.plot_optimum(cfg, r).axes) == 2


def test_a_wrong_table_value_fails_the_table_check(monkeypatch):
    cfg, r = _paper_setting()
    wrong = dict(optimum.TABLE_WPGD)
    wrong[(0.0, 1.0)] = (0.9167, 0.6875, 0.5238, 0.3548, 0.1813)  # last entry off by 1e-3
    monkeypatch.setattr(optimum, "TABLE_WPGD", wrong)
    assert not optimum.checks_optimum(cfg, r)[0].passed


def test_general_sigma_and_three_tasks():
    # K = 3 with the relevant task in the middle: scalar gating lies strictly between eq 17 and eq 24 (derived here)
    cfg = optimum.OptimumConfig(d=3, Sigma_eigenvalues=[2.0, 1.0, 0.5], sigma2=0.1,
                                task_R=np.eye(3).tolist(), task_rs=[[0.2, 0.8, 0.3]], n_bars=[0, 2, 4],
                                bfgs_n_bars=[2], bfgs_restarts=2)
    r = optimum.run_optimum(cfg, Reporter())
    assert "eq17" not in r  # the Σ = I closed forms are not drawn for a general Σ
    checks = optimum.checks_optimum(cfg, r)
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks if not c.passed]
    assert np.all(r["wpgd"][0, 1:] < r["scalar"][0, 1:] - 1e-6) and np.all(r["scalar"][0, 1:] < r["att"][0, 1:] - 1e-6)


def test_ordering_check_fails_when_an_optimum_is_not_nested():
    cfg = optimum.OptimumConfig(d=3, task_rs=[[0.8, 0.2]], n_bars=[0, 2], bfgs_n_bars=[2], bfgs_restarts=1)
    r = optimum.run_optimum(cfg, Reporter())
    r["scalar"] = r["scalar"].copy()
    r["scalar"][0, 1] = r["wpgd"][0, 1] - 1e-3
    failed = [c.name for c in optimum.checks_optimum(cfg, r) if not c.passed]
    assert "wpgd ≤ scalar at every n̄ (max excess)" in failed


@pytest.mark.parametrize("bad", [{"task_rs": [[0.9, 0.9]]}, {"bfgs_n_bars": [70]}, {"Sigma_eigenvalues": [1.0]}])
def test_invalid_settings_are_rejected(bad):
    with pytest.raises(ValidationError):
        optimum.OptimumConfig(**bad)
