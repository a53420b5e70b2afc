"""Reading results: plateaus and drops off a loss curve (given the theory's plateau levels), rise times,
and the control-variate estimate of a trained model's risk beside a reference predictor of known risk."""

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
    """First record time at which the loss is at or below ``level`` (NaN if it never is).

    Args:
        t: (T,) record times; loss: (T,) the curve; level: the level.
    """
    idx = np.flatnonzero(np.asarray(loss) <= level)
    return float(np.asarray(t)[idx[0]]) if idx.size else float("nan")


def first_rise(t, y, level: float) -> float:
    """First time y reaches ``level`` from below, interpolated linearly between records.

    Args:
        t: (T,) record times; y: (T,) a rising curve (e.g. a learning head's weight); level: the level.
    Returns:
        The time (t[0] if y starts at or above the level; NaN if it never reaches it).
    """
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    idx = np.flatnonzero(y >= level)
    if not idx.size:
        return float("nan")
    i = int(idx[0])
    if i == 0:
        return float(t[0])
    return float(t[i - 1] + (level - y[i - 1]) / (y[i] - y[i - 1]) * (t[i] - t[i - 1]))


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


def control_variate_risk(err_model, err_ref, E_ref) -> dict:
    """The risk of a model estimated beside a reference predictor of known risk, on the same prompts.

    With squared errors e = (ŷ_model − y)² and e_ref = (ŷ_ref − y)² on N shared prompts and E_ref = E[e_ref]
    known in closed form,

        R̂ = E_ref + mean(e − e_ref)

    is unbiased for E[e], and its variance is that of the difference, small when the model predicts
    nearly what the reference does (a trained model beside the theory's optimum), where the raw mean
    of e has a relative standard error of about √(2/N).

    Args:
        err_model: (..., N) squared errors of the model(s).
        err_ref: (..., N) squared errors of the reference on the same prompts (broadcast against err_model).
        E_ref: (...) the reference's exact risk.
    Returns:
        dict of (...) arrays: ``risk`` R̂ and its standard error ``risk_se``; ``raw`` = mean(e) and
        ``raw_se``; ``ref`` = mean(e_ref) and ``ref_se`` (the reference's Monte Carlo risk, a check of the
        sampler and the closed form that involves no training).
    """
    e, er = np.asarray(err_model), np.asarray(err_ref)
    diff = e - er
    n = diff.shape[-1]
    return {
        "risk": np.asarray(E_ref) + diff.mean(-1),
        "risk_se": diff.std(-1) / np.sqrt(n),
        "raw": e.mean(-1),
        "raw_se": e.std(-1) / np.sqrt(e.shape[-1]),
        "ref": er.mean(-1),
        "ref_se": er.std(-1) / np.sqrt(er.shape[-1]),
    }
