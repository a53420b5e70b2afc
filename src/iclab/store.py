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

The index is a cache of the folders, never the only copy: every finished folder is self-describing
(``config.json``; ``metrics.json`` with its checks, its index row and the size and SHA-256 of every
other file, ``artifacts``). :meth:`Store.rebuild_index` (``iclab index rebuild``) rebuilds the index
from the folders, moving the old file aside; an index that is missing or empty is rebuilt on first
use; an unreadable one is a one-line :class:`IndexDamaged` naming the command that repairs it.
:meth:`Store.verify` checks a folder against its manifest; a damaged folder is never reused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import zipfile
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


class StoreError(Exception):
    """A result store that cannot be used as it is (an unreadable index, a full disk): one line for the user."""


class IndexDamaged(StoreError):
    """``index.sqlite`` cannot be read; ``iclab index rebuild`` rebuilds it from the run folders."""


def _disk_full(err: BaseException) -> bool:
    text = str(err).lower()
    return (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or "disk is full" in text


def _file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def config_hash(experiment_id: str, config: dict) -> str:
    """16 hex digits of SHA-256 over the experiment id, resolved config and package version."""
    payload = json.dumps({"experiment": experiment_id, "config": config, "version": __version__}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Store:
    """A results root: run folders plus the SQLite index (WAL mode)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_root()

    # -- index ----------------------------------------------------------------------------

    @property
    def index_path(self) -> Path:
        """The SQLite index of this root."""
        return self.root / "index.sqlite"

    def _damaged(self, err: BaseException) -> StoreError:
        if _disk_full(err):
            return StoreError(f"the disk holding {self.root} is full ({err}); free space and run the command again")
        return IndexDamaged(f"the index {self.index_path} cannot be read ({err}); rebuild it from the run folders "
                            f"with `iclab index rebuild --results {self.root}` (no result is lost)")

    @contextmanager
    def _db(self):
        self.root.mkdir(parents=True, exist_ok=True)
        fresh = not self.index_path.is_file() or self.index_path.stat().st_size == 0
        try:
            con = sqlite3.connect(self.index_path, timeout=_DB_TIMEOUT_S)
        except sqlite3.DatabaseError as err:
            raise self._damaged(err) from None
        try:
            try:
                con.execute("PRAGMA journal_mode=WAL")
                _migrate(con)
                if fresh:
                    _index_folders(con, self, only_if_empty=True)
            except sqlite3.DatabaseError as err:
                if isinstance(err, sqlite3.OperationalError) and _is_locked(err):
                    raise
                raise self._damaged(err) from None
            try:
                yield con
                con.commit()
            except sqlite3.DatabaseError as err:
                if isinstance(err, sqlite3.OperationalError) and _is_locked(err):
                    raise
                raise self._damaged(err) from None
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
        """Index rows, newest first, optionally for one experiment and/or one status.

        A missing or empty index is rebuilt from the folders first; a ``running`` row whose process is gone
        (its lock is free) is marked ``interrupted``.

        Args:
            experiment: only this experiment's rows; status: only rows of this status.
        """
        if not self.root.is_dir():
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

        rows = self._transact(query)
        stale = [r for r in rows if r["status"] == "running" and self._abandoned(r["experiment"], r["config_hash"])]
        for r in stale:  # its process is gone (the lock is free): say so in the index too
            self.mark_interrupted(r["experiment"], r["config_hash"], "its process is gone (found by a later command)")
        return self._transact(query) if stale else rows

    def _abandoned(self, experiment_id: str, digest: str) -> bool:
        """True when nobody holds the run's lock, i.e. no live process computes it."""
        lock = self.lock(experiment_id, digest)
        try:
            if not lock.acquire(blocking=False):
                return False
        except OSError:
            return False
        lock.release()
        return True

    def indexed(self, experiment_id: str, digest: str) -> bool:
        """Whether the index has a finished (done or diverged) row of this run."""
        return bool(self._transact(lambda con: con.execute(
            "SELECT COUNT(*) FROM runs WHERE experiment = ? AND config_hash = ? AND status IN ('done', 'diverged')",
            (experiment_id, digest)).fetchone()[0]))

    def index_folder(self, path: Path) -> None:
        """Adds a finished run folder to the index (a reused folder the index had lost)."""
        self._transact(lambda con: _insert_folder(con, self, Path(path)))

    def rebuild_index(self) -> tuple[int, Path | None]:
        """Rebuilds ``index.sqlite`` from the run folders; the old file is moved aside, never deleted.

        Rows of runs that left no folder (failed, interrupted) are only in the old file. A folder whose
        ``metrics.json`` records its index row gets that row back as it was (id, times, status, checks).

        Returns:
            (number of runs indexed, where the old index was moved, or None if there was none).
        """
        moved = None
        if self.index_path.exists() and self.index_path.stat().st_size > 0:
            moved = self.root / f"index.sqlite.old-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            os.rename(self.index_path, moved)
            for suffix in ("-wal", "-shm"):
                side = self.root / f"index.sqlite{suffix}"
                if side.exists():
                    os.rename(side, moved.with_name(moved.name + suffix))
        elif self.index_path.exists():
            self.index_path.unlink()
        self.root.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.index_path, timeout=_DB_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            _migrate(con)
            n = _index_folders(con, self, only_if_empty=False)
            con.commit()
        finally:
            con.close()
        return n, moved

    def folders(self, experiment_id: str | None = None) -> list[Path]:
        """Every finished run folder (one with a ``metrics.json``) of the root, or of one experiment."""
        if not self.root.is_dir():
            return []
        out = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir() or not (path / "metrics.json").exists():
                continue
            if experiment_id is None or path.name.rsplit("-", 1)[0] == experiment_id:
                out.append(path)
        return out

    def verify(self, path: Path) -> list[str]:
        """What is wrong with a finished run folder (an empty list when it is intact).

        Checks that ``config.json`` and ``metrics.json`` parse and hold what a run needs, and that every
        artifact listed in the manifest (``metrics.json["artifacts"]``) exists with its recorded size and
        SHA-256; a folder written before manifests existed is checked for its files and a readable npz.
        """
        path = Path(path)
        problems = []
        try:
            metrics = json.loads((path / "metrics.json").read_text())
            if not isinstance(metrics, dict) or not isinstance(metrics.get("checks"), list):
                problems.append("metrics.json lacks its checks")
                metrics = metrics if isinstance(metrics, dict) else {}
        except (OSError, ValueError) as err:
            return [f"metrics.json unreadable ({type(err).__name__})"]
        try:
            config = json.loads((path / "config.json").read_text())
            if not isinstance(config, dict) or "experiment" not in config or not isinstance(config.get("config"), dict):
                problems.append("config.json lacks the experiment or its config")
        except (OSError, ValueError) as err:
            problems.append(f"config.json unreadable ({type(err).__name__})")
        manifest = metrics.get("artifacts")
        if isinstance(manifest, dict):
            for name, want in manifest.items():
                file = path / name
                if not file.is_file():
                    problems.append(f"{name} missing")
                elif file.stat().st_size != want.get("size"):
                    problems.append(f"{name} has {file.stat().st_size} bytes, {want.get('size')} recorded")
                elif _file_digest(file)["sha256"] != want.get("sha256"):
                    problems.append(f"{name} differs from its recorded SHA-256")
        else:
            for name in RESULT_FILES:
                if not (path / name).is_file():
                    problems.append(f"{name} missing")
            if (path / "trajectories.npz").is_file():
                try:
                    with np.load(path / "trajectories.npz") as z:
                        for k in z.files:
                            z[k]
                except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
                    problems.append(f"trajectories.npz unreadable ({type(err).__name__})")
        return problems

    def set_aside(self, path: Path) -> Path:
        """Moves a damaged run folder to ``.damaged/`` (never deletes it); returns where it went."""
        dest_root = self.root / ".damaged"
        dest_root.mkdir(parents=True, exist_ok=True)
        dest = dest_root / f"{Path(path).name}.{time.strftime('%Y%m%d-%H%M%S')}.{uuid.uuid4().hex[:6]}"
        os.rename(path, dest)
        return dest

    # -- folders ----------------------------------------------------------------------------

    def run_dir(self, experiment_id: str, digest: str) -> Path:
        return self.root / f"{experiment_id}-{digest}"

    def finished(self, experiment_id: str, digest: str) -> Path | None:
        """The folder of a finished run with this config, or None (also when it is damaged: see :meth:`verify`)."""
        path = self.run_dir(experiment_id, digest)
        if not (path / "metrics.json").exists():
            return None
        return path if not self.verify(path) else None

    def damaged(self, experiment_id: str, digest: str) -> list[str]:
        """The problems of this run's folder (empty when it is intact or absent)."""
        path = self.run_dir(experiment_id, digest)
        return self.verify(path) if (path / "metrics.json").exists() else []

    def running_dir(self, experiment_id: str, digest: str) -> Path:
        """The in-progress folder of a run: its checkpoints, kept until the run is stored."""
        return self.root / ".running" / f"{experiment_id}-{digest}"

    def lock(self, experiment_id: str, digest: str) -> "RunLock":
        """The lock of one run (not yet acquired): see :class:`RunLock`."""
        return RunLock(self.root / ".locks" / f"{experiment_id}-{digest}.lock")

    def begin(self, experiment_id: str, digest: str, preset: str | None, config: dict | None = None, *,
              started: float | None = None) -> int:
        """Records a run as running (at ``started``, default now); returns its index row id."""
        values = (self.run_dir(experiment_id, digest).name, experiment_id, digest, preset,
                  time.time() if started is None else started,
                  None if config is None else json.dumps(config, sort_keys=True))
        return self._transact(lambda con: int(con.execute(
            "INSERT INTO runs (run_dir, experiment, config_hash, preset, status, started, config) "
            "VALUES (?, ?, ?, ?, 'running', ?, ?)", values).lastrowid))

    def end(self, row: int, status: str, wall_s: float, passed: int | None = None, total: int | None = None,
            error: str | None = None, diverged_step: int | None = None, last_finite_loss: float | None = None,
            ended: float | None = None) -> None:
        """Marks a run done, failed, diverged or interrupted, with its wall time and check counts."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES} (got {status!r})")
        values = (status, time.time() if ended is None else ended, wall_s, passed, total, error, diverged_step,
                  last_finite_loss, row)
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
        tmp = tmp_root / f"{experiment_id}-{digest}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            tmp_root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            # metrics.json last: it carries the manifest (size and SHA-256) of every other file
            ordered = sorted(files.items(), key=lambda kv: kv[0] == "metrics.json")
            for name, content in ordered:
                dest = tmp / name
                if name == "metrics.json" and isinstance(content, dict):
                    content = dict(content, artifacts={n: _file_digest(tmp / n) for n in files if n != "metrics.json"})
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
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError) and _disk_full(err):
                raise StoreError(f"the disk holding {self.root} is full: the result of {experiment_id} was not "
                                 "written (nothing partial is left); free space and run the command again") from None
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


def _metrics_row(store: Store, path: Path) -> dict | None:
    """The index row a finished folder describes (None when its files are damaged)."""
    if store.verify(path):
        return None
    metrics = json.loads((path / "metrics.json").read_text())
    stored = json.loads((path / "config.json").read_text())
    checks = metrics["checks"]
    div = metrics.get("diverged") or {}
    row = metrics.get("index") or {}
    ended = row.get("ended")
    if ended is None:
        ended = (path / "metrics.json").stat().st_mtime
    wall = metrics.get("wall_s")
    started = row.get("started", ended - (wall or 0.0))
    status = metrics.get("status", "done")
    return {"id": row.get("id"), "run_dir": path.name, "experiment": stored["experiment"],
            "config_hash": metrics.get("config_hash") or path.name.rsplit("-", 1)[-1], "preset": stored.get("preset"),
            "status": status, "started": started, "ended": ended, "wall_s": wall,
            "checks_passed": sum(bool(c["passed"]) for c in checks), "checks_total": len(checks),
            "error": div.get("message") if status == "diverged" else None,
            "config": json.dumps(stored["config"], sort_keys=True),
            "diverged_step": div.get("step"), "last_finite_loss": div.get("last_finite_loss")}


_ROW_COLUMNS = ("id", "run_dir", "experiment", "config_hash", "preset", "status", "started", "ended", "wall_s",
                "checks_passed", "checks_total", "error", "config", "diverged_step", "last_finite_loss")


def _insert_row(con: sqlite3.Connection, row: dict) -> None:
    if row["id"] is not None and con.execute("SELECT 1 FROM runs WHERE id = ?", (row["id"],)).fetchone():
        row = dict(row, id=None)  # that id now belongs to another run: take a new one
    cols = [c for c in _ROW_COLUMNS if not (c == "id" and row["id"] is None)]
    con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})", [row[c] for c in cols])


def _insert_folder(con: sqlite3.Connection, store: Store, path: Path) -> bool:
    row = _metrics_row(store, path)
    if row is not None:
        _insert_row(con, row)
    return row is not None


def _index_folders(con: sqlite3.Connection, store: Store, only_if_empty: bool) -> int:
    """Indexes every intact finished folder (rows with a recorded id first, in id order; then by end time)."""
    if only_if_empty:
        con.execute("BEGIN IMMEDIATE")
        if con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]:
            con.execute("COMMIT")
            return 0
    rows = [r for r in (_metrics_row(store, p) for p in store.folders()) if r is not None]
    rows.sort(key=lambda r: (r["id"] is None, r["id"] or 0, r["ended"]))
    for r in rows:
        _insert_row(con, r)
    if only_if_empty:
        con.execute("COMMIT")
    return len(rows)
