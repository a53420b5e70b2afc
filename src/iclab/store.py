"""The result store: one folder per run, keyed by its resolved config and code, and a SQLite index.

Layout of a results root (default ``./iclab-results``, or ``$ICLAB_RESULTS``)::

    index.sqlite                 runs: id, experiment, run key, config key, code, preset, status, times, checks
    <experiment>-<key>/          config.json  metrics.json  trajectories.npz  figure.png/.pdf  log.txt
                                 (a failed run: config.json  metrics.json  error.txt  log.txt)
    .tmp/                        folders being written; renamed into place when complete
    .running/<experiment>-<hash>/  checkpoints of a run in progress (resumed after a crash)
    .locks/<experiment>-<hash>.lock  one lock file per run: one process computes a run at a time

The key (:func:`iclab.provenance.run_key`) covers the experiment id, the resolved config, iclab's version
and the code identity of the experiment (:func:`iclab.provenance.code_identity`): a run is reused only by
the same config computed by the same code.

A run folder appears in one ``rename`` once every file is written, so a folder that exists is an ended
run: ``done``, ``diverged`` (with its partial trajectory) or ``failed`` (its traceback in ``error.txt``;
never reused). An interrupted run leaves only ``.tmp`` and ``.running`` entries, never a folder.

**A results root is data.** Reading one (:class:`Store` with ``readonly=True``: ``iclab runs``, ``verify``,
``report``, ``export``, :func:`iclab.load`, :func:`iclab.runs`) opens the index read-only, writes nothing
into the root, and imports nothing named in it. Every name taken from a root is checked before it
becomes a path (:mod:`iclab.names`): a folder must be named ``<experiment>-<key>`` after its own
``config.json`` and ``metrics.json``, an index row's ``run_dir`` must be such a name (one path component),
artifacts must be the run files listed below as regular files (no symbolic links). A run or row that breaks
the rule is skipped with one line.

Concurrency: processes that share a results root take the run's lock (``fcntl.flock``, released
by the kernel when a process dies, SIGKILL included) before computing it, and the index is
SQLite in WAL mode whose writes are retried while another process holds the database.

The index is a cache of the folders, never the only copy: every ended folder is self-describing
(``config.json``; ``metrics.json`` with its checks, its index row, its code identity and the size and
SHA-256 of every other file, ``artifacts``). :meth:`Store.rebuild_index` (``iclab index rebuild``)
rebuilds the index from the folders, keeping the rows of runs in progress and a copy of the old file;
an index that is missing or empty is rebuilt on first write; an unreadable one is a one-line
:class:`IndexDamaged` naming the command that repairs it. :meth:`Store.verify` checks a folder against
its manifest; a damaged folder is never reused. The manifest guards against damage, not against a
forger (anyone can recompute it): what guards a reader is that nothing in a store is ever executed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sqlite3
import stat
import time
import uuid
import warnings
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from iclab import settings
from iclab.errors import IndexDamaged, StoreError
from iclab.names import is_name, is_run_folder, run_folder

__all__ = ["NPZ_ERRORS", "RESULT_FILES", "STATUSES", "IndexDamaged", "RunLock", "Store", "StoreError", "default_root",
           "readable_root"]

RESULT_FILES = ("config.json", "metrics.json", "trajectories.npz", "figure.png", "figure.pdf", "log.txt")
#: What a failed run's folder holds.
FAILED_FILES = ("config.json", "metrics.json", "error.txt", "log.txt")
#: Every name a run folder's manifest may list.
ARTIFACTS = frozenset(RESULT_FILES) | {"error.txt"}
#: What ``numpy.load`` of a ``trajectories.npz`` that is not arrays may raise (a crafted file can match its manifest).
NPZ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, MemoryError)
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
    last_finite_loss REAL,
    config_key TEXT,
    code TEXT,
    backend TEXT
"""
#: Columns added since the first schema: (name, SQL type), added by :func:`_migrate` to an older index.
_ADDED_COLUMNS = (("config", "TEXT"), ("diverged_step", "INTEGER"), ("last_finite_loss", "REAL"),
                  ("config_key", "TEXT"), ("code", "TEXT"), ("backend", "TEXT"))
_OLD_COLUMNS = ("id", "run_dir", "experiment", "config_hash", "preset", "status", "started", "ended", "wall_s",
                "checks_passed", "checks_total", "error")
_SCHEMA = f"CREATE TABLE IF NOT EXISTS runs ({_COLUMNS});\nCREATE INDEX IF NOT EXISTS runs_by_hash ON runs (config_hash);\n"

# Writers wait for each other: sqlite's own busy timeout, then retries with jittered backoff.
_DB_TIMEOUT_S = 30.0
_DB_RETRY_S = 120.0


def default_root() -> Path:
    """``$ICLAB_RESULTS`` if set, else ``./iclab-results``."""
    return Path(settings.results_root() or "iclab-results")


def readable_root(root: str | os.PathLike | None = None, *, option: str = "--results") -> Path:
    """The results root a reading command or function uses, checked: one line (StoreError) when it is empty,
    names a file or lies under one, or is a symbolic link that leads nowhere (a loop, a missing target). A
    root that does not exist is an empty store.

    Args:
        root: the folder given (None: ``$ICLAB_RESULTS`` or ``./iclab-results``).
        option: how the user gave it, named in the error (``--results``, ``root``).
    """
    what = option
    if root is None:
        what = "ICLAB_RESULTS" if settings.results_root() is not None else "the default results root"
        root = default_root()
    if not isinstance(root, (str, os.PathLike)) or isinstance(root, bytes):
        raise StoreError(f"{option} must be a folder path (got {type(root).__name__})")
    text = os.fspath(root)
    if not text.strip():
        raise StoreError(f"{what} is empty: name a folder")
    if "\0" in text:
        raise StoreError(f"{what} {text[:60]!r} holds a NUL character: name a folder")
    path = Path(os.path.expanduser(text))  # ~user of no such user stays as typed (as in a shell)
    probe = path
    while True:
        try:
            st = probe.stat()
        except OSError as err:
            if err.errno == errno.ELOOP or (err.errno == errno.ENOENT and probe.is_symlink()):
                raise StoreError(f"{what} {path} is a symbolic link that leads nowhere (a loop or a missing "
                                 "target): name a folder") from None
            if err.errno not in (errno.ENOENT, errno.ENOTDIR):
                raise StoreError(f"{what} {path} cannot be read ({err.strerror or err})") from None
            if probe.parent == probe:
                return path
            probe = probe.parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            where = "names a file" if probe == path else f"lies under the file {probe}"
            raise StoreError(f"{what} {path} {where}: name a folder")
        return path


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _disk_full(err: BaseException) -> bool:
    text = str(err).lower()
    return (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or "disk is full" in text


def _file_digest(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


class Store:
    """A results root: run folders plus the SQLite index (WAL mode).

    Args:
        root: the results root (None: ``$ICLAB_RESULTS`` or ``./iclab-results``).
        readonly: a reader's view (module docstring): the index is opened read-only (a missing one is read
            from the folders in memory), stale ``running`` rows are shown ``interrupted`` without being
            written, and every method that writes raises.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, readonly: bool = False):
        self.root = Path(root) if root is not None else default_root()
        self.readonly = readonly

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

    def _writable(self) -> None:
        if self.readonly:
            raise RuntimeError(f"the results root {self.root} was opened read-only")

    @contextmanager
    def _db(self):
        self._writable()
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

    def _read_rows(self) -> list[dict]:
        """Every index row, read-only, with no file made in the root: the index opened with ``immutable=1`` when
        no process has it open (no ``-wal`` file), else with ``mode=ro`` (``immutable=1`` where the root's file
        system is read-only), or, when there is no index, the rows the folders describe."""
        if not self.index_path.is_file() or self.index_path.stat().st_size == 0:
            rows = [r for r in (_metrics_row(self, p) for p in self.folders()) if r is not None]
            rows.sort(key=lambda r: (r["id"] is None, r["id"] or 0, r["ended"]))
            return rows[::-1]
        uri = self.index_path.resolve().as_uri()
        # mode=ro makes a WAL index's -wal and -shm files when they are missing (and cannot remove them): with no
        # -wal file no process has the index open, so it is read as immutable, and the rows are kept only if the
        # file did not change while they were read (a writer's checkpoint); else read with mode=ro.
        for _ in range(5) if not Path(f"{self.index_path}-wal").exists() else ():
            try:
                before = _stamp(self.index_path)
                try:
                    con = sqlite3.connect(f"{uri}?immutable=1", uri=True)
                    try:
                        con.row_factory = sqlite3.Row
                        rows, error = [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY id DESC")], None
                    finally:
                        con.close()
                except sqlite3.DatabaseError as err:
                    rows, error = None, err
                if _stamp(self.index_path) != before:  # a writer changed it meanwhile: read again
                    time.sleep(0.05)
                    continue
            except OSError:  # the index was moved meanwhile (a rebuild)
                break
            if error is not None:
                raise self._damaged(error) from None
            return rows
        last = None
        for mode in ("mode=ro", "immutable=1"):
            deadline = time.monotonic() + _DB_RETRY_S
            while True:
                try:
                    con = sqlite3.connect(f"{uri}?{mode}", uri=True, timeout=_DB_TIMEOUT_S)
                    try:
                        con.row_factory = sqlite3.Row
                        return [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY id DESC")]
                    finally:
                        con.close()
                except sqlite3.OperationalError as err:
                    last = err
                    if _is_locked(err) and time.monotonic() < deadline:
                        time.sleep(0.1)
                        continue
                    break
                except sqlite3.DatabaseError as err:
                    raise self._damaged(err) from None
        raise self._damaged(last) from None

    def rows(self, experiment: str | None = None, status: str | None = None, *, on_invalid=None) -> list[dict]:
        """Index rows, newest first, optionally for one experiment and/or one status.

        A ``running`` row whose process is gone (its lock is free) is ``interrupted``: written so in a writer's
        store, shown so in a reader's. A row whose names break the rule (:mod:`iclab.names`: a ``run_dir`` that
        is not ``<experiment>-<key>``, an experiment id with a path separator) is skipped with one line.

        Args:
            experiment: only this experiment's rows; status: only rows of this status.
            on_invalid: called with one line for each skipped row (default: a warning).
        """
        if not self.root.is_dir():
            return []
        if self.readonly:
            rows = self._read_rows()
        else:
            def query(con):
                con.row_factory = sqlite3.Row
                return [dict(r) for r in con.execute("SELECT * FROM runs ORDER BY id DESC")]

            rows = self._transact(query)
        valid = []
        for r in rows:
            problem = _row_problem(r)
            if problem:
                (on_invalid or _warn)(f"skipping index row {r.get('id')} of {self.root}: {problem}")
            else:
                valid.append(r)
        stale = [r for r in valid if r["status"] == "running" and self._abandoned(r["experiment"], r["config_hash"])]
        for r in stale:  # its process is gone (the lock is free): say so
            note = "its process is gone (found by a later command)"
            if not self.readonly:
                self.mark_interrupted(r["experiment"], r["config_hash"], note)
            r.update(status="interrupted", error=note)
        return [r for r in valid if (experiment is None or r["experiment"] == experiment)
                and (status is None or r["status"] == status)]

    def _abandoned(self, experiment_id: str, digest: str) -> bool:
        """True when nobody holds the run's lock, i.e. no live process computes it."""
        path = self.root / ".locks" / f"{run_folder(experiment_id, digest)}.lock"
        if self.readonly and not path.is_file():
            return True  # no lock file: nobody ever locked it here (a reader creates none)
        lock = RunLock(path)
        try:
            if not lock.acquire(blocking=False, create=not self.readonly):
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
        """Rebuilds ``index.sqlite`` from the run folders, keeping the rows of runs in progress.

        The old file is copied aside first (never deleted). A readable index is rebuilt in place, in one
        exclusive transaction: runs that begin or end meanwhile wait for it, and a ``running`` row whose
        process is alive (its lock is held) keeps its id, so that run ends its own row as usual. An unreadable
        index is moved aside and a new one written. A folder whose ``metrics.json`` records its index row gets
        that row back as it was (id, times, status, checks); rows of runs that left no folder (interrupted)
        are only in the copy.

        Returns:
            (number of runs indexed, where the old index was copied or moved, or None if there was none).
        """
        self._writable()
        self.root.mkdir(parents=True, exist_ok=True)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        aside = self.root / f"index.sqlite.old-{stamp}"
        scanned = {p.name: _metrics_row(self, p) for p in self.folders()}
        if self.index_path.is_file() and self.index_path.stat().st_size > 0:
            try:
                src = sqlite3.connect(self.index_path, timeout=_DB_TIMEOUT_S)
                try:
                    dst = sqlite3.connect(aside)
                    try:
                        src.backup(dst)
                    finally:
                        dst.close()
                    _migrate(src)
                    src.execute("BEGIN EXCLUSIVE")
                    n = self._rebuild_rows(src, scanned)
                    src.execute("COMMIT")
                    return n, aside
                finally:
                    src.close()
            except sqlite3.DatabaseError:
                aside.unlink(missing_ok=True)
            os.rename(self.index_path, aside)
            for suffix in ("-wal", "-shm"):
                side = self.root / f"index.sqlite{suffix}"
                if side.exists():
                    os.rename(side, aside.with_name(aside.name + suffix))
        else:
            aside = None
            if self.index_path.exists():
                self.index_path.unlink()
        con = sqlite3.connect(self.index_path, timeout=_DB_TIMEOUT_S)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            _migrate(con)
            con.execute("BEGIN IMMEDIATE")
            n = self._rebuild_rows(con, scanned)
            con.execute("COMMIT")
        finally:
            con.close()
        return n, aside

    def _rebuild_rows(self, con: sqlite3.Connection, scanned: dict) -> int:
        """Inside the rebuild's transaction: every row replaced by the folders' rows (those written since the
        scan included) and the live ``running`` rows."""
        con.row_factory = sqlite3.Row
        live = [dict(r) for r in con.execute("SELECT * FROM runs WHERE status = 'running'")
                if not _row_problem(dict(r)) and not self._abandoned(r["experiment"], r["config_hash"])]
        con.row_factory = None
        for p in self.folders():  # folders written between the scan and this transaction
            if p.name not in scanned:
                scanned[p.name] = _metrics_row(self, p)
        rows = [r for r in scanned.values() if r is not None]
        rows.sort(key=lambda r: (r["id"] is None, r["id"] or 0, r["ended"]))
        con.execute("DELETE FROM runs")
        ids = set()
        for r in rows:
            ids.add(_insert_row(con, r))
        for r in live:
            if r["id"] not in ids:  # a live run whose folder was written in the meantime has its row already
                _insert_row(con, {c: r.get(c) for c in _ROW_COLUMNS})
        return len(rows)

    def folders(self, experiment_id: str | None = None) -> list[Path]:
        """Every ended run folder (one with a ``metrics.json``) of the root, or of one experiment: named
        ``<experiment>-<key>`` (:mod:`iclab.names`), and no symbolic link."""
        if not self.root.is_dir():
            return []
        out = []
        for path in sorted(self.root.iterdir()):
            if not is_run_folder(path.name) or path.is_symlink() or not path.is_dir():
                continue
            if not (path / "metrics.json").exists():
                continue
            if experiment_id is None or path.name.rsplit("-", 1)[0] == experiment_id:
                out.append(path)
        return out

    def linked_folders(self, experiment_id: str | None = None) -> list[Path]:
        """The entries of the root named as run folders (of one experiment) that are symbolic links: never followed
        (:meth:`folders` leaves them out); ``iclab verify`` and ``iclab export`` report them as damaged."""
        if not self.root.is_dir():
            return []
        return [path for path in sorted(self.root.iterdir())
                if path.is_symlink() and is_run_folder(path.name, experiment_id)]

    def verify(self, path: Path) -> list[str]:
        """What is wrong with an ended run folder (an empty list when it is intact).

        Checks that the folder is named ``<experiment>-<key>`` after its own files (:mod:`iclab.names`) and is
        no symbolic link; that ``config.json`` and ``metrics.json`` parse and hold what a run needs; and that
        every artifact listed in the manifest (``metrics.json["artifacts"]``) is one of the run files, a regular
        file (no link) with its recorded size and SHA-256. A folder written before manifests existed is checked
        for its files and a readable npz.
        """
        path = Path(path)
        problems = []
        if path.is_symlink():
            return [f"{path.name} is a symbolic link"]
        if not is_run_folder(path.name):
            return [f"{path.name!r} is not a run folder's name (<experiment>-<16 hex digits>)"]
        experiment, digest = path.name.rsplit("-", 1)
        for name in ("metrics.json", "config.json"):
            if (path / name).is_symlink():
                return [f"{name} is a symbolic link"]
        try:
            metrics = json.loads((path / "metrics.json").read_text())
            if not isinstance(metrics, dict) or not isinstance(metrics.get("checks"), list):
                problems.append("metrics.json lacks its checks")
                metrics = metrics if isinstance(metrics, dict) else {}
            elif not all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("passed"), bool)
                         for c in metrics["checks"]):
                problems.append("metrics.json's checks are not checks (name, passed, ...)")
        except (OSError, ValueError) as err:
            return [f"metrics.json unreadable ({type(err).__name__})"]
        try:
            config = json.loads((path / "config.json").read_text())
            if not isinstance(config, dict) or "experiment" not in config or not isinstance(config.get("config"), dict):
                problems.append("config.json lacks the experiment or its config")
            elif config["experiment"] != experiment:
                problems.append(f"config.json names the experiment {str(config['experiment'])[:60]!r}, not the "
                                f"folder's {experiment!r}")
            elif config.get("preset") is not None and not is_name(config.get("preset")):
                problems.append(f"config.json's preset {str(config.get('preset'))[:60]!r} is not a valid name")
        except (OSError, ValueError) as err:
            problems.append(f"config.json unreadable ({type(err).__name__})")
        if metrics.get("config_hash") not in (None, digest):
            problems.append("metrics.json records another run key than the folder's")
        if metrics.get("status", "done") not in ("done", "diverged", "failed"):
            problems.append(f"metrics.json has the status {str(metrics.get('status'))[:20]!r}")
        manifest = metrics.get("artifacts")
        if isinstance(manifest, dict):
            for name, want in manifest.items():
                file = path / name
                if name not in ARTIFACTS:
                    problems.append(f"the manifest lists {str(name)[:60]!r}, which is not a run file")
                elif file.is_symlink() or not file.is_file():
                    problems.append(f"{name} missing" if not file.is_symlink() else f"{name} is a symbolic link")
                elif not isinstance(want, dict):
                    problems.append(f"the manifest's entry of {name} is not a size and a SHA-256")
                elif file.stat().st_size != want.get("size"):
                    problems.append(f"{name} has {file.stat().st_size} bytes, {want.get('size')} recorded")
                elif _file_digest(file)["sha256"] != want.get("sha256"):
                    problems.append(f"{name} differs from its recorded SHA-256")
        else:
            for name in RESULT_FILES:
                if (path / name).is_symlink() or not (path / name).is_file():
                    problems.append(f"{name} missing")
            if (path / "trajectories.npz").is_file() and not (path / "trajectories.npz").is_symlink():
                try:
                    with np.load(path / "trajectories.npz", allow_pickle=False) as z:
                        for k in z.files:
                            z[k]
                except NPZ_ERRORS as err:
                    problems.append(f"trajectories.npz unreadable ({type(err).__name__})")
        return problems

    def set_aside(self, path: Path) -> Path:
        """Moves a damaged run folder to ``.damaged/`` (never deletes it); returns where it went."""
        self._writable()
        dest_root = self.root / ".damaged"
        dest_root.mkdir(parents=True, exist_ok=True)
        dest = dest_root / f"{Path(path).name}.{time.strftime('%Y%m%d-%H%M%S')}.{uuid.uuid4().hex[:6]}"
        os.rename(path, dest)
        return dest

    # -- folders ----------------------------------------------------------------------------

    def run_dir(self, experiment_id: str, digest: str) -> Path:
        """The folder of a run (``<experiment>-<key>``, both checked: :func:`iclab.names.run_folder`)."""
        return self.root / run_folder(experiment_id, digest)

    def finished(self, experiment_id: str, digest: str) -> Path | None:
        """The folder of a finished (done or diverged) run with this key, or None (also when it is damaged, see
        :meth:`verify`, or failed)."""
        path = self.run_dir(experiment_id, digest)
        if not (path / "metrics.json").exists() or self.verify(path):
            return None
        return path if _status_of(path) in ("done", "diverged") else None

    def damaged(self, experiment_id: str, digest: str) -> list[str]:
        """The problems of this run's folder (empty when it is intact or absent)."""
        path = self.run_dir(experiment_id, digest)
        return self.verify(path) if (path / "metrics.json").exists() else []

    def running_dir(self, experiment_id: str, digest: str) -> Path:
        """The in-progress folder of a run: its checkpoints, kept until the run is stored."""
        return self.root / ".running" / run_folder(experiment_id, digest)

    def lock(self, experiment_id: str, digest: str) -> "RunLock":
        """The lock of one run (not yet acquired): see :class:`RunLock`."""
        return RunLock(self.root / ".locks" / f"{run_folder(experiment_id, digest)}.lock")

    def begin(self, experiment_id: str, digest: str, preset: str | None, config: dict | None = None, *,
              started: float | None = None, config_key: str | None = None, code: str | None = None,
              backend: str | None = None) -> int:
        """Records a run as running (at ``started``, default now); returns its index row id.

        Args:
            experiment_id, digest: the run; preset: its preset; config: its resolved config.
            started: its start time; config_key: :func:`iclab.provenance.config_key`; code: its code identity
                digest (:func:`iclab.provenance.code_identity`); backend: what it computes with (native or xla).
        """
        values = (run_folder(experiment_id, digest), experiment_id, digest, preset,
                  time.time() if started is None else started,
                  None if config is None else json.dumps(config, sort_keys=True), config_key, code, backend)
        return self._transact(lambda con: int(con.execute(
            "INSERT INTO runs (run_dir, experiment, config_hash, preset, status, started, config, config_key, code, "
            "backend) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?)", values).lastrowid))

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

    def previous(self, experiment_id: str, config_key: str, digest: str) -> Path | None:
        """The newest intact finished folder of the same experiment and config computed by other code (another
        run key), or None: what a rerun could not reuse, and says so."""
        candidates = []
        for path in self.folders(experiment_id):
            if path.name.rsplit("-", 1)[1] == digest or self.verify(path):
                continue
            try:
                metrics = json.loads((path / "metrics.json").read_text())
            except (OSError, ValueError):
                continue
            if metrics.get("config_key") == config_key or (
                    "config_key" not in metrics and _stored_config_key(path, experiment_id) == config_key):
                if metrics.get("status", "done") in ("done", "diverged"):
                    candidates.append(((metrics.get("index") or {}).get("ended") or 0.0, path))
        return max(candidates)[1] if candidates else None

    def write(self, experiment_id: str, digest: str, files: dict[str, object]) -> Path:
        """Writes a run's files into a temporary folder, then renames it into place.

        ``files`` maps names to: dict (JSON), str (text), dict of arrays under a ``.npz`` name,
        or a callable taking the destination path (figures).
        """
        self._writable()
        tmp_root = self.root / ".tmp"
        tmp = tmp_root / f"{run_folder(experiment_id, digest)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            tmp_root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            # metrics.json last: it carries the manifest (size and SHA-256) of every other file
            ordered = sorted(files.items(), key=lambda kv: kv[0] == "metrics.json")
            for name, content in ordered:
                if name not in ARTIFACTS:
                    raise ValueError(f"{name!r} is not a run file ({', '.join(sorted(ARTIFACTS))})")
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
            if final.exists():  # --force, or a failed run's folder: move the old one aside, then swap the new one in
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

    def acquire(self, blocking: bool = True, *, create: bool = True) -> bool:
        """Takes the lock; with ``blocking=False`` returns False at once if another process holds it.

        Args:
            blocking: wait for the lock. create: create the lock file (and its folder) if missing; a reader
                passes False and opens an existing file read-only (``flock`` works on a read-only descriptor).
        """
        if self._fd is not None:
            return True
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        else:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False
            raise
        if create:
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
        _add_columns(con)
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


def _add_columns(con: sqlite3.Connection) -> None:
    """Adds the columns an older index lacks (:data:`_ADDED_COLUMNS`), in one transaction."""
    have = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
    if all(name in have for name, _ in _ADDED_COLUMNS):
        return
    con.execute("BEGIN IMMEDIATE")
    have = {r[1] for r in con.execute("PRAGMA table_info(runs)")}  # another process may have added them
    for name, kind in _ADDED_COLUMNS:
        if name not in have:
            con.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
    con.execute("COMMIT")


def _row_problem(row: dict) -> str | None:
    """Why an index row cannot be followed (None when it can): its experiment and ``run_dir`` must be names of
    the rule (:mod:`iclab.names`), the ``run_dir`` that run's folder ``<experiment>-<key>``, one path component."""
    experiment, run_dir = row.get("experiment"), row.get("run_dir")
    if not is_name(experiment):
        return f"its experiment id {str(experiment)[:60]!r} is not a valid id"
    if not is_run_folder(run_dir, experiment, row.get("config_hash")):
        return (f"its run_dir {str(run_dir)[:60]!r} is not the run's folder name {experiment}-<key> "
                "(a path that could leave the results root)")
    if row.get("status") not in STATUSES:
        return f"its status {str(row.get('status'))[:20]!r} is not one of {', '.join(STATUSES)}"
    for column, optional in (("started", False), ("ended", True), ("wall_s", True), ("last_finite_loss", True)):
        value = row.get(column)
        if not (value is None and optional) and _number(value) is None and not (
                isinstance(value, float) and column == "last_finite_loss"):
            return f"its {column} {str(value)[:20]!r} is not a number"
    for column in ("id", "checks_passed", "checks_total", "diverged_step"):
        value = row.get(column)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"its {column} {str(value)[:20]!r} is not an integer"
    for column in ("preset", "error", "config", "config_key", "code", "backend"):
        if row.get(column) is not None and not isinstance(row.get(column), str):
            return f"its {column} is not text"
    if row.get("preset") is not None and not is_name(row["preset"]):
        return f"its preset {row['preset'][:40]!r} is not a valid name"
    return None


def _status_of(path: Path) -> str:
    try:
        metrics = json.loads((path / "metrics.json").read_text())
    except (OSError, ValueError):
        return "damaged"
    return metrics.get("status", "done") if isinstance(metrics, dict) else "damaged"


def _stored_config_key(path: Path, experiment_id: str) -> str | None:
    """The config key of a folder written before metrics.json recorded one (from its config.json)."""
    from iclab.provenance import config_key

    try:
        stored = json.loads((path / "config.json").read_text())
        return config_key(experiment_id, stored["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _metrics_row(store: Store, path: Path) -> dict | None:
    """The index row an ended folder describes (None when its files are damaged)."""
    if store.verify(path):
        return None
    try:
        return _folder_row(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a crafted file that passed verify
        return None


def _folder_row(path: Path) -> dict:
    metrics = json.loads((path / "metrics.json").read_text())
    stored = json.loads((path / "config.json").read_text())
    checks = metrics["checks"]
    div = metrics.get("diverged") if isinstance(metrics.get("diverged"), dict) else {}
    row = metrics.get("index") if isinstance(metrics.get("index"), dict) else {}
    ended = _number(row.get("ended"))
    if ended is None:
        ended = (path / "metrics.json").stat().st_mtime
    wall = _number(metrics.get("wall_s"))
    started = _number(row.get("started"))
    started = ended - (wall or 0.0) if started is None else started
    status = metrics.get("status", "done")
    row_id = row.get("id") if isinstance(row.get("id"), int) and not isinstance(row.get("id"), bool) else None
    return {"id": row_id, "run_dir": path.name, "experiment": stored["experiment"],
            "config_hash": metrics.get("config_hash") or path.name.rsplit("-", 1)[-1], "preset": stored.get("preset"),
            "status": status, "started": started, "ended": ended, "wall_s": wall,
            "checks_passed": sum(bool(c["passed"]) for c in checks), "checks_total": len(checks),
            "error": _text(div.get("message")) if status == "diverged" else (
                _text(metrics.get("error")) if status == "failed" else None),
            "config": json.dumps(stored["config"], sort_keys=True),
            "diverged_step": div.get("step") if isinstance(div.get("step"), int) else None,
            "last_finite_loss": _number(div.get("last_finite_loss")),
            "config_key": _text(metrics.get("config_key")),
            "code": _text(metrics["code"].get("digest")) if isinstance(metrics.get("code"), dict) else None,
            "backend": _text(metrics.get("backend"))}


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


_ROW_COLUMNS = ("id", "run_dir", "experiment", "config_hash", "preset", "status", "started", "ended", "wall_s",
                "checks_passed", "checks_total", "error", "config", "diverged_step", "last_finite_loss", "config_key",
                "code", "backend")


def _insert_row(con: sqlite3.Connection, row: dict) -> int:
    if row["id"] is not None and con.execute("SELECT 1 FROM runs WHERE id = ?", (row["id"],)).fetchone():
        row = dict(row, id=None)  # that id now belongs to another run: take a new one
    cols = [c for c in _ROW_COLUMNS if not (c == "id" and row["id"] is None)]
    cur = con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                      [row.get(c) for c in cols])
    return int(cur.lastrowid)


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
