"""Sweeps, resume, divergence, failures, the run lock, the index under concurrency, runs and export.

In process, on a toy experiment (gradient descent on a quadratic through the population engine)
registered for these tests only: fast, and it exercises the same launcher, loop and store code
paths as the real experiments (those run end to end in test_faults.py and test_ray.py).
"""

import contextlib
import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

from iclab.cli import main
from iclab.engines import population
from iclab.experiments import Experiment, ExperimentConfig, check_abs, param, register, unregister
from iclab.launch import UserError, run_experiment
from iclab.progress import Reporter
from iclab.store import RunLock, Store
from iclab.sweep import parse_grid, parse_grid_option, run_sweep, split_values

TOY = "iclabtest.toy"


class ToyConfig(ExperimentConfig):
    a: float = param(1.0, "curvature of L(x) = a x² / 2", gt=0, le=100)
    lr: float = param(0.1, "GD learning rate (diverges above 2/a)", gt=0, le=100)
    steps: int = param(400, "GD steps", ge=1, le=100_000)
    record_every: int = param(5, "record spacing", ge=1, le=1000)
    fail: bool = param(False, "raise in run (an injected exception)")
    tasks: int = param(2, "engine runs, one reporter task each", ge=1, le=5)


def run_toy(config: ToyConfig, reporter) -> dict:
    if config.fail:
        raise RuntimeError("injected failure")
    out = {}
    for i in range(config.tasks):
        x0 = jnp.full((config.seeds, 3), 1.0 + i)
        with reporter.task(f"toy {i}", config.steps) as cb:
            tr = population.gradient_descent(lambda x, a: 0.5 * a * jnp.sum(x**2), x0, jnp.full((config.seeds,), config.a),
                                             lr=config.lr, n_steps=config.steps, record_every=config.record_every,
                                             metrics={"norm": lambda x, a: jnp.sqrt(jnp.sum(x**2))}, batched=True,
                                             callback=cb, record_params=True)
        out[f"loss{i}"], out[f"norm{i}"], out[f"params{i}"], out["t"] = tr.loss, tr.metrics["norm"], tr.params, tr.t
    return out


def checks_toy(config: ToyConfig, r: dict) -> list:
    # GD on a x²/2 contracts by (1 − lr a) per step: the final loss is known in closed form.
    expected = 0.5 * config.a * 3 * (1 - config.lr * config.a) ** (2 * config.steps)
    return [check_abs("final loss of task 0", float(np.max(r["loss0"][..., -1])), expected, 1e-12 + 1e-9 * expected)]


def plot_toy(config: ToyConfig, r: dict):
    from iclab.experiments._plot import figure

    fig, axes = figure()
    axes[0, 0].plot(r["t"], np.atleast_2d(r["loss0"])[0])
    return fig


@pytest.fixture(scope="module", autouse=True)
def toy():
    register(Experiment(id=TOY, title="toy", paper="test", reference="none", config=ToyConfig,
                        presets={"quick": {}, "paper": {"steps": 800}}, run=run_toy, checks=checks_toy,
                        plot=plot_toy, grid={"lr": [0.05, 0.1]}))
    yield
    unregister(TOY)


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def index(root):
    return sqlite3.connect(os.path.join(root, "index.sqlite")).execute(
        "SELECT config_hash, status, error, diverged_step, last_finite_loss FROM runs ORDER BY id").fetchall()


# -- grids ------------------------------------------------------------------------------------

def test_grid_values_split_outside_brackets_and_parse_as_json():
    assert split_values("1,[2,3],'a,b'") == ["1", "[2,3]", "'a,b'"]
    assert parse_grid_option("w_init=1e-6,1e-4") == ("w_init", [1e-6, 1e-4])
    assert parse_grid_option("eigenvalues=[[0.4,0.3],[0.5,0.2]]") == ("eigenvalues", [[0.4, 0.3], [0.5, 0.2]])
    assert parse_grid_option("eigenvalues=[0.4,0.3],[0.5,0.2]") == ("eigenvalues", [[0.4, 0.3], [0.5, 0.2]])
    assert parse_grid_option("method=gd,gf") == ("method", ["gd", "gf"])
    assert parse_grid_option("x=3") == ("x", [3])
    for bad in ("x", "=1", "x=", "x=1,,2", "x=[]"):
        with pytest.raises(UserError):
            parse_grid_option(bad)
    with pytest.raises(UserError):
        parse_grid(["x=1", "x=2"])


def test_sweep_validates_every_point_before_running_and_writes_nothing(tmp_path):
    rc, _, err = cli("sweep", TOY, "--grid", "lr=0.1,-1", "--workers", "1", "--out", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "lr" in err and "-1" in err
    rc, _, err = cli("sweep", TOY, "--grid", "lr=0.1", "--set", "lr=0.2", "--out", str(tmp_path))
    assert rc == 2 and "both" in err
    rc, _, err = cli("sweep", "linattn.fig1", "--out", str(tmp_path))  # declares no grid
    assert rc == 2 and "--grid" in err
    rc, _, err = cli("sweep", TOY, "--executor", "spark", "--out", str(tmp_path))
    assert rc == 2 and "executor" in err
    assert list(tmp_path.iterdir()) == []


# -- runs: resume, divergence, failure -----------------------------------------------------------

class KillAfter(Reporter):
    """Stands in for a kill: raises (like SIGINT) after ``n`` progress updates of the run."""

    def __init__(self, n):
        self.n = n

    @contextlib.contextmanager
    def task(self, description, total):
        def update(step, obs):
            self.n -= 1
            if self.n < 0:
                raise KeyboardInterrupt

        from iclab.progress import TaskCallback

        yield TaskCallback(update)


def test_a_stopped_run_resumes_from_its_checkpoints_bit_for_bit(tmp_path):
    # 1001 records per task: the first, then chunks of 1, 15 × 64 and 39 records (a chunk after the first
    # holds as many records as fit in 2 s, at most 64: here always 64, a record costs microseconds)
    over = {"steps": 2000, "record_every": 2}
    twin = run_experiment(TOY, "quick", over, seeds=2, root=tmp_path / "twin", checkpoint_every=0)
    # 18 progress updates per task (the first record, 17 chunks); stopped at the 25th update: in the
    # second task after its 6th chunk, whose last checkpoint (every 2 chunks) holds 4 chunks: 1 + 3 · 64
    # records, step 2 · 193 = 386.
    with pytest.raises(KeyboardInterrupt):
        run_experiment(TOY, "quick", over, seeds=2, root=tmp_path / "r", reporter=KillAfter(24), checkpoint_every=2)
    store = Store(tmp_path / "r")
    running = sorted(p.name for p in store.root.joinpath(".running").iterdir() for p in p.iterdir())
    assert running == ["001-toy_0-1.npz", "002-toy_1-1.npz"]
    resumed = run_experiment(TOY, "quick", over, seeds=2, root=tmp_path / "r", checkpoint_every=2)
    assert not resumed.reused and resumed.status == "done" and resumed.passed
    assert resumed.resumed == ["toy 0: resumed at step 2000 of 2000 (finished)", "toy 1: resumed at step 386 of 2000"]
    a, b = np.load(twin.path / "trajectories.npz"), np.load(resumed.path / "trajectories.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bit for bit
    assert [r[1] for r in index(store.root)] == ["interrupted", "done"]
    assert not (store.root / ".running" / resumed.path.name).exists()  # checkpoints gone once stored
    assert "resumed: toy 1: resumed at step 386" in (resumed.path / "log.txt").read_text()


def test_checkpoints_of_another_config_or_a_changed_loop_are_not_used(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_experiment(TOY, "quick", {"steps": 2000, "record_every": 2}, root=tmp_path, reporter=KillAfter(10),
                       checkpoint_every=1)
    folder = next((tmp_path / ".running").iterdir())
    # Same folder, loop with other settings (record spacing): the checkpoint must be ignored.
    from iclab.checkpoint import RunCheckpoints
    from iclab.progress import RunReporter

    cfg = ToyConfig(steps=2000, record_every=4)
    reporter = RunReporter(Reporter(), RunCheckpoints(folder, every_chunks=1))
    r = run_toy(cfg, reporter)
    assert reporter.checkpoints.events == []
    ref = run_toy(cfg, Reporter())
    np.testing.assert_array_equal(r["loss0"], ref["loss0"])


def test_a_diverging_run_is_marked_diverged_with_its_finite_trajectory(tmp_path):
    rc, out, _ = cli("run", TOY, "--set", "lr=2.5", "--set", "steps=1000", "--json", "--out", str(tmp_path))
    assert rc == 1
    res = json.loads(out)
    assert res["status"] == "diverged" and not res["passed"]
    div = res["diverged"]
    # |1 − lr a| = 1.5: the loss 1.5·2.25^k overflows float64 at k = 875.
    assert div["task"] == "toy 0" and div["step"] == 875 and div["last_finite_step"] == div["step"] - 5
    expected = 0.5 * 3 * 2.25 ** div["last_finite_step"]
    assert div["last_finite_loss"] == pytest.approx(expected, rel=1e-9)
    arrays = np.load(os.path.join(res["path"], "trajectories.npz"))
    assert np.all(np.isfinite(arrays["loss"])) and arrays["step"][-1] == div["last_finite_step"]
    assert arrays["loss"].shape == (1, div["last_finite_step"] // 5 + 1)
    (row,) = index(tmp_path)
    assert row[1] == "diverged" and row[3] == div["step"] and row[4] == pytest.approx(expected, rel=1e-9)
    # A diverged result is a result: it is reused, and still reported as diverged.
    rc, out, _ = cli("run", TOY, "--set", "lr=2.5", "--set", "steps=1000", "--json", "--out", str(tmp_path))
    assert rc == 1 and json.loads(out)["reused"] and json.loads(out)["status"] == "diverged"


def test_a_sweep_goes_on_past_a_failed_and_a_diverged_point_and_exits_1(tmp_path):
    rc, out, _ = cli("sweep", TOY, "--grid", "fail=false,true", "--grid", "lr=0.1,2.5", "--set", "steps=1000",
                     "--workers", "1", "--json", "--out", str(tmp_path))
    assert rc == 1
    res = json.loads(out)
    status = {(p["values"]["fail"], p["values"]["lr"]): p["status"] for p in res["points"]}
    assert status == {(False, 0.1): "done", (False, 2.5): "diverged", (True, 0.1): "failed", (True, 2.5): "failed"}
    failed = [p for p in res["points"] if p["status"] == "failed"]
    assert all(p["error"] == "RuntimeError: injected failure" for p in failed)
    assert res["counts"] == {"done": 1, "cached": 0, "diverged": 1, "failed": 2}
    assert sorted(r[1] for r in index(tmp_path)) == ["diverged", "done", "failed", "failed"]
    # The text report names the failures at the end.
    rc, out, _ = cli("sweep", TOY, "--grid", "fail=false,true", "--grid", "lr=0.1,2.5", "--set", "steps=1000",
                     "--workers", "1", "--out", str(tmp_path))
    assert rc == 1 and "failed fail=true lr=0.1: RuntimeError: injected failure" in out
    assert "4 points: 0 done, 1 cached, 1 diverged, 2 failed" in out
    # runs lists them from the index.
    rc, out, _ = cli("runs", "--status", "failed", "--json", "--results", str(tmp_path))
    assert rc == 0 and len(json.loads(out)) == 4 and all(r["config"]["fail"] for r in json.loads(out))
    rc, _, err = cli("runs", "--status", "broken", "--results", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1


def test_sweep_uses_the_experiments_own_grid_and_reuses_stored_points(tmp_path):
    rc, out, _ = cli("sweep", TOY, "--workers", "1", "--json", "--out", str(tmp_path))
    assert rc == 0
    res = json.loads(out)
    assert [p["values"] for p in res["points"]] == [{"lr": 0.05}, {"lr": 0.1}]
    assert res["counts"]["done"] == 2
    rc, out, _ = cli("sweep", TOY, "--grid", "lr=0.1,0.2", "--workers", "1", "--json", "--out", str(tmp_path))
    assert rc == 0 and json.loads(out)["counts"] == {"done": 1, "cached": 1, "diverged": 0, "failed": 0}
    rc, out, _ = cli("sweep", TOY, "--grid", "lr=0.1,0.3", "--dry-run", "--json", "--out", str(tmp_path))
    assert rc == 0 and [p["stored"] for p in json.loads(out)["points"]] == [True, False]


# -- export and runs -------------------------------------------------------------------------------

def test_export_csv_and_parquet_one_row_per_run(tmp_path, monkeypatch):
    run_sweep(TOY, {"lr": [0.2, 0.1], "fail": [False, True]}, root=tmp_path, workers=1)
    rc, out, err = cli("export", TOY, "--results", str(tmp_path), "--out", str(tmp_path / "t.csv"))
    assert rc == 0, err
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert [(r["config.lr"], r["config.fail"], r["status"]) for r in rows] == [
        ("0.1", "False", "done"), ("0.1", "True", "failed"), ("0.2", "False", "done"), ("0.2", "True", "failed")]
    assert float(rows[0]["check.final loss of task 0"]) == pytest.approx(1.5 * 0.9 ** 800, rel=1e-9)
    assert rows[1]["error"] == "RuntimeError: injected failure"

    pq = pytest.importorskip("pyarrow.parquet")
    rc, out, err = cli("export", TOY, "--format", "parquet", "--results", str(tmp_path))
    assert rc == 0, err
    table = pq.read_table(tmp_path / "exports" / f"{TOY}.parquet").to_pylist()
    assert [(r["config.lr"], r["status"]) for r in table] == [(0.1, "done"), (0.1, "failed"), (0.2, "done"), (0.2, "failed")]
    assert table[0]["check.final loss of task 0"] == float(rows[0]["check.final loss of task 0"])

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    rc, _, err = cli("export", TOY, "--format", "parquet", "--results", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "pyarrow" in err
    rc, _, err = cli("export", TOY, "--format", "xlsx", "--results", str(tmp_path))
    assert rc == 2 and "csv" in err
    rc, _, err = cli("export", TOY, "--results", str(tmp_path / "empty"))
    assert rc == 1 and "No stored runs" in err


# -- the lock and the index under concurrency ---------------------------------------------------------

def _python(code: str, **kw):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_run_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    path = tmp_path / "x.lock"
    holder = _python(f"""
        import sys, time
        from iclab.store import RunLock
        lock = RunLock({str(path)!r}); lock.acquire(); print("held", flush=True); time.sleep(120)
    """)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = RunLock(path)
        assert not lock.acquire(blocking=False)
        holder.kill()  # SIGKILL: the kernel releases the flock
        holder.wait()
        deadline = time.time() + 10
        while not lock.acquire(blocking=False):
            assert time.time() < deadline
            time.sleep(0.05)
        assert lock.held
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_index_survives_concurrent_writers(tmp_path):
    code = f"""
        from iclab.store import Store
        s = Store({str(tmp_path)!r})
        for i in range(60):
            row = s.begin("x.fig1", "%016x" % i, "quick", {{"i": i}})
            s.end(row, "done", 0.1, 1, 1)
    """
    procs = [_python(code) for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    con = sqlite3.connect(tmp_path / "index.sqlite")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("SELECT COUNT(*), SUM(status = 'done') FROM runs").fetchone() == (240, 240)


def test_old_index_is_migrated_to_the_new_statuses(tmp_path):
    con = sqlite3.connect(tmp_path / "index.sqlite")
    con.executescript("""
        CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, run_dir TEXT NOT NULL, experiment TEXT NOT NULL,
            config_hash TEXT NOT NULL, preset TEXT, status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed')),
            started REAL NOT NULL, ended REAL, wall_s REAL, checks_passed INTEGER, checks_total INTEGER, error TEXT);
        INSERT INTO runs (run_dir, experiment, config_hash, preset, status, started)
            VALUES ('x-000000000000000a', 'x', '000000000000000a', 'quick', 'done', 1.0);
    """)
    con.commit()
    con.close()
    store = Store(tmp_path)
    row = store.begin("x", "000000000000000b", "quick")
    store.end(row, "diverged", 1.0, 0, 0, error="loss not finite", diverged_step=3, last_finite_loss=2.0)
    rows = store.rows()
    assert [(r["config_hash"], r["status"]) for r in rows] == [("000000000000000b", "diverged"),
                                                                ("000000000000000a", "done")]
    assert rows[0]["diverged_step"] == 3
