"""The public Python surface: every public module says what it exports (``__all__``), every exported name
imports, and every exported callable documents its arguments."""

import importlib
import inspect
import pkgutil

import pytest

import iclab

# Packages whose public (non-underscore) modules must declare __all__ (the public API's packages, and the
# top-level helpers a notebook uses).
REQUIRED = ("iclab", "iclab.tasks", "iclab.models", "iclab.engines", "iclab.theory", "iclab.experiments", "iclab.baselines",
            "iclab.experiments.checks", "iclab.results", "iclab.ops", "iclab.errors", "iclab.settings")
# Modules that need the optional torch extra.
OPTIONAL = ("iclab.models.gpt2_gla",)


def _public_modules():
    names = list(REQUIRED)
    for pkg in ("iclab.tasks", "iclab.models", "iclab.engines", "iclab.theory"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            if not info.name.startswith("_"):
                names.append(f"{pkg}.{info.name}")
    return sorted(set(names))


MODULES = _public_modules()


def _needs_args(fn) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return any(name not in ("self", "cls") for name in sig.parameters)


def _problems(qualname: str, obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return [f"{qualname}: no docstring"]
    if inspect.isfunction(obj) and _needs_args(obj) and "Args:" not in doc:
        return [f"{qualname}: takes arguments but its docstring has no Args section"]
    return []


@pytest.mark.parametrize("name", MODULES)
def test_every_public_module_exports_documented_names(name):
    if name in OPTIONAL:
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    assert (inspect.getdoc(module) or "").strip(), f"{name} has no module docstring"
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    problems = []
    for attr in exported:
        obj = getattr(module, attr)  # raises if a name in __all__ does not exist
        if inspect.ismodule(obj):
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            problems += _problems(f"{name}.{attr}", obj)
        if inspect.isclass(obj) and obj.__module__.startswith("iclab"):
            for meth_name, meth in vars(obj).items():
                if meth_name.startswith("_") or not inspect.isfunction(meth):
                    continue
                problems += _problems(f"{name}.{attr}.{meth_name}", meth)
    assert not problems, "\n".join(problems)


def test_top_level_surface():
    assert callable(iclab.run_experiment) and callable(iclab.load) and callable(iclab.runs)
    assert callable(iclab.run_sweep)
    with pytest.raises(AttributeError):
        iclab.no_such_name  # noqa: B018
