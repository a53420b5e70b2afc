import hashlib
import json
import sqlite3

import numpy as np
import pytest

from iclab.store import Store

KEY = "0123456789abcdef"  # a run key: 16 hex digits (iclab.names)


def test_write_is_atomic_and_index_tracks_status(tmp_path):
    store = Store(tmp_path)
    lock = store.lock("x.fig1", KEY)
    assert lock.acquire(blocking=False)  # as the launcher does: a running row whose lock is free is interrupted
    row = store.begin("x.fig1", KEY, "quick")
    assert store.rows()[0]["status"] == "running"
    assert store.finished("x.fig1", KEY) is None
    path = store.write("x.fig1", KEY, {"metrics.json": {"checks": []}, "trajectories.npz": {"a": np.arange(3)},
                                         "log.txt": "hello", "config.json": {"experiment": "x.fig1", "config": {}}})
    store.end(row, "done", 1.5, 2, 3)
    assert store.finished("x.fig1", KEY) == path
    metrics = json.loads((path / "metrics.json").read_text())
    manifest = metrics.pop("artifacts")
    assert metrics == {"checks": []}
    # the manifest records every other file's size and SHA-256
    assert set(manifest) == {"trajectories.npz", "log.txt", "config.json"}
    assert manifest["log.txt"] == {"size": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}
    assert store.verify(path) == []
    (path / "log.txt").write_text("hellO")
    assert store.verify(path) == ["log.txt differs from its recorded SHA-256"]
    assert store.finished("x.fig1", KEY) is None
    (path / "log.txt").write_text("hello")
    np.testing.assert_array_equal(np.load(path / "trajectories.npz")["a"], np.arange(3))
    r = store.rows("x.fig1")[0]
    assert (r["status"], r["wall_s"], r["checks_passed"], r["checks_total"]) == ("done", 1.5, 2, 3)
    con = sqlite3.connect(tmp_path / "index.sqlite")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    lock.release()


def test_interrupted_write_leaves_no_folder(tmp_path):
    store = Store(tmp_path)

    def explode(dest):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.write("x.fig1", KEY, {"log.txt": "partial", "figure.png": explode, "metrics.json": {}})
    assert not store.run_dir("x.fig1", KEY).exists()
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_force_rewrite_replaces_the_folder(tmp_path):
    store = Store(tmp_path)
    store.write("x.fig1", KEY, {"metrics.json": {"v": 1}, "log.txt": "old"})
    path = store.write("x.fig1", KEY, {"metrics.json": {"v": 2}})
    assert json.loads((path / "metrics.json").read_text()) == {"v": 2, "artifacts": {}}
    assert not (path / "log.txt").exists()
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_status_must_be_known(tmp_path):
    store = Store(tmp_path)
    row = store.begin("x", KEY, None)
    with pytest.raises(ValueError):
        store.end(row, "finished", 0.0)
