"""``iclab bench sweep``: what sharing the CPU costs, as measured ratios (issue: runs that share the CPU).

Two measurements, each in fresh processes of the CLI (so that every run compiles and computes as a user's
would), timed by wall clock and by CPU time (``getrusage`` of the finished children, pool workers included):

1. The same small sweep (``points`` quick-preset points, one base seed each) with 1 worker, one worker per
   core, and twice as many workers as cores. Workers get ⌊cores / W⌋ threads each (:mod:`iclab.threads`).
2. One quick run (``gating.optimum``: JAX and scipy's BFGS) idle, and beside a CPU-bound neighbour
   process (a loop of multi-threaded BLAS products, like a PyTorch training): with iclab's defaults (XLA one thread per core, BLAS one thread),
   with one thread fewer than the cores (``--threads``, the README's setting for a shared machine), and
   with BLAS one thread per core (its own default, and iclab's before the issue on sharing the CPU).
   The ratio of CPU times to the idle run is the cost of contention: a fair share costs 1×, threads
   spinning against a neighbour many times that.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

from iclab.threads import BLAS_VARIABLES, POOL_VARIABLES, available_cores

__all__ = ["bench_sweep"]


# The neighbour: a training-like loop of multi-threaded BLAS products (one thread per core, as a PyTorch
# training has), whose waiting threads spin as OpenMP's and OpenBLAS's do.
_NEIGHBOUR = "import numpy as np\na = np.random.rand(256, 256) / 256\nwhile True:\n    a = np.tanh(a @ a)"


def _timed(args: list[str], env: dict) -> tuple[float, float, int]:
    """(wall s, CPU s of the process and all its reaped descendants, exit code) of one CLI command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "iclab.cli", *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"iclab {' '.join(args[:2])} failed: {r.stderr.strip().splitlines()[-1:]}")
    return wall, cpu, r.returncode


def bench_sweep(experiment: str = "linattn.fig3", points: int = 4, neighbour_experiment: str = "gating.optimum") -> dict:
    """Sweeps with 1, C and 2C workers, and one run idle and beside a CPU-bound neighbour (module docstring).

    Args:
        experiment: the quick preset swept (a few seconds per run).
        points: sweep points (base seeds 0..points−1).
        neighbour_experiment: the quick preset run idle and beside the neighbour.
    Returns:
        JSON-able dict: cores; per sweep configuration its workers, threads per worker, wall and CPU
        seconds; the wall speed-up of C workers over 1; per thread setting its idle and beside-neighbour
        wall and CPU seconds, and the CPU ratios to the idle run of the same setting and of iclab's
        defaults.
    """
    cores = available_cores()
    env = {k: v for k, v in os.environ.items() if k not in ("ICLAB_THREADS",) + POOL_VARIABLES + BLAS_VARIABLES}
    env["CI"] = "true"  # no progress bars
    grid = "seed=" + ",".join(str(s) for s in range(points))
    out: dict = {"experiment": experiment, "neighbour_experiment": neighbour_experiment, "cores": cores,
                 "points": points, "sweeps": {}, "neighbour": {}}
    with tempfile.TemporaryDirectory(prefix="iclab-bench-sweep-") as tmp:
        for label, workers in (("1 worker", 1), ("1 worker per core", cores), ("2 workers per core", 2 * cores)):
            root = os.path.join(tmp, f"w{workers}")
            wall, cpu, _ = _timed(["sweep", experiment, "--grid", grid, "--workers", str(workers), "--out", root],
                                  env)
            out["sweeps"][label] = {"workers": workers, "threads_per_worker": max(1, cores // workers) if workers > 1
                                    else cores, "wall_s": wall, "cpu_s": cpu}
        out["sweep_speedup_per_core_vs_1"] = (out["sweeps"]["1 worker"]["wall_s"]
                                              / out["sweeps"]["1 worker per core"]["wall_s"])

        def run(tag: str, *extra: str, blas: int | None = None) -> tuple[float, float]:
            env_run = env if blas is None else {**env, **{name: str(blas) for name in BLAS_VARIABLES}}
            wall, cpu, _ = _timed(["run", neighbour_experiment, "--force", "--out", os.path.join(tmp, tag), *extra],
                                  env_run)
            return wall, cpu

        settings = (("iclab defaults", (), None), (f"--threads {max(1, cores - 1)}", ("--threads", str(max(1, cores - 1))), None),
                    ("BLAS one thread per core", (), cores))
        run("warm")  # the first run pays for cold caches (imports, files): not part of the comparison
        for tag, extra, blas in settings:
            wall, cpu = run("idle-" + tag.replace(" ", "-"), *extra, blas=blas)
            out["neighbour"]["idle, " + tag] = {"wall_s": wall, "cpu_s": cpu}
        idle_cpu = out["neighbour"]["idle, iclab defaults"]["cpu_s"]
        neighbour = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR],
                                     env={**env, **{name: str(cores) for name in BLAS_VARIABLES}})
        try:
            time.sleep(1.0)
            for tag, extra, blas in settings:
                wall, cpu = run("beside-" + tag.replace(" ", "-"), *extra, blas=blas)
                own_idle = out["neighbour"]["idle, " + tag]["cpu_s"]
                out["neighbour"]["beside a neighbour, " + tag] = {
                    "wall_s": wall, "cpu_s": cpu, "cpu_ratio_to_idle": cpu / own_idle,
                    "cpu_ratio_to_idle_defaults": cpu / idle_cpu}
        finally:
            neighbour.kill()
            neighbour.wait()
    out["load_after"] = os.getloadavg()
    return out
