"""Baselines on the models' own prompts: classical in-context estimators, the Bayes-optimal predictor of
each paper's data model with its Bayes risk, and algorithm matching.

Every predictor is pure JAX, batched over leading prompt axes, float64-safe (it keeps the input's
dtype), and differentiable in the query input. Plain-array form: ``x: (..., N, D)`` context inputs,
``y: (..., N)`` labels, ``x_q: (..., D)`` query; :func:`split_prompts` / :func:`on_prompts` read the
task modules' prompts (linreg, drift, gating's multitask, mhsa's multitask_regression) and
:func:`split_drift_tokens` / :func:`split_linreg_tokens` the models' token matrices.

- Linear estimators (``_linear``): :func:`least_squares` (min-norm), :func:`ridge`, :func:`gd`,
  :func:`preconditioned_gd`, :func:`wpgd` (gating eq 7), :func:`exponential_weights` (drift eq 15).
- Gaussian task prior (``_gaussian``; linattn, and mhsa per task): :func:`gaussian_posterior_mean`,
  :func:`gaussian_bayes_risk`, :func:`mhsa_posterior_mean`, :func:`mhsa_bayes_risk`.
- Correlated tasks with delimiters (``_multitask``; gating): :func:`multitask_posterior_mean`,
  :func:`multitask_bayes_risk`, :func:`independent_tasks_bayes_risk` (closed form).
- A finite task pool (``_pool``; task diversity, :mod:`iclab.tasks.pool`): :func:`pool_posterior` and
  :func:`pool_posterior_mean` (dMMSE); on fresh tasks the Bayes predictor is :func:`gaussian_posterior_mean`.
- AR(1) task drift (``_kalman``; drift): :func:`kalman_filter`, :func:`kalman_posterior_mean`,
  :func:`kalman_bayes_risk`; any linear-Gaussian state-space drift (:mod:`iclab.tasks.state_space`: rotation,
  trend, ...): :func:`state_space_filter`, :func:`state_space_posterior_mean`, :func:`state_space_bayes_risk`.
- Abrupt task switches (``_changepoint``; :mod:`iclab.tasks.switching`): :func:`changepoint_filter`,
  :func:`changepoint_posterior_mean` (the exact run-length mixture of Adams & MacKay's changepoint posterior)
  and its per-position Monte Carlo risk :func:`changepoint_bayes_risk`.
- Online adaptive filters (``_online``; drift's Sec 5 baselines on the prompt): :func:`lms`, :func:`rls`, and
  LMS's exact risk under AR(1) drift :func:`lms_risk`; :func:`filter_tail_errors` runs both along many
  streams at once (a compiled CPU kernel, numpy in and out: drift.baselines' Monte Carlo).
- Algorithm matching (``_matching``; von Oswald et al. 2023): :func:`prediction_gap`,
  :func:`sensitivity_cosine`, :func:`algorithm_match`, :func:`query_sensitivity`, :func:`mc_risk`.

Bayes risks are exact given the context inputs (the query integrated out); their mean over contexts
is a Rao–Blackwellised Monte Carlo estimate except where a docstring gives a closed form.
"""

from iclab.baselines._changepoint import (
    ChangepointFilter,
    changepoint_bayes_risk,
    changepoint_filter,
    changepoint_posterior_mean,
)
from iclab.baselines._gaussian import gaussian_bayes_risk, gaussian_posterior_mean, mhsa_bayes_risk, mhsa_posterior_mean
from iclab.baselines._kalman import (
    KalmanFilter,
    kalman_bayes_risk,
    kalman_filter,
    kalman_posterior_mean,
    state_space_bayes_risk,
    state_space_filter,
    state_space_posterior_mean,
)
from iclab.baselines._layouts import (
    DRIFT_TOKENS_QUERY,
    LINREG_TOKENS_QUERY,
    Context,
    QueryLens,
    on_prompts,
    query_lens,
    split_drift_tokens,
    split_linreg_tokens,
    split_prompts,
    targets,
)
from iclab.baselines._linear import exponential_weights, gd, least_squares, preconditioned_gd, ridge, wpgd
from iclab.baselines._matching import (
    AlgorithmMatch,
    algorithm_match,
    mc_risk,
    prediction_gap,
    query_sensitivity,
    sensitivity_cosine,
)
from iclab.baselines._multitask import independent_tasks_bayes_risk, multitask_bayes_risk, multitask_posterior_mean
from iclab.baselines._online import lms, lms_risk, rls
from iclab.baselines._pool import pool_posterior, pool_posterior_mean
from iclab.ops import filter_tail_errors
from iclab.baselines._stats import Estimate, mean_and_se

__all__ = [
    "DRIFT_TOKENS_QUERY", "LINREG_TOKENS_QUERY", "AlgorithmMatch", "ChangepointFilter", "Context", "Estimate", "KalmanFilter", "QueryLens",
    "algorithm_match", "changepoint_bayes_risk", "changepoint_filter", "changepoint_posterior_mean",
    "exponential_weights", "filter_tail_errors", "gaussian_bayes_risk", "gaussian_posterior_mean", "gd",
    "independent_tasks_bayes_risk", "kalman_bayes_risk", "kalman_filter", "kalman_posterior_mean", "least_squares",
    "lms", "lms_risk", "mc_risk", "mean_and_se", "mhsa_bayes_risk", "mhsa_posterior_mean", "multitask_bayes_risk",
    "multitask_posterior_mean", "on_prompts", "pool_posterior", "pool_posterior_mean", "prediction_gap",
    "preconditioned_gd", "query_lens",
    "query_sensitivity", "ridge", "rls", "sensitivity_cosine", "split_drift_tokens", "split_linreg_tokens", "split_prompts",
    "state_space_bayes_risk", "state_space_filter", "state_space_posterior_mean", "targets", "wpgd",
]
