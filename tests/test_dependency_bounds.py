"""pyproject.toml's bounds of jax, jaxlib, numba and llvmlite are the versions iclab is tested with: both ends.

The slow test builds a fresh virtual environment with the lowest (resp. newest) versions the bounds allow, installs
iclab from this repository into it (a plain ``pip install``: no editable install, no extras) and runs one quick
preset per paper through the CLI there, every check passing (exit 0). The other dependencies are constraints.txt's
pins, except where the lowest set needs older ones (``LOWEST_NEEDS``). It needs the package index: where
``pip download`` cannot reach it, it skips. The newest set is constraints.txt's pins (the environment ``make test``
installs, the fast test below keeps the two equal); its fresh environment checks a plain, non-editable install.

What fails below the lower bounds (found by installing them, and kept here for whoever moves them):

- jax/jaxlib 0.9.1 and 0.9.2: with one XLA thread (``--threads 1``, ``ICLAB_THREADS=1``: what each of CI's two
  pytest-xdist workers gets on 2 cores) linattn.fig1 hangs for good inside jaxlib's LAPACK SVD kernel
  (``lapack_dgesdd_ffi`` waits for its thread pool, whose one thread is itself, in a while loop); with 2 threads
  it passes. Fixed in 0.10.0.
- jaxlib < 0.9.1: XLA's FFI is API 0.2 (0.8.x, 0.9.0, 0.9.0.1) and refuses iclab's handler, which follows API 0.3
  (``iclab.ops._runtime.ffi``): host calls fall back to JAX's handler, which copies every operand
  (tests/ops/test_host.py fails). Below jax 0.8.2 ``emit_python_callback`` has no ``returns_token``, so
  ``host_call`` falls back to ``jax.pure_callback``; with jax 0.4.38's, gating.fig1 and drift.fig1 deadlock.
- llvmlite < 0.45 (so numba < 0.62, which needs llvmlite 0.44 or older): LLVM 15 cannot parse the kernels' opaque
  pointers (``ptr``), so the LLVM-IR kernels (``iclab.ops._runtime.llvm``) fail to compile: gating.fig1 and
  drift.fig1 exit with an LLVM IR parsing error.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
BOUNDED = ("jax", "jaxlib", "numba", "llvmlite")
# one quick preset per paper; gating.fig1 and drift.fig1 run the LLVM-IR and numba kernels and the host calls,
# linattn.fig1 jaxlib's LAPACK (the SVD that hangs below the lower bound), mhsa.fig3 the softmax model
PRESETS = ("linattn.fig1", "gating.fig1", "drift.fig1", "mhsa.fig3")

# What the lowest set needs besides constraints.txt's pins (the newest releases); each pin is the newest release
# that the lowest set accepts:
LOWEST_NEEDS = {
    "numpy": "2.3.5",  # numba 0.62 requires numpy < 2.4 (constraints.txt: 2.4.6)
}
# constraints.txt's pins that are never installed here: the llm extra's (not needed by the presets; an unpinned
# torch resolves to a multi-GB CUDA build)
NOT_INSTALLED = {"torch", "transformers"}

INSTALL_TIMEOUT = 1800  # s: a fresh environment downloads a few hundred MB (pip's cache makes it a minute)
RUN_TIMEOUT = 900       # s: each preset takes 10-90 s on 2 cores, plus its compilation

# In the environment: the installed versions, where iclab was imported from, and whether the host calls take
# iclab's zero-copy paths (the lower bound of jax is where they do).
PROBE = """
import json
from importlib.metadata import version
import jax, iclab
jax.numpy.zeros(1).block_until_ready()  # the CPU client first: the FFI handler registers with a started backend
from iclab.ops._runtime import ffi
from iclab.ops._runtime.host import host_call
print(json.dumps({"versions": {n: version(n) for n in ("jax", "jaxlib", "numba", "llvmlite", "numpy")},
                  "iclab": iclab.__file__, "direct": bool(host_call.direct), "ffi": bool(ffi.available())}))
"""


def bounds() -> dict[str, tuple[str, str]]:
    """{name: (lowest, newest)} of the bounded dependencies, from pyproject.toml's ``>=`` and ``<=``."""
    found = {}
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name in BOUNDED:
            spec = {s.operator: s.version for s in req.specifier}
            assert set(spec) == {">=", "<="}, f"{dep}: a lower (>=) and an upper (<=) bound, nothing else"
            found[req.name] = (spec[">="], spec["<="])
    assert set(found) == set(BOUNDED), f"pyproject.toml bounds {sorted(found)}, expected {sorted(BOUNDED)}"
    return found


def pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*(\S+)\s*", line.split("#")[0])
        if m:
            out[canonicalize_name(m[1])] = m[2]
    return out


def versions(end: str) -> dict[str, str]:
    """The pins of the set ``end`` (lowest / newest): constraints.txt's, the bounds' end, what the lowest needs."""
    chosen = {n: b[0 if end == "lowest" else 1] for n, b in bounds().items()}
    if end == "lowest":
        chosen.update(LOWEST_NEEDS)
    out = {n: v for n, v in pins().items() if n not in NOT_INSTALLED}
    out.update({canonicalize_name(n): v for n, v in chosen.items()})
    return out


def test_the_bounds_are_both_ends_and_the_pins_are_the_newest():
    # the newest set is constraints.txt's (what `make install` puts in CI's environment): bump both together
    p = pins()
    for name, (low, high) in bounds().items():
        assert p[name] == high, f"constraints.txt pins {name}=={p[name]}, pyproject.toml's upper bound is {high}"
        assert low != high
    assert not set(LOWEST_NEEDS) & set(BOUNDED)


def _index_reachable(tmp: Path) -> str | None:
    """None when pip can download the lowest jax from the package index, else why not."""
    low = bounds()["jax"][0]
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "-q", f"jax=={low}", "-d", str(tmp)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return f"`pip download jax=={low}` timed out after 120 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"`pip download jax=={low}` failed: {last}"
    return None


def _tail(r: subprocess.CompletedProcess) -> str:
    return (r.stdout + r.stderr)[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("end", ["lowest", "newest"])
def test_the_quick_presets_pass_at_each_end_of_the_bounds(end, tmp_path):
    why = _index_reachable(tmp_path / "probe-download")
    if why:
        pytest.skip(f"the package index is unreachable ({why}): cannot build the {end} environment")
    want = versions(end)
    timings = {}

    # a copy of the package's sources: pip builds in the source tree (build/, *.egg-info), so two environments built
    # at once (pytest-xdist) from the repository itself would race
    src = tmp_path / "iclab-src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(want.items())))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(CI="true", ICLAB_KERNEL_CACHE=str(tmp_path / "kernels"))
    venv = tmp_path / "venv"
    python, iclab = venv / "bin" / "python", venv / "bin" / "iclab"

    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, _tail(r)
    r = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c",
                        str(constraints), str(src), *(f"{n}=={want[n]}" for n in BOUNDED)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=INSTALL_TIMEOUT)
    assert r.returncode == 0, f"pip install of the {end} set failed:\n{_tail(r)}"
    timings["install"] = time.monotonic() - t0

    r = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, _tail(r)
    probe = json.loads(r.stdout.strip().splitlines()[-1])
    assert probe["versions"] == {n: want[n] for n in (*BOUNDED, "numpy")}
    assert Path(probe["iclab"]).is_relative_to(venv), f"iclab imported from {probe['iclab']}, not the new venv"
    assert probe["direct"] and probe["ffi"], f"host calls copy their operands with the {end} set: {probe}"

    for exp in PRESETS:
        t = time.monotonic()
        r = subprocess.run([str(iclab), "run", exp, "--out", str(tmp_path / "results")], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=RUN_TIMEOUT)
        timings[exp] = time.monotonic() - t
        assert r.returncode == 0, f"{exp} with the {end} set ({probe['versions']}) exited {r.returncode}:\n{_tail(r)}"
    print(f"{end} set {probe['versions']}: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
