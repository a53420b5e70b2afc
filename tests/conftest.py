import os

# Under pytest-xdist every worker is a process with its own thread pools: share the cores out among them
# (iclab.threads), or W workers of one thread per core oversubscribe the machine W times.
if os.environ.get("PYTEST_XDIST_WORKER") and "ICLAB_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["ICLAB_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import iclab  # noqa: F401, E402  (turns on float64 before any test builds arrays)

import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# A small linattn.fig1 (P = 200 prompts, 3000 steps, records every 5 steps: 11 chunks of
# at most 64 records per engine loop) swept over two init scales: the reference that the fault and Ray tests compare with.
FIG1_SMALL = {"P": 200, "steps": 3000, "record_every": 5}


@pytest.fixture(scope="session")
def fig1_small() -> list[str]:
    """FIG1_SMALL as ``--set`` options."""
    return [a for k, v in FIG1_SMALL.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory) -> dict:
    """Environment for the subprocesses of the fault and Ray tests: CI mode, and one JAX
    persistent compilation cache for the session, so each process compiles linattn.fig1's loops
    only the first time (a cached executable is the same code: results are bit for bit equal)."""
    return {"CI": "true", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="session")
def fig1_twin(tmp_path_factory, fig1_small, jax_cache):
    """The results root of linattn.fig1 at FIG1_SMALL over w_init = 1e-6, 1e-4, computed once,
    uninterrupted, without checkpoints, by the local executor, on one thread: its bit-for-bit twins must
    compute on as many threads (XLA's reductions are split by thread count; 2 threads differ by an ulp)."""
    root = tmp_path_factory.mktemp("fig1-twin")
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6,1e-4",
                        *fig1_small, "--workers", "1", "--checkpoint-every", "0", "--json", "--out", str(root)],
                       capture_output=True, text=True, env=dict(os.environ, **jax_cache, ICLAB_THREADS="1"), timeout=600)
    assert r.returncode in (0, 1), r.stderr
    assert [p["status"] for p in json.loads(r.stdout)["points"]] == ["done", "done"]
    return root


@pytest.fixture
def chromium_browser():
    """A headless system Chromium driven by Playwright (skips without either; .ci/run installs Chromium)."""
    import shutil

    path = next(filter(None, (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))), None)
    if path is None:
        pytest.skip("no Chromium found (apt-get install chromium); .ci/run installs it in CI")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=path, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            yield browser
        finally:
            browser.close()


# -- a local Ray cluster (test_ray.py, test_shards.py) ------------------------------------------

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
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
def ray_cluster(jax_cache):
    """A Ray head on 127.0.0.1 with 2 CPUs (skips without the ray extra), in a new session and a temporary
    directory, stopped even when a test fails by ending the processes of that session (every process of this
    cluster, workers included, and nothing else: ``ray stop`` would end every Ray cluster of the machine).

    Yields {"env": the environment that finds it with ``auto``, "address": host:port, "sid": its session,
    "pids": () -> its live processes, "cmdline": pid -> a process's command line}."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    tmp = tempfile.mkdtemp(prefix="iclab-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = dict(os.environ, **jax_cache, RAY_TMPDIR=tmp, RAY_USAGE_STATS_ENABLED="0",
               # keep every address on the loopback interface (Ray otherwise swaps 127.0.0.1 for the
               # machine's outward address)
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    log = open(Path(tmp) / "start.log", "w")
    head = subprocess.Popen([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", str(Path(tmp) / "ray")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sid = head.pid  # start_new_session: the head is its session's leader
    try:
        assert head.wait(timeout=180) == 0, (Path(tmp) / "start.log").read_text()[-3000:]
        yield {"env": env, "address": f"127.0.0.1:{port}", "sid": sid, "pids": lambda: session_pids(sid),
               "cmdline": cmdline}
    finally:
        stop_session(sid)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def free_port():
    """A function returning a TCP port of 127.0.0.1 that nothing listens on (now)."""
    return _free_port
