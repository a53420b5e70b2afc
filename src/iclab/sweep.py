"""Sweeps: one experiment over a grid of config values, on local processes or a Ray cluster.

The driver (the ``iclab sweep`` process) validates every grid point before running any, skips
points already in the store, takes each remaining point's lock (so concurrent sweeps sharing a
results root never compute a point twice: a point locked by another process is waited for and
then reused), and hands the point to an executor:

- ``local``: a pool of worker processes on this machine (``--workers``, default one per core;
  ``--workers 1`` runs in the driver itself);
- ``ray``: one task per point on a running Ray cluster (``--address auto`` or ``host:port``); a
  task whose worker dies is retried up to ``retries`` times.

Workers run :func:`iclab.launch.compute_point` and return arrays, checks and the figure bytes;
the driver writes every result into the store, so workers need no shared file system. Points
checkpoint their engine loops in the store's in-progress folder on the node that computes them,
so a rerun after a crash (of a worker, of the driver, SIGKILL included) resumes them there.

An exception in a point marks it ``failed`` (its error is stored and reported at the end); a NaN
or infinite loss marks it ``diverged``; the sweep goes on with the other points.
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool
import itertools
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from collections.abc import Mapping

from iclab import settings
from iclab.errors import ConfigError, UserError
from iclab.launch import (
    ExperimentRaised,
    RunIdentity,
    _check_api_arguments,
    _reusable,
    checkpoint_settings,
    code_of,
    compute_point,
    end_row,
    experiment_or_error,
    experiment_ref,
    identify,
    not_reused,
    resolve_config,
    results_root,
    shorten,
    store_failure,
    store_payload,
)
from iclab.progress import SweepProgress
from iclab.store import Store
from iclab.threads import available_cores, set_threads

MAX_POINTS = 10_000
EXECUTORS = ("local", "ray")


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
               overrides: dict | None = None, seeds: int | None = None) -> tuple[object, list[Point]]:
    """Every point of the grid, validated (UserError on the first invalid one), duplicates removed."""
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
            _, config = resolve_config(exp.id, preset, {**overrides, **values}, seeds)
        except UserError as err:
            label = " ".join(f"{k}={json.dumps(v, default=repr)}" for k, v in values.items())
            raise type(err)(f"grid point {label}: {err}") from None
        ident = identify(exp, config, preset, code)
        if ident.digest not in seen:
            seen.add(ident.digest)
            points.append(Point(values, ident))
    return exp, points


# -- executors ----------------------------------------------------------------------------------

class _Crash(Exception):
    """A worker died while computing a point (the point may be retried)."""


class _Inline:
    """Runs tasks one at a time in the driver process (``--workers 1``); ``fn`` computes one task
    (default: a sweep point, :func:`iclab.launch.compute_point`)."""

    capacity = 1

    def __init__(self, fn=compute_point):
        self.fn = fn
        self._queue: dict[int, tuple] = {}
        self._next = 0

    def submit(self, args: tuple):
        self._next += 1
        self._queue[self._next] = args
        return self._next

    def wait(self, handles, timeout):
        handle = next(iter(handles))
        try:
            return [(handle, self.fn(*self._queue.pop(handle)), None)]
        except Exception as err:  # noqa: BLE001 - a point's error is its result
            return [(handle, None, err)]

    def close(self, cancel: bool = False):
        self._queue.clear()


def _init_worker(parent: int, threads: int | None = None) -> None:
    """Pool worker start-up: die with the driver (a killed sweep leaves no orphan computing), and size
    the worker's thread pools (before it computes anything: XLA reads them when its client starts)."""
    if threads is not None:
        from iclab.threads import set_threads

        set_threads(threads)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
    import iclab  # noqa: F401  (float64 on)


class _LocalPool:
    """A pool of worker processes (spawned: JAX does not survive fork); a pool broken by a dead
    worker is replaced and its tasks retried. ``fn`` (a module-level function) computes one task."""

    def __init__(self, workers: int, threads: int | None = None, fn=compute_point):
        self.capacity = workers
        self.threads = threads
        self.fn = fn
        self._pool = None

    def _get(self):
        if self._pool is None:
            import multiprocessing as mp

            self._pool = cf.ProcessPoolExecutor(max_workers=self.capacity, mp_context=mp.get_context("spawn"),
                                                initializer=_init_worker, initargs=(os.getpid(), self.threads))
        return self._pool

    def submit(self, args: tuple):
        try:
            return self._get().submit(self.fn, *args)
        except BrokenProcessPool:
            self._reset()
            return self._get().submit(self.fn, *args)

    def wait(self, handles, timeout):
        done, _ = cf.wait(list(handles), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        out, broken = [], False
        for fut in done:
            err = fut.exception()
            if isinstance(err, BrokenProcessPool):
                broken = True
                out.append((fut, None, _Crash(f"worker process died ({err})")))
            else:
                out.append((fut, None if err else fut.result(), err))
        if broken:
            self._reset()
        return out

    def _reset(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self, cancel: bool = False):
        if self._pool is not None:
            if cancel:
                for proc in list(getattr(self._pool, "_processes", {}).values()):
                    if proc.is_alive():
                        proc.kill()
            self._pool.shutdown(wait=not cancel, cancel_futures=True)
            self._pool = None


class _Ray:
    """One Ray task per point (or per ``fn`` call) on a running cluster; Ray retries a task whose worker died."""

    def __init__(self, address: str | None, workers: int | None, retries: int, threads: int | None = None,
                 fn=compute_point):
        try:
            import ray
        except ImportError:
            raise ConfigError("the ray executor needs Ray: pip install 'iclab[ray]'") from None
        import logging

        self.ray = ray
        address = address or "auto"
        _check_reachable(address)
        # Ray's driver prints the cluster's error messages (e.g. a worker that died) on stdout:
        # send them to stderr while connected, so that stdout stays iclab's (--json).
        self._stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, ignore_reinit_error=True)
        except (ConnectionError, ValueError, RuntimeError) as err:
            sys.stdout = self._stdout
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"cannot connect to a Ray cluster at {address!r}: {first} "
                            "(start one with `ray start --head`)") from None
        # One CPU per task, so one thread per task unless --threads says otherwise (then as many CPUs).
        self.threads = threads or 1
        self.remote = ray.remote(num_cpus=self.threads, max_retries=retries, retry_exceptions=False)(fn)
        cpus = int(ray.cluster_resources().get("CPU", 1)) or 1
        self.capacity = workers or max(1, cpus // self.threads)

    def submit(self, args: tuple):
        return self.remote.remote(*args, threads=self.threads)

    def wait(self, handles, timeout):
        ready, _ = self.ray.wait(list(handles), num_returns=1, timeout=timeout)
        out = []
        for ref in ready:
            try:
                out.append((ref, self.ray.get(ref), None))
            except self.ray.exceptions.RayTaskError as err:
                cause = getattr(err, "cause", None)
                out.append((ref, None, cause if isinstance(cause, BaseException) else err))
            except self.ray.exceptions.RayError as err:  # worker or node died, retries used up
                out.append((ref, None, _Crash(_first_line(err))))
        return out

    def close(self, cancel: bool = False):
        try:
            self.ray.shutdown()
        finally:
            sys.stdout = self._stdout


def make_executor(executor: str, tasks: int, *, address: str | None = None, workers: int | None = None,
                  retries: int = 2, threads: int | None = None, fn=compute_point, inline_fn=None):
    """The executor of ``tasks`` independent tasks: ``ray`` (a running cluster), or ``local`` (a process
    pool of ``workers`` processes, default one per core and at most one per task, each with its share
    of the cores; one worker runs in this process).

    Args:
        executor: ``local`` or ``ray``; tasks: how many tasks there are.
        address, workers, retries, threads: as in :func:`run_sweep`.
        fn: the module-level function that computes one task (pickled to the workers).
        inline_fn: what computes a task in this process (default ``fn``).
    Returns:
        An object with ``capacity``, ``submit(args) -> handle``, ``wait(handles, timeout) -> [(handle,
        result, error)]`` and ``close(cancel)``.
    """
    if executor == "ray":
        return _Ray(address, workers, retries, threads, fn=fn)
    n = workers or min(available_cores(), tasks)
    if n == 1:
        if threads is not None:
            set_threads(threads)
        return _Inline(inline_fn or fn)
    # the cores shared out: W workers of ⌊cores / W⌋ threads each (at least one)
    return _LocalPool(n, threads or max(1, available_cores() // n), fn=fn)


def _check_reachable(address: str) -> None:
    """Fails fast (Ray itself retries for minutes) when a host:port address has no listener."""
    host, sep, port = address.rpartition(":")
    if address in ("auto", "local") or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=10).close()
    except OSError as err:
        raise ConfigError(f"cannot connect to a Ray cluster at {address!r}: {err.strerror or err} "
                        "(start one with `ray start --head`)") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


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


# -- the driver ------------------------------------------------------------------------------------

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
    Returns:
        SweepResult: one PointResult per point (status done, cached, diverged or failed; checks; path).
    Raises:
        UserError: bad input (one line; nothing runs).
    """
    settings.check_environment()
    _check_api_arguments(force, True, retries)
    if executor not in EXECUTORS:
        raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)} (got {shorten(executor)})")
    for name, value in (("workers", workers), ("threads", threads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be an integer ≥ 1 (got {shorten(value)})")
    if retries < 0:
        raise ConfigError(f"retries must be ≥ 0 (got {retries})")
    every, seconds = checkpoint_settings(checkpoint_every, checkpoint_seconds)
    exp, points = plan_sweep(exp_id, grid, preset, overrides, seeds)
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
    def reusable(point: Point) -> Path | None:
        if force:
            return None
        damaged = store.damaged(exp.id, point.digest)
        if damaged:
            print(f"warning: the stored result of {point.label} is damaged ({'; '.join(damaged)}): recomputing it "
                  "(the damaged folder is kept in .damaged/)", file=sys.stderr)
        return _reusable(store, exp.id, point.digest, repair=True)

    for point in points:
        path = reusable(point)
        if path is not None:
            finish(cached(point, path))
        else:
            todo.append((point, None))
    if not todo:
        progress.close()
        return SweepResult(exp.id, preset, executor, [results[p.digest] for p in points], time.perf_counter() - start)

    ex = make_executor(executor, len(todo), address=address, workers=workers, retries=retries, threads=threads)
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
                path = reusable(point)
                if path is not None:  # computed meanwhile by the process we waited for
                    lock.release()
                    finish(cached(point, path))
                    continue
                store.mark_interrupted(exp.id, point.digest)
                running = store.running_dir(exp.id, point.digest)
                if force and attempts[point.digest] == 0:
                    shutil.rmtree(running, ignore_errors=True)
                started = time.time()
                note = None if force else not_reused(store, point.ident)
                row = store.begin(exp.id, point.digest, preset, point.config, started=started,
                                  config_key=point.ident.config_key, code=point.ident.code["digest"])
                attempts[point.digest] += 1
                args = (experiment_ref(exp), point.config, point.digest, str(root_abs / ".running" / running.name),
                        every, seconds, driver_host)
                inflight[ex.submit(args)] = (point, lock, row, time.perf_counter(), started, note)
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
                point, lock, row, t0, started, note = inflight.pop(handle)
                wall = time.perf_counter() - t0
                if isinstance(err, _Crash) and executor == "local" and attempts[point.digest] <= retries:
                    store.end(row, "interrupted", wall, error=f"{err}; retried")
                    todo.insert(0, (point, lock))  # keeps its lock; resumes from its checkpoints
                    continue
                try:
                    if err is not None:
                        text = _error_text(err)
                        folder = store_failure(store, exp, point.ident, text, _traceback_text(err), wall_s=wall,
                                               row=row, started=started)
                        store.end(row, "failed", wall, error=text)
                        finish(PointResult(point, "failed", folder, [], text, wall, attempts[point.digest]))
                    else:
                        path = store_payload(store, exp, point.ident, payload, row=row, started=started, note=note)
                        end_row(store, row, payload)
                        shutil.rmtree(store.running_dir(exp.id, point.digest), ignore_errors=True)
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
        for point, lock, row, t0, *_ in inflight.values():
            try:
                store.end(row, "interrupted", time.perf_counter() - t0, error="the sweep was stopped")
            except Exception:  # noqa: BLE001 - an unwritable index must not hide why the sweep stopped
                pass
            finally:
                lock.release()
        for point, lock in todo + waiting:
            if lock is not None:
                lock.release()
        progress.close()
    return SweepResult(exp.id, preset, executor, [results[p.digest] for p in points], time.perf_counter() - start)
