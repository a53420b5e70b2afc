"""The four papers' prompt layouts, read as (context inputs, context labels, query input).

Every baseline works on plain arrays ``x: (..., N, D)``, ``y: (..., N)``, ``x_q: (..., D)``; the
functions here take them out of the task modules' prompts (and the models' token matrices), give
each layout's target, and say where its query input lives so that ∂ŷ/∂x_q can be taken
(:class:`QueryLens`). mhsa's prompts keep their own tokens-as-columns arrays ``(X, Y, q)`` (d_y
outputs), which the ``mhsa_*`` baselines take directly.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from iclab.tasks.drift import DriftPrompts
from iclab.tasks.linreg import Prompts as LinregPrompts
from iclab.tasks.multitask import MultitaskPrompts as GatingPrompts
from iclab.tasks.multitask_regression import MultitaskPrompts as MhsaPrompts

__all__ = ["Context", "DRIFT_TOKENS_QUERY", "LINREG_TOKENS_QUERY", "QueryLens", "on_prompts", "query_lens",
           "split_drift_tokens", "split_linreg_tokens", "split_prompts", "targets"]


class Context(NamedTuple):
    """What a predictor may read of a batch of prompts.

    Attributes:
        x: (..., N, D) context inputs (mhsa: X (P, d, L), tokens as columns).
        y: (..., N) context labels (mhsa: Y (P, d_y, L)).
        x_q: (..., D) query inputs (mhsa: q (P, d)).
    """

    x: jax.Array
    y: jax.Array
    x_q: jax.Array


def split_prompts(prompts) -> Context:
    """The context and query of a batch of prompts of any of the four task modules.

    linattn ``iclab.tasks.linreg.Prompts``: (x, y, x_q). drift ``DriftPrompts``: the first n tokens
    and x_{n+1} (y_{n+1}, the target, is dropped). gating ``iclab.tasks.multitask.MultitaskPrompts``:
    (x, y, x_query), blocks stacked in order. mhsa ``iclab.tasks.multitask_regression.MultitaskPrompts``:
    its own (X, Y, q).

    Args:
        prompts: a batch of prompts of one of the four layouts.
    Returns:
        :class:`Context` (x, y, x_q).
    """
    if isinstance(prompts, LinregPrompts):
        return Context(prompts.x, prompts.y, prompts.x_q)
    if isinstance(prompts, DriftPrompts):
        return Context(prompts.x[..., :-1, :], prompts.y[..., :-1], prompts.x[..., -1, :])
    if isinstance(prompts, GatingPrompts):
        return Context(prompts.x, prompts.y, prompts.x_query)
    if isinstance(prompts, MhsaPrompts):
        return Context(prompts.X, prompts.Y, prompts.q)
    raise TypeError(f"prompts must be linreg, drift, multitask or multitask_regression prompts (got "
                    f"{type(prompts).__name__}); split token matrices with split_drift_tokens / split_linreg_tokens")


def split_drift_tokens(Z: jax.Array) -> Context:
    """Context and query of drift's token-major prompt matrix (eq 4): rows z_i = (x_i, y_i), z_{n+1} = (x_{n+1}, 0).

    Args:
        Z: (..., n+1, d+1) tokens (``iclab.tasks.drift.tokens``).
    Returns:
        :class:`Context` with x (..., n, d), y (..., n), x_q (..., d).
    """
    return Context(Z[..., :-1, :-1], Z[..., :-1, -1], Z[..., -1, :-1])


def split_linreg_tokens(X: jax.Array) -> Context:
    """Context and query of linattn's prompt matrix (eq 1), tokens as columns: [[x_1..x_N x_q], [y_1..y_N 0]].

    Args:
        X: (..., D+1, N+1) tokens (``iclab.tasks.linreg.prompt_matrix``).
    Returns:
        :class:`Context` with x (..., N, D), y (..., N), x_q (..., D).
    """
    return Context(jnp.swapaxes(X[..., :-1, :-1], -1, -2), X[..., -1, :-1], X[..., :-1, -1])


def targets(prompts) -> jax.Array:
    """The quantity each layout asks to predict.

    linattn y_q = wᵀx_q; drift y_{n+1} = ⟨w_{n+1}, x_{n+1}⟩; gating y_{n+1} = x_{n+1}ᵀβ + σε;
    mhsa y_q = Gᵀq (noiseless).

    Args:
        prompts: a batch of prompts of one of the four layouts.
    Returns:
        (...,) targets, or (P, d_y) for mhsa.
    """
    if isinstance(prompts, LinregPrompts):
        return prompts.y_q
    if isinstance(prompts, DriftPrompts):
        return prompts.y[..., -1]
    if isinstance(prompts, GatingPrompts):
        return prompts.y_query
    if isinstance(prompts, MhsaPrompts):
        return prompts.y_q
    raise TypeError(f"no target is defined for {type(prompts).__name__}; pass target= explicitly")


class QueryLens(NamedTuple):
    """Where a layout keeps the query input, so that ∂ŷ/∂x_q can be taken through any predictor.

    Attributes:
        get: prompts -> (P, D) query inputs.
        set: (prompts, x_q (P, D)) -> the prompts with that query input.
    """

    get: Callable
    set: Callable


_LENSES = {
    LinregPrompts: QueryLens(lambda p: p.x_q, lambda p, v: p._replace(x_q=v)),
    DriftPrompts: QueryLens(lambda p: p.x[..., -1, :], lambda p, v: p._replace(x=p.x.at[..., -1, :].set(v))),
    GatingPrompts: QueryLens(lambda p: p.x_query, lambda p, v: p._replace(x_query=v)),
    MhsaPrompts: QueryLens(lambda p: p.q, lambda p, v: p._replace(q=v)),
}

#: Query of drift's token matrix Z (..., n+1, d+1): the first d entries of the last row.
DRIFT_TOKENS_QUERY = QueryLens(lambda Z: Z[..., -1, :-1], lambda Z, v: Z.at[..., -1, :-1].set(v))
#: Query of linattn's prompt matrix X (..., D+1, N+1): the first D entries of the last column.
LINREG_TOKENS_QUERY = QueryLens(lambda X: X[..., :-1, -1], lambda X, v: X.at[..., :-1, -1].set(v))


def query_lens(prompts) -> QueryLens:
    """The :class:`QueryLens` of a batch of task-module prompts (token matrices need an explicit one).

    Args:
        prompts: linreg, drift, multitask (gating) or multitask_regression (mhsa) prompts.
    Returns:
        the layout's :class:`QueryLens`.
    """
    lens = _LENSES.get(type(prompts))
    if lens is None:
        raise TypeError(f"no query lens for {type(prompts).__name__}; pass query=DRIFT_TOKENS_QUERY, "
                        "LINREG_TOKENS_QUERY or a QueryLens of your own")
    return lens


def on_prompts(baseline: Callable, **settings) -> Callable:
    """A baseline on plain arrays as a predictor of prompts: ``baseline(*split_prompts(prompts), **settings)``.

    E.g. ``on_prompts(ridge, lam=0.1)`` or ``on_prompts(kalman_posterior_mean, gamma=.95, sigma_w2=1.,
    sigma_e2=.01)``: the predictor any model is compared with in :func:`iclab.baselines.algorithm_match`.

    Args:
        baseline: a function ``(x, y, x_q, **settings) -> ŷ``.
        **settings: its keyword arguments.
    Returns:
        a function of a batch of task-module prompts returning ŷ.
    """
    def predict(prompts):
        return baseline(*split_prompts(prompts), **settings)

    predict.__doc__ = f"{getattr(baseline, '__name__', 'baseline')}({settings}) on prompts."
    return predict
