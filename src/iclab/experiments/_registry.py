"""The experiment registry: an experiment is a config, a run, checks and a plot.

``run(config, reporter) -> dict[str, np.ndarray]`` computes arrays (saved as npz);
``checks(config, arrays) -> list[Check]`` and ``plot(config, arrays) -> Figure`` work from the
arrays alone, so a stored result can be checked and re-plotted without recomputing.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from iclab.experiments._config import ExperimentConfig


@dataclass(frozen=True)
class Check:
    """A named comparison of a measured value with its expected value at a stated tolerance."""

    name: str
    measured: float
    expected: float
    tolerance: float
    passed: bool
    comparison: str = "abs"
    note: str = ""

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "measured": _plain(self.measured),
            "expected": _plain(self.expected),
            "tolerance": _plain(self.tolerance),
            "comparison": self.comparison,
            "passed": bool(self.passed),
            "note": self.note,
        }


def _plain(x):
    x = np.asarray(x).item() if np.ndim(x) == 0 else x
    return float(x) if isinstance(x, (float, np.floating, int, np.integer)) and not isinstance(x, bool) else x


def check_abs(name: str, measured, expected, tol: float, note: str = "") -> Check:
    """|measured − expected| ≤ tol."""
    measured, expected = float(measured), float(expected)
    return Check(name, measured, expected, tol, bool(abs(measured - expected) <= tol), "abs", note)


def check_rel(name: str, measured, expected, tol: float, note: str = "") -> Check:
    """|measured − expected| ≤ tol·|expected|."""
    measured, expected = float(measured), float(expected)
    return Check(name, measured, expected, tol, bool(abs(measured - expected) <= tol * abs(expected)), "rel", note)


def check_at_most(name: str, measured, bound: float, note: str = "") -> Check:
    """measured ≤ bound (e.g. a relative difference that must be tiny)."""
    measured = float(measured)
    return Check(name, measured, float(bound), 0.0, bool(measured <= bound), "le", note)


def check_at_least(name: str, measured, bound: float, note: str = "") -> Check:
    """measured ≥ bound (e.g. a z-score that must be large)."""
    measured = float(measured)
    return Check(name, measured, float(bound), 0.0, bool(measured >= bound), "ge", note)


def check_equal(name: str, measured, expected, note: str = "") -> Check:
    """measured == expected exactly (counts)."""
    return Check(name, float(measured), float(expected), 0.0, bool(measured == expected), "eq", note)


@dataclass
class Experiment:
    """A registered reproduction of one figure or table.

    Attributes:
        id: ``paper.figN``.
        title: one line.
        paper: the paper key (linattn, gating, drift, mhsa).
        reference: what it reproduces (figure, caption, equations).
        config: the pydantic config class.
        presets: named field overrides; must include ``quick`` and ``paper``.
        run, checks, plot: see the module docstring.
        notes: our choices, errata and unspecified settings that apply (shown by ``iclab show``).
        runtime: measured runtime per preset on the 2-core reference machine.
        grid: the figure's own sweep, field -> values, run by ``iclab sweep EXP`` when no
            ``--grid`` is given (optional).
        preflight: ``preflight(config)`` raises ValueError (one line) when what the run needs
            outside the config is missing (local model weights, data files); called before
            anything is stored (optional).
    """

    id: str
    title: str
    paper: str
    reference: str
    config: type[ExperimentConfig]
    presets: dict[str, dict]
    run: Callable
    checks: Callable
    plot: Callable
    notes: list[str] = field(default_factory=list)
    runtime: dict[str, str] = field(default_factory=dict)
    grid: dict[str, list] | None = None
    preflight: Callable | None = None

    def resolve(self, preset: str, overrides: dict | None = None) -> ExperimentConfig:
        """The config of a preset with field overrides applied (validated)."""
        values = dict(self.presets[preset])
        values.update(overrides or {})
        return self.config(**values)


_REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Adds an experiment to the registry (ids are unique)."""
    if experiment.id in _REGISTRY:
        raise ValueError(f"experiment {experiment.id} registered twice")
    for required in ("quick", "paper"):
        if required not in experiment.presets:
            raise ValueError(f"experiment {experiment.id} lacks the {required!r} preset")
    for key, values in (experiment.grid or {}).items():
        if key not in experiment.config.model_fields or not isinstance(values, list) or not values:
            raise ValueError(f"experiment {experiment.id}: grid entry {key!r} must name a config field "
                             "and give a non-empty list of values")
    _REGISTRY[experiment.id] = experiment
    return experiment


def _discover() -> None:
    # Every public module of this package registers its experiments on import: adding an
    # experiment is adding a file.
    import iclab.experiments as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"iclab.experiments.{mod.name}")


def all_experiments() -> dict[str, Experiment]:
    """Every registered experiment, by id, in registration order."""
    _discover()
    return dict(_REGISTRY)


def get_experiment(exp_id: str) -> Experiment:
    """The experiment with this id; KeyError if none.

    Ids are ``paper.name``: importing the paper's package alone registers it, which keeps a
    reused run from importing every other paper's modules (and their dependencies)."""
    paper = exp_id.partition(".")[0]
    if exp_id not in _REGISTRY and paper.isidentifier() and not paper.startswith("_"):
        try:
            importlib.import_module(f"iclab.experiments.{paper}")
        except ModuleNotFoundError as err:
            if err.name != f"iclab.experiments.{paper}":
                raise
    if exp_id in _REGISTRY:
        return _REGISTRY[exp_id]
    return all_experiments()[exp_id]
