"""The Kalman filter of a drifting task: drift's AR(1) process and any linear-Gaussian state-space process.

The exact Bayes predictor and its Bayes risk, first for drift's AR(1) task (:func:`kalman_filter`), then for
the general state-space task of :mod:`iclab.tasks.state_space` (:func:`state_space_filter`, below).

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

General transition (:func:`state_space_filter`). State s_0 ~ N(0, P_0), s_t = F s_{t−1} + e_t, e_t ~ N(0, Q),
task w_t = H s_t, y_t = x_tᵀ H s_t + σε_t. With h_t = Hᵀx_t the same recursion reads

    predict  m⁻ = F m_{t−1},  P⁻ = F P_{t−1} Fᵀ + Q          (m_0 = 0, P_0 given)
    update   u = P⁻h_t,  S = h_tᵀu + σ²,  k = u/S,  m_t = m⁻ + k (y_t − h_tᵀm⁻),  P_t = P⁻ − u uᵀ/S,

and the same skip rule, with the prior value h_tᵀ Σ_t h_t (Σ_t = F Σ_{t−1} Fᵀ + Q, Σ_0 = P_0, the unconditional
covariance of s_t; for F = γI, Q = σ_e²I, P_0 = σ_w²I, H = I it is v_t‖x_t‖², the AR(1) rule) and 10·k·eps.
F = γI, H = I gives :func:`kalman_filter`'s numbers to rounding (F P Fᵀ is γ(γP), not γ²P). The a-priori Bayes
risk at position t, the innovation variance h_tᵀP⁻h_t + σ² with x_t ~ N(0, Λ) integrated out analytically, is
tr(Λ H P⁻_t Hᵀ) + σ² (:func:`state_space_bayes_risk`): exact given the earlier inputs x_<t, whose average over
x_<t is estimated by Monte Carlo (the Riccati recursion has no closed-form mean over random inputs).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from iclab.baselines._conditioning import _jit

__all__ = ["KalmanFilter", "kalman_bayes_risk", "kalman_filter", "kalman_posterior_mean", "state_space_bayes_risk",
           "state_space_filter", "state_space_posterior_mean"]


class KalmanFilter(NamedTuple):
    """The Kalman filter of one batch of drifting-task sequences of length T.

    Attributes:
        predictions: (..., T) a-priori predictions ŷ_t = x_tᵀ E[w_t | y_1..y_{t−1}] (y_t unused).
        variances: (..., T) a-priori predictive variances x_tᵀ Cov[w_t | y_<t] x_t + σ²: the Bayes
            risk of ŷ_t given the inputs.
        mean: (..., k) E[s_{T+1} | y_1..y_T]: γ m_T for AR(1) (the state is the task, k = d), F m_T in general.
        cov: (..., k, k) Cov[s_{T+1} | y_1..y_T]: γ² P_T + σ_e² I for AR(1), F P_T Fᵀ + Q in general.
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


def _state_space_scan(x, y, F, Q, P0, H, sigma2, Lam):
    """The general filter's scan (module docstring): predictions, variances, tr(ΛHP⁻Hᵀ) per step, m_T, P_T."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    dt = x.dtype
    F, Q, P0 = (jnp.asarray(a, dt) for a in (F, Q, P0))
    k = F.shape[-1]
    H = jnp.eye(k, dtype=dt) if H is None else jnp.asarray(H, dt)
    batch = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-1])
    x = jnp.broadcast_to(x, batch + x.shape[-2:])
    y = jnp.broadcast_to(y, batch + y.shape[-1:])
    s2 = jnp.asarray(sigma2, dt)
    HLH = H.T @ jnp.asarray(Lam, dt) @ H if Lam is not None else jnp.zeros((k, k), dt)  # tr(Λ H P Hᵀ) = tr(HᵀΛH P)
    tol = 10.0 * k * float(jnp.finfo(dt).eps)

    def step(carry, xy):
        m, P, Sig = carry
        xt, yt = xy
        h = xt @ H  # (..., k) = Hᵀx_t
        m_pred = m @ F.T
        P_pred = F @ P @ F.T + Q
        Sig = F @ Sig @ F.T + Q
        u = (P_pred @ h[..., None])[..., 0]
        S0 = jnp.sum(h * u, axis=-1)
        pred = jnp.sum(m_pred * h, axis=-1)
        informative = S0 > tol * jnp.sum(h * (Sig @ h[..., None])[..., 0], axis=-1)
        S = jnp.where(informative, S0 + s2, 1.0)
        gain = jnp.where(informative[..., None], u / S[..., None], 0.0)
        m = m_pred + gain * (yt - pred)[..., None]
        P = P_pred - gain[..., :, None] * u[..., None, :]
        P = 0.5 * (P + jnp.swapaxes(P, -1, -2))
        risk = jnp.sum(HLH * P_pred, axis=(-2, -1)) + s2
        return (m, P, Sig), (pred, jnp.maximum(S0, 0.0) + s2, risk)

    m0 = jnp.zeros(batch + (k,), dt)
    carry = (m0, jnp.broadcast_to(P0, batch + (k, k)), P0)  # the unconditional Σ_t is the same for every prompt
    (m, P, _), (pred, var, risk) = jax.lax.scan(step, carry, (jnp.moveaxis(x, -2, 0), jnp.moveaxis(y, -1, 0)))
    mv = lambda a: jnp.moveaxis(a, 0, -1)  # noqa: E731
    return mv(pred), mv(var), mv(risk), m, P, F


@_jit()
def state_space_filter(x, y, *, F, Q, P0, H=None, sigma2=0.0) -> KalmanFilter:
    """Runs the Kalman filter of the state-space task (module docstring; :mod:`iclab.tasks.state_space`).

    Fed a prompt's full x (n+1 tokens) and y, ``predictions[..., -1]`` is the Bayes prediction of the target
    x_{n+1}ᵀ E[w_{n+1} | y_1..y_n] (y_{n+1} is never read for it). ``**process._asdict()`` of a
    :class:`iclab.tasks.state_space.StateSpace` gives F, Q, P0 and H.

    Args:
        x: (..., T, d) inputs x_1..x_T.
        y: (..., T) labels y_1..y_T.
        F: (k, k) transition.
        Q: (k, k) innovation covariance.
        P0: (k, k) covariance of the initial state s_0 (the first prediction is of s_1 = F s_0 + e_1).
        H: (d, k) task readout w_t = H s_t, or None for the identity (k = d).
        sigma2: observation-noise variance σ² ≥ 0.
    Returns:
        :class:`KalmanFilter` in x's dtype; ``mean``/``cov`` are E/Cov[s_{T+1} | y_1..y_T] of the state
        (the task's are H·mean and H·cov·Hᵀ).
    """
    pred, var, _, m, P, F = _state_space_scan(x, y, F, Q, P0, H, sigma2, None)
    return KalmanFilter(pred, var, m @ F.T, F @ P @ F.T + jnp.asarray(Q, P.dtype))


@_jit()
def state_space_posterior_mean(x, y, x_q, *, F, Q, P0, H=None, sigma2=0.0) -> jax.Array:
    """Bayes prediction of the state-space task's target: ŷ = x_{n+1}ᵀ H E[s_{n+1} | y_1..y_n].

    Args:
        x: (..., n, d) context inputs x_1..x_n.
        y: (..., n) context labels.
        x_q: (..., d) query input x_{n+1}.
        F: (k, k) transition.
        Q: (k, k) innovation covariance.
        P0: (k, k) covariance of s_0.
        H: (d, k) task readout, or None for the identity.
        sigma2: observation-noise variance σ² ≥ 0.
    Returns:
        (...,) predictions.
    """
    kf = state_space_filter(x, y, F=F, Q=Q, P0=P0, H=H, sigma2=sigma2)
    h = jnp.asarray(x_q, kf.mean.dtype) if H is None else jnp.asarray(x_q, kf.mean.dtype) @ jnp.asarray(H, kf.mean.dtype)
    return jnp.sum(kf.mean * h, axis=-1)


@_jit()
def state_space_bayes_risk(x, *, F, Q, P0, Lam, H=None, sigma2=0.0) -> jax.Array:
    """Bayes risk of the noisy label at every position: tr(Λ H Cov[s_t | y_<t] Hᵀ) + σ², t = 1..T.

    The innovation variance x_tᵀ H P⁻_t Hᵀ x_t + σ² with x_t ~ N(0, Λ) integrated out analytically; exact
    given the earlier inputs x_1..x_{t−1} (the covariances do not depend on the labels), so the risk at t is
    E[(y_t − ŷ_t)² | x_<t] for the filter's a-priori prediction ŷ_t. Its mean over contexts has no closed form:
    average this over sampled inputs (Rao–Blackwellised Monte Carlo). ``x[..., t−1, :]`` is never read for
    position t. Subtract σ² for the noiseless target x_tᵀw_t (the convention of :func:`kalman_bayes_risk`).

    Args:
        x: (..., T, d) inputs x_1..x_T (the last one, the query, is not read).
        F: (k, k) transition.
        Q: (k, k) innovation covariance.
        P0: (k, k) covariance of s_0.
        Lam: (d, d) input covariance Λ.
        H: (d, k) task readout, or None for the identity.
        sigma2: observation-noise variance σ² ≥ 0 (of the context labels and of the scored label).
    Returns:
        (..., T) conditional Bayes risks.
    """
    x = jnp.asarray(x)
    _, _, risk, _, _, _ = _state_space_scan(x, jnp.zeros(x.shape[:-1], x.dtype), F, Q, P0, H, sigma2, Lam)
    return risk
