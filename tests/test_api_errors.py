"""One error model for the Python API: every invalid argument of ``run_experiment``, ``run_sweep``, ``load`` and
``runs`` raises a subclass of :class:`iclab.UserError` with a one-line message, and writes nothing; a bad
``ICLAB_*`` variable is a :class:`iclab.ConfigError` from every entry point (and one line, exit 2, from the
CLI). A hypothesis fuzz test then mixes junk and valid values: every call succeeds or raises a UserError.

Successful calls run ``fuzz.toy``, an experiment registered by this module whose ``run`` returns at once.
"""

import contextlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import iclab
from iclab.cli import main
from iclab.experiments import Experiment, ExperimentConfig, check_abs, param, register, unregister

TOY = "fuzz.toy"


class ToyConfig(ExperimentConfig):
    H: int = param(2, "heads", ge=1, le=8)
    x: float = param(0.5, "a value", ge=0, le=1)


def _run(config, reporter):
    return {"y": np.array([config.x, float(config.H)]), "t": np.arange(3.0)}


def _checks(config, arrays):
    return [check_abs("y[0] is x", float(arrays["y"][0]), config.x, 1e-12)]


def _plot(config, arrays):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.5, 1.5), dpi=40)
    ax.plot(arrays["t"])
    return fig


@pytest.fixture(scope="module", autouse=True)
def toy():
    """``fuzz.toy`` registered for this module only."""
    exp = register(Experiment(id=TOY, title="a toy that returns at once", paper="fuzz", reference="none",
                              config=ToyConfig, presets={"quick": {}, "paper": {"H": 3}}, run=_run, checks=_checks,
                              plot=_plot))
    yield exp
    unregister(TOY)


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def snapshot(top: Path) -> dict:
    """Every entry under ``top`` (not following links): folders, files with their bytes, links with their target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(top))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


@pytest.fixture
def place(tmp_path, monkeypatch):
    """An empty working directory (the default root ``./iclab-results`` would land there) and a results root that
    does not exist yet: a refused call leaves both as they were."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("ICLAB_RESULTS", raising=False)
    yield tmp_path / "store"
    assert not any(cwd.iterdir()), "a refused call wrote into the working directory"


def refused(kind, fn):
    """``fn()`` raises ``kind`` (a UserError) with one line; returns the message."""
    assert issubclass(kind, iclab.UserError)
    with pytest.raises(kind) as err:
        fn()
    message = str(err.value)
    assert message and "\n" not in message, message
    return message


# -- arguments -----------------------------------------------------------------------------------------------

ARGUMENTS = {
    "experiment None": (iclab.ExperimentError, lambda r: iclab.run_experiment(None, root=r)),
    "experiment 3": (iclab.ExperimentError, lambda r: iclab.run_experiment(3, root=r)),
    "overrides a list of pairs": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1", "quick", [("N", 3)],
                                                                                   root=r)),
    "a number given as a string": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1",
                                                                                    overrides={"H": "7"}, root=r)),
    "seeds a string": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1", seeds="3", root=r)),
    "seeds True": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1", seeds=True, root=r)),
    "preset None": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1", preset=None, root=r)),
    "force a string": (iclab.ConfigError, lambda r: iclab.run_experiment("linattn.fig1", force="yes", root=r)),
    "load None": (iclab.StoreError, lambda r: iclab.load(None, root=r)),
    "load True": (iclab.StoreError, lambda r: iclab.load(True, root=r)),
    "load an empty name": (iclab.StoreError, lambda r: iclab.load("", root=r)),
    "load bytes": (iclab.StoreError, lambda r: iclab.load(b"x", root=r)),
    "load ~user of no user": (iclab.StoreError, lambda r: iclab.load("~no-such-user-zz/run", root=r)),
    "a root with a NUL": (iclab.StoreError, lambda r: iclab.runs(root=f"{r}\0x")),
    "run into a root with a NUL": (iclab.StoreError, lambda r: iclab.run_experiment(TOY, root=f"{r}\0x")),
    "load from a root with a NUL": (iclab.StoreError, lambda r: iclab.load(1, root="\0")),
    "runs of an unknown status": (iclab.ConfigError, lambda r: iclab.runs(status="nope", root=r)),
    "runs of a non-str experiment": (iclab.ConfigError, lambda r: iclab.runs(experiment=3, root=r)),
    "sweep grid a list of pairs": (iclab.ConfigError, lambda r: iclab.run_sweep("linattn.fig1", [("H", [1])], root=r)),
    "sweep grid values not a list": (iclab.ConfigError, lambda r: iclab.run_sweep("linattn.fig1", {"H": 1}, root=r)),
}


@pytest.mark.parametrize("case", list(ARGUMENTS))
def test_an_invalid_argument_is_one_line_of_a_user_error_and_writes_nothing(case, place):
    kind, call = ARGUMENTS[case]
    refused(kind, lambda: call(place))
    assert not place.exists()


def test_a_string_for_a_number_is_named_in_the_message(place):
    message = refused(iclab.ConfigError, lambda: iclab.run_experiment("linattn.fig1", overrides={"H": "7"}, root=place))
    assert "H" in message and "string" in message


def test_runs_of_a_root_that_is_a_file_is_a_store_error(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    assert "names a file" in refused(iclab.StoreError, lambda: iclab.runs(root=file))
    assert "lies under the file" in refused(iclab.StoreError, lambda: iclab.runs(root=file / "x"))
    assert file.read_text() == "not a folder"


def test_a_home_of_no_such_user_is_a_path_as_typed_never_a_traceback(place):
    """``~name`` of a user that does not exist stays as typed (as in a shell): a folder that does not exist."""
    root = "~no-such-user-zz/results"
    assert iclab.runs(root=root).empty
    for args in (("runs", "--results", root), ("verify", "--results", root)):
        rc, out, err = cli(*args)
        assert rc == 0 and not err, (args, err)
    assert "no such file" in refused(iclab.ExperimentError, lambda: iclab.run_experiment("~no-such-user-zz/x.py:demo",
                                                                                        root=place))
    assert not place.exists()


# -- a damaged stored run --------------------------------------------------------------------------------------

def _truncate(folder):
    (folder / "metrics.json").write_text((folder / "metrics.json").read_text()[:50])


def _config_list(folder):
    (folder / "config.json").write_text(json.dumps([1, 2, 3]))


DAMAGES = {
    "metrics.json truncated": _truncate,
    "trajectories.npz missing": lambda d: (d / "trajectories.npz").unlink(),
    "trajectories.npz corrupt": lambda d: (d / "trajectories.npz").write_bytes(b"PK\x03\x04" + b"\0" * 60),
    "config.json a JSON list": _config_list,
}


@pytest.fixture
def stored(tmp_path):
    r = iclab.run_experiment(TOY, root=tmp_path / "r")
    assert r.passed and not r.reused
    return r


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_loading_a_damaged_run_is_a_store_error_and_writes_nothing(stored, damage):
    DAMAGES[damage](stored.path)
    root = stored.path.parent
    before = snapshot(root)
    for ref, where in ((stored.path, None), (stored.path.name, root), (1, root)):
        message = refused(iclab.StoreError, lambda: iclab.load(ref, root=where))
        assert "damaged" in message and stored.path.name in message
    assert snapshot(root) == before


@pytest.mark.parametrize("content", [b"PK\x03\x04" + b"\0" * 60, b"\x93NUMPY garbage", b"", b"\x80\x04K\x01."])
def test_a_corrupt_npz_that_passes_its_manifest_is_a_store_error_when_read(stored, content):
    """Anyone can recompute a manifest: a file that matches it may still not be arrays."""
    import hashlib

    npz = stored.path / "trajectories.npz"
    npz.write_bytes(content)
    metrics = json.loads((stored.path / "metrics.json").read_text())
    metrics["artifacts"]["trajectories.npz"] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (stored.path / "metrics.json").write_text(json.dumps(metrics))
    r = iclab.load(stored.path)
    refused(iclab.StoreError, lambda: r.arrays)


# -- the environment ---------------------------------------------------------------------------------------------

BAD_ENVIRONMENT = [("ICLAB_THREADS", "abc"), ("ICLAB_MALLOC", "foo"), ("ICLAB_MEMORY_LIMIT_GB", "-1")]


@pytest.mark.parametrize("var,value", BAD_ENVIRONMENT)
def test_a_bad_variable_is_a_config_error_from_every_entry_point(var, value, place, monkeypatch):
    monkeypatch.setenv(var, value)
    for fn in (lambda: iclab.run_experiment(TOY, root=place),
               lambda: iclab.run_sweep(TOY, {"x": [0.5]}, root=place, workers=1),
               lambda: iclab.load(1, root=place), lambda: iclab.runs(root=place)):
        assert var in refused(iclab.ConfigError, fn)
    assert not place.exists()


@pytest.mark.parametrize("var,value", BAD_ENVIRONMENT)
def test_a_bad_variable_is_one_line_and_exit_2_from_the_cli(var, value, place, monkeypatch):
    monkeypatch.setenv(var, value)
    for args in (("run", TOY, "--out", place), ("sweep", TOY, "--grid", "x=0.5", "--workers", "1", "--out", place),
                 ("runs", "--results", place), ("report", "--results", place, "--out", place / "site"),
                 ("verify", "--results", place), ("export", TOY, "--results", place, "--out", place / "x.csv"),
                 ("index", "rebuild", "--results", place)):
        rc, out, err = cli(*args)
        assert rc == 2 and not out and "Traceback" not in err, (args, err)
        assert err.count("\n") == 1 and var in err, (args, err)
    assert not place.exists()


def test_a_results_root_that_is_a_symbolic_link_loop_is_one_line(tmp_path, monkeypatch):
    os.symlink("loop", tmp_path / "loop")
    monkeypatch.setenv("ICLAB_RESULTS", str(tmp_path / "loop"))
    monkeypatch.chdir(tmp_path)
    for args in (("run", TOY), ("runs",), ("report", "--out", tmp_path / "site"), ("verify",)):
        rc, out, err = cli(*args)
        assert rc == 2 and "Traceback" not in err, (args, err)
        assert err.count("\n") == 1 and "ICLAB_RESULTS" in err and "symbolic link" in err, (args, err)
    for fn in (iclab.runs, lambda: iclab.load(1), lambda: iclab.run_experiment(TOY)):
        assert "symbolic link" in refused(iclab.StoreError, fn)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop"]


# -- fuzz ----------------------------------------------------------------------------------------------------------
#
# Each example is a valid call with a few of its arguments (none, one or two) swapped for junk: the swapped ones
# are refused one line at a time, and the calls left valid run the toy (computed, or reused) to the end.

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.text(max_size=12), st.sampled_from(["", " ", "quick", "..", "../x", "~no-such-user-zz/x", "a\x00b", TOY]),
    st.binary(max_size=8), st.lists(st.integers(-2, 2), max_size=3), st.tuples(st.integers(0, 3)),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2),
)
KEYS = st.one_of(st.sampled_from(["nope", "", "h", "seed"]), st.none(), st.booleans(), st.integers(-2, 2),
                 st.floats(), st.binary(max_size=4), st.tuples(st.integers(0, 2)))
FIELD_VALUES = {"H": st.integers(1, 8), "x": st.floats(0, 1), "seed": st.integers(0, 5), "seeds": st.integers(1, 3)}
VALID_OVERRIDES = st.one_of(st.none(), st.fixed_dictionaries({}, optional=FIELD_VALUES))
BAD_OVERRIDES = st.one_of(JUNK, st.dictionaries(KEYS, JUNK, min_size=1, max_size=2),
                          st.fixed_dictionaries({}, optional=FIELD_VALUES).flatmap(
                              lambda d: st.dictionaries(st.sampled_from(sorted(FIELD_VALUES)), JUNK, min_size=1,
                                                        max_size=2).map(lambda bad: {**d, **bad})))
VALID_GRID = st.dictionaries(st.sampled_from(["x", "H"]), st.lists(st.integers(1, 3), min_size=1, max_size=2),
                             min_size=1, max_size=2)
BAD_GRID = st.one_of(JUNK, st.dictionaries(st.one_of(KEYS, st.sampled_from(["x", "H"])),
                                           st.one_of(JUNK, st.lists(JUNK, max_size=2)), min_size=1, max_size=2))


def _not_a_pool(v) -> bool:
    """Worker counts that start no process pool (a valid count ≥ 2 would: slow)."""
    return not (isinstance(v, int) and not isinstance(v, bool) and v >= 2) and v is not None


@st.composite
def call(draw, valid: dict, junk: dict):
    """Keyword arguments: each valid, except a few (at most two) drawn from ``junk``."""
    swapped = draw(st.sets(st.sampled_from(sorted(junk)), max_size=2))
    kwargs = {name: draw(junk[name] if name in swapped else strategy) for name, strategy in valid.items()}
    return swapped, kwargs


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """Roots to fuzz among: a store holding a run of the toy, a folder to create, a file, a path under a file and
    a symbolic link loop; the working directory and ICLAB_RESULTS point into this folder, never at the repository."""
    top = tmp_path_factory.mktemp("fuzz")
    store = top / "store"
    r = iclab.run_experiment(TOY, root=store)
    (top / "file").write_text("a file")
    os.symlink("loop", top / "loop")
    (top / "cwd").mkdir()
    mp = pytest.MonkeyPatch()
    mp.chdir(top / "cwd")
    mp.setenv("ICLAB_RESULTS", str(store))
    for var in ("ICLAB_THREADS", "ICLAB_MALLOC", "ICLAB_MEMORY_LIMIT_GB", "ICLAB_CHECKPOINT_EVERY",
                "ICLAB_CHECKPOINT_SECONDS"):
        mp.delenv(var, raising=False)
    try:
        yield {"store": store, "run": r.path.name, "valid": [store, str(store), top / "new" / "root", None],
               "invalid": [top / "file", top / "file" / "x", top / "loop", top / "loop" / "x"]}
    finally:
        mp.undo()


def _root(places, kwargs) -> None:
    """Roots are drawn as ("valid" | "invalid", index): the places exist only once the fixture ran."""
    kind, i = kwargs["root"] if isinstance(kwargs["root"], tuple) and len(kwargs["root"]) == 2 and \
        kwargs["root"][0] in ("valid", "invalid") else (None, None)
    if kind is not None:
        kwargs["root"] = places[kind][i % len(places[kind])]


VALID_ROOT = st.tuples(st.just("valid"), st.integers(0, 3))
BAD_ROOT = st.one_of(st.tuples(st.just("invalid"), st.integers(0, 3)), JUNK.filter(lambda v: v is not None))
# FUZZ_N=<n> runs more examples (a longer hunt by hand); the default keeps the file fast.
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_N", 80)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn, kwargs) -> None:
    """Succeeds, or raises a UserError of one line; anything else fails the test."""
    try:
        fn(**kwargs)
    except iclab.UserError as err:
        assert str(err) and "\n" not in str(err), repr(str(err))
        event(f"refused: {type(err).__name__}")
    else:
        event("ran")


RUN_VALID = {"exp_id": st.just(TOY), "preset": st.sampled_from(["quick", "paper"]), "overrides": VALID_OVERRIDES,
             "seeds": st.one_of(st.none(), st.integers(1, 3)), "root": VALID_ROOT, "force": st.booleans(),
             "repair": st.booleans(), "executor": st.none(), "workers": st.none(), "address": st.none(),
             "retries": st.integers(0, 3), "checkpoint_every": st.one_of(st.none(), st.integers(0, 5)),
             "checkpoint_seconds": st.one_of(st.none(), st.floats(0.5, 100))}
RUN_JUNK = {"exp_id": st.one_of(JUNK, st.sampled_from(["linattn.nope", "nope.py:demo", "fuzz", "fuzz.toy "])),
            "preset": st.one_of(JUNK.filter(lambda v: v not in ("quick", "paper")), st.just("nope")),
            "overrides": BAD_OVERRIDES, "seeds": st.one_of(JUNK.filter(lambda v: v is not None), st.integers(-2, 0)),
            "root": BAD_ROOT, "force": JUNK.filter(lambda v: not isinstance(v, bool)),
            "repair": JUNK.filter(lambda v: not isinstance(v, bool)),
            "executor": st.one_of(st.sampled_from(["local", "ray"]), JUNK.filter(lambda v: v is not None)),
            "workers": st.one_of(st.integers(-1, 4), JUNK), "address": st.one_of(st.just("auto"), JUNK),
            "retries": JUNK, "checkpoint_every": JUNK, "checkpoint_seconds": JUNK}


@FUZZ
@given(drawn=call(RUN_VALID, RUN_JUNK))
def test_fuzz_run_experiment(places, drawn):
    _, kwargs = drawn
    _root(places, kwargs)
    _outcome(iclab.run_experiment, kwargs)


@FUZZ
@given(drawn=call({"path_or_id": st.sampled_from(["run", "1", 1, " 1 ", TOY, "fuzz.toy-", "path"]),
                   "root": VALID_ROOT},
                  {"path_or_id": st.one_of(JUNK, st.integers(-1, 99), st.sampled_from(["0", "-1", "99", "f"])),
                   "root": BAD_ROOT}))
def test_fuzz_load(places, drawn):
    _, kwargs = drawn
    _root(places, kwargs)
    ref = kwargs["path_or_id"]
    kwargs["path_or_id"] = places["run"] if ref == "run" else places["store"] / places["run"] if ref == "path" else ref
    _outcome(iclab.load, kwargs)


@FUZZ
@given(drawn=call({"experiment": st.sampled_from([None, TOY, "linattn.fig1"]),
                   "status": st.sampled_from([None, "done", "failed", "running", "interrupted", "diverged"]),
                   "root": VALID_ROOT},
                  {"experiment": JUNK, "status": JUNK, "root": BAD_ROOT}))
def test_fuzz_runs(places, drawn):
    _, kwargs = drawn
    _root(places, kwargs)
    _outcome(iclab.runs, kwargs)


SWEEP_VALID = {"exp_id": st.just(TOY), "grid": VALID_GRID, "preset": st.sampled_from(["quick", "paper"]),
               "overrides": st.one_of(st.none(), st.fixed_dictionaries({}, optional={"seed": st.integers(0, 3)})),
               "seeds": st.one_of(st.none(), st.integers(1, 2)), "root": VALID_ROOT, "executor": st.just("local"),
               "workers": st.just(1), "retries": st.integers(0, 2), "force": st.booleans()}
SWEEP_JUNK = {"exp_id": RUN_JUNK["exp_id"], "grid": BAD_GRID, "preset": RUN_JUNK["preset"], "overrides": BAD_OVERRIDES,
              "seeds": RUN_JUNK["seeds"], "root": BAD_ROOT, "executor": JUNK.filter(lambda v: v != "ray"),
              "workers": JUNK.filter(_not_a_pool), "retries": st.one_of(JUNK, st.integers(-3, -1)),
              "force": RUN_JUNK["force"]}


@FUZZ
@given(drawn=call(SWEEP_VALID, SWEEP_JUNK))
def test_fuzz_run_sweep(places, drawn):
    _, kwargs = drawn
    _root(places, kwargs)
    _outcome(iclab.run_sweep, kwargs)
