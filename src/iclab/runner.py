"""The point pipeline: everything that computes one run (an experiment at one resolved config, a "point")
and stores it. ``iclab run`` (:func:`iclab.launch.run_experiment`), ``iclab sweep`` (:mod:`iclab.sweep`)
and sharded runs (:mod:`iclab.shards`) are layers over it; this module imports none of them.

A point goes through:

1. resolve: the experiment (:func:`experiment_or_error`: a registered id or a user's
   ``path/to/file.py:NAME``), its validated config (:func:`resolve_config`) and its identity
   (:func:`identify`: the run key of its config **and its code**, :mod:`iclab.provenance`);
2. reuse: a stored result is reused only when the experiment id, the resolved config, iclab's version
   and the code identity all match (:func:`reusable`: a damaged one is set aside and computed again);
   a rerun after a code change computes again and says why the stored result was not reused
   (:func:`not_reused`, :attr:`RunResult.recomputed`);
3. compute: run, checks and plot, with the experiment's functions held to their contract
   (:func:`compute`; on a worker process, :func:`compute_point`);
4. store: the run's folder and index row (:func:`store_payload`, :func:`end_row`), or its failure
   (:func:`store_failure`).

:func:`run_point` does steps 2-4 in this process for a given compute callable. It takes the run's lock in
the store (one process computes a given run at a time; a second one waits and reuses the result); the
run checkpoints its engine loops in its in-progress folder (a killed run resumes from there, see
:mod:`iclab.checkpoint`), and ends ``done``, ``diverged`` (the loss became NaN or infinite: the finite
part of the trajectory is stored), or ``failed``: its folder then holds ``error.txt`` with the traceback.
An exception raised by a user's experiment code is :class:`iclab.errors.RunFailed` (one line pointing at
``error.txt``; the CLI exits 3); one raised by iclab's own experiments keeps its traceback. A driver that
computes its points elsewhere (the sweep) takes the same steps with :func:`reusable`,
:func:`begin_attempt`, :func:`store_payload` and :func:`finish_attempt`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from iclab import __version__, settings
from iclab.errors import (
    ConfigError,
    ExperimentError,
    RunDamaged,
    RunFailed,
    StoreError,
    UserError,
    describe_validation_error,
    one_line,
    shorten,
)
from iclab.experiments import Check, all_experiments, get_experiment
from iclab.fields import flat_fields
from iclab.names import check_name, is_name
from iclab.ops import BACKENDS, resolve_backend, use_backend
from iclab.progress import Reporter, RunReporter
from iclab.provenance import code_identity, config_key, describe_change, environment_versions, file_sha256, run_key
from iclab.store import NPZ_ERRORS, Store, default_root, readable_root


@dataclass
class RunResult:
    """A stored run as an object: its arrays, config, checks and figure at hand.

    Returned by :func:`run_experiment` and :func:`iclab.load`; nothing here parses files by hand, and nothing
    here runs code named by the store (:meth:`figure` redraws only with code the user holds).

    Attributes:
        experiment: the experiment's id.
        path: the run's folder in the result store.
        config: the resolved config (JSON types); :meth:`config_model` gives the validated object.
        checks: the checks, as stored (dicts: name, measured, expected, tolerance, comparison, passed, note).
        reused: whether a stored result was reused instead of computed.
        wall_s: wall time of the computation (of the reuse, when reused).
        status: ``done``, ``diverged`` or ``failed``.
        diverged: where and how the loss stopped being finite (None unless diverged).
        resumed: notes of the checkpoints it resumed from.
        source: ``path/to/file.py:NAME`` for an experiment defined in a user's file, else None (a record:
            the file is never loaded from it).
        code: the code identity the run was computed by (:func:`iclab.provenance.code_identity`).
        recomputed: why a stored result of the same config was not reused (its code differed), else None.
        error: the one-line error of a failed run (its traceback is ``path / "error.txt"``).
        backend: what it computed with: ``native`` (the compiled kernels) or ``xla`` (None: not recorded).
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
    code: dict | None = None
    recomputed: str | None = None
    backend: str | None = None
    error: str | None = None
    _arrays: dict | None = field(default=None, repr=False, compare=False)
    _experiment: object = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        """True when the run finished (not diverged or failed) and every check passed."""
        return self.status == "done" and all(c["passed"] for c in self.checks)

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Every stored array (``trajectories.npz``), by name, loaded once (never unpickled)."""
        if self._arrays is None:
            if self.status == "failed":
                raise StoreError(f"{self.path.name} failed ({self.error}): it stored no arrays; its traceback is "
                                 f"{self.path / 'error.txt'}")
            try:
                with np.load(self.path / "trajectories.npz", allow_pickle=False) as data:
                    self._arrays = {k: data[k] for k in data.files}
            except NPZ_ERRORS as err:
                raise StoreError(f"{self.path / 'trajectories.npz'} cannot be read ({type(err).__name__}: "
                                 f"{one_line(err)[:120]}); `iclab verify` checks the store") from None
        return self._arrays

    @property
    def failed_checks(self) -> list[dict]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c["passed"]]

    def experiment_object(self, experiment=None):
        """The :class:`iclab.experiments.Experiment` of this run, from code the user holds: ``experiment`` (an
        Experiment, or ``path/to/file.py:NAME`` typed by the user), else the one that computed it in this
        process, else the built-in experiment of that id. Never a file named by the store.

        Args:
            experiment: the experiment object or file reference (None: as above).
        Raises:
            ExperimentError: none is at hand (a user's experiment loaded from a store: pass its file), or the
                file given is not the one the run records (another SHA-256).
        """
        from iclab.experiments import Experiment

        if experiment is None:
            if self._experiment is not None:
                return self._experiment
            builtin = builtin_experiment(self.experiment)
            if builtin is None:
                raise ExperimentError(f"{self.experiment} is not one of iclab's experiments: pass its experiment "
                                      "(the object, or path/to/file.py:NAME) to redraw it; a stored run's code is "
                                      "never loaded from the store")
            return builtin
        if isinstance(experiment, str) and is_file_reference(experiment):
            exp = load_experiment_file(experiment)
        elif isinstance(experiment, Experiment):
            exp = experiment
        else:
            raise ExperimentError(f"experiment must be an iclab Experiment or 'path/to/file.py:NAME' (got "
                                  f"{type(experiment).__name__})")
        if exp.id != self.experiment:
            raise ExperimentError(f"the experiment given is {exp.id}, the run is of {self.experiment}")
        recorded = ((self.code or {}).get("user_file") or {}).get("sha256")
        file = _user_file_of(exp)
        if recorded is not None and (file is None or file_sha256(file) != recorded):
            raise ExperimentError(f"{file or exp.id} is not the file {self.experiment} was run from (its SHA-256 "
                                  f"differs from the recorded {recorded[:12]}…): the stored figure is "
                                  "figure(); rerun the experiment to redraw it with this code")
        return exp

    def config_model(self, experiment=None):
        """The validated config object of this run (the experiment's pydantic config class).

        Args:
            experiment: as in :meth:`experiment_object`.
        """
        exp = self.experiment_object(experiment)
        try:
            return exp.config.model_validate(self.config)
        except ValidationError as err:
            raise ConfigError(f"{self.experiment}: the stored config does not validate with this code: "
                              f"{describe_validation_error(err, exp.config)}") from None

    def figure(self, experiment=None):
        """The run's figure (a matplotlib Figure).

        Redrawn from the stored arrays by the experiment's ``plot`` when the code is at hand: ``experiment``
        given (an Experiment, or ``path/to/file.py:NAME``, whose file must be the one the run records), or the
        run computed in this process, or an experiment of iclab's own computed by this very code. Otherwise the
        stored ``figure.png`` is returned as a Figure: reading a store never runs code from it. A diverged run
        gives the plot of its finite trajectory.

        Args:
            experiment: the experiment object or file reference to redraw with (None: as above).
        """
        if self.status == "failed":
            raise StoreError(f"{self.path.name} failed ({self.error}): it has no figure; its traceback is "
                             f"{self.path / 'error.txt'}")
        if self.status == "diverged":
            return _diverged_figure(self.experiment, self.arrays, (self.diverged or {}).get("message", "diverged"))
        if experiment is None and self._experiment is None:
            builtin = builtin_experiment(self.experiment)
            if builtin is None or (self.code or {}).get("digest") != code_identity(builtin)["digest"]:
                return stored_figure(self.path / "figure.png")
        exp = self.experiment_object(experiment)
        return exp.plot(self.config_model(exp), self.arrays)

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
        if self.code is not None:
            out["code"] = self.code.get("digest")
        if self.recomputed:
            out["recomputed"] = self.recomputed
        if self.backend:
            out["backend"] = self.backend
        if self.diverged is not None:
            out["diverged"] = self.diverged
        if self.resumed:
            out["resumed"] = self.resumed
        if self.source:
            out["source"] = self.source
        if self.error:
            out["error"] = self.error
        return out


def stored_figure(png: str | os.PathLike):
    """A stored ``figure.png`` as a matplotlib Figure (the picture on one axis-less axes, at its own size).

    Args:
        png: the PNG file.
    """
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    image = mpimg.imread(png)
    dpi = 130
    fig = plt.figure(figsize=(image.shape[1] / dpi, image.shape[0] / dpi), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(image)
    ax.set_axis_off()
    return fig


def builtin_experiment(exp_id: str):
    """iclab's own experiment of this id, or None. Only a paper package of ``iclab.experiments`` is imported
    (an id from a store is never turned into a module name otherwise)."""
    from iclab.experiments import paper_packages

    if not is_name(exp_id) or exp_id.partition(".")[0] not in paper_packages():
        return None
    try:
        exp = get_experiment(exp_id)
    except KeyError:
        return None
    return exp if exp.builtin else None


def _user_file_of(exp) -> str | None:
    """The file a user's experiment was loaded from (None for one defined elsewhere)."""
    info = _USER_SOURCES.get(exp.id)
    return info["path"] if info is not None and info["experiment"] is exp else None


#: Experiments loaded from users' files: id -> {"path": absolute path, "name": NAME, "sha256": the file's at load,
#: "experiment": the Experiment}.
_USER_SOURCES: dict[str, dict] = {}


def is_file_reference(ref) -> bool:
    """Whether ``ref`` names an experiment in a file (``path/to/file.py:NAME``) rather than a registered id."""
    if not isinstance(ref, str):
        return False
    path, sep, name = ref.rpartition(":")
    return bool(sep) and path.endswith(".py")


def load_experiment_file(ref: str):
    """Loads ``path/to/file.py:NAME``: imports the file and registers the :class:`Experiment` it names.

    Only ever called with a reference the user typed (``iclab run``, ``iclab show``, ``run_experiment``, the
    ``experiment`` argument of :meth:`RunResult.figure`), never with one read from a results root. The file is
    imported as a module of its own (its folder need not be a package; while it loads, its folder is on
    ``sys.path``, so it may import a module beside it); the experiment is registered under its own ``id``
    (replacing an earlier load of the same id from a file), so the store, checks, sweeps, resume and report
    treat it as any other. Its id may not be one of iclab's own experiments' or lie in a paper's namespace
    (``linattn.…``): the store would mistake its results for the built-in ones.

    Args:
        ref: ``path/to/file.py:NAME`` (relative to the current directory, or absolute).
    Returns:
        The experiment.
    Raises:
        ExperimentError: one line, when the file is missing or fails to import, NAME is not in it, it is not an
            Experiment, or its id is not allowed.
    """
    import importlib.util

    from iclab.experiments import Experiment, register

    path_text, _, name = str(ref).rpartition(":")
    path = Path(os.path.expanduser(path_text))  # ~user of no such user stays as typed (as in a shell)
    if not name.isidentifier():
        raise ExperimentError(f"{ref}: expected path/to/file.py:NAME with NAME a Python identifier")
    if not path.is_file():
        raise ExperimentError(f"{ref}: no such file {str(path)!r}")
    path = path.resolve()
    digest = file_sha256(path)
    module_name = "iclab_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ExperimentError(f"{ref}: {str(path)!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 - the user's file: its error is one line, not our traceback
        sys.modules.pop(module_name, None)
        raise ExperimentError(f"{ref}: importing {path.name} failed: {type(err).__name__}: {one_line(err)}") from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, Experiment))
        raise ExperimentError(f"{ref}: {path.name} defines no {name!r}"
                              + (f"; experiments in it: {', '.join(found)}" if found else "; it defines no Experiment"))
    exp = getattr(module, name)
    if not isinstance(exp, Experiment):
        raise ExperimentError(f"{ref}: {name} is a {type(exp).__name__}, not an iclab Experiment "
                              "(iclab.experiments.Experiment)")
    check_name(exp.id, f"{ref}: experiment id", ExperimentError)
    if builtin_experiment(exp.id) is not None:
        raise ExperimentError(f"{ref}: experiment id {exp.id!r} is one of iclab's own experiments; give your "
                              f"experiment an id of its own (e.g. 'user.{exp.id.rpartition('.')[2]}')")
    try:
        register(exp, replace=exp.id in _USER_SOURCES)
    except ValueError as err:
        raise ExperimentError(f"{ref}: {err}") from None
    _USER_SOURCES[exp.id] = {"path": str(path), "name": name, "sha256": digest, "experiment": exp}
    return exp


def experiment_ref(exp) -> str:
    """What a worker process needs to find ``exp``: its id, or ``path.py:NAME`` for a user file."""
    info = _USER_SOURCES.get(exp.id)
    return f"{info['path']}:{info['name']}" if info is not None and info["experiment"] is exp else exp.id


def experiment_or_error(exp_id):
    """The experiment of a registered id or of a ``path/to/file.py:NAME`` reference.

    Args:
        exp_id: ``paper.figN`` or ``path/to/file.py:NAME``.
    Raises:
        ExperimentError: one line naming the known experiments, or what is wrong with the file.
    """
    if not isinstance(exp_id, str) or not exp_id.strip():
        raise ExperimentError(f"experiment must be an experiment id such as 'linattn.fig1' or 'path/to/file.py:NAME' "
                              f"(got {shorten(exp_id)})")
    if is_file_reference(exp_id):
        return load_experiment_file(exp_id)
    try:
        return get_experiment(exp_id)
    except KeyError:
        known = ", ".join(all_experiments())
        raise ExperimentError(f"unknown experiment {shorten(exp_id)}; known: {known} (or path/to/file.py:NAME)") from None


def code_of(exp, config=None) -> dict:
    """The code identity of an experiment as run now (:func:`iclab.provenance.code_identity`).

    Args:
        exp: the experiment; config: the resolved config it runs (its registered extensions enter the identity),
            or None for the experiment's code alone.

    Raises:
        ExperimentError: a user's file that changed since it was loaded in this process (its module is the old
            code): load it again by its path.
    """
    info = _USER_SOURCES.get(exp.id)
    if info is not None and info["experiment"] is exp:
        if not Path(info["path"]).is_file() or file_sha256(info["path"]) != info["sha256"]:
            raise ExperimentError(f"{info['path']} changed since it was loaded: run it by its path "
                                  f"({info['path']}:{info['name']}) to load the new code")
        return code_identity(exp, info["path"], config=config)
    return code_identity(exp, config=config)


def resolve_config(exp_id: str, preset: str = "quick", overrides: dict | None = None, seeds: int | None = None):
    """The validated config of ``exp_id`` at ``preset`` with overrides.

    Args:
        exp_id: a registered id or ``path/to/file.py:NAME``; preset: a preset name.
        overrides: {field: value} (a dict; values of the field's own type: strings are not read as numbers).
        seeds: the number of seeds (an int), or None.
    Returns:
        (Experiment, config).
    Raises:
        ExperimentError: no such experiment. ConfigError: a bad preset, override, seeds, or a config whose memory
            estimate is over the limit (one line naming the field and what is allowed).
    """
    exp = experiment_or_error(exp_id)
    if not isinstance(preset, str) or preset not in exp.presets:
        raise ConfigError(f"preset must be one of {', '.join(exp.presets)} (got {shorten(preset)})")
    if overrides is None:
        overrides = {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a dict of config fields, {{field: value}} (got {type(overrides).__name__})")
    bad_keys = [k for k in overrides if not isinstance(k, str)]
    if bad_keys:
        raise ConfigError(f"overrides' keys must be config field names (str) (got {shorten(bad_keys[0])})")
    overrides = dict(overrides)
    if seeds is not None:
        if not isinstance(seeds, int) or isinstance(seeds, bool):
            raise ConfigError(f"seeds must be an integer ≥ 1 (got {shorten(seeds)})")
        if "seeds" in overrides and overrides["seeds"] != seeds:
            raise ConfigError(f"seeds is set by both --seeds ({seeds}) and --set seeds ({shorten(overrides['seeds'])})")
        overrides["seeds"] = seeds
    try:
        config = exp.resolve(preset, overrides)
    except ValidationError as err:
        raise ConfigError(f"{exp.id}: {describe_validation_error(err, exp.config)}") from None
    except (TypeError, ValueError) as err:  # an override pydantic could not even inspect
        raise ConfigError(f"{exp.id}: {one_line(err)}") from None
    if exp.preflight is not None:
        try:
            exp.preflight(config)
        except ValueError as err:
            raise ConfigError(f"{exp.id}: {err}") from None
    if exp.memory is not None:
        need, what = exp.memory(config)
        limit, given = memory_limit(), settings.memory_limit_gib()
        if need > limit:
            shown = (f"the limit of {given:g} GiB (ICLAB_MEMORY_LIMIT_GB)" if given is not None else
                     f"the limit of {limit / 2**30:.3g} GiB (80 % of this machine's memory; ICLAB_MEMORY_LIMIT_GB "
                     "sets another)")
            raise ConfigError(f"{exp.id}: this config needs about {_gib(need)} GiB for {what}, more than {shown}: "
                              "make it smaller")
    return exp, config


def _gib(nbytes: float) -> str:
    """Bytes as GiB with three significant digits (0.25, 1.5, 6.73e+03)."""
    return f"{nbytes / 2**30:.3g}"


def memory_limit() -> float:
    """The memory (bytes) a run may plan to use: ``ICLAB_MEMORY_LIMIT_GB`` GiB, else 80 % of physical memory.

    Raises:
        ConfigError: ``ICLAB_MEMORY_LIMIT_GB`` is not a number > 0 (:mod:`iclab.settings`).
    """
    given = settings.memory_limit_gib()
    if given is not None:
        return given * 2**30
    try:
        return 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return float("inf")


def checkpoint_settings(every: int | None = None, seconds: float | None = None) -> tuple[int | None, float | None]:
    """Checkpoint interval in chunks and seconds: the arguments, else ``ICLAB_CHECKPOINT_EVERY`` and
    ``ICLAB_CHECKPOINT_SECONDS``, else by time only (every 60 s).

    Raises:
        ConfigError: a value out of its range (one line).
    """
    env_every, env_seconds = settings.checkpoint_every(), settings.checkpoint_seconds()
    every = env_every if every is None else every
    seconds = env_seconds if seconds is None else seconds
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
        raise ConfigError(f"checkpoint interval must be an integer ≥ 0 chunks (got {shorten(every)})")
    if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0):
        raise ConfigError(f"checkpoint interval must be > 0 seconds (got {shorten(seconds)})")
    return every, seconds


def check_api_arguments(force, repair, retries) -> None:
    """Checks the flags of a run or sweep called from Python; each problem is one line (ConfigError).

    Args:
        force, repair: True or False; retries: an integer (its range is checked by the caller).
    """
    for name, value in (("force", force), ("repair", repair)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False (got {shorten(value)})")
    if not isinstance(retries, int) or isinstance(retries, bool):
        raise ConfigError(f"retries must be an integer ≥ 0 (got {shorten(retries)})")


class ExperimentRaised(Exception):
    """An exception raised inside an experiment's own function (``run``, ``checks``, ``plot``, ``run_shard``,
    ``assemble``): which function, the exception in one line, and its traceback as text (it travels from a
    worker process as it is). The original is the ``__cause__`` where it was raised in this process."""

    def __init__(self, function: str, text: str, traceback_text: str):
        super().__init__(function, text, traceback_text)
        self.function, self.text, self.traceback_text = function, text, traceback_text

    def __str__(self) -> str:
        return f"{self.function} raised {self.text}"


def call_experiment(function: str, fn, *args):
    """``fn(*args)``, an experiment's own function: an exception it raises becomes :class:`ExperimentRaised`
    (with its traceback), except the ones that say how the run ended (:class:`iclab.engines.Diverged`) or that
    are a user's input error (:class:`UserError`), which pass unchanged.

    Args:
        function: how the function is named in messages (``run(config, reporter)``).
        fn, args: the call.
    """
    from iclab.engines import Diverged

    try:
        return fn(*args)
    except (Diverged, UserError):
        raise
    except Exception as err:
        text = f"{type(err).__name__}: {one_line(err)}" if str(err).strip() else type(err).__name__
        raise ExperimentRaised(function, text, "".join(traceback.format_exception(err))) from err


def checked_arrays(exp_id: str, out, function: str = "run(config, reporter)") -> dict[str, np.ndarray]:
    """What an experiment's ``run`` (or ``run_shard``, ``assemble``) returned, as arrays by name; ExperimentError
    (one sentence naming the function and what it must return) when it is not a dict of numeric arrays.

    Args:
        exp_id: the experiment (named in the message); out: what the function returned; function: its name.
    """
    must = f"{exp_id}: {function} must return a dict of numeric arrays by name (str -> numpy array)"
    # (strings are allowed too: labels beside the numbers)
    if not isinstance(out, Mapping):
        raise ExperimentError(f"{must}; it returned {type(out).__name__}")
    arrays = {}
    for key, value in out.items():
        if not isinstance(key, str) or not key:
            raise ExperimentError(f"{must}; it returned the key {shorten(key)}")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as err:  # ragged lists
            raise ExperimentError(f"{must}; {key!r} is not an array ({one_line(err)[:80]})") from None
        if array.dtype.kind not in "biufcUS":  # numbers, booleans, strings: what npz holds without pickles
            raise ExperimentError(f"{must}; {key!r} has dtype {array.dtype} (object arrays are refused: a stored "
                                  "array must load without unpickling)")
        arrays[key] = array
    return arrays


def checked_checks(exp_id: str, out) -> list[dict]:
    """What an experiment's ``checks`` returned, as dicts; ExperimentError when it is not a list of Check."""
    if not isinstance(out, (list, tuple)) or not all(isinstance(c, Check) for c in out):
        got = type(out).__name__ if not isinstance(out, (list, tuple)) else \
            f"a list holding {type(next(c for c in out if not isinstance(c, Check))).__name__}"
        raise ExperimentError(f"{exp_id}: checks(config, arrays) must return a list of iclab.experiments.Check (made by "
                              f"check_abs, check_rel, check_at_most, check_at_least, check_equal); it returned {got}")
    return [c.as_dict() for c in out]


def checked_figure(exp_id: str, fig):
    """What an experiment's ``plot`` returned; ExperimentError when it is not a matplotlib Figure."""
    from matplotlib.figure import Figure

    if not isinstance(fig, Figure):
        raise ExperimentError(f"{exp_id}: plot(config, arrays) must return a matplotlib Figure (e.g. from "
                              f"plt.subplots()); it returned {type(fig).__name__}")
    return fig


def compute(exp, config, *, running_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
            checkpoint_seconds: float | None = None, reporter: Reporter | None = None, run=None) -> dict:
    """Runs, checks and plots one config; returns what the store needs (a picklable payload).

    With ``running_dir`` the engine loops checkpoint there and resume from what they find. A NaN or
    infinite loss ends the run as ``diverged`` with its finite trajectory. The experiment's functions are held
    to their contract (:func:`checked_arrays`, :func:`checked_checks`, :func:`checked_figure`: ExperimentError);
    an exception they raise is :class:`ExperimentRaised`. ``run(config, reporter) -> arrays`` replaces
    ``exp.run`` (a sharded run: :func:`iclab.shards.run_shards`).

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
            arrays = call_experiment("run(config, reporter)", run or exp.run, config, run_reporter)
        except Diverged as div:
            payload["status"] = "diverged"
            payload["diverged"] = {"task": div.label, "step": div.step, "t": div.t, "message": str(div),
                                   "last_finite_step": div.last_finite_step, "last_finite_t": div.last_finite_t,
                                   "last_finite_loss": div.last_finite_loss}
            payload["arrays"] = flat_arrays(div.records)
            payload["checks"] = []
            fig = _diverged_figure(exp.id, payload["arrays"], str(div))
        else:
            payload["status"] = "done"
            payload["arrays"] = checked_arrays(exp.id, arrays)
            payload["checks"] = checked_checks(exp.id, call_experiment("checks(config, arrays)", exp.checks, config,
                                                                       payload["arrays"]))
            fig = checked_figure(exp.id, call_experiment("plot(config, arrays)", exp.plot, config, payload["arrays"]))
        payload["figure_png"], payload["figure_pdf"] = _figure_bytes(fig)
    except Exception:
        if running_dir is not None:  # checkpoints of a failing run may come from a bug: start afresh
            shutil.rmtree(running_dir, ignore_errors=True)
        raise
    payload["resumed"] = list(checkpoints.events) if checkpoints is not None else []
    payload["wall_s"] = time.perf_counter() - start
    return payload


@dataclass(frozen=True)
class RunIdentity:
    """What keys a run in the store: the experiment, its resolved config, the code that computes it.

    Attributes:
        experiment: the experiment's id; preset: the preset it starts from; config: the resolved config (JSON).
        code: the code identity (:func:`iclab.provenance.code_identity`).
        digest: the run key (:func:`iclab.provenance.run_key`), its folder ``<experiment>-<digest>``.
        config_key: the key of the config alone (:func:`iclab.provenance.config_key`).
        backend: the backend it computes with, resolved (``native`` or ``xla``: :func:`iclab.ops.resolve_backend`).
    """

    experiment: str
    preset: str
    config: dict
    code: dict
    digest: str
    config_key: str
    backend: str = "native"


def identify(exp, config, preset: str, code: dict | None = None, *, backend: str = "auto") -> RunIdentity:
    """The :class:`RunIdentity` of a validated config of ``exp``.

    Args:
        exp: the experiment; config: its validated config; preset: the preset it starts from.
        code: its code identity (computed for this config if None; an experiment with ``extensions`` is always
            computed for this config).
        backend: ``auto``, ``native`` or ``xla`` (resolved here: ``auto`` is native on a CPU).
    """
    resolved = config.model_dump(mode="json")
    code = code_of(exp, config) if code is None or getattr(exp, "extensions", None) is not None else code
    chosen = check_backend(backend)
    return RunIdentity(exp.id, preset, resolved, code, run_key(exp.id, resolved, version=__version__,
                                                               code=code["digest"], backend=chosen),
                       config_key(exp.id, resolved), chosen)


def check_backend(backend) -> str:
    """A backend option resolved to ``native`` or ``xla``; ConfigError (one line) for another value.

    Args:
        backend: ``auto`` (native on a CPU, xla on an accelerator), ``native`` or ``xla``.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)} (got {shorten(backend)})")
    return resolve_backend(backend)


def worker_config(exp_id: str, resolved: dict, digest: str, threads: int | None = None, backend: str = "auto"):
    """A worker's (experiment, config): sets its threads, rebuilds the config from the driver's resolved JSON
    and checks that its run key (config and code) is the driver's.

    Args:
        exp_id: the experiment's id or ``path.py:NAME``; resolved, digest: its config and run key.
        threads: the threads this worker computes with (:func:`iclab.threads.set_threads`; None: as set).
        backend: the driver's resolved backend.
    Returns:
        (Experiment, config).
    Raises:
        RuntimeError: another run key on the worker: its code (iclab, or the experiment's file) or its config's
            round trip differs from the driver's.
    """
    import iclab  # noqa: F401  (float64 on, in a fresh worker)

    if threads is not None and os.environ.get("ICLAB_THREADS") != str(threads):
        from iclab.threads import set_threads

        set_threads(threads)
    exp = experiment_or_error(exp_id)
    config = exp.config.model_validate(resolved)
    again = identify(exp, config, "", backend=backend).digest
    if again != digest:
        raise RuntimeError(f"{exp_id} has another run key on this worker ({again}) than on the driver ({digest}): "
                           "its code (iclab, or the experiment's file) or its config differs; install the same code "
                           "on every node")
    return exp, config


def compute_point(exp_id: str, resolved: dict, digest: str, running_dir: str | None = None,
                  checkpoint_every: int | None = None, checkpoint_seconds: float | None = None,
                  driver_host: str | None = None, backend: str = "auto", threads: int | None = None) -> dict:
    """:func:`compute` for a worker process (local pool or Ray task): rebuilds the config from its
    resolved JSON and checks that it keys as the driver's. Checkpoints go to ``running_dir`` on
    the worker's file system; a worker on another host than the driver removes them once done
    (the driver stores the result and cannot see them).

    Args:
        exp_id: the experiment's id or ``path.py:NAME``; resolved, digest: its config and run key.
        running_dir: the in-progress folder for checkpoints (None: none).
        checkpoint_every, checkpoint_seconds: the checkpoint interval.
        driver_host: the sweep driver's host name.
        threads: the threads this worker computes with (:func:`iclab.threads.set_threads`; None: as set).
        backend: the backend to compute with (the driver's, resolved).
    Returns:
        The payload of :func:`compute`.
    """
    exp, config = worker_config(exp_id, resolved, digest, threads, backend)
    if running_dir is not None:
        try:
            Path(running_dir).parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # no such results root on this node: run without checkpoints
            running_dir = None
    with use_backend(backend):
        payload = compute(exp, config, running_dir=running_dir, checkpoint_every=checkpoint_every,
                          checkpoint_seconds=checkpoint_seconds)
    if running_dir is not None and driver_host is not None and driver_host != socket.gethostname():
        shutil.rmtree(running_dir, ignore_errors=True)
    return payload


def experiment_info(exp) -> dict:
    """What the report shows of an experiment, recorded with each run so that a store is shown without its code:
    title, paper, reference, notes, and each config field's description and paper value (a settings group's
    fields by their dotted names, :mod:`iclab.fields`)."""
    fields = {}
    for name, info in flat_fields(exp.config).items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        fields[name] = {"description": info.description or "", "paper": extra.get("paper"),
                        "paper_note": extra.get("paper_note")}
    return {"title": exp.title, "paper": exp.paper, "reference": exp.reference, "notes": list(exp.notes),
            "fields": fields}


def _config_files(ident: RunIdentity, exp) -> dict:
    stored = {"experiment": ident.experiment, "preset": ident.preset, "config": ident.config,
              "experiment_info": experiment_info(exp)}
    try:  # the preset's own config: the report's reproduce command names only the fields set beside it
        stored["preset_config"] = exp.resolve(ident.preset).model_dump(mode="json")
    except Exception:  # noqa: BLE001 - a preset that needs an override to validate: no base to compare with
        pass
    user = ident.code.get("user_file")
    if user:
        info = _USER_SOURCES.get(ident.experiment) or {}
        stored["source"] = f"{user['path']}:{info.get('name', '?')}"
        stored["source_sha256"] = user["sha256"]
    return stored


def _base_metrics(ident: RunIdentity, status: str, wall_s: float) -> dict:
    return {"experiment": ident.experiment, "preset": ident.preset, "config_hash": ident.digest,
            "config_key": ident.config_key, "version": __version__, "code": ident.code, "backend": ident.backend,
            "environment": environment_versions(), "status": status, "wall_s": wall_s}


def store_payload(store: Store, exp, ident: RunIdentity, payload: dict, *, row: int | None = None,
                  started: float | None = None, note: str | None = None) -> Path:
    """Writes a computed payload as the run's folder (atomically) and returns its path.

    Args:
        store: the result store; exp: the experiment; ident: the run's identity (:func:`identify`).
        payload: what :func:`compute` returned; its ``ended`` is set to the time recorded in the folder.
        row, started: the run's index row and start time, recorded in ``metrics.json`` so that
            ``iclab index rebuild`` restores the row as it was.
        note: why a stored result was not reused (:attr:`RunResult.recomputed`), logged.
    """
    checks = payload["checks"]
    n_pass = sum(c["passed"] for c in checks)
    status = payload["status"]
    log = [f"iclab {__version__} run of {ident.experiment} (preset {ident.preset}), run key {ident.digest}, code "
           f"{ident.code['digest']}",
           f"stored {time.strftime('%Y-%m-%d %H:%M:%S')}, computed on {payload.get('host', '?')}"]
    if note:
        log.append(f"computed again: {note}")
    log += [f"resumed: {n}" for n in payload.get("resumed", [])]
    log += [f"wall time {payload['wall_s']:.2f} s"]
    if status == "diverged":
        log += [f"DIVERGED: {payload['diverged']['message']}; the finite part of the trajectory is stored"]
    log += [f"checks passed {n_pass}/{len(checks)}"]
    log += [f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: measured {c['measured']!r}, "
            f"expected {c['expected']!r} ({c['comparison']}, tol {c['tolerance']!r})" for c in checks]
    metrics = dict(_base_metrics(ident, status, payload["wall_s"]),
                   passed=status == "done" and n_pass == len(checks), checks=checks)
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
    return store.write(ident.experiment, ident.digest, {
        "config.json": _config_files(ident, exp),
        "trajectories.npz": payload["arrays"],
        "figure.png": payload["figure_png"],
        "figure.pdf": payload["figure_pdf"],
        "log.txt": "\n".join(log) + "\n",
        "metrics.json": metrics,
    })


def store_failure(store: Store, exp, ident: RunIdentity, error: str, traceback_text: str, *, wall_s: float,
                  row: int | None = None, started: float | None = None) -> Path | None:
    """Writes a failed run's folder: its config, ``error.txt`` (the traceback) and ``metrics.json`` with status
    ``failed`` and the error in one line. A failed folder is never reused (the next run computes again and
    replaces it). Returns its path, or None when the store cannot be written (the original error matters more).

    Args:
        store, exp, ident: as in :func:`store_payload`; error: the one-line error; traceback_text: the traceback.
        wall_s, row, started: the run's wall time, index row and start time.
    """
    ended = time.time()
    metrics = dict(_base_metrics(ident, "failed", wall_s), passed=False, checks=[], error=error,
                   index={"id": row, "started": started, "ended": ended})
    log = [f"iclab {__version__} run of {ident.experiment} (preset {ident.preset}), run key {ident.digest}",
           f"FAILED {time.strftime('%Y-%m-%d %H:%M:%S')} after {wall_s:.2f} s: {error}",
           "the traceback is in error.txt"]
    try:
        return store.write(ident.experiment, ident.digest, {
            "config.json": _config_files(ident, exp), "error.txt": traceback_text,
            "log.txt": "\n".join(log) + "\n", "metrics.json": metrics})
    except Exception:  # noqa: BLE001 - a full disk must not hide why the run failed
        return None


def end_row(store: Store, row: int, payload: dict) -> None:
    """Closes a run's index row from its payload: done or diverged, wall time, checks."""
    checks = payload["checks"]
    div = payload.get("diverged")
    store.end(row, payload["status"], payload["wall_s"], sum(c["passed"] for c in checks), len(checks),
              error=None if div is None else div["message"],
              diverged_step=None if div is None else div["step"],
              last_finite_loss=None if div is None else div["last_finite_loss"], ended=payload.get("ended"))


def stored_result(path: Path, wall_s: float, *, reused: bool = True, experiment=None) -> RunResult:
    """The RunResult of a stored (verified) run folder, from its files alone.

    Args:
        path: the run folder; wall_s: the time to report; reused: whether it was reused rather than computed now.
        experiment: the Experiment that computed it in this process (lets :meth:`RunResult.figure` redraw).
    Raises:
        StoreError: a file that does not parse as a run's.
    """
    try:
        metrics = json.loads((path / "metrics.json").read_text())
        stored = json.loads((path / "config.json").read_text())
        code = metrics.get("code") if isinstance(metrics.get("code"), dict) else None
        return RunResult(stored["experiment"], path, stored["config"], list(metrics["checks"]), reused, wall_s,
                         metrics.get("status", "done"), metrics.get("diverged"), list(metrics.get("resumed", [])),
                         source=stored.get("source") if isinstance(stored.get("source"), str) else None, code=code,
                         error=metrics.get("error") if isinstance(metrics.get("error"), str) else None,
                         backend=metrics.get("backend") if isinstance(metrics.get("backend"), str) else None,
                         _experiment=experiment)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StoreError(f"{path} is not a readable run ({type(err).__name__}: {one_line(err)[:100]}); `iclab verify` "
                         "checks the store") from None


def not_reused(store: Store, ident: RunIdentity) -> str | None:
    """Why a stored result of the same experiment and config is not reused (its code differs), or None when the
    store holds none.

    Args:
        store: the results root; ident: the run about to be computed.
    """
    old = store.previous(ident.experiment, ident.config_key, ident.digest)
    if old is None:
        return None
    try:
        metrics = json.loads((old / "metrics.json").read_text())
        code = metrics.get("code")
    except (OSError, ValueError):
        code = None
    return f"{old.name} holds this config computed by other code ({describe_change(code, ident.code)})"


def reusable(store: Store, exp_id: str, digest: str, repair: bool) -> Path | None:
    """The stored folder of this run if it is intact (indexing it again if the index lost it); a damaged
    one is moved to ``.damaged/`` and recomputed, or with ``repair=False`` reported (:class:`RunDamaged`).

    Args:
        store: the result store; exp_id, digest: the run (its experiment and run key).
        repair: set a damaged folder aside (True) or raise :class:`RunDamaged` (False).
    Returns:
        The folder to reuse, or None: compute the run.
    """
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


@dataclass(frozen=True)
class Attempt:
    """One computation of a point, begun holding its lock (:func:`begin_attempt`).

    Attributes:
        row: its index row; started: when it began (seconds since the epoch).
        note: why a stored result of the same config is not reused (:func:`not_reused`), or None.
        running: the point's in-progress folder (its checkpoints; a sharded run's shard cache).
    """

    row: int
    started: float
    note: str | None
    running: Path


def begin_attempt(store: Store, ident: RunIdentity, *, force: bool = False, clear: bool | None = None) -> Attempt:
    """Begins computing a point; call it holding the point's lock. Notes why a stored result of the same
    config is not reused, marks the rows of a process that died computing it as interrupted, and opens its
    index row (``running``).

    Args:
        store: the result store; ident: the point (:func:`identify`).
        force: a recomputation asked for (then no note is made of a result not reused).
        clear: remove the in-progress folder first (its checkpoints: start afresh); default ``force``.
    """
    note = None if force else not_reused(store, ident)
    store.mark_interrupted(ident.experiment, ident.digest)
    running = store.running_dir(ident.experiment, ident.digest)
    if force if clear is None else clear:
        shutil.rmtree(running, ignore_errors=True)
    started = time.time()
    row = store.begin(ident.experiment, ident.digest, ident.preset, ident.config, started=started,
                      config_key=ident.config_key, code=ident.code["digest"], backend=ident.backend)
    return Attempt(row, started, note, running)


def finish_attempt(store: Store, attempt: Attempt, payload: dict) -> None:
    """Ends a stored point: closes its index row from the payload (:func:`end_row`) and removes its
    in-progress folder.

    Args:
        store: the result store; attempt: the point's (:func:`begin_attempt`); payload: what it computed.
    """
    end_row(store, attempt.row, payload)
    shutil.rmtree(attempt.running, ignore_errors=True)


def run_point(store: Store, exp, ident: RunIdentity, compute_fn: Callable[[Path], dict], *, force: bool = False,
              repair: bool = True, on_wait=None) -> RunResult:
    """Runs one point in this process: reuses its stored result, or (holding its lock) computes it with
    ``compute_fn`` and stores it; a run that raises is recorded as failed (see the module docstring).

    Args:
        store: the result store; exp: the experiment; ident: the point (:func:`identify`).
        compute_fn: ``compute_fn(running_dir) -> payload`` (as :func:`compute` returns it), called holding the
            lock with the point's in-progress folder.
        force: recompute even if a stored result exists (its in-progress folder is cleared first).
        repair: a stored result that fails its verification is moved to ``.damaged/`` and recomputed; with
            False it is reported (:class:`RunDamaged`) instead.
        on_wait: called (no arguments) if another process is computing this point and we wait for it.
    Returns:
        The :class:`RunResult`.
    Raises:
        RunDamaged: a damaged stored result and ``repair=False``.
        RunFailed: a user's experiment raised (recorded as failed, its traceback in ``error.txt``); any other
            exception of ``compute_fn`` is recorded too and raised as it is.
    """
    start = time.perf_counter()
    reuse = None if force else reusable(store, exp.id, ident.digest, repair)
    if reuse is not None:
        return stored_result(reuse, time.perf_counter() - start, experiment=exp)

    lock = store.lock(exp.id, ident.digest)
    if not lock.acquire(blocking=False):
        if on_wait is not None:
            on_wait()
        lock.acquire()
    try:
        reuse = None if force else reusable(store, exp.id, ident.digest, repair)
        if reuse is not None:  # computed by the process we waited for
            return stored_result(reuse, time.perf_counter() - start, experiment=exp)
        attempt = begin_attempt(store, ident, force=force)
        try:
            with use_backend(ident.backend):
                payload = compute_fn(attempt.running)
            path = store_payload(store, exp, ident, payload, row=attempt.row, started=attempt.started,
                                 note=attempt.note)
        except BaseException as err:
            raise _failed(store, exp, ident, attempt.row, attempt.started, err,
                          time.perf_counter() - start) from None
        finish_attempt(store, attempt, payload)
    finally:
        lock.release()
    ref = experiment_ref(exp)
    return RunResult(exp.id, path, ident.config, payload["checks"], False, payload["wall_s"], payload["status"],
                     payload["diverged"], payload["resumed"], source=ref if is_file_reference(ref) else None,
                     code=ident.code, recomputed=attempt.note, backend=ident.backend, _arrays=payload["arrays"],
                     _experiment=exp)


def _failed(store: Store, exp, ident: RunIdentity, row: int, started: float, err: BaseException,
            wall_s: float) -> BaseException:
    """Records a run that raised (index row, and for an error of the run itself its failed folder with
    ``error.txt``) and returns what to raise: :class:`RunFailed` for a user's experiment that raised, the
    original exception otherwise (iclab's own experiments keep their traceback: a bug of ours)."""
    note = interruption_note(err)
    if note is not None or isinstance(err, StoreError):
        _end_failed(store, row, err, wall_s)
        return err
    if isinstance(err, ExperimentRaised):
        error, text = str(err), err.traceback_text
    else:
        error = f"{type(err).__name__}: {one_line(err)}" if str(err).strip() else type(err).__name__
        text = "".join(traceback.format_exception(err))
    folder = store_failure(store, exp, ident, error, text, wall_s=wall_s, row=row, started=started)
    _end_failed(store, row, err, wall_s, error=error)
    if isinstance(err, ExperimentRaised) and not exp.builtin:
        where = folder / "error.txt" if folder is not None else "the index (the store could not be written)"
        return RunFailed(f"{exp.id} failed: {error} (its traceback: {where})", None if folder is None else
                         folder / "error.txt")
    if isinstance(err, ExperimentRaised) and err.__cause__ is not None:
        return err.__cause__
    return err


def interruption_note(err: BaseException) -> str | None:
    """The index's error text of a run stopped by the user or the system (None for other errors)."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (Ctrl-C); run the same command to resume"
    if isinstance(err, SystemExit):
        return f"interrupted (exit {err.code}); run the same command to resume"
    return None


def _end_failed(store: Store, row: int, err: BaseException, wall_s: float, error: str | None = None) -> None:
    """Closes the row of a run that raised (``error``: its one-line text, default from ``err``); a store that
    cannot be written (a full disk) leaves it ``running``, which later commands show as interrupted (its lock
    is free)."""
    note = interruption_note(err)
    try:
        store.end(row, "interrupted" if note else "failed", wall_s,
                  error=note or error or f"{type(err).__name__}: {one_line(err)}")
    except Exception:  # noqa: BLE001 - keep the original error, not the index's
        pass


def results_root(root: str | os.PathLike | None = None, *, option: str = "--out") -> Path:
    """The results root to write into, checked before any work: one line (StoreError) when it is empty,
    names a file or lies under one, is a symbolic link that leads nowhere, or is not writable.

    Args:
        root: the folder given (None: ``$ICLAB_RESULTS`` or ``./iclab-results``).
        option: how the user gave it, named in the error (``--out``, ``--results``).
    Returns:
        The root as a Path (not created yet if it does not exist).
    """
    if root is None:
        env = settings.results_root()
        if env is not None:
            return writable_folder(env, "ICLAB_RESULTS")
        return writable_folder(default_root(), "the default results root")
    return writable_folder(root, option)


def writable_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder that exists or can be created, and can be written into; StoreError otherwise.

    Args:
        path: the folder; what: how the user gave it (named in the error).
    """
    folder = readable_root(path, option=what)
    _check_writable(folder, folder, what, "a folder")
    return folder


def writable_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a file that can be written (its folder exists or can be created); StoreError otherwise.

    Args:
        path: the file; what: how the user gave it (named in the error).
    """
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise ConfigError(f"{what} must be a file path (got {type(path).__name__})")
    text = os.fspath(path)
    if not str(text).strip():
        raise StoreError(f"{what} is empty: name a file")
    if "\0" in str(text):
        raise StoreError(f"{what} {str(text)[:60]!r} holds a NUL character: name a file")
    file = Path(os.path.expanduser(text))  # ~user of no such user stays as typed (as in a shell)
    if file.is_dir():
        raise StoreError(f"{what} {file} is a folder: name a file")
    try:
        file.parent.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise StoreError(f"{what} {file} lies under a symbolic link that loops") from None
    _check_writable(file.parent, file, what, "a file")
    return file


def _check_writable(folder: Path, given: Path, what: str, kind: str) -> None:
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "names a file" if probe == given else f"lies under the file {probe}"
        raise StoreError(f"{what} {given} {where}: name {kind}")
    try:  # the only reliable test of writability (read-only mounts, permissions, root included)
        fd, name = tempfile.mkstemp(prefix=".iclab-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise StoreError(f"{what} {given} is not writable ({err.strerror or err})") from None


def _figure_bytes(fig) -> tuple[bytes, bytes]:
    import matplotlib.pyplot as plt

    png, pdf = io.BytesIO(), io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=130)
        fig.savefig(pdf, format="pdf")
    finally:
        plt.close(fig)
    return png.getvalue(), pdf.getvalue()


def flat_arrays(tree) -> dict[str, np.ndarray]:
    """A pytree of arrays as flat npz entries ("params['W']" style keys for nested leaves).

    Args:
        tree: {name: array or pytree of arrays} (a diverged run's records).
    """
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
