import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.experiments._analysis import first_rise
from iclab.experiments.mhsa import _training as training
from iclab.experiments.mhsa import fig1
from iclab.models import mhsa as models
from iclab.progress import Reporter
from iclab.tasks.multitask_regression import MultitaskPrompts, block_scales, sample_prompts, task_structure
from iclab.theory import mhsa as theory

TINY = dict(H=2, I=2, d_bar=3, L=8, batch=32, steps=6, record_every=3, eval_prompts=1024, lr=0.5,
            omega0=0.05, mu0=0.1, dtype="float64")


def _spec(H=3, I=2, seed=0):
    rng = np.random.default_rng(seed)
    return {"omega": rng.uniform(0.01, 0.3, (H, I)), "mu": rng.uniform(0.05, 2.0, (H, I))}


@pytest.mark.parametrize("rotate", [False, True])
def test_initial_params_read_back_and_are_decomposable(rotate):
    c = training.Fig1Config(I=2, d_bar=3, rotate=rotate, dtype="float64")
    ts = training.task_family(c)
    spec = _spec(I=2)
    p = jax.jit(lambda s: training.initial_params(s, ts, d_e=7))(spec)
    back = jax.jit(lambda q: models.read_spectral(q, ts.d_i, ts.Phi, ts.Psi))(p)
    np.testing.assert_allclose(back["omega"], spec["omega"], rtol=1e-12)
    np.testing.assert_allclose(back["mu"], spec["mu"], rtol=1e-12)
    defects = jax.jit(lambda q: training.decomposability_defects(q, ts))(p)
    assert set(defects) == set(training.DEFECTS)
    assert max(float(v) for v in defects.values()) < 1e-12
    noisy = training.initial_params(spec, ts, d_e=7, noise=1e-2, key=jax.random.PRNGKey(3))
    assert min(float(v) for v in training.decomposability_defects(noisy, ts).values()) > 1e-4


def test_full_model_at_decomposable_weights_is_the_spectral_model():
    c = training.Fig1Config(I=2, d_bar=3, dtype="float64")
    ts = training.task_family(c)
    spec = _spec(I=2, seed=1)
    pr = sample_prompts(jax.random.PRNGKey(0), ts, L=9, P=5)
    # jitted: one compilation instead of one per primitive in eager mode (same arithmetic)
    full = jax.jit(lambda s: models.predict(training.initial_params(s, ts, d_e=6), pr.X, pr.Y, pr.q))(spec)
    spectral = jax.jit(lambda s: models.predict_spectral(s, pr.X, pr.Y, pr.q, ts.d_i))(spec)
    np.testing.assert_allclose(full, spectral, rtol=1e-12, atol=1e-12)


def test_emergence_time_interpolates_and_handles_edges():
    """The emergence times of the checks: first_rise, linear between records."""
    t = np.array([0.0, 1.0, 2.0, 3.0])
    y = np.array([0.0, 0.2, 0.6, 1.0])
    assert first_rise(t, y, 0.4) == pytest.approx(1.5)
    assert first_rise(t, y, 0.0) == 0.0
    assert np.isnan(first_rise(t, y, 2.0))


def _ideal_arrays(c: training.Fig1Config):
    """Arrays of a run that follows the reduced ODE exactly, decomposable, at the (4.1) loss."""
    d_i, lam = (c.d_bar,) * c.I, (c.lam,) * c.I
    w0, m0 = theory.initial_state(H=c.H, I=c.I, omega0=c.omega0, mu0=c.mu0, advantage=c.advantage)
    d = c.I * c.d_bar
    tau = np.linspace(0, 80, 161)
    ode = theory.solve_reduced_dynamics(tau, d_i, lam, sigma2=0.0, L=c.L, d_e=d, omega0=w0, mu0=m0)
    w_star, mu_star = theory.convergence_limit(d_i, lam, sigma2=0.0, L=c.L)
    gf = theory.gf_icl(d_i, lam, sigma2=0.0, L=c.L)
    T = tau.size
    a = {"t": tau * d / 2, "loss": np.full((1, T), gf / 2), "omega": ode.omega_bar[None], "mu": ode.mu[None],
         "omega_init": w0, "mu_init": m0, "ode_tau": tau, "ode_omega": ode.omega_bar, "ode_mu": ode.mu,
         "omega_star": w_star, "mu_star": mu_star, "gf_icl": np.float64(gf), "zero_loss": np.float64(1.0),
         "final_loss": np.array([1.05 * gf]), "final_loss_se": np.array([1e-3]),
         "limit_loss": np.array([1.05 * gf]), "limit_loss_se": np.array([1e-3])}
    # Pure minibatch noise: residues ∝ B^{-1/2} (r(B/4) = 2 r(B)), population limit 0.
    a.update({f"defect_{k}": np.full((1, T), 0.05) for k in training.DEFECTS})
    a.update({f"companion_defect_{k}": np.full((1, T), 0.10) for k in training.DEFECTS})
    a.update({"spectral_omega": ode.omega_bar[None], "spectral_mu": ode.mu[None]})
    return a


def test_checks_pass_on_the_ode_path_and_catch_a_swapped_allocation():
    c = training.Fig1Config()
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
    # A spectral model 30 % slower than the ODE: the fitted time factor is 1.3·d/2.
    failed = {ch.name for ch in fig1.checks_fig1(c, dict(a, spectral_omega=slow[None])) if not ch.passed}
    assert any(name.startswith("time factor") for name in failed)


def _with_residues(a, cond, r_big, r_small):
    out = dict(a)
    for n in fig1.CONDITIONS[cond]:
        out[f"defect_{n}"] = np.full_like(a[f"defect_{n}"], r_big)
        out[f"companion_defect_{n}"] = np.full_like(a[f"companion_defect_{n}"], r_small)
    return out


def test_population_residue_extrapolates_and_the_decomposability_checks_can_fail():
    assert fig1.population_residue(0.05 + 0.003, 0.10 + 0.003, 4) == pytest.approx(0.003)
    assert fig1.population_residue(0.05, 0.10, 4) == pytest.approx(0.0, abs=1e-15)
    c = training.Fig1Config()  # k = 4096 / 1024 = 4
    a = _ideal_arrays(c)
    for cond, prefix in (("(i)", "decomposability (i)"), ("(ii)-(iii)", "decomposability (ii)")):
        # Residues that do not shrink with the batch: not noise, population limit 0.05.
        flat = {ch.name: ch for ch in fig1.checks_fig1(c, _with_residues(a, cond, 0.05, 0.05))}
        failed = {n for n, ch in flat.items() if not ch.passed}
        assert any(n.startswith(prefix) for n in failed) and any(n.startswith("decomposability residue is") for n in failed)
        # Noise on top of a population residue 0.02: scales roughly (ratio 0.12/0.07 = 1.71 ∈ [1.4, 2.6]) but b > 1e-2.
        floor = {ch.name: ch for ch in fig1.checks_fig1(c, _with_residues(a, cond, 0.07, 0.12))}
        assert not next(ch for n, ch in floor.items() if n.startswith(prefix)).passed
        assert next(ch for n, ch in floor.items() if n.startswith(prefix)).measured == pytest.approx(0.02)
        assert next(ch for n, ch in floor.items() if n.startswith("decomposability residue is")).passed
    # Residues growing too fast with 1/B (r(B/4) = 3 r(B)) are not B^{-1/2} noise either.
    fast = {ch.name: ch for ch in fig1.checks_fig1(c, _with_residues(a, "(i)", 0.05, 0.15))}
    assert not next(ch for n, ch in fast.items() if n.startswith("decomposability residue is")).passed


def _quadrature_batch(ts, X, q):
    """Full-model prompts on the given (X, q) whose task vectors integrate G out exactly: n = max d_i
    copies of each prompt, copy r with n_i = √n e_r in block i (0 if r ≥ d_i), so that the copies'
    mean of n_i n_iᵀ is I_{d_i} = E n_i n_iᵀ; σ = 0. Their ½-MSE is the exact-expectation ½-loss."""
    d, d_y, P = ts.d, ts.d_y, X.shape[0]
    n = max(ts.d_i)
    starts = np.concatenate([[0], np.cumsum(ts.d_i)[:-1]])
    Gs = []
    for r in range(n):
        N = np.zeros((d, d_y))
        for i, (a, di) in enumerate(zip(starts, ts.d_i)):
            if r < di:
                N[a + r, i] = np.sqrt(n)
        Gs.append(np.asarray(ts.Phi) @ (block_scales(ts) * N) @ np.asarray(ts.Psi).T / np.sqrt(d))
    G = jnp.asarray(np.repeat(np.stack(Gs), P, axis=0))
    Xr, qr = jnp.tile(X, (n, 1, 1)), jnp.tile(q, (n, 1))
    return MultitaskPrompts(Xr, jnp.einsum("pdy,pdl->pyl", G, Xr), qr, jnp.einsum("pdy,pd->py", G, qr), G)


@pytest.mark.slow
def test_spectral_gd_moves_like_full_gd_from_decomposable_weights():
    """One GD step of the full model from decomposable weights moves (ω̄, μ) like one GD step on the
    balanced factors (k_i = √d_i s_i, the block's Frobenius norm) of the spectral model, on the same
    batch. The G-quadrature batch makes the two losses equal (not only in expectation), so the first-order
    moves agree exactly and what is left is O(lr²): the full step's quadratic terms (within-block spread
    of ∂L/∂W_jj, off-diagonal products). Checked by its lr² scaling; without the 1/d_i (one shared
    factor s_i per block) ω̄ would move d_i times too far."""
    ts = task_structure((3, 2), (1.0, 0.5), rotation_key=jax.random.PRNGKey(5))  # heterogeneous d_i, λ_i; Φ, Ψ ≠ I
    d_e, H, L, P = 7, 3, 9, 512
    spec = _spec(H=H, I=2, seed=2)
    kx, kq = jax.random.split(jax.random.PRNGKey(1))
    X = jax.random.normal(kx, (P, ts.d, L), jnp.float64)
    q = jax.random.normal(kq, (P, ts.d), jnp.float64)
    batch = _quadrature_batch(ts, X, q)
    p0, f0 = training.initial_params(spec, ts, d_e), training.spectral_factors(spec, ts.d_i, d_e)
    back = training.factors_to_spectral(f0, ts.d_i, d_e)
    np.testing.assert_allclose(back["omega"], spec["omega"], rtol=1e-12)
    np.testing.assert_allclose(back["mu"], spec["mu"], rtol=1e-12)
    # The same ½: the full ½-MSE on the quadrature batch is the spectral ½ exact-expectation loss.
    assert float(jax.jit(training.half_mse)(p0, batch)) == pytest.approx(
        float(jax.jit(lambda f: training.spectral_half_loss(f, X, q, ts, d_e))(f0)), rel=1e-12)
    g_full = jax.jit(jax.grad(training.half_mse))(p0, batch)
    g_spec = jax.jit(jax.grad(lambda f: training.spectral_half_loss(f, X, q, ts, d_e)))(f0)

    def shared_s_loss(f):  # wrong parametrisation: one shared s_i per block, GD without the 1/d_i
        shared = {**f, "k": f["k"] * np.sqrt(ts.d_i), "q": f["q"] * np.sqrt(ts.d_i)}
        return training.spectral_half_loss(shared, X, q, ts, d_e)

    f_wrong = {**f0, "k": f0["k"] / np.sqrt(ts.d_i), "q": f0["q"] / np.sqrt(ts.d_i)}
    g_wrong = jax.jit(jax.grad(shared_s_loss))(f_wrong)

    def moves(lr):
        p1 = jax.tree_util.tree_map(lambda a, g: a - lr * g, p0, g_full)
        f1 = jax.tree_util.tree_map(lambda a, g: a - lr * g, f0, g_spec)
        w1 = jax.tree_util.tree_map(lambda a, g: a - lr * g, f_wrong, g_wrong)
        full = models.read_spectral(p1, ts.d_i, ts.Phi, ts.Psi)
        spectral = training.factors_to_spectral(f1, ts.d_i, d_e)
        wrong = training.factors_to_spectral({**w1, "k": w1["k"] * np.sqrt(ts.d_i), "q": w1["q"] * np.sqrt(ts.d_i)},
                                         ts.d_i, d_e)
        return {k: (np.asarray(full[k]) - spec[k], np.asarray(spectral[k]) - spec[k], np.asarray(wrong[k]) - spec[k])
                for k in ("omega", "mu")}

    big, small = moves(1e-2), moves(1e-3)
    for k in ("omega", "mu"):
        full, spectral, wrong = big[k]
        gap = np.max(np.abs(full - spectral))
        assert np.max(np.abs(full)) > 0
        assert gap <= 1e-3 * np.max(np.abs(full)), (k, gap)  # measured ≈ 1e-5 (ω̄), 6e-7 (μ) of the move
        gap_small = np.max(np.abs(small[k][0] - small[k][1]))
        assert 50 < gap / gap_small < 200, (k, gap / gap_small)  # O(lr²): 100 per decade
    wrong_gap = np.max(np.abs(big["omega"][0] - big["omega"][2]) / np.abs(big["omega"][0]))
    assert wrong_gap > 0.5  # ω̄ moved by d_i = 3 or 2 times the full model's move


# Three jitted trainings (full + spectral, companion) cost ~45 s of compilation: run with the slow set,
# beside the quick preset that covers the same path end to end.
@pytest.mark.slow
def test_tiny_run_records_shapes_checks_and_plot():
    c = training.Fig1Config(**TINY)
    a = fig1.run_fig1(c, Reporter())
    T = 3  # records at steps 0, 3, 6
    assert a["t"].shape == (T,) and np.allclose(a["t"], [0.0, 1.5, 3.0])
    assert a["omega"].shape == (1, T, 2, 2) and a["mu"].shape == (1, T, 2, 2)
    assert a["ode_omega"].shape == (T, 2, 2)
    np.testing.assert_allclose(a["omega"][0, 0], a["omega_init"], rtol=1e-12)
    np.testing.assert_allclose(a["mu"][0, 0], a["mu_init"], rtol=1e-12)
    assert a["spectral_omega"].shape == (1, T, 2, 2) and a["companion_defect_UX_over_UY"].shape == (1, T)
    np.testing.assert_allclose(a["spectral_omega"][0, 0], a["omega_init"], rtol=1e-12)
    np.testing.assert_allclose(a["spectral_mu"][0, 0], a["mu_init"], rtol=1e-12)
    assert np.all(np.isfinite(a["loss"])) and np.all(a["final_loss"] > 0)
    checks = fig1.checks_fig1(c, a)
    assert len(checks) == 11 and all(np.isfinite(ch.measured) or np.isnan(ch.measured) for ch in checks)
    fig = fig1.plot_fig1(c, a)
    assert len(fig.axes) == 4


@pytest.mark.slow  # two jitted joint trainings (~20 s of compilation)
def test_train_fig1_is_plain_sgd_on_the_documented_keys_and_the_spectral_model_leaves_it_alone():
    """train_fig1 (one group of iclab.engines.train_members, params0 = the theory's init) against a naive
    per-seed, per-step GD loop on the documented keys: init noise fold_in(key_s, 1), the batch of step k
    fold_in(fold_in(key_s, 2), k). With the spectral group added (the joint sum of the two losses) the full
    model's trajectory and its recorded ½-MSE are unchanged."""
    c = training.Fig1Config(**dict(TINY, steps=3, record_every=1, init_noise=1e-3, seeds=2))
    alone = training.train_fig1(c, None)
    joint = training.train_fig1(c, None, spectral=True)
    ts, d_e = alone.ts, alone.d_e
    spec0 = {"omega": alone.omega_init, "mu": alone.mu_init}
    grad = jax.jit(jax.value_and_grad(training.half_mse))
    sample = jax.jit(lambda key: sample_prompts(key, ts, c.L, c.batch))
    for s in range(c.seeds):
        key_s = jax.random.fold_in(jax.random.PRNGKey(c.seed), s)
        p = training.initial_params(spec0, ts, d_e, c.init_noise, jax.random.fold_in(key_s, 1))
        losses = []
        for k in range(c.steps + 1):
            batch = sample(jax.random.fold_in(jax.random.fold_in(key_s, 2), k))
            loss, g = grad(p, batch)
            losses.append(float(loss))
            if k < c.steps:
                p = jax.tree_util.tree_map(lambda a, b: a - c.lr * b, p, g)
        for run in (alone, joint):
            for name in p:
                np.testing.assert_allclose(run.final[name][s], p[name], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(run.trajectory.metrics["member_loss"]["full"][s], losses, rtol=1e-12)
    np.testing.assert_allclose(joint.trajectory.metrics["spectral"]["omega"][:, 0], np.broadcast_to(
        alone.omega_init, (c.seeds,) + alone.omega_init.shape), rtol=1e-12)
    assert not np.allclose(joint.trajectory.metrics["spectral"]["omega"][:, -1],
                           joint.trajectory.metrics["spectral"]["omega"][:, 0])  # the spectral model trains


def test_experiment_is_registered_with_quick_and_paper_presets():
    from iclab.experiments import get_experiment

    exp = get_experiment("mhsa.fig1")
    paper = exp.resolve("paper")
    assert (paper.H, paper.I, paper.I * paper.d_bar, paper.L, paper.lam, paper.sigma) == (3, 3, 30, 100, 1.0, 0.0)
    assert exp.resolve("quick").steps <= 300
    assert jnp.dtype(paper.dtype) == jnp.float32


@pytest.mark.slow
def test_float32_is_preserved_through_data_loss_and_gradient():
    c = training.Fig1Config(I=2, d_bar=3, H=2, dtype="float32")
    ts = training.task_family(c)
    pr = sample_prompts(jax.random.PRNGKey(0), ts, L=4, P=3)
    assert {a.dtype for a in pr} == {jnp.dtype("float32")}
    w0, m0 = theory.initial_state(H=2, I=2, omega0=0.05, mu0=0.1)
    p = training.initial_params({"omega": w0, "mu": m0}, ts, d_e=6)
    g = jax.grad(training.half_mse)(p, pr)
    assert {a.dtype for a in jax.tree_util.tree_leaves((p, g, training.half_mse(p, pr)))} == {jnp.dtype("float32")}
