"""Measurements as data: ``iclab measure`` runs what the README and the docs quote and writes it as one record.

A **record** is a JSON file under ``docs/measurements/`` of the repository, written by :func:`measure`: the machine
(CPU model, cores, memory, load), the software (Python, iclab's version and git commit, the versions of its
dependencies), the date, and

- for every preset measured (each quick preset, and the paper presets asked for): the wall and CPU seconds of
  ``iclab run EXP --preset P --json --force`` in a fresh process (imports and compilation included), the
  checks it passed out of how many, its status and the backend it computed with;
- for every benchmark: the output of ``iclab bench NAME --json`` as it came, its wall and CPU seconds, and the
  ratios the Benchmarks page plots (:func:`bench_ratios`).

A record holds only what the command measured. Running it again (on this machine or another) writes another
record beside the others; nothing is edited by hand. What the README, ``iclab show``, ``iclab list`` and the
docs say about time and speed is generated from the records (:func:`load`, :func:`experiments_markdown`,
:func:`runtime_lines`): for each preset and each benchmark the newest record that measured it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["BENCH_ORDER", "Measurements", "bench_ratios", "default_directory", "experiments_markdown",
           "experiments_table", "format_seconds", "load", "machine", "measure", "measure_bench", "measure_run",
           "runtime_lines", "software", "update_readme"]

SCHEMA = 1
#: The benchmarks in the order the record and the Benchmarks page list them.
BENCH_ORDER = ("linattn", "gating", "drift", "mhsa", "sweep")
#: Packages whose versions a record names besides iclab's own dependencies (read from its metadata), when installed.
EXTRA_PACKAGES = ("torch", "transformers", "ray")
#: The README's table sits between these two lines; ``iclab list --markdown --update README.md`` rewrites it.
TABLE_BEGIN = "<!-- experiments table: generated from docs/measurements by `iclab list --markdown`; do not edit -->"
TABLE_END = "<!-- end of the experiments table -->"
#: The figure of the measured linattn.fig1 quick run, kept beside the records (the README shows it).
FIGURE = "linattn.fig1-quick.png"
#: drift.gpt2 needs GPT-2's weights and GLUE, which a machine may not have: its quick preset is measured on the
#: tiny random fixture that ships with iclab, and the record says so.
_FIXTURE_NOTE = "on the tiny random GPT-2 fixture (python -m iclab.experiments.drift._gpt2_fixture), not GPT-2 and GLUE"


# ------------------------------------------------------------------------------------------------
# Where records live, and what the machine is


def _repository_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]  # src/iclab/measure.py -> the repository (an editable install)
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "iclab").is_dir() else None


def default_directory() -> Path | None:
    """The repository's ``docs/measurements`` folder (None for an installed wheel, which has no repository)."""
    root = _repository_root()
    return None if root is None else root / "docs" / "measurements"


def machine() -> dict:
    """The machine a record was measured on: CPU model and its vector extensions (``/proc/cpuinfo``: the compiled
    kernels' speed depends on AVX2 against AVX-512), cores (all, and those this process may use), memory
    (``/proc/meminfo``), the operating system and the 1-, 5- and 15-minute load averages now."""
    cpu, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and cpu is None:
                cpu = line.split(":", 1)[1].strip()
            elif line.lower().startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 2**20, 1)  # kB -> GiB
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        available = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        available = os.cpu_count()
    return {"cpu_model": cpu or platform.processor() or "unknown", "cores": os.cpu_count(),
            "cores_available": available, "memory_gib": memory, "os": platform.platform(),
            "vector_extensions": [x for x in ("avx2", "fma", "avx512f") if x in flags],
            "load_average": list(os.getloadavg())}


def software() -> dict:
    """Python's version, the installed versions of iclab, of its dependencies and of :data:`EXTRA_PACKAGES`,
    iclab's git commit (when the code is a git checkout) and whether tracked files differed from it."""
    from importlib import metadata

    versions = {}
    try:
        requires = metadata.requires("iclab") or []
    except metadata.PackageNotFoundError:
        requires = []
    names = ["iclab"] + [m[0] for m in (re.match(r"[A-Za-z0-9_.\-]+", r) for r in requires if "extra ==" not in r) if m]
    for name in dict.fromkeys([*names, *EXTRA_PACKAGES]):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    out = {"python": platform.python_version(), "packages": versions, "git_commit": None, "git_modified": None}
    root = _repository_root()
    if root is not None and shutil.which("git"):
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10)
            if head.returncode == 0:
                out["git_commit"] = head.stdout.strip()
                status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, timeout=30)
                out["git_modified"] = bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    return out


# ------------------------------------------------------------------------------------------------
# Measuring one preset, one benchmark


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _subprocess(args: list[str], timeout: float | None) -> tuple[subprocess.CompletedProcess | None, float, float]:
    """(the finished process or None on a timeout, wall seconds, CPU seconds of it and its reaped children)."""
    env = {k: v for k, v in os.environ.items() if k != "ICLAB_RESULTS"}
    env["CI"] = "true"  # plain output, no progress bars
    cpu0, start = _children_cpu(), time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "iclab.cli", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        proc = None
    return proc, time.perf_counter() - start, _children_cpu() - cpu0


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _run_summary(result: dict) -> dict:
    checks = result.get("checks") or []
    return {"status": result.get("status"), "passed": result.get("passed"),
            "checks_passed": sum(bool(c.get("passed")) for c in checks), "checks_total": len(checks),
            "failed_checks": [c.get("name") for c in checks if not c.get("passed")],
            "backend": result.get("backend"), "run_wall_s": result.get("wall_s")}


def measure_run(experiment: str, preset: str, results: str | Path, *, in_process: bool = False,
                overrides: dict | None = None, extra_args: tuple[str, ...] = (), timeout: float | None = None) -> dict:
    """Runs one preset from scratch and returns what was measured.

    Args:
        experiment: an experiment id (``linattn.fig1``).
        preset: ``quick`` or ``paper``.
        results: the results root the run writes into (a scratch folder: the run is forced).
        in_process: run it in this process (:func:`iclab.launch.run_experiment`; for tests) instead of a fresh
            ``iclab run EXP --preset P --json --force`` process (what a record holds: it includes imports and
            compilation, as a user's run does).
        overrides: config fields to set (in-process only; a record measures the presets as they are).
        extra_args: more arguments of ``iclab run`` (``--model-path DIR``).
        timeout: seconds after which the run is stopped and recorded as timed out (None: no limit).
    Returns:
        JSON-able dict: ``command``, ``wall_s``, ``cpu_s`` (user + system, the process and its children),
        ``exit_code``, the 1-minute load average before and after, and from the run's JSON ``status``, ``passed``,
        ``checks_passed``, ``checks_total``, ``failed_checks``, ``backend``, ``run_wall_s`` (the runner's own
        wall time); or ``error`` (one line) when the run did not give a result.
    """
    command = f"iclab run {experiment} --preset {preset} --json --force" + "".join(f" {a}" for a in extra_args)
    out: dict = {"command": command, "load_average_1min": [os.getloadavg()[0]]}
    if in_process:
        from iclab.launch import run_experiment

        cpu0, start = time.process_time(), time.perf_counter()
        try:
            result = run_experiment(experiment, preset, dict(overrides or {}), root=str(results), force=True).as_dict()
            code = 0 if result.get("passed") else 1
        except Exception as err:  # recorded, not raised: one failed preset does not stop a record
            result, code = None, 2
            out["error"] = f"{type(err).__name__}: {err}"[:300]
        out.update(wall_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu0, exit_code=code)
    else:
        if overrides:
            raise ValueError("overrides are for in-process runs only: a record measures the presets as they are")
        args = ["run", experiment, "--preset", preset, "--json", "--force", "--out", str(results), *extra_args]
        proc, wall, cpu = _subprocess(args, timeout)
        out.update(wall_s=wall, cpu_s=cpu, exit_code=None if proc is None else proc.returncode)
        result = None
        if proc is None:
            out["error"] = f"timed out after {timeout:g} s"
        else:
            try:
                result = json.loads(proc.stdout)
            except json.JSONDecodeError:
                out["error"] = _last_line(proc.stderr) or f"no result (exit {proc.returncode})"
    if result is not None:
        out.update(_run_summary(result))
        if result.get("path"):
            out["_path"] = result["path"]  # for the figure; not stored
    out["load_average_1min"].append(os.getloadavg()[0])
    return out


def measure_bench(name: str, *, in_process: bool = False, kwargs: dict | None = None,
                  timeout: float | None = None) -> dict:
    """Runs one benchmark and returns its output as it came, with the ratios the Benchmarks page plots.

    Args:
        name: a benchmark of :data:`iclab.bench.BENCHMARKS`.
        in_process: call :func:`iclab.bench.run_benchmark` in this process (tests) instead of a fresh
            ``iclab bench NAME --json`` process.
        kwargs: the benchmark function's keywords (in-process only: smaller settings for a test).
        timeout: seconds after which it is stopped and recorded as timed out (None: no limit).
    Returns:
        JSON-able dict: ``command``, ``wall_s``, ``cpu_s``, ``exit_code``, the 1-minute load average before and
        after, ``result`` (the benchmark's JSON) and ``ratios`` (:func:`bench_ratios`); or ``error``.
    """
    out: dict = {"command": f"iclab bench {name} --json", "load_average_1min": [os.getloadavg()[0]]}
    result = None
    if in_process:
        from iclab.bench import run_benchmark

        cpu0, start = time.process_time(), time.perf_counter()
        try:
            result = json.loads(json.dumps(run_benchmark(name, **(kwargs or {})), default=float))
            code = 0
        except Exception as err:
            code = 2
            out["error"] = f"{type(err).__name__}: {err}"[:300]
        out.update(wall_s=time.perf_counter() - start, cpu_s=time.process_time() - cpu0, exit_code=code)
    else:
        if kwargs:
            raise ValueError("benchmark keywords are for in-process runs only: a record measures the benchmarks as they are")
        proc, wall, cpu = _subprocess(["bench", name, "--json"], timeout)
        out.update(wall_s=wall, cpu_s=cpu, exit_code=None if proc is None else proc.returncode)
        if proc is None:
            out["error"] = f"timed out after {timeout:g} s"
        elif proc.returncode != 0:
            out["error"] = _last_line(proc.stderr) or f"exit {proc.returncode}"
        else:
            try:
                result = json.loads(proc.stdout)
            except json.JSONDecodeError:
                out["error"] = "the benchmark's output is not JSON: " + _last_line(proc.stdout)
    out["load_average_1min"].append(os.getloadavg()[0])
    if result is not None:
        out["result"] = result
        out["ratios"] = bench_ratios(name, result)
    return out


# ------------------------------------------------------------------------------------------------
# The ratios a benchmark's page plots


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x not in (
        float("inf"), float("-inf")) else None


def _ratio(a, b) -> float | None:
    a, b = _num(a), _num(b)
    return a / b if a is not None and b else None


def _speedup(label: str, value, fast: str, reference: str, how: str) -> dict | None:
    value = _num(value)
    return None if value is None else {"label": label, "value": value, "fast": fast, "reference": reference, "how": how}


def _floor(label: str, value, rounds=None, how: str = "") -> dict | None:
    value = _num(value)
    if value is None:
        return None
    entry = {"label": label, "value": value, "how": how}
    rounds = [r for r in (_num(x) for x in rounds or []) if r is not None]
    if rounds:
        entry["low"], entry["high"] = min(rounds), max(rounds)
    return entry


def _floor_of_step(label: str, entry: dict, how: str) -> dict | None:
    """A paper step timed in rounds beside the matmul peak (``_roofline.step_beside_peaks``): the median round's
    time over the floor's time at the peak, and the rounds' range."""
    if not isinstance(entry, dict):
        return None
    fractions = entry.get("fraction_of_matmul_peak_step_rounds") or []
    rounds = [1.0 / f for f in (_num(x) for x in fractions) if f]
    return _floor(label, entry.get("floor_ratio_step"), rounds, how)


def bench_ratios(name: str, result: dict) -> dict:
    """The ratios the Benchmarks page plots, read from a benchmark's JSON output.

    Args:
        name: the benchmark (``linattn``, ``gating``, ``drift``, ``mhsa``, ``sweep``).
        result: its ``iclab bench NAME --json`` output.
    Returns:
        ``{"speedups": [...], "floors": [...]}``: a speed-up is the reference's time over the fast path's (> 1:
        the fast path is faster), with ``label``, ``value``, ``fast``, ``reference`` and ``how`` it was measured; a
        floor ratio is a step's time over the time its arithmetic floor (the flops counted from its shapes) takes
        at the matmul peak measured beside it (1: at the floor), with ``label``, ``value``, ``how`` and, for a step
        timed in rounds, ``low`` and ``high``. Entries whose numbers are missing are left out.
    """
    speedups, floors = [], []
    r = result if isinstance(result, dict) else {}
    if name == "linattn":
        how = "seconds per step after compilation: the slope between a short and a long run, least of two calls each"
        for backend, value in (r.get("speedup_per_step_by_backend") or {}).items():
            speedups.append(_speedup(f"linattn Fig 4: moments engine ({backend}) vs sampled GD, 1 seed", value,
                                     f"moments engine, {backend}", "full-batch GD on the prompts (sampled engine)", how))
        for key, values in r.items():
            m = re.fullmatch(r"speedup_per_seed_step_(\d+)_seeds_by_backend", key)
            if m and isinstance(values, dict):
                for backend, value in values.items():
                    speedups.append(_speedup(f"linattn Fig 4: moments engine ({backend}) vs sampled GD, {m.group(1)} seeds",
                                             value, f"moments engine, {backend}", "full-batch GD on the prompts", how))
    elif name == "gating":
        how = "one jitted loop of Adam steps on fresh batches, timed on its second call"
        for key, value in r.items():
            m = re.fullmatch(r"speedup_(\d+)_seeds?", key)
            if m:
                n = m.group(1)
                speedups.append(_speedup(f"gating Fig 1a step: query-only GLA vs per-token recurrence, {n} seed{'s' * (n != '1')}",
                                         value, "query-only form", "per-token recurrence (lax.scan)", how))
        for fig in ("fig1", "fig2"):
            paper = r.get(f"{fig}_paper") or {}
            kernels = paper.get("kernels") or {}
            speedups.append(_speedup(
                f"gating.{fig} paper: loss and gradient, compiled kernels vs XLA",
                _ratio((kernels.get("xla") or {}).get("loss_grad_s"), (kernels.get("native") or {}).get("loss_grad_s")),
                "compiled CPU kernels (native)", "XLA", "one jitted call, mean of two after a warm-up call"))
            floors.append(_floor_of_step(f"gating.{fig} paper step", paper,
                                         "median of five timed loops, each against the faster matmul peak beside it"))
    elif name == "drift":
        how = "one jitted call, mean of two after a warm-up call"
        fig1, fig2 = r.get("fig1") or {}, r.get("fig2") or {}
        forms1, forms2 = fig1.get("forms") or {}, fig2.get("forms") or {}
        native1 = forms1.get("native_shared") or forms1.get("native") or {}
        speedups.append(_speedup("drift.fig1 paper: loss and gradient, compiled kernels vs XLA",
                                 _ratio((forms1.get("xla") or {}).get("loss_grad_s"), native1.get("loss_grad_s")),
                                 "compiled read-out kernel (shared layout)", "XLA", how))
        speedups.append(_speedup("drift.fig1 paper: the batch, compiled sampler vs XLA",
                                 _ratio(fig1.get("sample_s_xla"), fig1.get("sample_s")),
                                 "compiled sampler", "XLA's sampler", how))
        speedups.append(_speedup("drift.fig2 paper: loss and gradient, compiled layers vs XLA",
                                 _ratio((forms2.get("parallel") or {}).get("loss_grad_s"),
                                        (forms2.get("native") or {}).get("loss_grad_s")),
                                 "compiled recurrent layer kernels", "XLA's parallel form", how))
        speedups.append(_speedup("drift.fig2 paper: the batch, compiled sampler vs XLA",
                                 _ratio(fig2.get("sample_s_xla"), fig2.get("sample_s")),
                                 "compiled sampler", "XLA's sampler", how))
        step_how = "median of five timed loops, each against the faster matmul peak beside it"
        floors.append(_floor_of_step("drift.fig1 paper step", fig1, step_how))
        floors.append(_floor_of_step("drift.fig2 paper step", fig2, step_how))
        kernels = r.get("native_layer_kernels") or {}
        for key, label in (("ir_forward", "forward"), ("ir_backward_data", "backward, first layer"),
                           ("ir_backward_stream", "backward, layer on the stream")):
            floors.append(_floor(f"drift full layer alone (LLVM IR kernel), {label}",
                                 _ratio(1.0, kernels.get(f"{key}_fraction_of_matmul_peak")),
                                 how="best of several calls at the paper's batch, one layer"))
    elif name == "mhsa":
        how = "one jitted loop of SGD steps on fresh batches, timed on its second call (different models: speed only)"
        for key in r:
            m = re.fullmatch(r"full_(\d+)_seeds?", key)
            if m:
                spectral = r.get(key.replace("full", "spectral", 1)) or {}
                n = m.group(1)
                speedups.append(_speedup(f"mhsa Fig 1 step: spectral model vs full attention, {n} seed{'s' * (n != '1')}",
                                         _ratio(spectral.get("steps_per_s"), (r.get(key) or {}).get("steps_per_s")),
                                         "spectral (ω̄, μ) model", "full multi-head softmax attention", how))
    elif name == "sweep":
        sweeps = r.get("sweeps") or {}
        cores = r.get("cores")
        speedups.append(_speedup(f"a quick sweep: {cores} workers vs 1 (wall)", r.get("sweep_speedup_per_core_vs_1"),
                                 "one worker per core", "one worker", "fresh CLI processes, wall clock"))
        many = sweeps.get("2 workers per core") or {}
        speedups.append(_speedup("a quick sweep: one worker per core vs two per core (wall)",
                                 _ratio(many.get("wall_s"), (sweeps.get("1 worker per core") or {}).get("wall_s")),
                                 "one worker per core", "two workers per core", "fresh CLI processes, wall clock"))
    return {"speedups": [s for s in speedups if s], "floors": [f for f in floors if f]}


# ------------------------------------------------------------------------------------------------
# Writing a record


def _natural(exp_id: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", exp_id)]


def _slug(text: str) -> str:
    text = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:40] or "cpu"


def _split(values) -> list[str]:
    out = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def measure(directory: str | Path, *, quick: list[str] | None | bool = None, paper: list[str] = (),
            benches: list[str] | None = None, results: str | Path | None = None, in_process: bool = False,
            overrides: dict | None = None, bench_kwargs: dict | None = None, timeout: float | None = None,
            log=None, command: str = "iclab measure") -> Path:
    """Measures the presets and benchmarks asked for and writes one record into ``directory``.

    Args:
        directory: where the record goes (``docs/measurements`` of the repository); created if missing.
        quick: the experiments whose quick preset is measured (None or True: every registered experiment; False
            or []: none).
        paper: the experiments whose paper preset is measured too (long: up to hours each).
        benches: the benchmarks run (None: every one of :data:`iclab.bench.BENCHMARKS`; []: none).
        results: the results root the runs write into (None: a temporary folder, removed afterwards).
        in_process: runs and benchmarks in this process (tests; :func:`measure_run`, :func:`measure_bench`).
        overrides: ``{experiment: {field: value}}`` for in-process runs (tests only).
        bench_kwargs: ``{benchmark: {keyword: value}}`` for in-process benchmarks (tests only).
        timeout: seconds allowed to each run and benchmark (None: no limit).
        log: called with one line per finished item (None: print to stderr).
        command: the command line recorded.
    Returns:
        The path of the record (``<date>-<cpu>-<cores>c.json``). While it is being measured the record is
        ``….json.partial`` (rewritten after every item), so that no reader takes a half record for a whole one.
    Raises:
        ValueError: an unknown experiment or benchmark, or nothing to measure.
    """
    from iclab.bench import BENCHMARKS
    from iclab.experiments import all_experiments

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    known = all_experiments()
    quick_ids = sorted(known, key=_natural) if quick is None or quick is True else _split(quick or [])
    paper_ids = _split(paper)
    bench_names = [b for b in BENCH_ORDER if b in BENCHMARKS] + [b for b in BENCHMARKS if b not in BENCH_ORDER] \
        if benches is None else _split(benches)
    for exp_id in quick_ids + paper_ids:
        if exp_id not in known:
            raise ValueError(f"unknown experiment {exp_id!r}; known: {', '.join(sorted(known, key=_natural))}")
    for name in bench_names:
        if name not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    todo = [("run", e, "quick") for e in quick_ids] + [("run", e, "paper") for e in paper_ids] + \
           [("bench", b, None) for b in bench_names]
    if not todo:
        raise ValueError("nothing to measure: name quick presets, paper presets or benchmarks")

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    box = machine()
    name = f"{now:%Y-%m-%dT%H%M%SZ}-{_slug(box['cpu_model'])}-{box['cores_available']}c.json"
    final, partial = directory / name, directory / (name + ".partial")
    record = {"schema": SCHEMA, "date": now.isoformat(timespec="seconds"), "command": command,
              "machine": box, "software": software(),
              "environment": {k: os.environ[k] for k in ("ICLAB_THREADS", "ICLAB_MALLOC", "ICLAB_KERNEL_CACHE",
                                                         "JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ},
              "how": {"runs": "in the measuring process (a test)" if in_process else
                      "a fresh process per preset (imports and compilation included); wall clock, and CPU seconds "
                      "(user + system) of the process and its children",
                      "benches": "in the measuring process (a test)" if in_process else
                      "a fresh process per benchmark; its own JSON output as it came, plus the ratios the "
                      "Benchmarks page plots"},
              "in_process": in_process,
              "experiments": {}, "benches": {}}
    cpu0, start = _children_cpu() + time.process_time(), time.perf_counter()
    scratch = tempfile.TemporaryDirectory(prefix="iclab-measure-") if results is None else None
    root = Path(scratch.name if scratch is not None else results)
    try:
        for k, (kind, item, preset) in enumerate(todo, 1):
            if kind == "run":
                extra = ()
                if item == "drift.gpt2" and not in_process:
                    extra = _gpt2_fixture(root, timeout)
                    if extra is None:
                        entry = {"command": f"iclab run {item} --preset {preset}", "error":
                                 "the tiny GPT-2 fixture could not be made (the llm extra: torch, transformers)"}
                        record["experiments"].setdefault(item, {})[preset] = entry
                        log(f"[{k}/{len(todo)}] {item} {preset}: {entry['error']}")
                        continue
                entry = measure_run(item, preset, root, in_process=in_process,
                                    overrides=(overrides or {}).get(item), extra_args=extra, timeout=timeout)
                if extra:
                    entry["note"] = _FIXTURE_NOTE
                    entry["command"] = entry["command"].replace(str(root / "gpt2-fixture"), "FIXTURE")
                path = entry.pop("_path", None)
                if item == "linattn.fig1" and preset == "quick" and path and entry.get("status") == "done":
                    figure = Path(path) / "figure.png"
                    if figure.is_file():
                        shutil.copyfile(figure, directory / FIGURE)
                record["experiments"].setdefault(item, {})[preset] = entry
                log(f"[{k}/{len(todo)}] {item} {preset}: {format_seconds(entry['wall_s']) if 'wall_s' in entry else ''} "
                    + (f"error: {entry['error']}" if "error" in entry else
                       f"{entry.get('checks_passed')}/{entry.get('checks_total')} checks"))
            else:
                entry = measure_bench(item, in_process=in_process, kwargs=(bench_kwargs or {}).get(item), timeout=timeout)
                record["benches"][item] = entry
                log(f"[{k}/{len(todo)}] bench {item}: {format_seconds(entry['wall_s'])} "
                    + (f"error: {entry['error']}" if "error" in entry else "done"))
            record["wall_s"] = time.perf_counter() - start
            record["cpu_s"] = _children_cpu() + time.process_time() - cpu0
            partial.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    finally:
        if scratch is not None:
            scratch.cleanup()
    record["machine"]["load_average_end"] = list(os.getloadavg())
    record["complete"] = True
    partial.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    partial.replace(final)
    return final


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _gpt2_fixture(root: Path, timeout: float | None) -> tuple[str, ...] | None:
    """The arguments that point drift.gpt2 at the tiny fixture, made under ``root`` (None if it cannot be made)."""
    folder = root / "gpt2-fixture"
    if not (folder / "model").is_dir():
        try:
            proc = subprocess.run([sys.executable, "-m", "iclab.experiments.drift._gpt2_fixture", str(folder)],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            return None
    return ("--model-path", str(folder / "model"), "--data-path", str(folder / "data"))


# ------------------------------------------------------------------------------------------------
# Reading records


@dataclass
class Measurements:
    """What the records of a folder say, the newest record first for each preset and each benchmark.

    Attributes:
        directory: the folder read (None: no folder).
        records: ``{file name: record}``, oldest first.
        runs: ``{(experiment, preset): entry}``, each entry from the newest record that measured it, with the
            record's file name under ``"record"``.
        benches: ``{benchmark: entry}``, likewise.
    """

    directory: Path | None = None
    records: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)
    benches: dict = field(default_factory=dict)

    def run(self, experiment: str, preset: str) -> dict | None:
        """The newest measurement of a preset (None: never measured).

        Args:
            experiment: the experiment id.
            preset: ``quick`` or ``paper``.
        """
        return self.runs.get((experiment, preset))

    def ratios(self, bench: str) -> dict:
        """A measured benchmark's ratios (:func:`bench_ratios`), read again from its stored output, so that the
        Benchmarks page follows the current reading of it ({"speedups": [], "floors": []} when none).

        Args:
            bench: the benchmark's name.
        """
        entry = self.benches.get(bench) or {}
        if isinstance(entry.get("result"), dict):
            return bench_ratios(bench, entry["result"])
        return entry.get("ratios") or {"speedups": [], "floors": []}

    def used(self) -> list[str]:
        """The records any shown number comes from, oldest first."""
        names = {e["record"] for e in self.runs.values()} | {e["record"] for e in self.benches.values()}
        return [n for n in self.records if n in names]

    def describe(self, name: str) -> str:
        """One line naming a record's machine: CPU model, cores, memory, and its load average at the start.

        Args:
            name: the record's file name.
        """
        box = self.records[name].get("machine", {})
        parts = [box.get("cpu_model") or "unknown CPU", f"{box.get('cores_available') or box.get('cores')} cores"]
        if box.get("memory_gib"):
            parts.append(f"{box['memory_gib']:g} GiB")
        load = box.get("load_average") or []
        if load:
            parts.append(f"load average {load[0]:.1f} at the start")
        return ", ".join(parts)


def load(directory: str | Path | None = None) -> Measurements:
    """Reads every record of a folder (``*.json``; a ``.partial`` record is not read).

    Args:
        directory: the folder (None: :func:`default_directory`; a missing folder gives no measurements).
    Returns:
        :class:`Measurements`: for each preset and benchmark, the newest record that measured it (by the
        record's ``date``, then its file name).
    """
    directory = default_directory() if directory is None else Path(directory)
    out = Measurements(directory=directory)
    if directory is None or not directory.is_dir():
        return out
    loaded = []
    for path in directory.glob("*.json"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and record.get("schema") == SCHEMA:
            loaded.append((str(record.get("date", "")), path.name, record))
    for _, name, record in sorted(loaded):
        out.records[name] = record
        for exp_id, presets in (record.get("experiments") or {}).items():
            for preset, entry in (presets or {}).items():
                out.runs[(exp_id, preset)] = {**entry, "record": name}
        for bench, entry in (record.get("benches") or {}).items():
            out.benches[bench] = {**entry, "record": name}
    return out


# ------------------------------------------------------------------------------------------------
# What is generated from them


def format_seconds(seconds) -> str:
    """A duration for a table cell: ``6.1 s``, ``43 s``, ``12 min``, ``1.4 h``.

    Args:
        seconds: the duration (None: ``not measured``).
    """
    s = _num(seconds)
    if s is None:
        return "not measured"
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _time_cell(entry: dict | None) -> str:
    if entry is None:
        return "not measured"
    if "error" in entry:
        return "failed" if "timed out" not in entry["error"] else "timed out"
    return format_seconds(entry.get("wall_s")) + (" (fixture)" if entry.get("note") else "")


def _checks(entry: dict | None) -> str | None:
    if entry is None or "checks_total" not in entry:
        return None
    text = f"{entry['checks_passed']}/{entry['checks_total']}"
    return text + (" (diverged)" if entry.get("status") == "diverged" else "")


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def experiments_table(experiments, measurements: Measurements, *, link=None) -> list[str]:
    """The experiments table (Markdown lines): id, what it reproduces, quick time, paper time, checks passed.

    Args:
        experiments: the experiments (:class:`iclab.experiments.Experiment`), in any order (shown in natural
            order: linattn.fig3 before linattn.fig10).
        measurements: :func:`load`'s result.
        link: a function of the experiment id giving the id cell's link target (None: no link).
    Returns:
        The header, the rule and one row per experiment; a time is the wall time of the newest measurement of that
        preset (``not measured`` where none was made), checks are ``quick p/t`` and, when the paper preset was
        measured, ``paper p/t``.
    """
    lines = ["| id | reproduces | quick | paper | checks passed |", "|---|---|---|---|---|"]
    for e in sorted(experiments, key=lambda e: _natural(e.id)):
        quick, paper = measurements.run(e.id, "quick"), measurements.run(e.id, "paper")
        checks = [f"{p} {c}" for p, c in (("quick", _checks(quick)), ("paper", _checks(paper))) if c]
        ref = str(e.reference).split(";")[0].strip()
        what = f"{e.title} ({ref})" if ref else str(e.title)
        ident = f"`{e.id}`" if link is None else f"[`{e.id}`]({link(e.id)})"
        lines.append("| " + " | ".join([ident, _cell(what), _time_cell(quick), _time_cell(paper),
                                         ", ".join(checks) or "not measured"]) + " |")
    return lines


def experiments_markdown(experiments, measurements: Measurements, *, record_link: str = "docs/measurements/") -> str:
    """The README's experiments block (``iclab list --markdown``): a sentence naming the records the numbers come
    from, and :func:`experiments_table`.

    Args:
        experiments: the experiments.
        measurements: :func:`load`'s result.
        record_link: the folder of the records as a link from where the block is shown.
    """
    used = measurements.used()
    if used:
        sources = "; ".join(f"[`{name}`]({record_link}{name}) ({measurements.describe(name)})" for name in used)
        caption = (f"Wall time of `iclab run EXP --preset P --force` in a fresh process (imports and compilation "
                   f"included) and the checks it passed, as `iclab measure` recorded them: {sources}.")
    else:
        caption = "No measurement record yet: `iclab measure` writes one under `docs/measurements/`."
    return caption + "\n\n" + "\n".join(experiments_table(experiments, measurements)) + "\n"


def runtime_lines(experiment, measurements: Measurements) -> dict:
    """``iclab show``'s runtime lines: for each preset, what the newest record measured.

    Args:
        experiment: the experiment.
        measurements: :func:`load`'s result.
    Returns:
        ``{preset: line}`` for every preset of the experiment, ``not measured`` where no record measured it.
    """
    out = {}
    for preset in experiment.presets:
        entry = measurements.run(experiment.id, preset)
        if entry is None:
            out[preset] = "not measured (iclab measure" + (" --paper " + experiment.id if preset == "paper" else "") + \
                " records it)"
            continue
        where = f"{entry['record']}: {measurements.describe(entry['record'])}"
        if "error" in entry:
            out[preset] = f"{_time_cell(entry)}: {entry['error']} ({where})"
            continue
        parts = [f"{format_seconds(entry.get('wall_s'))} wall", f"{format_seconds(entry.get('cpu_s'))} CPU"]
        if _checks(entry):
            parts.append(f"{_checks(entry)} checks")
        if entry.get("backend"):
            parts.append(f"backend {entry['backend']}")
        if entry.get("note"):
            parts.append(entry["note"])
        out[preset] = ", ".join(parts) + f" (measured by iclab measure, {where})"
    return out


def update_readme(path: str | Path, block: str) -> bool:
    """Replaces the experiments block of a README (between :data:`TABLE_BEGIN` and :data:`TABLE_END`).

    Args:
        path: the README.
        block: the new block (:func:`experiments_markdown`).
    Returns:
        True when the file changed.
    Raises:
        ValueError: the README lacks the two marker lines.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path} has no experiments block (the lines {TABLE_BEGIN!r} and {TABLE_END!r})")
    new = text[: begin + len(TABLE_BEGIN)] + "\n" + block.rstrip("\n") + "\n" + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text
