"""The exact Bayes predictor of a task that switches abruptly inside the prompt (changepoints).

Data model (:mod:`iclab.tasks.switching`): w_1 ~ N(0, Σ_w); at each later step, with hazard h, the task is
redrawn from N(0, Σ_w), otherwise kept; y_t = x_tᵀw_t + σε_t. Write s_t for the position of the last switch at
or before t (s_1 = 1) and r_t = t − s_t for the run length, the number of earlier observations in the current
segment. Given s_t = s, the current task is a fresh N(0, Σ_w) draw seen only through y_s..y_{t−1} (the
segments before s are independent of it), so the posterior predictive of y_t is Gaussian with the ridge /
Kalman posterior of that segment:

    μ_s = x_tᵀ m_s,   v_s = x_tᵀ P_s x_t + σ²,   (m_s, P_s) = posterior of w given y_s..y_{t−1} under N(0, Σ_w).

The posterior over s_t is Adams & MacKay's run-length recursion (Bayesian online changepoint detection, 2007,
their eqs 3-5 with a constant hazard), exact here because every segment is linear-Gaussian. With
a_t(s) = log p(s_t = s, y_1..y_{t−1}) (a_1(1) = 0):

    b_t(s)     = a_t(s) + log N(y_t; μ_s, v_s)                  (= log p(s_t = s, y_1..y_t))
    a_{t+1}(s) = log(1 − h) + b_t(s)    for s ≤ t               (no switch at t+1)
    a_{t+1}(t+1) = log h + logsumexp_s b_t(s)                   (a switch at t+1)

and the Bayes prediction under squared loss is the posterior predictive mean, the mixture

    ŷ_t = Σ_s p(s_t = s | y_<t) μ_s,   Var[y_t | y_<t] = Σ_s p(s_t = s | y_<t) (v_s + (μ_s − ŷ_t)²).

Enumerating the switch patterns instead (2^{t−1} of them) gives the same numbers; the tests do exactly that.
Every segment start s carries its own covariance-form Kalman update (O(d²) per observation), so a prompt of T
tokens costs O(T² d²) time and O(T d²) memory, vectorised over the starts and the prompts. The weights live
in log space, renormalised at every step (their total is the log evidence log p(y_1..y_T)), so no weight
under- or overflows; h = 0 (only s = 1: the Gaussian-prior posterior mean,
:func:`iclab.baselines.gaussian_posterior_mean`) and h = 1 (only s = t: the prior mean 0, the context
ignored) are exact, through log 0 = −∞.

Noiseless labels (σ² = 0) with Σ_w ≻ 0 and inputs in general position (any d of them independent: almost
surely for continuous inputs). A segment's first d observations have proper Gaussian predictives; they pin its
task down, so from its (d+1)-th observation on the segment predicts each label exactly (v_s = 0, P_s = 0): the
label's conditional law under s is a point mass at μ_s. The posterior is then the σ → 0 limit of the one above.
In that limit a start s whose segment predicts y_t exactly carries a likelihood factor of order 1/σ, one that
predicts it with a proper variance a factor of order 1, and one whose exact prediction misses y_t a factor
e^{−O(1/σ²)}. So at a step where some start predicts y_t exactly and is right (|y_t − μ_s| within roundoff:
√eps·(|y_t| + √(x_tᵀΣ_w x_t)); a wrong exact prediction misses by O(1)), only those starts keep their weight,
each with the factor 1 of its point mass; at any other step the starts that predict exactly are wrong and
drop out, and the others are weighed as above. The starts that survive a step then agree on every segment of
more than d observations (a segment that mixes two tasks predicts wrongly; a shorter one predicts fewer labels
exactly), so the O(1) factors their exact predictions carry in the limit are common to them and cancel; the
tests check the result against an enumeration of the switch patterns that takes the limit from the singular
Gaussian likelihoods (most labels determined first, then their pseudo-determinant densities). The log evidence
is +∞ once a label is determined by the labels before it (the limit of a density on a lower-dimensional set).
Use float64 for noiseless labels: in float32 the roundoff of a right exact prediction and the miss of a wrong
one are no longer far apart.

The Bayes risk has no closed form: the predictor is non-linear in the labels (its weights are), so its risk
is an average over the 2^{n} switch patterns of Gaussian-mixture integrals with no closed form.
:func:`changepoint_bayes_risk` estimates it per position by Monte Carlo over prompts, Rao–Blackwellised over
each label given its past (the exact conditional risk Var[y_t | y_<t] is averaged, not the squared error),
with standard errors.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from iclab.baselines._conditioning import _jit
from iclab.baselines._gaussian import _prior_factor
from iclab.baselines._stats import Estimate
from iclab.errors import ConfigError

__all__ = ["ChangepointFilter", "changepoint_bayes_risk", "changepoint_filter", "changepoint_posterior_mean"]


class ChangepointFilter(NamedTuple):
    """The changepoint posterior along a batch of sequences of length T.

    Attributes:
        predictions: (..., T) a-priori Bayes predictions ŷ_t = E[y_t | y_1..y_{t−1}, x_1..x_t] (y_t unused).
        variances: (..., T) Var[y_t | y_1..y_{t−1}, x_1..x_t] (σ² included): the conditional Bayes risk of ŷ_t.
        run_length: (..., T, T) [t−1, r] = p(r_t = r | y_1..y_{t−1}), the posterior probability that the
            current segment at t holds the r observations before it (the last switch at t − r); 0 for r ≥ t.
        log_evidence: (...,) log p(y_1..y_T | x_1..x_T); +∞ where σ² = 0 and a label is determined by the
            labels before it (module docstring).
    """

    predictions: jax.Array
    variances: jax.Array
    run_length: jax.Array
    log_evidence: jax.Array


def _check(*, hazard, sigma2, prior_cov, labels: int, d: int) -> None:
    """One ConfigError line per argument out of range (traced values cannot be read and are not checked)."""
    def concrete(v):
        return not isinstance(v, jax.core.Tracer)

    if concrete(hazard) and not (np.ndim(hazard) == 0 and 0.0 <= float(hazard) <= 1.0):
        raise ConfigError(f"hazard: the switch probability per step is a number in [0, 1] (got {hazard!r})")
    if not concrete(sigma2):
        return
    if not (np.ndim(sigma2) == 0 and float(sigma2) >= 0.0):
        raise ConfigError(f"sigma2: the label-noise variance is a number >= 0 (got {sigma2!r})")
    if float(sigma2) == 0.0 and labels > d and concrete(prior_cov) and np.ndim(prior_cov) in (0, 2):
        p = np.asarray(prior_cov, np.float64)
        smallest = float(p) if p.ndim == 0 else float(np.linalg.eigvalsh(0.5 * (p + p.T))[0])
        if not smallest > 0.0:
            raise ConfigError(f"prior_cov: noiseless labels (sigma2 = 0) beyond d = {d} need a positive definite "
                              f"task prior covariance (smallest eigenvalue {smallest:g}); use sigma2 > 0")


def _run(x, y, hazard, prior_cov, sigma2):
    """The recursion of the module docstring over T tokens: per-step outputs and the final (m, P, a, log z, exact).

    The segment starts are slots 0..T (slot s is the segment starting at token s+1; slot T starts after the
    last token, for a prediction of token T+1). A slot that has not started keeps its prior (m = 0, P = Σ_w)
    and weight −∞. With σ² = 0, a slot whose segment already holds d observations predicts exactly (v = 0) and
    is not updated; ``exact`` says whether some label was determined by the labels before it.
    """
    dt = x.dtype
    T, d = x.shape[-2:]
    batch = jnp.broadcast_shapes(x.shape[:-2], y.shape[:-1])
    x = jnp.broadcast_to(x, batch + (T, d))
    y = jnp.broadcast_to(y, batch + (T,))
    S = T + 1
    C = _prior_factor(prior_cov, d, dt)
    Sigma = C @ C.T
    s2 = jnp.asarray(sigma2, dt)
    noiseless = s2 == 0
    h = jnp.asarray(hazard, dt)
    log_stay, log_switch = jnp.log1p(-h), jnp.log(h)
    slots = jnp.arange(S)
    tol = jnp.sqrt(jnp.finfo(dt).eps)

    def step(carry, inp):
        m, P, a, logz, exact = carry
        t, xt, yt = inp
        started = slots <= t
        # σ² = 0: the segment of slot s holds t − s observations; from d of them on its prediction is exact
        pinned = noiseless & started & (t - slots >= d)
        mu = jnp.einsum("...sd,...d->...s", m, xt)
        u = jnp.einsum("...sde,...e->...sd", P, xt)
        v = jnp.where(pinned, 0.0, jnp.maximum(jnp.einsum("...sd,...d->...s", u, xt), 0.0) + s2)
        p = jax.nn.softmax(a, axis=-1)  # a is −∞ on the slots not started (s > t)
        mean = jnp.sum(p * mu, axis=-1)
        var = jnp.sum(p * (v + (mu - mean[..., None]) ** 2), axis=-1)
        v_safe = jnp.where(pinned, 1.0, v)
        loglik = -0.5 * (jnp.log(2 * jnp.pi * v_safe) + (yt[..., None] - mu) ** 2 / v_safe)
        # a point mass: factor 1 where the exact prediction is right (to roundoff), 0 where it misses
        scale = jnp.abs(yt) + jnp.sqrt(jnp.einsum("...d,de,...e->...", xt, Sigma, xt))
        right = jnp.abs(yt[..., None] - mu) <= tol * scale[..., None]
        hit = pinned & right & (a > -jnp.inf)
        any_hit = jnp.any(hit, axis=-1, keepdims=True)
        b = jnp.where(any_hit, jnp.where(hit, a, -jnp.inf),
                      jnp.where(started & ~pinned, a + loglik, -jnp.inf))
        lb = jax.nn.logsumexp(b, axis=-1)
        # the Kalman update of every started segment not yet pinned; the others keep theirs (or their prior)
        upd = started & ~pinned
        k = u / v_safe[..., None]
        m = jnp.where(upd[..., None], m + k * (yt[..., None] - mu)[..., None], m)
        Pn = P - k[..., :, None] * u[..., None, :]
        P = jnp.where(upd[..., None, None], 0.5 * (Pn + jnp.swapaxes(Pn, -1, -2)), P)
        b = b - lb[..., None]  # log p(s | y_≤t)
        a = jnp.where(started, log_stay + b, jnp.where(slots == t + 1, log_switch, -jnp.inf))
        return (m, P, a, logz + lb, exact | any_hit[..., 0]), (mean, var, p)

    m0 = jnp.zeros(batch + (S, d), dt)
    P0 = jnp.broadcast_to(Sigma, batch + (S, d, d))
    a0 = jnp.broadcast_to(jnp.where(slots == 0, 0.0, -jnp.inf).astype(dt), batch + (S,))
    init = (m0, P0, a0, jnp.zeros(batch, dt), jnp.zeros(batch, bool))
    carry, (mean, var, p) = jax.lax.scan(step, init,
                                         (jnp.arange(T), jnp.moveaxis(x, -2, 0), jnp.moveaxis(y, -1, 0)))
    return carry, jnp.moveaxis(mean, 0, -1), jnp.moveaxis(var, 0, -1), jnp.moveaxis(p, 0, -2)


@_jit()
def _filter(x, y, hazard, prior_cov, sigma2):
    (_, _, _, logz, exact), mean, var, p = _run(x, y, hazard, prior_cov, sigma2)
    T = x.shape[-2]
    t = jnp.arange(T)[:, None]
    r = jnp.arange(T)[None, :]
    # p[..., t, s] over starts s (0-based) → run length r = t − s
    rl = jnp.where(r <= t, jnp.take_along_axis(p[..., :T], jnp.broadcast_to(jnp.clip(t - r, 0), p.shape[:-1] + (T,)),
                                               axis=-1), 0.0)
    return ChangepointFilter(mean, var, rl, jnp.where(exact, jnp.inf, logz))


@_jit()
def _posterior_mean(x, y, x_q, hazard, prior_cov, sigma2):
    x_q = jnp.asarray(x_q, x.dtype)
    (m, _, a, _, _), *_ = _run(x, y, hazard, prior_cov, sigma2)
    mu = jnp.einsum("...sd,...d->...s", m, x_q)
    return jnp.sum(jax.nn.softmax(a, axis=-1) * mu, axis=-1)


def changepoint_filter(x, y, *, hazard, prior_cov=1.0, sigma2) -> ChangepointFilter:
    """Runs the changepoint posterior (module docstring) along each sequence: every a-priori prediction.

    Fed a switching prompt's full x (n+1 tokens) and y, ``predictions[..., -1]`` is the Bayes prediction of the
    target (y_{n+1} enters only ``log_evidence``) and ``variances`` its conditional Bayes risk at every position.

    Args:
        x: (..., T, d) inputs x_1..x_T.
        y: (..., T) labels y_1..y_T.
        hazard: switch probability h ∈ [0, 1] per step.
        prior_cov: σ_w² (scalar: Σ_w = σ_w² I) or a (d, d) PSD task prior covariance Σ_w.
        sigma2: label-noise variance σ² ≥ 0 (0: module docstring; needs Σ_w ≻ 0 beyond d labels).
    Returns:
        :class:`ChangepointFilter` in x's dtype.
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    _check(hazard=hazard, sigma2=sigma2, prior_cov=prior_cov, labels=x.shape[-2], d=x.shape[-1])
    return _filter(x, jnp.asarray(y, x.dtype), hazard, prior_cov, sigma2)


def changepoint_posterior_mean(x, y, x_q, *, hazard, prior_cov=1.0, sigma2) -> jax.Array:
    """The Bayes prediction of the query under abrupt task switches: ŷ = Σ_s p(s | context) x_qᵀ m_s.

    The posterior predictive mean of y_{N+1} given (x_1, y_1, …, x_N, y_N, x_{N+1}): the mixture over the
    position s of the last switch (s = N+1: a switch at the query itself, predicted by the prior mean 0) of the
    Gaussian posterior means m_s of the segment y_s..y_N (module docstring). h = 0 gives
    :func:`iclab.baselines.gaussian_posterior_mean`, h = 1 gives 0.

    Args:
        x: (..., N, d) context inputs x_1..x_N.
        y: (..., N) context labels.
        x_q: (..., d) query input x_{N+1}.
        hazard: switch probability h ∈ [0, 1] per step.
        prior_cov: σ_w² (scalar) or a (d, d) PSD task prior covariance Σ_w.
        sigma2: label-noise variance σ² ≥ 0 (0: module docstring; needs Σ_w ≻ 0 beyond d labels).
    Returns:
        (...,) predictions, in x's dtype.
    """
    x = jnp.asarray(x)
    _check(hazard=hazard, sigma2=sigma2, prior_cov=prior_cov, labels=x.shape[-2], d=x.shape[-1])
    return _posterior_mean(x, jnp.asarray(y, x.dtype), x_q, hazard, prior_cov, sigma2)


def changepoint_bayes_risk(x, y, *, hazard, prior_cov=1.0, sigma2) -> Estimate:
    """The Bayes risk E[(ŷ_t − y_t)²] at every position t, by Monte Carlo over prompts, with standard errors.

    No closed form exists (module docstring). Each prompt contributes its exact conditional risk
    Var[y_t | y_<t, x_≤t] (:attr:`ChangepointFilter.variances`), whose mean is the risk (a Rao–Blackwellised
    estimate: it has less variance than the squared errors themselves). The label y_t carries its noise, so the
    risk includes σ²; subtract σ² for a noiseless target x_tᵀw_t.

    Args:
        x: (P, T, d) inputs of P prompts drawn from the switching task
            (:func:`iclab.tasks.switching.sample_switching_prompts`; the labels must come from the same h, Σ_w, σ²).
        y: (P, T) their labels.
        hazard: switch probability h ∈ [0, 1] per step.
        prior_cov: σ_w² (scalar) or a (d, d) PSD Σ_w.
        sigma2: label-noise variance σ² ≥ 0.
    Returns:
        :class:`iclab.baselines.Estimate` with mean (T,) and se (T,) (position t at index t−1).
    """
    v = changepoint_filter(x, y, hazard=hazard, prior_cov=prior_cov, sigma2=sigma2).variances
    v = v.reshape(-1, v.shape[-1])
    P = v.shape[0]
    se = jnp.std(v, axis=0, ddof=1) / jnp.sqrt(P) if P > 1 else jnp.full(v.shape[-1:], jnp.nan, v.dtype)
    return Estimate(jnp.mean(v, axis=0), se)
