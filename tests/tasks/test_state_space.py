"""Linear-Gaussian state-space task drift: the exact autocovariance against the states written as a linear map of
(s_0, e_1, e_2, ...) (float64), AR(1) against Lemma 1, the sampler against the autocovariance (Monte Carlo, 5 SE)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
import iclab.theory.drift as drift
from iclab.errors import ConfigError
from iclab.tasks import state_space as ss
from iclab.tasks.drift import tokens


def _brute_autocovariance(p: ss.StateSpace, n: int) -> np.ndarray:
    """E[w_a w_bᵀ] from s_t = F^t s_0 + Σ_{j≤t} F^{t−j} e_j: s_t = L_t z, z = (s_0, e_1..e_{n+1}) independent."""
    k, T = p.k, n + 1
    cov_z = np.zeros((k * (T + 1), k * (T + 1)))
    cov_z[:k, :k] = p.P0
    for j in range(1, T + 1):
        cov_z[j * k:(j + 1) * k, j * k:(j + 1) * k] = p.Q
    L = np.zeros((T, k, k * (T + 1)))
    for t in range(1, T + 1):
        for j in range(t + 1):
            L[t - 1, :, j * k:(j + 1) * k] = np.linalg.matrix_power(p.F, t - j)
    W = np.einsum("dk,tkz->tdz", p.H, L)
    return np.einsum("adz,zy,bey->abde", W, cov_z, W)


PROCESSES = {
    "ar1": ss.ar1_process(3, gamma=0.9, sigma_w2=1.0, sigma_e2=0.1),
    "rotation": ss.rotation_process(4, omega=0.7, sigma_w2=1.0, sigma_e2=0.05, gamma=0.97),
    "trend": ss.trend_process(2, sigma_w2=1.0, sigma_v2=0.2, sigma_e2=0.02, sigma_u2=0.005),
}


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_autocovariance_equals_the_linear_map_of_the_innovations(name):
    p, n = PROCESSES[name], 7
    C = ss.task_autocovariance(p, n=n)
    assert C.shape == (n + 1, n + 1, p.d, p.d)
    np.testing.assert_allclose(C, _brute_autocovariance(p, n), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(C, np.swapaxes(np.swapaxes(C, 0, 1), 2, 3))  # C(b, a) = C(a, b)ᵀ


def test_ar1_autocovariance_is_lemma1():
    setting = dict(gamma=0.85, sigma_w2=0.7, sigma_e2=0.2)
    C = ss.task_autocovariance(ss.ar1_process(2, **setting), n=9)
    c = drift.ar1_covariance(**setting, n=9)
    np.testing.assert_allclose(C, c[:, :, None, None] * np.eye(2), rtol=1e-14, atol=1e-15)


def test_pure_rotation_is_periodic_and_the_trend_moves_at_its_velocity():
    p = ss.rotation_process(4, omega=2 * np.pi / 5, sigma_w2=1.0, sigma_e2=0.0)
    pr = ss.sample_state_space_prompts(jax.random.PRNGKey(0), 3, p, n=11, Lam=np.eye(4))
    w = np.asarray(pr.w)
    np.testing.assert_allclose(w[:, 5:], w[:, :-5], rtol=0, atol=1e-12)  # period 5
    np.testing.assert_allclose(np.linalg.norm(w, axis=-1), np.linalg.norm(w[:, :1], axis=-1).repeat(12, 1), rtol=1e-12)
    t = ss.trend_process(2, sigma_w2=1.0, sigma_v2=1.0, sigma_e2=0.0, sigma_u2=0.0)
    w = np.asarray(ss.sample_state_space_prompts(jax.random.PRNGKey(1), 3, t, n=6, Lam=np.eye(2)).w)
    np.testing.assert_allclose(np.diff(w, 2, axis=1), 0.0, rtol=0, atol=1e-12)  # constant velocity: straight line


def test_prompts_layout_and_noise():
    p = PROCESSES["trend"]
    Lam = np.array([[1.0, 0.3], [0.3, 0.5]])
    pr = ss.sample_state_space_prompts(jax.random.PRNGKey(2), 4000, p, n=5, Lam=Lam, sigma2=0.3)
    assert pr.x.shape == (4000, 6, 2) and pr.y.shape == (4000, 6) and pr.w.shape == (4000, 6, 2) and pr.n == 5
    assert tokens(pr).shape == (4000, 6, 3)
    r = np.asarray(pr.y - np.einsum("btd,btd->bt", pr.x, pr.w)).ravel()  # the label noise σε
    assert abs(r.var() - 0.3) < 4 * 0.3 * np.sqrt(2 / r.size)  # Var of a sample variance of N(0, σ²): 2σ⁴/N
    noiseless = ss.sample_state_space_prompts(jax.random.PRNGKey(2), 4000, p, n=5, Lam=Lam)
    np.testing.assert_array_equal(noiseless.w, pr.w)  # the noise has its own key


@pytest.mark.parametrize("name", ["rotation", "trend"])
def test_sampled_tasks_have_the_autocovariance(name):
    """E[w_a w_bᵀ] entrywise, Monte Carlo at 5 standard errors (one compile, 20000 prompts)."""
    p, n, B = PROCESSES[name], 5, 20000
    w = np.asarray(ss.sample_state_space_prompts(jax.random.PRNGKey(3), B, p, n=n, Lam=np.eye(p.d)).w)
    prod = np.einsum("bai,bcj->bacij", w, w)
    est, se = prod.mean(0), prod.std(0, ddof=1) / np.sqrt(B)
    C = ss.task_autocovariance(p, n=n)
    assert np.all(np.abs(est - C) <= 5 * se + 1e-12)


@pytest.mark.parametrize("call,field", [
    (lambda: ss.rotation_process(3, omega=0.1, sigma_w2=1.0, sigma_e2=0.1), "d"),
    (lambda: ss.ar1_process(2, gamma=0.9, sigma_w2=-1.0, sigma_e2=0.1), "sigma_w2"),
    (lambda: ss.trend_process(2, sigma_w2=1.0, sigma_v2=1.0, sigma_e2=0.0, sigma_u2=float("nan")), "sigma_u2"),
    (lambda: ss.linear_gaussian_process(np.eye(2), -np.eye(2), np.eye(2)), "Q"),
    (lambda: ss.linear_gaussian_process(np.eye(2), np.eye(2), np.eye(2), H=np.eye(3)), "H"),
    (lambda: ss.task_autocovariance(PROCESSES["ar1"], n=0), "n"),
    (lambda: ss.sample_state_space_prompts(jax.random.PRNGKey(0), 2, PROCESSES["ar1"], n=3, Lam=np.eye(2)), "Lam"),
])
def test_bad_input_is_one_line_naming_the_field(call, field):
    with pytest.raises(ConfigError) as e:
        call()
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and "\n" not in msg
