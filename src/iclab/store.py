"""The result store: one folder per run, named by a hash of its resolved config, and a SQLite index.

Layout of a results root (default ``./iclab-results``, or ``$ICLAB_RESULTS``)::

    index.sqlite                 runs: id, experiment, config hash, preset, status, times, checks
    <experiment>-<hash>/         config.json  metrics.json  trajectories.npz  figure.png/.pdf  log.txt
    .tmp/                        folders being written; renamed into place when complete

A run folder appears in one ``rename`` once every file is written, so a folder that exists is a
finished run: an interrupted run leaves only a ``.tmp`` entry, never a folder that looks done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from iclab import __version__

RESULT_FILES = ("config.json", "metrics.json", "trajectories.npz", "figure.png", "figure.pdf", "log.txt")
STATUSES = ("running", "done", "failed")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_dir TEXT NOT NULL,
    experiment TEXT NOT NULL,
    config_hash TEXT NOT NULL,
    preset TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed')),
    started REAL NOT NULL,
    ended REAL,
    wall_s REAL,
    checks_passed INTEGER,
    checks_total INTEGER,
    error TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_hash ON runs (config_hash);
"""


def default_root() -> Path:
    """``$ICLAB_RESULTS`` if set, else ``./iclab-results``."""
    return Path(os.environ.get("ICLAB_RESULTS", "iclab-results"))


def config_hash(experiment_id: str, config: dict) -> str:
    """16 hex digits of SHA-256 over the experiment id, resolved config and package version."""
    payload = json.dumps({"experiment": experiment_id, "config": config, "version": __version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Store:
    """A results root: run folders plus the SQLite index (WAL mode)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_root()

    # -- index ----------------------------------------------------------------------------

    @contextmanager
    def _db(self):
        self.root.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.root / "index.sqlite", timeout=30.0)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(_SCHEMA)
            yield con
            con.commit()
        finally:
            con.close()

    def rows(self, experiment: str | None = None) -> list[dict]:
        """Index rows, newest first, optionally for one experiment."""
        if not (self.root / "index.sqlite").exists():
            return []
        with self._db() as con:
            con.row_factory = sqlite3.Row
            sql = "SELECT * FROM runs" + (" WHERE experiment = ?" if experiment else "") + " ORDER BY id DESC"
            return [dict(r) for r in con.execute(sql, (experiment,) if experiment else ())]

    # -- folders ----------------------------------------------------------------------------

    def run_dir(self, experiment_id: str, digest: str) -> Path:
        return self.root / f"{experiment_id}-{digest}"

    def finished(self, experiment_id: str, digest: str) -> Path | None:
        """The folder of a finished run with this config, or None."""
        path = self.run_dir(experiment_id, digest)
        return path if (path / "metrics.json").is_file() else None

    def begin(self, experiment_id: str, digest: str, preset: str | None) -> int:
        """Records a run as running; returns its index row id."""
        with self._db() as con:
            cur = con.execute(
                "INSERT INTO runs (run_dir, experiment, config_hash, preset, status, started) VALUES (?, ?, ?, ?, 'running', ?)",
                (self.run_dir(experiment_id, digest).name, experiment_id, digest, preset, time.time()),
            )
            return int(cur.lastrowid)

    def end(self, row: int, status: str, wall_s: float, passed: int | None = None, total: int | None = None,
            error: str | None = None) -> None:
        """Marks a run done or failed, with its wall time and check counts."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES} (got {status!r})")
        with self._db() as con:
            con.execute(
                "UPDATE runs SET status = ?, ended = ?, wall_s = ?, checks_passed = ?, checks_total = ?, error = ? WHERE id = ?",
                (status, time.time(), wall_s, passed, total, error, row),
            )

    def write(self, experiment_id: str, digest: str, files: dict[str, object]) -> Path:
        """Writes a run's files into a temporary folder, then renames it into place.

        ``files`` maps names to: dict (JSON), str (text), dict of arrays under a ``.npz`` name,
        or a callable taking the destination path (figures).
        """
        tmp_root = self.root / ".tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        tmp = tmp_root / f"{experiment_id}-{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, content in files.items():
                dest = tmp / name
                if callable(content):
                    content(dest)
                elif name.endswith(".npz"):
                    np.savez_compressed(dest, **{k: np.asarray(v) for k, v in content.items()})
                elif name.endswith(".json"):
                    dest.write_text(json.dumps(content, indent=2, default=_json_default) + "\n")
                else:
                    dest.write_text(str(content))
            final = self.run_dir(experiment_id, digest)
            old = None
            if final.exists():  # --force: move the old result aside, then swap the new one in
                old = tmp_root / f"old-{final.name}.{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return final
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__}")
