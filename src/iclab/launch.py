"""The run API: :func:`run_experiment` resolves an experiment's config, runs it (or reuses the stored
result), checks, plots and stores it. Everything ``iclab run`` does is a call of :func:`run_experiment`;
``iclab sweep`` (:mod:`iclab.sweep`) runs the same pipeline's :func:`iclab.runner.compute_point` on
workers and stores what they return.

This module is the thin layer a user calls: it checks the arguments, resolves the config, and hands the
run to :func:`iclab.runner.run_point` (the pipeline of one run: identity, reuse, lock, compute, store,
failure), computing it in this process or, with ``executor``, as shards (:mod:`iclab.shards`).

A run is keyed by its config **and its code** (:mod:`iclab.provenance`): a stored result is reused only
when the experiment id, the resolved config, iclab's version and the code identity all match, and a
rerun after a code change computes again and says why the stored result was not reused
(:attr:`RunResult.recomputed`).

A run takes its lock in the store (one process computes a given run at a time; a second one waits and
reuses the result), checkpoints its engine loops in its in-progress folder (a killed run resumes from
there, see :mod:`iclab.checkpoint`), and ends ``done``, ``diverged`` (the loss became NaN or infinite:
the finite part of the trajectory is stored), or ``failed``: its folder then holds ``error.txt`` with the
traceback. An exception raised by a user's experiment code is :class:`iclab.errors.RunFailed` (one line
pointing at ``error.txt``; the CLI exits 3); one raised by iclab's own experiments keeps its traceback.

The names of :mod:`iclab.runner` and :mod:`iclab.errors` that were always imported from here
(:class:`RunResult`, :func:`resolve_config`, :func:`load_experiment_file`, :class:`UserError`,
:class:`RunDamaged`, ...) are importable from here as well.
"""

from __future__ import annotations

import json
from pathlib import Path

from iclab import settings
from iclab.errors import ConfigError, ExperimentError, RunDamaged, RunFailed, StoreError, UserError
from iclab.experiments import all_experiments
from iclab.ops import use_backend
from iclab.progress import Reporter
from iclab.runner import (
    ExperimentRaised,
    RunIdentity,
    RunResult,
    builtin_experiment,
    call_experiment,
    check_api_arguments,
    checked_arrays,
    checked_checks,
    checked_figure,
    check_backend,
    checkpoint_settings,
    code_of,
    compute,
    compute_point,
    describe_validation_error,
    end_row,
    experiment_info,
    experiment_or_error,
    experiment_ref,
    identify,
    interruption_note,
    is_file_reference,
    load_experiment_file,
    memory_limit,
    not_reused,
    resolve_config,
    results_root,
    run_point,
    shorten,
    store_failure,
    store_payload,
    stored_figure,
    stored_result,
    worker_config,
    writable_file,
    writable_folder,
)
from iclab.shards import check_options, compute_sharded, shard_names
from iclab.store import Store

__all__ = [
    # the run API
    "run_experiment", "parse_assignment", "parse_assignments", "path_overrides",
    # re-exported: imported from here by older code
    "ConfigError", "ExperimentError", "ExperimentRaised", "RunDamaged", "RunFailed", "RunIdentity", "RunResult",
    "StoreError", "UserError", "builtin_experiment", "call_experiment", "checked_arrays", "checked_checks",
    "checked_figure", "checkpoint_settings", "code_of", "compute", "compute_point", "describe_validation_error",
    "end_row", "experiment_info", "experiment_or_error", "experiment_ref", "identify", "interruption_note",
    "is_file_reference", "load_experiment_file", "memory_limit", "not_reused", "resolve_config", "results_root",
    "shorten", "store_failure", "store_payload", "stored_figure", "stored_result", "worker_config", "writable_file",
    "writable_folder",
]


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
            raise ConfigError(f"{flag} applies only to experiments with a {key} field ({', '.join(users) or 'none'}); "
                            f"{exp_id} has none")
    return given


def parse_assignment(text: str) -> tuple[str, object]:
    """``key=value`` with the value read as JSON when it parses (numbers, lists, null, true),
    as a comma-separated list when it has commas, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value (got {text!r})")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key:
        raise ConfigError(f"--set expects key=value (got {text!r})")
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


def parse_assignments(texts: list[str] | None) -> dict:
    """Several ``key=value`` options as a dict; a key given twice is a UserError (not last-wins).

    Args:
        texts: the ``--set`` options.
    """
    out: dict = {}
    for text in texts or []:
        key, value = parse_assignment(text)
        if key in out:
            raise ConfigError(f"--set {key} is given twice ({shorten(out[key])} and {shorten(value)})")
        out[key] = value
    return out


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
    backend: str = "auto",
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
            stored as one run. The run key, hence the stored result, does not depend on the executor:
            the assembled arrays equal the unsharded run's to float rounding.
        workers: shards computed at once (local default: one per core, 1 runs in this process; ray
            default: the cluster's CPUs); only with ``executor``.
        address: the Ray cluster (``auto``, default, or ``host:port``); only with ``executor="ray"``.
        retries: times a shard whose worker died is retried.
        backend: ``auto`` (the default: the compiled kernels of :mod:`iclab.ops` on a CPU, XLA on an
            accelerator), ``native`` or ``xla``. A run option, never a paper setting: it enters the run key (the
            backends agree to float rounding, and a compiled sampler draws from another generator), and the run
            records it.
    Returns:
        The :class:`RunResult`: ``result.arrays["loss"]``, ``result.checks``, ``result.figure()``, ``result.path``.
    Raises:
        UserError: bad input (one line; nothing written), e.g. ``executor`` for an experiment without shards;
            :class:`ExperimentError` also when the experiment's ``run``/``checks``/``plot`` return the wrong type
            (the run is recorded as failed).
        RunFailed: a user's experiment raised; the run is recorded as failed, its traceback in ``error.txt``.
    """
    settings.check_environment()
    check_api_arguments(force, repair, retries)
    check_options(executor, workers, address, retries)
    chosen = check_backend(backend)
    with use_backend(chosen):  # an experiment's memory estimate may depend on the backend
        exp, config = resolve_config(exp_id, preset, overrides, seeds)
    if executor is not None:
        shard_names(exp, config)
    every, seconds = checkpoint_settings(checkpoint_every, checkpoint_seconds)
    ident = identify(exp, config, preset, backend=chosen)
    store = Store(results_root(root))

    def compute_run(running: Path) -> dict:
        if executor is None:
            return compute(exp, config, running_dir=running, checkpoint_every=every, checkpoint_seconds=seconds,
                           reporter=reporter)
        return compute_sharded(exp, config, ident.digest, store, executor=executor, address=address, backend=chosen,
                               workers=workers, retries=retries, checkpoint_every=every, checkpoint_seconds=seconds,
                               reporter=reporter)

    return run_point(store, exp, ident, compute_run, force=force, repair=repair, on_wait=on_wait)
