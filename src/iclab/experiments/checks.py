"""Checks: named comparisons of a measured value with what theory (or the paper) expects, at a stated tolerance.

An experiment's ``checks(config, arrays)`` returns a list of :class:`Check`; ``iclab run`` prints them,
stores them in ``metrics.json`` and exits 1 when one fails. Build them with the helpers below, which
say in their name what is compared: :func:`check_abs` (|m − e| ≤ tol), :func:`check_rel`
(|m − e| ≤ tol·|e|), :func:`check_at_most` (m ≤ bound), :func:`check_at_least` (m ≥ bound) and
:func:`check_equal` (counts). State in ``note`` where the tolerance comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Check", "check_abs", "check_at_least", "check_at_most", "check_equal", "check_rel"]


@dataclass(frozen=True)
class Check:
    """A named comparison of a measured value with its expected value at a stated tolerance."""

    name: str
    measured: float
    expected: float
    tolerance: float
    passed: bool
    comparison: str = "abs"
    note: str = ""

    def as_dict(self) -> dict:
        """The check as plain JSON types (as stored in ``metrics.json``)."""
        return {
            "name": self.name,
            "measured": _plain(self.measured),
            "expected": _plain(self.expected),
            "tolerance": _plain(self.tolerance),
            "comparison": self.comparison,
            "passed": bool(self.passed),
            "note": self.note,
        }


def _plain(x):
    x = np.asarray(x).item() if np.ndim(x) == 0 else x
    return float(x) if isinstance(x, (float, np.floating, int, np.integer)) and not isinstance(x, bool) else x


def check_abs(name: str, measured, expected, tol: float, note: str = "") -> Check:
    """|measured − expected| ≤ tol.

    Args:
        name: what is compared, in the paper's terms.
        measured: the simulated value; expected: the theory's (or paper's) value.
        tol: the absolute tolerance; note: where the tolerance comes from.
    """
    measured, expected = float(measured), float(expected)
    return Check(name, measured, expected, tol, bool(abs(measured - expected) <= tol), "abs", note)


def check_rel(name: str, measured, expected, tol: float, note: str = "") -> Check:
    """|measured − expected| ≤ tol·|expected|.

    Args:
        name: what is compared; measured, expected: the two values.
        tol: the relative tolerance; note: where the tolerance comes from.
    """
    measured, expected = float(measured), float(expected)
    return Check(name, measured, expected, tol, bool(abs(measured - expected) <= tol * abs(expected)), "rel", note)


def check_at_most(name: str, measured, bound: float, note: str = "") -> Check:
    """measured ≤ bound (e.g. a relative difference that must be tiny).

    Args:
        name: what is compared; measured: the value; bound: its upper bound; note: why that bound.
    """
    measured = float(measured)
    return Check(name, measured, float(bound), 0.0, bool(measured <= bound), "le", note)


def check_at_least(name: str, measured, bound: float, note: str = "") -> Check:
    """measured ≥ bound (e.g. a z-score that must be large).

    Args:
        name: what is compared; measured: the value; bound: its lower bound; note: why that bound.
    """
    measured = float(measured)
    return Check(name, measured, float(bound), 0.0, bool(measured >= bound), "ge", note)


def check_equal(name: str, measured, expected, note: str = "") -> Check:
    """measured == expected exactly (counts).

    Args:
        name: what is counted; measured, expected: the two counts; note: context.
    """
    return Check(name, float(measured), float(expected), 0.0, bool(measured == expected), "eq", note)
