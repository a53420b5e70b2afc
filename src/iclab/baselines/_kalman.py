"""The Kalman filter of drift's AR(1) task process: the exact Bayes predictor and its Bayes risk.

Data model (``iclab.tasks.drift``): w_0 ~ N(0, σ_w² I), w_i = γ w_{i−1} + e_i, e_i ~ N(0, σ_e² I),
y_i = ⟨w_i, x_i⟩ (+ σε_i, σ = 0 in the paper), i = 1..n; the target is y_{n+1} = ⟨w_{n+1}, x_{n+1}⟩.
The filter carries the posterior N(m_t, P_t) of w_t given y_1..y_t:

    predict  m⁻ = γ m_{t−1},  P⁻ = γ² P_{t−1} + σ_e² I      (m_0 = 0, P_0 = σ_w² I)
    update   u = P⁻x_t,  S = x_tᵀu + σ²,  k = u/S,
             m_t = m⁻ + k (y_t − x_tᵀm⁻),  P_t = P⁻ − u uᵀ/S,

and E[w_{n+1} | y_1..y_n] = γ m_n, Cov = γ² P_n + σ_e² I. The covariances do not depend on the
labels, so the Bayes risk given the inputs, x_{n+1}ᵀ(γ²P_n + σ_e²I)x_{n+1}, is exact.

Noiseless observations (σ = 0) are the numerical trap: each update makes P singular along x_t,
and with σ_e = 0 (the stationary task, γ = 1) P reaches 0 once the inputs span R^d, after which
S is roundoff and k = u/S would be 0/0. An observation whose predicted variance xᵀP⁻x falls below
10·d·eps times its prior value ‖x‖² v_t (v_t = γ² v_{t−1} + σ_e², v_0 = σ_w², the unconditional
variance of a coordinate of w_t) carries no information (it is already determined) and is skipped,
which is its exact limit; no jitter is added. For the optimal gain the update P⁻ − uuᵀ/S equals the
Joseph form (I − kxᵀ)P⁻(I − kxᵀ)ᵀ + σ²kkᵀ; we keep the O(d²) form, symmetrised, and the tests check
it against brute-force Gaussian conditioning (to 1e-10) and that P stays positive semidefinite. Like any
covariance-form filter its roundoff grows as eps·cond(X)² (the normal equations' conditioning): in the
stationary noiseless case (γ = 1, σ_e = 0), where :func:`gaussian_posterior_mean` is the same predictor
through an SVD (eps·cond(X)), expect ~1e-10 rather than ~1e-14 after the inputs span R^d.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from iclab.baselines._conditioning import _jit

__all__ = ["KalmanFilter", "kalman_bayes_risk", "kalman_filter", "kalman_posterior_mean"]


class KalmanFilter(NamedTuple):
    """The Kalman filter of one batch of drifting-task sequences of length T.

    Attributes:
        predictions: (..., T) a-priori predictions ŷ_t = x_tᵀ E[w_t | y_1..y_{t−1}] (y_t unused).
        variances: (..., T) a-priori predictive variances x_tᵀ Cov[w_t | y_<t] x_t + σ²: the Bayes
            risk of ŷ_t given the inputs.
        mean: (..., d) E[w_{T+1} | y_1..y_T] = γ m_T.
        cov: (..., d, d) Cov[w_{T+1} | y_1..y_T] = γ² P_T + σ_e² I.
    """

    predictions: jax.Array
    variances: jax.Array
    mean: jax.Array
    cov: jax.Array


@_jit()
def kalman_filter(x, y, *, gamma, sigma_w2, sigma_e2, sigma2=0.0) -> KalmanFilter:
    """Runs the Kalman filter of the AR(1) task along each sequence (module docstring).

    Fed a drift prompt's full x (n+1 tokens) and y, ``predictions[..., -1]`` is the Bayes prediction
    of the target (y_{n+1} is never read for it) and ``predictions`` are the a-priori predictions
    along the prompt, comparable with ``iclab.theory.drift.lms_predictions`` / ``rls_predictions``.

    Args:
        x: (..., T, d) inputs x_1..x_T.
        y: (..., T) labels y_1..y_T.
        gamma: AR(1) coefficient γ.
        sigma_w2: variance σ_w² of w_0.
        sigma_e2: innovation variance σ_e².
        sigma2: observation-noise variance σ² ≥ 0 (0 in the drift paper).
    Returns:
        :class:`KalmanFilter` in x's dtype.
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    dt = x.dtype
    d = x.shape[-1]
    batch = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-1])
    x = jnp.broadcast_to(x, batch + x.shape[-2:])
    y = jnp.broadcast_to(y, batch + y.shape[-1:])
    g, sw2, se2, s2 = (jnp.asarray(v, dt) for v in (gamma, sigma_w2, sigma_e2, sigma2))
    eye = jnp.eye(d, dtype=dt)
    tol = 10.0 * d * float(jnp.finfo(dt).eps)

    def step(carry, xy):
        m, P, v = carry
        xt, yt = xy
        m_pred = g * m
        P_pred = g * g * P + se2 * eye
        v = g * g * v + se2
        u = (P_pred @ xt[..., None])[..., 0]
        S0 = jnp.sum(xt * u, axis=-1)
        pred = jnp.sum(m_pred * xt, axis=-1)
        informative = S0 > tol * v * jnp.sum(xt * xt, axis=-1)
        S = jnp.where(informative, S0 + s2, 1.0)
        k = jnp.where(informative[..., None], u / S[..., None], 0.0)
        m = m_pred + k * (yt - pred)[..., None]
        P = P_pred - k[..., :, None] * u[..., None, :]
        P = 0.5 * (P + jnp.swapaxes(P, -1, -2))
        return (m, P, v), (pred, jnp.maximum(S0, 0.0) + s2)

    m0 = jnp.zeros(batch + (d,), dt)
    P0 = jnp.broadcast_to(sw2 * eye, batch + (d, d))
    (m, P, _), (pred, var) = jax.lax.scan(step, (m0, P0, sw2), (jnp.moveaxis(x, -2, 0), jnp.moveaxis(y, -1, 0)))
    return KalmanFilter(jnp.moveaxis(pred, 0, -1), jnp.moveaxis(var, 0, -1), g * m, g * g * P + se2 * eye)


@_jit()
def kalman_posterior_mean(x, y, x_q, *, gamma, sigma_w2, sigma_e2, sigma2=0.0) -> jax.Array:
    """Bayes prediction of drift's target: ŷ = x_{n+1}ᵀ E[w_{n+1} | y_1..y_n] (the Kalman filter).

    The exact posterior mean under w_i = γ w_{i−1} + e_i, for any γ (γ = 1, σ_e = 0 is the stationary
    task and gives :func:`gaussian_posterior_mean` with prior σ_w²).

    Args:
        x: (..., n, d) context inputs x_1..x_n.
        y: (..., n) context labels.
        x_q: (..., d) query input x_{n+1}.
        gamma: AR(1) coefficient γ.
        sigma_w2: variance σ_w² of w_0.
        sigma_e2: innovation variance σ_e².
        sigma2: observation-noise variance σ² ≥ 0.
    Returns:
        (...,) predictions.
    """
    kf = kalman_filter(x, y, gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2, sigma2=sigma2)
    return jnp.sum(kf.mean * jnp.asarray(x_q, kf.mean.dtype), axis=-1)


@_jit()
def kalman_bayes_risk(x, *, gamma, sigma_w2, sigma_e2, Lam, sigma2=0.0) -> jax.Array:
    """Bayes risk given the context inputs, x_{n+1} ~ N(0, Λ) integrated out: tr(Λ Cov[w_{n+1} | y_1..y_n]).

    Exact for every context X (the filter's covariance does not depend on the labels), for the
    noiseless target y_{n+1} = ⟨w_{n+1}, x_{n+1}⟩. Its expectation over X has no closed form (the
    Riccati recursion runs on random rank-one updates): estimate it by averaging this exact conditional
    risk over sampled contexts. Always σ_e² trΛ ≤ risk ≤ v_{n+1} trΛ (knowing w_n exactly leaves the
    innovation e_{n+1}; knowing nothing leaves the prior variance v_{n+1} of Lemma 1).

    Args:
        x: (..., n, d) context inputs x_1..x_n.
        gamma: AR(1) coefficient γ.
        sigma_w2: variance σ_w² of w_0.
        sigma_e2: innovation variance σ_e².
        Lam: (d, d) input covariance Λ.
        sigma2: observation-noise variance σ² ≥ 0 of the context labels.
    Returns:
        (...,) conditional Bayes risks.
    """
    x = jnp.asarray(x)
    kf = kalman_filter(x, jnp.zeros(x.shape[:-1], x.dtype), gamma=gamma, sigma_w2=sigma_w2, sigma_e2=sigma_e2,
                       sigma2=sigma2)
    return jnp.sum(jnp.asarray(Lam, x.dtype) * kf.cov, axis=(-2, -1))
