"""Faults end to end, through the CLI in subprocesses, on a small linattn.fig1 (conftest.FIG1_SMALL):
a run and a sweep killed with SIGKILL part-way and run again equal their uninterrupted twin; two
processes asking for the same run compute it once; a diverging learning rate is marked diverged.
"""

import contextlib
import csv
import io
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from iclab.cli import main

ENV: dict = {}

ICLAB = [sys.executable, "-m", "iclab.cli"]


@pytest.fixture(autouse=True)
def _env(jax_cache):
    global ENV
    ENV = jax_cache


def env_for(root, **extra):
    # one thread, as fig1_twin computes (bit-for-bit comparisons need the same thread count)
    return dict(os.environ, **ENV, ICLAB_RESULTS=str(root), ICLAB_THREADS="1", **extra)


def iclab(*args, root, timeout=300, **extra):
    return subprocess.run([*ICLAB, *args], capture_output=True, text=True, env=env_for(root, **extra), timeout=timeout)


def start(*args, root, **extra):
    return subprocess.Popen([*ICLAB, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_for(root, **extra))


def export(root) -> str:
    """``iclab export linattn.fig1`` of a results root, as CSV text (in process)."""
    out = Path(root) / "export.csv"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["export", "linattn.fig1", "--results", str(root), "--out", str(out)])
    assert rc == 0, err.getvalue()
    return out.read_text()


def wait_for(predicate, timeout=240, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def checkpoints(root):
    return sorted(p.name for p in Path(root).glob(".running/*/*.npz"))


def rows(root):
    return sqlite3.connect(Path(root) / "index.sqlite").execute(
        "SELECT config_hash, status FROM runs ORDER BY id").fetchall()


def twin_dir(twin, w_init):
    for path in Path(twin).glob("linattn.fig1-*"):
        if json.loads((path / "config.json").read_text())["config"]["w_init"] == w_init:
            return path
    raise AssertionError(f"no twin run at w_init={w_init}")


def assert_same_run(a: Path, b: Path):
    x, y = np.load(a / "trajectories.npz"), np.load(b / "trajectories.npz")
    assert sorted(x.files) == sorted(y.files)
    for k in x.files:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)  # bit for bit
    assert json.loads((a / "metrics.json").read_text())["checks"] == json.loads((b / "metrics.json").read_text())["checks"]


def children(pid):
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nPPid:\t{pid}\n" in text:
            out.append(int(status.parent.name))
    return out


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("\nState:\t")[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_run_killed_mid_way_resumes_to_the_uninterrupted_result(tmp_path, fig1_twin, fig1_small):
    proc = start("run", "linattn.fig1", *fig1_small, "--json", root=tmp_path, ICLAB_CHECKPOINT_EVERY="1")
    try:  # kill it once the second engine loop has saved a checkpoint
        wait_for(lambda: any(n.startswith("002-") for n in checkpoints(tmp_path)) or proc.poll() is not None,
                 what="a checkpoint of the second loop")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not list(tmp_path.glob("linattn.fig1-*")), "the run finished before it was killed"
    assert rows(tmp_path)[0][1] == "running"  # what a killed process leaves

    again = iclab("run", "linattn.fig1", *fig1_small, "--json", root=tmp_path, ICLAB_CHECKPOINT_EVERY="1")
    assert again.returncode in (0, 1), again.stderr
    res = json.loads(again.stdout)
    assert res["status"] == "done" and not res["reused"]
    assert res["resumed"] and res["resumed"][0] == "population attn_m: resumed at step 3000 of 3000 (finished)"
    assert_same_run(Path(res["path"]), twin_dir(fig1_twin, 1e-6))
    assert [s for _, s in rows(tmp_path)] == ["interrupted", "done"]
    assert not list(tmp_path.glob(".running/*/*"))


@pytest.mark.slow
def test_sweep_killed_at_a_random_moment_finishes_every_point_once_on_rerun(tmp_path, fig1_twin, fig1_small):
    seed = random.randrange(10**6)
    delay = random.Random(seed).uniform(0.0, 3.0)
    args = ["sweep", "linattn.fig1", "--grid", "w_init=1e-6,1e-4", *fig1_small, "--workers", "2"]
    proc = start(*args, root=tmp_path, ICLAB_CHECKPOINT_EVERY="1")
    workers = []
    try:
        wait_for(lambda: checkpoints(tmp_path) or proc.poll() is not None, what="a first checkpoint")
        workers = children(proc.pid)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    print(f"killed the sweep {delay:.2f} s after its first checkpoint (seed {seed})")
    # Its pool workers die with it (PR_SET_PDEATHSIG): nothing goes on computing behind our back.
    wait_for(lambda: not any(alive(p) for p in workers), timeout=30, what="the pool workers to exit")

    again = iclab(*args, "--json", root=tmp_path, ICLAB_CHECKPOINT_EVERY="1")
    assert again.returncode in (0, 1), again.stderr
    res = json.loads(again.stdout)
    assert all(p["status"] in ("done", "cached") for p in res["points"]) and len(res["points"]) == 2
    done = [h for h, s in rows(tmp_path) if s == "done"]
    assert sorted(done) == sorted(p["config_hash"] for p in res["points"])  # every point done exactly once
    assert {s for _, s in rows(tmp_path)} <= {"done", "interrupted"}
    mine, twin = export(tmp_path), export(fig1_twin)
    assert mine == twin
    assert len(list(csv.DictReader(io.StringIO(mine)))) == 2


def test_two_processes_on_one_config_compute_it_once(tmp_path, fig1_small):
    args = ["run", "linattn.fig1", *fig1_small, "--set", "w_init=1e-5", "--json"]
    procs = [start(*args, root=tmp_path) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode in (0, 1), err
        results.append(json.loads(out))
    assert sorted(r["reused"] for r in results) == [False, True]  # one computes, one reuses
    assert results[0]["path"] == results[1]["path"]
    assert [s for _, s in rows(tmp_path)] == ["done"]
    path = Path(results[0]["path"])
    assert json.loads((path / "metrics.json").read_text())["status"] == "done"
    np.load(path / "trajectories.npz")["population_attn_m"]
    assert not list(tmp_path.glob(".tmp/*")) and not list(tmp_path.glob(".running/*"))


def test_a_diverging_learning_rate_is_marked_diverged(tmp_path):
    r = iclab("run", "linattn.fig1", "--set", "lr=9", "--set", "P=200", "--json", root=tmp_path)
    assert r.returncode == 1, r.stderr
    res = json.loads(r.stdout)
    div = res["diverged"]
    assert res["status"] == "diverged" and div["task"] == "population attn_m"
    assert div["step"] > div["last_finite_step"] >= 0 and np.isfinite(div["last_finite_loss"])
    arrays = np.load(Path(res["path"]) / "trajectories.npz")
    assert np.all(np.isfinite(arrays["loss"])) and arrays["step"][-1] == div["last_finite_step"]
    (row,) = sqlite3.connect(tmp_path / "index.sqlite").execute(
        "SELECT status, diverged_step, last_finite_loss, error FROM runs").fetchall()
    assert row[:3] == ("diverged", div["step"], div["last_finite_loss"]) and "not finite" in row[3]
    out = io.StringIO()  # reused (in process): still reported as diverged, exit 1
    with contextlib.redirect_stdout(out):
        rc = main(["run", "linattn.fig1", "--set", "lr=9", "--set", "P=200", "--out", str(tmp_path)])
    assert rc == 1 and "diverged" in out.getvalue() and "last finite loss" in out.getvalue()
