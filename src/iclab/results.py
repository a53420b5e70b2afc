"""Stored runs as Python objects: :func:`load` reopens one run, :func:`runs` is the index as a DataFrame.

A notebook never parses ``trajectories.npz`` or ``metrics.json`` by hand::

    import iclab
    r = iclab.run_experiment("linattn.fig1", "quick", {"N": 63})
    r.arrays["sampled_attn_m"], r.checks, r.figure()
    df = iclab.runs(experiment="linattn.fig1")          # one row per run, config.<field> columns
    again = iclab.load(df.path.iloc[0])                 # or iclab.load("linattn.fig1-93189116") / a row id
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from iclab.launch import RunResult, UserError, load_experiment_file, stored_result
from iclab.store import Store

__all__ = ["load", "runs"]


def _run_folder(ref, root: Path) -> Path:
    """The folder of a stored run named by a path, a folder name, a config-hash prefix or an index row id."""
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        rows = [r for r in Store(root).rows() if r["id"] == int(ref)]
        if not rows:
            raise UserError(f"no run with index id {ref} in {root}")
        path = Path(rows[0]["run_dir"])
        return path if path.is_absolute() else root / path
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path
    if (root / path / "config.json").is_file():
        return root / path
    text = str(ref)
    matches = sorted(d for d in root.glob("*") if d.is_dir() and (d / "config.json").is_file()
                     and (d.name == text or d.name.rsplit("-", 1)[-1].startswith(text) or d.name.startswith(text)))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UserError(f"no stored run {text!r} in {root} (give a run folder, its name, a config-hash prefix "
                        "or an index id)")
    raise UserError(f"{text!r} names {len(matches)} runs in {root}: {', '.join(m.name for m in matches[:5])}"
                    + (" ..." if len(matches) > 5 else ""))


def load(path_or_id, *, root: str | os.PathLike | None = None) -> RunResult:
    """Reopens a stored run.

    Args:
        path_or_id: the run's folder, its name (``linattn.fig1-93189116c82f8935``), a unique prefix of its
            config hash or name, or its id in the index (``iclab runs``).
        root: the results root searched for names, hashes and ids (default ``$ICLAB_RESULTS`` or
            ``./iclab-results``).
    Returns:
        The :class:`iclab.launch.RunResult`: ``.arrays``, ``.config``, ``.checks``, ``.figure()``.
    Raises:
        UserError: when nothing (or more than one run) matches.
    """
    root_path = Store(root).root
    folder = _run_folder(path_or_id, root_path)
    stored = json.loads((folder / "config.json").read_text())
    metrics = json.loads((folder / "metrics.json").read_text())
    if stored.get("source"):
        try:
            load_experiment_file(stored["source"])
        except UserError:
            pass  # arrays and checks stay at hand; only figure() needs the file
    return stored_result(stored["experiment"], folder, stored["config"], float(metrics.get("wall_s", 0.0)))


def runs(experiment: str | None = None, status: str | None = None, *, root: str | os.PathLike | None = None):
    """The result store's index as a pandas DataFrame, newest first.

    Args:
        experiment: only this experiment's runs.
        status: only runs of this status (running, done, failed, diverged, interrupted).
        root: the results root (default ``$ICLAB_RESULTS`` or ``./iclab-results``).
    Returns:
        A DataFrame with one row per run: id, experiment, config_hash, preset, status, started and ended
        (timestamps), wall_s, checks_passed, checks_total, error, diverged_step, last_finite_loss, path (the
        run folder, where it exists), config (dict), and one ``config.<field>`` column per config field.
    """
    import pandas as pd

    store = Store(root)
    rows = store.rows(experiment=experiment, status=status)
    records = []
    for r in rows:
        config = json.loads(r["config"]) if r.get("config") else {}
        folder = Path(r["run_dir"])
        folder = folder if folder.is_absolute() else store.root / folder
        rec = {k: v for k, v in r.items() if k not in ("config", "run_dir")}
        rec["path"] = str(folder) if (folder / "config.json").is_file() else None
        rec["config"] = config
        rec.update({f"config.{k}": (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in config.items()})
        records.append(rec)
    columns = ["id", "experiment", "config_hash", "preset", "status", "started", "ended", "wall_s", "checks_passed",
               "checks_total", "error", "diverged_step", "last_finite_loss", "path", "config"]
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=columns)
    for col in ("started", "ended"):
        df[col] = pd.to_datetime(df[col], unit="s")
    extra = sorted(c for c in df.columns if c not in columns)
    return df[[c for c in columns if c in df.columns] + extra]
