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


# ---------------------------------------------------------------------------------------------
# Registered extensions a config uses by name (Experiment.extensions) are part of the key


_SCALES: dict = {}  # a toy registry, as lab.drift_families' register_drift_family


def _extension_experiment():
    from iclab.experiments import Experiment, ExperimentConfig, param

    class Config(ExperimentConfig):
        scale: str = param("mine", "the registered scale to use")

    def run(config, reporter):
        return {"y": [float(_SCALES[config.scale].factor(2.0))]}

    def plot(config, arrays):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.plot(arrays["y"])
        return fig

    return Experiment(id="user.extension_key", title="t", paper="user", reference="r", config=Config,
                      presets={"quick": {}, "paper": {}}, run=run, checks=lambda c, a: [], plot=plot,
                      extensions=lambda config: [_SCALES[config.scale]])


def _load_scale(folder: Path, body: str, monkeypatch):
    """A user's module defining and registering a dataclass with a function (as a DriftFamily), loaded anew."""
    import importlib
    import sys

    (folder / "my_scale.py").write_text(textwrap.dedent(f"""
        from dataclasses import dataclass
        from typing import Callable

        @dataclass(frozen=True)
        class Scale:
            name: str
            factor: Callable

        SCALE = Scale("mine", lambda v: {body})
    """))
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("my_scale", None)
    importlib.invalidate_caches()
    _SCALES["mine"] = importlib.import_module("my_scale").SCALE


def test_an_edited_registered_extension_is_computed_again_not_served_from_the_store(tmp_path, monkeypatch):
    from iclab.experiments import register, unregister

    exp = register(_extension_experiment())
    try:
        _load_scale(tmp_path, "3 * v", monkeypatch)
        first = iclab.run_experiment(exp.id, root=tmp_path / "r")
        assert first.arrays["y"].tolist() == [6.0] and not first.reused
        assert iclab.run_experiment(exp.id, root=tmp_path / "r").reused  # the same extension: reused
        code = first.code["extensions"]
        assert list(code["files"]) == [str((tmp_path / "my_scale.py").resolve())]
        _load_scale(tmp_path, "5 * v", monkeypatch)  # the user edits the extension, not the experiment
        second = iclab.run_experiment(exp.id, root=tmp_path / "r")
        assert not second.reused and second.arrays["y"].tolist() == [10.0]
        assert "a registered extension it uses changed (my_scale.py)" in second.recomputed
    finally:
        unregister(exp.id)
        _SCALES.clear()


def test_an_extension_held_by_no_file_is_keyed_by_its_source_and_values():
    from iclab.experiments import Experiment
    from iclab.runner import code_of

    exp = _extension_experiment()
    config = exp.resolve("quick")
    digests = []
    for source in ("lambda v: 3 * v", "lambda v: 5 * v"):
        namespace: dict = {}
        exec(compile(f"factor = {source}\n", "<cell>", "exec"), namespace)  # a notebook cell
        for name in ("mine", "other"):
            _SCALES["mine"] = _scale_object(namespace["factor"], name)
            digests.append(code_of(exp, config)["digest"])
    _SCALES.clear()
    assert len(set(digests)) == 4  # the function's source and the object's values each move the key
    plain = Experiment(**{**exp.__dict__, "extensions": None})
    assert "extensions" not in code_of(plain, config)


def _scale_object(factor, name):
    """A registered object (a frozen dataclass, as DriftFamily) holding a function and a value."""
    from dataclasses import make_dataclass

    return make_dataclass("Scale", ["name", "factor"], frozen=True)(name, factor)


def test_lab_drift_families_keys_only_the_families_of_ones_own():
    """Its built-in families are its own code: a config naming only them has the experiment's identity (stored
    runs keep their keys); a family registered from a notebook cell enters the key."""
    import numpy as np

    from iclab.experiments.lab import drift_families as df
    from iclab.runner import code_of

    exp = get_experiment("lab.drift_families")
    config = exp.resolve("quick")
    assert code_of(exp, config) == code_of(exp)
    namespace: dict = {}
    exec(compile("from iclab.tasks.state_space import ar1_process\n"
                 "process = lambda c, v: ar1_process(c.d, gamma=v, sigma_w2=c.sigma_w2, sigma_e2=0.5)\n",
                 "<cell>", "exec"), namespace)
    family = df.register_drift_family(df.DriftFamily("cell_family", "v", process=namespace["process"],
                                                     domain=(0.0, 1.0)), replace=True)
    try:
        mine = exp.resolve("quick", {"families": ["ar1", "cell_family"], "strengths": {"cell_family": [0.5]}})
        ident = code_of(exp, mine)
        assert "extensions" in ident and ident["digest"] != code_of(exp)["digest"]
        df.register_drift_family(df.DriftFamily("cell_family", "v", process=namespace["process"],
                                                domain=(0.0, 0.9)), replace=True)
        assert code_of(exp, mine)["digest"] != ident["digest"]  # a value of the family changed
        assert np.isfinite(family.domain[1])
    finally:
        df.unregister_drift_family("cell_family")
