"""In-context linear regression whose task switches abruptly inside the prompt (changepoints).

A prompt of length n holds inputs x_1..x_{n+1} iid N(0, Λ) and task vectors w_1..w_{n+1} that are kept from
one step to the next except at a **switch**, where the task is redrawn from its prior:

    w_1 ~ N(0, Σ_w);   for i = 2..n+1, independently:  w_i ~ N(0, Σ_w) (fresh) with probability h,
                                                        w_i = w_{i−1}          otherwise,

with labels y_i = ⟨w_i, x_i⟩ + σ ε_i, ε_i ~ N(0, 1) iid (i = 1..n+1; σ² = 0 gives noiseless labels). The
hazard h is the switch probability per step: the segments between switches have geometric lengths of mean
1/h, h = 0 is the stationary task (one w per prompt, :mod:`iclab.tasks.linreg`) and h = 1 a fresh task at
every token. The target y_{n+1} carries the noise as the context labels do (every position of the prompt is
the same kind of label, so a risk per position is one quantity along the prompt); a risk against it is the
noiseless-target risk plus σ².

The task process is stationary with a geometric autocovariance: w_i and w_j (i < j) are the same draw when
no switch falls in i+1..j (probability (1 − h)^{j−i}) and independent otherwise, so

    C(i, j) = E[w_i w_jᵀ] = (1 − h)^{|i−j|} Σ_w,

the AR(1) autocovariance of drift's Lemma 1 (:func:`iclab.theory.drift.ar1_covariance`) with γ = 1 − h at
stationarity (v = σ_w² for every step), so any second-moment (linear-estimator) risk that depends on the task
process only through C is the same as under that AR(1) drift. The Bayes predictor is not: it is the
changepoint posterior mean, :func:`iclab.baselines.changepoint_posterior_mean`.

Prompts come in drift's batch layout (:class:`iclab.tasks.drift.DriftPrompts`: x (B, n+1, d), y (B, n+1),
w (B, n+1, d)), so every drift baseline and layout helper (:func:`iclab.baselines.split_prompts`,
:func:`iclab.tasks.drift.tokens`) reads them unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from iclab.errors import ConfigError
from iclab.tasks import standard_normal
from iclab.tasks.drift import DriftPrompts
from iclab.tasks.pool import sample_pool

__all__ = ["sample_switching_prompts", "sample_switching_tasks", "switching_autocovariance"]


def _check(*, hazard=None, sigma2=None, n=None, B=None) -> None:
    """One ConfigError line per field out of range; traced values are not checked (they cannot be read)."""
    def concrete(v):
        return v is not None and not isinstance(v, jax.core.Tracer)

    if concrete(hazard) and not (np.ndim(hazard) == 0 and 0.0 <= float(hazard) <= 1.0):
        raise ConfigError(f"hazard: the switch probability per step is a number in [0, 1] (got {hazard!r})")
    if concrete(sigma2) and not (np.ndim(sigma2) == 0 and float(sigma2) >= 0.0):
        raise ConfigError(f"sigma2: the label-noise variance is a number >= 0 (got {sigma2!r})")
    if n is not None and (int(n) != n or n < 1):
        raise ConfigError(f"n: the number of context pairs is an integer >= 1 (got {n!r})")
    if B is not None and (int(B) != B or B < 1):
        raise ConfigError(f"B: the number of prompts is an integer >= 1 (got {B!r})")


def sample_switching_tasks(key: jax.Array, B: int, d: int, *, hazard, prior_cov=1.0, n: int,
                           dtype=jnp.float64) -> jax.Array:
    """Task vectors w_1..w_{n+1} of the switching process (module docstring): kept, or redrawn with probability h.

    Every step i draws a candidate g_i ~ N(0, Σ_w) and a switch b_i ~ Bernoulli(h) (b_1 = 1); w_i = g_{s(i)} with
    s(i) = max{j ≤ i : b_j = 1} the position of the last switch.

    Args:
        key: PRNG key.
        B: number of prompts.
        d: dimension.
        hazard: switch probability h ∈ [0, 1] per step (a scalar, possibly traced).
        prior_cov: σ_w² (scalar: Σ_w = σ_w² I) or a (d, d) positive semi-definite Σ_w.
        n: context length (the process runs to step n+1).
        dtype: float dtype of the result.
    Returns:
        (B, n+1, d) array; [:, i-1, :] is w_i.
    """
    _check(hazard=hazard, n=n, B=B)
    return _tasks(key, hazard, prior_cov, B=B, d=d, n=n, dtype=jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("B", "d", "n", "dtype"))
def _tasks(key, hazard, prior_cov, *, B, d, n, dtype):
    k_g, k_b = jax.random.split(key)
    T = n + 1
    g = sample_pool(k_g, B * T, d, prior_cov=prior_cov, dtype=dtype).reshape(B, T, d)
    switch = jax.random.uniform(k_b, (B, T), dtype) < jnp.asarray(hazard, dtype)
    switch = switch.at[:, 0].set(True)
    last = jax.lax.cummax(jnp.where(switch, jnp.arange(T), 0), axis=1)  # s(i) − 1, (B, T)
    return jnp.take_along_axis(g, last[..., None], axis=1)


def sample_switching_prompts(key: jax.Array, B: int, *, hazard, prior_cov=1.0, sigma2=0.0, n: int,
                             Lam: jax.Array, dtype=None) -> DriftPrompts:
    """Draws B prompts of the switching task: x_i ~ N(0, Λ), switching w_i, y_i = ⟨w_i, x_i⟩ + σ ε_i.

    Inputs, tasks and label noise use independent keys (fold_in(key, 0), (key, 1), (key, 2)); the inputs are
    drawn as :func:`iclab.tasks.drift.sample_drift_prompts` draws them (the same key gives the same x).

    Args:
        key: PRNG key.
        B: number of prompts.
        hazard: switch probability h ∈ [0, 1] per step.
        prior_cov: σ_w² (scalar) or a (d, d) PSD task prior covariance Σ_w.
        sigma2: label-noise variance σ² ≥ 0 (every label, the target y_{n+1} included).
        n: labelled context pairs.
        Lam: (d, d) input covariance Λ.
        dtype: float dtype (default Λ's).
    Returns:
        :class:`iclab.tasks.drift.DriftPrompts` with x (B, n+1, d), y (B, n+1), w (B, n+1, d).
    """
    _check(hazard=hazard, sigma2=sigma2, n=n, B=B)
    Lam = jnp.asarray(Lam)
    dtype = jnp.dtype(Lam.dtype if dtype is None else dtype)
    return _prompts(key, hazard, prior_cov, sigma2, Lam, B=B, n=n, dtype=dtype)


# One compiled program per shape: dispatched op by op, the sampler's many small ops cost seconds of compilation.
@functools.partial(jax.jit, static_argnames=("B", "n", "dtype"))
def _prompts(key, hazard, prior_cov, sigma2, Lam, *, B, n, dtype):
    d = Lam.shape[-1]
    chol = jnp.linalg.cholesky(Lam).astype(dtype)
    x = standard_normal(jax.random.fold_in(key, 0), (B, n + 1, d), dtype) @ chol.T
    w = _tasks(jax.random.fold_in(key, 1), hazard, prior_cov, B=B, d=d, n=n, dtype=dtype)
    noise = standard_normal(jax.random.fold_in(key, 2), (B, n + 1), dtype)
    y = jnp.einsum("btd,btd->bt", x, w) + jnp.sqrt(jnp.asarray(sigma2, dtype)) * noise
    return DriftPrompts(x=x, y=y, w=w)


def switching_autocovariance(*, hazard, n: int, prior_cov=1.0) -> np.ndarray:
    """The exact task autocovariance C(i, j) = E[w_i w_jᵀ] = (1 − h)^{|i−j|} Σ_w of w_1..w_{n+1}.

    With a scalar σ_w² it is returned per coordinate, as :func:`iclab.theory.drift.ar1_covariance` returns
    drift's (E[w_i w_jᵀ] = c(i, j) I_d, c(i, j) = σ_w² (1 − h)^{|i−j|}), so a risk formula written for that
    covariance reads it unchanged; with a (d, d) Σ_w the whole blocks.

    Args:
        hazard: switch probability h ∈ [0, 1] per step.
        n: context length (the matrix covers steps 1..n+1).
        prior_cov: σ_w² (scalar) or a (d, d) Σ_w.
    Returns:
        (n+1, n+1) numpy array c (entry [i-1, j-1] is c(i, j)) for a scalar prior, or (n+1, n+1, d, d) blocks
        C(i, j) for a matrix one.
    """
    _check(hazard=hazard, n=n)
    idx = np.arange(n + 1)
    decay = (1.0 - float(hazard)) ** np.abs(idx[:, None] - idx[None, :]).astype(float)  # 0⁰ = 1 on the diagonal
    p = np.asarray(prior_cov, dtype=float)
    if p.ndim == 0:
        return float(p) * decay
    if p.ndim != 2 or p.shape[0] != p.shape[1]:
        raise ConfigError(f"prior_cov: a scalar σ_w² or a square (d, d) matrix (got shape {p.shape})")
    return decay[:, :, None, None] * p
