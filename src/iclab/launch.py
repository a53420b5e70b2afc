"""The one launcher: resolve an experiment's config, run it (or reuse the stored result), check,
plot and store. Everything ``iclab run`` does is a call of :func:`run_experiment`; ``iclab sweep``
(:mod:`iclab.sweep`) runs the same :func:`compute_point` on workers and stores what they return.

A run takes its lock in the store (one process computes a given config at a time; a second one
waits and reuses the result), checkpoints its engine loops in its in-progress folder (a killed run
resumes from there, see :mod:`iclab.checkpoint`), and ends ``done``, ``diverged`` (the loss became
NaN or infinite: the finite part of the trajectory is stored), or ``failed`` (an exception).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from iclab import __version__
from iclab.experiments import Check, all_experiments, get_experiment
from iclab.progress import Reporter, RunReporter
from iclab.store import Store, config_hash


class UserError(Exception):
    """Bad input from the user: shown as one line, exit code 2, nothing written."""


class RunDamaged(Exception):
    """A stored result failed its verification and the user asked not to repair it: one line, exit 1."""


@dataclass
class RunResult:
    """A stored run as an object: its arrays, config, checks and figure at hand.

    Returned by :func:`run_experiment` and :func:`iclab.load`; nothing here parses files by hand.

    Attributes:
        experiment: the experiment's id.
        path: the run's folder in the result store.
        config: the resolved config (JSON types); :meth:`config_model` gives the validated object.
        checks: the checks, as stored (dicts: name, measured, expected, tolerance, comparison, passed, note).
        reused: whether a stored result was reused instead of computed.
        wall_s: wall time of the computation (of the reuse, when reused).
        status: ``done`` or ``diverged``.
        diverged: where and how the loss stopped being finite (None unless diverged).
        resumed: notes of the checkpoints it resumed from.
        source: ``path/to/file.py:NAME`` for an experiment defined outside the package, else None.
    """

    experiment: str
    path: Path
    config: dict
    checks: list[dict]
    reused: bool
    wall_s: float
    status: str = "done"
    diverged: dict | None = None
    resumed: list[str] = field(default_factory=list)
    source: str | None = None
    _arrays: dict | None = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        """True when the run finished (not diverged) and every check passed."""
        return self.status == "done" and all(c["passed"] for c in self.checks)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every stored array (``trajectories.npz``), by name, loaded once."""
        if self._arrays is None:
            with np.load(self.path / "trajectories.npz") as data:
                self._arrays = {k: data[k] for k in data.files}
        return self._arrays

    @property
    def failed_checks(self) -> list[dict]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c["passed"]]

    def experiment_object(self):
        """The :class:`iclab.experiments.Experiment` that produced this run (its file is loaded again
        for an experiment defined outside the package)."""
        return experiment_or_error(self.source or self.experiment)

    def config_model(self):
        """The validated config object of this run (the experiment's pydantic config class)."""
        return self.experiment_object().config.model_validate(self.config)

    def figure(self):
        """The run's figure, drawn again from the stored arrays (a matplotlib Figure).

        A diverged run gives the plot of its finite trajectory; a finished one the experiment's own plot.
        """
        if self.status == "diverged":
            return _diverged_figure(self.experiment, self.arrays, (self.diverged or {}).get("message", "diverged"))
        exp = self.experiment_object()
        return exp.plot(exp.config.model_validate(self.config), self.arrays)

    def as_dict(self) -> dict:
        """The run as plain JSON types (``iclab run --json``)."""
        out = {
            "experiment": self.experiment,
            "path": str(self.path),
            "status": self.status,
            "reused": self.reused,
            "wall_s": self.wall_s,
            "passed": self.passed,
            "checks": self.checks,
            "config": self.config,
        }
        if self.diverged is not None:
            out["diverged"] = self.diverged
        if self.resumed:
            out["resumed"] = self.resumed
        if self.source:
            out["source"] = self.source
        return out


#: Experiments loaded from files outside the package: id -> "absolute/path.py:NAME".
_USER_SOURCES: dict[str, str] = {}


def is_file_reference(ref: str) -> bool:
    """Whether ``ref`` names an experiment in a file (``path/to/file.py:NAME``) rather than a registered id."""
    path, sep, name = str(ref).rpartition(":")
    return bool(sep) and path.endswith(".py")


def load_experiment_file(ref: str):
    """Loads ``path/to/file.py:NAME``: imports the file and registers the :class:`Experiment` it names.

    The file is imported as a module of its own (its folder need not be a package); the experiment is
    registered under its own ``id`` (replacing an earlier load of the same file), so the store, checks,
    sweeps, resume and report treat it as any other.

    Args:
        ref: ``path/to/file.py:NAME`` (relative to the current directory, or absolute).
    Returns:
        The experiment.
    Raises:
        UserError: one line, when the file is missing or fails to import, NAME is not in it, or it is
            not an Experiment.
    """
    import importlib.util
    import re
    import sys

    from iclab.experiments import Experiment, register

    path_text, _, name = str(ref).rpartition(":")
    path = Path(path_text).expanduser()
    if not name.isidentifier():
        raise UserError(f"{ref}: expected path/to/file.py:NAME with NAME a Python identifier")
    if not path.is_file():
        raise UserError(f"{ref}: no such file {str(path)!r}")
    path = path.resolve()
    module_name = "iclab_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{ref}: {str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file: its error is one line, not our traceback
        sys.modules.pop(module_name, None)
        text = " ".join(str(err).split())
        raise UserError(f"{ref}: importing {path.name} failed: {type(err).__name__}: {text}") from None
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, Experiment))
        raise UserError(f"{ref}: {path.name} defines no {name!r}"
                        + (f"; experiments in it: {', '.join(found)}" if found else "; it defines no Experiment"))
    exp = getattr(module, name)
    if not isinstance(exp, Experiment):
        raise UserError(f"{ref}: {name} is a {type(exp).__name__}, not an iclab Experiment "
                        "(iclab.experiments.Experiment)")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", exp.id):
        raise UserError(f"{ref}: experiment id {exp.id!r} must be letters, digits, '_', '.' or '-'")
    try:
        register(exp, replace=exp.id in _USER_SOURCES)
    except ValueError as err:
        raise UserError(f"{ref}: {err} (a registered experiment has this id)") from None
    _USER_SOURCES[exp.id] = f"{path}:{name}"
    return exp


def experiment_ref(exp) -> str:
    """What a worker process needs to find ``exp``: its id, or ``path.py:NAME`` for a user file."""
    return _USER_SOURCES.get(exp.id, exp.id)


def experiment_or_error(exp_id: str):
    """The experiment of a registered id or of a ``path/to/file.py:NAME`` reference.

    Args:
        exp_id: ``paper.figN`` or ``path/to/file.py:NAME``.
    Raises:
        UserError: one line naming the known experiments, or what is wrong with the file.
    """
    if is_file_reference(exp_id):
        return load_experiment_file(exp_id)
    try:
        return get_experiment(exp_id)
    except KeyError:
        known = ", ".join(all_experiments())
        raise UserError(f"unknown experiment {exp_id!r}; known: {known} (or path/to/file.py:NAME)") from None


def path_overrides(exp_id: str, **paths) -> dict:
    """Config overrides from path options (``--model-path``, ``--data-path``): each given one must
    name a field of the experiment's config (UserError otherwise)."""
    given = {k: str(v) for k, v in paths.items() if v is not None}
    if not given:
        return {}
    exp = experiment_or_error(exp_id)
    for key in given:
        if key not in exp.config.model_fields:
            flag = "--" + key.replace("_", "-")
            users = sorted(e.id for e in all_experiments().values() if key in e.config.model_fields)
            raise UserError(f"{flag} applies only to experiments with a {key} field ({', '.join(users) or 'none'}); "
                            f"{exp_id} has none")
    return given


def parse_assignment(text: str) -> tuple[str, object]:
    """``key=value`` with the value read as JSON when it parses (numbers, lists, null, true),
    as a comma-separated list when it has commas, else as a string."""
    if "=" not in text:
        raise UserError(f"--set expects key=value (got {text!r})")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise UserError(f"--set expects key=value (got {text!r})")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        pass
    if "," in raw:
        parts = []
        for part in raw.split(","):
            try:
                parts.append(json.loads(part))
            except json.JSONDecodeError:
                parts.append(part.strip())
        return key, parts
    return key, raw


def shorten(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (long values are not echoed whole in one-line errors).

    Args:
        value: anything; limit: the most characters kept.
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_assignments(texts: list[str] | None) -> dict:
    """Several ``key=value`` options as a dict; a key given twice is a UserError (not last-wins).

    Args:
        texts: the ``--set`` options.
    """
    out: dict = {}
    for text in texts or []:
        key, value = parse_assignment(text)
        if key in out:
            raise UserError(f"--set {key} is given twice ({shorten(out[key])} and {shorten(value)})")
        out[key] = value
    return out


def describe_validation_error(err: ValidationError, config_cls) -> str:
    """One line naming each bad field, what is allowed, and what was given.

    Args:
        err: pydantic's error; config_cls: the config class validated (for the fields' bounds).
    """
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "config"
        ctx = e.get("ctx") or {}
        given = e.get("input")
        kind = e["type"]
        if kind == "extra_forbidden":
            allowed = ", ".join(config_cls.model_fields)
            parts.append(f"unknown field {field!r}; allowed fields: {allowed}")
            continue
        bound = {"greater_than_equal": ("≥", "ge"), "greater_than": (">", "gt"),
                 "less_than_equal": ("≤", "le"), "less_than": ("<", "lt")}.get(kind)
        if bound:
            msg = f"{field} must be {bound[0]} {ctx[bound[1]]}"
            info = config_cls.model_fields.get(e["loc"][0]) if e["loc"] else None
            if info is not None:
                limits = [f"{sym} {getattr(m, a)}" for m in info.metadata
                          for a, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
                          if getattr(m, a, None) is not None]
                if len(limits) > 1:
                    msg = f"{field} must be {' and '.join(limits)}"
            parts.append(f"{msg} (got {shorten(given)})")
        elif kind == "value_error":
            message = str(ctx.get("error", e["msg"]))
            parts.append(f"{field}: {message} (got {shorten(given)})" if e["loc"] else message)
        else:
            parts.append(f"{field}: {e['msg'].lower()} (got {shorten(given)})")
    return "; ".join(parts)


def resolve_config(exp_id: str, preset: str = "quick", overrides: dict | None = None, seeds: int | None = None):
    """The validated config of ``exp_id`` at ``preset`` with overrides; UserError if invalid."""
    exp = experiment_or_error(exp_id)
    if preset not in exp.presets:
        raise UserError(f"preset must be one of {', '.join(exp.presets)} (got {preset!r})")
    overrides = dict(overrides or {})
    if seeds is not None:
        if "seeds" in overrides and overrides["seeds"] != seeds:
            raise UserError(f"seeds is set by both --seeds ({seeds}) and --set seeds ({shorten(overrides['seeds'])})")
        overrides["seeds"] = seeds
    try:
        config = exp.resolve(preset, overrides)
    except ValidationError as err:
        raise UserError(f"{exp_id}: {describe_validation_error(err, exp.config)}") from None
    if exp.preflight is not None:
        try:
            exp.preflight(config)
        except ValueError as err:
            raise UserError(f"{exp_id}: {err}") from None
    if exp.memory is not None:
        need, what = exp.memory(config)
        limit = memory_limit()
        if need > limit:
            raise UserError(f"{exp_id}: this config needs about {need / 2**30:.1f} GiB for {what}, more than the "
                            f"limit of {limit / 2**30:.1f} GiB (ICLAB_MEMORY_LIMIT_GB, default 80 % of this machine's "
                            "memory): make it smaller")
    return exp, config


def memory_limit() -> float:
    """The memory (bytes) a run may plan to use: ``ICLAB_MEMORY_LIMIT_GB`` GiB, else 80 % of physical memory."""
    env = os.environ.get("ICLAB_MEMORY_LIMIT_GB")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise UserError(f"ICLAB_MEMORY_LIMIT_GB must be a number of GiB (got {shorten(env)})") from None
        if not value > 0 or value == float("inf"):
            raise UserError(f"ICLAB_MEMORY_LIMIT_GB must be > 0 and finite (got {shorten(env)})")
        return value * 2**30
    try:
        return 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return float("inf")


def checkpoint_settings(every: int | None = None, seconds: float | None = None) -> tuple[int | None, float | None]:
    """Checkpoint interval in chunks and seconds: the arguments, else ``ICLAB_CHECKPOINT_EVERY`` and
    ``ICLAB_CHECKPOINT_SECONDS``, else by time only (every 60 s)."""
    from iclab.checkpoint import env_settings

    try:
        env_every, env_seconds = env_settings()
    except ValueError as err:
        raise UserError(str(err)) from None
    every = env_every if every is None else every
    seconds = env_seconds if seconds is None else seconds
    if every is not None and every < 0:
        raise UserError(f"checkpoint interval must be ≥ 0 chunks (got {every})")
    if seconds is not None and seconds <= 0:
        raise UserError(f"checkpoint interval must be > 0 seconds (got {seconds})")
    return every, seconds


def compute(exp, config, *, running_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
            checkpoint_seconds: float | None = None, reporter: Reporter | None = None, run=None) -> dict:
    """Runs, checks and plots one config; returns what the store needs (a picklable payload).

    With ``running_dir`` the engine loops checkpoint there and resume from what they find. A NaN or
    infinite loss ends the run as ``diverged`` with its finite trajectory; exceptions propagate.
    ``run(config, reporter) -> arrays`` replaces ``exp.run`` (a sharded run: :func:`iclab.shards.run_shards`).

    Returns:
        {"status": "done" | "diverged", "arrays", "checks" (dicts), "figure_png", "figure_pdf"
        (bytes), "wall_s", "resumed" (notes), "diverged" (dict or None), "host"}.
    """
    from iclab.checkpoint import RunCheckpoints
    from iclab.engines import Diverged

    start = time.perf_counter()
    checkpoints = None
    if running_dir is not None:
        checkpoints = RunCheckpoints(running_dir, checkpoint_every, checkpoint_seconds)
    run_reporter = RunReporter(reporter or Reporter(), checkpoints)
    payload = {"host": socket.gethostname(), "diverged": None}
    try:
        try:
            arrays = (run or exp.run)(config, run_reporter)
        except Diverged as div:
            payload["status"] = "diverged"
            payload["diverged"] = {"task": div.label, "step": div.step, "t": div.t, "message": str(div),
                                   "last_finite_step": div.last_finite_step, "last_finite_t": div.last_finite_t,
                                   "last_finite_loss": div.last_finite_loss}
            payload["arrays"] = _flat_arrays(div.records)
            payload["checks"] = []
            fig = _diverged_figure(exp.id, payload["arrays"], str(div))
        else:
            payload["status"] = "done"
            payload["arrays"] = {k: np.asarray(v) for k, v in arrays.items()}
            checks: list[Check] = exp.checks(config, payload["arrays"])
            payload["checks"] = [c.as_dict() for c in checks]
            fig = exp.plot(config, payload["arrays"])
        payload["figure_png"], payload["figure_pdf"] = _figure_bytes(fig)
    except Exception:
        if running_dir is not None:  # checkpoints of a failing run may come from a bug: start afresh
            shutil.rmtree(running_dir, ignore_errors=True)
        raise
    payload["resumed"] = list(checkpoints.events) if checkpoints is not None else []
    payload["wall_s"] = time.perf_counter() - start
    return payload


def worker_config(exp_id: str, resolved: dict, digest: str, threads: int | None = None):
    """A worker's (experiment, config): sets its threads, rebuilds the config from the driver's resolved JSON
    and checks that it hashes as the driver's (RuntimeError otherwise).

    Args:
        exp_id: the experiment's id or ``path.py:NAME``; resolved, digest: its config and hash.
        threads: the threads this worker computes with (:func:`iclab.threads.set_threads`; None: as set).
    Returns:
        (Experiment, config).
    """
    import iclab  # noqa: F401  (float64 on, in a fresh worker)

    if threads is not None and os.environ.get("ICLAB_THREADS") != str(threads):
        from iclab.threads import set_threads

        set_threads(threads)
    exp = experiment_or_error(exp_id)
    config = exp.config.model_validate(resolved)
    again = config_hash(exp.id, config.model_dump(mode="json"))
    if again != digest:
        raise RuntimeError(f"config of {exp_id} does not round-trip on the worker (hash {again} != {digest})")
    return exp, config


def compute_point(exp_id: str, resolved: dict, digest: str, running_dir: str | None = None,
                  checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
                  driver_host: str | None = None, threads: int | None = None) -> dict:
    """:func:`compute` for a worker process (local pool or Ray task): rebuilds the config from its
    resolved JSON and checks that it hashes as the driver's. Checkpoints go to ``running_dir`` on
    the worker's file system; a worker on another host than the driver removes them once done
    (the driver stores the result and cannot see them).

    Args:
        exp_id: the experiment's id or ``path.py:NAME``; resolved, digest: its config and hash.
        running_dir: the in-progress folder for checkpoints (None: none).
        checkpoint_every, checkpoint_seconds: the checkpoint interval.
        driver_host: the sweep driver's host name.
        threads: the threads this worker computes with (:func:`iclab.threads.set_threads`; None: as set).
    Returns:
        The payload of :func:`compute`.
    """
    exp, config = worker_config(exp_id, resolved, digest, threads)
    if running_dir is not None:
        try:
            Path(running_dir).parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # no such results root on this node: run without checkpoints
            running_dir = None
    payload = compute(exp, config, running_dir=running_dir, checkpoint_every=checkpoint_every,
                      checkpoint_seconds=checkpoint_seconds)
    if running_dir is not None and driver_host is not None and driver_host != socket.gethostname():
        shutil.rmtree(running_dir, ignore_errors=True)
    return payload


def store_payload(store: Store, exp_id: str, digest: str, preset: str, resolved: dict, payload: dict, *,
                  row: int | None = None, started: float | None = None) -> Path:
    """Writes a computed payload as the run's folder (atomically) and returns its path.

    Args:
        store: the result store; exp_id, digest, preset, resolved: the run's identity and config.
        payload: what :func:`compute` returned; its ``ended`` is set to the time recorded in the folder.
        row, started: the run's index row and start time, recorded in ``metrics.json`` so that
            ``iclab index rebuild`` restores the row as it was.
    """
    checks = payload["checks"]
    n_pass = sum(c["passed"] for c in checks)
    status = payload["status"]
    log = [f"iclab {__version__} run of {exp_id} (preset {preset}), config hash {digest}",
           f"stored {time.strftime('%Y-%m-%d %H:%M:%S')}, computed on {payload.get('host', '?')}"]
    log += [f"resumed: {note}" for note in payload.get("resumed", [])]
    log += [f"wall time {payload['wall_s']:.2f} s"]
    if status == "diverged":
        log += [f"DIVERGED: {payload['diverged']['message']}; the finite part of the trajectory is stored"]
    log += [f"checks passed {n_pass}/{len(checks)}"]
    log += [f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: measured {c['measured']!r}, "
            f"expected {c['expected']!r} ({c['comparison']}, tol {c['tolerance']!r})" for c in checks]
    metrics = {"experiment": exp_id, "preset": preset, "config_hash": digest, "version": __version__,
               "status": status, "wall_s": payload["wall_s"],
               "passed": status == "done" and n_pass == len(checks), "checks": checks}
    if payload.get("diverged") is not None:
        metrics["diverged"] = payload["diverged"]
    if payload.get("resumed"):
        metrics["resumed"] = payload["resumed"]
    if payload.get("sharded"):
        metrics["sharded"] = payload["sharded"]
        sh = payload["sharded"]
        log.insert(2, f"sharded: {sh['shards']} shards on the {sh['executor']} executor ({sh['computed']} computed "
                      f"now, {sh['reused']} reused from the shard cache)")
    payload["ended"] = time.time()
    metrics["index"] = {"id": row, "started": started, "ended": payload["ended"]}
    return store.write(exp_id, digest, {
        "config.json": {"experiment": exp_id, "preset": preset, "config": resolved,
                        **({"source": _USER_SOURCES[exp_id]} if exp_id in _USER_SOURCES else {})},
        "trajectories.npz": payload["arrays"],
        "figure.png": payload["figure_png"],
        "figure.pdf": payload["figure_pdf"],
        "log.txt": "\n".join(log) + "\n",
        "metrics.json": metrics,
    })


def end_row(store: Store, row: int, payload: dict) -> None:
    """Closes a run's index row from its payload: done or diverged, wall time, checks."""
    checks = payload["checks"]
    div = payload.get("diverged")
    store.end(row, payload["status"], payload["wall_s"], sum(c["passed"] for c in checks), len(checks),
              error=None if div is None else div["message"],
              diverged_step=None if div is None else div["step"],
              last_finite_loss=None if div is None else div["last_finite_loss"], ended=payload.get("ended"))


def stored_result(exp_id: str, path: Path, resolved: dict, wall_s: float, reused: bool = True) -> RunResult:
    """The RunResult of a stored run folder.

    Args:
        exp_id: the experiment's id; path: the run folder; resolved: its resolved config;
        wall_s: the time to report; reused: whether it was reused rather than computed now.
    """
    metrics = json.loads((path / "metrics.json").read_text())
    return RunResult(exp_id, path, resolved, metrics["checks"], reused, wall_s, metrics.get("status", "done"),
                     metrics.get("diverged"), metrics.get("resumed", []), source=_USER_SOURCES.get(exp_id))


def run_experiment(
    exp_id: str,
    preset: str = "quick",
    overrides: dict | None = None,
    *,
    seeds: int | None = None,
    root: str | Path | None = None,
    force: bool = False,
    reporter: Reporter | None = None,
    checkpoint_every: int | None = None,
    checkpoint_seconds: float | None = None,
    on_wait=None,
    repair: bool = True,
    executor: str | None = None,
    workers: int | None = None,
    address: str | None = None,
    retries: int = 2,
) -> RunResult:
    """Runs (or reuses) one experiment and stores it; see the module docstring. ``iclab run`` is this call.

    Args:
        exp_id: a registered id (``linattn.fig1``) or ``path/to/file.py:NAME`` (an experiment defined in a
            file of yours: :func:`load_experiment_file`).
        preset: ``quick``, ``paper`` or another preset of the experiment.
        overrides: config fields to set, {field: value}.
        seeds: number of seeds (overrides the config's ``seeds``).
        root: results root (default ``$ICLAB_RESULTS`` or ``./iclab-results``).
        force: recompute even if a stored result exists.
        reporter: progress reporter (default silent).
        checkpoint_every, checkpoint_seconds: checkpoint interval (chunks, seconds); defaults from
            ``ICLAB_CHECKPOINT_EVERY`` / ``ICLAB_CHECKPOINT_SECONDS``; 0 chunks turns them off.
        on_wait: called (no arguments) if another process is computing this run and we wait for it.
        repair: a stored result that fails its verification (:meth:`iclab.store.Store.verify`) is moved
            to ``.damaged/`` and recomputed; with False it is reported (:class:`RunDamaged`) instead.
        executor: None (the default): the experiment's ``run`` in this process. ``local`` or ``ray``: its
            shards (:mod:`iclab.shards`) as separate tasks on a process pool or a Ray cluster, each cached
            as it finishes (a killed run, run again, computes only the missing shards), then assembled and
            stored as one run. The config hash, hence the stored result, does not depend on the executor:
            the assembled arrays equal the unsharded run's to float rounding.
        workers: shards computed at once (local default: one per core, 1 runs in this process; ray
            default: the cluster's CPUs); only with ``executor``.
        address: the Ray cluster (``auto``, default, or ``host:port``); only with ``executor="ray"``.
        retries: times a shard whose worker died is retried.
    Returns:
        The :class:`RunResult`: ``result.arrays["loss"]``, ``result.checks``, ``result.figure()``, ``result.path``.
    Raises:
        UserError: bad input (one line; nothing written), e.g. ``executor`` for an experiment without shards.
    """
    from iclab.shards import check_options, shard_names

    check_options(executor, workers, address, retries)
    exp, config = resolve_config(exp_id, preset, overrides, seeds)
    if executor is not None:
        shard_names(exp, config)
    every, seconds = checkpoint_settings(checkpoint_every, checkpoint_seconds)
    resolved = config.model_dump(mode="json")
    digest = config_hash(exp.id, resolved)
    store = Store(results_root(root))
    start = time.perf_counter()
    reuse = None if force else _reusable(store, exp.id, digest, repair)
    if reuse is not None:
        return stored_result(exp.id, reuse, resolved, time.perf_counter() - start)

    lock = store.lock(exp.id, digest)
    if not lock.acquire(blocking=False):
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        reuse = None if force else _reusable(store, exp.id, digest, repair)
        if reuse is not None:  # computed by the process we waited for
            return stored_result(exp.id, reuse, resolved, time.perf_counter() - start)
        store.mark_interrupted(exp.id, digest)
        running = store.running_dir(exp.id, digest)
        if force:
            shutil.rmtree(running, ignore_errors=True)
        started = time.time()
        row = store.begin(exp.id, digest, preset, resolved, started=started)
        try:
            if executor is None:
                payload = compute(exp, config, running_dir=running, checkpoint_every=every,
                                  checkpoint_seconds=seconds, reporter=reporter)
            else:
                payload = _compute_sharded(exp, config, digest, store, executor=executor, address=address,
                                           workers=workers, retries=retries, checkpoint_every=every,
                                           checkpoint_seconds=seconds, reporter=reporter)
            path = store_payload(store, exp.id, digest, preset, resolved, payload, row=row, started=started)
        except BaseException as err:
            _end_failed(store, row, err, time.perf_counter() - start)
            raise
        end_row(store, row, payload)
        shutil.rmtree(running, ignore_errors=True)
    finally:
        lock.release()
    return RunResult(exp.id, path, resolved, payload["checks"], False, payload["wall_s"], payload["status"],
                     payload["diverged"], payload["resumed"], source=_USER_SOURCES.get(exp.id),
                     _arrays=payload["arrays"])


def _compute_sharded(exp, config, digest: str, store: Store, *, reporter, **options) -> dict:
    """:func:`compute` with the arrays from the run's shards (:func:`iclab.shards.run_shards`); the payload
    records how the run was sharded (``sharded``) and which shards were reused or resumed (``resumed``)."""
    from iclab.shards import run_shards

    info: dict = {}
    payload = compute(exp, config, reporter=reporter,
                      run=lambda cfg, rep: run_shards(exp, cfg, digest, store, reporter=rep, info=info, **options))
    notes = list(info.pop("resumed", []))
    if info.get("reused"):
        notes.insert(0, f"{info['reused']} of {info['shards']} shards reused from the shard cache of an earlier run")
    payload["resumed"] = notes + payload["resumed"]
    payload["sharded"] = info
    return payload


def interruption_note(err: BaseException) -> str | None:
    """The index's error text of a run stopped by the user or the system (None for other errors)."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (Ctrl-C); run the same command to resume"
    if isinstance(err, SystemExit):
        return f"interrupted (exit {err.code}); run the same command to resume"
    return None


def _end_failed(store: Store, row: int, err: BaseException, wall_s: float) -> None:
    """Closes the row of a run that raised; a store that cannot be written (a full disk) leaves it
    ``running``, which later commands show as interrupted (its lock is free)."""
    note = interruption_note(err)
    try:
        store.end(row, "interrupted" if note else "failed", wall_s,
                  error=note or f"{type(err).__name__}: {' '.join(str(err).split())}")
    except Exception:  # noqa: BLE001 - keep the original error, not the index's
        pass


def _reusable(store: Store, exp_id: str, digest: str, repair: bool) -> Path | None:
    """The stored folder of this run if it is intact (indexing it again if the index lost it); a damaged
    one is moved to ``.damaged/`` and recomputed, or with ``repair=False`` reported (UserError)."""
    problems = store.damaged(exp_id, digest)
    if problems:
        folder = store.run_dir(exp_id, digest)
        if not repair:
            raise RunDamaged(f"the stored result {folder} is damaged ({'; '.join(problems)}); run without "
                             "--no-repair to recompute it (the damaged folder is kept in .damaged/)")
        store.set_aside(folder)
        return None
    path = store.finished(exp_id, digest)
    if path is not None and not store.indexed(exp_id, digest):
        store.index_folder(path)
    return path


def results_root(root: str | os.PathLike | None = None, *, option: str = "--out") -> Path:
    """The results root to write into, checked before any work: one line (UserError) when it is empty,
    names a file or lies under one, or is not writable.

    Args:
        root: the folder given (None: ``$ICLAB_RESULTS`` or ``./iclab-results``).
        option: how the user gave it, named in the error (``--out``, ``--results``).
    Returns:
        The root as a Path (not created yet if it does not exist).
    """
    from iclab.store import default_root

    if root is None:
        env = os.environ.get("ICLAB_RESULTS")
        return writable_folder(env, "ICLAB_RESULTS") if env is not None else writable_folder(default_root(), "the "
                                                                                             "default results root")
    return writable_folder(root, option)


def writable_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder that exists or can be created, and can be written into; UserError otherwise.

    Args:
        path: the folder; what: how the user gave it (named in the error).
    """
    text = os.fspath(path)
    if not str(text).strip():
        raise UserError(f"{what} is empty: name a folder")
    folder = Path(text).expanduser()
    _check_writable(folder, folder, what, "a folder")
    return folder


def writable_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a file that can be written (its folder exists or can be created); UserError otherwise.

    Args:
        path: the file; what: how the user gave it (named in the error).
    """
    text = os.fspath(path)
    if not str(text).strip():
        raise UserError(f"{what} is empty: name a file")
    file = Path(text).expanduser()
    if file.is_dir():
        raise UserError(f"{what} {file} is a folder: name a file")
    _check_writable(file.parent, file, what, "a file")
    return file


def _check_writable(folder: Path, given: Path, what: str, kind: str) -> None:
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "names a file" if probe == given else f"lies under the file {probe}"
        raise UserError(f"{what} {given} {where}: name {kind}")
    try:  # the only reliable test of writability (read-only mounts, permissions, root included)
        fd, name = tempfile.mkstemp(prefix=".iclab-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise UserError(f"{what} {given} is not writable ({err.strerror or err})") from None


def _figure_bytes(fig) -> tuple[bytes, bytes]:
    import matplotlib.pyplot as plt

    png, pdf = io.BytesIO(), io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=130)
        fig.savefig(pdf, format="pdf")
    finally:
        plt.close(fig)
    return png.getvalue(), pdf.getvalue()


def _flat_arrays(tree) -> dict[str, np.ndarray]:
    """A pytree of arrays as flat npz entries ("params['W']" style keys for nested leaves)."""
    import jax

    out = {}
    for key, value in dict(tree).items():
        leaves = jax.tree_util.tree_flatten_with_path(value)[0]
        if len(leaves) == 1 and not leaves[0][0]:
            out[key] = np.asarray(value)
        else:
            for path, leaf in leaves:
                out[f"{key}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


def _diverged_figure(exp_id: str, arrays: dict, message: str):
    """The finite part of a diverged run's loss, on a log scale (a note when the first record diverged)."""
    from iclab.experiments._plot import COLORS, figure

    fig, axes = figure(width=6.0)
    ax = axes[0, 0]
    loss = np.asarray(arrays.get("loss", np.zeros(0)), dtype=float)
    loss = loss.reshape(-1, loss.shape[-1]) if loss.ndim and loss.size else np.zeros((0, 0))
    step = np.asarray(arrays.get("step", np.zeros(0)), dtype=float)
    use_step = step.size == loss.shape[-1] and step.size > 0 and np.all(np.isfinite(step))
    t = np.asarray(arrays.get("t", np.zeros(0)), dtype=float).reshape(-1)
    x = step if use_step else (t if t.size == loss.shape[-1] else np.arange(loss.shape[-1]))
    with np.errstate(divide="ignore"):
        for curve in loss:  # log10 on a linear axis: near-overflow values break a log axis's margins
            ax.plot(x, np.log10(np.abs(curve)), color=COLORS[3], lw=1.2)
    if loss.shape[-1] == 0:
        ax.text(0.5, 0.5, "the loss was not finite at the first record:\nno finite trajectory to plot",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    ax.set_xlabel("step" if use_step else "t")
    ax.set_ylabel("log₁₀ |loss| (finite part)")
    ax.set_title(f"{exp_id} diverged: {message}", fontsize=7)
    return fig
