import os

# Under pytest-xdist every worker is a process with its own thread pools: share the cores out among them
# (iclab.threads), or W workers of one thread per core oversubscribe the machine W times.
if os.environ.get("PYTEST_XDIST_WORKER") and "ICLAB_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["ICLAB_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))

import iclab  # noqa: F401, E402  (turns on float64 before any test builds arrays)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# A small linattn.fig1 (P = 200 prompts, 3000 steps, records every 5 steps: 10 chunks per engine
# loop) swept over two init scales: the reference that the fault and Ray tests compare with.
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
    uninterrupted, without checkpoints, by the local executor."""
    root = tmp_path_factory.mktemp("fig1-twin")
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "sweep", "linattn.fig1", "--grid", "w_init=1e-6,1e-4",
                        *fig1_small, "--workers", "1", "--checkpoint-every", "0", "--json", "--out", str(root)],
                       capture_output=True, text=True, env=dict(os.environ, **jax_cache), timeout=600)
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
