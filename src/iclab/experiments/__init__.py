"""Registered figure and table reproductions; see :func:`all_experiments`."""

from iclab.experiments._config import ExperimentConfig, param
from iclab.experiments._registry import (
    Check,
    Experiment,
    all_experiments,
    check_abs,
    check_at_most,
    check_equal,
    check_rel,
    get_experiment,
    register,
)

__all__ = [
    "Check",
    "Experiment",
    "ExperimentConfig",
    "all_experiments",
    "check_abs",
    "check_at_most",
    "check_equal",
    "check_rel",
    "get_experiment",
    "param",
    "register",
]
