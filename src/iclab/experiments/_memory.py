"""Upper estimates of a run's largest memory need from its config's shapes (``Experiment.memory``).

An experiment's ``memory(config) -> (bytes, what)`` is checked by :func:`iclab.launch.resolve_config` against
the memory limit before anything runs, so that a config too large for the machine is refused in one line
instead of dying inside XLA or being killed by the kernel. The estimate is the sum of the large arrays a run
can hold at once (its terms), each an element count from the config times the item size and a small number of
copies (the draw and its transform, autodiff's saved values, a list of records and its concatenation), so
that it bounds the peak from above without being loose by more than a small factor. ``what`` names the term
that dominates. Phases that follow each other (a training, then an evaluation that reads only the final
weights) are not summed: the run's need is the largest phase's (:func:`largest`).

The helpers here are the terms several papers share; each paper's module composes its experiments' estimates
from them.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["FLOAT32", "FLOAT64", "Term", "itemsize", "largest", "records", "total"]

FLOAT64 = 8
FLOAT32 = 4

#: One term of an estimate: (bytes, what they are).
Term = tuple[float, str]


def itemsize(dtype: str) -> int:
    """Bytes per element of a config's ``dtype`` field ("float32" or "float64")."""
    return FLOAT32 if dtype == "float32" else FLOAT64


def total(terms: Iterable[Term]) -> Term:
    """The sum of the terms' bytes, named by the largest term (the one a user shrinks first).

    Args:
        terms: (bytes, what) pairs; terms of 0 bytes are ignored.
    Returns:
        (bytes, what): what = the largest term's description, with the share of the others when they
        weigh more than a tenth of the total.
    """
    terms = [(float(b), w) for b, w in terms if b > 0]
    if not terms:
        return 0.0, "nothing that scales with the config"
    need = sum(b for b, _ in terms)
    big, what = max(terms)
    if need - big > 0.1 * need:
        what = f"{what} (and {(need - big) / 2**30:.2g} GiB besides)"
    return need, what


def largest(*phases: Term) -> Term:
    """The largest of the estimates of a run's phases that do not overlap in time (a training, then the
    evaluations that read only its final weights): each phase's (bytes, what), typically a :func:`total`."""
    need, what = max(phases, key=lambda t: t[0])
    return float(need), what


def records(*, seeds: int, steps: int, record_every: int, values: float, copies: int = 3,
            item: int = FLOAT64) -> float:
    """Bytes of a recorded trajectory: steps // record_every + 2 records of ``values`` numbers per seed.

    The training loop keeps its records as a list of chunks and concatenates them (twice the records at that
    moment); an experiment's readings of the trajectory (per-seed curves, moved axes) and the stored npz file's
    contiguous copies add about one more: ``copies`` = 3 by default.

    Args:
        seeds: seeds S trained at once; steps, record_every: the loop's; values: numbers recorded per record
            and seed (losses, metrics, recorded params); copies: copies alive at once; item: bytes per number.
    Returns:
        bytes.
    """
    return float(copies) * item * seeds * (steps // record_every + 2) * values
