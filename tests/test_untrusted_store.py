"""The trust boundary of a results root: a store is data.

Reading a results root (``iclab report``, ``runs``, ``verify``, ``export``, ``index rebuild``, ``iclab.load``,
``iclab.runs``, ``RunResult.figure()``) never imports a Python file named in it, never follows a name from it
out of the root, and never writes outside its output folder. Each test crafts a copy of a real store (one run of
the user's demo experiment, computed once for the module) that attacks the reader, then runs every reading
command on it. Each reading command is watched (:func:`reading`): the root stays byte-identical, nothing is
written under the test's folder outside the output folder, no marker file appears, and an audit hook records
every file opened: one outside the root and the output folder (a marker script, a run behind a symbolic link,
the target of a crafted manifest entry) fails the test even when nothing of it reaches the output.

Layout of a crafted case (``tmp`` is the test's folder; the root is nested so that every ``..`` a crafted
name could climb lands inside ``tmp``, where the snapshots see it)::

    tmp/a/b/c/results/          the root: the good run G (user.demo-<key>) and the attack (user.demo-feedface...)
    tmp/x/y/z/out/              the output folder: report --out out/site, export --out out/x.csv
    tmp/elsewhere/              files outside the root that a crafted name points at
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlparse

import numpy as np
import pytest

import iclab
from iclab.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "user_experiment.py"
DEMO = f"{FIXTURE}:demo"
KEY2 = "feedfacecafebeef"  # the run key of the crafted run beside the good one
SECRET = "OUTSIDE-SECRET-7f3a"  # written into every file outside the root: it must never reach an output


@pytest.fixture(scope="module", autouse=True)
def _forget_the_demo():
    """The demo registers itself when loaded: leave the registry as the other test modules expect it."""
    yield
    from iclab.experiments import unregister

    unregister("user.demo")


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# -- what a reading command touches ------------------------------------------------------------------------

_OPENED: list | None = None
_HOOKED = False


def _audit(event, args):
    if _OPENED is not None and event in ("open", "sqlite3.connect") and args and args[0] is not None \
            and not isinstance(args[0], int):
        _OPENED.append(args[0])


def _install_hook():
    global _HOOKED
    if not _HOOKED:  # an audit hook cannot be removed: one for the process, recording only inside reading()
        sys.addaudithook(_audit)
        _HOOKED = True


def _real(entry) -> str:
    text = os.fsdecode(os.fspath(entry))
    if text.startswith("file:"):  # sqlite's URI form
        text = unquote(urlparse(text).path)
    return os.path.realpath(text)


def _within(path: str, folder) -> bool:
    folder = os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def snapshot(top: Path, exclude: Path | None = None) -> dict:
    """Every entry under ``top`` (not following links): folders, files with their bytes, links with their target."""
    out = {}
    top = Path(top)
    if not top.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(top):
        d = Path(dirpath)
        if exclude is not None and (d == exclude or exclude in d.parents):
            dirnames[:] = []
            continue
        for name in sorted(dirnames + filenames):
            p = d / name
            if exclude is not None and p == exclude:
                continue
            rel = str(p.relative_to(top))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def _changes(before: dict, after: dict) -> list[str]:
    return sorted(set(before) ^ set(after)) + sorted(k for k in set(before) & set(after) if before[k] != after[k])


def markers(tmp: Path) -> list[Path]:
    return sorted(tmp.rglob("MARKER*"))


@contextlib.contextmanager
def reading(case, what: str, *, root_changes: bool = False):
    """Watches one reading command (see the module docstring); ``root_changes``: it may write in the root
    (``index rebuild``), and nothing else."""
    global _OPENED
    _install_hook()
    root_before = snapshot(case.root)
    outside = case.root if root_changes else case.out
    tmp_before = snapshot(case.tmp, exclude=outside)
    modules = {m for m in sys.modules if m.startswith("iclab_user_")}
    _OPENED = []
    try:
        yield
    finally:
        opened, _OPENED = _OPENED, None
    if not root_changes:
        changed = _changes(root_before, snapshot(case.root))
        assert not changed, f"{what} wrote into the results root: {changed}"
    changed = _changes(tmp_before, snapshot(case.tmp, exclude=outside))
    assert not changed, f"{what} wrote outside its output: {changed}"
    assert not markers(case.tmp), f"{what} imported a file named by the store"
    assert {m for m in sys.modules if m.startswith("iclab_user_")} == modules, f"{what} imported a user's file"
    forbidden = {os.path.realpath(f) for f in case.forbidden}
    for entry in opened:
        real = _real(entry)
        assert real not in forbidden, f"{what} opened {real}"
        if _probe(real, case.out):
            continue
        outside_both = _within(real, case.tmp) and not (_within(real, case.root) or _within(real, case.out))
        assert not outside_both, f"{what} opened {real}, outside the root and the output"


def _probe(path: str, out: Path) -> bool:
    """The file a command makes and removes at once to see that the output's nearest existing folder is
    writable (``iclab.runner.writable_folder``)."""
    return os.path.basename(path).startswith(".iclab-probe-") and _within(str(out), os.path.dirname(path))


# -- a real store and crafted copies ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A results root holding one run of the demo, made through the CLI."""
    root = tmp_path_factory.mktemp("base") / "results"
    rc, out, err = cli("run", DEMO, "--out", root, "--json")
    assert rc == 0, err
    result = json.loads(out)
    run = Path(result["path"]).name
    (row,) = index_rows(root)
    return SimpleNamespace(root=root, run=run, key=run.rsplit("-", 1)[1], id=row["id"], result=result)


def index_rows(root: Path) -> list[dict]:
    """The index's rows, read without touching the root (``immutable``: no -wal or -shm file is made)."""
    con = sqlite3.connect(f"{(Path(root) / 'index.sqlite').resolve().as_uri()}?immutable=1", uri=True)
    try:
        con.row_factory = sqlite3.Row
        return [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY id")]
    finally:
        con.close()


@pytest.fixture
def case(base, tmp_path):
    """A copy of the base store in the crafted layout (module docstring), with nothing crafted yet."""
    root = tmp_path / "a" / "b" / "c" / "results"
    out = tmp_path / "x" / "y" / "z" / "out"
    root.parent.mkdir(parents=True)
    out.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(base.root, root, symlinks=True)
    return SimpleNamespace(tmp=tmp_path, root=root, out=out, good=root / base.run, good_id=base.id, key=base.key,
                           elsewhere=tmp_path / "elsewhere", forbidden=[], bad=None)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def set_manifest(folder: Path) -> None:
    """Recomputes the manifest of ``folder`` for what its files hold now (anyone can)."""
    metrics = read_json(folder / "metrics.json")
    metrics["artifacts"] = {name: {"size": (folder / name).stat().st_size, "sha256": sha256(folder / name)}
                            for name in metrics["artifacts"] if (folder / name).is_file()}
    write_json(folder / "metrics.json", metrics)


def clone(case, dest: Path, *, experiment: str = "user.demo", key: str = KEY2, secret: bool = False) -> Path:
    """A copy of the good run at ``dest`` as the run ``experiment-key`` (its manifest recomputed); with
    ``secret`` its check, log and figure carry SECRET."""
    shutil.copytree(case.good, dest)
    metrics = read_json(dest / "metrics.json")
    metrics.update(config_hash=key, experiment=experiment)
    metrics["index"]["id"] = None
    if secret:
        metrics["checks"][0]["name"] = SECRET
        (dest / "log.txt").write_text(SECRET + "\n")
        with open(dest / "figure.png", "ab") as f:
            f.write(SECRET.encode())
    write_json(dest / "metrics.json", metrics)
    config = read_json(dest / "config.json")
    config["experiment"] = experiment
    write_json(dest / "config.json", config)
    set_manifest(dest)
    return dest


def add_row(root: Path, good_id: int, **fields) -> int:
    """A row written into the index by hand: the good run's, with ``fields`` changed; returns its id."""
    row = next(r for r in index_rows(root) if r["id"] == good_id)
    row.update(id=None, started=row["started"] + 1, ended=row["ended"] + 1, **fields)
    cols = [c for c in row if c != "id"]
    con = sqlite3.connect(Path(root) / "index.sqlite")
    try:
        cur = con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                          [row[c] for c in cols])
        con.commit()
        return int(cur.lastrowid)
    finally:
        con.close()


def bad_run(case, **crafted) -> SimpleNamespace:
    """The crafted run beside the good one: a clone in the root with its own (newer) index row."""
    path = clone(case, case.root / f"user.demo-{KEY2}", **crafted)
    row = add_row(case.root, case.good_id, run_dir=path.name, config_hash=KEY2)
    case.bad = SimpleNamespace(path=path, name=path.name, id=row)
    return case.bad


# -- every reading command ----------------------------------------------------------------------------------

CLI_READERS = {
    "report": lambda c: ("report", "--results", c.root, "--out", c.out / "site"),
    "runs": lambda c: ("runs", "--results", c.root),
    "runs --json": lambda c: ("runs", "--results", c.root, "--json"),
    "verify": lambda c: ("verify", "--results", c.root),
    "export": lambda c: ("export", "user.demo", "--results", c.root, "--out", c.out / "x.csv"),
}


def api(case, what: str, fn) -> SimpleNamespace:
    """``fn()`` watched by :func:`reading`: its value, or the UserError it raised (anything else fails), and the
    warnings it gave."""
    with reading(case, what), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value, error = fn(), None
        except iclab.UserError as err:
            value, error = None, err
    if error is not None:
        assert "\n" not in str(error), (what, str(error))
    said = [str(w.message) for w in caught if "skipping" in str(w.message)]
    return SimpleNamespace(value=value, error=error, warnings=said)


def is_stored_picture(fig) -> bool:
    """The stored figure.png shown as a Figure: one axes holding one image and no plotted line."""
    return len(fig.axes) == 1 and len(fig.axes[0].images) == 1 and not fig.axes[0].lines


def read_everything(case) -> SimpleNamespace:
    """Every reading command of the CLI and the Python API on ``case.root``; the good run is read by path, name and
    index id (and the crafted one too, where it has them). Checks what holds for every crafted store."""
    import matplotlib.pyplot as plt

    res = SimpleNamespace()
    res.cli = {}
    for name, args in CLI_READERS.items():
        with reading(case, name):
            rc, out, err = cli(*args(case))
        assert "Traceback" not in err, (name, err)
        assert all(ln.startswith(("warning: ", "damaged: ")) for ln in lines(err)), (name, err)
        assert rc == 0 or (name == "verify" and rc == 1), (name, rc, err)  # 1: verify found damage
        res.cli[name] = SimpleNamespace(rc=rc, out=out, err=err, lines=lines(err))
    site = case.out / "site"
    res.page = (site / "user.demo-quick" / "index.html").read_text()
    res.site = {str(p.relative_to(site)): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    res.csv = (case.out / "x.csv").read_text()
    for blob in list(res.site.values()) + [res.csv.encode(), res.cli["runs --json"].out.encode()]:
        assert SECRET.encode() not in blob, "a file outside the root reached an output"
    res.runs = api(case, "iclab.runs", lambda: iclab.runs(root=case.root))
    assert res.runs.error is None, res.runs.error
    res.loads = {}
    for label, ref, root in (("good by path", case.good, None), ("good by name", case.good.name, case.root),
                             ("good by id", case.good_id, case.root)):
        res.loads[label] = api(case, f"load({label})", lambda: iclab.load(ref, root=root))
        assert res.loads[label].error is None, (label, res.loads[label].error)
        assert res.loads[label].value.path == case.good
    if case.bad is not None:
        for label, ref, root in (("bad by path", case.bad.path, None), ("bad by name", case.bad.name, case.root),
                                 ("bad by id", case.bad.id, case.root)):
            if ref is not None:
                res.loads[label] = api(case, f"load({label})", lambda: iclab.load(ref, root=root))
    for label, got in res.loads.items():
        if got.value is not None:
            fig = api(case, f"figure() of load({label})", got.value.figure)
            assert fig.error is None and is_stored_picture(fig.value), (label, fig.error)
            plt.close(fig.value)
    return res


def rebuild(case) -> list[dict]:
    """``iclab index rebuild`` on the crafted root: it writes its index there and nothing elsewhere; the
    rows it indexed."""
    with reading(case, "index rebuild", root_changes=True):
        rc, out, err = cli("index", "rebuild", "--results", case.root)
    assert rc == 0 and "Traceback" not in err, err
    return index_rows(case.root)


def assert_good_page(res, case) -> None:
    """The report shows the good run (its run key), whatever else it skipped."""
    assert f"run key {case.key}" in res.page


def assert_bad_refused(res, *labels) -> None:
    for label in labels:
        got = res.loads[label]
        assert isinstance(got.error, iclab.StoreError), (label, got.value)


# -- a clean store ---------------------------------------------------------------------------------------------

def test_every_reading_command_leaves_a_clean_store_byte_identical(case):
    res = read_everything(case)
    for name, r in res.cli.items():
        assert r.rc == 0 and not r.lines, (name, r.err)
    assert len(res.runs.value) == 1 and res.runs.value.path.iloc[0] == str(case.good)
    assert_good_page(res, case)
    assert case.key in res.csv


# -- a source to import ----------------------------------------------------------------------------------

MARKER_SCRIPT = """import pathlib
pathlib.Path({marker!r}).write_text("imported")
ok = None
"""


@pytest.mark.parametrize("manifest", ["stale", "recomputed"])
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_source_named_by_the_store_is_never_imported(case, where, manifest):
    bad = bad_run(case)
    script = bad.path / "notes.py" if where == "inside" else case.elsewhere / "evil.py"
    script.write_text(MARKER_SCRIPT.format(marker=str(case.tmp / f"MARKER-{where}")))
    case.forbidden.append(script)
    config = read_json(bad.path / "config.json")
    config.update(source=f"{script}:ok", source_sha256=sha256(script))
    write_json(bad.path / "config.json", config)
    if manifest == "recomputed":
        set_manifest(bad.path)
    res = read_everything(case)
    if manifest == "stale":  # a damaged run: skipped with one line by every command that reads runs
        assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1
        assert bad.name in res.cli["verify"].lines[0] and "config.json" in res.cli["verify"].lines[0]
        for name in ("report", "export"):
            assert len(res.cli[name].lines) == 1 and bad.name in res.cli[name].lines[0], (name, res.cli[name].err)
        assert_good_page(res, case)
        assert_bad_refused(res, "bad by path", "bad by name", "bad by id")
    else:  # an intact run that records a source: shown as text, never loaded
        for name, r in res.cli.items():
            assert r.rc == 0 and not r.lines, (name, r.err)
        assert f"run key {KEY2}" in res.page and str(script) in res.page
        loaded = res.loads["bad by id"].value
        assert loaded.source == f"{script}:ok" and loaded.path == bad.path
    assert len(res.runs.value) == 2 and not res.runs.warnings
    indexed = rebuild(case)
    assert {r["run_dir"] for r in indexed} == {case.good.name} | ({bad.name} if manifest == "recomputed" else set())
    assert not markers(case.tmp)


def test_figure_redraws_only_with_the_file_the_run_records(case):
    bad = bad_run(case)
    config = read_json(bad.path / "config.json")
    script = case.elsewhere / "evil.py"
    script.write_text(MARKER_SCRIPT.format(marker=str(case.tmp / "MARKER-figure")))
    config["source"] = f"{script}:ok"
    write_json(bad.path / "config.json", config)
    set_manifest(bad.path)
    case.forbidden.append(script)
    loaded = api(case, "load", lambda: iclab.load(bad.id, root=case.root)).value
    stored = api(case, "figure()", loaded.figure).value
    assert is_stored_picture(stored)
    # the user's own file, named by the user, whose SHA-256 is the one recorded: redrawn by its plot
    recorded = loaded.code["user_file"]["sha256"]
    assert recorded == sha256(FIXTURE)
    fig = loaded.figure(experiment=DEMO)
    assert not is_stored_picture(fig) and fig.axes[0].lines
    # an edited copy of it (another tolerance): refused, one line
    edited = case.tmp / "edited" / "user_experiment.py"
    edited.parent.mkdir()
    text = FIXTURE.read_text()
    assert "1e-3" in text
    edited.write_text(text.replace("1e-3", "2e-3"))
    with pytest.raises(iclab.ExperimentError, match="SHA-256") as err:
        loaded.figure(experiment=f"{edited}:demo")
    assert "\n" not in str(err.value)
    assert not markers(case.tmp)


# -- names that climb out of the root -------------------------------------------------------------------------

ESCAPE = "../../../escaped/PWNED"


def test_an_experiment_id_with_dotdot_in_a_run_folder_is_skipped(case):
    bad = bad_run(case)
    config = read_json(bad.path / "config.json")
    config["experiment"] = ESCAPE
    write_json(bad.path / "config.json", config)
    metrics = read_json(bad.path / "metrics.json")
    metrics["experiment"] = ESCAPE
    write_json(bad.path / "metrics.json", metrics)
    set_manifest(bad.path)
    res = read_everything(case)
    assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1 and bad.name in res.cli["verify"].lines[0]
    for name in ("report", "export"):
        assert len(res.cli[name].lines) == 1 and bad.name in res.cli[name].lines[0], (name, res.cli[name].err)
    assert_good_page(res, case)
    assert_bad_refused(res, "bad by path", "bad by name", "bad by id")
    # an index rebuilt from the folders leaves it out, and the report still shows the good run
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]
    shutil.rmtree(case.out)
    res = read_everything(case)
    assert not res.cli["report"].lines and res.cli["verify"].rc == 1
    assert_good_page(res, case)
    assert not list(case.tmp.rglob("escaped"))


@pytest.mark.parametrize("experiment", [ESCAPE, ".."])
def test_a_run_moved_where_its_crafted_id_points_is_never_followed(case, experiment):
    """The crafted run lies where its id would lead (``../../../escaped/PWNED-<key>``, outside the root; or the
    folder ``..-<key>`` inside it), and the index names it so."""
    run_dir = f"{experiment}-{KEY2}"
    dest = Path(os.path.normpath(case.root / run_dir))
    dest.parent.mkdir(parents=True, exist_ok=True)
    clone(case, dest, experiment=experiment, secret=True)
    case.forbidden += [dest / name for name in ("metrics.json", "config.json", "figure.png", "log.txt")]
    row = add_row(case.root, case.good_id, experiment=experiment, run_dir=run_dir, config_hash=KEY2)
    case.bad = SimpleNamespace(path=None, name=None, id=row)
    res = read_everything(case)
    for name in ("runs", "runs --json", "report", "export"):
        assert len(res.cli[name].lines) == 1, (name, res.cli[name].err)
        assert f"index row {row}" in res.cli[name].lines[0], (name, res.cli[name].err)
    assert res.cli["verify"].rc == 0 and not res.cli["verify"].lines
    assert row not in [r["id"] for r in json.loads(res.cli["runs --json"].out)]
    assert len(res.runs.warnings) == 1 and row not in set(res.runs.value.id)
    assert_good_page(res, case)
    assert_bad_refused(res, "bad by id")
    assert "no run with index id" in str(res.loads["bad by id"].error)
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]


@pytest.mark.parametrize("how", ["dotdot", "absolute", "slash in experiment"])
def test_an_index_row_leading_out_of_the_root_is_never_followed(case, how):
    outside = {"dotdot": "../../outside_run", "absolute": None, "slash in experiment": f"../../outside-{KEY2}"}[how]
    experiment = "../../outside" if how == "slash in experiment" else "user.demo"
    dest = Path(os.path.normpath(case.root / outside)) if outside else case.elsewhere / "outside_run"
    run_dir = outside or str(dest)
    clone(case, dest, experiment=experiment, secret=True)
    assert not _within(str(dest), case.root)
    case.forbidden += [dest / name for name in ("metrics.json", "config.json", "figure.png", "log.txt")]
    row = add_row(case.root, case.good_id, experiment=experiment, run_dir=run_dir, config_hash=KEY2)
    case.bad = SimpleNamespace(path=None, name=None, id=row)
    res = read_everything(case)
    for name in ("runs", "runs --json", "report", "export"):
        assert len(res.cli[name].lines) == 1, (name, res.cli[name].err)
        assert f"index row {row}" in res.cli[name].lines[0], (name, res.cli[name].err)
    assert res.cli["verify"].rc == 0 and not res.cli["verify"].lines and "1 of 1" in res.cli["verify"].out
    assert row not in [r["id"] for r in json.loads(res.cli["runs --json"].out)]
    assert len(res.runs.warnings) == 1 and row not in set(res.runs.value.id)
    assert str(dest) not in set(res.runs.value.path.dropna())
    assert "no run with index id" in str(res.loads["bad by id"].error)
    assert_good_page(res, case)
    assert KEY2 not in res.csv
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]


# -- symbolic links and manifests naming other files -------------------------------------------------------------

def test_a_run_folder_that_is_a_symbolic_link_out_of_the_root_is_skipped(case):
    target = clone(case, case.elsewhere / f"user.demo-{KEY2}", secret=True)
    link = case.root / target.name
    link.symlink_to(target, target_is_directory=True)
    case.forbidden += [target / name for name in ("metrics.json", "config.json", "figure.png", "log.txt")]
    row = add_row(case.root, case.good_id, run_dir=link.name, config_hash=KEY2)
    case.bad = SimpleNamespace(path=link, name=link.name, id=row)
    res = read_everything(case)
    assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1, res.cli["verify"].err
    assert link.name in res.cli["verify"].lines[0] and "symbolic link" in res.cli["verify"].lines[0]
    for name in ("report", "export"):
        assert len(res.cli[name].lines) == 1, (name, res.cli[name].err)
        assert link.name in res.cli[name].lines[0] and "symbolic link" in res.cli[name].lines[0]
    assert not res.cli["runs"].lines  # the row itself is data: listed, never followed
    assert_good_page(res, case)
    assert KEY2 not in res.csv
    df = res.runs.value
    assert df.loc[df.id == row, "path"].isna().all() and len(df) == 2
    assert_bad_refused(res, "bad by path", "bad by name", "bad by id")
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]


@pytest.mark.parametrize("artifact", ["figure.png", "trajectories.npz", "config.json", "metrics.json"])
def test_an_artifact_that_is_a_symbolic_link_out_of_the_root_is_damage(case, artifact):
    bad = bad_run(case)
    target = case.elsewhere / artifact
    shutil.copyfile(bad.path / artifact, target)
    if artifact == "figure.png":
        with open(target, "ab") as f:
            f.write(SECRET.encode())
    (bad.path / artifact).unlink()
    (bad.path / artifact).symlink_to(target)
    if artifact != "metrics.json":
        set_manifest(bad.path)  # the manifest matches the target: only the link gives it away
    case.forbidden.append(target)
    res = read_everything(case)
    assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1
    assert "symbolic link" in res.cli["verify"].lines[0] and bad.name in res.cli["verify"].lines[0]
    for name in ("report", "export"):
        assert len(res.cli[name].lines) == 1 and bad.name in res.cli[name].lines[0], (name, res.cli[name].err)
    assert_good_page(res, case)
    assert res.site["user.demo-quick/figure.png"] == (case.good / "figure.png").read_bytes()
    assert_bad_refused(res, "bad by path", "bad by name", "bad by id")
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]


@pytest.mark.parametrize("entry", ["../../etc/passwd", "figure.png/../../../etc/passwd", "absolute", "/etc/passwd"])
def test_a_manifest_naming_a_file_out_of_the_folder_is_damage(case, entry):
    bad = bad_run(case)
    if entry == "absolute":
        entry = str(case.elsewhere / "passwd")
    target = Path(os.path.normpath(bad.path / entry))
    if entry != "/etc/passwd":
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"root:x:0:0:{SECRET}\n")
    case.forbidden.append(target)
    metrics = read_json(bad.path / "metrics.json")
    metrics["artifacts"][entry] = {"size": target.stat().st_size, "sha256": sha256(target)}
    write_json(bad.path / "metrics.json", metrics)
    res = read_everything(case)
    assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1
    assert "not a run file" in res.cli["verify"].lines[0] and bad.name in res.cli["verify"].lines[0]
    for name in ("report", "export"):
        assert len(res.cli[name].lines) == 1 and bad.name in res.cli[name].lines[0], (name, res.cli[name].err)
    assert_good_page(res, case)
    assert_bad_refused(res, "bad by path", "bad by name", "bad by id")
    assert [r["run_dir"] for r in rebuild(case)] == [case.good.name]


def _npz(members: dict, compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _npy(array, shape: str | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    data = buf.getvalue()
    return data if shape is None else data.replace(f"({array.size},)".encode(), shape.encode())


def _corrupt_deflate() -> bytes:
    data = bytearray(_npz({"loss.npy": _npy(np.arange(2000.0))}, zipfile.ZIP_DEFLATED))
    data[80:100] = b"\xff" * 20
    return bytes(data)


NOT_ARRAYS = {
    "not a zip": lambda: b"PK\x03\x04" + b"\0" * 60,
    "a broken deflate stream": _corrupt_deflate,
    "a header claiming 10^13 entries": lambda: _npz({"loss.npy": _npy(np.zeros(3), "(10000000000000,)")}),
    "an object array": lambda: _npz({"loss.npy": _npy(np.array([None, 1], dtype=object))}),
}


@pytest.mark.parametrize("manifest", ["recomputed", "none (an old run)"])
@pytest.mark.parametrize("content", list(NOT_ARRAYS))
def test_a_trajectories_file_that_is_not_arrays_is_refused_when_read(case, content, manifest):
    """Anyone can recompute a manifest: a trajectories.npz that matches it may still not be arrays; a run stored
    before manifests existed has its npz opened by verify itself."""
    bad = bad_run(case)
    (bad.path / "trajectories.npz").write_bytes(NOT_ARRAYS[content]())
    if manifest == "recomputed":
        set_manifest(bad.path)
    else:
        metrics = read_json(bad.path / "metrics.json")
        del metrics["artifacts"]
        write_json(bad.path / "metrics.json", metrics)
    res = read_everything(case)
    if manifest == "recomputed":  # intact by its manifest: listed and shown, its arrays refused when read
        assert res.cli["verify"].rc == 0 and not res.cli["verify"].lines
        assert not res.cli["report"].lines and f"run key {KEY2}" in res.page and "curves.csv" not in res.page
        loaded = res.loads["bad by id"].value
        with pytest.raises(iclab.StoreError) as err:
            loaded.arrays
        assert "\n" not in str(err.value) and "trajectories.npz" in str(err.value)
    else:  # verify reads the npz: damaged
        assert res.cli["verify"].rc == 1 and len(res.cli["verify"].lines) == 1
        assert "trajectories.npz unreadable" in res.cli["verify"].lines[0]
        assert len(res.cli["report"].lines) == 1 and bad.name in res.cli["report"].lines[0]
        assert_good_page(res, case)
        assert_bad_refused(res, "bad by path", "bad by name", "bad by id")


# -- a root that cannot be written ---------------------------------------------------------------------------------

def _list_read_only(case) -> None:
    for args in (("runs", "--results", case.root), ("runs", "--results", case.root, "--json"),
                 ("verify", "--results", case.root)):
        with reading(case, " ".join(map(str, args))):
            rc, out, err = cli(*args)
        assert rc == 0 and not err, (args, err)
    rows = json.loads(cli("runs", "--results", case.root, "--json")[1])
    assert [r["run_dir"] for r in rows] == [case.good.name]
    got = api(case, "iclab.runs", lambda: iclab.runs(root=case.root))
    assert got.error is None and list(got.value.path) == [str(case.good)]
    got = api(case, "load", lambda: iclab.load(case.good_id, root=case.root))
    assert got.error is None and got.value.path == case.good


@pytest.mark.parametrize("what", ["index.sqlite", "root"])
def test_a_read_only_index_or_root_can_be_listed(case, what):
    target = case.root / "index.sqlite" if what == "index.sqlite" else case.root
    mode = target.stat().st_mode
    target.chmod(0o444 if what == "index.sqlite" else 0o555)
    try:
        if os.access(target, os.W_OK):
            pytest.skip("chmod does not take writing away here (running as root)")
        _list_read_only(case)
    finally:
        target.chmod(mode)


def test_a_root_on_a_read_only_mount_can_be_listed(case):
    mnt = case.tmp / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        root = mnt / "results"
        shutil.copytree(case.root, root, symlinks=True)
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True).returncode == 0
        case.root, case.good = root, root / case.good.name
        _list_read_only(case)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- stale code: a run is reused only by the code that computed it ------------------------------------------------

TOY = '''
import numpy as np
from iclab.experiments import Experiment, ExperimentConfig, check_abs, param


class ToyConfig(ExperimentConfig):
    x: float = param(0.5, "a value", ge=0, le=1)


def run(config, reporter):
    return {{"y": np.array([{value}])}}


def checks(config, arrays):
    return [check_abs("{check}", float(arrays["y"][0]), {value}, {tolerance})]


def plot(config, arrays):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot(arrays["y"])
    return fig


demo = Experiment(id="{exp_id}", title="a toy", paper="user", reference="none", config=ToyConfig,
                  presets={{"quick": {{}}, "paper": {{}}}}, run=run, checks=checks, plot=plot)
'''


def toy_file(path: Path, *, exp_id="user.demo", value=1.0, check="toy check", tolerance=0.1) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOY.format(exp_id=exp_id, value=value, check=check, tolerance=tolerance))
    return f"{path}:demo"


def run_json(ref: str, root: Path) -> dict:
    rc, out, err = cli("run", ref, "--out", root, "--json")
    assert rc in (0, 1) and "Traceback" not in err, err
    return json.loads(out)


def test_an_edited_user_file_computes_again_and_says_why(tmp_path):
    ref = toy_file(tmp_path / "copy" / "toy.py", tolerance=0.1)
    first = run_json(ref, tmp_path / "r")
    assert not first["reused"] and "recomputed" not in first
    assert run_json(ref, tmp_path / "r")["reused"]
    toy_file(tmp_path / "copy" / "toy.py", tolerance=0.2)  # a tolerance changed
    second = run_json(ref, tmp_path / "r")
    assert not second["reused"] and second["path"] != first["path"]
    assert Path(first["path"]).name in second["recomputed"] and "toy.py was edited" in second["recomputed"]
    assert second["checks"][0]["tolerance"] == 0.2 and first["checks"][0]["tolerance"] == 0.1


@pytest.mark.slow
def test_an_edited_copy_of_the_demo_computes_again_and_says_why(tmp_path):
    copy = tmp_path / "copy" / "user_experiment.py"
    copy.parent.mkdir()
    text = FIXTURE.read_text()
    copy.write_text(text)
    first = run_json(f"{copy}:demo", tmp_path / "r")
    assert not first["reused"]
    copy.write_text(text.replace("1e-3", "2e-3"))
    second = run_json(f"{copy}:demo", tmp_path / "r")
    assert not second["reused"] and second["path"] != first["path"]
    assert Path(first["path"]).name in second["recomputed"] and "user_experiment.py was edited" in second["recomputed"]
    assert [c["tolerance"] for c in second["checks"]] == [2e-3]


def test_two_files_with_one_experiment_id_each_get_their_own_result(tmp_path):
    a = toy_file(tmp_path / "a" / "exp.py", value=1.0, check="check of a")
    b = toy_file(tmp_path / "b" / "exp.py", value=2.0, check="check of b")
    root = tmp_path / "r"
    ra, rb = run_json(a, root), run_json(b, root)
    assert not ra["reused"] and not rb["reused"] and ra["path"] != rb["path"]
    assert "another experiment file" in rb["recomputed"]
    for ref, name, path in ((a, "check of a", ra["path"]), (b, "check of b", rb["path"]),
                            (a, "check of a", ra["path"])):
        again = run_json(ref, root)
        assert again["reused"] and again["path"] == path and [c["name"] for c in again["checks"]] == [name]
    assert {r["config_hash"] for r in json.loads(cli("runs", "--results", root, "--json")[1])} == {
        Path(ra["path"]).name.rsplit("-", 1)[1], Path(rb["path"]).name.rsplit("-", 1)[1]}


@pytest.mark.parametrize("exp_id,fragment", [("linattn.fig1", "one of iclab's own experiments"),
                                             ("linattn.myfig", "namespace of iclab's own")])
def test_a_user_file_may_not_take_a_builtin_id_or_namespace(tmp_path, exp_id, fragment):
    ref = toy_file(tmp_path / "mine" / "exp.py", exp_id=exp_id)
    rc, out, err = cli("run", ref, "--out", tmp_path / "r", "--json")
    assert rc == 2 and not out and "Traceback" not in err
    assert len(lines(err)) == 1 and fragment in err and exp_id in err
    assert not (tmp_path / "r").exists()
    from iclab.experiments import get_experiment

    assert exp_id != "linattn.fig1" or get_experiment("linattn.fig1").builtin
