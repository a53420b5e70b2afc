"""Config fields by their dotted names: a config composes settings objects (a model's, a task's), each a field
whose type is a pydantic model, and its fields are named ``group.field`` everywhere a user names a field:
``--set transformer.width=64``, a preset's ``{"transformer.width": 64}``, a sweep grid's key, ``iclab show``'s
rows, an export's columns, a report's reproduce command.

A config with no settings group has only plain names, and every function here is the identity on it. Standard
library and pydantic only: :mod:`iclab.errors` reads the bounds of a dotted field with :func:`field_info`, and the
report reads stored configs (data, not code) with :func:`flat_config`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["field_info", "flat_config", "flat_fields", "flat_values", "is_group", "nested_values", "renamed"]


def is_group(info: FieldInfo) -> bool:
    """Whether a field holds a settings object (its type is a pydantic model).

    Args:
        info: the field's pydantic FieldInfo.
    Returns:
        True for a settings group.
    """
    annotation = info.annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def flat_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every field of ``model`` by its dotted name, a settings group's fields in its place (``transformer.width``).

    Args:
        model: a pydantic model class (an experiment's config).
    Returns:
        {dotted name: FieldInfo}, in declaration order.
    """
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        if is_group(info):
            out.update({f"{name}.{sub}": sub_info for sub, sub_info in flat_fields(info.annotation).items()})
        else:
            out[name] = info
    return out


def field_info(model: type[BaseModel], loc: Iterable[Any]) -> FieldInfo | None:
    """The FieldInfo at a pydantic error location (``("transformer", "width")``), or None where the location is
    not a field.

    Args:
        model: the validated pydantic model class; loc: the error's location.
    Returns:
        The innermost field's FieldInfo, or None.
    """
    info = None
    for part in loc:
        fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
        info = fields.get(part) if isinstance(part, str) else None
        if info is None:
            return None
        model = info.annotation
    return info


def flat_values(model: type[BaseModel], values: dict) -> dict:
    """``values`` with each settings group given as a dict or object spread into dotted names (``{"transformer":
    {"width": 64}}`` → ``{"transformer.width": 64}``), so that one mapping updated by another sets single fields.

    Args:
        model: the config class; values: {field or dotted field: value}.
    Returns:
        A new dict; keys that name no group are kept as they are.
    """
    out: dict = {}
    for key, value in values.items():
        info = model.model_fields.get(key) if isinstance(key, str) else None
        if info is not None and is_group(info) and isinstance(value, (dict, BaseModel)):
            value = value.model_dump() if isinstance(value, BaseModel) else value
            out.update({f"{key}.{k}": v for k, v in flat_values(info.annotation, value).items()})
        else:
            out[key] = value
    return out


def nested_values(model: type[BaseModel], values: dict) -> dict:
    """The inverse of :func:`flat_values`: dotted names gathered into their group's dict, which pydantic validates
    as the group's settings object. A dotted name whose head is not a group is kept (and refused as unknown).

    Args:
        model: the config class; values: {field or dotted field: value}.
    Returns:
        A new dict.
    """
    out: dict = {}
    groups: dict[str, dict] = {}
    for key, value in flat_values(model, values).items():
        head, dot, rest = key.partition(".") if isinstance(key, str) else (key, "", "")
        info = model.model_fields.get(head) if dot else None
        if info is not None and is_group(info):
            groups.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    for head, sub in groups.items():
        out[head] = nested_values(model.model_fields[head].annotation, sub)
    return out


def flat_config(config: dict, names: Iterable[str]) -> dict:
    """A stored config (JSON data) with each group's dict spread into the dotted names ``names`` holds: reading a
    results root needs no code, only the names recorded with it.

    Args:
        config: {field: value} as stored; names: the dotted field names (an experiment's recorded fields).
    Returns:
        A new dict, groups spread in place; a dict-valued field with no dotted name in ``names`` is kept whole.
    """
    names = set(names)
    out: dict = {}
    for key, value in config.items():
        inner = {k: v for k, v in value.items() if f"{key}.{k}" in names} if isinstance(value, dict) else {}
        if inner and len(inner) == len(value):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def renamed(message: str, names: dict[str, str]) -> str:
    """A settings class's validator message with its field names replaced by the names a user gives them (whole
    words only, longest first): ``width`` → ``transformer.width`` or ``transformer_width``.

    Args:
        message: the validator's message; names: {the class's field name: the user's name}.
    Returns:
        The message in the user's names.
    """
    if not names:
        return message
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?!\w)"
    return re.sub(pattern, lambda m: names[m.group(1)], message)
