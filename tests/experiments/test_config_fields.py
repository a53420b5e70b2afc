"""No config field is declared twice: a field of an engine's specification (a pydantic model in
iclab.engines, e.g. LinregTraining's H, w_init, lr, steps, P) that an experiment's config exposes must be
taken from the engine (iclab.experiments.engine_fields, docs/own-experiment.md), keeping the engine's type,
description and (possibly narrowed) bounds, not declared anew with param or Field."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from typing import ClassVar, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, Field

import iclab.engines
from iclab.engines.linreg import LinregSettings, LinregTraining
from iclab.errors import ConfigError
from iclab.experiments import ExperimentConfig, all_experiments, engine_fields, param, setting
from iclab.runner import resolve_config


def engine_specs() -> list[type[BaseModel]]:
    """Every pydantic model defined in a module of iclab.engines."""
    specs = []
    for info in pkgutil.iter_modules(iclab.engines.__path__, "iclab.engines."):
        module = importlib.import_module(info.name)
        specs += [obj for obj in vars(module).values() if inspect.isclass(obj) and issubclass(obj, BaseModel)
                  and obj is not BaseModel and obj.__module__ == module.__name__]
    return specs


def _declaring(cls: type, name: str) -> type:
    """The class of cls's MRO whose own annotations hold ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))


def _bounds(info) -> dict:
    return {a: getattr(m, a) for m in info.metadata for a in ("ge", "gt", "le", "lt") if getattr(m, a, None) is not None}


def duplicated_fields(config: type[BaseModel], spec: type[BaseModel]) -> list[str]:
    """The fields of ``config`` named as a field of ``spec`` but not taken from the engine's declaration."""
    bad = []
    for name in sorted(set(config.model_fields) & set(spec.model_fields)):
        owner = _declaring(config, name)
        if issubclass(owner, BaseModel) and owner.__module__.startswith("iclab.engines"):
            continue  # inherited from the engine's class itself
        source = vars(owner).get("__engine_fields__", {}).get(name)
        if source is None or _declaring(source, name) is not _declaring(spec, name):
            bad.append(f"{owner.__qualname__}.{name} declared anew (not taken from {spec.__name__})")
            continue
        mine, theirs = config.model_fields[name], spec.model_fields[name]
        narrowed = (mine.annotation == theirs.annotation or mine.annotation in get_args(theirs.annotation)
                    or (get_origin(mine.annotation) is Literal
                        and set(get_args(mine.annotation)) <= set(get_args(theirs.annotation))))
        if mine.description != theirs.description or not narrowed:
            bad.append(f"{owner.__qualname__}.{name}: type or description differs from {spec.__name__}'s")
        engine, own = _bounds(theirs), _bounds(mine)
        lower = max((own[a] for a in ("ge", "gt") if a in own), default=None)
        upper = min((own[a] for a in ("le", "lt") if a in own), default=None)
        if any(a in engine and (lower is None or lower < engine[a]) for a in ("ge", "gt")) or \
                any(a in engine and (upper is None or upper > engine[a]) for a in ("le", "lt")):
            bad.append(f"{owner.__qualname__}.{name}: bounds {own} wider than {spec.__name__}'s {engine}")
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
    specs = engine_specs()
    assert LinregTraining in specs and LinregSettings in specs
    checked, bad = set(), []
    for exp_id, exp in all_experiments().items():
        for spec in specs:
            if builds_spec(exp.config, spec):
                shared = set(exp.config.model_fields) & set(spec.model_fields)
                checked |= {(exp_id, name) for name in shared}
                bad += [f"{exp_id}: {b}" for b in duplicated_fields(exp.config, spec)]
    assert not bad, "\n".join(bad)
    # not vacuous: every linattn figure that exposes them takes H, w_init, lr, steps, P, record_every from the engine
    for name in ("H", "w_init", "lr", "steps", "P", "record_every"):
        assert ("linattn.fig1", name) in checked and ("linattn.fig4", name) in checked
    assert {("linattn.fig3", "engine"), ("linattn.fig5", "rho"), ("linattn.fig6", "rtol"), ("linattn.fig7", "R")} <= checked
    assert not any(exp_id.startswith(("drift.", "gating.", "mhsa.")) for exp_id, _ in checked)


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


def test_figure_bounds_and_set_keys_are_kept():
    # fig1 narrows H to ≤ 1024 (the engine allows 100000); Fig11 re-takes H with its own default, keeping AttnS's ≤ 256
    with pytest.raises(ConfigError, match="H"):
        resolve_config("linattn.fig1", "quick", {"H": 2000})
    _, config = resolve_config("linattn.fig1", "quick", {"H": 3, "lr": 0.05})
    assert (config.H, config.lr) == (3, 0.05)
    fig11 = all_experiments()["linattn.fig11"].config
    assert fig11().H == 5 and _bounds(fig11.model_fields["H"])["le"] == 256
