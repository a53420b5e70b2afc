"""The one launcher: resolve an experiment's config, run it (or reuse the stored result), check,
plot and store. Everything the CLI does is a call of :func:`run_experiment`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from iclab import __version__
from iclab.experiments import Check, get_experiment
from iclab.experiments._registry import all_experiments
from iclab.progress import Reporter
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

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)

    def as_dict(self) -> dict:
        return {
            "experiment": self.experiment,
            "path": str(self.path),
            "reused": self.reused,
            "wall_s": self.wall_s,
            "passed": self.passed,
            "checks": self.checks,
            "config": self.config,
        }


def experiment_or_error(exp_id: str):
    try:
        return get_experiment(exp_id)
    except KeyError:
        known = ", ".join(all_experiments())
        raise UserError(f"unknown experiment {exp_id!r}; known: {known}") from None


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
        return exp, exp.resolve(preset, overrides)
    except ValidationError as err:
        raise UserError(f"{exp_id}: {describe_validation_error(err, exp.config)}") from None


def run_experiment(
    exp_id: str,
    preset: str = "quick",
    overrides: dict | None = None,
    *,
    seeds: int | None = None,
    root: str | Path | None = None,
    force: bool = False,
    reporter: Reporter | None = None,
) -> RunResult:
    """Runs (or reuses) one experiment and stores it; see the module docstring."""
    exp, config = resolve_config(exp_id, preset, overrides, seeds)
    resolved = config.model_dump(mode="json")
    digest = config_hash(exp.id, resolved)
    store = Store(root)
    start = time.perf_counter()
    existing = store.finished(exp.id, digest)
    if existing is not None and not force:
        metrics = json.loads((existing / "metrics.json").read_text())
        return RunResult(exp.id, existing, resolved, metrics["checks"], True, time.perf_counter() - start)

    row = store.begin(exp.id, digest, preset)
    log = [f"iclab {__version__} run of {exp.id} (preset {preset}), config hash {digest}",
           f"started {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    try:
        arrays = exp.run(config, reporter or Reporter())
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        checks: list[Check] = exp.checks(config, arrays)
        fig = exp.plot(config, arrays)
        wall = time.perf_counter() - start
        check_dicts = [c.as_dict() for c in checks]
        n_pass = sum(c["passed"] for c in check_dicts)
        log += [f"wall time {wall:.2f} s", f"checks passed {n_pass}/{len(check_dicts)}"]
        log += [f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: measured {c['measured']!r}, "
                f"expected {c['expected']!r} ({c['comparison']}, tol {c['tolerance']!r})" for c in check_dicts]
        metrics = {"experiment": exp.id, "preset": preset, "config_hash": digest, "version": __version__,
                   "wall_s": wall, "passed": n_pass == len(check_dicts), "checks": check_dicts}
        path = store.write(exp.id, digest, {
            "config.json": {"experiment": exp.id, "preset": preset, "config": resolved},
            "trajectories.npz": arrays,
            "figure.png": lambda p: fig.savefig(p, dpi=130),
            "figure.pdf": lambda p: fig.savefig(p),
            "log.txt": "\n".join(log) + "\n",
            "metrics.json": metrics,
        })
        import matplotlib.pyplot as plt

        plt.close(fig)
    except BaseException as err:
        store.end(row, "failed", time.perf_counter() - start, error=f"{type(err).__name__}: {err}")
        raise
    store.end(row, "done", wall, n_pass, len(check_dicts))
    return RunResult(exp.id, path, resolved, check_dicts, False, wall)
