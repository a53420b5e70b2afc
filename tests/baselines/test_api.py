"""iclab.baselines keeps the public-surface rules of tests/test_public_api.py: a module docstring, an
``__all__`` of importable names, and an Args section in every exported function that takes arguments."""

import inspect

from iclab import baselines


def test_public_surface_is_documented():
    assert (inspect.getdoc(baselines) or "").strip()
    assert len(set(baselines.__all__)) == len(baselines.__all__)
    problems = []
    for name in baselines.__all__:
        obj = getattr(baselines, name)
        doc = inspect.getdoc(obj) or ""
        if not doc.strip():
            problems.append(f"{name}: no docstring")
        elif inspect.isfunction(obj) and inspect.signature(obj).parameters and "Args:" not in doc:
            problems.append(f"{name}: no Args section")
        if inspect.isfunction(obj) and "Returns:" not in doc:
            problems.append(f"{name}: no Returns section")
    assert not problems, "\n".join(problems)


def test_two_floats_in_a_row_are_keyword_only():
    """Issue 18's rule: wherever two or more float settings follow each other, they are keyword-only."""
    for name in baselines.__all__:
        obj = getattr(baselines, name)
        if not inspect.isfunction(obj):
            continue
        params = inspect.signature(obj).parameters.values()
        floats = [p for p in params if isinstance(p.default, float)]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in floats), name
