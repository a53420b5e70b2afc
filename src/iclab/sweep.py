"""Sweeps: one experiment over a grid of config values, on local processes or a Ray cluster.

The driver (the ``iclab sweep`` process) validates every grid point before running any, skips
points already in the store, takes each remaining point's lock (so concurrent sweeps sharing a
results root never compute a point twice: a point locked by another process is waited for and
then reused), and hands the point to an executor (:mod:`iclab.executors`):

- ``local``: a pool of worker processes on this machine (``--workers``, default one per core;
  ``--workers 1`` runs in the driver itself);
- ``ray``: one task per point on a running Ray cluster (``--address auto`` or ``host:port``); a
  task whose worker dies is retried up to ``retries`` times.

Workers run :func:`iclab.runner.compute_point` and return arrays, checks and the figure bytes;
the driver writes every result into the store, so workers need no shared file system. Points
checkpoint their engine loops in the store's in-progress folder on the node that computes them,
so a rerun after a crash (of a worker, of the driver, SIGKILL included) resumes them there.

An exception in a point marks it ``failed`` (its error is stored and reported at the end); a NaN
or infinite loss marks it ``diverged``; the sweep goes on with the other points.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from iclab import settings
from iclab.errors import ConfigError, UserError
from iclab.executors import EXECUTORS, WorkerCrash, make_executor
from iclab.progress import SweepProgress
from iclab.runner import (
    ExperimentRaised,
    RunIdentity,
    begin_attempt,
    check_api_arguments,
    check_backend,
    checkpoint_settings,
    code_of,
    compute_point,
    experiment_or_error,
    experiment_ref,
    finish_attempt,
    identify,
    resolve_config,
    results_root,
    reusable,
    shorten,
    store_failure,
    store_payload,
)
from iclab.ops import use_backend
from iclab.store import Store

MAX_POINTS = 10_000


# -- grids ------------------------------------------------------------------------------------

def split_values(raw: str) -> list[str]:
    """Splits ``a,b,[c,d]`` on the commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in raw:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            cur.append(ch)
        elif ch in "[{(":
            depth += 1
            cur.append(ch)
        elif ch in "]})":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth <= 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _value(text: str):
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_grid_option(text: str) -> tuple[str, list]:
    """``key=v1,v2,...`` (or ``key=[v1,v2]`` in JSON) as (key, values); values read as JSON when
    they parse, else as strings."""
    if "=" not in text:
        raise ConfigError(f"--grid expects key=v1,v2,... (got {text!r})")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"--grid expects key=v1,v2,... (got {text!r})")
    if not raw:
        raise ConfigError(f"--grid {key}: no values (got {text!r})")
    try:
        whole = json.loads(raw)
    except json.JSONDecodeError:
        whole = None
    else:
        if isinstance(whole, list):
            if not whole:
                raise ConfigError(f"--grid {key}: no values (got {text!r})")
            return key, whole
    parts = split_values(raw)
    if any(not p.strip() for p in parts):
        raise ConfigError(f"--grid {key}: empty value in {raw!r}")
    return key, [_value(p) for p in parts]


def parse_grid(texts: list[str] | None) -> dict[str, list]:
    grid: dict[str, list] = {}
    for text in texts or []:
        key, values = parse_grid_option(text)
        if key in grid:
            raise ConfigError(f"--grid {key} given twice")
        grid[key] = values
    return grid


# -- plan -------------------------------------------------------------------------------------

@dataclass
class Point:
    """One grid point: its grid values and run identity (resolved config, code, run key)."""

    values: dict
    ident: RunIdentity

    @property
    def config(self) -> dict:
        """The resolved config (JSON types)."""
        return self.ident.config

    @property
    def digest(self) -> str:
        """The run key."""
        return self.ident.digest

    @property
    def label(self) -> str:
        return " ".join(f"{k}={json.dumps(v)}" for k, v in self.values.items()) or "(defaults)"


@dataclass
class PointResult:
    """What became of a point: done, cached, diverged or failed."""

    point: Point
    status: str
    path: Path | None = None
    checks: list = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    attempts: int = 0

    @property
    def passed(self) -> bool:
        return self.status in ("done", "cached") and all(c["passed"] for c in self.checks)

    def as_dict(self) -> dict:
        return {"values": self.point.values, "config_hash": self.point.digest, "status": self.status,
                "passed": self.passed, "checks_passed": sum(c["passed"] for c in self.checks),
                "checks_total": len(self.checks), "path": None if self.path is None else str(self.path),
                "error": self.error, "wall_s": self.wall_s}


@dataclass
class SweepResult:
    experiment: str
    preset: str
    executor: str
    points: list[PointResult]
    wall_s: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.points)

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.points)

    def as_dict(self) -> dict:
        return {"experiment": self.experiment, "preset": self.preset, "executor": self.executor,
                "wall_s": self.wall_s, "ok": self.ok,
                "counts": {s: self.count(s) for s in ("done", "cached", "diverged", "failed")},
                "points": [r.as_dict() for r in self.points]}


def plan_sweep(exp_id: str, grid: dict[str, list] | None = None, preset: str = "quick",
               overrides: dict | None = None, seeds: int | None = None, *,
               backend: str = "auto") -> tuple[object, list[Point]]:
    """Every point of the grid, validated (UserError on the first invalid one), duplicates removed.

    Args:
        exp_id, grid, preset, overrides, seeds: as in :func:`run_sweep`.
        backend: ``auto``, ``native`` or ``xla`` (every point's).
    """
    chosen = check_backend(backend)
    exp = experiment_or_error(exp_id)
    if not isinstance(preset, str) or preset not in exp.presets:
        raise ConfigError(f"preset must be one of {', '.join(exp.presets)} (got {shorten(preset)})")
    if grid is not None and not isinstance(grid, Mapping):
        raise ConfigError(f"grid must be a dict of config fields to lists of values, {{field: [v1, v2]}} (got "
                          f"{type(grid).__name__})")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a dict of config fields, {{field: value}} (got {type(overrides).__name__})")
    if grid and any(not isinstance(k, str) for k in grid):
        raise ConfigError(f"grid's keys must be config field names (str) (got {shorten(next(k for k in grid if not isinstance(k, str)))})")
    if not grid:
        grid = dict(getattr(exp, "grid", None) or {})
        if not grid:
            raise ConfigError(f"{exp.id} declares no grid: give one with --grid key=v1,v2,...")
    overrides = dict(overrides or {})
    for key, values in grid.items():
        if key in overrides:
            raise ConfigError(f"{key} is set by both --set and --grid")
        if key == "seeds" and seeds is not None:
            raise ConfigError("seeds is set by both --seeds and --grid")
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigError(f"grid {key} must be a non-empty list of values (got {shorten(values)})")
    size = 1
    for values in grid.values():
        size *= len(values)
    if size > MAX_POINTS:
        raise ConfigError(f"the grid has {size} points; at most {MAX_POINTS}")
    points, seen = [], set()
    code = code_of(exp)
    for combo in itertools.product(*(list(v) for v in grid.values())):
        values = dict(zip(grid, combo))
        try:
            with use_backend(chosen):  # an experiment's memory estimate may depend on the backend
                _, config = resolve_config(exp.id, preset, {**overrides, **values}, seeds)
        except UserError as err:
            label = " ".join(f"{k}={json.dumps(v, default=repr)}" for k, v in values.items())
            raise type(err)(f"grid point {label}: {err}") from None
        ident = identify(exp, config, preset, code, backend=chosen)
        if ident.digest not in seen:
            seen.add(ident.digest)
            points.append(Point(values, ident))
    return exp, points


# -- the driver ------------------------------------------------------------------------------------

def _error_text(err: BaseException) -> str:
    if isinstance(err, ExperimentRaised):
        return err.text
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _traceback_text(err: BaseException) -> str:
    """A point's traceback: the worker's own (an experiment's exception travels with it), else the one Python
    chained to the exception (a process pool attaches the worker's as its cause)."""
    import traceback

    if isinstance(err, ExperimentRaised):
        return err.traceback_text
    return "".join(traceback.format_exception(err))


def run_sweep(
    exp_id: str,
    grid: dict[str, list] | None = None,
    preset: str = "quick",
    overrides: dict | None = None,
    *,
    seeds: int | None = None,
    root: str | Path | None = None,
    executor: str = "local",
    address: str | None = None,
    workers: int | None = None,
    retries: int = 2,
    force: bool = False,
    checkpoint_every: int | None = None,
    checkpoint_seconds: float | None = None,
    progress: SweepProgress | None = None,
    threads: int | None = None,
    backend: str = "auto",
) -> SweepResult:
    """Runs every point of a grid (see the module docstring) and returns what became of each. ``iclab sweep``.

    Args:
        exp_id: a registered id or ``path/to/file.py:NAME``.
        grid: field -> values; the points are their product (None: the experiment's own grid).
        preset: the preset every point starts from; overrides: fields fixed at every point.
        seeds: number of seeds of every point.
        root: results root (default ``$ICLAB_RESULTS`` or ``./iclab-results``).
        executor: ``local`` (a process pool here) or ``ray`` (a running Ray cluster); address: the Ray address.
        workers: points computed at once (local default: one per core; ray: the cluster's CPUs).
        retries: times a point whose worker died is retried.
        force: recompute points that have a stored result.
        checkpoint_every, checkpoint_seconds: checkpoint interval of every point.
        progress: a SweepProgress display (default silent).
        threads: threads of each worker (:mod:`iclab.threads`; default: the cores shared out among the
            local workers, one per Ray task).
        backend: ``auto``, ``native`` or ``xla``, every point's (:func:`iclab.launch.run_experiment`).
    Returns:
        SweepResult: one PointResult per point (status done, cached, diverged or failed; checks; path).
    Raises:
        UserError: bad input (one line; nothing runs).
    """
    settings.check_environment()
    check_api_arguments(force, True, retries)
    if executor not in EXECUTORS:
        raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)} (got {shorten(executor)})")
    for name, value in (("workers", workers), ("threads", threads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be an integer ≥ 1 (got {shorten(value)})")
    if retries < 0:
        raise ConfigError(f"retries must be ≥ 0 (got {retries})")
    every, seconds = checkpoint_settings(checkpoint_every, checkpoint_seconds)
    exp, points = plan_sweep(exp_id, grid, preset, overrides, seeds, backend=backend)
    start = time.perf_counter()
    store = Store(results_root(root))
    root_abs = store.root.resolve()
    progress = progress or SweepProgress()
    results: dict[str, PointResult] = {}
    counts = defaultdict(int)

    def finish(result: PointResult) -> None:
        results[result.point.digest] = result
        counts["failed" if result.status in ("failed", "diverged") else result.status] += 1
        progress.update(counts["done"], counts["failed"], counts["cached"], len(inflight))

    def cached(point: Point, path: Path) -> PointResult:
        metrics = json.loads((path / "metrics.json").read_text())
        status = "cached" if metrics.get("status", "done") == "done" else metrics["status"]
        return PointResult(point, status, path, metrics["checks"],
                           (metrics.get("diverged") or {}).get("message"), 0.0)

    inflight: dict = {}
    progress.start(len(points))
    todo: list[tuple[Point, object]] = []  # (point, lock held or None)
    def stored(point: Point) -> Path | None:
        if force:
            return None
        damaged = store.damaged(exp.id, point.digest)
        if damaged:
            print(f"warning: the stored result of {point.label} is damaged ({'; '.join(damaged)}): recomputing it "
                  "(the damaged folder is kept in .damaged/)", file=sys.stderr)
        return reusable(store, exp.id, point.digest, repair=True)

    for point in points:
        path = stored(point)
        if path is not None:
            finish(cached(point, path))
        else:
            todo.append((point, None))
    if not todo:
        progress.close()
        return SweepResult(exp.id, preset, executor, [results[p.digest] for p in points], time.perf_counter() - start)

    ex = make_executor(executor, len(todo), address=address, workers=workers, retries=retries, threads=threads,
                       fn=compute_point)
    attempts: dict[str, int] = defaultdict(int)
    waiting: list[tuple[Point, object]] = []
    driver_host = socket.gethostname()
    interrupted = False
    try:
        while todo or waiting or inflight:
            # Start points while there is capacity; a point another process holds waits.
            while todo and len(inflight) < ex.capacity:
                point, lock = todo.pop(0)
                if lock is None:
                    lock = store.lock(exp.id, point.digest)
                    if not lock.acquire(blocking=False):
                        waiting.append((point, lock))
                        continue
                path = stored(point)
                if path is not None:  # computed meanwhile by the process we waited for
                    lock.release()
                    finish(cached(point, path))
                    continue
                attempt = begin_attempt(store, point.ident, force=force, clear=force and attempts[point.digest] == 0)
                attempts[point.digest] += 1
                args = (experiment_ref(exp), point.config, point.digest,
                        str(root_abs / ".running" / attempt.running.name), every, seconds, driver_host,
                        point.ident.backend)
                inflight[ex.submit(args)] = (point, lock, attempt, time.perf_counter())
                progress.update(counts["done"], counts["failed"], counts["cached"], len(inflight))
            # Points held by other processes: take them over once their lock frees.
            if waiting and len(inflight) < ex.capacity:
                still = []
                for point, lock in waiting:
                    if lock.acquire(blocking=False):
                        todo.append((point, lock))
                    else:
                        still.append((point, lock))
                waiting = still
                if not todo and not inflight:
                    time.sleep(0.5)
                    continue
            if not inflight:
                continue
            for handle, payload, err in ex.wait(list(inflight), timeout=0.5):
                point, lock, attempt, t0 = inflight.pop(handle)
                wall = time.perf_counter() - t0
                if isinstance(err, WorkerCrash) and executor == "local" and attempts[point.digest] <= retries:
                    store.end(attempt.row, "interrupted", wall, error=f"{err}; retried")
                    todo.insert(0, (point, lock))  # keeps its lock; resumes from its checkpoints
                    continue
                try:
                    if err is not None:
                        text = _error_text(err)
                        folder = store_failure(store, exp, point.ident, text, _traceback_text(err), wall_s=wall,
                                               row=attempt.row, started=attempt.started)
                        store.end(attempt.row, "failed", wall, error=text)
                        finish(PointResult(point, "failed", folder, [], text, wall, attempts[point.digest]))
                    else:
                        path = store_payload(store, exp, point.ident, payload, row=attempt.row,
                                             started=attempt.started, note=attempt.note)
                        finish_attempt(store, attempt, payload)
                        div = payload.get("diverged")
                        finish(PointResult(point, payload["status"], path, payload["checks"],
                                           None if div is None else div["message"], payload["wall_s"],
                                           attempts[point.digest]))
                finally:
                    lock.release()
    except BaseException:
        interrupted = True
        raise
    finally:
        ex.close(cancel=interrupted)
        for point, lock, attempt, t0 in inflight.values():
            try:
                store.end(attempt.row, "interrupted", time.perf_counter() - t0, error="the sweep was stopped")
            except Exception:  # noqa: BLE001 - an unwritable index must not hide why the sweep stopped
                pass
            finally:
                lock.release()
        for point, lock in todo + waiting:
            if lock is not None:
                lock.release()
        progress.close()
    return SweepResult(exp.id, preset, executor, [results[p.digest] for p in points], time.perf_counter() - start)
