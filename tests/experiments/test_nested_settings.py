"""A config holding a settings object whole (``nested``): its fields named with a dot wherever a user names a field
(``--set``, presets, sweep grids, ``iclab show``, export columns, the report's reproduce command), its bounds and
validators refused in those names, and the settings class's instance passed on."""

from __future__ import annotations

import contextlib
import csv
import io
import json

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from iclab.cli import main
from iclab.errors import ConfigError, describe_validation_error
from iclab.experiments import (Experiment, ExperimentConfig, check_abs, nested, param, register, setting,
                               unregister)
from iclab.experiments._config import field_rows
from iclab.fields import flat_config, flat_fields
from iclab.runner import resolve_config
from iclab.sweep import plan_sweep

TOY = "user.nested_toy"


class Pair(BaseModel):
    """A toy model's settings: a validator relates two fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    width: int = Field(8, ge=1, le=1024, description="residual width (a multiple of heads)")
    heads: int = Field(2, ge=1, le=64, description="heads")
    depth: int = Field(3, ge=1, le=64, description="blocks")
    scale: float = Field(0.1, gt=0, le=10, description="init std")

    @model_validator(mode="after")
    def _divides(self):
        if self.width % self.heads:
            raise ValueError(f"width must be a multiple of heads = {self.heads} (got {self.width})")
        return self


class ToyConfig(ExperimentConfig):
    D: int = param(2, "input dimension", ge=1, le=16)
    toy: Pair = nested(Pair, "the toy model", width=setting(12, paper=64, paper_note="the paper's"),
                       heads=setting(3), depth=setting(2, le=8))


def _run(config, reporter):
    t = config.toy
    assert type(t).__name__ == "Pair" and isinstance(t, Pair)   # the settings class's instance, passed on whole
    return {"y": np.array([float(t.width), float(t.heads), float(t.depth)])}


def _checks(config, arrays):
    return [check_abs("width stored", float(arrays["y"][0]), float(config.toy.width), 0.0)]


def _plot(config, arrays):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.5, 1.5), dpi=40)
    ax.plot(arrays["y"])
    return fig


@pytest.fixture(scope="module", autouse=True)
def toy():
    exp = register(Experiment(id=TOY, title="a toy holding its model's settings whole", paper="user",
                              reference="none", config=ToyConfig,
                              presets={"quick": {"toy.depth": 4}, "paper": {"toy": {"width": 64, "heads": 4, "depth": 6}}},
                              grid={"toy.width": [6, 12]}, run=_run, checks=_checks, plot=_plot))
    yield exp
    unregister(TOY)


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def refusal(**values) -> str:
    with pytest.raises(ValidationError) as err:
        ToyConfig(**values)
    return describe_validation_error(err.value, ToyConfig)


def test_a_nested_group_holds_the_settings_class_with_the_configs_defaults_and_narrowing():
    c = ToyConfig()
    assert isinstance(c.toy, Pair) and c.toy == Pair(width=12, heads=3, depth=2, scale=0.1)
    assert c.model_dump(mode="json")["toy"] == {"width": 12, "heads": 3, "depth": 2, "scale": 0.1}
    # dotted names, the group as a dict, or a Pair: the same config
    assert ToyConfig(**{"toy.width": 6}).toy.width == 6
    assert ToyConfig(toy={"width": 6}) == ToyConfig(**{"toy.width": 6}) == ToyConfig(toy=Pair(width=6, heads=3, depth=2))
    # one line in the dotted names: bounds (narrowed by the config), the class's validator, unknown and wrong-typed
    assert refusal(**{"toy.depth": 9}) == "toy.depth must be ≥ 1 and ≤ 8 (got 9)"
    assert refusal(**{"toy.width": 13}) == "toy.width must be a multiple of toy.heads = 3 (got 13)"
    assert refusal(**{"toy.wide": 1}).startswith("unknown field 'toy.wide'; allowed fields: toy.width, toy.heads, ")
    assert "toy.depth" in refusal(nope=1)
    assert refusal(width=6).startswith("unknown field 'width' (did you mean toy.width?); allowed fields: seed, ")
    assert refusal(**{"toy.heads": True}).startswith("toy.heads must be a number, not a boolean")
    assert refusal(**{"toy.scale": "0.2"}).startswith("toy.scale must be a number, not a string")
    assert refusal(**{"Q.width": 1}).startswith("unknown field 'Q.width'")
    # a subclass re-declares the group: the base's narrowing and defaults stay, narrowed further
    class Deeper(ToyConfig):
        toy: Pair = nested(Pair, "the toy model, deeper", depth=setting(5, le=6))

    assert Deeper().toy == Pair(width=12, heads=3, depth=5)
    with pytest.raises(TypeError, match="wider"):
        class Wider(ToyConfig):
            toy: Pair = nested(Pair, "wider", depth=setting(5, le=20))
    with pytest.raises(TypeError, match="declared as Pair"):
        class Mistyped(ExperimentConfig):
            toy: int = nested(Pair, "mistyped")
    with pytest.raises(TypeError, match="not a field of Pair"):
        nested(Pair, "typo", widht=setting(3))


def test_dotted_names_reach_every_place_a_user_names_a_field(tmp_path):
    # presets and overrides merge field by field: the preset's depth stays when --set gives the width
    _, config = resolve_config(TOY, "quick", {"toy.width": 6})
    assert config.toy == Pair(width=6, heads=3, depth=4)
    _, config = resolve_config(TOY, "paper", {"toy.heads": 2})
    assert config.toy == Pair(width=64, heads=2, depth=6)
    with pytest.raises(ConfigError, match=rf"^{TOY}: toy.width must be a multiple of toy.heads = 3 \(got 7\)$"):
        resolve_config(TOY, "quick", {"toy.width": 7})
    # iclab show / field_rows: one row per field of the group, with its presets and paper value
    rows = {r["name"]: r for r in field_rows(ToyConfig, {"quick": {"toy.depth": 4}, "paper": {"toy": {"width": 64, "heads": 4}}})}
    assert list(rows) == ["seed", "seeds", "D", "toy.width", "toy.heads", "toy.depth", "toy.scale"] == list(flat_fields(ToyConfig))
    assert rows["toy.width"]["paper_value"] == 64 and rows["toy.width"]["presets"] == {"quick": 12, "paper": 64}
    assert rows["toy.depth"]["bounds"] == "≥ 1, ≤ 8" and rows["toy.depth"]["presets"]["quick"] == 4
    assert rows["toy.scale"]["group"] == {"name": "toy", "type": "Pair", "description": "the toy model"}
    assert "group" not in rows["D"]
    # a sweep grid keyed by a dotted name
    _, points = plan_sweep(TOY, {"toy.width": [6, 9]}, "quick", {"toy.heads": 3})
    assert [p.values for p in points] == [{"toy.width": 6}, {"toy.width": 9}]
    # the CLI: run with --set, the bad value's one line and exit 2, the export's columns, the report's command
    root = tmp_path / "results"
    rc, out, err = cli("run", TOY, "--set", "toy.width=6", "--out", root)
    assert rc == 0, err
    rc, out, err = cli("run", TOY, "--set", "toy.width=7", "--out", root)
    assert rc == 2 and err.strip().splitlines()[-1].endswith("toy.width must be a multiple of toy.heads = 3 (got 7)")
    rc, out, err = cli("export", TOY, "--results", root, "--out", tmp_path / "toy.csv")
    assert rc == 0, err
    with (tmp_path / "toy.csv").open() as fh:
        (row,) = list(csv.DictReader(fh))
    assert (row["config.toy.width"], row["config.toy.depth"], row["config.D"]) == ("6", "4", "2")
    rc, out, err = cli("report", "--results", root, "--out", tmp_path / "site")
    assert rc == 0, err
    page = next((tmp_path / "site").glob("*/index.html")).read_text()
    assert f"iclab run {TOY} --preset quick --set toy.width=6" in page and "<code>toy.depth</code>" in page


def test_flat_config_spreads_only_groups_named_in_the_recorded_fields():
    stored = {"D": 2, "toy": {"width": 6, "heads": 3}, "strengths": {"a": [0.1]}}
    assert flat_config(stored, ["D", "toy.width", "toy.heads"]) == {"D": 2, "toy.width": 6, "toy.heads": 3,
                                                                    "strengths": {"a": [0.1]}}
    assert flat_config(stored, []) == stored   # no recorded names (an experiment this code does not define)
    assert json.loads(json.dumps(flat_config(stored, ["toy.width"]))) == stored   # a partial match is kept whole


def test_the_registry_refuses_a_grid_key_that_names_no_field():
    with pytest.raises(ValueError, match="grid entry 'toy.wide'"):
        register(Experiment(id="user.nested_bad", title="t", paper="user", reference="none", config=ToyConfig,
                            presets={"quick": {}, "paper": {}}, grid={"toy.wide": [1]}, run=_run,
                            checks=_checks, plot=_plot))
