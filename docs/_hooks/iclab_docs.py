"""mkdocs hook of iclab's site: pages generated from the code at build time, tutorials executed, maths
rendered to static KaTeX HTML.

- Papers: one page per paper from the experiment registry (what ``iclab list --markdown`` and
  ``iclab show`` print), its runtimes from the measurement records (``docs/measurements``, :mod:`iclab.measure`),
  and the text of ``docs/papers/<paper>.intro.md`` at its top when that file exists.
- Benchmarks: the measured numbers of ``docs/benchmarks.md`` and its bar charts (matplotlib, rendered at build
  time into the site), generated from the newest measurement records; the experiments table of
  ``docs/papers.md`` likewise.
- CLI reference: from the typer app's click commands.
- API reference: one page per public module (the modules ``tests/test_public_api.py`` checks); the build
  fails on a public name without a docstring, or a function with arguments and no ``Args:`` section
  (that test's rule, imported from it).
- Tutorials: ``docs/tutorials/*.py`` (jupytext percent format) executed by nbclient on an ipykernel;
  an exception (a failed theory assert) fails the build. Their figures become PNG files of the page.
- Maths: every ``\\(…\\)`` / ``\\[…\\]`` of arithmatex is rendered by KaTeX under node at build time
  (:file:`katex_render.js`); the site loads KaTeX's CSS and fonts from ``assets/katex``, nothing from a
  CDN, and needs no script to show a formula.
"""

from __future__ import annotations

import hashlib
import html
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.iclab")
ROOT = Path(__file__).resolve().parents[2]
HOOKS = Path(__file__).resolve().parent
KATEX_VERSION = "0.16.22"
# sha256 of the registry's tarball katex-0.16.22.tgz (npm pack checks the registry's own integrity too)
KATEX_SHA256 = "e9e0d167db3175481cbadaff38e8d90b130f6a3ddb451a47e43c577fd511f365"
KATEX_FILES = ("katex.min.css",)
PAPER_TITLES = {
    "linattn": "Training dynamics of in-context learning in linear attention (Zhang, Singh, Latham, Saxe, ICML 2025)",
    "gating": "Gating is weighting: gated linear attention through in-context learning (Li, Tarzanagh, Rawat, "
              "Fazel, Oymak)",
    "drift": "Learning to adapt: in-context learning beyond stationarity",
    "mhsa": "Training dynamics of multi-head softmax attention for in-context learning (Chen, Sheen, Wang, Yang)",
    "lab": "Beyond the four papers: settings none of them runs, on iclab's models and theory",
}
PAPER_LINKS = {
    "linattn": "https://arxiv.org/abs/2501.16265",
    "gating": "https://arxiv.org/abs/2504.04308",
    "drift": "https://openreview.net/forum?id=giA3v1Lo0G",
    "mhsa": "https://arxiv.org/abs/2402.19442",
    "lab": "https://arxiv.org/abs/2306.15063",
}
THEORY = {"linattn": "linattn", "gating": "wpgd", "drift": "drift", "mhsa": "mhsa", "lab": "task_diversity"}
BENCH_MARKER = "<!-- iclab: measured benchmarks -->"
TABLE_MARKER = "<!-- iclab: experiments table -->"
TUTORIALS = ("linattn", "gating", "drift", "mhsa", "model_family", "nonstationary", "task_diversity")


# ------------------------------------------------------------------------------------------------
# Public modules and their docstrings (the rule of tests/test_public_api.py)


def _public_api_test():
    spec = importlib.util.spec_from_file_location("_iclab_public_api", ROOT / "tests" / "test_public_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def api_modules() -> list[str]:
    """Every public module of the reference: those tests/test_public_api.py checks, less the top level."""
    return [m for m in _public_api_test().MODULES if m != "iclab"]


def docstring_problems(modules: list[str]) -> list[str]:
    """Public names without a docstring (or a function with arguments and no Args section)."""
    test = _public_api_test()
    problems = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # an optional extra (torch) missing: its page is still built from source
            log.info("docstring check skips %s (%s)", name, err)
            continue
        if not (inspect.getdoc(module) or "").strip():
            problems.append(f"{name}: no module docstring")
        exported = getattr(module, "__all__", None)
        if exported is None:
            problems.append(f"{name}: no __all__")
            continue
        for attr in exported:
            obj = getattr(module, attr)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                problems += test._problems(f"{name}.{attr}", obj)
            if inspect.isclass(obj) and obj.__module__.startswith("iclab"):
                for meth_name, meth in vars(obj).items():
                    if not meth_name.startswith("_") and inspect.isfunction(meth):
                        problems += test._problems(f"{name}.{attr}.{meth_name}", meth)
    return problems


def api_page(module: str) -> str:
    return (f"# `{module}`\n\n::: {module}\n    options:\n      show_root_heading: false\n"
            f"      show_root_toc_entry: false\n")


def api_index(modules: list[str]) -> str:
    lines = ["# API reference", "",
             "One page per public module, generated from the docstrings: the maths, the shapes of the arguments "
             "and what is returned. Formulas are the docstrings' own, rendered.", ""]
    for group in ("tasks", "models", "engines", "theory", "baselines", "experiments", "results"):
        members = [m for m in modules if m == f"iclab.{group}" or m.startswith(f"iclab.{group}.")]
        if members:
            lines.append(f"- **{group}**: " + ", ".join(f"[`{m}`]({m}.md)" for m in members))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Papers (the registry) and the CLI (the typer app)


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _natural(exp_id):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", exp_id)]


def paper_page(paper: str, docs_dir: Path | None = None) -> str:
    """One paper's page: its intro (``docs/papers/<paper>.intro.md``, when it exists), the experiments table with
    the measured runtimes, and every experiment's fields, notes and measured runtimes."""
    from iclab import measure
    from iclab.experiments import all_experiments
    from iclab.experiments._config import field_rows

    exps = sorted((e for e in all_experiments().values() if e.paper == paper), key=lambda e: _natural(e.id))
    measured = measure.load()
    theory = f"[`iclab.theory.{THEORY[paper]}`](../api/iclab.theory.{THEORY[paper]}.md)"
    intro = (docs_dir or ROOT / "docs") / "papers" / f"{paper}.intro.md"
    if intro.is_file():  # the intro names the paper (title, authors, venue) itself
        lines = [f"# {paper}", "", f"iclab's closed forms for this paper: {theory}; [the paper]({PAPER_LINKS[paper]}).",
                 "", intro.read_text(encoding="utf-8").strip(), ""]
    else:
        lines = [f"# {paper}", "", f"*[{PAPER_TITLES.get(paper, paper)}]({PAPER_LINKS[paper]})* (the paper's own "
                 f"page). iclab's closed forms for it are {theory}.", ""]
    lines += ["## Experiments", "",
              "Generated at build time from the experiment registry (`iclab show EXP`) and, for the times and checks, "
              "from the newest measurement records (`iclab measure`; see [Benchmarks](../benchmarks.md#the-records)).",
              ""]
    lines += measure.experiments_table(exps, measured, link=lambda exp_id: "#" + exp_id.replace(".", ""))
    for e in exps:
        lines += ["", f"## {e.id} {{#{e.id.replace('.', '')}}}", "", f"**{_cell(e.title)}**", "",
                  f"Reproduces: {_cell(e.reference)}.", "", f"`iclab run {e.id} --preset quick`", ""]
        presets = list(e.presets)
        lines += ["| field | meaning | " + " | ".join(presets) + " | paper's value |",
                  "|---|---|" + "---|" * len(presets) + "---|"]
        for r in field_rows(e.config, e.presets):
            paper_value = "not stated" if r["paper_value"] is None else json.dumps(r["paper_value"])
            if r["paper_note"]:
                paper_value += f" ({r['paper_note']})"
            allowed = r["type"] + (f", {r['bounds']}" if r["bounds"] else "")
            vals = " | ".join(f"`{_cell(json.dumps(r['presets'][p]))}`" for p in presets)
            lines.append(f"| `{r['name']}` | {_cell(r['description'])} ({_cell(allowed)}) | {vals} | {_cell(paper_value)} |")
        if e.notes:
            lines += ["", "Notes (our choices, the paper's settings, errata):", ""]
            lines += [f"- {_cell(n)}" for n in e.notes]
        lines += ["", "Measured:", ""]
        lines += [f"- {preset}: {_cell(line)}" for preset, line in measure.runtime_lines(e, measured).items()]
    return "\n".join(lines) + "\n"


def experiments_overview() -> str:
    """The table of every experiment (the README's), each id linked to its paper page."""
    from iclab import measure
    from iclab.experiments import all_experiments

    exps = all_experiments()
    return "\n".join(measure.experiments_table(
        exps.values(), measure.load(),
        link=lambda exp_id: f"papers/{exps[exp_id].paper}.md#{exp_id.replace('.', '')}")) + "\n"


# ------------------------------------------------------------------------------------------------
# Benchmarks: the measured numbers and their bar charts


_BENCH_COLOURS = {"linattn": "#1f77b4", "gating": "#2ca02c", "drift": "#d62728", "mhsa": "#9467bd", "sweep": "#7f7f7f"}


def _times(x: float) -> str:
    """A ratio for a label: 15,000×, 37.5×, 1.33×."""
    return f"{x:,.0f}×" if x >= 1000 else f"{x:.3g}×"


def _bar_chart(entries: list[tuple[str, dict]], *, title: str, xlabel: str) -> bytes:
    """A horizontal bar chart (PNG bytes) of (benchmark, ratio entry) pairs on a log axis, one bar each with its
    value beside it and, where the entry has one, the range of its rounds; a dashed line at 1."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [e["label"] for _, e in entries]
    values = [e["value"] for _, e in entries]
    highs = [e.get("high", e["value"]) for _, e in entries]
    fig, ax = plt.subplots(figsize=(9.5, 0.42 * len(entries) + 1.4), dpi=110)
    y = list(range(len(entries)))[::-1]
    ax.barh(y, values, color=[_BENCH_COLOURS.get(b, "#444444") for b, _ in entries], height=0.62)
    for yi, (_, e), high in zip(y, entries, highs):
        if "low" in e:
            ax.plot([e["low"], e["high"]], [yi, yi], color="black", lw=1.2)
        ax.text(high * 1.1, yi, _times(e["value"]), va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlim(min(0.8, min(values) * 0.8), max(highs) * 6)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _fmt_num(x) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return _cell(x)
    return f"{x:.4g}"


def benchmarks_section(measured=None) -> tuple[str, dict[str, bytes]]:
    """The measured part of the Benchmarks page (Markdown) and its figures ({file name: PNG bytes})."""
    from iclab import measure
    from iclab.bench import BENCHMARKS

    measured = measured if measured is not None else measure.load()
    names = [b for b in measure.BENCH_ORDER if b in measured.benches] + \
        [b for b in measured.benches if b not in measure.BENCH_ORDER]
    if not names:
        return ("No benchmark has been measured yet: `iclab measure` (or `iclab measure --no-quick`) runs them and "
                "writes the record this page is generated from.\n"), {}
    speedups = [(b, e) for b in names for e in measured.ratios(b)["speedups"]]
    floors = [(b, e) for b in names for e in measured.ratios(b)["floors"]]
    figures = {}
    lines = []
    if speedups:
        figures["speedups.png"] = _bar_chart(speedups, title="Each fast path against its reference, in one process",
                                             xlabel="the reference's time / the fast path's time (log scale)")
        lines += ["## Fast paths against their references", "",
                  "Each bar is the reference's time over the fast path's, both measured in the same process after "
                  "compilation (the tables below say how each was timed). Right of the dashed line the fast path is "
                  "faster.", "",
                  "![Speed-up of each fast path over its reference, one bar each](benchmarks/speedups.png)"
                  "{ .tutorial-figure }", ""]
    if floors:
        figures["floors.png"] = _bar_chart(floors, title="Steps and kernels against their arithmetic floor",
                                           xlabel="time / the floor's time at the measured matmul peak (log scale)")
        lines += ["## Against the arithmetic floor", "",
                  "Each bar is a step's (or a kernel's) time over the time its floor, the flops its model must do, "
                  "takes at the float32 matrix product's speed measured beside it: 1, the dashed line, is a step at "
                  "the floor. For a step timed in rounds the bar is the median round and the black line the range "
                  "of the rounds.", "",
                  "![Each paper step's and kernel's time over its arithmetic floor, one bar each](benchmarks/floors.png)"
                  "{ .tutorial-figure }", ""]
    lines += ["## The numbers", ""]
    for b in names:
        entry = measured.benches[b]
        record = entry["record"]
        lines += [f"### `iclab bench {b}`", "", f"*{_cell(BENCHMARKS[b][2]) if b in BENCHMARKS else ''}*", "",
                  f"Measured by `iclab measure` in [`{record}`](measurements/{record}) ({_cell(measured.describe(record))}); "
                  f"the benchmark took {measure.format_seconds(entry.get('wall_s'))} of wall time.", ""]
        if "error" in entry:
            lines += [f"It did not finish: {_cell(entry['error'])}.", ""]
            continue
        result = entry.get("result") or {}
        if result.get("setting"):
            lines += [f"Setting: {_cell(result['setting'])}.", ""]
        ratios = measured.ratios(b)
        if ratios.get("speedups"):
            lines += ["| comparison | speed-up | fast path | reference | how it was timed |", "|---|---|---|---|---|"]
            lines += [f"| {_cell(x['label'])} | {_times(x['value'])} | {_cell(x['fast'])} | {_cell(x['reference'])} | "
                      f"{_cell(x['how'])} |" for x in ratios["speedups"]]
            lines.append("")
        if ratios.get("floors"):
            lines += ["| step or kernel | time / floor | rounds | how it was timed |", "|---|---|---|---|"]
            lines += [f"| {_cell(f['label'])} | {_times(f['value'])} | "
                      + (f"{f['low']:.3g}-{f['high']:.3g}×" if "low" in f else "-") + f" | {_cell(f['how'])} |"
                      for f in ratios["floors"]]
            lines.append("")
        flat = [(k, v) for k, v in result.items() if not isinstance(v, (dict, list)) and k != "setting"]
        if flat:
            lines += ["??? note \"Every top-level number of its JSON output\"", "", "    | key | value |",
                      "    |---|---|"]
            lines += [f"    | `{k}` | {_fmt_num(v)} |" for k, v in flat]
            lines.append("")
    return "\n".join(lines) + "\n", figures


def cli_page() -> str:
    import click
    import typer

    from iclab.cli import app

    root = typer.main.get_command(app)
    lines = ["# CLI reference", "", "Generated from the typer app (`iclab --help`). Every command is one call of the "
             "Python API (see [Concepts](concepts.md)).", ""]

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], path + [name])
            return
        usage_args = " ".join(p.human_readable_name.upper() for p in cmd.params if isinstance(p, click.Argument))
        lines.extend([f"## `{' '.join(path)}`", "", inspect.cleandoc(cmd.help or "").split("\n\n")[0], "",
                      f"```\n{' '.join(path)} [OPTIONS] {usage_args}\n```", ""])
        rows = []
        for p in cmd.params:
            if p.hidden if hasattr(p, "hidden") else False:
                continue
            if isinstance(p, click.Argument):
                name = p.human_readable_name.upper()
            else:
                name = ", ".join(p.opts + p.secondary_opts)
            default = "" if p.default in (None, False, ()) or callable(p.default) else f" (default: `{p.default}`)"
            rows.append(f"| `{name}` | {_cell(getattr(p, 'help', '') or '')}{default} |")
        if rows:
            lines.extend(["| argument / option | meaning |", "|---|---|", *rows, ""])

    walk(root, ["iclab"])
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Tutorials


def execute_tutorial(path: Path) -> tuple[str, list[bytes], float]:
    """Runs a jupytext percent notebook; returns its page (Markdown), its PNG figures and the seconds it took.

    Raises:
        PluginError: a cell raised (a failed assert of simulation against theory included).
    """
    import jupytext
    import nbclient

    nb = jupytext.read(path)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    # The kernel's own stderr (ipykernel's notice about its TCP transport) goes to a log beside the build;
    # what a cell prints or raises comes back through the kernel's messages.
    log_path = ROOT / "build" / f"tutorial-{path.stem}.kernel.log"
    log_path.parent.mkdir(exist_ok=True)
    try:
        with open(log_path, "w") as kernel_log:
            client.execute(stderr=kernel_log)
    except nbclient.exceptions.CellExecutionError as err:
        raise PluginError(f"tutorial {path} failed:\n{err}") from None
    seconds = time.perf_counter() - start
    parts, figures = [], []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(cell.source)
            continue
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        parts.append(f"```python\n{cell.source}\n```")
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and out.get("name") == "stdout" and out.text.strip():
                parts.append(f"```text\n{out.text.rstrip()}\n```")
            elif out.output_type in ("display_data", "execute_result"):
                data = out.get("data", {})
                if "image/png" in data:
                    import base64

                    figures.append(base64.b64decode(data["image/png"]))
                    parts.append(f'![figure {len(figures)} of the {path.stem} tutorial]({path.stem}/figure-{len(figures)}.png)'
                                 '{ .tutorial-figure }')
                elif "text/plain" in data and out.output_type == "execute_result":
                    parts.append(f"```text\n{data['text/plain'].rstrip()}\n```")
    source = f"[`docs/tutorials/{path.name}`]({path.name})"
    header = (f"!!! info \"Executed when the site was built\"\n    This page is {source} (jupytext percent format), run "
              f"top to bottom by `make docs` in {seconds:.0f} s on the build machine; its last cell asserts "
              f"simulation against theory, so a wrong theory value fails the build.\n")
    body = "\n\n".join(parts)
    first_break = body.find("\n", body.find("# "))
    return body[: first_break + 1] + "\n" + header + body[first_break + 1:], figures, seconds


# ------------------------------------------------------------------------------------------------
# KaTeX


def katex_dist() -> Path:
    """KaTeX's dist/ folder of the pinned version, unpacked under build/ (npm pack, once)."""
    cache = ROOT / "build" / f"katex-{KATEX_VERSION}"
    dist = cache / "package" / "dist"
    if (dist / "katex.min.js").is_file():
        return dist
    cache.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise PluginError("make docs needs npm (and node) to bring in KaTeX: apt-get install nodejs npm")
    tgz = cache / f"katex-{KATEX_VERSION}.tgz"
    if not tgz.is_file():
        subprocess.run([npm, "pack", f"katex@{KATEX_VERSION}", "--pack-destination", str(cache), "--silent"],
                       check=True, stdout=subprocess.DEVNULL)
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    if digest != KATEX_SHA256:
        tgz.unlink()
        raise PluginError(f"katex-{KATEX_VERSION}.tgz has sha256 {digest}, expected {KATEX_SHA256}")
    with tarfile.open(tgz) as tar:
        tar.extractall(cache, members=[m for m in tar.getmembers() if m.name.startswith("package/")],
                       filter="data")
    return dist


_MATH = re.compile(r'<(span|div) class="arithmatex">(\\\(|\\\[)(.*?)(\\\)|\\\])</\1>', re.S)


def render_maths(site: Path, dist: Path) -> int:
    """Replaces every arithmatex span of the built pages by KaTeX's HTML; returns the number rendered.

    Raises:
        PluginError: a hand-written formula KaTeX cannot parse (a converted docstring formula falls back to text).
    """
    pages = {p: p.read_text(encoding="utf-8") for p in site.rglob("*.html")}
    formulas = sorted({(html.unescape(m.group(3)), m.group(2) == "\\[") for text in pages.values()
                       for m in _MATH.finditer(text)})
    if not formulas:
        return 0
    node = shutil.which("node")
    if node is None:
        raise PluginError("make docs needs node to render the maths with KaTeX")
    result = subprocess.run([node, str(HOOKS / "katex_render.js"), str(dist / "katex.min.js")],
                            input=json.dumps(formulas), capture_output=True, text=True, check=True)
    rendered = dict(zip(formulas, json.loads(result.stdout)))
    bad = [tex for (tex, _), r in rendered.items() if "error" in r and not tex.startswith("{}")]
    if bad:
        raise PluginError("KaTeX cannot render: " + "; ".join(f"{t!r}: {rendered[(t, d)]['error']}"
                                                             for t, d in formulas if t in bad))
    fallbacks = [tex for (tex, _), r in rendered.items() if "error" in r]
    if fallbacks:
        log.info("%d docstring formulas left as text (KaTeX: not TeX)", len(fallbacks))

    def replace(m):
        tex, display = html.unescape(m.group(3)), m.group(2) == "\\["
        r = rendered[(tex, display)]
        if "error" in r:
            return html.escape(_unicode_of(tex))
        return r["html"]

    for path, text in pages.items():
        new = _MATH.sub(replace, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
    return len(formulas)


def _unicode_of(tex: str) -> str:
    """A converted formula that KaTeX rejected, shown as plain text (its TeX source, readable)."""
    return tex[2:] if tex.startswith("{}") else tex


# ------------------------------------------------------------------------------------------------
# mkdocs events


def on_config(config):
    modules = api_modules()
    config["extra"]["iclab_api_modules"] = modules

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                (title, value), = item.items()
                if value == "papers/index.md":
                    out.append({title: ["papers.md"] + [f"papers/{p}.md" for p in PAPER_TITLES]})
                elif value == "api/index.md":
                    out.append({title: ["api/index.md"] + [{m: f"api/{m}.md"} for m in modules]})
                elif isinstance(value, list):
                    out.append({title: expand(value)})
                else:
                    out.append(item)
            else:
                out.append(item)
        return out

    config["nav"] = expand(config["nav"])
    return config


def on_files(files, config):
    modules = config["extra"]["iclab_api_modules"]
    problems = docstring_problems(modules)
    if problems:
        raise PluginError("public names without the docstring the API reference needs:\n" + "\n".join(problems))

    def add(uri: str, content):
        files.append(File.generated(config, uri, content=content))

    for paper in PAPER_TITLES:
        add(f"papers/{paper}.md", paper_page(paper, Path(config["docs_dir"])))
    bench_markdown, bench_figures = benchmarks_section()
    config["extra"]["iclab_benchmarks"] = bench_markdown
    for name, png in bench_figures.items():
        add(f"benchmarks/{name}", png)
    add("api/index.md", api_index(modules))
    for m in modules:
        add(f"api/{m}.md", api_page(m))
    add("cli.md", cli_page())
    tutorials = Path(config["docs_dir"]) / "tutorials"
    timings = {}
    only = os.environ.get("ICLAB_DOCS_TUTORIALS")  # a comma list to execute while writing one (default: all)
    for name in TUTORIALS:
        if only is not None and name not in only.split(","):
            add(f"tutorials/{name}.md", f"# {name}\n\nNot executed in this build (ICLAB_DOCS_TUTORIALS={only}).\n")
            continue
        page, figures, seconds = execute_tutorial(tutorials / f"{name}.py")
        timings[name] = seconds
        log.info("tutorial %s executed in %.1f s (%d figures)", name, seconds, len(figures))
        add(f"tutorials/{name}.md", page)
        for k, png in enumerate(figures, 1):
            add(f"tutorials/{name}/figure-{k}.png", png)
    config["extra"]["iclab_tutorial_seconds"] = timings
    dist = katex_dist()
    add("assets/katex/katex.min.css", (dist / "katex.min.css").read_bytes())
    for font in sorted((dist / "fonts").glob("*.woff2")):
        add(f"assets/katex/fonts/{font.name}", font.read_bytes())
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "benchmarks.md":
        if BENCH_MARKER not in markdown:
            raise PluginError(f"docs/benchmarks.md lacks the line {BENCH_MARKER}")
        return markdown.replace(BENCH_MARKER, config["extra"]["iclab_benchmarks"])
    if page.file.src_uri == "papers.md":
        if TABLE_MARKER not in markdown:
            raise PluginError(f"docs/papers.md lacks the line {TABLE_MARKER}")
        return markdown.replace(TABLE_MARKER, experiments_overview())
    return markdown


def on_post_build(config):
    site = Path(config["site_dir"])
    n = render_maths(site, katex_dist())
    log.info("rendered %d distinct formulas with KaTeX %s", n, KATEX_VERSION)
    timings = config["extra"].get("iclab_tutorial_seconds", {})
    (site / "tutorial-seconds.json").write_text(json.dumps(timings, indent=2))
