"""The experiment registry: an experiment is a config, a run, checks and a plot.

``run(config, reporter) -> dict[str, np.ndarray]`` computes arrays (saved as npz);
``checks(config, arrays) -> list[Check]`` and ``plot(config, arrays) -> Figure`` work from the
arrays alone, so a stored result can be checked and re-plotted without recomputing.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable


from iclab.experiments._config import ExperimentConfig
from iclab.experiments.checks import Check  # noqa: F401  (re-exported)
from iclab.fields import flat_fields, flat_values
from iclab.names import check_name


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
        memory: ``memory(config) -> (bytes, what)``: an estimate of the run's largest memory need and
            what it is (e.g. "the P·N·D float64 prompts"), checked against the memory limit before
            anything runs (optional; see :func:`iclab.launch.memory_limit`).
        shards, run_shard, assemble: the figure's shards (optional; all three or none), for
            ``iclab run EXP --executor local|ray`` (:mod:`iclab.shards`). A shard is an independent part
            of the figure: a set of its arrays' entries (e.g. gating.fig1's panel × block of n̄) whose
            computation reads nothing of the other shards' (its models' init and data keys are functions
            of (seed, member id, step) only, :mod:`iclab.engines.joint`), so that

                run(config) = assemble(config, {s: run_shard(config, s) for s in shards(config)})

            to float rounding (the reductions of a smaller grid may group their sums differently).
            ``shards(config) -> list[str]``: the shard names of a resolved config (distinct, stable,
            letters, digits, ``_ . = -`` only); ``run_shard(config, name, reporter) -> dict[str, array]``:
            one shard's arrays; ``assemble(config, {name: arrays}, reporter) -> dict[str, array]``: the
            arrays ``run`` would return, from every shard's (it may compute cheap shared things, e.g.
            closed forms). ``run`` stays the whole grid in one process (the efficient form on one machine).
        extensions: ``extensions(config) -> list``: the objects from outside the experiment's own modules that a
            resolved config uses by name (e.g. a drift family of one's own named in ``lab.drift_families``'s
            ``families``: :func:`iclab.experiments.lab.drift_families.register_drift_family`). Their code and
            values enter the run's key (:func:`iclab.provenance.code_identity`), so that editing a registered
            extension computes again instead of serving the old one's result (optional).
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
    memory: Callable | None = None
    shards: Callable | None = None
    run_shard: Callable | None = None
    assemble: Callable | None = None
    extensions: Callable | None = None

    @property
    def builtin(self) -> bool:
        """Whether this is one of iclab's own experiments (defined in a module of :mod:`iclab.experiments`)."""
        return getattr(self.run, "__module__", "").startswith("iclab.experiments.")

    @property
    def sharded(self) -> bool:
        """Whether the experiment declares shards (``iclab run --executor`` can split it)."""
        return self.shards is not None

    def resolve(self, preset: str, overrides: dict | None = None) -> ExperimentConfig:
        """The config of a preset with field overrides applied (validated).

        Args:
            preset: a preset name (``quick``, ``paper``, ...); overrides: {field: value}, a settings group's
                fields by their dotted names (``{"transformer.width": 64}``) or the group whole.
        Raises:
            pydantic.ValidationError: an override out of its field's range.
        """
        values = flat_values(self.config, self.presets[preset])   # a group's single fields set one by one
        values.update(flat_values(self.config, overrides or {}))
        return self.config(**values)


_REGISTRY: dict[str, Experiment] = {}
#: The folder of :mod:`iclab.experiments`, whose modules and paper packages register the built-in experiments.
_PACKAGE_DIR = Path(__file__).parent


def register(experiment: Experiment, *, replace: bool = False) -> Experiment:
    """Adds an experiment to the registry.

    Args:
        experiment: the experiment; its id (letters, digits, ``_ . -``: :mod:`iclab.names`) must be new unless
            ``replace``; an experiment defined outside iclab may not take an id in the namespace of iclab's own
            papers (``linattn.…``): the store would take its results for the built-in ones.
        replace: allow replacing an experiment of the same id (a notebook cell run again).
    Returns:
        The experiment.
    Raises:
        ValueError: one line naming what is wrong.
    """
    check_name(experiment.id, "experiment id")
    if experiment.id in _REGISTRY and (not replace or _REGISTRY[experiment.id].builtin != experiment.builtin):
        raise ValueError(f"experiment {experiment.id} registered twice")
    paper = experiment.id.partition(".")[0]
    if not experiment.builtin and paper in paper_packages():
        raise ValueError(f"experiment id {experiment.id!r} lies in the namespace of iclab's own {paper!r} "
                         "experiments; give it an id of its own (e.g. 'user.…')")
    for name in experiment.presets:
        check_name(name, f"experiment {experiment.id}: preset")
    for required in ("quick", "paper"):
        if required not in experiment.presets:
            raise ValueError(f"experiment {experiment.id} lacks the {required!r} preset")
    for key, values in (experiment.grid or {}).items():
        if key not in flat_fields(experiment.config) or not isinstance(values, list) or not values:
            raise ValueError(f"experiment {experiment.id}: grid entry {key!r} must name a config field "
                             "and give a non-empty list of values")
    declared = [name for name in ("shards", "run_shard", "assemble") if getattr(experiment, name) is not None]
    if declared and len(declared) != 3:
        raise ValueError(f"experiment {experiment.id}: shards, run_shard and assemble go together (got only "
                         f"{', '.join(declared)})")
    _REGISTRY[experiment.id] = experiment
    return experiment


def paper_packages() -> set[str]:
    """The paper packages of :mod:`iclab.experiments` (``linattn``, ``gating``, ...)."""
    return {m.name for m in pkgutil.iter_modules([str(_PACKAGE_DIR)]) if m.ispkg and not m.name.startswith("_")}


def unregister(exp_id: str) -> None:
    """Removes an experiment from the registry (nothing if it is not registered).

    Args:
        exp_id: the experiment's id.
    """
    _REGISTRY.pop(exp_id, None)


def _discover() -> None:
    # Every public module of this package registers its experiments on import: adding an
    # experiment is adding a file.
    for mod in pkgutil.iter_modules([str(_PACKAGE_DIR)]):
        if not mod.name.startswith("_"):
            importlib.import_module(f"iclab.experiments.{mod.name}")


def all_experiments() -> dict[str, Experiment]:
    """Every registered experiment, by id, in registration order."""
    _discover()
    return dict(_REGISTRY)


def get_experiment(exp_id: str) -> Experiment:
    """The experiment with this id; KeyError if none.

    Args:
        exp_id: ``paper.name``, e.g. ``linattn.fig1``.

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
