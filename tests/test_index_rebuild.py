"""``iclab index rebuild`` while a run is in progress keeps that run's row: the index is never silently incomplete."""

import json
import os
import subprocess
import sys
import textwrap
import time

from iclab.store import Store

EXPERIMENT = textwrap.dedent('''
    import os, time
    import numpy as np
    from iclab.experiments import Experiment, ExperimentConfig, check_abs


    def run(config, reporter):
        deadline = time.time() + 120
        while not os.path.exists(os.environ["REBUILD_GO"]) and time.time() < deadline:
            time.sleep(0.05)
        return {"x": np.ones(2)}


    def checks(config, arrays):
        return [check_abs("x", float(arrays["x"].sum()), 2.0, 0.0)]


    def plot(config, arrays):
        import matplotlib.pyplot as plt
        return plt.subplots()[0]


    slow = Experiment(id="rebuild.slow", title="waits for a file", paper="user", reference="none",
                      config=ExperimentConfig, presets={"quick": {}, "paper": {}}, run=run, checks=checks, plot=plot)
''')


def test_a_rebuild_during_a_run_keeps_its_row_and_the_run_ends_it(tmp_path):
    (tmp_path / "slow.py").write_text(EXPERIMENT)
    root, go = tmp_path / "r", tmp_path / "go"
    env = dict(os.environ, REBUILD_GO=str(go), ICLAB_THREADS="1")
    cmd = [sys.executable, "-m", "iclab.cli", "run", f"{tmp_path / 'slow.py'}:slow", "--out", str(root), "--json"]
    # a finished run first, so that the rebuild has a folder to index beside the running row
    (tmp_path / "go").write_text("")
    done = subprocess.run(cmd + ["--set", "seed=1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    go.unlink()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        store = Store(root, readonly=True)
        deadline = time.monotonic() + 120
        while not [r for r in store.rows() if r["status"] == "running"]:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never showed up as running"
            time.sleep(0.1)
        [running] = [r for r in store.rows() if r["status"] == "running"]
        n, aside = Store(root).rebuild_index()
        assert n == 1 and aside is not None and aside.is_file()  # one finished folder; the old index kept
        rows = {r["id"]: r for r in Store(root, readonly=True).rows()}
        assert rows[running["id"]]["status"] == "running" and len(rows) == 2
        go.write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    result = json.loads(out)
    rows = Store(root, readonly=True).rows()
    assert len(rows) == 2 and {r["status"] for r in rows} == {"done"}
    mine = [r for r in rows if r["id"] == running["id"]]
    assert len(mine) == 1 and mine[0]["run_dir"] == os.path.basename(result["path"])
    # a second rebuild, with nothing running, gives the same rows back
    Store(root).rebuild_index()
    again = Store(root, readonly=True).rows()
    assert [(r["id"], r["run_dir"], r["status"]) for r in again] == [(r["id"], r["run_dir"], r["status"]) for r in rows]
