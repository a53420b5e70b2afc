"""The Ray executor against a real local Ray cluster (head on the loopback address, 2 CPUs).

The cluster is started with ``ray start --head`` in a new session and a temporary directory, and
stopped, even when a test fails, by ending the processes of that session (every process of this
cluster, workers included, and nothing else: ``ray stop`` would end every Ray cluster of the
machine). A sweep
through it with 2 workers, one of which is killed part-way (Ray retries its task, which resumes
from its checkpoint), must give exactly the local executor's results.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """The live processes of a session (Ray puts its workers in process groups of their own, but
    they stay in the session of the ``ray start`` that we made a session leader)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_session(sid: int) -> None:
    """Ends every process of the cluster's session, by pid: SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 15)):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while session_pids(sid) and time.time() < deadline:
            time.sleep(0.1)
    assert not session_pids(sid), "Ray processes survived SIGKILL"


@pytest.fixture(scope="module")
def cluster(jax_cache):
    """A Ray head on 127.0.0.1 with 2 CPUs; yields the environment that finds it with ``auto``."""
    tmp = tempfile.mkdtemp(prefix="iclab-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, **jax_cache, RAY_TMPDIR=tmp, RAY_USAGE_STATS_ENABLED="0",
               # keep every address on the loopback interface (Ray otherwise swaps 127.0.0.1 for the
               # machine's outward address)
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    log = open(Path(tmp) / "start.log", "w")
    head = subprocess.Popen([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", str(Path(tmp) / "ray")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sid = head.pid  # start_new_session: the head is its session's leader
    try:
        assert head.wait(timeout=180) == 0, (Path(tmp) / "start.log").read_text()[-3000:]
        yield {"env": env, "address": f"127.0.0.1:{port}", "sid": sid}
    finally:
        stop_session(sid)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_sweep_on_ray_equals_the_local_executor_and_survives_a_dead_worker(cluster, fig1_twin, fig1_small, tmp_path):
    env = dict(cluster["env"], ICLAB_RESULTS=str(tmp_path), ICLAB_CHECKPOINT_EVERY="1")
    sweep = subprocess.Popen([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6,1e-4",
                              *fig1_small, "--executor", "ray", "--address", "auto", "--workers", "2", "--json"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        # Kill one worker while it computes a point, once both points have saved a checkpoint.
        deadline = time.time() + 300
        while killed is None and sweep.poll() is None and time.time() < deadline:
            if len({p.parent for p in tmp_path.glob(".running/*/*.npz")}) == 2:
                busy = [p for p in session_pids(cluster["sid"]) if cmdline(p).startswith("ray::compute_point")]
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


def test_ray_executor_without_a_cluster_is_a_one_line_error(tmp_path):
    port = free_port()  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6",
                        "--executor", "ray", "--address", f"127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CI="true", ICLAB_RESULTS=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "ray start --head" in r.stderr
