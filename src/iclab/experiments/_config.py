"""Experiment configs: pydantic models whose fields carry a description, bounds, and the paper's value.

Use :func:`param` for every field: ``paper=`` records what the paper (or its reference code)
uses, so ``iclab show`` can print it beside our default; ``paper_note=`` says where it comes from
or that the paper leaves it unspecified.

A field that an engine's specification declares (:class:`iclab.engines.linreg.LinregSettings`: H, w_init,
lr, steps, P, ...) is not declared again: the config takes it with :func:`engine_fields`, giving only its
default, the paper's value and, where the figure needs them, narrower bounds or fewer choices
(:func:`setting`). The type, bounds and description stay the engine's, so a config and the engine cannot
disagree on what a field is. A figure that trains two models side by side takes the fields once per model
under a suffix (``engine_fields(LinregSettings, suffix="_m", label="ATTN_M", H=...)``: ``H_m``), and a sweep
grid of an engine field (the init scales of a sweep, the ranks of a rank sweep) is a list declared with
:func:`engine_grid`, whose elements have the engine field's type and bounds.

A config that composes a model's or a task's settings object (zoology's ``TrainConfig(data, model)``) holds it as
ONE field declared with :func:`nested`: ``transformer: TransformerSettings = nested(TransformerSettings, "...",
layers=setting(2, paper=8))``. The object's fields keep the settings class's type, bounds, description and
validators, with the config's defaults and paper values, and a user names them ``transformer.layers`` wherever a
field is named (``--set transformer.layers=4``, a preset, a sweep grid; :mod:`iclab.fields`). The experiment reads
``config.transformer``, an instance of the settings class, and passes it on whole.
"""

from __future__ import annotations

import json
import os
import re
import types
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from iclab.fields import flat_fields, flat_values, is_group, nested_values, renamed

__all__ = ["EngineFields", "EngineGrid", "ExperimentConfig", "Nested", "Setting", "TrainingConfig", "engine_fields",
           "engine_grid", "field_rows", "nested", "param", "setting", "validate_eigenvalues"]

UNSPECIFIED = "unspecified"


def param(default: Any, description: str, *, paper: Any = None, paper_note: str | None = None, **bounds: Any) -> Any:
    """A config field with its meaning, bounds (ge/gt/le/lt), and the paper's value.

    Args:
        default: our default value.
        description: what the field is, in the paper's terms.
        paper: the paper's (or its reference code's) value; None when it gives none.
        paper_note: where the paper's value comes from, or that the paper leaves it unspecified.
        bounds: pydantic bounds (ge, gt, le, lt), shown by ``iclab show`` and in every error message.
    Returns:
        A pydantic ``Field``.
    """
    extra = {"paper": paper, "paper_note": paper_note}
    return Field(default, description=description, json_schema_extra=extra, **bounds)


class Setting(NamedTuple):
    """A config's default and paper value for a field an engine declares (:func:`setting`)."""

    default: Any
    paper: Any = None
    paper_note: str | None = None
    choices: tuple | None = None
    bounds: dict | None = None


def setting(default: Any, *, paper: Any = None, paper_note: str | None = None, choices: tuple | None = None,
            **bounds: Any) -> Setting:
    """A config's default for a field it takes from an engine (:func:`engine_fields`), with the paper's value.

    Args:
        default: our default value.
        paper: the paper's (or its reference code's) value; None when it gives none.
        paper_note: where the paper's value comes from, or that the paper leaves it unspecified.
        choices: for a Literal field, the values this config allows (a subset of the engine's).
        bounds: ge, gt, le, lt narrower than the engine's (e.g. the sizes a figure is made for).
    Returns:
        The :class:`Setting`.
    """
    return Setting(default, paper, paper_note, None if choices is None else tuple(choices), bounds or None)


class EngineFields(dict):
    """{engine field name: :class:`Setting`} taken from one engine specification (:func:`engine_fields`), each
    becoming the config field ``prefix + name + suffix``."""

    def __init__(self, spec: type[BaseModel], settings: dict[str, Setting], suffix: str = "", label: str | None = None,
                 prefix: str = ""):
        super().__init__(settings)
        self.spec, self.suffix, self.label, self.prefix = spec, suffix, label, prefix


_SUFFIX = re.compile(r"_[a-z][a-z0-9]*")
_PREFIX = re.compile(r"[a-z][a-z0-9]*_")


def engine_fields(spec: type[BaseModel], *, suffix: str = "", label: str | None = None, prefix: str = "",
                  **settings: Setting) -> EngineFields:
    """Fields of a config taken from an engine's specification, declared there once.

    Assigned in a config's body as a ``ClassVar`` (``linreg: ClassVar = engine_fields(LinregSettings, H=setting(8,
    paper=8), ...)``), it adds each named field of ``spec`` at that place, with the engine's type, bounds and
    description and the config's default and paper value; a subclass overrides a default the same way. A field
    the engine allows to be None (P: not needed by the population engine) is taken without None when its default
    is a value.

    A config that trains several models side by side takes the fields once per model, each group under its
    ``suffix`` and ``label``: ``engine_fields(LinregSettings, suffix="_m", label="softmax ATTN_M", H=setting(8))``
    adds ``H_m``, of the engine's type and bounds (narrowable only), described as ``"softmax ATTN_M: "`` followed
    by the engine's description; ``prefix="toy_"`` names them ``toy_layers`` likewise (a model's settings taken
    field by field beside the config's own; a config that holds a model's settings whole uses :func:`nested`). A suffixed or
    prefixed field is not read by :meth:`iclab.engines.linreg.LinregTraining.of`
    (its name is not the engine's): the config passes it to the run's specification itself.

    A list of values of an engine field that a config sweeps (the init scales of an init sweep, the ranks of a
    rank sweep) is a different thing from the field, a grid: it keeps a name and description of its own and is
    declared with :func:`engine_grid`, whose elements have the engine field's type and bounds (narrowable only).
    A field whose name is an engine field's with a suffix (``lr_s``) or a plural (``w_inits_m``, ``heads_m``,
    ``ranks``) is taken with one of the two (``tests/experiments/test_config_fields.py`` enforces it).

    Args:
        spec: the engine's pydantic specification (e.g. :class:`iclab.engines.linreg.LinregSettings`).
        suffix: appended to each field's name (``_`` then lowercase letters or digits, e.g. ``_m``); empty: the
            engine's names.
        label: with a suffix or prefix (and only then), the model the group belongs to, put before the engine's
            description as ``"{label}: {description}"``.
        prefix: put before each field's name (lowercase letters or digits then ``_``, e.g. ``transformer_``).
        settings: engine field name -> :func:`setting`.
    Returns:
        The :class:`EngineFields`, which :class:`ExperimentConfig` expands when the class is created.
    Raises:
        TypeError: a name that is not a field of ``spec``, a value that is not a :func:`setting`, a malformed
            suffix or prefix, or one without a label (or a label without either).
    """
    if suffix and not _SUFFIX.fullmatch(suffix):
        raise TypeError(f"suffix must be '_' then lowercase letters or digits, e.g. '_m' (got {suffix!r})")
    if prefix and not _PREFIX.fullmatch(prefix):
        raise TypeError(f"prefix must be lowercase letters or digits then '_', e.g. 'transformer_' (got {prefix!r})")
    if bool(suffix or prefix) != bool(label):
        raise TypeError("give a suffix or prefix and a label together (the label names the model the fields belong "
                        "to)")
    for name, value in settings.items():
        if name not in spec.model_fields:
            raise TypeError(f"{name!r} is not a field of {spec.__name__}")
        if not isinstance(value, Setting):
            raise TypeError(f"{name}: give iclab.experiments.setting(default, paper=...), not {type(value).__name__}")
    return EngineFields(spec, settings, suffix, label, prefix)


class Nested(NamedTuple):
    """A config field holding one settings object (:func:`nested`)."""

    spec: type[BaseModel]
    description: str
    settings: dict[str, Setting]


def nested(spec: type[BaseModel], description: str, **settings: Setting) -> Any:
    """A config field holding one ``spec`` object, the settings of a model or task the experiment composes.

    Assigned in a config's body under the spec's type (``transformer: TransformerSettings =
    nested(TransformerSettings, "the transformer", layers=setting(2, paper=8), ...)``), it becomes a field whose
    value is a ``spec`` instance: each named field takes the config's default, paper value and narrower bounds or
    choices (:func:`setting`), the others keep the spec's defaults; types, descriptions and the spec's validators
    (those relating two of its fields) stay the spec's. Its fields are named ``name.field`` by users
    (``--set transformer.width=64``, presets, sweep grids, ``iclab show``) and read as ``config.name.field``. A
    subclass re-declares the group to change a default, narrowing what its base declared.

    Args:
        spec: the settings class (a frozen pydantic model with a default for each field the config does not set).
        description: what the group is, shown beside its fields.
        settings: spec field name -> :func:`setting`.
    Returns:
        The :class:`Nested` marker, which :class:`ExperimentConfig` expands when the class is created.
    Raises:
        TypeError: a name that is not a field of ``spec``, or a value that is not a :func:`setting`.
    """
    for name, value in settings.items():
        if name not in spec.model_fields:
            raise TypeError(f"{name!r} is not a field of {spec.__name__}")
        if not isinstance(value, Setting):
            raise TypeError(f"{name}: give iclab.experiments.setting(default, paper=...), not {type(value).__name__}")
    return Nested(spec, description, settings)


def _nested_field(owner: type, name: str, group: Nested, annotation: Any) -> tuple[type[BaseModel], FieldInfo]:
    """The settings class of a :func:`nested` field (a subclass of the spec, of the same name, whose fields carry
    the config's defaults, paper values and narrowing) and the config's FieldInfo for it."""
    spec = group.spec
    written = annotation.replace(" ", "") if isinstance(annotation, str) else annotation
    if written not in (spec.__name__, spec):
        raise TypeError(f"{owner.__name__}.{name}: a nested {spec.__name__} is declared as {spec.__name__} "
                        f"(got {annotation})")
    base = next((b.model_fields[name].annotation for b in owner.__mro__[1:]
                 if name in getattr(b, "model_fields", {}) and is_group(b.model_fields[name])), spec)
    if not issubclass(base, spec):
        raise TypeError(f"{owner.__name__}.{name}: a base config holds {base.__name__} there, not {spec.__name__}")
    annotations, namespace = {}, {}
    for field, s in group.settings.items():
        annotations[field], namespace[field] = _taken_field(base, field, s, None)

    def __eq__(self, other):  # equal to the settings class's instance of the same values (pydantic's compares types)
        if isinstance(other, spec):
            return self.model_dump() == other.model_dump()
        return NotImplemented

    namespace.update(__annotations__=annotations, __module__=owner.__module__, __doc__=spec.__doc__,
                     __qualname__=f"{owner.__qualname__}.{name}", __eq__=__eq__, __hash__=base.__hash__,
                     model_config=ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False))
    settings_cls = type(spec.__name__, (base,), namespace)
    return settings_cls, Field(default_factory=settings_cls, description=group.description)


class EngineGrid(NamedTuple):
    """A list of values of one engine field (a sweep grid), declared by :func:`engine_grid`."""

    spec: type
    name: str
    default: Any
    description: str
    paper: Any = None
    paper_note: str | None = None
    bounds: dict | None = None


def engine_grid(spec: type[BaseModel], name: str, default: list, description: str, *, paper: Any = None,
                paper_note: str | None = None, **bounds: Any) -> EngineGrid:
    """A config field holding several values of the engine field ``name`` (a sweep grid), each element of the
    engine field's type and within its bounds.

    Declared in a config's body with its list type, ``w_inits_m: list[float] = engine_grid(LinregSettings,
    "w_init", [1e-6, 1e-3, 1.0], "ATTN_M init scales w_init (eq 34), increasing")``: the field keeps its own
    name, description and paper value (a grid is not the field), and :class:`ExperimentConfig` gives its elements
    the engine field's type and bounds, narrowed by ``bounds``. What a grid needs beyond that (distinct,
    increasing, at least some length) stays the config's own validator.

    Args:
        spec: the engine's pydantic specification (e.g. :class:`iclab.engines.linreg.LinregSettings`).
        name: the engine field whose values the list holds.
        default: our default list.
        description: what the grid is, in the paper's terms.
        paper: the paper's (or its reference code's) list; None when it gives none.
        paper_note: where the paper's value comes from, or that the paper leaves it unspecified.
        bounds: ge, gt, le, lt of each element, narrower than the engine field's.
    Returns:
        The :class:`EngineGrid`, which :class:`ExperimentConfig` expands when the class is created.
    Raises:
        TypeError: a name that is not a field of ``spec``.
    """
    if name not in spec.model_fields:
        raise TypeError(f"{name!r} is not a field of {spec.__name__}")
    return EngineGrid(spec, name, list(default), description, paper, paper_note, bounds or None)


_LOWER, _UPPER = ("ge", "gt"), ("le", "lt")


def _engine_bounds(info: FieldInfo) -> dict:
    return {attr: getattr(meta, attr) for meta in info.metadata for attr in _LOWER + _UPPER
            if getattr(meta, attr, None) is not None}


def _without_none(annotation):
    """``annotation`` without None (``int | None`` → ``int``)."""
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation):
        rest = tuple(a for a in get_args(annotation) if a is not type(None))
        return rest[0] if len(rest) == 1 else Union[rest]
    return annotation


def _narrowed(spec: type[BaseModel], name: str, bounds: dict, narrower: dict | None) -> dict:
    """``bounds`` (the engine's, or a base config's) replaced side by side by ``narrower``, which may only narrow
    them; ordered ge, gt, le, lt."""
    bounds = dict(bounds)
    for attr, value in (narrower or {}).items():
        side = _LOWER if attr in _LOWER else _UPPER if attr in _UPPER else None
        if side is None:
            raise TypeError(f"{name}: bounds are ge, gt, le, lt (got {attr})")
        engine = [bounds[a] for a in side if a in bounds]
        if engine and (value < engine[0] if side is _LOWER else value > engine[0]):
            raise TypeError(f"{name}: {attr} = {value} is wider than {spec.__name__}'s bound {engine[0]}")
        for a in side:
            bounds.pop(a, None)
        bounds[attr] = value
    return {a: bounds[a] for a in _LOWER + _UPPER if a in bounds}


def _taken_field(spec: type[BaseModel], name: str, s: Setting, inherited: FieldInfo | None,
                 label: str | None = None) -> tuple[Any, FieldInfo]:
    """The annotation and FieldInfo of ``spec``'s field ``name`` with the config's default, paper value and narrowing
    (of the engine's bounds and choices, or of those a base config took when it re-takes the field), its description
    prefixed ``"{label}: "`` when the field is taken under a suffix."""
    info = spec.model_fields[name]
    annotation = info.annotation if inherited is None else inherited.annotation
    if s.default is not None:
        annotation = _without_none(annotation)
    if s.choices is not None:
        allowed = get_args(annotation) if get_origin(annotation) is Literal else ()
        if not s.choices or not set(s.choices) <= set(allowed):
            raise TypeError(f"{name}: choices must be some of {spec.__name__}'s {', '.join(map(str, allowed)) or 'none'}")
        annotation = Literal[s.choices]
    ordered = _narrowed(spec, name, _engine_bounds(info if inherited is None else inherited), s.bounds)
    extra = {"paper": s.paper, "paper_note": s.paper_note}
    description = info.description if label is None else f"{label}: {info.description}"
    return annotation, Field(s.default, description=description, json_schema_extra=extra, **ordered)


def _grid_field(grid: EngineGrid, field: str, annotation: Any) -> tuple[Any, FieldInfo]:
    """The annotation ``list[Annotated[T, bounds]]`` (T and bounds the engine field's, narrowed) and FieldInfo of a
    config's grid field ``field``, declared as ``list[T]``."""
    info = grid.spec.model_fields[grid.name]
    element = _without_none(info.annotation)
    written = annotation.replace(" ", "") if isinstance(annotation, str) else annotation
    if written not in (f"list[{getattr(element, '__name__', element)}]", list[element]):
        raise TypeError(f"{field}: a grid of {grid.spec.__name__}.{grid.name} is declared as "
                        f"list[{getattr(element, '__name__', element)}] (got {annotation})")
    ordered = _narrowed(grid.spec, f"{field} (elements)", _engine_bounds(info), grid.bounds)
    extra = {"paper": grid.paper, "paper_note": grid.paper_note}
    return list[Annotated[element, Field(**ordered)]], Field(grid.default, description=grid.description,
                                                             json_schema_extra=extra)


class ExperimentConfig(BaseModel):
    """Fields shared by every experiment: the base seed and the number of seeds run (vmapped).

    Every config refuses unknown fields, NaN and ±inf in any float field or list element, booleans given
    for numbers (``--set N=true`` is an error, not N = 1) and strings given for numbers (``{"H": "7"}`` from
    Python is an error, not H = 7: the CLI reads ``--set H=7`` as the number already).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    def __init_subclass__(cls, **kwargs):
        # Before pydantic collects the fields: each engine_fields group becomes fields at its place in the class
        # body (named field + suffix), with the engine's type, bounds and description, and each engine_grid field
        # a list of elements of the engine field's type and bounds. __engine_fields__ records where each came from
        # ({config field: (spec, engine field)}, this class's own) and __engine_grids__ likewise the grids
        # (tests/experiments/test_config_fields.py walks them).
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__annotations__", {})
        expanded, taken, grids, groups, nests = {}, {}, {}, [], {}
        for name, annotation in own.items():
            group = cls.__dict__.get(name)
            expanded[name] = annotation
            if isinstance(group, EngineGrid):
                expanded[name], info = _grid_field(group, name, annotation)
                setattr(cls, name, info)
                grids[name] = (group.spec, group.name)
                continue
            if isinstance(group, Nested):
                expanded[name], info = _nested_field(cls, name, group, annotation)
                setattr(cls, name, info)
                nests[name] = group.spec
                continue
            if not isinstance(group, EngineFields):
                continue
            for engine_name, s in group.items():
                field = group.prefix + engine_name + group.suffix
                if field in own or field in taken:
                    raise TypeError(f"{cls.__name__}.{field} is declared twice: by hand and taken from "
                                    f"{group.spec.__name__}")
                inherited = next((base.model_fields[field] for base in cls.__mro__[1:]
                                  if field in vars(base).get("__engine_fields__", {})), None)
                expanded[field], info = _taken_field(group.spec, engine_name, s, inherited, group.label)
                setattr(cls, field, info)
                taken[field] = (group.spec, engine_name)
            if (group.spec, group.prefix, group.suffix) not in groups:
                groups.append((group.spec, group.prefix, group.suffix))
        if taken or grids or nests:
            own.clear()
            own.update(expanded)
        cls.__engine_fields__ = taken  # this class's own: a subclass that declares a field by hand is not covered
        cls.__engine_grids__ = grids
        cls.__nested__ = nests  # {field: settings class}, this class's own nested() groups
        cls.__engine_groups__ = groups  # (spec, prefix, suffix), this class's own; the validator walks the MRO

    def taken(self, spec: type[BaseModel], *, prefix: str = "", suffix: str = "") -> BaseModel:
        """The settings this config takes from ``spec`` (:func:`engine_fields`) as one validated ``spec``: the
        config composes them, ``config.taken(Spec, prefix="toy_")`` gives them as one ``Spec``.

        Fields of ``spec`` the config does not take keep the spec's defaults (a spec with required fields needs
        them taken). The spec's own validators (those relating two of its fields) run on the config's values when
        the config is created, their one-line message naming the fields by the config's names (a spec's message
        names its fields by their own).

        Args:
            spec: the pydantic specification the fields were taken from.
            prefix: the group's prefix (``transformer_``); empty for fields taken under the engine's names.
            suffix: the group's suffix (``_m``).
        Returns:
            The ``spec`` instance.
        Raises:
            ValueError: the spec refuses the combination (one line).
        """
        fields = type(self).model_fields
        names = {name: prefix + name + suffix for name in spec.model_fields if prefix + name + suffix in fields}
        try:
            return spec(**{name: getattr(self, field) for name, field in names.items()})
        except ValidationError as err:
            message = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(renamed(message, names)) from None

    @model_validator(mode="after")
    def _taken_settings(self):
        # the validators of a spec that relate two of its fields (each field's own bounds were checked as the
        # config's), where the config takes every field the spec requires (not a per-run spec: LinregTraining)
        fields = type(self).model_fields
        for spec, prefix, suffix in dict.fromkeys(g for c in reversed(type(self).__mro__)
                                                  for g in vars(c).get("__engine_groups__", ())):
            if spec.__pydantic_decorators__.model_validators and all(
                    prefix + name + suffix in fields for name, info in spec.model_fields.items() if info.is_required()):
                self.taken(spec, prefix=prefix, suffix=suffix)
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data):
        # dotted names (transformer.width) gathered into their settings group first; each field, a group's
        # included, refuses booleans and strings where it holds numbers
        if isinstance(data, dict):
            data = nested_values(cls, data)
            fields = flat_fields(cls)
            for name, value in flat_values(cls, data).items():
                info = fields.get(name)
                if info is not None and _contains_bool(value) and not _admits_bool(info.annotation):
                    kind = "hold numbers, not booleans" if isinstance(value, (list, tuple)) else "be a number, not a boolean"
                    raise ValueError(f"{name} must {kind} (got {json.dumps(value)[:80]})")
                if info is not None and _contains_str(value) and not _admits_str(info.annotation):
                    kind = "hold numbers, not strings" if isinstance(value, (list, tuple)) else "be a number, not a string"
                    raise ValueError(f"{name} must {kind} (got {json.dumps(value, default=repr)[:80]})")
        return data

    seed: int = param(0, "base PRNG seed; seed s of a run uses fold_in(PRNGKey(seed), s)", ge=0, le=2**31 - 1)
    seeds: int = param(1, "number of independent seeds (init and data), run together with vmap", ge=1, le=1024)


def _contains_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, (list, tuple)) and any(_contains_bool(v) for v in value)


def _contains_str(value) -> bool:
    if isinstance(value, (str, bytes)):
        return True
    return isinstance(value, (list, tuple)) and any(_contains_str(v) for v in value)


def _admits_str(annotation) -> bool:
    """Whether a field's type takes strings anywhere in it (str, a Literal of strings, a path, or a container or
    union of one)."""
    if annotation is Any or (isinstance(annotation, type) and issubclass(annotation, (str, os.PathLike))):
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    return any(_admits_str(a) for a in get_args(annotation) if a is not Ellipsis)


def _admits_bool(annotation) -> bool:
    """Whether a field's type takes booleans (bool itself, a Literal of booleans, or a union with one)."""
    if annotation is bool:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return any(_admits_bool(a) for a in get_args(annotation))
    return annotation is Any


def validate_eigenvalues(values: list[float] | None, size: int, size_name: str) -> list[float] | None:
    """Checks a list of covariance eigenvalues: all finite and > 0, ``size`` of them (None passes).

    Args:
        values: the eigenvalues, or None (a config's default spectrum).
        size: the input dimension they must match.
        size_name: that dimension's field name (``D`` or ``d``), named in the error.
    Raises:
        ValueError: one line naming what is wrong.
    """
    if values is None:
        return None
    if len(values) == 0 or any(not (0 < v < float("inf")) for v in values):
        raise ValueError("eigenvalues must all be finite and > 0")
    if len(values) != size:
        raise ValueError(f"eigenvalues must have {size_name} = {size} entries (got {len(values)})")
    return values


class TrainingConfig(ExperimentConfig):
    """An optimiser on the shared time axis t = Σ lr: steps, learning rate and schedule, the optax update
    direction, per-model gradient clipping and the training dtype. Papers redeclare the fields whose
    defaults (and paper values) differ."""

    steps: int = param(1000, "optimiser steps", ge=1, le=10_000_000)
    lr: float = param(1e-3, "learning rate (the peak of the schedule)", gt=0, le=100)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0 over the run")
    optimizer: Literal["gd", "adam", "adamw"] = param("adam", "optimiser: plain GD, Adam, or AdamW (decoupled weight decay)")
    b1: float = param(0.9, "Adam β1", ge=0, lt=1)
    b2: float = param(0.999, "Adam β2", ge=0, lt=1)
    weight_decay: float = param(0.0, "AdamW (decoupled) weight decay (optimizer adamw only)", ge=0, le=10)
    clip_norm: float = param(0.0, "clip each model's gradient to this Euclidean norm before the optimiser (0: off)",
                             ge=0, le=1e6)
    dtype: Literal["float32", "float64"] = param("float32", "training dtype (data, weights, gradients)")

    def schedule(self):
        """The learning rate: the float ``lr``, or an optax schedule of the step (cosine decay)."""
        import optax

        return optax.cosine_decay_schedule(self.lr, self.steps) if self.lr_schedule == "cosine" else self.lr

    def transformation(self):
        """The optax update direction without learning rate (engines apply lr themselves)."""
        import optax

        if self.optimizer == "gd":
            return optax.identity()
        adam = optax.scale_by_adam(b1=self.b1, b2=self.b2)
        if self.optimizer == "adam":
            return adam
        return optax.chain(adam, optax.add_decayed_weights(self.weight_decay))

    def jnp_dtype(self):
        """``dtype`` as a jax.numpy dtype."""
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)


def field_rows(config_cls: type[BaseModel], presets: dict[str, dict]) -> list[dict]:
    """One row per config field: name, type, description, bounds, preset values, paper value; a settings group's
    fields (:func:`nested`) by their dotted names, each row with its ``group`` (name, settings class, description).

    Args:
        config_cls: an experiment's config class.
        presets: preset name -> field overrides.
    """
    rows = []
    symbols = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
    values = {p: flat_values(config_cls, config_cls(**v).model_dump(mode="json")) for p, v in presets.items()}
    for name, info in flat_fields(config_cls).items():
        extra = info.json_schema_extra or {}
        bounds = [f"{sym} {getattr(meta, attr)}" for meta in info.metadata for attr, sym in symbols
                  if getattr(meta, attr, None) is not None]
        annotation = info.annotation
        element = get_args(annotation)[0] if get_origin(annotation) is list and get_args(annotation) else None
        if get_origin(element) is Annotated:  # a grid of an engine field (engine_grid): the elements' bounds
            element, *metadata = get_args(element)
            bounds += [f"each {sym} {getattr(m, attr)}" for info_m in metadata for m in info_m.metadata
                       for attr, sym in symbols if getattr(m, attr, None) is not None]
            annotation = list[element]
        if get_origin(annotation) is Literal:
            type_name = "one of " + ", ".join(str(a) for a in get_args(annotation))
        else:
            type_name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        row = {
            "name": name,
            "type": type_name,
            "description": info.description or "",
            "bounds": ", ".join(bounds),
            "default": info.default,
            "paper_value": extra.get("paper"),
            "paper_note": extra.get("paper_note"),
        }
        row["presets"] = {p: v[name] for p, v in values.items()}
        head = name.partition(".")[0]
        if head != name:  # a settings group's field: the group it belongs to
            group = config_cls.model_fields[head]
            row["group"] = {"name": head, "type": group.annotation.__name__, "description": group.description or ""}
        rows.append(row)
    return rows
