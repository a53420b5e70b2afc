"""Checkpoints of a run in progress, so that a killed run resumes where it stopped.

The launcher gives each run an in-progress folder (``<root>/.running/<experiment>-<hash>/``) and
wraps the experiment's reporter so that the callback every ``reporter.task(...)`` yields carries a
:class:`TaskCheckpoint`. The engines' loop (:func:`iclab.engines._loop.run_loop` and the gradient
flow integrator) asks it for one :class:`LoopCheckpoint` per loop and, at chunk boundaries, saves
(the loop's state, the records so far, the next record index) through it; when it finds a
checkpoint of the same loop it restores it and goes on from there. Experiments need no change:
a checkpoint is keyed by the task's order within the run and its label, and by the loop's order
within the task, so a deterministic experiment meets its own checkpoints again on a rerun.

Loops resume at the chunk boundary they saved. ``run_loop``'s chunks all run one compiled program (their
record count is an argument), so a resumed run computes exactly the arithmetic of an uninterrupted one (bit
for bit) whatever the chunk lengths before and after; the gradient-flow integrator resumes with the same
chunk sizes after it, to the same end.

When: every ``every_chunks`` chunks (``ICLAB_CHECKPOINT_EVERY``; 0 turns checkpoints off), and
whenever ``every_seconds`` have passed since the last save (``ICLAB_CHECKPOINT_SECONDS``, default
60), plus once when a loop finishes, so that a run killed in a later loop skips the finished ones.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np

FORMAT = 1
DEFAULT_EVERY_SECONDS = 60.0


def env_settings() -> tuple[int | None, float | None]:
    """(every_chunks, every_seconds) from ``ICLAB_CHECKPOINT_EVERY`` / ``ICLAB_CHECKPOINT_SECONDS``.

    Raises:
        iclab.errors.ConfigError: a value out of its range (one line; :mod:`iclab.settings`).
    """
    from iclab import settings

    return settings.checkpoint_every(), settings.checkpoint_seconds()


class RunCheckpoints:
    """The checkpoints of one run, in its in-progress folder.

    Args:
        folder: the run's in-progress folder (created when the first checkpoint is saved).
        every_chunks: save every this many chunks (None: only by time; 0: never save or load).
        every_seconds: also save when this long has passed since the last save (None: default 60 s).
    """

    def __init__(self, folder: str | os.PathLike, every_chunks: int | None = None, every_seconds: float | None = None):
        self.folder = Path(folder)
        self.every_chunks = every_chunks
        self.every_seconds = DEFAULT_EVERY_SECONDS if every_seconds is None else every_seconds
        self.enabled = every_chunks != 0
        self.events: list[str] = []  # what was resumed, for the run's log
        self._tasks = 0

    def task(self, label: str) -> "TaskCheckpoint":
        self._tasks += 1
        return TaskCheckpoint(self, f"{self._tasks:03d}-{_slug(label)}", label)


class TaskCheckpoint:
    """The checkpoint handle of one reporter task; each engine loop inside it takes :meth:`loop`."""

    def __init__(self, run: RunCheckpoints, key: str, label: str):
        self.run, self.key, self.label = run, key, label
        self._loops = 0

    def loop(self) -> "LoopCheckpoint | None":
        if not self.run.enabled:
            return None
        self._loops += 1
        return LoopCheckpoint(self.run, self.run.folder / f"{self.key}-{self._loops}.npz", self.label)


class LoopCheckpoint:
    """Saves and loads one loop's (state leaves, record leaves, meta) as one npz, atomically."""

    def __init__(self, run: RunCheckpoints, path: Path, label: str):
        self.run, self.path, self.label = run, path, label
        self._last_save = time.monotonic()
        self._chunks = 0
        self._broken = False

    def due(self) -> bool:
        """Counts a finished chunk; True when a checkpoint should be saved now."""
        self._chunks += 1
        every = self.run.every_chunks
        if every and self._chunks >= every:
            return True
        return time.monotonic() - self._last_save >= self.run.every_seconds

    def save(self, meta: dict, state, records) -> None:
        """Writes the checkpoint (``state``: pytree; ``records``: pytree of numpy arrays)."""
        if self._broken:
            return
        import jax

        try:
            s_leaves, s_def = jax.tree_util.tree_flatten(state)
            r_leaves, r_def = jax.tree_util.tree_flatten(records)
            arrays = {f"s{i}": _to_numpy(x) for i, x in enumerate(s_leaves)}
            arrays.update({f"r{i}": np.asarray(x) for i, x in enumerate(r_leaves)})
            meta = dict(meta, format=FORMAT, state_tree=str(s_def), records_tree=str(r_def),
                        n_state=len(s_leaves), n_records=len(r_leaves))
            arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    np.savez(f, **arrays)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:  # a partial file (a full disk) must not stay behind and keep the disk full
                if tmp.exists():
                    tmp.unlink()
        except (OSError, TypeError, ValueError) as err:  # an unwritable node or an unsaveable leaf
            self._broken = True
            warnings.warn(f"checkpoints of {self.label!r} are off: {type(err).__name__}: {err}", stacklevel=2)
            return
        self._last_save = time.monotonic()
        self._chunks = 0

    def load(self, expect: dict, state_template, records_template=None):
        """The saved (meta, state, records) if a checkpoint of this loop exists and matches
        ``expect`` (the loop's settings) and the template's structure, shapes and dtypes; else None.

        The state is rebuilt on the template's leaves (dtype, weak type, PRNG key type), so the
        resumed loop traces and computes exactly as the uninterrupted one.
        """
        if self._broken or not self.path.is_file():
            return None
        import jax

        try:
            with np.load(self.path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                s_leaves, s_def = jax.tree_util.tree_flatten(state_template)
                if meta.get("format") != FORMAT or any(meta.get(k) != v for k, v in expect.items()):
                    return None
                if meta["state_tree"] != str(s_def) or meta["n_state"] != len(s_leaves):
                    return None
                saved = [z[f"s{i}"] for i in range(len(s_leaves))]
                if any(_to_numpy(t).shape != a.shape or _to_numpy(t).dtype != a.dtype
                       for t, a in zip(s_leaves, saved)):
                    return None
                state = jax.tree_util.tree_unflatten(s_def, [_restore(t, a) for t, a in zip(s_leaves, saved)])
                r_leaves = [z[f"r{i}"] for i in range(meta["n_records"])]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as err:
            # a truncated or corrupt file (a crash while it was written elsewhere, a damaged disk): start afresh
            warnings.warn(f"ignoring unreadable checkpoint {self.path}: {type(err).__name__}: {err}", stacklevel=2)
            return None
        if records_template is not None:
            r_def = jax.tree_util.tree_structure(records_template)
            if meta["records_tree"] != str(r_def):
                return None
            records = jax.tree_util.tree_unflatten(r_def, r_leaves)
        else:
            records = r_leaves
        return meta, state, records

    def note(self, text: str) -> None:
        self.run.events.append(f"{self.label}: {text}")


def _to_numpy(x) -> np.ndarray:
    import jax

    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _restore(template, saved: np.ndarray):
    import jax

    if isinstance(template, jax.Array):
        if jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(template))
        from iclab.ops import convert_keeping_weak_type

        # keep the weak type of the fresh state's leaf (it decides type promotion)
        return convert_keeping_weak_type(saved, np.dtype(template.dtype), weak_type=bool(template.weak_type))
    if isinstance(template, np.ndarray):
        return saved
    return type(template)(saved.item()) if np.ndim(saved) == 0 else saved


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")[:60] or "task"

