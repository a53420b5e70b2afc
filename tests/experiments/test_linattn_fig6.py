import jax.numpy as jnp
import numpy as np
import pytest

from iclab.experiments.linattn import fig6
from iclab.experiments.linattn._common import keys_and_covariances
from iclab.progress import Reporter
from iclab.theory import linattn as theory


def test_crossing_time_interpolates_between_records():
    t = np.array([0.0, 1.0, 2.0, 3.0])
    assert fig6.crossing_time(t, np.array([1.0, 0.8, 0.4, 0.2]), 0.6) == pytest.approx(1.5)
    assert fig6.crossing_time(t, np.array([0.5, 0.4, 0.3, 0.2]), 0.6) == 0.0
    assert np.isnan(fig6.crossing_time(t, np.ones(4), 0.6))


def test_ordering_violations_and_peak_rate_index():
    assert fig6.ordering_violations(np.array([[40.0, 41], [30, 31], [1, 2]])) == 0
    assert fig6.ordering_violations(np.array([[40.0, 41], [40, 31], [1, 35]])) == 2
    t = np.linspace(0, 10, 201)
    assert fig6.peak_rate_index(t, np.exp(-t)) == 0  # lazy: fastest at once
    assert fig6.peak_rate_index(t, 1 - 1 / (1 + np.exp(-(t - 5)))) > 0  # a plateau first


def test_config_requires_small_and_large_increasing_inits():
    with pytest.raises(ValueError, match="increasing"):
        fig6.Fig6Config(w_inits_m=[1e-6, 1e-2, 1e-4, 1.0])
    with pytest.raises(ValueError, match="fit_max_init"):
        fig6.Fig6Config(w_inits_s=[1e-2, 1e-1, 1.0])
    with pytest.raises(ValueError, match="largest"):
        fig6.Fig6Config(w_inits_m=[1e-6, 1e-4, 1e-3], fit_max_init=1e-2)
    # an init scale outside the engine's w_init bounds is refused by the grid's element bounds, before anything runs
    with pytest.raises(ValueError, match=r"w_inits_m\.3\n  Input should be less than or equal to 1000"):
        fig6.Fig6Config(w_inits_m=[1e-6, 1e-4, 1e-2, 1e4])


def test_training_is_population_gradient_flow_from_each_init():
    config = fig6.Fig6Config(rtol=1e-9)
    spec = config.training("attn_s", 0.3)
    assert (spec.engine, spec.integrator, spec.H, spec.w_init, spec.rtol) == ("population", "gf", 4, 0.3, 1e-9)
    assert config.training("attn_m", 1e-6).H == 8

@pytest.mark.slow
def test_refined_crossing_matches_the_exact_eq21_solution():
    # Aligned init: v₁ follows eq 21 exactly; the half-way loss is reached at v_half with
    # L = trΛ − 2λ²v³ + λa v⁶, and eq 70 gives the exact time (paper units, t/τ = 2t).
    config = fig6.Fig6Config(seeds=1, n_records=30)
    lam = config.lambdas()
    inv_N = 1.0 / config.N
    _, Lams = keys_and_covariances(config)
    w = 0.05
    v, k, q = theory.plateau_ansatz_weights(lam, 0, v_next=w, inv_N=inv_N, H=config.H_s)
    params0 = {"v": jnp.asarray(v[None]), "k": jnp.asarray(k[None]), "q": jnp.asarray(q[None])}
    spec = config.training("attn_s", w)
    tr = fig6._flow(spec, config, params0, Lams, 2000.0, Reporter(), "aligned")
    levels = theory.plateau_losses(lam, inv_N)
    half = 0.5 * (levels[0] + levels[1])
    t1 = fig6._crossings(spec, config, tr, Lams, half, Reporter(), "refine")[0]
    a = lam[0] ** 2 * (1 + inv_N * (1 + lam.sum() / lam[0]))
    u = np.roots([lam[0] * a, -2 * lam[0] ** 2, lam.sum() - half])  # u = v³
    v_half = np.min(u[u > 0]) ** (1 / 3)
    ode = dict(lam=lam[0], inv_N=inv_N, trace=lam.sum())
    exact = 0.5 * (theory.eq70_time(v_half, **ode) - theory.eq70_time(w, **ode))
    coarse = fig6.crossing_time(tr.t, tr.loss[0], half)
    assert abs(t1 - exact) < 1e-3 * exact
    assert abs(coarse - exact) > abs(t1 - exact)  # the log grid alone is coarser
