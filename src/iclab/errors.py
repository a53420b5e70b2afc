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

This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ExperimentError", "IndexDamaged", "RunDamaged", "RunFailed", "StoreError", "UserError",
           "one_line"]


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
