"""The one rule for names that become paths: experiment ids, presets, run folders, index rows.

An experiment id or a preset name is letters, digits, ``_``, ``.`` and ``-``, starting with a letter,
digit or ``_``, at most 128 characters: it can be a file name and can never be ``..``, hold a path
separator or start a hidden file. ``iclab run`` checks a user's experiment id with it, and every
command that reads a results root checks every name it takes from the root (``config.json``'s
experiment and preset, a folder's name, an index row's ``run_dir``) with it before the name becomes a
path; a stored run whose names break the rule is skipped with one line (:mod:`iclab.store`).
"""

from __future__ import annotations

import re

__all__ = ["NAME", "check_name", "is_name", "is_run_folder", "run_folder"]

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"[0-9a-f]{16}")


def is_name(text) -> bool:
    """Whether ``text`` is a str that the rule admits (module docstring)."""
    return isinstance(text, str) and NAME.fullmatch(text) is not None


def check_name(text, what: str, error: type[Exception] = ValueError) -> str:
    """``text`` if the rule admits it, else ``error`` with one line naming ``what`` and the rule.

    Args:
        text: the name; what: what it is (``experiment id``, ``preset``), named in the message.
        error: the exception class raised.
    """
    if not is_name(text):
        shown = repr(text) if not isinstance(text, str) or len(text) <= 60 else repr(text[:59] + "…")
        raise error(f"{what} {shown} must be letters, digits, '_', '.' or '-' (starting with a letter, digit or '_', "
                    "at most 128 characters)")
    return text


def run_folder(experiment: str, digest: str) -> str:
    """The folder name of a run: ``<experiment>-<digest>`` (both checked).

    Args:
        experiment: the experiment id; digest: the run's 16-hex-digit key.
    """
    check_name(experiment, "experiment id")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"run key {digest!r} must be 16 hexadecimal digits")
    return f"{experiment}-{digest}"


def is_run_folder(name, experiment=None, digest=None) -> bool:
    """Whether ``name`` is a run folder's name (``<experiment>-<16 hex digits>``, one path component),
    of the given experiment and digest when they are given.

    Args:
        name: the candidate (a str); experiment, digest: what it must name (None: any).
    """
    if not isinstance(name, str):
        return False
    exp, sep, key = name.rpartition("-")
    if not sep or not is_name(exp) or not _DIGEST.fullmatch(key):
        return False
    return (experiment is None or exp == experiment) and (digest is None or key == digest)
