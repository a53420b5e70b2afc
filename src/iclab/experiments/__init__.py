"""Registered figure and table reproductions, and what a user needs to write their own.

An experiment (:class:`Experiment`) is a config class (:class:`ExperimentConfig`, fields built with
:func:`param`, taken from an engine's specification with :func:`engine_fields`, sweep grids of an engine
field made with :func:`engine_grid`, or a model's or task's settings object held whole with :func:`nested`), named
presets, and three functions: ``run(config, reporter) -> arrays``,
``checks(config, arrays) -> [Check]`` (:mod:`iclab.experiments.checks`) and ``plot(config, arrays) -> Figure``.
:func:`register` adds one to the registry that ``iclab run`` reads; a file outside the package runs with
``iclab run path/to/file.py:NAME``.
"""

from iclab.experiments import checks
from iclab.experiments._config import ExperimentConfig, engine_fields, engine_grid, nested, param, setting
from iclab.experiments._registry import (
    Experiment,
    all_experiments,
    get_experiment,
    paper_packages,
    register,
    unregister,
)
from iclab.experiments.checks import Check, check_abs, check_at_least, check_at_most, check_equal, check_rel

__all__ = [
    "Check",
    "Experiment",
    "ExperimentConfig",
    "all_experiments",
    "check_abs",
    "check_at_least",
    "check_at_most",
    "check_equal",
    "check_rel",
    "checks",
    "engine_fields",
    "engine_grid",
    "get_experiment",
    "nested",
    "paper_packages",
    "param",
    "register",
    "setting",
    "unregister",
]
