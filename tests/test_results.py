"""Results as objects (run_experiment, iclab.load, iclab.runs) and experiments defined in a user's file."""

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

import iclab
from iclab.cli import main
from iclab.errors import StoreError
from iclab.launch import UserError

FIXTURE = Path(__file__).parent / "fixtures" / "user_experiment.py"
DEMO = f"{FIXTURE}:demo"


@pytest.fixture(scope="module", autouse=True)
def _forget_the_demo():
    """The demo registers itself when loaded: leave the registry as the other test modules expect it."""
    yield
    from iclab.experiments import unregister

    unregister("user.demo")


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """A store holding one run of the user's demo experiment, made through the CLI."""
    root = tmp_path_factory.mktemp("user-results")
    rc, out, err = cli("run", DEMO, "--out", str(root), "--json")
    assert rc == 0, err
    return root, json.loads(out)


def test_a_user_file_runs_end_to_end_with_store_checks_and_report(demo_root):
    root, result = demo_root
    assert result["experiment"] == "user.demo" and result["passed"] and len(result["checks"]) == 1
    folder = Path(result["path"])
    stored = json.loads((folder / "config.json").read_text())
    assert stored["source"] == f"{FIXTURE.resolve()}:demo"
    assert (folder / "figure.png").stat().st_size > 0
    # a second run reuses the stored result
    rc, out, _ = cli("run", DEMO, "--out", str(root), "--json")
    assert rc == 0 and json.loads(out)["reused"]
    rc, out, err = cli("report", "--results", str(root))
    assert rc == 0, err
    page = (root / "report" / "user.demo-quick" / "index.html").read_text()
    assert "ATTN_M on a 3-d covariance" in page  # the title, from the user's file
    assert f"iclab run {FIXTURE.resolve()}:demo --preset quick" in page
    rc, out, _ = cli("show", DEMO)
    assert rc == 0 and "user.demo" in out and "eigenvalues" in out


@pytest.mark.parametrize("ref,message", [
    ("tests/fixtures/no_such_file.py:demo", "no such file"),
    (f"{FIXTURE}:missing", "defines no 'missing'; experiments in it: demo"),
    (f"{FIXTURE}:not_an_experiment", "is a int, not an iclab Experiment"),
    (f"{FIXTURE}:1bad", "NAME a Python identifier"),
])
def test_a_bad_user_reference_is_one_line_and_exit_2(ref, message, tmp_path):
    rc, out, err = cli("run", ref, "--out", str(tmp_path))
    assert rc == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_user_file_that_fails_to_import_is_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import numpy\nraise RuntimeError('boom\\nsecond line')\n")
    rc, _, err = cli("run", f"{bad}:demo", "--out", str(tmp_path / "r"))
    assert rc == 2 and err.count("\n") == 1 and "RuntimeError: boom second line" in err


def test_run_experiment_returns_arrays_checks_and_a_figure(demo_root, tmp_path):
    root, _ = demo_root
    r = iclab.run_experiment(DEMO, "quick", {"H": 3}, root=tmp_path)
    assert r.passed and not r.reused and r.source.endswith("user_experiment.py:demo")
    assert r.arrays["loss"].shape[-1] == r.arrays["t"].shape[0]
    np.testing.assert_array_equal(r.arrays["loss"], np.load(r.path / "trajectories.npz")["loss"])
    assert r.config_model().H == 3
    fig = r.figure()
    assert fig.axes and len(fig.axes[0].lines) >= 2


def test_load_reopens_a_run_by_path_name_hash_prefix_and_index_id(demo_root):
    root, result = demo_root
    path = Path(result["path"])
    by_path = iclab.load(path)
    by_name = iclab.load(path.name, root=root)
    by_hash = iclab.load(path.name.rsplit("-", 1)[1][:8], root=root)
    df = iclab.runs(root=root)
    by_id = iclab.load(int(df.loc[df.path == str(path), "id"].iloc[0]), root=root)
    for r in (by_path, by_name, by_hash, by_id):
        assert r.path == path and r.experiment == "user.demo" and r.reused
        assert r.checks == result["checks"]
        np.testing.assert_array_equal(r.arrays["loss"], by_path.arrays["loss"])
    with pytest.raises(UserError, match="no stored run"):
        iclab.load("nothing-like-this", root=root)


def test_an_all_digit_run_key_prefix_is_found_as_well_as_an_index_id(tmp_path):
    # a run key's hex prefix can be all digits (a 2 % chance for 8 of them): it names its run unless an index id
    # names another one too, which is refused as ambiguous
    from iclab.results import _run_folder

    class Store:  # the two listings _run_folder reads
        root = tmp_path

        def rows(self):
            return [{"id": 9, "run_dir": "user.demo-1234abcd00000000"}, {"id": 7, "run_dir": "user.demo-98914582aa"}]

        def folders(self):
            return [tmp_path / r["run_dir"] for r in self.rows()]

    store = Store()
    assert _run_folder("98914582", store) == tmp_path / "user.demo-98914582aa"   # by key prefix
    assert _run_folder(" 7 ", store) == tmp_path / "user.demo-98914582aa"        # by index id
    assert _run_folder(9, store) == tmp_path / "user.demo-1234abcd00000000"  # an int is an index id only
    assert _run_folder("1234", store) == tmp_path / "user.demo-1234abcd00000000"
    with pytest.raises(StoreError, match="names 2 runs"):
        _run_folder("9", store)  # index id 9 and the key prefix 9 of the other run
    with pytest.raises(StoreError, match="no run with index id or run-key prefix 5"):
        _run_folder("5", store)
    with pytest.raises(StoreError, match="no run with index id 5"):
        _run_folder(5, store)


def test_runs_is_a_dataframe_of_the_index(demo_root, tmp_path):
    root, result = demo_root
    df = iclab.runs(root=root)
    assert {"id", "experiment", "status", "checks_passed", "path", "config", "config.eigenvalues"} <= set(df.columns)
    row = df.loc[df.path == result["path"]].iloc[0]
    assert row.status == "done" and row.checks_passed == 1 and row["config.N"] == 15
    assert json.loads(row["config.eigenvalues"]) == [0.5, 0.3, 0.2]
    assert str(df.started.dtype).startswith("datetime64")
    assert len(iclab.runs(experiment="linattn.fig1", root=root)) == 0
    empty = iclab.runs(root=tmp_path)
    assert empty.empty and "experiment" in empty.columns
