import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.experiments.mhsa import fig1
from iclab.models import mhsa as models
from iclab.progress import Reporter
from iclab.tasks.multitask_regression import sample_prompts
from iclab.theory import mhsa as theory

TINY = dict(H=2, I=2, d_bar=3, L=8, batch=32, steps=6, record_every=3, eval_prompts=1024, lr=0.5,
            omega0=0.05, mu0=0.1, dtype="float64")


def _spec(H=3, I=2, seed=0):
    rng = np.random.default_rng(seed)
    return {"omega": rng.uniform(0.01, 0.3, (H, I)), "mu": rng.uniform(0.05, 2.0, (H, I))}


@pytest.mark.parametrize("rotate", [False, True])
def test_initial_params_read_back_and_are_decomposable(rotate):
    c = fig1.Fig1Config(I=2, d_bar=3, rotate=rotate, dtype="float64")
    ts = fig1.task_family(c)
    spec = _spec(I=2)
    p = jax.jit(lambda s: fig1.initial_params(s, ts, d_e=7))(spec)
    back = jax.jit(lambda q: models.read_spectral(q, ts.d_i, ts.Phi, ts.Psi))(p)
    np.testing.assert_allclose(back["omega"], spec["omega"], rtol=1e-12)
    np.testing.assert_allclose(back["mu"], spec["mu"], rtol=1e-12)
    defects = jax.jit(lambda q: fig1.decomposability_defects(q, ts))(p)
    assert set(defects) == set(fig1.DEFECTS)
    assert max(float(v) for v in defects.values()) < 1e-12
    noisy = fig1.initial_params(spec, ts, d_e=7, noise=1e-2, key=jax.random.PRNGKey(3))
    assert min(float(v) for v in fig1.decomposability_defects(noisy, ts).values()) > 1e-4


def test_full_model_at_decomposable_weights_is_the_spectral_model():
    c = fig1.Fig1Config(I=2, d_bar=3, dtype="float64")
    ts = fig1.task_family(c)
    spec = _spec(I=2, seed=1)
    pr = sample_prompts(jax.random.PRNGKey(0), ts, L=9, P=5)
    # jitted: one compilation instead of one per primitive in eager mode (same arithmetic)
    full = jax.jit(lambda s: models.predict(fig1.initial_params(s, ts, d_e=6), pr.X, pr.Y, pr.q))(spec)
    spectral = jax.jit(lambda s: models.predict_spectral(s, pr.X, pr.Y, pr.q, ts.d_i))(spec)
    np.testing.assert_allclose(full, spectral, rtol=1e-12, atol=1e-12)


def test_rise_time_interpolates_and_handles_edges():
    t = np.array([0.0, 1.0, 2.0, 3.0])
    y = np.array([0.0, 0.2, 0.6, 1.0])
    assert fig1.rise_time(t, y, 0.4) == pytest.approx(1.5)
    assert fig1.rise_time(t, y, 0.0) == 0.0
    assert np.isnan(fig1.rise_time(t, y, 2.0))


def _ideal_arrays(c: fig1.Fig1Config):
    """Arrays of a run that follows the reduced ODE exactly, decomposable, at the (4.1) loss."""
    d_i, lam = (c.d_bar,) * c.I, (c.lam,) * c.I
    w0, m0 = theory.initial_state(c.H, c.I, c.omega0, c.mu0, c.advantage)
    d = c.I * c.d_bar
    tau = np.linspace(0, 80, 161)
    ode = theory.solve_reduced_dynamics(w0, m0, tau, d_i, lam, 0.0, c.L, d)
    w_star, mu_star = theory.convergence_limit(d_i, lam, 0.0, c.L)
    gf = theory.gf_icl(d_i, lam, 0.0, c.L)
    T = tau.size
    a = {"t": tau * d / 2, "loss": np.full((1, T), gf / 2), "omega": ode.omega_bar[None], "mu": ode.mu[None],
         "omega_init": w0, "mu_init": m0, "ode_tau": tau, "ode_omega": ode.omega_bar, "ode_mu": ode.mu,
         "omega_star": w_star, "mu_star": mu_star, "gf_icl": np.float64(gf), "zero_loss": np.float64(1.0),
         "final_loss": np.array([1.05 * gf]), "final_loss_se": np.array([1e-3]),
         "limit_loss": np.array([1.05 * gf]), "limit_loss_se": np.array([1e-3])}
    a.update({f"defect_{k}": np.zeros((1, T)) for k in fig1.DEFECTS})
    return a


def test_checks_pass_on_the_ode_path_and_catch_a_swapped_allocation():
    c = fig1.Fig1Config()
    a = _ideal_arrays(c)
    checks = fig1.checks_fig1(c, a)
    assert all(ch.passed for ch in checks), [(ch.name, ch.measured) for ch in checks if not ch.passed]
    swapped = dict(a, omega=a["omega"][:, :, [1, 0, 2]], mu=a["mu"][:, :, [1, 0, 2]])
    failed = {ch.name for ch in fig1.checks_fig1(c, swapped) if not ch.passed}
    assert any(name.startswith("task allocation") for name in failed)
    tau = a["ode_tau"]  # a simulation 30 % slower than the ODE: ω̄_sim(t) = ω̄_ODE(t/1.3)
    slow = np.empty_like(a["ode_omega"])
    for h in range(3):
        for i in range(3):
            slow[:, h, i] = np.interp(tau / 1.3, tau, a["ode_omega"][:, h, i])
    late = dict(a, omega=slow[None])
    failed = {ch.name for ch in fig1.checks_fig1(c, late) if not ch.passed}
    assert any(name.startswith("emergence time") for name in failed)
    noisy = dict(a, defect_WX_offdiag=np.full_like(a["defect_WX_offdiag"], 0.05))
    failed = {ch.name for ch in fig1.checks_fig1(c, noisy) if not ch.passed}
    assert any(name.startswith("decomposability (ii)") for name in failed)


def test_tiny_run_records_shapes_checks_and_plot():
    c = fig1.Fig1Config(**TINY)
    a = fig1.run_fig1(c, Reporter())
    T = 3  # records at steps 0, 3, 6
    assert a["t"].shape == (T,) and np.allclose(a["t"], [0.0, 1.5, 3.0])
    assert a["omega"].shape == (1, T, 2, 2) and a["mu"].shape == (1, T, 2, 2)
    assert a["ode_omega"].shape == (T, 2, 2)
    np.testing.assert_allclose(a["omega"][0, 0], a["omega_init"], rtol=1e-12)
    np.testing.assert_allclose(a["mu"][0, 0], a["mu_init"], rtol=1e-12)
    assert np.all(np.isfinite(a["loss"])) and np.all(a["final_loss"] > 0)
    checks = fig1.checks_fig1(c, a)
    assert len(checks) == 9 and all(np.isfinite(ch.measured) or np.isnan(ch.measured) for ch in checks)
    fig = fig1.plot_fig1(c, a)
    assert len(fig.axes) == 4


def test_experiment_is_registered_with_quick_and_paper_presets():
    from iclab.experiments import get_experiment

    exp = get_experiment("mhsa.fig1")
    paper = exp.resolve("paper")
    assert (paper.H, paper.I, paper.I * paper.d_bar, paper.L, paper.lam, paper.sigma) == (3, 3, 30, 100, 1.0, 0.0)
    assert exp.resolve("quick").steps <= 300
    assert jnp.dtype(paper.dtype) == jnp.float32


def test_float32_is_preserved_through_data_loss_and_gradient():
    c = fig1.Fig1Config(I=2, d_bar=3, H=2, dtype="float32")
    ts = fig1.task_family(c)
    pr = sample_prompts(jax.random.PRNGKey(0), ts, L=4, P=3)
    assert {a.dtype for a in pr} == {jnp.dtype("float32")}
    w0, m0 = theory.initial_state(2, 2, 0.05, 0.1)
    p = fig1.initial_params({"omega": w0, "mu": m0}, ts, d_e=6)
    g = jax.grad(fig1.half_mse)(p, pr)
    assert {a.dtype for a in jax.tree_util.tree_leaves((p, g, fig1.half_mse(p, pr)))} == {jnp.dtype("float32")}
