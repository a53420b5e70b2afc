"""Fuzzed ``--set`` and ``--grid``: random keys, values and grids end in success or in one line of
error with exit code 2, never a traceback, and a rejected config writes nothing.

In process through ``iclab.cli.main``, with linattn.fig1's run, checks and plot replaced by instant
stand-ins (its config class, presets and validation are the real ones), so that accepted configs
cost milliseconds.
"""

import contextlib
import io
import json
import string
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from iclab.cli import main
from iclab.experiments import check_equal, get_experiment

EXP = "linattn.fig1"
FIELDS = list(get_experiment(EXP).config.model_fields)
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Plausible keys and values (mostly valid configs) mixed with arbitrary text (mostly rejected).
plausible = st.one_of(st.integers(1, 64).map(str), st.floats(1e-7, 1.0).map(repr), st.sampled_from(["gd", "gf", "true"]))
keys = st.one_of(st.sampled_from(FIELDS), st.sampled_from(FIELDS), st.text(string.printable, max_size=10),
                 st.text(max_size=6))
json_values = st.one_of(
    st.integers(-(10**6), 10**12), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.lists(st.floats(-2, 2, allow_nan=False), max_size=5), st.sampled_from(["gd", "gf", "linear", "power"]),
)
value_texts = st.one_of(plausible, plausible, json_values.map(json.dumps), st.text(string.printable, max_size=12),
                        st.text(max_size=6))
# Valid values of linattn.fig1's fields, so that a fair share of the fuzzed configs is accepted.
VALID = {"w_init": st.floats(1e-7, 1.0).map(repr), "lr": st.floats(1e-4, 1.0).map(repr),
         "N": st.integers(1, 100).map(str), "H": st.integers(1, 16).map(str), "steps": st.integers(1, 100).map(str),
         "P": st.integers(1, 100).map(str), "record_every": st.integers(1, 10).map(str), "seed": st.integers(0, 99).map(str),
         "population_method": st.sampled_from(["gd", "gf"]), "rotate": st.sampled_from(["true", "false"])}
valid_key = st.sampled_from(sorted(VALID))
valid_assignment = valid_key.flatmap(lambda k: VALID[k].map(lambda v: f"{k}={v}"))
valid_grid = valid_key.flatmap(lambda k: st.lists(VALID[k], min_size=1, max_size=3).map(lambda vs: f"{k}={','.join(vs)}"))
# Non-finite numbers and booleans given for numeric fields: always rejected.
NUMERIC = sorted(k for k in VALID if k not in ("population_method", "rotate"))
bad_numbers = st.tuples(st.sampled_from(NUMERIC + ["eigenvalues"]),
                        st.sampled_from(["NaN", "Infinity", "-Infinity", "true", "false", "[0.4,NaN,0.2,0.1]",
                                         "[0.4,Infinity,0.2,0.1]", "[true,0.3,0.2,0.1]", "1e309"])
                        ).map(lambda kv: f"{kv[0]}={kv[1]}")
assignments = st.one_of(valid_assignment, valid_assignment, valid_assignment, bad_numbers,
                        st.tuples(keys, value_texts).map(lambda kv: f"{kv[0]}={kv[1]}"), st.text(max_size=12))
grid_options = st.one_of(
    valid_grid, valid_grid, valid_grid,
    st.tuples(keys, st.lists(value_texts, min_size=1, max_size=3)).map(lambda kv: f"{kv[0]}={','.join(kv[1])}"),
    st.tuples(keys, st.lists(plausible, min_size=1, max_size=3)).map(lambda kv: f"{kv[0]}={','.join(kv[1])}"),
    st.tuples(keys, st.lists(json_values, min_size=0, max_size=3)).map(lambda kv: f"{kv[0]}={json.dumps(kv[1])}"),
    st.text(max_size=12),
)

@pytest.fixture
def instant(monkeypatch):
    """linattn.fig1 with instant run, checks and plot."""
    exp = get_experiment(EXP)

    def plot(config, arrays):
        from iclab.experiments._plot import figure

        fig, _ = figure(width=1.0, height=1.0)
        return fig

    monkeypatch.setattr(exp, "run", lambda config, reporter: {"x": np.arange(3.0)})
    monkeypatch.setattr(exp, "checks", lambda config, arrays: [check_equal("stand-in", 1, 1)])
    monkeypatch.setattr(exp, "plot", plot)


def call(args: list[str]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)  # an exception escaping here is a traceback: the test fails
    return rc, out.getvalue(), err.getvalue()


def check_outcome(rc: int, err: str, root: Path) -> None:
    event("accepted" if rc == 0 else "rejected")
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
        assert not root.exists() or not any(root.iterdir()), "a rejected config wrote something"
    else:
        stored = list(root.glob(f"{EXP}-*/config.json"))
        assert stored, "an accepted config stored nothing"
        fields = get_experiment(EXP).config.model_fields
        for path in stored:
            for name, value in json.loads(path.read_text())["config"].items():
                values = value if isinstance(value, list) else [value]
                assert all(not isinstance(v, float) or np.isfinite(v) for v in values), (name, value)
                if fields[name].annotation is not bool:
                    assert not any(isinstance(v, bool) for v in values), (name, value)


@FUZZ
@given(sets=st.lists(assignments, max_size=3), seeds=st.one_of(st.none(), st.none(), st.integers(-3, 2000)),
       preset=st.sampled_from(["quick", "quick", "paper", "huge"]))
def test_fuzzed_set_is_success_or_one_line_exit_2(instant, sets, seeds, preset):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "results"
        args = ["run", EXP, "--preset", preset, "--out", str(root)]
        args += [a for s in sets for a in ("--set", s)]
        if seeds is not None:
            args += ["--seeds", str(seeds)]
        rc, _, err = call(args)
        check_outcome(rc, err, root)


@FUZZ
@given(grids=st.lists(grid_options, min_size=1, max_size=2), sets=st.lists(assignments, max_size=1))
def test_fuzzed_grid_is_success_or_one_line_exit_2(instant, grids, sets):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "results"
        args = ["sweep", EXP, "--workers", "1", "--out", str(root)]
        args += [a for g in grids for a in ("--grid", g)]
        args += [a for s in sets for a in ("--set", s)]
        rc, _, err = call(args)
        check_outcome(rc, err, root)
