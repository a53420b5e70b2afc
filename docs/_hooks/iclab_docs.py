"""mkdocs hook of iclab's site: pages generated from the code at build time, tutorials executed, maths
rendered to static KaTeX HTML.

- Papers: one page per paper from the experiment registry (what ``iclab list --markdown`` and
  ``iclab show`` print).
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
}
THEORY = {"linattn": "linattn", "gating": "wpgd", "drift": "drift", "mhsa": "mhsa"}
TUTORIALS = ("linattn", "gating", "drift", "mhsa")


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


def paper_page(paper: str) -> str:
    from iclab.experiments import all_experiments
    from iclab.experiments._config import field_rows

    def natural(exp_id):
        return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", exp_id)]

    exps = sorted((e for e in all_experiments().values() if e.paper == paper), key=lambda e: natural(e.id))
    lines = [f"# {paper}", "", f"*{PAPER_TITLES.get(paper, paper)}*. The digest of the paper is "
             f"`shared/spec/{paper}.md`; the closed forms are [`iclab.theory.{THEORY[paper]}`](../api/iclab.theory.{THEORY[paper]}.md).",
             "", "Generated from the experiment registry at build time (`iclab list --markdown`, `iclab show EXP`).", "",
             "| id | reproduces | quick | paper |", "|---|---|---|---|"]
    for e in exps:
        anchor = e.id.replace(".", "")
        lines.append(f"| [`{e.id}`](#{anchor}) | {_cell(e.title)} ({_cell(e.reference)}) | "
                     f"{_cell(e.runtime.get('quick', 'not measured'))} | {_cell(e.runtime.get('paper', 'not measured'))} |")
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
        if e.runtime:
            lines += ["", "Runtime: " + "; ".join(f"{p}: {_cell(r)}" for p, r in e.runtime.items()) + "."]
    return "\n".join(lines) + "\n"


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
                    out.append({title: [f"papers/{p}.md" for p in PAPER_TITLES]})
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
        add(f"papers/{paper}.md", paper_page(paper))
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


def on_post_build(config):
    site = Path(config["site_dir"])
    n = render_maths(site, katex_dist())
    log.info("rendered %d distinct formulas with KaTeX %s", n, KATEX_VERSION)
    timings = config["extra"].get("iclab_tutorial_seconds", {})
    (site / "tutorial-seconds.json").write_text(json.dumps(timings, indent=2))
