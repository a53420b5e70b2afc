"""The Ray executor against a real local Ray cluster (head on the loopback address, 2 CPUs: the
``ray_cluster`` fixture of tests/conftest.py). A sweep through it with 2 workers, one of which is killed
part-way (Ray retries its task, which resumes from its checkpoint), must give exactly the local
executor's results.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")


@pytest.mark.slow  # a Ray head (tens of seconds to start) and a killed worker
def test_sweep_on_ray_equals_the_local_executor_and_survives_a_dead_worker(ray_cluster, fig1_twin, fig1_small,
                                                                            tmp_path):
    cluster = ray_cluster
    env = dict(cluster["env"], ICLAB_RESULTS=str(tmp_path), ICLAB_CHECKPOINT_EVERY="1", ICLAB_THREADS="1")  # as fig1_twin
    sweep = subprocess.Popen([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6,1e-4",
                              *fig1_small, "--executor", "ray", "--address", "auto", "--workers", "2", "--json"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        # Kill one worker while it computes a point, once both points have saved a checkpoint.
        deadline = time.time() + 300
        while killed is None and sweep.poll() is None and time.time() < deadline:
            if len({p.parent for p in tmp_path.glob(".running/*/*.npz")}) == 2:
                busy = [p for p in cluster["pids"]() if cluster["cmdline"](p).startswith("ray::compute_point")]
                if busy:
                    os.kill(busy[0], signal.SIGKILL)
                    killed = busy[0]
            time.sleep(0.05)
        out, err = sweep.communicate(timeout=400)
    finally:
        sweep.kill()
        sweep.wait()
    assert sweep.returncode in (0, 1), err
    assert killed is not None, "no Ray worker was seen computing"
    res = json.loads(out)
    assert res["executor"] == "ray" and [p["status"] for p in res["points"]] == ["done", "done"]

    resumed = 0
    for point in res["points"]:
        mine = Path(point["path"])
        twin = fig1_twin / mine.name  # same config, same hash
        a, b = np.load(mine / "trajectories.npz"), np.load(twin / "trajectories.npz")
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # every array, bit for bit
        ma, mb = json.loads((mine / "metrics.json").read_text()), json.loads((twin / "metrics.json").read_text())
        assert ma["checks"] == mb["checks"]  # every metric
        resumed += bool(ma.get("resumed"))
    assert resumed >= 1, err  # the killed task was retried and resumed from its checkpoint
    assert not list(tmp_path.glob(".running/*/*"))


def test_ray_executor_without_a_cluster_is_a_one_line_error(tmp_path, free_port):
    port = free_port()  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6",
                        "--executor", "ray", "--address", f"127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CI="true", ICLAB_RESULTS=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "ray start --head" in r.stderr
