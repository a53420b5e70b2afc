import jax
import numpy as np
import pytest

from iclab.models import linattn as m
from iclab.tasks.linreg import covariance, sample_prompts


@pytest.mark.parametrize("D,H,N", [(1, 1, 1), (3, 2, 5), pytest.param(4, 8, 31, marks=pytest.mark.slow),
                                   pytest.param(6, 3, 9, marks=pytest.mark.slow)])
def test_full_matrix_attn_m_equals_eq_m_equals_mlp(D, H, N):
    """Forward pass (eqs M, 7, 42): the three forms of ATTN_M agree to 1e-12, with random * blocks."""
    key = jax.random.PRNGKey(D * 100 + H)
    Lam = covariance(np.linspace(1.0, 0.2, D), jax.random.fold_in(key, 0))
    pr = sample_prompts(jax.random.fold_in(key, 1), Lam, N, 13)
    reduced = m.init_attn_m(jax.random.fold_in(key, 2), D, H, w_init=1.0)
    full = m.attn_m_full_from_reduced(reduced, jax.random.fold_in(key, 3), scale=1.0)
    y_m = m.predict_attn_m(reduced, pr)
    y_full = m.predict_attn_m_full(full, pr)
    y_mlp = m.predict_mlp(m.mlp_from_attn_m(reduced), pr)
    scale = np.abs(y_m).max()
    np.testing.assert_allclose(y_full, y_m, atol=1e-12 * scale, rtol=0)
    np.testing.assert_allclose(y_mlp, y_m, atol=1e-12 * scale, rtol=0)


def test_full_matrix_attn_m_against_a_naive_token_loop():
    """The full form against a direct evaluation of X + Σ_i (1/N) W^V_i X Xᵀ W^{KQ}_i X."""
    D, H, N = 3, 2, 4
    key = jax.random.PRNGKey(0)
    pr = sample_prompts(key, covariance([0.5, 0.3, 0.2]), N, 3)
    WV = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (H, D + 1, D + 1)))
    WKQ = np.asarray(jax.random.normal(jax.random.fold_in(key, 2), (H, D + 1, D + 1)))
    got = m.predict_attn_m_full({"WV": WV, "WKQ": WKQ}, pr)
    for p in range(3):
        X = np.zeros((D + 1, N + 1))
        for n in range(N):
            X[:D, n], X[D, n] = pr.x[p, n], pr.y[p, n]
        X[:D, N] = pr.x_q[p]
        out = X.copy()
        for i in range(H):
            out += WV[i] @ X @ X.T @ WKQ[i] @ X / N
        assert got[p] == pytest.approx(out[D, N], rel=1e-12)


def test_nonzero_value_or_key_blocks_change_the_prediction():
    """The zero blocks matter: eq M holds only with v⃗ = u = 0 (otherwise the test above is vacuous)."""
    D, H, N = 3, 2, 5
    key = jax.random.PRNGKey(5)
    pr = sample_prompts(key, covariance([0.5, 0.3, 0.2]), N, 7)
    reduced = m.init_attn_m(jax.random.fold_in(key, 1), D, H, 1.0)
    full = m.attn_m_full_from_reduced(reduced, jax.random.fold_in(key, 2))
    bumped = dict(full, WV=full["WV"].at[:, -1, 0].set(0.5))
    assert np.abs(m.predict_attn_m_full(bumped, pr) - m.predict_attn_m(reduced, pr)).max() > 1e-3


def test_effective_matrices_and_cubic_feature_layout():
    D, H = 4, 5
    key = jax.random.PRNGKey(7)
    pr = sample_prompts(key, covariance([0.4, 0.3, 0.2, 0.1]), 6, 9)
    params = m.init_attn_m(key, D, H, 1.0)
    A = m.effective_matrix_attn_m(params)
    np.testing.assert_allclose(A, m.effective_matrix_mlp(m.mlp_from_attn_m(params)), atol=1e-15)
    beta = np.asarray(pr.x.transpose(0, 2, 1) @ pr.y[..., None])[..., 0] / 6
    z = m.cubic_feature(pr)
    i, j = 1, 3  # column-stacking vec: z[jD + i] = β_i x_{q,j}
    np.testing.assert_allclose(z[:, j * D + i], beta[:, i] * pr.x_q[:, j], rtol=1e-12)
    np.testing.assert_allclose(m.predict_attn_m(params, pr), np.einsum("pi,ij,pj->p", beta, A, pr.x_q), rtol=1e-11)


def test_init_scale_of_eq_34():
    """Eq 34: ‖w₂‖² and ‖W₁‖_F² both have mean w_init² (checked over many heads)."""
    params = m.init_attn_m(jax.random.PRNGKey(0), D=4, H=4000, w_init=0.3)
    assert float(np.sum(params["v"] ** 2)) == pytest.approx(0.09, rel=0.1)
    assert float(np.sum(params["U"] ** 2)) == pytest.approx(0.09, rel=0.1)


def test_registered_families_are_this_module_s_functions():
    """The families of task linreg read this module's functions; full forms point at their full family."""
    from iclab.models import get_model, model_families

    linreg = model_families("linreg")
    assert {"attn_m", "attn_s", "mlp", "attn_m_full", "attn_s_full", "softmax_attn_m", "softmax_attn_s"} <= set(linreg)
    assert get_model("attn_m").predict is m.predict_attn_m and get_model("attn_m").tensor is m.tensor_attn_m
    assert get_model("attn_s").effective_matrix is m.effective_matrix_attn_s
    assert get_model(get_model("attn_s").full_form).predict is m.predict_attn_s_full
    assert get_model("mlp").full_form is None and get_model("softmax_attn_s").options == ("rho",)
    assert get_model("softmax_attn_m").engines == ("sampled",)
    assert get_model("attn_m_full").engines == ("sampled", "moments")
    for name in m.__all__:
        assert getattr(m, name).__doc__, name
