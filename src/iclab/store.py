"""The result store: one folder per run, named by a hash of its resolved config, and a SQLite index.

Layout of a results root (default ``./iclab-results``, or ``$ICLAB_RESULTS``)::

    index.sqlite                 runs: id, experiment, config hash, preset, status, times, checks
    <experiment>-<hash>/         config.json  metrics.json  trajectories.npz  figure.png/.pdf  log.txt
    .tmp/                        folders being written; renamed into place when complete
    .running/<experiment>-<hash>/  checkpoints of a run in progress (resumed after a crash)
    .locks/<experiment>-<hash>.lock  one lock file per run: one process computes a run at a time

A run folder appears in one ``rename`` once every file is written, so a folder that exists is a
finished run (``done``, or ``diverged`` with its partial trajectory): an interrupted run leaves
only ``.tmp`` and ``.running`` entries, never a folder that looks done.

Concurrency: processes that share a results root take the run's lock (``fcntl.flock``, released
by the kernel when a process dies, SIGKILL included) before computing it, and the index is
SQLite in WAL mode whose writes are retried while another process holds the database.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from iclab import __version__

RESULT_FILES = ("config.json", "metrics.json", "trajectories.npz", "figure.png", "figure.pdf", "log.txt")
STATUSES = ("running", "done", "failed", "diverged", "interrupted")
"""running: being computed; done: finished (checks may pass or fail); failed: raised an exception;
diverged: the loss became NaN or infinite (partial trajectory kept); interrupted: its process died
(or was stopped) before finishing, and a later run of the same config took over."""

_COLUMNS = """
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_dir TEXT NOT NULL,
    experiment TEXT NOT NULL,
    config_hash TEXT NOT NULL,
    preset TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'done', 'failed', 'diverged', 'interrupted')),
    started REAL NOT NULL,
    ended REAL,
    wall_s REAL,
    checks_passed INTEGER,
    checks_total INTEGER,
    error TEXT,
    config TEXT,
    diverged_step INTEGER,
    last_finite_loss REAL
"""
_OLD_COLUMNS = ("id", "run_dir", "experiment", "config_hash", "preset", "status", "started", "ended", "wall_s",
                "checks_passed", "checks_total", "error")
_SCHEMA = f"CREATE TABLE IF NOT EXISTS runs ({_COLUMNS});\nCREATE INDEX IF NOT EXISTS runs_by_hash ON runs (config_hash);\n"

# Writers wait for each other: sqlite's own busy timeout, then retries with jittered backoff.
_DB_TIMEOUT_S = 30.0
_DB_RETRY_S = 120.0


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
        con = sqlite3.connect(self.root / "index.sqlite", timeout=_DB_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            _migrate(con)
            yield con
            con.commit()
        finally:
            con.close()

    def _transact(self, fn):
        """Runs ``fn(con)`` in one transaction, retried while the database is locked by another
        process (WAL lets readers run beside one writer; writers queue)."""
        deadline = time.monotonic() + _DB_RETRY_S
        delay = 0.05
        while True:
            try:
                with self._db() as con:
                    return fn(con)
            except sqlite3.OperationalError as err:
                if not _is_locked(err) or time.monotonic() > deadline:
                    raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    def rows(self, experiment: str | None = None, status: str | None = None) -> list[dict]:
        """Index rows, newest first, optionally for one experiment and/or one status."""
        if not (self.root / "index.sqlite").exists():
            return []
        where, args = [], []
        if experiment:
            where.append("experiment = ?")
            args.append(experiment)
        if status:
            where.append("status = ?")
            args.append(status)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC"

        def query(con):
            con.row_factory = sqlite3.Row
            return [dict(r) for r in con.execute(sql, args)]

        return self._transact(query)

    # -- folders ----------------------------------------------------------------------------

    def run_dir(self, experiment_id: str, digest: str) -> Path:
        return self.root / f"{experiment_id}-{digest}"

    def finished(self, experiment_id: str, digest: str) -> Path | None:
        """The folder of a finished run with this config, or None."""
        path = self.run_dir(experiment_id, digest)
        return path if (path / "metrics.json").is_file() else None

    def running_dir(self, experiment_id: str, digest: str) -> Path:
        """The in-progress folder of a run: its checkpoints, kept until the run is stored."""
        return self.root / ".running" / f"{experiment_id}-{digest}"

    def lock(self, experiment_id: str, digest: str) -> "RunLock":
        """The lock of one run (not yet acquired): see :class:`RunLock`."""
        return RunLock(self.root / ".locks" / f"{experiment_id}-{digest}.lock")

    def begin(self, experiment_id: str, digest: str, preset: str | None, config: dict | None = None) -> int:
        """Records a run as running; returns its index row id."""
        values = (self.run_dir(experiment_id, digest).name, experiment_id, digest, preset, time.time(),
                  None if config is None else json.dumps(config, sort_keys=True))
        return self._transact(lambda con: int(con.execute(
            "INSERT INTO runs (run_dir, experiment, config_hash, preset, status, started, config) "
            "VALUES (?, ?, ?, ?, 'running', ?, ?)", values).lastrowid))

    def end(self, row: int, status: str, wall_s: float, passed: int | None = None, total: int | None = None,
            error: str | None = None, diverged_step: int | None = None, last_finite_loss: float | None = None) -> None:
        """Marks a run done, failed, diverged or interrupted, with its wall time and check counts."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES} (got {status!r})")
        values = (status, time.time(), wall_s, passed, total, error, diverged_step, last_finite_loss, row)
        self._transact(lambda con: con.execute(
            "UPDATE runs SET status = ?, ended = ?, wall_s = ?, checks_passed = ?, checks_total = ?, error = ?, "
            "diverged_step = ?, last_finite_loss = ? WHERE id = ?", values))

    def mark_interrupted(self, experiment_id: str, digest: str, note: str = "its process died before finishing") -> int:
        """Marks the ``running`` rows of a run as interrupted; call it holding the run's lock (then
        no live process is computing it). Returns how many rows changed."""
        return self._transact(lambda con: con.execute(
            "UPDATE runs SET status = 'interrupted', ended = ?, error = ? "
            "WHERE experiment = ? AND config_hash = ? AND status = 'running'",
            (time.time(), note, experiment_id, digest)).rowcount)

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
                elif isinstance(content, (bytes, bytearray)):
                    dest.write_bytes(content)
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


class RunLock:
    """An exclusive ``fcntl.flock`` on a run's lock file: one process computes a run at a time.

    The kernel releases it when the holder's file is closed or the process dies (SIGKILL
    included), so a crashed run never leaves a stale lock. Lock files are never deleted (deleting
    one would let two processes lock two different files of the same name).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, blocking: bool = True) -> bool:
        """Takes the lock; with ``blocking=False`` returns False at once if another process holds it."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {time.time():.0f}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _is_locked(err: sqlite3.OperationalError) -> bool:
    text = str(err).lower()
    return "locked" in text or "busy" in text


def _migrate(con: sqlite3.Connection) -> None:
    """Creates the index, or upgrades one written by an older iclab (new statuses and columns)."""
    row = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone()
    if row is None:
        con.executescript(_SCHEMA)
        return
    if "interrupted" in row[0]:
        return
    # SQLite cannot alter a CHECK constraint: copy into a new table, in one transaction.
    con.execute("BEGIN IMMEDIATE")
    row = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone()
    if "interrupted" not in row[0]:  # another process may have migrated while we waited
        cols = ", ".join(_OLD_COLUMNS)
        con.execute(f"CREATE TABLE runs_new ({_COLUMNS})")
        con.execute(f"INSERT INTO runs_new ({cols}) SELECT {cols} FROM runs")
        con.execute("DROP TABLE runs")
        con.execute("ALTER TABLE runs_new RENAME TO runs")
        con.execute("CREATE INDEX IF NOT EXISTS runs_by_hash ON runs (config_hash)")
    con.execute("COMMIT")


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__}")
