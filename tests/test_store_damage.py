"""Fault injection on the result store: a damaged index, damaged run folders, bad paths, a full disk,
a truncated checkpoint, bad values, Ctrl-C and SIGKILL. Each case ends in one line of error (exit 2 for
bad input or a path, 1 for a failed run) or in a recovery, with no traceback and no finished result lost.

Runs use the user's demo experiment of ``tests/fixtures/user_experiment.py`` (a few seconds each), in
process through ``iclab.cli.main`` except where a signal is sent.
"""

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from iclab.cli import main

DEMO = f"{Path(__file__).parent / 'fixtures' / 'user_experiment.py'}:demo"


@pytest.fixture(scope="module", autouse=True)
def _forget_the_demo():
    """The demo registers itself when loaded: leave the registry as the other test modules expect it."""
    yield
    from iclab.experiments import unregister

    unregister("user.demo")


def cli(*args, env=None):
    err, out = io.StringIO(), io.StringIO()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = main([str(a) for a in args])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, out.getvalue(), err.getvalue()


def one_line(err: str, *fragments: str) -> None:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def runs_json(root) -> list:
    rc, out, err = cli("runs", "--results", root, "--json")
    assert rc == 0, err
    return json.loads(out)


def folders(root) -> dict[str, bytes]:
    """Every file of every finished run folder, by relative path (to show no result is lost or altered)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).glob("user.demo-*/*"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A store with two finished runs of the demo (H = 4 and H = 2), and its `runs --json`."""
    root = tmp_path_factory.mktemp("reference")
    for h in (4, 2):
        rc, _, err = cli("run", DEMO, "--out", root, "--set", f"H={h}")
        assert rc == 0, err
    return root, runs_json(root)


@pytest.fixture
def store(reference, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(reference[0], root)
    return root, reference[1]


def demo_folder(root, H: int) -> Path:
    for p in Path(root).glob("user.demo-*"):
        if json.loads((p / "config.json").read_text())["config"]["H"] == H:
            return p
    raise AssertionError(f"no run at H = {H}")


# -- 1. the index ----------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_an_unreadable_index_is_one_line_everywhere_and_rebuild_restores_it(store, damage):
    root, before = store
    index = root / "index.sqlite"
    if damage == "truncate":
        os.truncate(index, 100)
    else:
        index.write_bytes(np.random.default_rng(0).bytes(5000))
    kept = folders(root)
    for args in (["runs", "--results", root], ["runs", "--results", root, "--json"], ["report", "--results", root],
                 ["export", DEMO, "--results", root], ["run", DEMO, "--out", root, "--set", "H=3"]):
        rc, _, err = cli(*args)
        assert rc == 2, (args, err)
        one_line(err, "iclab index rebuild", str(root))
    rc, out, err = cli("index", "rebuild", "--results", root)
    assert rc == 0, err
    assert "indexed 2 stored runs" in out and list(root.glob("index.sqlite.old-*"))  # the damaged file is kept
    assert runs_json(root) == before
    assert folders(root) == kept


@pytest.mark.parametrize("damage", ["delete", "empty"])
def test_a_deleted_or_empty_index_is_rebuilt_on_first_use(store, damage):
    root, before = store
    if damage == "delete":
        (root / "index.sqlite").unlink()
    else:
        (root / "index.sqlite").write_bytes(b"")
    assert runs_json(root) == before
    rc, out, err = cli("report", "--results", root)
    assert rc == 0 and "report:" in out, err


def test_a_reused_folder_missing_from_the_index_is_indexed_again(store):
    root, before = store
    con = sqlite3.connect(root / "index.sqlite")
    con.execute("DELETE FROM runs WHERE id = ?", (before[0]["id"],))
    con.commit()
    con.close()
    assert len(runs_json(root)) == 1
    rc, out, err = cli("run", DEMO, "--out", root, "--set", f"H={before[0]['config']['H']}", "--json")
    assert rc == 0 and json.loads(out)["reused"], err
    assert {r["config_hash"] for r in runs_json(root)} == {r["config_hash"] for r in before}


def test_a_running_row_whose_process_died_is_shown_interrupted(store):
    root, _ = store
    from iclab.store import Store

    s = Store(root)
    row = s.begin("user.demo", "0" * 16, "quick", {"H": 9})  # no process holds its lock: as after SIGKILL
    rows = {r["id"]: r for r in runs_json(root)}
    assert rows[row]["status"] == "interrupted" and "process is gone" in rows[row]["error"]


# -- 2. divergence at the first record ---------------------------------------------------------------

def test_a_loss_not_finite_at_the_first_record_is_a_diverged_result(tmp_path):
    rc, out, err = cli("run", DEMO, "--out", tmp_path, "--set", "eigenvalues=[1e300,0.3,0.2]", "--json")
    assert rc == 1 and "Traceback" not in err
    result = json.loads(out)
    assert result["status"] == "diverged" and result["diverged"]["last_finite_loss"] is None
    arrays = np.load(Path(result["path"]) / "trajectories.npz")
    assert arrays["loss"].shape[-1] == 0
    assert (Path(result["path"]) / "figure.png").stat().st_size > 0
    assert runs_json(tmp_path)[0]["status"] == "diverged"


@pytest.mark.parametrize("value", ["[Infinity,0.3,0.2]", "[NaN,0.3,0.2]", "[-Infinity,0.3,0.2]", "[true,0.3,0.2]"])
def test_non_finite_and_boolean_list_elements_are_rejected(value, tmp_path):
    rc, _, err = cli("run", DEMO, "--out", tmp_path / "r", "--set", f"eigenvalues={value}")
    assert rc == 2
    one_line(err, "eigenvalues")
    assert not (tmp_path / "r").exists()


# -- 3. paths ------------------------------------------------------------------------------------------

def test_bad_result_paths_are_one_line_exit_2_and_write_nothing(store, tmp_path):
    root, _ = store
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["run", DEMO, "--out", a_file], "names a file"),
        (["run", DEMO, "--out", a_file / "under"], "lies under the file"),
        (["run", DEMO, "--out", ""], "is empty"),
        (["sweep", DEMO, "--grid", "H=2,3", "--out", a_file], "names a file"),
        (["sweep", DEMO, "--grid", "H=2,3", "--out", a_file / "x", "--dry-run"], "lies under the file"),
        (["export", DEMO, "--results", root, "--out", a_file / "x.csv"], "lies under the file"),
        (["export", DEMO, "--results", root, "--out", tmp_path], "is a folder"),
        (["export", DEMO, "--results", root, "--out", ""], "is empty"),
        (["report", "--results", root, "--out", a_file / "site"], "lies under the file"),
        (["report", "--results", a_file], "names a file"),
        (["runs", "--results", a_file / "x"], "lies under the file"),
    ]
    for args, fragment in cases:
        rc, _, err = cli(*args)
        assert rc == 2, (args, err)
        one_line(err, fragment)
    rc, _, err = cli("run", DEMO, env={"ICLAB_RESULTS": str(a_file / "r")})
    assert rc == 2
    one_line(err, "ICLAB_RESULTS", "lies under the file")
    assert not list(tmp_path.glob(".*tmp*")) and not list(tmp_path.glob("*.tmp*"))  # no temporary file left


@pytest.fixture
def tmpfs(tmp_path):
    """A 160 KB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_read_only_mount_is_one_line_exit_2(store, tmpfs):
    root, _ = store
    assert subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True).returncode == 0
    for args in (["run", DEMO, "--out", tmpfs / "r"], ["export", DEMO, "--results", root, "--out", tmpfs / "x.csv"],
                 ["report", "--results", root, "--out", tmpfs / "site"]):
        rc, _, err = cli(*args)
        assert rc == 2, (args, err)
        one_line(err, "not writable")


# -- 4. checkpoints -------------------------------------------------------------------------------------

def test_a_truncated_checkpoint_is_ignored_with_a_warning(tmp_path):
    from iclab.launch import identify, resolve_config
    from iclab.store import Store

    exp, config = resolve_config(DEMO, "quick", {"H": 3})
    digest = identify(exp, config, "quick").digest
    running = Store(tmp_path).running_dir(exp.id, digest)
    running.mkdir(parents=True)
    (running / "001-ATTN_M_population_engine-1.npz").write_bytes(b"PK\x03\x04xxxx")
    with pytest.warns(UserWarning, match="ignoring unreadable checkpoint"):
        rc, _, err = cli("run", DEMO, "--out", tmp_path, "--set", "H=3")
    assert rc == 0, err


# -- 5, 6. damaged run folders ---------------------------------------------------------------------------

DAMAGES = {
    "truncated metrics.json": lambda d: (d / "metrics.json").write_text((d / "metrics.json").read_text()[:40]),
    "metrics.json without checks": lambda d: (d / "metrics.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "metrics.json").read_text()).items() if k != "checks"})),
    "corrupt config.json": lambda d: (d / "config.json").write_text("{not json"),
    "truncated trajectories.npz": lambda d: os.truncate(d / "trajectories.npz", 100),
    "deleted trajectories.npz": lambda d: (d / "trajectories.npz").unlink(),
    "altered figure.png": lambda d: (d / "figure.png").write_bytes(b"\x89PNG not a figure"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_folder_is_never_reused_and_affects_that_run_alone(store, damage, tmp_path):
    root, _ = store
    bad, good = demo_folder(root, 2), demo_folder(root, 4)
    intact = {p.name: p.read_bytes() for p in good.iterdir()}
    DAMAGES[damage](bad)
    rc, out, err = cli("verify", "--results", root)
    assert rc == 1 and "1 of 2 stored runs intact" in out and bad.name in err
    # report and export skip it with one warning line and go on
    rc, out, err = cli("report", "--results", root)
    assert rc == 0, err
    one_line(err, "skipping the damaged run", bad.name)
    rc, out, err = cli("export", DEMO, "--results", root, "--out", tmp_path / "x.csv")
    assert rc == 0, err
    one_line(err, "skipping the damaged run", bad.name)
    assert len((tmp_path / "x.csv").read_text().splitlines()) == 2  # header + the intact run
    # --no-repair reports it; a plain run moves it aside and recomputes
    rc, _, err = cli("run", DEMO, "--out", root, "--set", "H=2", "--no-repair")
    assert rc == 1
    one_line(err, "is damaged", "--no-repair")
    rc, out, err = cli("run", DEMO, "--out", root, "--set", "H=2", "--json")
    assert rc == 0 and not json.loads(out)["reused"], err
    assert len(list((root / ".damaged").iterdir())) == 1  # kept, not deleted
    assert cli("verify", "--results", root)[0] == 0
    assert {p.name: p.read_bytes() for p in good.iterdir()} == intact


def test_a_sweep_recomputes_a_damaged_point_and_goes_on(store):
    root, _ = store
    DAMAGES["truncated trajectories.npz"](demo_folder(root, 2))
    rc, out, err = cli("sweep", DEMO, "--grid", "H=2,4", "--out", root, "--workers", "1", "--json")
    assert rc == 0, err
    statuses = {p["values"]["H"]: p["status"] for p in json.loads(out)["points"]}
    assert statuses == {2: "done", 4: "cached"}
    one_line(err, "is damaged", "recomputing")


# -- 7. a full disk ------------------------------------------------------------------------------------------

def test_enospc_while_writing_a_result_is_one_line_and_leaves_nothing_partial(tmp_path, monkeypatch):
    import iclab.store

    real = np.savez_compressed

    def full(file, **arrays):
        real(file, **arrays)
        with open(file, "ab") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(iclab.store.np, "savez_compressed", full)
    rc, _, err = cli("run", DEMO, "--out", tmp_path, "--set", "H=3")
    assert rc == 2
    one_line(err, "full", str(tmp_path))
    assert not list(tmp_path.glob("user.demo-*")) and not list((tmp_path / ".tmp").iterdir())
    assert [r["status"] for r in runs_json(tmp_path)] == ["failed"]


def test_a_full_tmpfs_is_one_line_and_a_rerun_succeeds_once_space_is_freed(tmpfs):
    filler = tmpfs / "filler"
    rc = 2
    for size in (150_000, 120_000, 90_000, 60_000):  # leave too little room for a result, whatever the fs overhead
        filler.write_bytes(b"\0" * size)
        rc, _, err = cli("run", DEMO, "--out", tmpfs / "r", "--set", "H=3")
        if rc == 2:
            break
    assert rc == 2
    one_line(err, "full")
    leftovers = [p for p in (tmpfs / "r").rglob("*") if ".tmp" in p.name or p.suffix == ".tmp"]
    assert not leftovers and not list((tmpfs / "r").glob("user.demo-*"))
    filler.unlink()
    rc, _, err = cli("run", DEMO, "--out", tmpfs / "r", "--set", "H=3")
    assert rc == 0, err


# -- 8, 9. values and options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["run", DEMO, "--set", "N=true"], "N must be a number, not a boolean"),
    (["run", DEMO, "--set", "steps=true"], "steps must be a number"),
    (["sweep", DEMO, "--grid", "N=15,true", "--dry-run"], "N must be a number"),
    (["run", DEMO, "--set", "N=3", "--set", "N=5"], "given twice"),
    (["sweep", DEMO, "--grid", "H=2", "--set", "N=3", "--set", "N=5"], "given twice"),
    (["run", DEMO, "--set", "seeds=2", "--seeds", "3"], "both --seeds"),
    (["run", DEMO, "--set", "lr=NaN"], "finite"),
    (["runs", "--limit", "0"], "--limit must be ≥ 1"),
    (["runs", "--limit", "-1"], "--limit must be ≥ 1"),
    (["runs", "--experiment", "nope.fig9"], "unknown experiment"),
    (["run", "linattn.fig1", "--set", "N=100000"], "needs about"),  # within N's bounds, but P·N·D is too large
])
def test_bad_values_and_options_are_one_line_exit_2(args, fragment, tmp_path):
    rc, _, err = cli(*args, "--results" if args[0] == "runs" else "--out", tmp_path / "r")
    assert rc == 2
    one_line(err, fragment)
    assert not (tmp_path / "r").exists()


def test_the_memory_limit_can_be_set(tmp_path):
    rc, _, err = cli("run", "linattn.fig1", "--set", "P=200", "--out", tmp_path, env={"ICLAB_MEMORY_LIMIT_GB": "0.0001"})
    assert rc == 2
    one_line(err, "needs about", "ICLAB_MEMORY_LIMIT_GB")
    rc, _, err = cli("run", "linattn.fig1", "--out", tmp_path, env={"ICLAB_MEMORY_LIMIT_GB": "lots"})
    assert rc == 2
    one_line(err, "ICLAB_MEMORY_LIMIT_GB must be a number")


def test_a_long_value_is_cut_in_the_message(tmp_path):
    rc, _, err = cli("run", DEMO, "--set", "eigenvalues=" + "x" * 100_000, "--out", tmp_path)
    assert rc == 2
    one_line(err, "eigenvalues")
    assert len(err) < 400


# -- signals -------------------------------------------------------------------------------------------------------

def _start(root, *extra):
    env = dict(os.environ, CI="true", ICLAB_CHECKPOINT_EVERY="1")
    # A background job of a non-interactive shell (as CI may start us) inherits SIGINT ignored, and Python
    # keeps an ignored SIGINT ignored: restore the default so the child gets Ctrl-C as a terminal user's would.
    return subprocess.Popen([sys.executable, "-m", "iclab.cli", "run", DEMO, "--out", str(root), "--set",
                             "steps=1000000", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_running(root, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if list(Path(root).glob(".running/*/*.npz")):  # a checkpoint: it is inside the training loop
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError("the run never started its loop")


def test_ctrl_c_prints_one_line_and_records_interrupted(tmp_path):
    proc = _start(tmp_path)
    _wait_running(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    one_line(err, "interrupted; run the same command to resume")
    (row,) = runs_json(tmp_path)
    assert row["status"] == "interrupted" and "Ctrl-C" in row["error"]


def test_a_sigkilled_run_is_shown_interrupted(tmp_path):
    proc = _start(tmp_path)
    _wait_running(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=60)
    (row,) = runs_json(tmp_path)
    assert row["status"] == "interrupted" and "process is gone" in row["error"]
