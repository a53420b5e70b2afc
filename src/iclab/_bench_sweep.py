"""``iclab bench sweep``: what sharing the CPU costs, as measured ratios (issue: runs that share the CPU).

Two measurements, each in fresh processes of the CLI (so that every run compiles and computes as a user's
would), timed by wall clock and by CPU time (``getrusage`` of the finished children, pool workers included):

1. The same small sweep (``points`` quick-preset points, one base seed each) with 1 worker, one worker per
   core, and twice as many workers as cores. Workers get ⌊cores / W⌋ threads each (:mod:`iclab.threads`).
2. One quick run idle, and beside a CPU-bound neighbour process (a busy loop on one core): with the
   default threads (one per core) and with one thread fewer than the cores (``--threads``), the setting the
   README gives for a shared machine. The ratio of CPU times to the idle run is the cost of contention:
   a fair share costs 1×, threads spinning against a neighbour many times that.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

from iclab.threads import POOL_VARIABLES, available_cores

__all__ = ["bench_sweep"]


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


def bench_sweep(experiment: str = "linattn.fig3", points: int = 4) -> dict:
    """Sweeps with 1, C and 2C workers, and one run idle and beside a CPU-bound neighbour (module docstring).

    Args:
        experiment: the quick preset swept and run (a few seconds per run).
        points: sweep points (base seeds 0..points−1).
    Returns:
        JSON-able dict: cores; per sweep configuration its workers, threads per worker, wall and CPU
        seconds; the wall speed-up of C workers over 1; per neighbour setting its wall and CPU seconds and
        CPU ratio to the idle run.
    """
    cores = available_cores()
    env = {k: v for k, v in os.environ.items() if k not in ("ICLAB_THREADS",) + POOL_VARIABLES}
    env["CI"] = "true"  # no progress bars
    grid = "seed=" + ",".join(str(s) for s in range(points))
    out: dict = {"experiment": experiment, "cores": cores, "points": points, "sweeps": {}, "neighbour": {}}
    with tempfile.TemporaryDirectory(prefix="iclab-bench-sweep-") as tmp:
        for label, workers in (("1 worker", 1), ("1 worker per core", cores), ("2 workers per core", 2 * cores)):
            root = os.path.join(tmp, f"w{workers}")
            wall, cpu, _ = _timed(["sweep", experiment, "--grid", grid, "--workers", str(workers), "--out", root],
                                  env)
            out["sweeps"][label] = {"workers": workers, "threads_per_worker": max(1, cores // workers) if workers > 1
                                    else cores, "wall_s": wall, "cpu_s": cpu}
        out["sweep_speedup_per_core_vs_1"] = (out["sweeps"]["1 worker"]["wall_s"]
                                              / out["sweeps"]["1 worker per core"]["wall_s"])

        def run(tag: str, *extra: str) -> tuple[float, float]:
            wall, cpu, _ = _timed(["run", experiment, "--force", "--out", os.path.join(tmp, tag), *extra], env)
            return wall, cpu

        run("warm")  # the first run pays for cold caches (imports, files): not part of the comparison
        idle_wall, idle_cpu = run("idle")
        out["neighbour"]["idle"] = {"wall_s": idle_wall, "cpu_s": idle_cpu}
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.0)
            for tag, extra in (("default threads", ()), (f"--threads {max(1, cores - 1)}",
                                                          ("--threads", str(max(1, cores - 1))))):
                wall, cpu = run(tag.replace(" ", "-"), *extra)
                out["neighbour"][tag] = {"wall_s": wall, "cpu_s": cpu, "cpu_ratio_to_idle": cpu / idle_cpu}
        finally:
            neighbour.kill()
            neighbour.wait()
    out["load_after"] = os.getloadavg()
    return out
