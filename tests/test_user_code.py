"""A user's experiment that breaks its contract or raises: one sentence, the failure recorded, no traceback.

``run`` must return a dict of numeric arrays, ``checks`` a list of Check, ``plot`` a matplotlib Figure: a
wrong type is one line naming the function and what it must return (exit 2). An exception inside the
user's code is recorded as ``failed`` with its traceback in the run folder's ``error.txt`` and one line
pointing at it (exit 3); a failed run is never reused: the same code runs again (and replaces the failed
folder when it succeeds).
"""

import contextlib
import io
import json
import textwrap
from pathlib import Path

import pytest

import iclab
from iclab.cli import main
from iclab.experiments import unregister

TEMPLATE = textwrap.dedent('''
    import numpy as np
    from iclab.experiments import Experiment, ExperimentConfig, check_abs, param


    class Config(ExperimentConfig):
        scale: float = param(1.0, "a scale", gt=0)


    def run(config, reporter):
        RUN


    def checks(config, arrays):
        CHECKS


    def plot(config, arrays):
        PLOT


    demo = Experiment(id="usercode.toy", title="a toy", paper="user", reference="none", config=Config,
                      presets={"quick": {}, "paper": {}}, run=run, checks=checks, plot=plot)
''')
GOOD = {"RUN": 'return {"x": np.arange(3.0) * config.scale}',
        "CHECKS": 'return [check_abs("x sums to 3", float(arrays["x"].sum()), 3.0, 1e-12)]',
        "PLOT": "import matplotlib.pyplot as plt\n    fig, ax = plt.subplots()\n    ax.plot(arrays['x'])\n"
                "    return fig"}


@pytest.fixture(autouse=True)
def _forget():
    yield
    unregister("usercode.toy")


def write(tmp_path: Path, **parts) -> str:
    text = TEMPLATE
    for name, body in {**GOOD, **parts}.items():
        text = text.replace(name, body)
    path = tmp_path / "toy.py"
    path.write_text(text)
    return f"{path}:demo"


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def index(root: Path) -> list[tuple]:
    rc, out, err = cli("runs", "--results", root, "--json")
    assert rc == 0, err
    return [(r["status"], r["error"]) for r in json.loads(out)]


@pytest.mark.parametrize("part,body,sentence", [
    ("RUN", "return [1.0, 2.0]", "run(config, reporter) must return a dict of numeric arrays by name (str -> numpy "
                                 "array); it returned list"),
    ("RUN", "return None", "it returned NoneType"),
    ("RUN", 'return {"x": np.array([object(), 1], dtype=object)}', "'x' has dtype object (object arrays are refused"),
    ("RUN", 'return {"x": [[1.0], [1.0, 2.0]]}', "'x' is not an array"),
    ("CHECKS", 'return "all good"', "checks(config, arrays) must return a list of iclab.experiments.Check"),
    ("CHECKS", "return [True]", "it returned a list holding bool"),
    ("PLOT", "return None", "plot(config, arrays) must return a matplotlib Figure"),
])
def test_a_wrong_return_type_is_one_sentence_and_recorded_failed(tmp_path, part, body, sentence):
    ref = write(tmp_path, **{part: body})
    rc, out, err = cli("run", ref, "--out", tmp_path / "r")
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err and sentence in lines[0], err
    assert lines[0].startswith("error: usercode.toy: ")
    [(status, error)] = index(tmp_path / "r")
    assert status == "failed" and sentence in error
    [folder] = (tmp_path / "r").glob("usercode.toy-*")
    assert sentence in (folder / "error.txt").read_text()
    assert not (folder / "trajectories.npz").exists()


def test_an_exception_in_user_code_is_recorded_with_its_traceback_and_exits_3(tmp_path):
    ref = write(tmp_path, RUN='raise ValueError("the data file is missing\\nsecond line")')
    rc, out, err = cli("run", ref, "--out", tmp_path / "r")
    assert rc == 3, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    [folder] = (tmp_path / "r").glob("usercode.toy-*")
    assert lines[0] == (f"error: usercode.toy failed: run(config, reporter) raised ValueError: the data file is "
                        f"missing second line (its traceback: {folder / 'error.txt'})")
    trace = (folder / "error.txt").read_text()
    assert trace.startswith("Traceback") and "toy.py" in trace and 'raise ValueError("the data file' in trace
    assert index(tmp_path / "r") == [("failed", "run(config, reporter) raised ValueError: the data file is missing "
                                                "second line")]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["checks"] == [] and set(metrics["artifacts"]) == {
        "config.json", "error.txt", "log.txt"}
    rc, out, _ = cli("verify", "--results", tmp_path / "r")
    assert rc == 0 and "1 of 1 stored runs intact" in out
    # the Python API raises RunFailed with the same line, and the failed run is not reused
    with pytest.raises(iclab.RunFailed, match="raised ValueError") as info:
        iclab.run_experiment(ref, root=tmp_path / "r")
    assert info.value.error_file == folder / "error.txt"
    # fixed, the file is other code: a run of its own, the failed folder stays as the failure's record
    ref = write(tmp_path)
    rc, out, err = cli("run", ref, "--out", tmp_path / "r", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["passed"] and not result["reused"]
    assert sorted(s for s, _ in index(tmp_path / "r")) == ["done", "failed", "failed"]
    assert Path(result["path"]) != folder and (folder / "error.txt").is_file()


def test_an_exception_in_checks_or_plot_names_the_function(tmp_path):
    ref = write(tmp_path, PLOT="return 1 / 0")
    rc, _, err = cli("run", ref, "--out", tmp_path / "r")
    assert rc == 3 and "plot(config, arrays) raised ZeroDivisionError: division by zero" in err


def test_a_built_in_experiment_that_raises_keeps_its_traceback(tmp_path, monkeypatch):
    """An exception of iclab's own experiment is a bug of ours: it propagates as it is (recorded as failed)."""
    from iclab.experiments import get_experiment

    exp = get_experiment("linattn.fig1")

    def broken(config, reporter):
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(exp, "run", broken)
    monkeypatch.setattr(type(exp), "builtin", property(lambda self: True))
    with pytest.raises(RuntimeError, match="a bug of ours"):
        iclab.run_experiment("linattn.fig1", root=tmp_path)
    [folder] = tmp_path.glob("linattn.fig1-*")
    assert "a bug of ours" in (folder / "error.txt").read_text()


def test_a_failed_run_of_the_same_code_is_computed_again_and_replaced(tmp_path, monkeypatch):
    flag = tmp_path / "data-ready"
    monkeypatch.setenv("TOY_FLAG", str(flag))
    ref = write(tmp_path, RUN='import os\n    if not os.path.exists(os.environ["TOY_FLAG"]):\n'
                              '        raise FileNotFoundError("no data yet")\n    return {"x": np.arange(3.0)}')
    rc, _, err = cli("run", ref, "--out", tmp_path / "r")
    assert rc == 3 and "no data yet" in err
    [failed] = (tmp_path / "r").glob("usercode.toy-*")
    flag.write_text("")
    rc, out, err = cli("run", ref, "--out", tmp_path / "r", "--json")
    assert rc == 0, err
    assert json.loads(out)["path"] == str(failed)  # the same code and config: the same folder, now done
    assert not (failed / "error.txt").exists()
    assert json.loads((failed / "metrics.json").read_text())["status"] == "done"
