"""Reading plateaus and drops off a loss curve, given the theory's plateau levels."""

from __future__ import annotations

import numpy as np


def plateau_dwell(t: np.ndarray, loss: np.ndarray, levels: np.ndarray, tol: float) -> np.ndarray:
    """Time the curve spends within ``tol`` of each level: (len(levels),).

    Each record stands for the time to the next record (the last one for none).
    """
    dt = np.diff(t, append=t[-1])
    near = np.abs(loss[None, :] - np.asarray(levels)[:, None]) <= tol
    return (near * dt[None, :]).sum(axis=1)


def visited_plateaus(t, loss, levels, tol: float, min_dwell_frac: float = 0.03) -> np.ndarray:
    """Indices of the levels the curve rests on for at least ``min_dwell_frac`` of the run."""
    dwell = plateau_dwell(np.asarray(t), np.asarray(loss), levels, tol)
    return np.flatnonzero(dwell >= min_dwell_frac * (t[-1] - t[0]))


def drop_tolerance(levels) -> float:
    """Half-width of the band around a plateau level: a third of the smallest gap between levels,
    so that bands never overlap."""
    gaps = np.abs(np.diff(np.sort(np.asarray(levels))))
    gaps = gaps[gaps > 0]
    return float(gaps.min() / 3.0) if gaps.size else 0.01


def first_crossing(t, loss, level: float) -> float:
    """First time the loss falls to or below ``level`` (NaN if it never does)."""
    idx = np.flatnonzero(np.asarray(loss) <= level)
    return float(np.asarray(t)[idx[0]]) if idx.size else float("nan")


def drop_intervals(t, loss, valley_frac: float = 0.1, min_drop_frac: float = 0.02) -> list[tuple[int, int]]:
    """The drops of a loss curve: (start, end) record indices of each saddle escape.

    A drop is a peak of the descent rate r = −dL/dt. Two peaks are separate drops only if the
    rate between them falls below ``valley_frac`` of the smaller peak (a plateau between them);
    otherwise they are one drop. Drops that lose less than ``min_drop_frac`` of the total
    decrease are ignored. A slow, decelerating approach to the final value is no drop: its rate
    falls monotonically.

    Args:
        t: (T,) times.
        loss: (T,) a smooth loss curve (exact or population loss, not a noisy minibatch loss).
    """
    t, loss = np.asarray(t, dtype=float), np.asarray(loss, dtype=float)
    rate = -np.gradient(loss, t)
    peaks = [i for i in range(1, len(rate) - 1) if rate[i] > 0 and rate[i] >= rate[i - 1] and rate[i] > rate[i + 1]]
    if len(rate) > 1 and rate[0] > rate[1] and rate[0] > 0:
        peaks.insert(0, 0)
    merged: list[int] = []
    for p in peaks:
        if merged:
            q = merged[-1]
            valley = rate[q : p + 1].min()
            if valley > valley_frac * min(rate[q], rate[p]):
                merged[-1] = q if rate[q] >= rate[p] else p
                continue
        merged.append(p)
    # Drop boundaries: the deepest valley between consecutive peaks.
    bounds = [0]
    for a, b in zip(merged[:-1], merged[1:]):
        bounds.append(a + int(np.argmin(rate[a : b + 1])))
    bounds.append(len(loss) - 1)
    total = loss[0] - loss.min()
    drops = []
    for k in range(len(merged)):
        start, end = bounds[k], bounds[k + 1]
        if total > 0 and loss[start] - loss[end] >= min_drop_frac * total:
            drops.append((start, end))
    return drops


def count_drops(t, loss, **kwargs) -> int:
    """Number of drops (saddle escapes) of a smooth loss curve; see :func:`drop_intervals`."""
    return len(drop_intervals(t, loss, **kwargs))
