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

from iclab import settings
from iclab.errors import ConfigError, StoreError
from iclab.runner import RunResult, shorten, stored_result
from iclab.names import is_name
from iclab.store import STATUSES, Store, readable_root

__all__ = ["load", "runs"]


def _run_folder(ref, store: Store) -> Path:
    """The folder of a stored run named by a path, a folder name, a run-key prefix or an index row id."""
    root = store.root
    if isinstance(ref, bool) or not isinstance(ref, (int, str, os.PathLike)) or isinstance(ref, bytes):
        raise StoreError(f"a stored run is named by its folder, its name, a prefix of its run key or its index id "
                         f"(got {shorten(ref)})")
    if isinstance(ref, int):
        rows = [r for r in store.rows() if r["id"] == ref]
        if not rows:
            raise StoreError(f"no run with index id {ref} in {root}")
        return root / rows[0]["run_dir"]  # checked by Store.rows: one path component, <experiment>-<key>
    text = os.fspath(ref)
    if not text.strip():
        raise StoreError("the run to load is empty: give a run folder, its name, a run-key prefix or an index id")
    path = Path(os.path.expanduser(text))  # ~user of no such user stays as typed (as in a shell)
    if (path / "config.json").is_file():  # a folder the user named
        return path
    if text.strip().isdigit():  # an index id, or a run-key prefix that happens to be all digits
        text = text.strip()
    if not is_name(text):
        raise StoreError(f"no stored run {shorten(text)} in {root} (give a run folder, its name, a run-key prefix "
                         "or an index id)")
    matches = [d for d in store.folders()
               if d.name == text or d.name.rsplit("-", 1)[-1].startswith(text) or d.name.startswith(text)]
    exact = [d for d in matches if d.name == text]
    matches = exact or matches
    if text.isdigit():
        by_id = [root / r["run_dir"] for r in store.rows() if r["id"] == int(text)]
        matches = list(dict.fromkeys(by_id + matches))
        if not matches:
            raise StoreError(f"no run with index id or run-key prefix {text} in {root}")
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise StoreError(f"no stored run {shorten(text)} in {root} (give a run folder, its name, a run-key prefix "
                         "or an index id)")
    raise StoreError(f"{text!r} names {len(matches)} runs in {root}: {', '.join(m.name for m in matches[:5])}"
                     + (" ..." if len(matches) > 5 else ""))


def load(path_or_id, *, root: str | os.PathLike | None = None) -> RunResult:
    """Reopens a stored run, verified: nothing in it is executed, and a damaged run is refused.

    The run's files are checked against its manifest first (as ``iclab verify`` does). Its arrays, config and
    checks are read as data (``numpy.load`` without pickles, JSON); :meth:`RunResult.figure` gives the stored
    figure, or redraws it with code the user holds (an experiment of iclab's own, or one passed explicitly).

    Args:
        path_or_id: the run's folder, its name (``linattn.fig1-93189116c82f8935``), a unique prefix of its
            run key or name, or its id in the index (``iclab runs``).
        root: the results root searched for names, keys and ids (default ``$ICLAB_RESULTS`` or
            ``./iclab-results``).
    Returns:
        The :class:`iclab.runner.RunResult`: ``.arrays``, ``.config``, ``.checks``, ``.figure()``.
    Raises:
        StoreError: nothing (or more than one run) matches, or the run is damaged (one line).
    """
    settings.check_environment()
    store = Store(readable_root(root, option="root"), readonly=True)
    folder = _run_folder(path_or_id, store)
    problems = store.verify(folder)
    if problems:
        raise StoreError(f"the stored run {folder} is damaged ({'; '.join(problems)}); `iclab verify` lists the "
                         "damaged runs of a store")
    try:
        wall = float(json.loads((folder / "metrics.json").read_text()).get("wall_s") or 0.0)
    except (TypeError, ValueError, AttributeError):
        wall = 0.0
    return stored_result(folder, wall)


def runs(experiment: str | None = None, status: str | None = None, *, root: str | os.PathLike | None = None):
    """The result store's index as a pandas DataFrame, newest first (read-only: the store is not written).

    Args:
        experiment: only this experiment's runs.
        status: only runs of this status (running, done, failed, diverged, interrupted).
        root: the results root (default ``$ICLAB_RESULTS`` or ``./iclab-results``).
    Returns:
        A DataFrame with one row per run: id, experiment, config_hash (the run key), config_key, code (the code
        identity's digest), backend (native or xla), preset, status, started and ended (timestamps), wall_s, checks_passed, checks_total,
        error, diverged_step, last_finite_loss, path (the run folder, where it exists), config (dict), and one
        ``config.<field>`` column per config field. An index row whose names would leave the root is skipped with
        a warning.
    Raises:
        ConfigError: a bad experiment or status; StoreError: a root that is a file or a broken link.
    """
    import pandas as pd

    settings.check_environment()
    if experiment is not None and not isinstance(experiment, str):
        raise ConfigError(f"experiment must be an experiment id (str) or None (got {shorten(experiment)})")
    if status is not None and status not in STATUSES:
        raise ConfigError(f"status must be one of {', '.join(STATUSES)} (got {shorten(status)})")
    store = Store(readable_root(root, option="root"), readonly=True)
    rows = store.rows(experiment=experiment, status=status)
    records = []
    for r in rows:
        try:
            config = json.loads(r["config"]) if r.get("config") else {}
        except ValueError:
            config = {}
        config = config if isinstance(config, dict) else {}
        folder = store.root / r["run_dir"]
        rec = {k: v for k, v in r.items() if k not in ("config", "run_dir")}
        rec["path"] = str(folder) if (folder / "config.json").is_file() and not folder.is_symlink() else None
        rec["config"] = config
        rec.update({f"config.{k}": (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in config.items()})
        records.append(rec)
    columns = ["id", "experiment", "config_hash", "config_key", "code", "backend", "preset", "status", "started", "ended",
               "wall_s", "checks_passed", "checks_total", "error", "diverged_step", "last_finite_loss", "path",
               "config"]
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=columns)
    for col in ("started", "ended"):
        df[col] = pd.to_datetime(df[col], unit="s")
    extra = sorted(c for c in df.columns if c not in columns)
    return df[[c for c in columns if c in df.columns] + extra]
