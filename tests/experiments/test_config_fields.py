"""No config field is declared twice: a field of an engine's specification (a pydantic model in
iclab.engines, e.g. LinregTraining's H, w_init, lr, steps, P) that an experiment's config exposes must be
taken from the engine (iclab.experiments.engine_fields, docs/own-experiment.md), keeping the engine's type,
description and (possibly narrowed) bounds, not declared anew with param or Field. The same holds for a
per-model copy under a suffix (H_m, lr_s: engine_fields(..., suffix=, label=)) and for a sweep grid of an
engine field (w_inits_m, heads_m, ranks: engine_grid, whose elements keep the engine field's type and bounds)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
from typing import Annotated, ClassVar, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, Field, ValidationError, model_validator

import iclab.engines
import iclab.models
from iclab.engines.linreg import LinregSettings, LinregTraining
from iclab.errors import ConfigError
from iclab.experiments import ExperimentConfig, all_experiments, engine_fields, engine_grid, param, setting
from iclab.experiments._config import field_rows
from iclab.models.transformer import TransformerSettings
from iclab.runner import resolve_config


def pydantic_models(package) -> list[type[BaseModel]]:
    """Every pydantic model defined in a module of ``package`` (iclab.engines: the engines' specifications, e.g.
    LinregTraining; iclab.models: a model's settings, e.g. TransformerSettings)."""
    specs = []
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        specs += [obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, BaseModel)
                  and obj is not BaseModel and obj.__module__ == module.__name__]
    return specs


def _declaring(cls: type, name: str) -> type:
    """The class of cls's MRO whose own annotations hold ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))


def _bounds(info) -> dict:
    return {a: getattr(m, a) for m in info.metadata for a in ("ge", "gt", "le", "lt") if getattr(m, a, None) is not None}


def _wider(own: dict, engine: dict) -> bool:
    """Whether bounds ``own`` (ge/gt/le/lt) admit a value that the engine's ``engine`` refuse."""
    lower = max((own[a] for a in ("ge", "gt") if a in own), default=None)
    upper = min((own[a] for a in ("le", "lt") if a in own), default=None)
    return any(a in engine and (lower is None or lower < engine[a]) for a in ("ge", "gt")) or \
        any(a in engine and (upper is None or upper > engine[a]) for a in ("le", "lt"))


def duplicated_fields(config: type[BaseModel], spec: type[BaseModel]) -> list[str]:
    """The fields of ``config`` named as a field of ``spec`` but not taken from the engine's declaration."""
    bad = []
    for name in sorted(set(config.model_fields) & set(spec.model_fields)):
        owner = _declaring(config, name)
        if issubclass(owner, BaseModel) and owner.__module__.startswith("iclab.engines"):
            continue  # inherited from the engine's class itself
        source = vars(owner).get("__engine_fields__", {}).get(name)
        if source is None or source[1] != name or _declaring(source[0], name) is not _declaring(spec, name):
            bad.append(f"{owner.__qualname__}.{name} declared anew (not taken from {spec.__name__})")
            continue
        mine, theirs = config.model_fields[name], spec.model_fields[name]
        narrowed = (mine.annotation == theirs.annotation or mine.annotation in get_args(theirs.annotation)
                    or (get_origin(mine.annotation) is Literal
                        and set(get_args(mine.annotation)) <= set(get_args(theirs.annotation))))
        if mine.description != theirs.description or not narrowed:
            bad.append(f"{owner.__qualname__}.{name}: type or description differs from {spec.__name__}'s")
        engine, own = _bounds(theirs), _bounds(mine)
        if _wider(own, engine):
            bad.append(f"{owner.__qualname__}.{name}: bounds {own} wider than {spec.__name__}'s {engine}")
    return bad


# The plural of an engine field's name in a grid's name: its name + "s" (w_inits), or these English words.
PLURALS = {"H": "heads", "R": "ranks"}
SUFFIX = r"_[a-z][a-z0-9]*"  # a model's tag, as engine_fields allows: _m, _s, _a, _attn, ...
def prefix_of(spec: type[BaseModel]) -> str:
    """The prefix a model's settings go under: TransformerSettings -> transformer_ (other models' fields, e.g.
    softmax_heads beside the transformer, are their own)."""
    return spec.__name__.removesuffix("Settings").lower() + "_"
# Fields whose name is an engine field's with a suffix but which are another thing, each with the reason.
NOT_COPIES = {"Fig14Config.P_test": "the size of each test set (linattn.fig14), not training prompts"}


def copy_of(name: str, spec: type[BaseModel]) -> tuple[str, str] | None:
    """("suffixed" | "grid", engine field) when ``name`` is a field of ``spec`` under a suffix (lr_m) or prefix
    (transformer_layers) or a plural of one with or without a suffix (w_inits_m, heads_m, ranks); None otherwise."""
    for field in spec.model_fields:
        if re.fullmatch(re.escape(field) + SUFFIX, name) or name == prefix_of(spec) + field:
            return "suffixed", field
        plural = PLURALS.get(field, field + "s")
        if re.fullmatch(re.escape(plural) + f"({SUFFIX})?", name):
            return "grid", field
    return None


def copied_fields(config: type[BaseModel], spec: type[BaseModel]) -> list[str]:
    """The fields of ``config`` that are a suffixed copy or a grid of a field of ``spec`` (:func:`copy_of`) but not
    taken from the engine's declaration with engine_fields(..., suffix=) or engine_grid, or that widen the
    engine's type or bounds."""
    bad = []
    for name in sorted(config.model_fields):
        kind_field = copy_of(name, spec)
        if kind_field is None:
            continue
        kind, field = kind_field
        owner = _declaring(config, name)
        if f"{owner.__qualname__}.{name}" in NOT_COPIES:
            continue
        record = "__engine_fields__" if kind == "suffixed" else "__engine_grids__"
        source = vars(owner).get(record, {}).get(name)
        if source is None or source[1] != field or _declaring(source[0], field) is not _declaring(spec, field):
            how = "engine_fields(..., suffix= or prefix=)" if kind == "suffixed" else "engine_grid"
            bad.append(f"{owner.__qualname__}.{name} declared anew (not taken from {spec.__name__}.{field} "
                       f"with {how})")
            continue
        mine, theirs = config.model_fields[name], spec.model_fields[field]
        if kind == "suffixed":
            own_type, own_bounds = mine.annotation, _bounds(mine)
            if not (mine.description or "").endswith(": " + theirs.description):
                bad.append(f"{owner.__qualname__}.{name}: description is not '<label>: ' + {spec.__name__}'s")
        else:
            (element,) = get_args(mine.annotation) if get_origin(mine.annotation) is list else (None,)
            own_type, *metadata = get_args(element) if get_origin(element) is Annotated else (element,)
            own_bounds = {a: v for info in metadata for a, v in _bounds(info).items()}
        if not (own_type == theirs.annotation or own_type in get_args(theirs.annotation)):
            bad.append(f"{owner.__qualname__}.{name}: type {own_type} is not {spec.__name__}.{field}'s")
        engine = _bounds(theirs)
        if _wider(own_bounds, engine):
            bad.append(f"{owner.__qualname__}.{name}: bounds {own_bounds} wider than {spec.__name__}.{field}'s {engine}")
    return bad


def builds_spec(config: type[BaseModel], spec: type[BaseModel]) -> bool:
    """Whether a module of the config's paper package (or its own module) refers to the spec's module: then its
    fields with the spec's names are the spec's (drift, gating and mhsa train by other engines, whose lr, steps
    and H are their own)."""
    package = config.__module__.rsplit(".", 1)[0] if config.__module__.startswith("iclab.experiments.") \
        else config.__module__
    for name, module in list(sys.modules.items()):
        if module is None or not (name == config.__module__ or name.startswith(package + ".")):
            continue
        for value in vars(module).values():
            if getattr(value, "__name__", None) == spec.__module__ or getattr(value, "__module__", None) == spec.__module__:
                return True
    return False


def test_no_experiment_config_redeclares_an_engine_field():
    specs = pydantic_models(iclab.engines) + pydantic_models(iclab.models)
    assert LinregTraining in specs and LinregSettings in specs and TransformerSettings in specs
    checked, copies, exempt, bad = set(), set(), set(), []
    for exp_id, exp in all_experiments().items():
        for spec in specs:
            if builds_spec(exp.config, spec):
                shared = set(exp.config.model_fields) & set(spec.model_fields)
                checked |= {(exp_id, name) for name in shared}
                for name in exp.config.model_fields:
                    if copy_of(name, spec) is not None:
                        qualname = f"{_declaring(exp.config, name).__qualname__}.{name}"
                        if qualname in NOT_COPIES:
                            exempt.add(qualname)
                        else:
                            copies.add((exp_id, name))
                bad += [f"{exp_id}: {b}" for b in duplicated_fields(exp.config, spec) + copied_fields(exp.config, spec)]
    assert not bad, "\n".join(bad)
    # not vacuous: every linattn figure that exposes them takes H, w_init, lr, steps, P, record_every from the engine
    for name in ("H", "w_init", "lr", "steps", "P", "record_every"):
        assert ("linattn.fig1", name) in checked and ("linattn.fig4", name) in checked
    assert {("linattn.fig3", "engine"), ("linattn.fig5", "rho"), ("linattn.fig6", "rtol"), ("linattn.fig7", "R")} <= checked
    assert not any(exp_id.startswith(("drift.", "gating.", "mhsa.")) for exp_id, _ in checked)
    # ... and the figures that train two models side by side take each model's copies and grids from it too
    for fig, names in {"linattn.fig5": ("H", "w_init", "lr", "steps"), "linattn.fig6": ("H",),
                       "linattn.fig7": ("H", "w_init", "lr", "steps", "record_every"),
                       "linattn.fig8": ("w_init", "lr", "steps", "record_every")}.items():
        assert {(fig, f"{name}{suffix}") for name in names for suffix in ("_m", "_s")} <= copies
    assert {("linattn.fig6", "w_inits_m"), ("linattn.fig6", "w_inits_s"), ("linattn.fig8", "heads_m"),
            ("linattn.fig8", "ranks_s"), ("linattn.fig8", "H_s")} <= copies
    assert {(f"linattn.fig{n}", "ranks") for n in (4, 11, 12, 13)} <= copies
    # ... and both lab experiments that train the transformer hold its settings whole, a TransformerSettings
    # (nested), with no field of it copied beside
    for exp_id in ("lab.task_diversity", "lab.drift_families"):
        fields = all_experiments()[exp_id].config.model_fields
        assert issubclass(fields["transformer"].annotation, TransformerSettings)
        assert not {name for name in fields if copy_of(name, TransformerSettings) is not None}
    assert set(NOT_COPIES) <= exempt  # each exemption is still in use


def test_the_check_fails_on_duplicated_toy_configs():
    class Redeclared(ExperimentConfig):
        H: int = param(8, "attention heads H", ge=1, le=1024)

    class Copied(ExperimentConfig):  # a word-for-word copy of the engine's declaration is still a second one
        H: int = Field(8, ge=1, le=100_000, description=LinregSettings.model_fields["H"].description)

    class Taken(ExperimentConfig):
        linreg: ClassVar = engine_fields(LinregSettings, H=setting(8, paper=8, le=1024), lr=setting(0.1))

    class RedeclaredBelow(Taken):  # a subclass declaring by hand what its base took
        lr: float = param(0.2, "learning rate", gt=0, le=10)

    assert duplicated_fields(Redeclared, LinregTraining) == ["test_the_check_fails_on_duplicated_toy_configs.<locals>."
                                                            "Redeclared.H declared anew (not taken from LinregTraining)"]
    assert len(duplicated_fields(Copied, LinregSettings)) == 1
    assert duplicated_fields(Taken, LinregTraining) == []
    assert [b.split(".")[-1] for b in duplicated_fields(RedeclaredBelow, LinregTraining)] == [
        "lr declared anew (not taken from LinregTraining)"]


def test_the_check_fails_on_suffixed_copies_and_grids_declared_by_hand():
    class HandSuffixed(ExperimentConfig):  # Fig 5 as it was: a model's copy declared anew, its own bounds
        H_m: int = param(8, "softmax ATTN_M heads", ge=1, le=1024)
        lr_s: float = param(0.2, "ATTN_S GD learning rate", gt=0, le=10)

    class HandGrid(ExperimentConfig):  # grids of an engine field with no (or their own) element bounds
        w_inits_m: list[float] = param([1e-6, 1.0], "ATTN_M init scales")
        ranks: list[int] = param([1, 2], "ranks R, one panel each")

    class Taken(ExperimentConfig):
        attn_m: ClassVar = engine_fields(LinregSettings, suffix="_m", label="ATTN_M", H=setting(8, le=1024),
                                         lr=setting(0.1, le=10))
        w_inits_m: list[float] = engine_grid(LinregSettings, "w_init", [1e-6, 1.0], "ATTN_M init scales", le=10)
        heads_a: list[int] = engine_grid(LinregTraining, "H", [1, 2], "panels: heads H of each")

    class RedeclaredBelow(Taken):  # a subclass declaring by hand what its base took under a suffix
        lr_m: float = param(0.2, "ATTN_M: " + LinregSettings.model_fields["lr"].description, gt=0, le=10)

    class WrongSource(ExperimentConfig):  # taken under a suffix, but another field's declaration
        attn_m: ClassVar = engine_fields(LinregSettings, suffix="_m", label="ATTN_M", steps=setting(10))
        steps_x: int = param(10, "ATTN_X steps", ge=1)

    def local(bad):  # the messages without the test function's qualname
        return sorted(b.split("<locals>.", 1)[-1] for b in bad)

    assert local(copied_fields(HandSuffixed, LinregTraining)) == [
        "HandSuffixed.H_m declared anew (not taken from LinregTraining.H with engine_fields(..., suffix= or prefix=))",
        "HandSuffixed.lr_s declared anew (not taken from LinregTraining.lr with engine_fields(..., suffix= or prefix=))"]
    assert local(copied_fields(HandGrid, LinregSettings)) == [
        "HandGrid.ranks declared anew (not taken from LinregSettings.R with engine_grid)",
        "HandGrid.w_inits_m declared anew (not taken from LinregSettings.w_init with engine_grid)"]
    assert copied_fields(Taken, LinregTraining) == [] and copied_fields(Taken, LinregSettings) == []
    assert local(copied_fields(RedeclaredBelow, LinregSettings)) == [
        "RedeclaredBelow.lr_m declared anew (not taken from LinregSettings.lr with engine_fields(..., suffix= or prefix=))"]
    assert local(copied_fields(WrongSource, LinregSettings)) == [
        "WrongSource.steps_x declared anew (not taken from LinregSettings.steps with engine_fields(..., suffix= or prefix=))"]
    # a hand declaration that records itself as taken still fails on its description, type and bounds
    class Impostor(ExperimentConfig):
        lr_x: float = param(0.1, "ATTN_X GD learning rate", gt=0, le=1e9)
        ranks: list[float] = param([1.0], "ranks")

    Impostor.__engine_fields__ = {"lr_x": (LinregSettings, "lr")}
    Impostor.__engine_grids__ = {"ranks": (LinregSettings, "R")}
    assert local(copied_fields(Impostor, LinregSettings)) == sorted([
        "Impostor.ranks: type <class 'float'> is not LinregSettings.R's",
        "Impostor.ranks: bounds {} wider than LinregSettings.R's {'ge': 1, 'le': 1024}",
        "Impostor.lr_x: description is not '<label>: ' + LinregSettings's",
        "Impostor.lr_x: bounds {'gt': 0, 'le': 1000000000.0} wider than LinregSettings.lr's {'gt': 0, 'le': 1000000.0}"])
    # what the detector counts as a copy, and what not
    assert copy_of("record_every_s", LinregSettings) == ("suffixed", "record_every")
    assert copy_of("heads_m", LinregSettings) == ("grid", "H") and copy_of("ranks", LinregSettings) == ("grid", "R")
    assert copy_of("rtols", LinregSettings) == ("grid", "rtol")
    assert copy_of("t_max_m", LinregSettings) is None and copy_of("Hm", LinregSettings) is None
    assert copy_of("P_test", LinregSettings) == ("suffixed", "P")  # caught, then exempted (NOT_COPIES)


def test_the_check_fails_on_a_models_settings_declared_by_hand_under_a_prefix():
    class HandTransformer(ExperimentConfig):  # lab.drift_families as it was: the transformer's sizes declared anew
        transformer_layers: int = param(2, "transformer blocks", ge=1, le=64)
        transformer_w_init: float = param(0.02, "transformer weights' init std", gt=0, le=10)

    class TakenTransformer(ExperimentConfig):
        transformer_settings: ClassVar = engine_fields(TransformerSettings, prefix="transformer_", label="transformer",
                                                       layers=setting(2), w_init=setting(0.02, le=1))

    bad = sorted(b.split("<locals>.", 1)[-1] for b in copied_fields(HandTransformer, TransformerSettings))
    assert bad == [
        "HandTransformer.transformer_layers declared anew (not taken from TransformerSettings.layers with "
        "engine_fields(..., suffix= or prefix=))",
        "HandTransformer.transformer_w_init declared anew (not taken from TransformerSettings.w_init with "
        "engine_fields(..., suffix= or prefix=))"]
    assert copied_fields(TakenTransformer, TransformerSettings) == []
    assert TakenTransformer.model_fields["transformer_layers"].description == \
        "transformer: " + TransformerSettings.model_fields["layers"].description
    assert copy_of("transformer_heads", TransformerSettings) == ("suffixed", "heads")
    with pytest.raises(TypeError, match="prefix must be"):
        engine_fields(TransformerSettings, prefix="Transformer", label="transformer", layers=setting(2))
    with pytest.raises(TypeError, match="together"):
        engine_fields(TransformerSettings, prefix="transformer_", layers=setting(2))


def test_a_config_composes_the_settings_it_takes_and_runs_their_validators():
    class Pair(BaseModel):  # a toy model's settings with a validator relating two fields, one field not taken
        width: int = Field(8, ge=1)
        heads: int = Field(2, ge=1)
        depth: int = Field(3, ge=1)

        @model_validator(mode="after")
        def _divides(self):
            if self.width % self.heads:
                raise ValueError(f"width must be a multiple of heads = {self.heads} (got {self.width})")
            return self

    class Toy(ExperimentConfig):
        model: ClassVar = engine_fields(Pair, prefix="toy_", label="toy", width=setting(12), heads=setting(3))
        engine: ClassVar = engine_fields(LinregSettings, H=setting(4))  # LinregSettings requires fields not taken

    assert Toy().taken(Pair, prefix="toy_") == Pair(width=12, heads=3, depth=3)
    with pytest.raises(ValidationError, match=r"toy_width must be a multiple of toy_heads = 3 \(got 13\)"):
        Toy(toy_width=13)  # the spec's message, in the config's names
    assert Toy(H=7).H == 7  # LinregSettings (fields required and not taken) is not built
    # each lab experiment holds its transformer's settings whole (nested), refused in the dotted names
    for exp in ("lab.task_diversity", "lab.drift_families"):
        _, config = resolve_config(exp, "quick", {"transformer.layers": 3})
        assert isinstance(config.transformer, TransformerSettings) and config.transformer.layers == 3
    with pytest.raises(ConfigError, match=r"transformer.width must be a multiple of transformer.heads = 5 \(got 16\)"):
        resolve_config("lab.drift_families", "quick", {"transformer.heads": 5})


def test_suffixed_fields_and_grids_keep_the_engine_declaration():
    class Toy(ExperimentConfig):
        N: int = param(31, "context pairs per prompt N", ge=1)
        attn_m: ClassVar = engine_fields(LinregSettings, suffix="_m", label="softmax ATTN_M",
                                         H=setting(8, paper=9, paper_note="caption", le=1024), P=setting(500))
        ranks_s: list[int] = engine_grid(LinregSettings, "R", [1, 2], "ATTN_S panels: rank R of each", paper=[1, 2],
                                         le=8)
        attn_s: ClassVar = engine_fields(LinregSettings, suffix="_s", label="ATTN_S", H=setting(4))

    assert list(Toy.model_fields) == ["seed", "seeds", "N", "H_m", "P_m", "ranks_s", "H_s"]  # at their places
    H = Toy.model_fields["H_m"]
    assert (H.annotation, H.default) == (int, 8)
    assert H.description == "softmax ATTN_M: " + LinregSettings.model_fields["H"].description
    assert H.json_schema_extra == {"paper": 9, "paper_note": "caption"} and _bounds(H) == {"ge": 1, "le": 1024}
    assert _bounds(Toy.model_fields["H_s"]) == {"ge": 1, "le": 100_000}  # the engine's own
    assert Toy.model_fields["P_m"].annotation is int
    assert Toy.__engine_fields__ == {"H_m": (LinregSettings, "H"), "P_m": (LinregSettings, "P"),
                                     "H_s": (LinregSettings, "H")}
    assert Toy.__engine_grids__ == {"ranks_s": (LinregSettings, "R")}
    assert Toy(H_m=1024).H_m == 1024 and Toy(ranks_s=[8, 3]).ranks_s == [8, 3]
    for bad in ({"H_m": 1025}, {"H_s": 0}, {"P_m": None}, {"ranks_s": [0]}, {"ranks_s": [9]}, {"ranks_s": [1.5]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Toy(**bad)
    rows = {r["name"]: r for r in field_rows(Toy, {"quick": {"ranks_s": [2]}})}
    assert (rows["ranks_s"]["type"], rows["ranks_s"]["bounds"]) == ("list", "each ≥ 1, each ≤ 8")
    assert rows["ranks_s"]["presets"] == {"quick": [2]} and rows["H_m"]["bounds"] == "≥ 1, ≤ 1024"


def test_taken_fields_keep_the_engine_declaration_with_the_config_default_and_paper_value():
    class Toy(ExperimentConfig):
        N: int = param(31, "context pairs per prompt N", ge=1)
        linreg: ClassVar = engine_fields(LinregTraining, H=setting(8, paper=9, paper_note="caption", le=1024),
                                         P=setting(500), engine=setting("moments", choices=("moments", "sampled")))
        n_eval: int = param(10, "held-out prompts", ge=1)

    class Wider(Toy):
        linreg: ClassVar = engine_fields(LinregSettings, H=setting(5))

    assert list(Toy.model_fields) == ["seed", "seeds", "N", "H", "P", "engine", "n_eval"]  # at the group's place
    H = Toy.model_fields["H"]
    assert (H.annotation, H.default, H.description) == (int, 8, LinregSettings.model_fields["H"].description)
    assert H.json_schema_extra == {"paper": 9, "paper_note": "caption"} and _bounds(H) == {"ge": 1, "le": 1024}
    assert Toy.model_fields["P"].annotation is int  # the engine's int | None, without None: a config gives a value
    assert get_args(Toy.model_fields["engine"].annotation) == ("moments", "sampled")
    # a subclass's new default keeps the bounds its base narrowed
    assert Wider().H == 5 and _bounds(Wider.model_fields["H"]) == {"ge": 1, "le": 1024}
    with pytest.raises(ValueError, match="H"):
        Wider(H=2000)
    spec = LinregTraining.of(Toy(), model="attn_m", w_init=0.1, lr=0.1, steps=1)
    assert (spec.H, spec.P, spec.engine, spec.lr) == (8, 500, "moments", 0.1)


def test_engine_fields_refuses_what_the_engine_does_not_declare_or_allow():
    with pytest.raises(TypeError, match="'Hx' is not a field of LinregSettings"):
        engine_fields(LinregSettings, Hx=setting(1))
    with pytest.raises(TypeError, match="wider than LinregSettings's bound"):
        class Wide(ExperimentConfig):
            linreg: ClassVar = engine_fields(LinregSettings, lr=setting(0.1, le=1e9))
    with pytest.raises(TypeError, match="choices must be some of"):
        class Gf(ExperimentConfig):
            linreg: ClassVar = engine_fields(LinregTraining, engine=setting("gf", choices=("gf",)))
    with pytest.raises(TypeError, match="declared twice"):
        class Twice(ExperimentConfig):
            H: int = param(8, "heads", ge=1)
            linreg: ClassVar = engine_fields(LinregSettings, H=setting(8))
    with pytest.raises(TypeError, match="declared twice"):
        class TwiceSuffixed(ExperimentConfig):
            H_m: int = param(8, "ATTN_M heads", ge=1)
            attn_m: ClassVar = engine_fields(LinregSettings, suffix="_m", label="ATTN_M", H=setting(8))
    with pytest.raises(TypeError, match="suffix or prefix and a label together"):
        engine_fields(LinregSettings, suffix="_m", H=setting(8))
    with pytest.raises(TypeError, match="suffix or prefix and a label together"):
        engine_fields(LinregSettings, label="ATTN_M", H=setting(8))
    with pytest.raises(TypeError, match="suffix must be '_' then lowercase"):
        engine_fields(LinregSettings, suffix="M", label="ATTN_M", H=setting(8))
    with pytest.raises(TypeError, match="wider than LinregSettings's bound"):
        class WideSuffixed(ExperimentConfig):
            attn_m: ClassVar = engine_fields(LinregSettings, suffix="_m", label="ATTN_M", w_init=setting(0.1, le=1e4))
    with pytest.raises(TypeError, match="'Hx' is not a field of LinregSettings"):
        engine_grid(LinregSettings, "Hx", [1], "heads")
    with pytest.raises(TypeError, match=r"ranks \(elements\): ge = 0 is wider than LinregSettings's bound 1"):
        class WideGrid(ExperimentConfig):
            ranks: list[int] = engine_grid(LinregSettings, "R", [1], "ranks", ge=0)
    with pytest.raises(TypeError, match=r"is declared as list\[float\]"):
        class WrongType(ExperimentConfig):
            w_inits: list[int] = engine_grid(LinregSettings, "w_init", [1], "inits")


def test_figure_bounds_and_set_keys_are_kept():
    # fig1 narrows H to ≤ 1024 (the engine allows 100000); Fig11 re-takes H with its own default, keeping AttnS's ≤ 256
    with pytest.raises(ConfigError, match="H"):
        resolve_config("linattn.fig1", "quick", {"H": 2000})
    _, config = resolve_config("linattn.fig1", "quick", {"H": 3, "lr": 0.05})
    assert (config.H, config.lr) == (3, 0.05)
    fig11 = all_experiments()["linattn.fig11"].config
    assert fig11().H == 5 and _bounds(fig11.model_fields["H"])["le"] == 256
    # a model's copy keeps the figure's narrowing; a grid's elements the engine's bounds, one line naming the element
    with pytest.raises(ConfigError, match=r"^linattn.fig5: H_m must be ≥ 1 and ≤ 1024 \(got 2000\)$"):
        resolve_config("linattn.fig5", "quick", {"H_m": 2000})
    with pytest.raises(ConfigError, match=r"^linattn.fig8: ranks_s.0 must be ≥ 1 \(got 0\)$"):
        resolve_config("linattn.fig8", "quick", {"ranks_s": [0, 2]})
    with pytest.raises(ConfigError, match=r"^linattn.fig6: w_inits_m.3 must be ≤ 1000.0 \(got 10000.0\)$"):
        resolve_config("linattn.fig6", "quick", {"w_inits_m": [1e-6, 1e-4, 1e-2, 1e4]})
