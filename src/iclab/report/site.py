"""A static, offline site of every reproduction in a result store.

``build_site(store_root, out_dir)`` writes ``index.html`` (one row per experiment and preset,
grouped by paper, with a thumbnail) and one page per experiment: its figure, the checks table,
the resolved config with each value marked as the paper's or our choice, the notes that apply,
the command that reproduces it, and the raw data (npz and a CSV of its main curves). Plain
HTML and CSS, no scripts, no CDN: it opens from the file system.
"""

from __future__ import annotations

import csv
import html
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from iclab.experiments import all_experiments
from iclab.launch import UserError, load_experiment_file
from iclab.store import Store

CSS = """
:root { --ok: #1a7f37; --bad: #c62828; --muted: #666; --line: #ddd; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; padding: 1rem;
       max-width: 1100px; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid var(--line); }
a { color: #0b57d0; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0 1rem; }
th, td { border-bottom: 1px solid var(--line); padding: .35rem .5rem; text-align: left; vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.pass { color: var(--ok); font-weight: 600; } .fail { color: var(--bad); font-weight: 600; }
tr.failing { background: #fdecea; }
img.figure { max-width: 100%; height: auto; border: 1px solid var(--line); }
img.thumb { width: 160px; max-width: 30vw; height: auto; border: 1px solid var(--line); }
code, pre { font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; background: #f6f6f6; }
pre { padding: .6rem; overflow-x: auto; }
.muted { color: var(--muted); }
.tag { font-size: .8rem; padding: 0 .35rem; border-radius: .3rem; border: 1px solid var(--line); }
.tag.paper { background: #e8f0fe; } .tag.ours { background: #fff4e5; }
@media (max-width: 640px) { body { padding: .5rem; font-size: 14px; } th, td { padding: .25rem; } }
"""


@dataclass
class RunEntry:
    """The newest finished run of one experiment at one preset."""

    experiment: str
    preset: str
    path: Path
    config: dict
    metrics: dict
    ended: float | None
    source: str | None = None

    @property
    def slug(self) -> str:
        return f"{self.experiment}-{self.preset}"


def collect_runs(store_root: str | Path, on_damaged=None) -> list[RunEntry]:
    """The newest finished run per (experiment, preset) in a result store; damaged folders are skipped.

    Args:
        store_root: the results root.
        on_damaged: called with (folder, problems) for each damaged folder skipped.
    """
    store = Store(store_root)
    if not store.root.is_dir():
        return []
    seen: dict[tuple[str, str], RunEntry] = {}
    for row in store.rows():  # newest first
        if row["status"] != "done":
            continue
        path = store.root / row["run_dir"]
        if not (path / "metrics.json").is_file():
            continue
        problems = store.verify(path)
        if problems:
            if on_damaged is not None:
                on_damaged(path, problems)
            continue
        cfg = json.loads((path / "config.json").read_text())
        key = (row["experiment"], cfg.get("preset") or row["preset"] or "custom")
        if key in seen:
            continue
        seen[key] = RunEntry(row["experiment"], key[1], path, cfg["config"],
                             json.loads((path / "metrics.json").read_text()), row["ended"], cfg.get("source"))
    return sorted(seen.values(), key=lambda r: (r.experiment, r.preset))


def _esc(x) -> str:
    return html.escape(str(x))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return _esc(json.dumps(x) if isinstance(x, (list, dict, bool)) or x is None else x)


def _page(title: str, body: str, css_href: str) -> str:
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(title)}</title><link rel=\"icon\" href=\"data:,\">"
            f"<link rel=\"stylesheet\" href=\"{css_href}\">"
            f"</head><body>\n{body}\n</body></html>\n")


def write_curves_csv(arrays: dict, dest: Path) -> int:
    """Writes the main curves of a run as CSV: every array whose last axis has the most common
    length T among the arrays (curves on one time axis); (S, T) arrays become one column per seed.

    Returns the number of columns written (0 if no curves)."""
    arrays = {k: np.asarray(v) for k, v in arrays.items() if np.asarray(v).ndim in (1, 2) and np.asarray(v).size}
    lengths = [a.shape[-1] for a in arrays.values() if a.shape[-1] > 1]
    if not lengths:
        return 0
    T = max(set(lengths), key=lengths.count)
    cols: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        if a.shape[-1] != T or not np.issubdtype(a.dtype, np.number):
            continue
        if a.ndim == 1:
            cols[name] = a
        else:
            for s in range(a.shape[0]):
                cols[f"{name}[{s}]"] = a[s]
    with dest.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(list(cols))
        for i in range(T):
            writer.writerow([repr(float(c[i])) for c in cols.values()])
    return len(cols)


def _command(entry: RunEntry, exp) -> str:
    base = exp.resolve(entry.preset).model_dump(mode="json") if exp and entry.preset in exp.presets else {}
    parts = ["iclab", "run", entry.source or entry.experiment, "--preset", entry.preset]
    for key, value in entry.config.items():
        if key in base and base[key] != value:
            parts += ["--set", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    return " ".join(parts)


def _experiment_page(entry: RunEntry, exp, out: Path) -> None:
    folder = out / entry.slug
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("figure.png", "figure.pdf", "trajectories.npz"):
        if (entry.path / name).is_file():
            shutil.copy2(entry.path / name, folder / name)
    n_cols = 0
    if (entry.path / "trajectories.npz").is_file():
        with np.load(entry.path / "trajectories.npz") as data:
            n_cols = write_curves_csv(dict(data), folder / "curves.csv")
    checks = entry.metrics.get("checks", [])
    n_pass = sum(c["passed"] for c in checks)
    rows = []
    for c in checks:
        status = '<span class="pass">pass</span>' if c["passed"] else '<span class="fail">FAIL</span>'
        tol = {"abs": f"± {c['tolerance']:g}", "rel": f"± {c['tolerance']:g} (relative)", "le": "≤ expected",
               "ge": "≥ expected", "eq": "exact"}.get(c["comparison"], _fmt(c["tolerance"]))
        note = f'<div class="muted">{_esc(c["note"])}</div>' if c.get("note") else ""
        rows.append(f'<tr class="{"" if c["passed"] else "failing"}"><td>{_esc(c["name"])}{note}</td>'
                    f'<td class="num">{_fmt(c["measured"])}</td><td class="num">{_fmt(c["expected"])}</td>'
                    f'<td class="num">{_esc(tol)}</td><td>{status}</td></tr>')
    fields = exp.config.model_fields if exp else {}
    cfg_rows = []
    for key, value in entry.config.items():
        info = fields.get(key)
        extra = (info.json_schema_extra or {}) if info else {}
        paper_value = extra.get("paper")
        if paper_value is not None and paper_value == value:
            mark = '<span class="tag paper">paper</span>'
        else:
            mark = '<span class="tag ours">our choice</span>'
        note = extra.get("paper_note") or ""
        paper_txt = "not stated" if paper_value is None else _fmt(paper_value)
        cfg_rows.append(f"<tr><td><code>{_esc(key)}</code></td><td class=\"num\">{_fmt(value)}</td><td>{mark}</td>"
                        f"<td>{_esc(info.description if info else '')}</td><td>{paper_txt}"
                        f"{' — ' + _esc(note) if note else ''}</td></tr>")
    notes = "".join(f"<li>{_esc(n)}</li>" for n in (exp.notes if exp else []))
    title = exp.title if exp else entry.experiment
    data_links = ['<a href="trajectories.npz">trajectories.npz</a>']
    if n_cols:
        data_links.append(f'<a href="curves.csv">curves.csv</a> ({n_cols} columns)')
    figure = ('<p><img class="figure" src="figure.png" alt="figure of ' + _esc(entry.experiment) + '"></p>'
              '<p><a href="figure.pdf">figure (PDF)</a></p>') if (folder / "figure.png").is_file() else "<p>No figure.</p>"
    body = f"""<p><a href="../index.html">← all experiments</a></p>
<h1>{_esc(entry.experiment)} <span class="muted">({_esc(entry.preset)} preset)</span></h1>
<p>{_esc(title)}</p>
<p class="muted">Reproduces: {_esc(exp.reference if exp else '')}</p>
{figure}
<h2>Checks: {n_pass} / {len(checks)} passed</h2>
<div class="scroll"><table><thead><tr><th>check</th><th>measured</th><th>expected</th><th>tolerance</th><th>result</th></tr></thead>
<tbody>{''.join(rows)}</tbody></table></div>
<h2>Reproduce</h2>
<pre>{_esc(_command(entry, exp))}</pre>
<p class="muted">Wall time {entry.metrics.get('wall_s', float('nan')):.1f} s; config hash {_esc(entry.metrics.get('config_hash', ''))}; iclab {_esc(entry.metrics.get('version', ''))}.</p>
<h2>Notes</h2><ul>{notes or '<li>None.</li>'}</ul>
<h2>Configuration</h2>
<div class="scroll"><table><thead><tr><th>field</th><th>value</th><th>source</th><th>meaning</th><th>paper's value</th></tr></thead>
<tbody>{''.join(cfg_rows)}</tbody></table></div>
<h2>Data</h2><p>{' · '.join(data_links)}</p>
"""
    (folder / "index.html").write_text(_page(f"{entry.experiment} — iclab", body, "../style.css"))


def build_site(store_root: str | Path, out_dir: str | Path, *, on_damaged=None) -> Path:
    """Builds the site for every finished run in ``store_root``; returns the index path.

    Args:
        store_root: the results root; out_dir: the site's folder.
        on_damaged: called with (folder, problems) for each damaged run folder, which is left out.
    Raises:
        FileNotFoundError: when the store holds no finished run (nothing to show).
    """
    entries = collect_runs(store_root, on_damaged)
    if not entries:
        raise FileNotFoundError(f"no finished runs in {store_root}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "style.css").write_text(CSS)
    registry = dict(all_experiments())
    for e in entries:  # experiments defined in a user's file: load it again for the title and notes
        if e.experiment not in registry and e.source:
            try:
                registry[e.experiment] = load_experiment_file(e.source)
            except UserError:
                pass
    by_paper: dict[str, list[RunEntry]] = {}
    for e in entries:
        exp = registry.get(e.experiment)
        by_paper.setdefault(exp.paper if exp else e.experiment.split(".")[0], []).append(e)
        _experiment_page(e, exp, out)
    sections = []
    for paper, group in sorted(by_paper.items()):
        rows = []
        for e in group:
            exp = registry.get(e.experiment)
            checks = e.metrics.get("checks", [])
            n_pass = sum(c["passed"] for c in checks)
            ok = n_pass == len(checks)
            status = f'<span class="{"pass" if ok else "fail"}">{"pass" if ok else "FAIL"}</span>'
            thumb = (f'<a href="{e.slug}/index.html"><img class="thumb" src="{e.slug}/figure.png" alt="{_esc(e.experiment)}"></a>'
                     if (out / e.slug / "figure.png").is_file() else "")
            date = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.ended)) if e.ended else ""
            rows.append(f'<tr class="{"" if ok else "failing"}"><td>{thumb}</td>'
                        f'<td><a href="{e.slug}/index.html">{_esc(e.experiment)}</a><div class="muted">{_esc(exp.reference if exp else "")}</div></td>'
                        f'<td>{_esc(exp.title if exp else "")}</td><td>{status}</td><td class="num">{n_pass} / {len(checks)}</td>'
                        f'<td class="num">{e.metrics.get("wall_s", float("nan")):.1f} s</td><td class="num">{_esc(date)}</td>'
                        f'<td>{_esc(e.preset)}</td></tr>')
        sections.append(f"<h2>{_esc(paper)}</h2><div class=\"scroll\"><table><thead><tr><th></th><th>experiment</th>"
                        f"<th>title</th><th>status</th><th>checks</th><th>wall time</th><th>date</th><th>preset</th></tr>"
                        f"</thead><tbody>{''.join(rows)}</tbody></table></div>")
    total = sum(len(e.metrics.get("checks", [])) for e in entries)
    passed = sum(c["passed"] for e in entries for c in e.metrics.get("checks", []))
    body = (f"<h1>iclab report</h1><p>{len(entries)} reproductions, {passed} / {total} checks passed. "
            f"Each page shows the figure, its checks against theory, the configuration and the command that "
            f"reproduces it.</p>{''.join(sections)}")
    index = out / "index.html"
    index.write_text(_page("iclab report", body, "style.css"))
    return index
