"""The compiled LMS/RLS kernel (baselines.filter_tail_errors) against its naive twins, theory.drift's scans and a
per-token numpy loop: tail errors equal to float rounding, for every label set, block remainder and thread count."""

import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
from iclab.ops.online_filters import native
from iclab.baselines import filter_tail_errors
from iclab.theory import drift as theory


def _streams(G, B, T, d, seed=0):
    """AR(1)-drifting labels of G processes on shared Gaussian inputs (any streams would do; these are the kind the
    kernel serves)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, d))
    gam = np.linspace(0.8, 0.99, G)
    w = rng.standard_normal((B, d))[None] * np.ones((G, 1, 1))
    y = np.empty((G, B, T))
    for t in range(T):
        w = gam[:, None, None] * w + 0.1 * rng.standard_normal((B, d))[None]
        y[:, :, t] = np.einsum("gbd,bd->gb", w, x[:, t])
    return x, y


def _naive(x, y, mu, beta, delta, window):
    """One stream at a time, one token at a time (P ← (P − k (Px)ᵀ)/β)."""
    T, d = x.shape
    w, v, P = np.zeros(d), np.zeros(d), delta * np.eye(d)
    el = er = 0.0
    for t in range(T):
        rl = y[t] - x[t] @ w
        w = w + mu * x[t] * rl
        Px = P @ x[t]
        k = Px / (beta + x[t] @ Px)
        rr = y[t] - x[t] @ v
        v = v + k * rr
        P = (P - np.outer(k, Px)) / beta
        if t >= T - window:
            el, er = el + rl**2, er + rr**2
    return el / window, er / window


@pytest.mark.parametrize("G,B,T,d,window", [(1, 1, 1, 1, 1), (2, 17, 40, 3, 10), (3, 33, 25, 10, 25)])
def test_filter_tail_errors_equal_theory_scans_and_naive_loop(G, B, T, d, window):
    x, y = _streams(G, B, T, d, seed=G * 100 + B)
    lms, rls = filter_tail_errors(x, y, mu=0.02, beta=0.95, delta=50.0, window=window)
    assert lms.shape == rls.shape == (G, B)
    for g in range(G):
        want_l = ((np.asarray(theory.lms_predictions(x, y[g], mu=0.02)) - y[g])[:, T - window:] ** 2).mean(-1)
        want_r = ((np.asarray(theory.rls_predictions(x, y[g], beta=0.95, delta=50.0)) - y[g])[:, T - window:] ** 2
                  ).mean(-1)
        np.testing.assert_allclose(lms[g], want_l, rtol=1e-12)
        np.testing.assert_allclose(rls[g], want_r, rtol=1e-9)  # P's rounding accumulates over the stream
        for b in (0, B - 1):
            np.testing.assert_allclose((lms[g, b], rls[g, b]), _naive(x[b], y[g, b], 0.02, 0.95, 50.0, window),
                                       rtol=1e-9)


def test_filter_tail_errors_of_one_label_set_and_bad_window():
    x, y = _streams(2, 5, 12, 2)
    lms, rls = filter_tail_errors(x, y[1], mu=0.05, beta=0.9, delta=10.0, window=4)
    both = filter_tail_errors(x, y, mu=0.05, beta=0.9, delta=10.0, window=4)
    assert lms.shape == (5,) and np.array_equal(lms, both[0][1]) and np.array_equal(rls, both[1][1])
    for window in (0, 13):
        with pytest.raises(ValueError, match="window"):
            filter_tail_errors(x, y, mu=0.05, beta=0.9, delta=10.0, window=window)
    with pytest.raises(ValueError, match=r"\(B, T, d\)"):
        filter_tail_errors(x, y[:, :4], mu=0.05, beta=0.9, delta=10.0, window=4)


def test_filter_tail_errors_do_not_depend_on_the_thread_count(monkeypatch):
    """Each stream is one lane of one block: 1, 2 and 3 threads give the same bits."""
    x, y = _streams(2, 3 * native.CHUNK + 5, 30, 4, seed=9)
    out = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(native, "thread_count", lambda n=threads: n)
        out.append(filter_tail_errors(x, y, mu=0.01, beta=0.98, delta=100.0, window=7))
    for o in out[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(o, out[0]))
