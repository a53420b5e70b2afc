"""A static, offline site of every reproduction in a result store.

``build_site(store_root, out_dir)`` writes ``index.html`` (one row per experiment and preset,
grouped by paper, with a thumbnail) and one page per experiment: its figure, the checks table,
the resolved config with each value marked as the paper's or our choice, the notes that apply,
the command that reproduces it, and the raw data (npz and a CSV of its main curves). Plain
HTML and CSS, no scripts, no CDN: it opens from the file system.

A results root is data (:mod:`iclab.store`): the site is built from the runs' own files (each run records
its experiment's title, notes and field descriptions), read-only, with every stored text escaped, every
name checked before it becomes a path, and nothing written outside ``out_dir``. No code named by the store
is imported; iclab's own experiments are looked up in the installed package only for runs that recorded
no description of their own.
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

from iclab.fields import flat_config
from iclab.names import is_name
from iclab.store import NPZ_ERRORS, Store

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
    info: dict | None = None
    preset_config: dict | None = None

    @property
    def slug(self) -> str:
        return f"{self.experiment}-{self.preset}"


def collect_runs(store_root: str | Path, on_damaged=None, on_invalid=None) -> list[RunEntry]:
    """The newest finished run per (experiment, preset) in a result store, read-only; damaged folders and index
    rows whose names would leave the root are skipped.

    Args:
        store_root: the results root.
        on_damaged: called with (folder, problems) for each damaged folder skipped.
        on_invalid: called with one line for each index row skipped (default: a warning).
    """
    store = Store(store_root, readonly=True)
    if not store.root.is_dir():
        return []
    seen: dict[tuple[str, str], RunEntry] = {}
    for row in store.rows(on_invalid=on_invalid):  # newest first; names checked
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
        preset = cfg.get("preset") or row["preset"] or "custom"
        key = (row["experiment"], preset if is_name(preset) else "custom")
        if key in seen:
            continue
        source = cfg.get("source") if isinstance(cfg.get("source"), str) else None
        info = cfg.get("experiment_info") if isinstance(cfg.get("experiment_info"), dict) else None
        base = cfg.get("preset_config") if isinstance(cfg.get("preset_config"), dict) else None
        seen[key] = RunEntry(row["experiment"], key[1], path, cfg["config"],
                             json.loads((path / "metrics.json").read_text()), row["ended"], source, info, base)
    return sorted(seen.values(), key=lambda r: (r.experiment, r.preset))


def _builtin_info(experiment: str) -> tuple[dict | None, dict | None]:
    """(description, preset configs) of one of iclab's own experiments, from the installed package (None, None
    for any other id): for runs stored before runs recorded their own."""
    from iclab.runner import builtin_experiment, experiment_info

    exp = builtin_experiment(experiment)
    if exp is None:
        return None, None
    presets = {}
    for name in exp.presets:
        try:
            presets[name] = exp.resolve(name).model_dump(mode="json")
        except Exception:  # noqa: BLE001 - a preset this code no longer validates: no base to compare with
            pass
    return experiment_info(exp), presets


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


def _command(entry: RunEntry, base: dict | None, names=()) -> str:
    base = flat_config(base or {}, names)
    parts = ["iclab", "run", entry.source or entry.experiment, "--preset", entry.preset]
    for key, value in flat_config(entry.config, names).items():
        if key in base and base[key] != value:
            parts += ["--set", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    return " ".join(parts)


def _text_list(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _experiment_page(entry: RunEntry, info: dict, base: dict | None, out: Path) -> None:
    folder = out / entry.slug
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("figure.png", "figure.pdf", "trajectories.npz"):
        src = entry.path / name
        if src.is_file() and not src.is_symlink():
            shutil.copyfile(src, folder / name)
    n_cols = 0
    if (entry.path / "trajectories.npz").is_file():
        try:
            with np.load(entry.path / "trajectories.npz", allow_pickle=False) as data:
                n_cols = write_curves_csv({k: data[k] for k in data.files}, folder / "curves.csv")
        except NPZ_ERRORS:  # arrays that match their manifest but are not arrays: no curves
            n_cols = 0
    checks = [c for c in entry.metrics.get("checks", []) if isinstance(c, dict)]
    n_pass = sum(bool(c.get("passed")) for c in checks)
    rows = []
    for c in checks:
        status = '<span class="pass">pass</span>' if c.get("passed") else '<span class="fail">FAIL</span>'
        tolerance = c.get("tolerance")
        tol = {"abs": f"± {_fmt(tolerance)}", "rel": f"± {_fmt(tolerance)} (relative)", "le": "≤ expected",
               "ge": "≥ expected", "eq": "exact"}.get(c.get("comparison"), _fmt(tolerance))
        note = f'<div class="muted">{_esc(c["note"])}</div>' if c.get("note") else ""
        rows.append(f'<tr class="{"" if c.get("passed") else "failing"}"><td>{_esc(c.get("name", ""))}{note}</td>'
                    f'<td class="num">{_fmt(c.get("measured"))}</td><td class="num">{_fmt(c.get("expected"))}</td>'
                    f'<td class="num">{tol}</td><td>{status}</td></tr>')
    fields = info.get("fields") if isinstance(info.get("fields"), dict) else {}
    cfg_rows = []
    for key, value in flat_config(entry.config, fields).items():
        field = fields.get(key) if isinstance(fields.get(key), dict) else {}
        paper_value = field.get("paper")
        if paper_value is not None and paper_value == value:
            mark = '<span class="tag paper">paper</span>'
        else:
            mark = '<span class="tag ours">our choice</span>'
        note = field.get("paper_note") or ""
        paper_txt = "not stated" if paper_value is None else _fmt(paper_value)
        cfg_rows.append(f"<tr><td><code>{_esc(key)}</code></td><td class=\"num\">{_fmt(value)}</td><td>{mark}</td>"
                        f"<td>{_esc(field.get('description') or '')}</td><td>{paper_txt}"
                        f"{' — ' + _esc(note) if note else ''}</td></tr>")
    notes = "".join(f"<li>{_esc(n)}</li>" for n in _text_list(info.get("notes")))
    title = info.get("title") or entry.experiment
    data_links = ['<a href="trajectories.npz">trajectories.npz</a>']
    if n_cols:
        data_links.append(f'<a href="curves.csv">curves.csv</a> ({n_cols} columns)')
    figure = ('<p><img class="figure" src="figure.png" alt="figure of ' + _esc(entry.experiment) + '"></p>'
              '<p><a href="figure.pdf">figure (PDF)</a></p>') if (folder / "figure.png").is_file() else "<p>No figure.</p>"
    wall = entry.metrics.get("wall_s")
    wall = wall if isinstance(wall, (int, float)) and not isinstance(wall, bool) else float("nan")
    code = entry.metrics.get("code") if isinstance(entry.metrics.get("code"), dict) else {}
    body = f"""<p><a href="../index.html">← all experiments</a></p>
<h1>{_esc(entry.experiment)} <span class="muted">({_esc(entry.preset)} preset)</span></h1>
<p>{_esc(title)}</p>
<p class="muted">Reproduces: {_esc(info.get('reference') or '')}</p>
{figure}
<h2>Checks: {n_pass} / {len(checks)} passed</h2>
<div class="scroll"><table><thead><tr><th>check</th><th>measured</th><th>expected</th><th>tolerance</th><th>result</th></tr></thead>
<tbody>{''.join(rows)}</tbody></table></div>
<h2>Reproduce</h2>
<pre>{_esc(_command(entry, base, fields))}</pre>
<p class="muted">Wall time {wall:.1f} s; run key {_esc(entry.metrics.get('config_hash', ''))}; code {_esc(code.get('digest', 'not recorded'))}; iclab {_esc(entry.metrics.get('version', ''))}.</p>
<h2>Notes</h2><ul>{notes or '<li>None.</li>'}</ul>
<h2>Configuration</h2>
<div class="scroll"><table><thead><tr><th>field</th><th>value</th><th>source</th><th>meaning</th><th>paper's value</th></tr></thead>
<tbody>{''.join(cfg_rows)}</tbody></table></div>
<h2>Data</h2><p>{' · '.join(data_links)}</p>
"""
    (folder / "index.html").write_text(_page(f"{entry.experiment} — iclab", body, "../style.css"))


def build_site(store_root: str | Path, out_dir: str | Path, *, on_damaged=None, on_invalid=None) -> Path:
    """Builds the site for every finished run in ``store_root``; returns the index path.

    Args:
        store_root: the results root (read, never written); out_dir: the site's folder (the only one written).
        on_damaged: called with (folder, problems) for each damaged run folder, which is left out.
        on_invalid: called with one line for each index row left out (its names would leave the root).
    Raises:
        FileNotFoundError: when the store holds no finished run (nothing to show).
    """
    entries = collect_runs(store_root, on_damaged, on_invalid)
    if not entries:
        raise FileNotFoundError(f"no finished runs in {store_root}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "style.css").write_text(CSS)
    infos: dict[int, tuple[dict, dict | None]] = {}
    by_paper: dict[str, list[RunEntry]] = {}
    for e in entries:
        info, base = e.info, e.preset_config
        if info is None or base is None:
            builtin_info, presets = _builtin_info(e.experiment)
            info = info or builtin_info or {}
            base = base if base is not None else (presets or {}).get(e.preset)
        infos[id(e)] = (info, base)
        paper = info.get("paper") if isinstance(info.get("paper"), str) else e.experiment.split(".")[0]
        by_paper.setdefault(paper, []).append(e)
        _experiment_page(e, info, base, out)
    sections = []
    for paper, group in sorted(by_paper.items()):
        rows = []
        for e in group:
            info = infos[id(e)][0]
            checks = [c for c in e.metrics.get("checks", []) if isinstance(c, dict)]
            n_pass = sum(bool(c.get("passed")) for c in checks)
            ok = n_pass == len(checks)
            status = f'<span class="{"pass" if ok else "fail"}">{"pass" if ok else "FAIL"}</span>'
            thumb = (f'<a href="{e.slug}/index.html"><img class="thumb" src="{e.slug}/figure.png" alt="{_esc(e.experiment)}"></a>'
                     if (out / e.slug / "figure.png").is_file() else "")
            date = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.ended)) if e.ended else ""
            wall = e.metrics.get("wall_s")
            wall = wall if isinstance(wall, (int, float)) and not isinstance(wall, bool) else float("nan")
            rows.append(f'<tr class="{"" if ok else "failing"}"><td>{thumb}</td>'
                        f'<td><a href="{e.slug}/index.html">{_esc(e.experiment)}</a><div class="muted">{_esc(info.get("reference") or "")}</div></td>'
                        f'<td>{_esc(info.get("title") or "")}</td><td>{status}</td><td class="num">{n_pass} / {len(checks)}</td>'
                        f'<td class="num">{wall:.1f} s</td><td class="num">{_esc(date)}</td>'
                        f'<td>{_esc(e.preset)}</td></tr>')
        sections.append(f"<h2>{_esc(paper)}</h2><div class=\"scroll\"><table><thead><tr><th></th><th>experiment</th>"
                        f"<th>title</th><th>status</th><th>checks</th><th>wall time</th><th>date</th><th>preset</th></tr>"
                        f"</thead><tbody>{''.join(rows)}</tbody></table></div>")
    total = sum(len(e.metrics.get("checks", [])) for e in entries)
    passed = sum(bool(c.get("passed")) for e in entries for c in e.metrics.get("checks", []) if isinstance(c, dict))
    body = (f"<h1>iclab report</h1><p>{len(entries)} reproductions, {passed} / {total} checks passed. "
            f"Each page shows the figure, its checks against theory, the configuration and the command that "
            f"reproduces it.</p>{''.join(sections)}")
    index = out / "index.html"
    index.write_text(_page("iclab report", body, "style.css"))
    return index
