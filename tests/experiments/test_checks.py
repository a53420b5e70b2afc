"""Tests of iclab.experiments.checks: the comparisons behind the verdict ``iclab run`` reports.

Each helper is tested at its boundary: it passes at its tolerance and fails just beyond it. Values are
dyadic (exact in binary) so the boundary is hit exactly, and |expected| ≠ 1 so a relative tolerance
and an absolute one give different verdicts.
"""

import json
import math

import numpy as np
import pytest

from iclab.experiments.checks import Check, check_abs, check_at_least, check_at_most, check_equal, check_rel


def just_above(x):
    """The next float after x: the smallest step beyond a boundary."""
    return float(np.nextafter(x, np.inf))


def just_below(x):
    return float(np.nextafter(x, -np.inf))


# ------------------------------------------------------------------------------------ check_abs


def test_check_abs_passes_at_its_tolerance_and_fails_just_beyond():
    # |4.5 − 4| = 0.5 exactly: the boundary itself passes (≤, not <), on either side of expected.
    assert check_abs("x", 4.5, 4.0, 0.5).passed
    assert check_abs("x", 3.5, 4.0, 0.5).passed
    # One ulp beyond on either side fails: an always-true check or a looser tolerance would pass.
    assert not check_abs("x", just_above(4.5), 4.0, 0.5).passed
    assert not check_abs("x", just_below(3.5), 4.0, 0.5).passed


def test_check_abs_is_absolute_not_relative():
    # |5 − 4| = 1 > 0.5, but ≤ 0.5·|4| = 2: a relative comparison would pass it.
    assert not check_abs("x", 5.0, 4.0, 0.5).passed
    # |0.3 − 0.25| = 0.05 ≤ 0.125, but > 0.125·0.25 = 0.03125: a relative comparison would fail it.
    assert check_abs("x", 0.3, 0.25, 0.125).passed


def test_check_abs_fields():
    c = check_abs("final loss", 4.5, 4.0, 0.5, note="from the SE")
    assert c == Check("final loss", 4.5, 4.0, 0.5, True, "abs", "from the SE")


# ------------------------------------------------------------------------------------ check_rel


def test_check_rel_passes_at_its_tolerance_and_fails_just_beyond():
    # tol·|expected| = 0.125·4 = 0.5 exactly, while tol = 0.125 alone would reject a difference of 0.5:
    # so the boundary passes only if the tolerance is scaled by |expected|.
    assert check_rel("x", 4.5, 4.0, 0.125).passed
    assert check_rel("x", 3.5, 4.0, 0.125).passed
    assert not check_rel("x", just_above(4.5), 4.0, 0.125).passed
    assert not check_rel("x", just_below(3.5), 4.0, 0.125).passed


def test_check_rel_scales_by_the_magnitude_of_expected():
    # Negative expected: tol·|−4| = 0.5; tol·(−4) = −0.5 would reject even an exact match.
    assert check_rel("x", -4.5, -4.0, 0.125).passed
    assert check_rel("x", -4.0, -4.0, 0.125).passed
    assert not check_rel("x", just_below(-4.5), -4.0, 0.125).passed
    # |expected| < 1: |0.3 − 0.25| = 0.05 ≤ tol = 0.125 but > tol·0.25 = 0.03125, so an absolute
    # comparison would pass what the relative one must fail.
    assert not check_rel("x", 0.3, 0.25, 0.125).passed
    # tol·|0.25| = 0.03125 exactly: 0.28125 − 0.25 is the boundary.
    assert check_rel("x", 0.28125, 0.25, 0.125).passed
    assert not check_rel("x", just_above(0.28125), 0.25, 0.125).passed


def test_check_rel_fields():
    c = check_rel("eq 19", 4.5, 4.0, 0.125, note="MC error")
    assert c == Check("eq 19", 4.5, 4.0, 0.125, True, "rel", "MC error")


# -------------------------------------------------------------------------------- check_at_most


def test_check_at_most_is_non_strict_upper_bound():
    # measured == bound passes: the docstring says measured ≤ bound (a strict < would fail it).
    assert check_at_most("x", 4.0, 4.0).passed
    # Below the bound passes, one ulp above fails: swapping to ≥ flips both.
    assert check_at_most("x", 0.25, 4.0).passed
    assert check_at_most("x", just_below(4.0), 4.0).passed
    assert not check_at_most("x", just_above(4.0), 4.0).passed
    assert not check_at_most("x", 8.0, 4.0).passed


def test_check_at_most_fields():
    c = check_at_most("rel diff", 0.25, 4.0, note="tiny")
    assert c == Check("rel diff", 0.25, 4.0, 0.0, True, "le", "tiny")


# ------------------------------------------------------------------------------- check_at_least


def test_check_at_least_is_non_strict_lower_bound():
    # measured == bound passes: the docstring says measured ≥ bound (a strict > would fail it).
    assert check_at_least("x", 4.0, 4.0).passed
    # Above the bound passes, one ulp below fails: swapping to ≤ flips both.
    assert check_at_least("x", 8.0, 4.0).passed
    assert check_at_least("x", just_above(4.0), 4.0).passed
    assert not check_at_least("x", just_below(4.0), 4.0).passed
    assert not check_at_least("x", 0.25, 4.0).passed


def test_check_at_least_fields():
    c = check_at_least("z-score", 8.0, 4.0, note="large")
    assert c == Check("z-score", 8.0, 4.0, 0.0, True, "ge", "large")


# --------------------------------------------------------------------------------- check_equal


def test_check_equal_is_exact():
    assert check_equal("count", 7, 7).passed
    assert check_equal("count", 7, 7.0).passed  # the same count as int or float
    assert not check_equal("count", 7, 8).passed
    # Counts off by one at sizes where approximate comparisons call them equal:
    # np.isclose (rtol 1e-5) accepts 10⁶ vs 10⁶ + 1, math.isclose (rel_tol 1e-9) accepts 10¹⁰ vs 10¹⁰ + 1.
    assert not check_equal("count", 1_000_000, 1_000_001).passed
    assert not check_equal("count", 10**10, 10**10 + 1).passed
    # One ulp apart is not equal either (any tolerance, however tiny, would accept it).
    assert not check_equal("count", 4.0, just_above(4.0)).passed


def test_check_equal_fields():
    c = check_equal("drops", 4, 4, note="staircase")
    assert c == Check("drops", 4.0, 4.0, 0.0, True, "eq", "staircase")
    assert type(c.measured) is float and type(c.expected) is float


# --------------------------------------------------------------------------------------- NaN


NAN_CHECKS = {
    "abs": lambda m: check_abs("x", m, 4.0, 0.5),
    "abs, infinite tol": lambda m: check_abs("x", m, 4.0, math.inf),
    "rel": lambda m: check_rel("x", m, 4.0, 0.125),
    "rel, infinite tol": lambda m: check_rel("x", m, 4.0, math.inf),
    "at_most": lambda m: check_at_most("x", m, 4.0),
    "at_most, infinite bound": lambda m: check_at_most("x", m, math.inf),
    "at_least": lambda m: check_at_least("x", m, 4.0),
    "at_least, infinite bound": lambda m: check_at_least("x", m, -math.inf),
    "equal": lambda m: check_equal("x", m, 4.0),
    "equal to NaN": lambda m: check_equal("x", m, math.nan),
}


@pytest.mark.parametrize("nan", [math.nan, np.float64("nan"), np.float32("nan")], ids=["float", "float64", "float32"])
@pytest.mark.parametrize("helper", list(NAN_CHECKS))
def test_nan_measured_fails_every_helper(helper, nan):
    # A diverged run (NaN) must never be reported as agreeing with theory, even with infinite slack.
    c = NAN_CHECKS[helper](nan)
    assert c.passed is False
    assert math.isnan(c.measured)


# ------------------------------------------------------------------------------------ as_dict

KEYS = {"name", "measured", "expected", "tolerance", "comparison", "passed", "note"}


def test_as_dict_keeps_the_fields():
    c = check_rel("eq 19", 4.5, 4.0, 0.125, note="MC error")
    assert c.as_dict() == {"name": "eq 19", "measured": 4.5, "expected": 4.0, "tolerance": 0.125,
                           "comparison": "rel", "passed": True, "note": "MC error"}


@pytest.mark.parametrize("scalar", [np.float64, np.float32, np.int64, np.int32, lambda v: np.array(v, dtype=float)],
                         ids=["float64", "float32", "int64", "int32", "0d-array"])
def test_as_dict_gives_plain_json_types(scalar):
    # A Check built straight from numpy values (as an experiment's checks() may do): every number
    # comes back a Python float and passed a Python bool, so json.dumps needs no help.
    c = Check("x", scalar(3), scalar(4), scalar(1), np.bool_(True), "abs", "n")
    d = c.as_dict()
    assert set(d) == KEYS
    for key in ("measured", "expected", "tolerance"):
        assert type(d[key]) is float, (key, type(d[key]))
    assert (d["measured"], d["expected"], d["tolerance"]) == (3.0, 4.0, 1.0)
    assert type(d["passed"]) is bool and d["passed"] is True
    assert type(d["name"]) is str and type(d["comparison"]) is str and type(d["note"]) is str
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("make", [
    lambda: check_abs("a", np.float32(4.5), np.float64(4.0), np.float32(0.5)),
    lambda: check_rel("r", np.float32(4.5), np.int64(4), np.float64(0.125)),
    lambda: check_at_most("m", np.float32(0.25), np.float64(4.0)),
    lambda: check_at_least("l", np.int64(8), np.float32(4.0)),
    lambda: check_equal("e", np.int64(4), np.float64(4.0)),
], ids=["abs", "rel", "at_most", "at_least", "equal"])
def test_helpers_as_dict_from_numpy_inputs(make):
    d = make().as_dict()
    assert set(d) == KEYS
    assert all(type(d[k]) is float for k in ("measured", "expected", "tolerance"))
    assert type(d["passed"]) is bool and d["passed"] is True
    assert json.loads(json.dumps(d)) == d


def test_as_dict_of_a_failed_check_says_false():
    d = check_abs("x", just_above(4.5), 4.0, 0.5).as_dict()
    assert d["passed"] is False
