"""The ``iclab`` command: a thin layer over :mod:`iclab.launch` and the experiment registry.

User errors print one line and exit 2; a failing check makes ``run`` exit 1; bugs keep their
traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from typer.exceptions import TyperException
from rich.console import Console
from rich.table import Table

from iclab.bench import BENCHMARKS
from iclab.launch import UserError, experiment_or_error, parse_assignment, run_experiment

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="iclab: reproduce and check the theory of in-context learning in attention models.")
out = Console(highlight=False, soft_wrap=True)


@app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List the registered experiments."""
    from iclab.experiments import all_experiments

    exps = all_experiments()
    if as_json:
        print(json.dumps([{"id": e.id, "paper": e.paper, "title": e.title, "reference": e.reference,
                           "presets": list(e.presets)} for e in exps.values()], indent=2))
        return
    table = Table("id", "paper", "title", "reproduces")
    for e in exps.values():
        table.add_row(e.id, e.paper, e.title, e.reference)
    out.print(table)


@app.command("show")
def show_cmd(experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
             as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Show an experiment: every config field with its meaning, presets, bounds and the paper's value."""
    from iclab.experiments._config import field_rows

    exp = experiment_or_error(experiment)
    rows = field_rows(exp.config, exp.presets)
    if as_json:
        print(json.dumps({"id": exp.id, "title": exp.title, "reference": exp.reference, "notes": exp.notes,
                          "runtime": exp.runtime, "fields": rows}, indent=2, default=str))
        return
    out.print(f"[bold]{exp.id}[/bold]: {exp.title}")
    out.print(f"reproduces: {exp.reference}\n")
    for r in rows:
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
    for preset, runtime in exp.runtime.items():
        out.print(f"runtime ({preset}): {runtime}")


@app.command("run")
def run_cmd(
    experiment: str = typer.Argument(..., help="experiment id, e.g. linattn.fig1"),
    preset: str = typer.Option("quick", "--preset", help="quick (≤ 60 s on 2 cores) or paper (the paper's settings)"),
    assignments: Optional[List[str]] = typer.Option(None, "--set", help="override a config field: key=value (repeatable)"),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="number of seeds (vmapped)"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    force: bool = typer.Option(False, "--force", help="recompute even if a stored result exists"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Run an experiment (or reuse its stored result), print its checks, exit 1 if one fails."""
    from iclab.progress import default_reporter

    overrides = dict(parse_assignment(a) for a in assignments or [])
    result = run_experiment(experiment, preset, overrides, seeds=seeds, root=out_dir, force=force,
                            reporter=default_reporter())
    if as_json:
        print(json.dumps(result.as_dict(), indent=2))
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


@app.command("report")
def report_cmd(
    out_dir: Optional[Path] = typer.Option(None, "--out", help="site folder (default: <results root>/report)"),
    results: Optional[Path] = typer.Option(None, "--results", help="results root (default $ICLAB_RESULTS or ./iclab-results)"),
    open_browser: bool = typer.Option(False, "--open", help="open the index in a web browser"),
) -> None:
    """Build a static HTML report of every finished run: figures, checks, configs, data."""
    from iclab.report import build_site
    from iclab.store import default_root

    root = results or default_root()
    try:
        index = build_site(root, out_dir or root / "report")
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
        raise UserError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    result = run_benchmark(name)
    if as_json:
        print(json.dumps(result, indent=2, default=float))
        return
    table = Table("measure", "value", title=f"iclab bench {name}: {BENCHMARKS[name][2]}")
    for key, value in result.items():
        table.add_row(key, _fmt(value) if not isinstance(value, dict) else json.dumps(value, default=float))
    out.print(table)


def _fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    """Entry point: runs the app, turning user errors into one line on stderr and exit code 2."""
    try:
        # Without standalone mode, an Exit(code) raised in a command comes back as the return value.
        rc = app(args=argv, standalone_mode=False)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except typer.Exit as err:
        return err.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except TyperException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # typer has printed the help already
            return 0
        print(f"error: {err.format_message()}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
