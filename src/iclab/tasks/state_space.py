"""In-context linear regression under linear-Gaussian state-space task drift (a generalisation of drift's AR(1)).

The task of token i is read from a latent state s_i ∈ R^k that evolves linearly with Gaussian innovations,

    s_0 ~ N(0, P_0),   s_i = F s_{i−1} + e_i,   e_i ~ N(0, Q)   (i = 1..n+1),
    w_i = H s_i ∈ R^d,   x_i ~ N(0, Λ) iid,   y_i = x_iᵀ w_i + σ ε_i,   ε_i ~ N(0, 1),

and the target is y_{n+1}. H (d, k) selects the task from an augmented state: the state of a linear trend
is (w, v), a task and its velocity. F is any (k, k) matrix (:func:`linear_gaussian_process`); three families
are built here:

- :func:`ar1_process`: F = γ I, Q = σ_e² I, P_0 = σ_w² I, H = I: drift's AR(1) task (drift eq 2,
  :mod:`iclab.tasks.drift`), whose task covariance is Lemma 1's c(a, b) I.
- :func:`rotation_process`: F = γ R(ω), R(ω) the block-diagonal rotation by the angle ω in each of the d/2
  coordinate planes (d even): a task that turns by ω per token, periodic with period 2π/ω when γ = 1, σ_e = 0.
- :func:`trend_process`: state (w, v) ∈ R^{2d}, w_i = w_{i−1} + v_{i−1} + e_i, v_i = v_{i−1} + e'_i
  (e ~ N(0, σ_e² I), e' ~ N(0, σ_u² I), w_0 ~ N(0, σ_w² I), v_0 ~ N(0, σ_v² I)): a task moving at a
  slowly varying velocity.

The second moments are exact: Σ_i = Cov(s_i) follows Σ_i = F Σ_{i−1} Fᵀ + Q (Σ_0 = P_0) and
E[s_a s_bᵀ] = F^{a−b} Σ_b for a ≥ b, so the task autocovariance is C(a, b) = E[w_a w_bᵀ] = H F^{a−b} Σ_b Hᵀ
(:func:`task_autocovariance`). The risk of any predictor linear in the labels depends on the task process only
through C (:mod:`iclab.theory.nonstationary`), and the Bayes predictor is the Kalman filter of (F, Q, P_0, H, σ²)
(:func:`iclab.baselines.state_space_filter`).

Prompts are drift's :class:`~iclab.tasks.drift.DriftPrompts` (x (B, n+1, d), y (B, n+1), w (B, n+1, d)), so
``iclab.tasks.drift.tokens`` and ``iclab.baselines.split_prompts`` read them; the labels here carry the noise
σε_i (σ = 0 is drift's noiseless case).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from iclab.errors import ConfigError
from iclab.tasks import standard_normal
from iclab.tasks.drift import DriftPrompts

__all__ = ["StateSpace", "ar1_process", "linear_gaussian_process", "rotation_process", "sample_state_space_prompts", "state_covariances",
           "task_autocovariance", "trend_process"]


class StateSpace(NamedTuple):
    """A linear-Gaussian task process s_i = F s_{i−1} + e_i, e_i ~ N(0, Q), s_0 ~ N(0, P_0), task w_i = H s_i.

    The field names are the keywords of :func:`iclab.baselines.state_space_filter`, so
    ``state_space_filter(x, y, **process._asdict())`` runs its Kalman filter.

    Attributes:
        F: (k, k) transition matrix.
        Q: (k, k) innovation covariance (symmetric positive semidefinite).
        P0: (k, k) covariance of the initial state s_0 (symmetric positive semidefinite).
        H: (d, k) task readout w_i = H s_i.
    """

    F: np.ndarray
    Q: np.ndarray
    P0: np.ndarray
    H: np.ndarray

    @property
    def d(self) -> int:
        """Dimension d of the task (and of the inputs)."""
        return self.H.shape[0]

    @property
    def k(self) -> int:
        """Dimension k of the state."""
        return self.F.shape[0]


def _nonneg(name, value):
    if not (np.isfinite(value) and value >= 0):
        raise ConfigError(f"{name}: a variance is a finite number >= 0 (got {value!r})")
    return float(value)


def _dim(d, *, even=False):
    if int(d) != d or d < 1 or (even and d % 2):
        allowed = "an even integer >= 2" if even else "an integer >= 1"
        raise ConfigError(f"d: the task dimension must be {allowed} (got {d!r})")
    return int(d)


def _checked(F, Q, P0, H) -> StateSpace:
    F, Q, P0, H = (np.asarray(a, dtype=float) for a in (F, Q, P0, H))
    k = F.shape[0] if F.ndim == 2 else -1
    if F.shape != (k, k) or k < 1:
        raise ConfigError(f"F: the transition must be a square (k, k) matrix (got shape {F.shape})")
    for name, M in (("Q", Q), ("P0", P0)):
        if M.shape != (k, k) or not np.allclose(M, M.T, rtol=0, atol=1e-12 * max(1.0, np.abs(M).max())):
            raise ConfigError(f"{name}: a covariance must be a symmetric ({k}, {k}) matrix (got shape {M.shape})")
        if np.linalg.eigvalsh(M).min() < -1e-12 * max(1.0, np.abs(M).max()):
            raise ConfigError(f"{name}: a covariance must be positive semidefinite (smallest eigenvalue "
                              f"{np.linalg.eigvalsh(M).min():.3g})")
    if H.ndim != 2 or H.shape[1] != k:
        raise ConfigError(f"H: the task readout must be a (d, {k}) matrix (got shape {H.shape})")
    return StateSpace(F, Q, P0, H)


def linear_gaussian_process(F, Q, P0, H=None) -> StateSpace:
    """A :class:`StateSpace` from its matrices, checked (H defaults to the identity: the state is the task).

    Args:
        F: (k, k) transition.
        Q: (k, k) innovation covariance.
        P0: (k, k) covariance of s_0.
        H: (d, k) task readout, or None for I_k.
    Returns:
        StateSpace in float64.
    """
    F = np.asarray(F, dtype=float)
    return _checked(F, Q, P0, np.eye(F.shape[0]) if H is None else H)


def ar1_process(d: int, *, gamma, sigma_w2, sigma_e2) -> StateSpace:
    """Drift's AR(1) task (drift eq 2): F = γ I_d, Q = σ_e² I_d, P_0 = σ_w² I_d, H = I_d.

    Args:
        d: task dimension.
        gamma: AR(1) coefficient γ (any real; |γ| > 1 is Theorem 4's explosive range).
        sigma_w2: variance σ_w² of a coordinate of w_0.
        sigma_e2: innovation variance σ_e².
    Returns:
        StateSpace with k = d.
    """
    d = _dim(d)
    if not np.isfinite(gamma):
        raise ConfigError(f"gamma: the AR(1) coefficient must be a finite number (got {gamma!r})")
    eye = np.eye(d)
    return _checked(float(gamma) * eye, _nonneg("sigma_e2", sigma_e2) * eye, _nonneg("sigma_w2", sigma_w2) * eye, eye)


def rotation_process(d: int, *, omega, sigma_w2, sigma_e2, gamma=1.0) -> StateSpace:
    """A task turning by the angle ω per token: F = γ R(ω), R(ω) = diag(r(ω), ..., r(ω)) (d/2 blocks).

    r(ω) = [[cos ω, −sin ω], [sin ω, cos ω]] rotates each coordinate plane (w_{2j−1}, w_{2j}); Q = σ_e² I,
    P_0 = σ_w² I, H = I. With γ = 1 and σ_e = 0 the task is periodic along the prompt with period 2π/ω; with
    γ < 1 the stationary covariance is σ_e²/(1 − γ²) I, as for AR(1) (R is orthogonal). C(a, b) = c(a, b) R(ω)^{a−b}
    for a ≥ b, c the AR(1) covariance of Lemma 1.

    Args:
        d: task dimension, even.
        omega: rotation angle ω per token (radians).
        sigma_w2: variance σ_w² of a coordinate of w_0.
        sigma_e2: innovation variance σ_e².
        gamma: damping γ (1: a pure rotation).
    Returns:
        StateSpace with k = d.
    """
    d = _dim(d, even=True)
    for name, v in (("omega", omega), ("gamma", gamma)):
        if not np.isfinite(v):
            raise ConfigError(f"{name}: must be a finite number (got {v!r})")
    c, s = np.cos(float(omega)), np.sin(float(omega))
    F = float(gamma) * np.kron(np.eye(d // 2), np.array([[c, -s], [s, c]]))
    eye = np.eye(d)
    return _checked(F, _nonneg("sigma_e2", sigma_e2) * eye, _nonneg("sigma_w2", sigma_w2) * eye, eye)


def trend_process(d: int, *, sigma_w2, sigma_v2, sigma_e2, sigma_u2) -> StateSpace:
    """A task moving at a slowly varying velocity: state (w, v) ∈ R^{2d}, w_i = w_{i−1} + v_{i−1} + e_i, v_i = v_{i−1} + e'_i.

    F = [[I, I], [0, I]], Q = diag(σ_e² I, σ_u² I), P_0 = diag(σ_w² I, σ_v² I), H = [I, 0]. The task's
    variance grows like σ_v² i² (+ σ_u² i³/3 + σ_e² i): not stationary.

    Args:
        d: task dimension.
        sigma_w2: variance σ_w² of a coordinate of w_0.
        sigma_v2: variance σ_v² of a coordinate of the initial velocity v_0.
        sigma_e2: variance σ_e² of the task's own innovation e_i.
        sigma_u2: variance σ_u² of the velocity's innovation e'_i.
    Returns:
        StateSpace with k = 2d.
    """
    d = _dim(d)
    eye, zero = np.eye(d), np.zeros((d, d))
    F = np.block([[eye, eye], [zero, eye]])
    Q = np.block([[_nonneg("sigma_e2", sigma_e2) * eye, zero], [zero, _nonneg("sigma_u2", sigma_u2) * eye]])
    P0 = np.block([[_nonneg("sigma_w2", sigma_w2) * eye, zero], [zero, _nonneg("sigma_v2", sigma_v2) * eye]])
    return _checked(F, Q, P0, np.hstack([eye, zero]))


def _length(n):
    if int(n) != n or n < 1:
        raise ConfigError(f"n: the number of context pairs must be an integer >= 1 (got {n!r})")
    return int(n)


def state_covariances(process: StateSpace, *, n: int) -> np.ndarray:
    """Σ_i = Cov(s_i) for i = 0..n+1, by Σ_i = F Σ_{i−1} Fᵀ + Q from Σ_0 = P_0 (exact, float64).

    Args:
        process: the task process.
        n: number of context pairs (the query is step n+1).
    Returns:
        (n+2, k, k) numpy array; [i] is Σ_i.
    """
    n = _length(n)
    F, Q = process.F, process.Q
    out = np.empty((n + 2,) + F.shape)
    out[0] = process.P0
    for i in range(1, n + 2):
        S = F @ out[i - 1] @ F.T + Q
        out[i] = 0.5 * (S + S.T)
    return out


def task_autocovariance(process: StateSpace, *, n: int) -> np.ndarray:
    """The task autocovariance C(a, b) = E[w_a w_bᵀ] = H F^{a−b} Σ_b Hᵀ (a ≥ b; C(b, a) = C(a, b)ᵀ), exact.

    The input of :func:`iclab.theory.nonstationary.exponential_weights_risk`. For :func:`ar1_process` it is
    c(a, b) I_d with c Lemma 1's covariance (``iclab.theory.drift.ar1_covariance``).

    Args:
        process: the task process.
        n: number of context pairs; the matrix covers the tasks w_1..w_{n+1}.
    Returns:
        (n+1, n+1, d, d) numpy array; [a−1, b−1] is E[w_a w_bᵀ].
    """
    Sig = state_covariances(process, n=n)
    F, H = process.F, process.H
    d, T = H.shape[0], n + 1
    C = np.empty((T, T, d, d))
    for b in range(1, T + 1):
        K = Sig[b]  # E[s_a s_bᵀ] for a = b, b+1, ...
        for a in range(b, T + 1):
            C[a - 1, b - 1] = H @ K @ H.T
            C[b - 1, a - 1] = C[a - 1, b - 1].T
            K = F @ K
    return C


def _sqrt_psd(M):
    """A square root R with R Rᵀ = M of a symmetric PSD M (eigen form: a singular M has one too)."""
    vals, vecs = np.linalg.eigh(M)
    return vecs * np.sqrt(np.clip(vals, 0.0, None))


def sample_state_space_prompts(key: jax.Array, B: int, process: StateSpace, *, n: int, Lam, sigma2=0.0,
                               dtype=None) -> DriftPrompts:
    """Draws B prompts of the state-space drifting task (module docstring) in drift's prompt layout.

    Inputs, state noise and label noise use independent keys (fold_in(key, 0), (key, 1), (key, 2)).

    Args:
        key: PRNG key.
        B: number of prompts.
        process: the task process (F, Q, P_0, H).
        n: labelled context pairs (the query is token n+1).
        Lam: (d, d) input covariance Λ.
        sigma2: label-noise variance σ² ≥ 0 (on every label, the target's included).
        dtype: float dtype (default Λ's, float64 for a numpy Λ).
    Returns:
        DriftPrompts with x (B, n+1, d), y (B, n+1) (noisy labels), w (B, n+1, d) (tasks w_i = H s_i).
    """
    n = _length(n)
    if int(B) != B or B < 1:
        raise ConfigError(f"B: the number of prompts must be an integer >= 1 (got {B!r})")
    sigma2 = _nonneg("sigma2", sigma2)
    Lam = jnp.asarray(Lam)
    d, k = process.d, process.k
    if Lam.shape != (d, d):
        raise ConfigError(f"Lam: the input covariance must be a ({d}, {d}) matrix (got shape {Lam.shape})")
    dtype = Lam.dtype if dtype is None else dtype
    chol = jnp.linalg.cholesky(Lam).astype(dtype)
    x = standard_normal(jax.random.fold_in(key, 0), (B, n + 1, d), dtype) @ chol.T
    F, H = (jnp.asarray(a, dtype) for a in (process.F, process.H))
    rQ, rP = (jnp.asarray(_sqrt_psd(M), dtype) for M in (process.Q, process.P0))
    eps = standard_normal(jax.random.fold_in(key, 1), (n + 2, B, k), dtype)

    def step(s, eps_i):
        s = s @ F.T + eps_i @ rQ.T
        return s, s @ H.T

    _, w = jax.lax.scan(step, eps[0] @ rP.T, eps[1:])
    w = jnp.moveaxis(w, 0, -2)
    noise = standard_normal(jax.random.fold_in(key, 2), (B, n + 1), dtype)
    y = jnp.einsum("btd,btd->bt", x, w) + jnp.sqrt(jnp.asarray(sigma2, dtype)) * noise
    return DriftPrompts(x=x, y=y, w=w)
