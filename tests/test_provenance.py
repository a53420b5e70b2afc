"""The run key knows the code: iclab.provenance's code identity and the key built from it."""

import json
import shutil
import textwrap
from pathlib import Path

import pytest

import iclab
from iclab import provenance
from iclab.experiments import get_experiment
from iclab.provenance import code_identity, config_key, describe_change, run_key

FIXTURE = Path(__file__).parent / "fixtures" / "user_experiment.py"

BASE = dict(experiment_id="x.fig1", config={"D": 4, "N": 31}, version="0.1.0", code="0123456789abcdef",
            backend="native")


def key(**change):
    args = dict(BASE, **change)
    return run_key(args["experiment_id"], args["config"], version=args["version"], code=args["code"],
                   backend=args["backend"])


def test_run_key_depends_on_each_of_its_inputs_and_not_on_key_order():
    a = key()
    assert len(a) == 16 and int(a, 16) >= 0
    assert a == key(config={"N": 31, "D": 4})
    others = [key(experiment_id="x.fig2"), key(config={"D": 4, "N": 32}), key(version="0.1.1"),
              key(code="0123456789abcdee"), key(backend="xla")]
    assert len({a, *others}) == 6  # every input moves the key


def test_config_key_ignores_the_code_and_the_version():
    assert config_key("x.fig1", {"D": 4, "N": 31}) == config_key("x.fig1", {"N": 31, "D": 4})
    assert config_key("x.fig1", {"D": 4}) != config_key("x.fig2", {"D": 4})
    assert config_key("x.fig1", {"D": 4}) != config_key("x.fig1", {"D": 5})


def test_a_builtin_experiment_covers_the_files_it_imports_and_no_other():
    ident = code_identity(get_experiment("linattn.fig1"))
    files = set(ident["files"])
    # its own module, the shared experiment code, and the engines, models, tasks and theory it trains through
    for needed in ("iclab/experiments/linattn/fig1.py", "iclab/experiments/linattn/_common.py",
                   "iclab/experiments/checks.py", "iclab/engines/linreg.py", "iclab/theory/linattn.py",
                   "iclab/__init__.py", "iclab/experiments/linattn/__init__.py"):
        assert needed in files, needed
    # not another paper's figures, nor the store, the CLI or the report
    for absent in ("iclab/experiments/gating/fig2.py", "iclab/cli.py", "iclab/store.py", "iclab/report/site.py",
                   "iclab/experiments/linattn/fig3.py"):
        assert absent not in files, absent
    assert ident["iclab"] == iclab.__version__ and "user_file" not in ident


def test_the_identity_follows_an_edit_of_an_imported_file(tmp_path, monkeypatch):
    """A copy of the package: editing a file the experiment imports changes its identity, editing another does not."""
    pkg = tmp_path / "iclab"
    shutil.copytree(provenance.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "_TOP", tmp_path)
    exp = get_experiment("linattn.fig1")
    real = Path(provenance.PACKAGE_DIR)

    def identity():
        # the experiment's modules, as if loaded from the copy
        start = [pkg / Path(m.replace(".", "/") + ".py").relative_to("iclab") for m in
                 ("iclab.experiments.linattn.fig1",)]
        files, _ = provenance._reached(start)
        return {k: provenance.file_sha256(p) for k, p in files.items()}

    before = identity()
    (pkg / "engines" / "linreg.py").write_text((real / "engines" / "linreg.py").read_text() + "\n# edited\n")
    after = identity()
    assert [k for k in before if before[k] != after[k]] == ["iclab/engines/linreg.py"]
    (pkg / "experiments" / "gating" / "fig2.py").write_text("# not imported by linattn.fig1\n")
    assert identity() == after
    assert exp.id == "linattn.fig1"


def test_a_user_file_covers_its_path_its_bytes_and_its_siblings(tmp_path):
    from iclab.experiments import unregister
    from iclab.launch import code_of, load_experiment_file

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "helpers.py").write_text("SCALE = 1.0\n")
    text = FIXTURE.read_text().replace('id="user.demo"', 'id="user.sibling"')
    text = text.replace("import numpy as np\n", "import numpy as np\nimport helpers  # a module beside the file\n", 1)
    (folder / "exp.py").write_text(text)
    try:
        exp = load_experiment_file(f"{folder / 'exp.py'}:demo")  # the sibling import resolves while it loads
        first = code_of(exp)
        assert first["user_file"]["path"] == str((folder / "exp.py").resolve())
        assert set(first["siblings"]) == {"helpers.py"}
        assert "iclab/engines/linreg.py" in first["files"]
        (folder / "helpers.py").write_text("SCALE = 2.0\n")
        second = code_of(exp)
        assert second["digest"] != first["digest"]
        assert describe_change(first, second) == "changed: helpers.py"
        (folder / "exp.py").write_text(text + "\n# edited\n")
        with pytest.raises(iclab.ExperimentError, match="changed since it was loaded"):
            code_of(exp)  # the module in memory is the old code: it must be loaded again
        exp = load_experiment_file(f"{folder / 'exp.py'}:demo")
        assert "exp.py was edited" in describe_change(second, code_of(exp))
    finally:
        unregister("user.sibling")


def test_describe_change_of_a_run_that_recorded_no_code():
    new = code_identity(get_experiment("linattn.fig1"))
    assert describe_change(None, new) == "it was stored by an iclab that did not record its code"
    old = json.loads(json.dumps(new))
    old["iclab"] = "0.0.9"
    assert describe_change(old, new).startswith("iclab 0.0.9 → ")


def test_an_experiment_defined_without_a_file_is_keyed_by_its_source(tmp_path):
    from iclab.experiments import Experiment, ExperimentConfig

    namespace: dict = {}
    source = textwrap.dedent("""
        def run(config, reporter):
            return {"x": [1.0]}
    """)
    exec(compile(source, "<cell>", "exec"), namespace)  # a notebook cell: no file behind it

    def make(run):
        return Experiment(id="cell.toy", title="t", paper="cell", reference="r", config=ExperimentConfig,
                          presets={"quick": {}, "paper": {}}, run=run, checks=lambda c, a: [], plot=lambda c, a: None)

    a = code_identity(make(namespace["run"]))
    exec(compile(source.replace("1.0", "2.0"), "<cell>", "exec"), namespace)
    b = code_identity(make(namespace["run"]))
    assert "inline" in a and a["digest"] != b["digest"]


def test_the_import_scan_finds_every_import_the_parser_finds():
    """The text scan (fast) against Python's own parser, over every file of the package: no import is missed."""
    import ast

    for path in sorted(provenance.PACKAGE_DIR.rglob("*.py")):
        parsed = set()
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                parsed |= {(a.name, 0, ()) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                parsed.add((node.module or "", node.level, tuple(a.name for a in node.names)))
        st = path.stat()
        scanned = set(provenance._imports_of(str(path), st.st_mtime_ns, st.st_size))
        assert parsed <= scanned, (path, sorted(parsed - scanned)[:3])
