"""Task executors: where independent tasks compute, for :mod:`iclab.sweep` (one task per grid point) and
:mod:`iclab.shards` (one task per shard of a run).

- ``local``: a pool of worker processes on this machine (spawned: JAX does not survive fork), each with
  its share of the cores; a pool broken by a dead worker is replaced and its tasks come back as
  :class:`WorkerCrash` (the caller may retry them). One worker runs the tasks in this process instead.
- ``ray``: one task per call on a running Ray cluster (``address``: ``auto`` or ``host:port``); Ray
  retries a task whose worker died up to ``retries`` times, then it comes back as :class:`WorkerCrash`.

Every executor has the same interface (:func:`make_executor`): ``capacity``, ``submit(args) -> handle``,
``wait(handles, timeout) -> [(handle, result, error)]`` and ``close(cancel)``. A task is a module-level
function (pickled by reference to the workers) called with ``args`` and ``threads=``.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import sys
from concurrent.futures.process import BrokenProcessPool

from iclab.errors import ConfigError
from iclab.threads import available_cores, set_threads

__all__ = ["EXECUTORS", "WorkerCrash", "make_executor"]

EXECUTORS = ("local", "ray")


class WorkerCrash(Exception):
    """A worker died while computing a task (the task may be retried)."""


class _Inline:
    """Runs tasks one at a time in the driver process (``--workers 1``); ``fn`` computes one task."""

    capacity = 1

    def __init__(self, fn):
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
        except Exception as err:  # noqa: BLE001 - a task's error is its result
            return [(handle, None, err)]

    def close(self, cancel: bool = False):
        self._queue.clear()


def _init_worker(parent: int, threads: int | None = None) -> None:
    """Pool worker start-up: die with the driver (a killed sweep or sharded run leaves no orphan computing), and
    size the worker's thread pools (before it computes anything: XLA reads them when its client starts)."""
    from iclab.ops import die_with_parent

    if threads is not None:
        set_threads(threads)
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)
    import iclab  # noqa: F401  (float64 on)


class _LocalPool:
    """A pool of worker processes (spawned: JAX does not survive fork); a pool broken by a dead
    worker is replaced and its tasks retried. ``fn`` (a module-level function) computes one task."""

    def __init__(self, workers: int, fn, threads: int | None = None):
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
                out.append((fut, None, WorkerCrash(f"worker process died ({err})")))
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
    """One Ray task per ``fn`` call on a running cluster; Ray retries a task whose worker died."""

    def __init__(self, address: str | None, workers: int | None, retries: int, fn, threads: int | None = None):
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
                out.append((ref, None, WorkerCrash(_first_line(err))))
        return out

    def close(self, cancel: bool = False):
        try:
            self.ray.shutdown()
        finally:
            sys.stdout = self._stdout


def make_executor(executor: str, tasks: int, *, address: str | None = None, workers: int | None = None,
                  retries: int = 2, threads: int | None = None, fn, inline_fn=None):
    """The executor of ``tasks`` independent tasks: ``ray`` (a running cluster), or ``local`` (a process
    pool of ``workers`` processes, default one per core and at most one per task, each with its share
    of the cores; one worker runs in this process).

    Args:
        executor: ``local`` or ``ray``; tasks: how many tasks there are.
        address: the Ray cluster (``auto``, the default, or ``host:port``); only with ``ray``.
        workers: tasks computed at once (local default: one per core, at most one per task; ray default:
            the cluster's CPUs, one task per ``threads`` of them).
        retries: times Ray retries a task whose worker died (a local pool's crashed tasks come back as
            :class:`WorkerCrash`: the caller retries them).
        threads: threads of each worker (:mod:`iclab.threads`; default: the cores shared out among the
            local workers, one per Ray task).
        fn: the module-level function that computes one task (pickled to the workers).
        inline_fn: what computes a task in this process (default ``fn``).
    Returns:
        An object with ``capacity``, ``submit(args) -> handle``, ``wait(handles, timeout) -> [(handle,
        result, error)]`` and ``close(cancel)``.
    """
    if executor == "ray":
        return _Ray(address, workers, retries, fn, threads)
    n = workers or min(available_cores(), tasks)
    if n == 1:
        if threads is not None:
            set_threads(threads)
        return _Inline(inline_fn or fn)
    # the cores shared out: W workers of ⌊cores / W⌋ threads each (at least one)
    return _LocalPool(n, fn, threads or max(1, available_cores() // n))


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


