"""Algorithm matching (von Oswald et al. 2023): how closely a model's predictions follow an algorithm's.

Both metrics compare two prediction functions of the same held-out prompts, ``predict(prompts) -> ŷ``
((P,) or (P, d_y)), so any model (wrapped as a function of the prompts) and any baseline
(:func:`iclab.baselines.on_prompts`) can be compared:

- prediction gap E‖ŷ_model − ŷ_alg‖², with its standard error over prompts;
- sensitivity cosine: the cosine between ∂ŷ_model/∂x_q and ∂ŷ_alg/∂x_q (the Jacobians with respect to
  the query input, flattened), per prompt, averaged over prompts.

The Jacobians are taken by ``jax.jacrev`` on one prompt at a time (a batch of one), vmapped over the
prompts: no predictor can leak one prompt's query into another's derivative. The query input is
found by a :class:`iclab.baselines.QueryLens` (inferred for the task modules' prompts). Predictors must
be pure JAX functions of the prompts (they are jitted and differentiated); close over parameters and
static options, e.g. ``lambda Z: gla_forget.predict(params, Z, lam)``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from iclab.baselines._layouts import QueryLens, query_lens, targets
from iclab.baselines._stats import Estimate, mean_and_se

__all__ = ["AlgorithmMatch", "algorithm_match", "mc_risk", "prediction_gap", "query_sensitivity",
           "sensitivity_cosine"]


def _per_prompt_sq(diff: jax.Array) -> jax.Array:
    return jnp.sum(diff.reshape(diff.shape[0], -1) ** 2, axis=-1)


def mc_risk(predict: Callable, prompts, *, target=None) -> Estimate:
    """Monte Carlo risk E‖ŷ − y‖² of a predictor on a batch of prompts, with its standard error (no ½).

    Args:
        predict: prompts -> (P,) or (P, d_y) predictions.
        prompts: P held-out prompts.
        target: (P,) or (P, d_y) targets, or None for the layout's (:func:`iclab.baselines.targets`).
    Returns:
        :class:`Estimate` of the mean squared error over prompts.
    """
    y = targets(prompts) if target is None else jnp.asarray(target)
    return mean_and_se(_per_prompt_sq(jax.jit(predict)(prompts) - y))


def prediction_gap(predict_model: Callable, predict_alg: Callable, prompts) -> Estimate:
    """Prediction gap E‖ŷ_model − ŷ_alg‖² over held-out prompts, with its standard error (no ½).

    Args:
        predict_model: prompts -> (P,) or (P, d_y) predictions of the model.
        predict_alg: prompts -> predictions of the algorithm, same shape.
        prompts: P held-out prompts.
    Returns:
        :class:`Estimate` (mean, se) of the per-prompt squared gap.
    """
    diff = jax.jit(lambda p: predict_model(p) - predict_alg(p))(prompts)
    return mean_and_se(_per_prompt_sq(diff))


def _jacobians(predict, prompts, lens):
    x_q = lens.get(prompts)

    def one(prompt, v):
        single = jax.tree_util.tree_map(lambda a: a[None], prompt)
        return jax.jacrev(lambda u: predict(lens.set(single, u[None]))[0])(v)

    return jax.vmap(one)(prompts, x_q)


def _cosines(Jm, Ja):
    Jm, Ja = Jm.reshape(Jm.shape[0], -1), Ja.reshape(Ja.shape[0], -1)
    den = jnp.linalg.norm(Jm, axis=-1) * jnp.linalg.norm(Ja, axis=-1)
    return jnp.where(den > 0, jnp.sum(Jm * Ja, axis=-1) / jnp.where(den > 0, den, 1.0), 0.0)


def query_sensitivity(predict: Callable, prompts, *, query: QueryLens | None = None) -> jax.Array:
    """∂ŷ/∂x_q of every prompt: jax.jacrev on a batch of one prompt, vmapped over the prompts.

    Args:
        predict: prompts -> (P,) or (P, d_y) predictions (called on batches of one prompt).
        prompts: P prompts, every leaf with a leading axis P.
        query: where the query input lives; None infers it for the task modules' prompts
            (:func:`iclab.baselines.query_lens`).
    Returns:
        (P, D) gradients, or (P, d_y, D) Jacobians for vector outputs.
    """
    lens = query_lens(prompts) if query is None else query
    # One compile of the whole vmapped Jacobian: op-by-op dispatch of it costs seconds per new shape.
    return jax.jit(lambda p: _jacobians(predict, p, lens))(prompts)


def sensitivity_cosine(predict_model: Callable, predict_alg: Callable, prompts, *,
                       query: QueryLens | None = None) -> Estimate:
    """Mean over prompts of cos(∂ŷ_model/∂x_q, ∂ŷ_alg/∂x_q), with its standard error.

    cos = ⟨J_m, J_a⟩ / (‖J_m‖ ‖J_a‖) on the flattened Jacobians; a prompt where either sensitivity is
    exactly zero counts as cosine 0.

    Args:
        predict_model: prompts -> predictions of the model.
        predict_alg: prompts -> predictions of the algorithm.
        prompts: P held-out prompts.
        query: the query's :class:`QueryLens`, or None to infer it.
    Returns:
        :class:`Estimate` of the cosine, in [−1, 1].
    """
    lens = query_lens(prompts) if query is None else query
    cos = jax.jit(lambda p: _cosines(_jacobians(predict_model, p, lens), _jacobians(predict_alg, p, lens)))(prompts)
    return mean_and_se(cos)


class AlgorithmMatch(NamedTuple):
    """Both matching metrics of a model against an algorithm on the same prompts.

    Attributes:
        gap: E‖ŷ_model − ŷ_alg‖².
        gap_se: its standard error.
        relative_gap: gap / E‖ŷ_alg‖² (scale-free; 0 for a perfect match).
        cosine: mean sensitivity cosine.
        cosine_se: its standard error.
    """

    gap: jax.Array
    gap_se: jax.Array
    relative_gap: jax.Array
    cosine: jax.Array
    cosine_se: jax.Array


def algorithm_match(predict_model: Callable, predict_alg: Callable, prompts, *,
                    query: QueryLens | None = None) -> AlgorithmMatch:
    """Prediction gap, relative gap and sensitivity cosine of a model against an algorithm.

    Args:
        predict_model: prompts -> predictions of the model.
        predict_alg: prompts -> predictions of the algorithm.
        prompts: P held-out prompts.
        query: the query's :class:`QueryLens`, or None to infer it.
    Returns:
        :class:`AlgorithmMatch`.
    """
    lens = query_lens(prompts) if query is None else query

    def arrays(p):
        y_m, y_a = predict_model(p), predict_alg(p)
        cos = _cosines(_jacobians(predict_model, p, lens), _jacobians(predict_alg, p, lens))
        return _per_prompt_sq(y_m - y_a), _per_prompt_sq(y_a), cos

    sq_gap, sq_alg, cos = jax.jit(arrays)(prompts)
    gap, c = mean_and_se(sq_gap), mean_and_se(cos)
    return AlgorithmMatch(gap.mean, gap.se, gap.mean / jnp.mean(sq_alg), c.mean, c.se)
