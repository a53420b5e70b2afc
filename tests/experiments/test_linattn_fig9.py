import jax
import numpy as np

from iclab.experiments.linattn import fig9
from iclab.models import linattn as models
from iclab.theory import linattn as theory


def test_rows_are_the_mlp_w1_of_eq7():
    p = models.init_attn_m(jax.random.PRNGKey(0), 3, 5, 1.0)
    np.testing.assert_array_equal(fig9._rows(p["U"]), np.asarray(models.mlp_from_attn_m(p)["W1"]))


def test_rank_alignment_and_conservation_helpers():
    d = np.array([3.0, 0, 4, 0]) / 5
    g = np.array([1.0, -2, 0.5])
    W1 = np.outer(g, d)
    assert fig9.singular_ratio(W1) < 1e-15
    np.testing.assert_allclose(fig9.row_cosines(W1, d), 1.0)
    assert fig9.singular_ratio(W1 + np.diag([0, 0, 1.0]) @ np.ones((3, 4))) > 0.1
    v = np.ones((1, 3, 2))
    U = np.zeros((1, 3, 2, 1, 1))
    U[0, 2, 0, 0, 0] = 1.0  # W₁W₁ᵀ changes by 1 in entry (0, 0) at the last record
    np.testing.assert_allclose(fig9.conserved_drift(v, U), [[0.0, 0.0, 1.0]])


def _synthetic(config, end_direction):
    """A run whose rows are g_i·vec(Λ²) up to t = 10 and g_i·end_direction at t = 20 (loss half-way at 20)."""
    Lam = np.diag(config.lambdas())
    d_plat = theory.plateau_direction(Lam)
    g = np.array([0.5, -1.0, 2.0])
    W1 = np.stack([1e-3 * np.outer(g, d_plat), 1e-3 * np.outer(g, d_plat), np.outer(g, end_direction)])[None]
    U = np.swapaxes(W1.reshape(1, 3, 3, config.D, config.D), -1, -2)  # inverse of column stacking
    v = np.broadcast_to(g, (1, 3, 3)) * np.array([1e-3, 1e-3, 1.0])[None, :, None]
    t = np.array([0.0, 10.0, 20.0])
    loss = np.array([[1.0, 1.0, 0.136]])
    r = {"Lam": Lam[None], "mlp_W1": W1, "mlp_w2": v,
         "population_half_lr_drift": np.array([[0.0, 1e-3]]), "population_drift": np.array([[0.0, 1e-3, 2e-3]])}
    for e in ("population", "sampled"):
        r.update({f"{e}_t": t, f"{e}_loss": loss, f"{e}_U": U, f"{e}_v": v})
    return r


def test_checks_pass_on_the_theory_directions_and_fail_on_vec_inverse_lambda():
    config = fig9.Fig9Config()
    Lam = np.diag(config.lambdas())
    ok = fig9.checks_fig9(config, _synthetic(config, theory.converged_direction(Lam, 1 / config.N)))
    assert all(c.passed for c in ok), [(c.name, c.measured) for c in ok if not c.passed]
    bad = {c.name: c.passed for c in fig9.checks_fig9(config, _synthetic(config, theory.large_N_direction(Lam)))}
    failed = [n for n, p in bad.items() if not p]
    assert len(failed) == 1 and failed[0].startswith("end: rows resolve the finite-N correction")
