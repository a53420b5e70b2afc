"""One table of configs and metrics across the stored runs of an experiment (``iclab export``).

A row per stored run folder (``done``, ``diverged`` or ``failed``), plus a row per run whose latest
attempt ``failed`` and that has no folder. Columns: experiment, preset, config_hash (the run key), code
(the code identity's digest), status, passed, checks_passed, checks_total, diverged_step,
last_finite_loss, error, then one column per config field (``config.<name>``; lists as JSON) and one
per check (``check.<name>``: the measured value). Rows are sorted by config values, so the same set of
runs always gives the same file. Wall times are left out for the same reason (they live in the index:
``iclab runs``). The store is read as data, read-only (:mod:`iclab.store`).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from iclab.fields import flat_config
from iclab.store import Store

FORMATS = ("csv", "parquet")
FIXED = ["experiment", "preset", "config_hash", "code", "backend", "status", "passed", "checks_passed", "checks_total",
         "diverged_step", "last_finite_loss", "error"]


def export_rows(root: str | os.PathLike | None, exp_id: str, field_order: list[str] | None = None, *,
                on_damaged=None, on_invalid=None) -> tuple[list[str], list[dict]]:
    """(columns, rows) of every stored run of ``exp_id`` under ``root``.

    Args:
        root: the results root; exp_id: the experiment; field_order: config fields first in the columns (a settings
            group's by their dotted names, each a column).
        on_damaged: called with (folder, problems) for each damaged folder, which is skipped.
        on_invalid: called with one line for each index row skipped (its names would leave the root).
    """
    store = Store(root, readonly=True)
    rows, configs = [], []
    for path in store.folders(exp_id) + store.linked_folders(exp_id):  # a link is damage, never followed
        problems = store.verify(path)
        if problems:
            if on_damaged is not None:
                on_damaged(path, problems)
            continue
        metrics = json.loads((path / "metrics.json").read_text())
        cfg = json.loads((path / "config.json").read_text())
        checks = metrics.get("checks", [])
        div = metrics.get("diverged") if isinstance(metrics.get("diverged"), dict) else {}
        code = metrics.get("code") if isinstance(metrics.get("code"), dict) else {}
        status = metrics.get("status", "done")
        row = {"experiment": exp_id, "preset": cfg.get("preset"), "config_hash": path.name.rsplit("-", 1)[1],
               "code": code.get("digest"), "backend": metrics.get("backend"), "status": status, "passed": bool(metrics.get("passed")),
               "checks_passed": sum(bool(c["passed"]) for c in checks), "checks_total": len(checks),
               "diverged_step": div.get("step"), "last_finite_loss": div.get("last_finite_loss"),
               "error": div.get("message") if status == "diverged" else metrics.get("error")}
        if status == "failed":
            row.update(checks_passed=None, checks_total=None)
        row.update({f"check.{c['name']}": c.get("measured") for c in checks})
        rows.append(row)
        configs.append(cfg.get("config", {}))
    stored = {r["config_hash"] for r in rows}
    latest: dict[str, dict] = {}
    for r in store.rows(experiment=exp_id, on_invalid=on_invalid):  # newest first
        latest.setdefault(r["config_hash"], r)
    for digest, r in sorted(latest.items()):
        if r["status"] == "failed" and digest not in stored and r.get("config"):
            try:
                config = json.loads(r["config"])
            except ValueError:
                continue
            rows.append({"experiment": exp_id, "preset": r["preset"], "config_hash": digest, "code": r.get("code"),
                         "backend": r.get("backend"),
                         "status": "failed", "passed": False, "checks_passed": None, "checks_total": None,
                         "diverged_step": None, "last_finite_loss": None, "error": r["error"]})
            configs.append(config if isinstance(config, dict) else {})
    names = list(field_order or [])
    configs = [flat_config(cfg, names) for cfg in configs]   # a settings group's fields as columns of their own
    for cfg in configs:
        names += [k for k in sorted(cfg) if k not in names]
    for row, cfg in zip(rows, configs):
        for k in names:
            v = cfg.get(k)
            row[f"config.{k}"] = json.dumps(v) if isinstance(v, (list, dict)) else v
    order = sorted(range(len(rows)), key=lambda i: (tuple(_sort_key(configs[i].get(k)) for k in names),
                                                    str(rows[i]["preset"]), rows[i]["config_hash"]))
    rows = [rows[i] for i in order]
    check_cols = []
    for row in rows:
        check_cols += [k for k in row if k.startswith("check.") and k not in check_cols]
    columns = FIXED + [f"config.{k}" for k in names] + check_cols
    return columns, [{c: row.get(c) for c in columns} for row in rows]


def _sort_key(v):
    if isinstance(v, bool) or v is None:
        return (0, str(v), 0.0)
    if isinstance(v, (int, float)):
        return (1, "", float(v))
    return (2, json.dumps(v, sort_keys=True), 0.0)


def write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return repr(v)
        return str(v)

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for row in rows:
            w.writerow([cell(row[c]) for c in columns])
    os.replace(tmp, path)


def write_parquet(path: Path, columns: list[str], rows: list[dict]) -> None:
    """Parquet through pyarrow (ImportError if it is missing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def column(values):
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):  # mixed types: keep them as JSON text
            return pa.array([None if v is None else json.dumps(v) for v in values])

    table = pa.table({c: column([row[c] for row in rows]) for c in columns})
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
