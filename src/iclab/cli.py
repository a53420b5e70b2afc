"""The ``iclab`` command: a thin layer over :mod:`iclab.launch`, :mod:`iclab.sweep`, :mod:`iclab.runner`
(experiments, results roots) and the experiment registry.

Exit codes: 0 success; 1 a check failed (or a point diverged or failed, or a stored result is damaged
and ``--no-repair`` was given); 2 bad input (one line naming the field and what is allowed: every
:class:`iclab.errors.UserError`, nothing written); 3 a user's experiment raised (one line pointing at
the run's ``error.txt``, where its traceback is kept). Bugs of iclab's keep their traceback.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from typer.exceptions import TyperException
from rich.console import Console
from rich.table import Table

from iclab import settings
from iclab.bench import BENCHMARKS
from iclab.errors import ConfigError, RunDamaged, RunFailed, UserError
from iclab.launch import parse_assignments, path_overrides, run_experiment
from iclab.runner import experiment_or_error, results_root, writable_file, writable_folder
from iclab.store import readable_root as _readable_root

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="iclab: reproduce and check the theory of in-context learning in attention models.")
out = Console(highlight=False, soft_wrap=True)


@app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON"),
             markdown: bool = typer.Option(False, "--markdown", help="print the README's experiment table (generated "
                                           "from the measurement records)"),
             update: Optional[Path] = typer.Option(None, "--update", help="with --markdown: rewrite the table in this "
                                                   "README (between its marker lines) instead of printing it"),
             measurements: Optional[Path] = typer.Option(None, "--measurements", help="the measurement records' folder "
                                                         "(default: docs/measurements of the repository)")) -> None:
    """List the registered experiments (their runtimes from the newest measurement records: `iclab measure`)."""
    from iclab import measure
    from iclab.experiments import all_experiments

    exps = all_experiments()
    if update is not None and not markdown:
        raise ConfigError("--update needs --markdown")
    record = measure.load(measurements)
    if as_json:
        print(json.dumps([{"id": e.id, "paper": e.paper, "title": e.title, "reference": e.reference,
                           "presets": list(e.presets), "runtime": measure.runtime_lines(e, record)}
                          for e in exps.values()], indent=2))
        return
    if markdown:
        block = measure.experiments_markdown(exps.values(), record)
        if update is None:
            print(block, end="")
            return
        try:
            changed = measure.update_readme(update, block)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--update: {err}") from None
        out.print(f"{update}: experiments table {'rewritten' if changed else 'already up to date'}")
        return
    table = Table("id", "paper", "title", "reproduces")
    for e in exps.values():
        table.add_row(e.id, e.paper, e.title, e.reference)
    out.print(table)


@app.command("show")
def show_cmd(experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
             as_json: bool = typer.Option(False, "--json", help="print JSON"),
             measurements: Optional[Path] = typer.Option(None, "--measurements", help="the measurement records' folder "
                                                         "(default: docs/measurements of the repository)")) -> None:
    """Show an experiment: every config field with its meaning, presets, bounds and the paper's value, and its
    measured runtimes."""
    from iclab import measure
    from iclab.experiments._config import field_rows

    exp = experiment_or_error(experiment)
    rows = field_rows(exp.config, exp.presets)
    runtime = measure.runtime_lines(exp, measure.load(measurements))
    if as_json:
        print(json.dumps({"id": exp.id, "title": exp.title, "reference": exp.reference, "notes": exp.notes,
                          "runtime": runtime, "fields": rows}, indent=2, default=str))
        return
    out.print(f"[bold]{exp.id}[/bold]: {exp.title}")
    out.print(f"reproduces: {exp.reference}\n")
    group = None
    for r in rows:
        if r.get("group") and r["group"] != group:  # a settings group held whole: its class and meaning, once
            group = r["group"]
            out.print(f"[bold]{group['name']}[/bold] (a {group['type']}, its fields below): {group['description']}",
                      markup=True)
        allowed = f"{r['type']}" + (f", {r['bounds']}" if r["bounds"] else "")
        out.print(f"[bold]{r['name']}[/bold] ({allowed}): {r['description']}")
        presets = "   ".join(f"{p} preset: {json.dumps(v)}" for p, v in r["presets"].items())
        paper = "not stated" if r["paper_value"] is None else json.dumps(r["paper_value"])
        if r["paper_note"]:
            paper += f" ({r['paper_note']})"
        out.print(f"    {presets}   paper's value: {paper}")
    out.print()
    for note in exp.notes:
        out.print(f"• {note}")
    for preset, line in runtime.items():
        out.print(f"runtime ({preset}): {line}", markup=False)


@app.command("run")
def run_cmd(
    experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
    preset: str = typer.Option("quick", "--preset", help="quick (≤ 60 s on 2 cores) or paper (the paper's settings)"),
    assignments: Optional[List[str]] = typer.Option(None, "--set", help="override a config field: key=value (repeatable)"),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="number of seeds (vmapped)"),
    out_dir: Optional[str] = typer.Option(None, "--out", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    force: bool = typer.Option(False, "--force", help="recompute even if a stored result exists"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    checkpoint_every: Optional[int] = typer.Option(
        None, "--checkpoint-every", help="checkpoint every K chunks of each engine loop (default $ICLAB_CHECKPOINT_EVERY, "
        "else every 60 s; 0: off)"),
    model_path: Optional[Path] = typer.Option(None, "--model-path", help="local pretrained model folder "
                                              "(experiments with a model_path field: drift.gpt2)"),
    data_path: Optional[Path] = typer.Option(None, "--data-path", help="local dataset folder (experiments with a "
                                             "data_path field: drift.gpt2)"),
    no_repair: bool = typer.Option(False, "--no-repair", help="report a damaged stored result (exit 1) instead of "
                                   "moving it to .damaged/ and recomputing it"),
    threads: Optional[int] = typer.Option(None, "--threads", help="threads to compute with (XLA, BLAS, OpenMP, torch; "
                                          "default $ICLAB_THREADS, else one per core): fewer when sharing the machine"),
    executor: Optional[str] = typer.Option(None, "--executor", help="compute the experiment's shards as separate tasks: "
                                           "local (process pool) or ray (a running Ray cluster); default: one process"),
    workers: Optional[int] = typer.Option(None, "--workers", help="shards computed at once (local default: one per "
                                          "core, 1 runs in this process; ray default: the cluster's CPUs)"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address: auto (default) or host:port"),
    backend: str = typer.Option("auto", "--backend", help="auto (the compiled CPU kernels on a CPU, XLA on an "
                                "accelerator), native or xla: how the models and samplers compute (a run option: it "
                                "enters the run key, the numbers differ by float rounding or, for compiled samplers, by "
                                "their generator)"),
) -> None:
    """Run an experiment (or reuse its stored result), print its checks, exit 1 if one fails.

    A run killed part-way resumes from its last checkpoint when run again; a NaN or infinite loss
    stops it as diverged (exit 1), with the finite part of its trajectory stored. With --executor, an
    experiment that declares shards is computed shard by shard (each cached as it finishes) and assembled."""
    from iclab.progress import default_reporter

    _threads(threads)
    overrides = parse_assignments(assignments)
    for key, value in path_overrides(experiment, model_path=model_path, data_path=data_path).items():
        if key in overrides:
            raise ConfigError(f"{key} is set by both --set and --{key.replace('_', '-')}")
        overrides[key] = value
    result = run_experiment(experiment, preset, overrides, seeds=seeds, root=out_dir, force=force,
                            reporter=default_reporter(), checkpoint_every=checkpoint_every, repair=not no_repair,
                            executor=executor, workers=workers, address=address, backend=backend,
                            on_wait=lambda: print("another process is computing this run: waiting for it",
                                                  file=sys.stderr))
    if result.recomputed:
        print(f"note: computed again: {result.recomputed}", file=sys.stderr)
    if as_json:
        print(_json(result.as_dict(), indent=2))
    elif result.status == "diverged":
        how = "stored result" if result.reused else f"ran {result.wall_s:.1f} s"
        out.print(f"[red]diverged[/red]: {result.diverged['message']} ({how})")
        out.print(f"partial trajectory: {result.path / 'trajectories.npz'}")
    else:
        table = Table("check", "measured", "expected", "tolerance", "result", title=f"{result.experiment} ({preset})")
        for c in result.checks:
            tol = {"abs": f"± {c['tolerance']:g}", "rel": f"± {c['tolerance']:g} rel", "le": "≤ expected",
                   "eq": "exact", "ge": "≥ expected"}.get(c["comparison"], str(c["tolerance"]))
            table.add_row(c["name"], _fmt(c["measured"]), _fmt(c["expected"]), tol,
                          "[green]pass[/green]" if c["passed"] else "[red]FAIL[/red]")
        out.print(table)
        n_pass = sum(c["passed"] for c in result.checks)
        how = "reused stored result" if result.reused else f"ran in {result.wall_s:.1f} s"
        out.print(f"{n_pass}/{len(result.checks)} checks passed; {how}")
        out.print(f"results: {result.path}")
        out.print(f"figure:  {result.path / 'figure.png'}")
    if not result.passed:
        raise typer.Exit(1)


@app.command("sweep")
def sweep_cmd(
    experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
    grids: Optional[List[str]] = typer.Option(None, "--grid", help="a swept field: key=v1,v2,... (repeatable; the "
                                              "grid is their product; default: the experiment's own grid)"),
    assignments: Optional[List[str]] = typer.Option(None, "--set", help="fix a config field: key=value (repeatable)"),
    preset: str = typer.Option("quick", "--preset", help="quick or paper"),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="number of seeds of every point (vmapped)"),
    executor: str = typer.Option("local", "--executor", help="local (process pool on this machine) or ray (a running Ray cluster)"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address: auto (default) or host:port"),
    workers: Optional[int] = typer.Option(None, "--workers", help="points computed at once (local default: one per "
                                          "core, 1 runs in this process; ray default: the cluster's CPUs)"),
    retries: int = typer.Option(2, "--retries", help="times a point whose worker died is retried"),
    out_dir: Optional[str] = typer.Option(None, "--out", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    force: bool = typer.Option(False, "--force", help="recompute points that have a stored result"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", help="checkpoint every K chunks (see run)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the points (and which are stored) without running"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
    threads: Optional[int] = typer.Option(None, "--threads", help="threads of each worker (default: the cores shared "
                                          "out among the local workers; one per Ray task)"),
    backend: str = typer.Option("auto", "--backend", help="auto (the compiled CPU kernels on a CPU, XLA on an "
                                "accelerator), native or xla: how the models and samplers compute (a run option: it "
                                "enters the run key, the numbers differ by float rounding or, for compiled samplers, by "
                                "their generator)"),
) -> None:
    """Run an experiment over a grid of config values, locally or on a Ray cluster.

    Stored points are reused, so a sweep run again after a crash computes only what is missing
    (points killed part-way resume from their checkpoints). Exit 1 if a point failed, diverged or
    failed a check."""
    from iclab.progress import default_sweep_progress
    from iclab.store import Store
    from iclab.sweep import parse_grid, plan_sweep, run_sweep

    overrides = parse_assignments(assignments)
    grid = parse_grid(grids)
    if dry_run:
        exp, points = plan_sweep(experiment, grid, preset, overrides, seeds, backend=backend)
        store = Store(results_root(out_dir))
        rows = [{"values": p.values, "config_hash": p.digest,
                 "stored": store.finished(exp.id, p.digest) is not None} for p in points]
        if as_json:
            print(_json({"experiment": exp.id, "preset": preset, "points": rows}, indent=2))
            return
        table = Table("point", "run key", "stored", title=f"{exp.id} ({preset}): {len(points)} points")
        for p, r in zip(points, rows):
            table.add_row(p.label, p.digest, "yes" if r["stored"] else "no")
        out.print(table)
        return
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be ≥ 1 (got {threads})")
    _threads(None)  # a bad ICLAB_THREADS is one line here too
    result = run_sweep(experiment, grid, preset, overrides, seeds=seeds, root=out_dir, executor=executor,
                       address=address, workers=workers, retries=retries, force=force,
                       checkpoint_every=checkpoint_every, progress=default_sweep_progress(), threads=threads,
                       backend=backend)
    if as_json:
        print(_json(result.as_dict(), indent=2))
    else:
        table = Table("point", "status", "checks", "wall", "result", title=f"{result.experiment} ({preset}), {executor}")
        for r in result.points:
            colour = {"done": "green", "cached": "green", "diverged": "red", "failed": "red"}[r.status]
            checks = f"{sum(c['passed'] for c in r.checks)}/{len(r.checks)}" if r.status != "failed" else "–"
            table.add_row(r.point.label, f"[{colour}]{r.status}[/{colour}]", checks,
                          f"{r.wall_s:.1f} s" if r.status != "cached" else "–", str(r.path or r.error or ""))
        out.print(table)
        for r in result.points:
            if r.status in ("failed", "diverged"):
                out.print(f"[red]{r.status}[/red] {r.point.label}: {r.error}")
        counts = ", ".join(f"{result.count(s)} {s}" for s in ("done", "cached", "diverged", "failed"))
        out.print(f"{len(result.points)} points: {counts}; {result.wall_s:.1f} s")
    if not result.ok:
        raise typer.Exit(1)


@app.command("runs")
def runs_cmd(
    experiment: Optional[str] = typer.Option(None, "--experiment", help="only this experiment"),
    status: Optional[str] = typer.Option(None, "--status", help="only this status: running, done, failed, diverged, interrupted"),
    results: Optional[str] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most this many rows, newest first (default: all)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """List runs from the result store's index, newest first."""
    from iclab.store import STATUSES, Store

    if status is not None and status not in STATUSES:
        raise ConfigError(f"--status must be one of {', '.join(STATUSES)} (got {status!r})")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be ≥ 1 (got {limit})")
    store = Store(readable_root(results), readonly=True)
    rows = store.rows(experiment=experiment, status=status, on_invalid=_warn_invalid)
    if experiment is not None and not rows and not store.rows(experiment=experiment, on_invalid=lambda _: None):
        _known_experiment(experiment)
    if limit is not None:
        rows = rows[:limit]
    if as_json:
        for r in rows:
            r["config"] = json.loads(r["config"]) if r.get("config") else None
        print(_json(rows, indent=2))
        return
    table = Table("id", "experiment", "key", "code", "backend", "preset", "status", "checks", "wall", "started", "error")
    for r in rows:
        colour = {"done": "green", "running": "yellow"}.get(r["status"], "red")
        checks = f"{r['checks_passed']}/{r['checks_total']}" if r["checks_total"] is not None else "–"
        wall = f"{r['wall_s']:.1f} s" if r["wall_s"] is not None else "–"
        started = time.strftime("%m-%d %H:%M", time.localtime(r["started"]))
        table.add_row(str(r["id"]), r["experiment"], r["config_hash"][:8], (r.get("code") or "–")[:8],
                      r.get("backend") or "–", r["preset"] or "",
                      f"[{colour}]{r['status']}[/{colour}]", checks, wall, started, (r["error"] or "")[:60])
    out.print(table)
    out.print(f"{len(rows)} runs in {store.root}")


@app.command("export")
def export_cmd(
    experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
    fmt: str = typer.Option("csv", "--format", help="csv or parquet (parquet needs pyarrow)"),
    out_file: Optional[str] = typer.Option(None, "--out", help="output file (default <results>/exports/<experiment>.<format>)"),
    results: Optional[str] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
) -> None:
    """Write one table of configs and metrics (check values) across the stored runs of an experiment."""
    from iclab.export import FORMATS, export_rows, write_csv, write_parquet
    from iclab.fields import flat_fields
    from iclab.names import is_name
    from iclab.store import Store

    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    root = readable_root(results)
    try:
        exp = experiment_or_error(experiment)
        exp_id, fields = exp.id, list(flat_fields(exp.config))
    except UserError:  # an experiment this code does not define: export what the store holds of it
        if not is_name(experiment) or not Store(root, readonly=True).folders(experiment):
            raise
        exp_id, fields = experiment, []
    if out_file is not None:
        writable_file(out_file, "--out")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ConfigError("parquet export needs pyarrow: pip install pyarrow (or 'iclab[parquet]'), "
                            "or use --format csv") from None
    columns, rows = export_rows(root, exp_id, fields, on_damaged=_warn_damaged, on_invalid=_warn_invalid)
    if not rows:
        print(f"No stored runs of {exp_id} in {root}: run it first, e.g. `iclab run {exp_id}`.", file=sys.stderr)
        raise typer.Exit(1)
    path = writable_file(out_file, "--out") if out_file is not None else Path(root) / "exports" / f"{exp_id}.{fmt}"
    writable_folder(path.parent, "the exports folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    (write_csv if fmt == "csv" else write_parquet)(path, columns, rows)
    out.print(f"{len(rows)} runs × {len(columns)} columns: {path}")


@app.command("report")
def report_cmd(
    out_dir: Optional[str] = typer.Option(None, "--out", help="site folder (default: <results root>/report)"),
    results: Optional[str] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    open_browser: bool = typer.Option(False, "--open", help="open the index in a web browser"),
) -> None:
    """Build a static HTML report of every finished run: figures, checks, configs, data."""
    from iclab.report import build_site

    root = readable_root(results)
    site = writable_folder(out_dir, "--out") if out_dir is not None else writable_folder(root / "report", "the report folder")
    try:
        index = build_site(root, site, on_damaged=_warn_damaged, on_invalid=_warn_invalid)
    except FileNotFoundError:
        print(f"No finished runs in {root}: run an experiment first, e.g. `iclab run linattn.fig1`, "
              "then `iclab report`.", file=sys.stderr)
        raise typer.Exit(1)
    out.print(f"report: {index.resolve()}")
    if open_browser:
        import webbrowser

        webbrowser.open(index.resolve().as_uri())


@app.command("bench")
def bench_cmd(
    name: str = typer.Argument(..., help="benchmark name: " + ", ".join(BENCHMARKS)),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Run a benchmark: the fast and the reference path side by side, in one process."""
    from iclab.bench import run_benchmark

    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    _threads(None)
    try:
        result = run_benchmark(name)
    except RuntimeError as err:  # e.g. a timing lost in noise: say so in one line, report nothing
        raise ConfigError(f"bench {name}: {err}") from None
    if as_json:
        print(json.dumps(result, indent=2, default=float))
        return
    table = Table("measure", "value", title=f"iclab bench {name}: {BENCHMARKS[name][2]}")
    for key, value in result.items():
        table.add_row(key, _fmt(value) if not isinstance(value, dict) else json.dumps(value, default=float))
    out.print(table)


@app.command("measure")
def measure_cmd(
    quick: bool = typer.Option(True, "--quick/--no-quick", help="measure every experiment's quick preset (or those "
                               "of --only)"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="only these experiments' quick presets (comma list "
                                             "or repeated): linattn.fig1,gating.fig1"),
    paper: Optional[List[str]] = typer.Option(None, "--paper", help="also these experiments' paper presets (comma list "
                                              "or repeated; each may take up to hours)"),
    bench: Optional[List[str]] = typer.Option(None, "--bench", help="only these benchmarks (comma list or repeated; "
                                              "default: every one)"),
    no_bench: bool = typer.Option(False, "--no-bench", help="run no benchmark"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="the records' folder (default: docs/measurements of "
                                           "the repository)"),
    results: Optional[str] = typer.Option(None, "--results", help="results root the runs write into (default: a "
                                          "temporary folder, removed afterwards)"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="seconds allowed to each run and benchmark "
                                            "(default: no limit)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be measured, measure nothing"),
) -> None:
    """Measure the quick presets (and chosen paper presets) and every benchmark, each in a fresh process, and write
    the record the README's table, `iclab show` and the docs' Benchmarks page are generated from.

    The record (docs/measurements/<date>-<cpu>-<cores>c.json) holds the machine, the software versions, and for
    each preset its wall and CPU seconds and checks passed, for each benchmark its JSON output and ratios. Then
    `iclab list --markdown --update README.md` rewrites the README's table from the records."""
    from iclab import measure
    from iclab.bench import BENCHMARKS
    from iclab.experiments import all_experiments

    if no_bench and bench:
        raise ConfigError("--bench and --no-bench exclude each other")
    directory = out_dir if out_dir is not None else measure.default_directory()
    if directory is None:
        raise ConfigError("no repository here to hold the record (an installed iclab): give --out DIR")
    quick_ids = (measure._split(only) if only else None) if quick else []
    if only and not quick:
        raise ConfigError("--only and --no-quick exclude each other")
    benches = [] if no_bench else (measure._split(bench) if bench else None)
    if dry_run:
        ids = sorted(all_experiments(), key=_natural_key) if quick_ids is None else quick_ids
        for exp_id in ids:
            out.print(f"iclab run {exp_id} --preset quick --json --force")
        for exp_id in measure._split(paper):
            out.print(f"iclab run {exp_id} --preset paper --json --force")
        for name in (list(BENCHMARKS) if benches is None else benches):
            out.print(f"iclab bench {name} --json")
        out.print(f"record: {directory}/")
        return
    args = " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(("iclab", "cli.py")) else "measure"
    try:
        path = measure.measure(directory, quick=quick_ids, paper=paper or [], benches=benches, results=results,
                               timeout=timeout, command=f"iclab {args}".strip())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    out.print(f"record: {path}")
    out.print("regenerate the README's table: iclab list --markdown --update README.md")


@app.command("verify")
def verify_cmd(
    experiment: Optional[str] = typer.Argument(None, help="only this experiment's runs (default: every run)"),
    results: Optional[str] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
) -> None:
    """Check every stored run folder against its manifest (sizes and SHA-256 of its files); exit 1 on damage."""
    from iclab.store import Store

    store = Store(readable_root(results), readonly=True)
    if experiment is not None and not store.folders(experiment):
        _known_experiment(experiment)
    folders = store.folders(experiment) + store.linked_folders(experiment)  # a link is damage, never followed
    bad = 0
    for folder in folders:
        problems = store.verify(folder)
        if problems:
            bad += 1
            print(f"damaged: {folder.name}: {'; '.join(problems)}", file=sys.stderr)
    out.print(f"{len(folders) - bad} of {len(folders)} stored runs intact in {store.root}"
              + (f"; {bad} damaged (a run of the same config moves a damaged folder to .damaged/ and recomputes it)"
                 if bad else ""))
    if bad:
        raise typer.Exit(1)


index_app = typer.Typer(no_args_is_help=True, help="The result store's index (index.sqlite).")
app.add_typer(index_app, name="index")


@index_app.command("rebuild")
def index_rebuild_cmd(
    results: Optional[str] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
) -> None:
    """Rebuild index.sqlite from the run folders, keeping the rows of runs in progress (the old file is kept
    beside it, never deleted)."""
    from iclab.store import Store

    root = readable_root(results)
    writable_folder(root, "--results")
    n, moved = Store(root).rebuild_index()
    out.print(f"indexed {n} stored runs in {root / 'index.sqlite'}"
              + (f"; the old index is kept as {moved.name}" if moved is not None else ""))


def _threads(threads: Optional[int]) -> None:
    """Applies ``--threads`` (before anything computes); ``ICLAB_THREADS`` and ``ICLAB_MALLOC`` were checked by
    :func:`main` (:func:`iclab.settings.check_environment`)."""
    from iclab.ops import retain_freed_memory
    from iclab.threads import set_threads

    retain_freed_memory(settings.malloc_mode())
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be ≥ 1 (got {threads})")
        set_threads(threads)


def readable_root(results: Optional[str]) -> Path:
    """The results root a reading command uses: one line (StoreError) when it is empty, names a file or lies
    under one, or is a symbolic link that leads nowhere (:func:`iclab.store.readable_root`)."""
    return _readable_root(results)


def _known_experiment(experiment: str) -> None:
    from iclab.experiments import all_experiments

    if experiment not in all_experiments():
        raise ConfigError(f"unknown experiment {experiment!r}; known: {', '.join(all_experiments())}")


def _warn_damaged(path: Path, problems: list[str]) -> None:
    print(f"warning: skipping the damaged run {path.name}: {'; '.join(problems)} (`iclab verify` lists them)",
          file=sys.stderr)


def _warn_invalid(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _json(obj, indent: int = 2) -> str:
    """Strict JSON (no bare NaN or Infinity, which JSON parsers reject): non-finite numbers become null."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), indent=indent, allow_nan=False)


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app, turning user errors into one line on stderr and exit code 2 (module docstring)."""
    try:
        settings.check_environment()
        # Without standalone mode, an Exit(code) raised in a command comes back as the return value.
        rc = app(args=argv, standalone_mode=False)
    except RunDamaged as err:
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        return 1
    except UserError as err:
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        return 3
    except typer.Exit as err:
        return err.exit_code
    except (typer.Abort, KeyboardInterrupt):
        print("interrupted; run the same command to resume", file=sys.stderr)
        return 130
    except TyperException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # typer has printed the help already
            return 0
        print(f"error: {_one_line(err.format_message())}", file=sys.stderr)
        return 2
    if rc == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into a silent Exit(130); none of our commands exits 130
        print("interrupted; run the same command to resume", file=sys.stderr)
    return rc if isinstance(rc, int) else 0


def _natural_key(exp_id: str) -> list:
    """linattn.fig3 before linattn.fig10."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", exp_id)]


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
