"""The one launcher: resolve an experiment's config, run it (or reuse the stored result), check,
plot and store. Everything ``iclab run`` does is a call of :func:`run_experiment`; ``iclab sweep``
(:mod:`iclab.sweep`) runs the same :func:`compute_point` on workers and stores what they return.

A run takes its lock in the store (one process computes a given config at a time; a second one
waits and reuses the result), checkpoints its engine loops in its in-progress folder (a killed run
resumes from there, see :mod:`iclab.checkpoint`), and ends ``done``, ``diverged`` (the loss became
NaN or infinite: the finite part of the trajectory is stored), or ``failed`` (an exception).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
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


@dataclass
class RunResult:
    """What a run produced: its folder, checks, whether it was reused, and its wall time."""

    experiment: str
    path: Path
    config: dict
    checks: list[dict]
    reused: bool
    wall_s: float
    status: str = "done"
    diverged: dict | None = None
    resumed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "done" and all(c["passed"] for c in self.checks)

    def as_dict(self) -> dict:
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
        return out


def experiment_or_error(exp_id: str):
    try:
        return get_experiment(exp_id)
    except KeyError:
        known = ", ".join(all_experiments())
        raise UserError(f"unknown experiment {exp_id!r}; known: {known}") from None


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


def describe_validation_error(err: ValidationError, config_cls) -> str:
    """One line naming each bad field, what is allowed, and what was given."""
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
            parts.append(f"{msg} (got {given!r})")
        elif kind == "value_error":
            message = str(ctx.get("error", e["msg"]))
            parts.append(f"{field}: {message} (got {given!r})" if e["loc"] else message)
        else:
            parts.append(f"{field}: {e['msg'].lower()} (got {given!r})")
    return "; ".join(parts)


def resolve_config(exp_id: str, preset: str = "quick", overrides: dict | None = None, seeds: int | None = None):
    """The validated config of ``exp_id`` at ``preset`` with overrides; UserError if invalid."""
    exp = experiment_or_error(exp_id)
    if preset not in exp.presets:
        raise UserError(f"preset must be one of {', '.join(exp.presets)} (got {preset!r})")
    overrides = dict(overrides or {})
    if seeds is not None:
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
    return exp, config


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
            checkpoint_seconds: float | None = None, reporter: Reporter | None = None) -> dict:
    """Runs, checks and plots one config; returns what the store needs (a picklable payload).

    With ``running_dir`` the engine loops checkpoint there and resume from what they find. A NaN or
    infinite loss ends the run as ``diverged`` with its finite trajectory; exceptions propagate.

    Returns:
        {"status": "done" | "diverged", "arrays", "checks" (dicts), "figure_png", "figure_pdf"
        (bytes), "wall_s", "resumed" (notes), "diverged" (dict or None), "host"}.
    """
    from iclab.checkpoint import RunCheckpoints
    from iclab.engines._loop import Diverged

    start = time.perf_counter()
    checkpoints = None
    if running_dir is not None:
        checkpoints = RunCheckpoints(running_dir, checkpoint_every, checkpoint_seconds)
    run_reporter = RunReporter(reporter or Reporter(), checkpoints)
    payload = {"host": socket.gethostname(), "diverged": None}
    try:
        try:
            arrays = exp.run(config, run_reporter)
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


def compute_point(exp_id: str, resolved: dict, digest: str, running_dir: str | None = None,
                  checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
                  driver_host: str | None = None) -> dict:
    """:func:`compute` for a worker process (local pool or Ray task): rebuilds the config from its
    resolved JSON and checks that it hashes as the driver's. Checkpoints go to ``running_dir`` on
    the worker's file system; a worker on another host than the driver removes them once done
    (the driver stores the result and cannot see them)."""
    import iclab  # noqa: F401  (float64 on, in a fresh worker)

    exp = experiment_or_error(exp_id)
    config = exp.config.model_validate(resolved)
    again = config_hash(exp.id, config.model_dump(mode="json"))
    if again != digest:
        raise RuntimeError(f"config of {exp_id} does not round-trip on the worker (hash {again} != {digest})")
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


def store_payload(store: Store, exp_id: str, digest: str, preset: str, resolved: dict, payload: dict) -> Path:
    """Writes a computed payload as the run's folder (atomically) and returns its path."""
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
    return store.write(exp_id, digest, {
        "config.json": {"experiment": exp_id, "preset": preset, "config": resolved},
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
              last_finite_loss=None if div is None else div["last_finite_loss"])


def stored_result(exp_id: str, path: Path, resolved: dict, wall_s: float, reused: bool = True) -> RunResult:
    """The RunResult of a stored run folder."""
    metrics = json.loads((path / "metrics.json").read_text())
    return RunResult(exp_id, path, resolved, metrics["checks"], reused, wall_s, metrics.get("status", "done"),
                     metrics.get("diverged"), metrics.get("resumed", []))


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
) -> RunResult:
    """Runs (or reuses) one experiment and stores it; see the module docstring.

    Args:
        checkpoint_every, checkpoint_seconds: checkpoint interval (chunks, seconds); defaults from
            ``ICLAB_CHECKPOINT_EVERY`` / ``ICLAB_CHECKPOINT_SECONDS``; 0 chunks turns them off.
        on_wait: called (no arguments) if another process is computing this run and we wait for it.
    """
    exp, config = resolve_config(exp_id, preset, overrides, seeds)
    every, seconds = checkpoint_settings(checkpoint_every, checkpoint_seconds)
    resolved = config.model_dump(mode="json")
    digest = config_hash(exp.id, resolved)
    store = Store(root)
    start = time.perf_counter()
    existing = store.finished(exp.id, digest)
    if existing is not None and not force:
        return stored_result(exp.id, existing, resolved, time.perf_counter() - start)

    lock = store.lock(exp.id, digest)
    if not lock.acquire(blocking=False):
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        existing = store.finished(exp.id, digest)
        if existing is not None and not force:  # computed by the process we waited for
            return stored_result(exp.id, existing, resolved, time.perf_counter() - start)
        store.mark_interrupted(exp.id, digest)
        running = store.running_dir(exp.id, digest)
        if force:
            shutil.rmtree(running, ignore_errors=True)
        row = store.begin(exp.id, digest, preset, resolved)
        try:
            payload = compute(exp, config, running_dir=running, checkpoint_every=every, checkpoint_seconds=seconds,
                              reporter=reporter)
            path = store_payload(store, exp.id, digest, preset, resolved, payload)
        except BaseException as err:
            status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
            store.end(row, status, time.perf_counter() - start, error=f"{type(err).__name__}: {err}")
            raise
        end_row(store, row, payload)
        shutil.rmtree(running, ignore_errors=True)
    finally:
        lock.release()
    return RunResult(exp.id, path, resolved, payload["checks"], False, payload["wall_s"], payload["status"],
                     payload["diverged"], payload["resumed"])


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
    """The finite part of a diverged run's loss, on a log scale."""
    from iclab.experiments._plot import COLORS, figure

    fig, axes = figure(width=6.0)
    ax = axes[0, 0]
    loss = np.asarray(arrays.get("loss", np.zeros(0)))
    loss = loss.reshape(-1, loss.shape[-1]) if loss.ndim else loss.reshape(1, 1)
    use_step = "step" in arrays and np.all(np.isfinite(arrays["step"]))
    x = arrays["step"] if use_step else arrays.get("t", np.arange(loss.shape[-1]))
    with np.errstate(divide="ignore"):
        for curve in loss:  # log10 on a linear axis: near-overflow values break a log axis's margins
            ax.plot(x, np.log10(np.abs(curve)), color=COLORS[3], lw=1.2)
    ax.set_xlabel("step" if use_step else "t")
    ax.set_ylabel("log₁₀ |loss| (finite part)")
    ax.set_title(f"{exp_id} diverged: {message}", fontsize=7)
    return fig
