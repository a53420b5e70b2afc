"""Shared helpers of the mhsa experiments: the paper key and the homogeneous-task loss curves of
Figs 5 and 7 (the Fig 1 training setting is :mod:`iclab.experiments.mhsa._training`)."""

from __future__ import annotations

import numpy as np

from iclab.experiments._memory import FLOAT64, Term
from iclab.theory import mhsa as theory

PAPER = "mhsa"


def bayes_mc_memory(*, n: int, batch_size: int, d_bar: int, L: int) -> Term:
    """Upper estimate of :func:`iclab.theory.mhsa.bayes_risk_mc`'s memory, float64: one batch of
    min(n, batch_size) draws of the (d̄, L) covariates (and their product's operand), their (L,) responses and
    (d̄, d̄) Gram matrices, and the n risks kept.

    Args:
        n: Monte Carlo draws; batch_size: draws per batch; d_bar: d̄; L: context length.
    Returns:
        (bytes, what).
    """
    m = min(n, batch_size)
    return (float(FLOAT64 * (m * (2 * d_bar * L + 3 * L + 3 * d_bar * d_bar) + 2 * n)),
            f"a batch of {m} Monte Carlo draws of d̄×L = {d_bar}×{L} float64 covariates")


def loss_curves(r, I: int, *, lam: float, sigma2: float, penalties=(), d_bar: int = 100) -> dict:
    """Fig 5's curves against r = d̄/L (homogeneous tasks; they depend on d̄/L only, d̄ sets the scale).

    Args:
        r: (R,) values of d̄/L; I: tasks; lam: every task's signal λ; sigma2: σ²; penalties: ridge
        coefficients b (ridge with penalty b·d, our reading of Fig 5's 'penalty'); d_bar: d̄ of the closed forms in
        (d, L).
    Returns:
        {"r", "penalties", "ridge" (P, R) MP ridge risk per penalty b, "mmse" (4.6), "bayes_mp" (MP Bayes
        risk), "gf" GF-ICL (Table 1, H ≥ I), "opts" OptS-ICL (H = 1)}, every loss without ½.
    """
    r = np.asarray(r, dtype=float)
    d = I * d_bar
    L = d_bar / r
    table = dict(I=I, d=d, lam=lam, sigma2=sigma2)
    ridge = np.array([[sum(theory.ridge_variance_bias_mp(rk, I=I, lam=lam, sigma2=sigma2, b=b)) for rk in r]
                      for b in penalties])
    return {"r": r, "ridge": ridge.reshape(len(penalties), r.size), "penalties": np.asarray(penalties, dtype=float),
            "mmse": np.array([theory.mmse_table(**table, L=Lk) for Lk in L]),
            "bayes_mp": np.array([theory.bayes_risk_mp(rk, I=I, lam=lam, sigma2=sigma2) for rk in r]),
            "gf": np.array([theory.gf_icl_table(**table, L=Lk) for Lk in L]),
            "opts": np.array([theory.opts_icl_table(**table, L=Lk) for Lk in L])}
