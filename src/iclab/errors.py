"""iclab's exceptions: what the CLI turns into one line and an exit code, and what the Python API raises.

A mistake of the user's is a :class:`UserError`: one line naming the field (or option, variable, file)
and what is allowed, exit code 2, nothing written. Its subclasses say where the mistake is:

- :class:`ConfigError`: an argument, config field, option or ``ICLAB_*`` variable out of its range;
- :class:`ExperimentError`: an experiment that cannot be found or loaded, or an experiment's own
  functions that break their contract (``run`` must return arrays by name, ``checks`` a list of
  checks, ``plot`` a matplotlib Figure);
- :class:`StoreError`: a results root or stored run that cannot be used as it is (damaged, unreadable,
  a name that would leave the root).

Two outcomes are not mistakes of the input and have their own exit codes: :class:`RunDamaged`
(a stored result failed its verification and the user asked not to repair it: exit 1, as a failed
check) and :class:`RunFailed` (the experiment's own code raised: the run is recorded as ``failed``
with its traceback in the run folder's ``error.txt``: exit 3). Anything else is a bug of iclab's
and keeps its traceback.

This module imports nothing when it loads, so every layer may raise these; :func:`describe_validation_error`
reads a config's (dotted) fields with :mod:`iclab.fields`, the one layer below it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ExperimentError", "IndexDamaged", "RunDamaged", "RunFailed", "StoreError", "UserError",
           "describe_validation_error", "one_line", "shorten"]


class UserError(Exception):
    """Bad input from the user: one line, exit code 2, nothing written.

    The message is made one line (:func:`one_line`): a path or value it names may hold a newline.
    """

    def __init__(self, message: object = "", *args):
        super().__init__(one_line(message), *args)


class ConfigError(UserError):
    """An argument, config field, CLI option or environment variable outside what is allowed."""


class ExperimentError(UserError):
    """An experiment that cannot be found or loaded, or whose ``run``/``checks``/``plot`` return the wrong type."""


class StoreError(UserError):
    """A results root or a stored run that cannot be used as it is: one line for the user."""


class IndexDamaged(StoreError):
    """``index.sqlite`` cannot be read; ``iclab index rebuild`` rebuilds it from the run folders."""


class RunDamaged(StoreError):
    """A stored result failed its verification and the user asked not to repair it (the CLI exits 1)."""


class RunFailed(Exception):
    """The experiment's own code raised: the run is recorded as ``failed``, its traceback in ``error_file``.

    Attributes:
        error_file: the ``error.txt`` holding the traceback (None when it could not be written).
    """

    def __init__(self, message: str, error_file=None):
        super().__init__(message)
        self.error_file = error_file


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space.

    Args:
        text: anything; its ``str`` is taken.
    """
    return " ".join(str(text).split())


def shorten(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (long values are not echoed whole in one-line errors).

    Args:
        value: anything; limit: the most characters kept.
    """
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe_validation_error(err, config_cls) -> str:
    """One line naming each bad field, what is allowed, and what was given.

    Args:
        err: a pydantic ``ValidationError``; config_cls: the pydantic model validated (for the fields' bounds).
    """
    from iclab.fields import field_info, flat_fields, is_group, renamed  # pydantic's: errors itself stays standard library only

    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "config"
        ctx = e.get("ctx") or {}
        given = e.get("input")
        kind = e["type"]
        if kind == "extra_forbidden":
            group = ".".join(str(x) for x in e["loc"][:-1])
            owner = field_info(config_cls, e["loc"][:-1]) if group else None
            fields = flat_fields(owner.annotation if owner is not None else config_cls)
            names = [f"{group}.{name}" if group else name for name in fields]
            near = [n for n in names if n.rsplit(".", 1)[-1] == field.rsplit(".", 1)[-1] and n != field]
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            parts.append(f"unknown field {field!r}{hint}; allowed fields: {', '.join(names)}")
            continue
        bound = {"greater_than_equal": ("≥", "ge"), "greater_than": (">", "gt"),
                 "less_than_equal": ("≤", "le"), "less_than": ("<", "lt")}.get(kind)
        if bound:
            msg = f"{field} must be {bound[0]} {ctx[bound[1]]}"
            info = field_info(config_cls, e["loc"])
            if info is not None:
                limits = [f"{sym} {getattr(m, a)}" for m in info.metadata
                          for a, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
                          if getattr(m, a, None) is not None]
                if len(limits) > 1:
                    msg = f"{field} must be {' and '.join(limits)}"
            parts.append(f"{msg} (got {shorten(given)})")
        elif kind == "value_error":
            message = str(ctx.get("error", e["msg"]))
            group = field_info(config_cls, e["loc"]) if e["loc"] else None
            if group is not None and is_group(group):
                # a settings object's own validator (relating two of its fields): its names as the user gives them
                parts.append(renamed(message, {name: f"{field}.{name}" for name in group.annotation.model_fields}))
            else:
                parts.append(f"{field}: {message} (got {shorten(given)})" if e["loc"] else message)
        else:
            parts.append(f"{field}: {e['msg'].lower()} (got {shorten(given)})")
    return "; ".join(parts)
