"""Sharded runs: one figure computed as independent shards on local processes or a Ray cluster.

An experiment may declare shards (:class:`iclab.experiments.Experiment` ``shards``, ``run_shard``,
``assemble``): independent parts of its figure, e.g. gating.fig1's panels × blocks of n̄. ``iclab run EXP
--executor local --workers N`` (or ``--executor ray [--address ADDR]``) then

1. lists the shards of the resolved config and reuses every one cached by an earlier, interrupted run of
   the same config;
2. computes the others as separate tasks on the executors (:func:`iclab.executors.make_executor`: a
   process pool, or one Ray task per shard), each checkpointing its engine loops on the node computing it;
3. caches each finished shard in the run's in-progress folder as it arrives (written to a temporary name
   and renamed, with its size and SHA-256 in a sidecar; a cached shard that fails the check is recomputed);
4. assembles the figure's arrays (``assemble``) and stores them as an ordinary run (:func:`compute_sharded`
   is the compute step of :func:`iclab.runner.run_point`): checks, figure, index row, ``metrics.json``
   with ``sharded`` (the executor, the number of shards, how many were computed now and how many
   reused).

The shard cache of a run is ``<root>/.running/<experiment>-<hash>/shards/<shard>.npz`` (+ ``.json``),
removed with the rest of the in-progress folder once the run is stored; ``--force`` starts it afresh.
The run key does not depend on the executor: a sharded run's result equals the unsharded run's to
float rounding, and either one is reused by the other.

Workers need no shared file system: they return a shard's arrays to the driver, which writes the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np

from iclab.errors import ConfigError
from iclab.executors import EXECUTORS, WorkerCrash, make_executor
from iclab.ops import use_backend
from iclab.progress import Reporter, RunReporter, task
from iclab.runner import checked_arrays, compute, experiment_ref, flat_arrays, worker_config
from iclab.store import Store

__all__ = ["EXECUTORS", "ShardCache", "ShardFailed", "check_options", "compute_shard", "compute_sharded", "run_shards",
           "shard_names"]
#: What a shard name may be: it names a file in the shard cache.
SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}")


class ShardFailed(RuntimeError):
    """A shard raised an exception (a bug, or a worker that died more often than ``retries``)."""


def check_options(executor: str | None, workers: int | None, address: str | None, retries: int = 2) -> None:
    """Checks the sharding options of a run; each problem is one line (UserError).

    Args:
        executor: None (no sharding), ``local`` or ``ray``.
        workers: ≥ 1 if given; only with an executor.
        address: only with ``ray``.
        retries: ≥ 0.
    """
    if executor is None:
        if workers is not None or address is not None:
            raise ConfigError("--workers and --address apply to a sharded run: add --executor local or --executor ray")
        return
    if executor not in EXECUTORS:
        raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)} (got {executor!r})")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ConfigError(f"workers must be an integer ≥ 1 (got {workers!r})")
    if address is not None and (executor != "ray" or not isinstance(address, str)):
        raise ConfigError("--address applies to --executor ray only, as host:port or auto")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ConfigError(f"retries must be an integer ≥ 0 (got {retries!r})")


def shard_names(exp, config) -> list[str]:
    """The shard names of a resolved config, checked (UserError when the experiment declares no shards).

    Args:
        exp: the experiment; config: its resolved config.
    Raises:
        UserError: the experiment has no shards.
        ValueError: names that repeat, are empty or are not file-safe (a bug of the experiment).
    """
    if not getattr(exp, "sharded", False):
        raise ConfigError(f"{exp.id} declares no shards: run it without --executor (or sweep a grid with iclab sweep)")
    names = list(exp.shards(config))
    if not names:
        raise ValueError(f"{exp.id}: shards(config) returned no shard")
    bad = [n for n in names if not isinstance(n, str) or not SHARD_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"{exp.id}: shard names must be letters, digits, '_', '.', '=' or '-' (got {bad[:3]})")
    if len(set(names)) != len(names):
        raise ValueError(f"{exp.id}: shard names repeat")
    return names


class ShardCache:
    """The finished shards of one run: ``<name>.npz`` and its sidecar ``<name>.json`` (size, SHA-256,
    wall time, host), each written to a temporary name and renamed; the sidecar is written last, so a
    shard without one is unfinished.

    Args:
        folder: the cache folder (created on the first save).
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.npz", self.folder / f"{name}.json"

    def load(self, name: str) -> tuple[dict, dict] | None:
        """(arrays, sidecar) of a cached shard, or None when it is absent or fails its check (then both
        files are removed, and the shard is computed again)."""
        npz, side = self._paths(name)
        if not side.is_file():
            return None
        try:
            meta = json.loads(side.read_text())
            if npz.stat().st_size != meta["size"] or _sha256(npz) != meta["sha256"]:
                raise ValueError("differs from its recorded size or SHA-256")
            with np.load(npz, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError, TypeError, EOFError) as err:
            print(f"warning: the cached shard {name} is damaged ({type(err).__name__}: {err}): computing it again",
                  file=sys.stderr)
            npz.unlink(missing_ok=True)
            side.unlink(missing_ok=True)
            return None
        return arrays, meta

    def save(self, name: str, arrays: dict, meta: dict) -> None:
        """Writes a finished shard (atomically: temporary names, then rename; the sidecar last)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        npz, side = self._paths(name)
        tag = f".{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        tmp_npz, tmp_side = npz.with_name(npz.name + tag), side.with_name(side.name + tag)
        try:
            with open(tmp_npz, "wb") as f:
                np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
            os.replace(tmp_npz, npz)
            tmp_side.write_text(json.dumps(dict(meta, size=npz.stat().st_size, sha256=_sha256(npz)), indent=1))
            os.replace(tmp_side, side)
        finally:
            tmp_npz.unlink(missing_ok=True)
            tmp_side.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def compute_shard(exp_id: str, resolved: dict, digest: str, name: str, running_dir: str | None = None,
                  checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
                  driver_host: str | None = None, backend: str = "auto", threads: int | None = None,
                  reporter: Reporter | None = None) -> dict:
    """One shard on a worker (local pool, Ray task, or this process): rebuilds the config from its resolved
    JSON, checks its hash, runs ``exp.run_shard`` with its engine loops checkpointed in ``running_dir``.

    Args:
        exp_id: the experiment's id or ``path.py:NAME``; resolved, digest: the run's config and hash.
        name: the shard.
        running_dir: the shard's checkpoint folder (None: none); removed on a worker of another host than
            the driver once the shard is done.
        checkpoint_every, checkpoint_seconds: the checkpoint interval.
        driver_host: the driver's host name.
        backend: the backend to compute with (the driver's, resolved).
        threads: the threads this worker computes with (None: as set).
        reporter: progress reporter (only in the driver's process; None: silent).
    Returns:
        {"status": "done", "arrays", "wall_s", "host", "resumed"}; or status "diverged" with "diverged" (the
        fields of :class:`iclab.engines.Diverged`) and its finite records as "arrays".
    """
    from iclab.checkpoint import RunCheckpoints
    from iclab.engines import Diverged

    exp, config = worker_config(exp_id, resolved, digest, threads, backend)
    checkpoints = None
    if running_dir is not None:
        try:
            Path(running_dir).parent.mkdir(parents=True, exist_ok=True)
            checkpoints = RunCheckpoints(running_dir, checkpoint_every, checkpoint_seconds)
        except OSError:  # no such results root on this node: run without checkpoints
            running_dir = None
    start = time.perf_counter()
    out = {"host": socket.gethostname()}
    try:
        try:
            with use_backend(backend):
                arrays = exp.run_shard(config, name, RunReporter(reporter or Reporter(), checkpoints))
        except Exception:
            if running_dir is not None:  # checkpoints of a failing shard may come from a bug: start afresh
                shutil.rmtree(running_dir, ignore_errors=True)
            raise
    except Diverged as div:  # not picklable as it is: its fields travel as a dict
        out.update(status="diverged", arrays=flat_arrays(div.records), diverged={
            "label": div.label, "step": div.step, "t": div.t, "last_finite_step": div.last_finite_step,
            "last_finite_t": div.last_finite_t, "last_finite_loss": div.last_finite_loss})
    else:
        out.update(status="done", arrays=checked_arrays(exp.id, arrays, "run_shard(config, name, reporter)"))
    out["wall_s"] = time.perf_counter() - start
    out["resumed"] = [f"shard {name}: {e}" for e in (checkpoints.events if checkpoints is not None else [])]
    if running_dir is not None and driver_host is not None and driver_host != socket.gethostname():
        shutil.rmtree(running_dir, ignore_errors=True)
    return out


def run_shards(exp, config, digest: str, store: Store, *, executor: str = "local", address: str | None = None,
               workers: int | None = None, retries: int = 2, threads: int | None = None,
               checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
               reporter: Reporter | None = None, info: dict | None = None, backend: str = "auto") -> dict:
    """Computes (or reuses from the cache) every shard of a run and assembles the figure's arrays.

    Called by :func:`compute_sharded`, holding the run's lock (see the module docstring).

    Args:
        exp, config, digest: the experiment, its resolved config and run key.
        store: the result store (the cache is in the run's in-progress folder).
        executor, address, workers, retries, threads: as in :func:`iclab.executors.make_executor`.
        checkpoint_every, checkpoint_seconds: the shards' checkpoint interval.
        reporter: progress reporter (None: silent); one task counts the shards.
        info: filled with {"executor", "shards", "computed", "reused", "resumed"} (None: not recorded).
        backend: the run's backend, resolved (every shard computes with it).
    Returns:
        The assembled arrays (``exp.assemble``).
    Raises:
        iclab.engines.Diverged: a shard diverged (its finite records, its task named after the shard).
        ShardFailed: a shard raised (the other shards finished so far stay cached).
    """
    from iclab.engines import Diverged

    names = shard_names(exp, config)
    resolved = config.model_dump(mode="json")
    running = store.running_dir(exp.id, digest).resolve()
    cache = ShardCache(running / "shards")
    parts: dict[str, dict] = {}
    for name in names:
        hit = cache.load(name)
        if hit is not None:
            parts[name] = hit[0]
    reused = len(parts)
    todo = [n for n in names if n not in parts]
    info = {} if info is None else info
    info.update(executor=executor, shards=len(names), computed=0, reused=reused, resumed=[])
    host = socket.gethostname()
    with task(reporter, f"shards of {exp.id} ({executor})", len(names)) as cb:
        cb(len(parts), {})
        if todo:
            # A shard computed in this process reports nothing: its tasks would nest inside the shards' bar.
            ex = make_executor(executor, len(todo), address=address, workers=workers, retries=retries,
                               threads=threads, fn=compute_shard)
            attempts: dict[str, int] = defaultdict(int)
            inflight: dict = {}
            cancel = True
            try:
                while todo or inflight:
                    while todo and len(inflight) < ex.capacity:
                        name = todo.pop(0)
                        attempts[name] += 1
                        args = (experiment_ref(exp), resolved, digest, name, str(running / "checkpoints" / name),
                                checkpoint_every, checkpoint_seconds, host, backend)
                        inflight[ex.submit(args)] = name
                    for handle, out, err in ex.wait(list(inflight), timeout=0.5):
                        name = inflight.pop(handle)
                        if isinstance(err, WorkerCrash) and executor == "local" and attempts[name] <= retries:
                            todo.insert(0, name)  # resumes from its checkpoints
                            continue
                        if err is not None:
                            text = " ".join(str(err).split())
                            raise ShardFailed(f"shard {name} of {exp.id} failed: {type(err).__name__}: {text}") from err
                        info["resumed"] += out.get("resumed", [])
                        if out["status"] == "diverged":
                            d = out["diverged"]
                            raise Diverged(f"shard {name}: {d['label']}", d["step"], d["t"], d["last_finite_step"],
                                           d["last_finite_t"], d["last_finite_loss"], out["arrays"])
                        cache.save(name, out["arrays"], {"shard": name, "experiment": exp.id, "config_hash": digest,
                                                         "wall_s": out["wall_s"], "host": out["host"]})
                        shutil.rmtree(running / "checkpoints" / name, ignore_errors=True)
                        parts[name] = out["arrays"]
                        info["computed"] += 1
                        cb(len(parts), {})
                cancel = False
            finally:
                ex.close(cancel=cancel)
    return checked_arrays(exp.id, exp.assemble(config, {name: parts[name] for name in names}, reporter),
                          "assemble(config, shards, reporter)")


def compute_sharded(exp, config, digest: str, store: Store, *, reporter: Reporter | None = None, **options) -> dict:
    """:func:`iclab.runner.compute` with the arrays from the run's shards (:func:`run_shards`); the payload
    records how the run was sharded (``sharded``) and which shards were reused or resumed (``resumed``).

    Args:
        exp, config, digest, store: as in :func:`run_shards`.
        reporter: progress reporter (None: silent).
        options: the other arguments of :func:`run_shards` (executor, address, workers, retries, threads,
            checkpoint_every, checkpoint_seconds).
    Returns:
        The payload of :func:`iclab.runner.compute`, with ``sharded``.
    """
    info: dict = {}
    payload = compute(exp, config, reporter=reporter,
                      run=lambda cfg, rep: run_shards(exp, cfg, digest, store, reporter=rep, info=info, **options))
    notes = list(info.pop("resumed", []))
    if info.get("reused"):
        notes.insert(0, f"{info['reused']} of {info['shards']} shards reused from the shard cache of an earlier run")
    payload["resumed"] = notes + payload["resumed"]
    payload["sharded"] = info
    return payload
