"""GLA with a global forget factor (drift paper, eqs 5-9): every form (the gating kernels of models.gla fed
the constant gate g_t = λ) against a naive per-token loop in float64, on outputs and on gradients with respect
to every weight, λ (through θ) and the tokens; eq 9 = uᵀHu; λ = 1 is linear attention."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import iclab  # noqa: F401  (float64)
import iclab.theory.drift as theory
from iclab.models import gla_forget as gla
from iclab.tasks.drift import sample_drift_prompts, tokens

FORMS = ("readout", "parallel", "chunked", "recurrent", "scan", "unrolled")
LAYER_FORMS = FORMS[1:]
# jitted (and several forms in one compile): far cheaper than op-by-op dispatch of every einsum
predict = jax.jit(gla.predict, static_argnames="form")


@jax.jit
def all_forms(params, Z, lam):
    """Every all-position form (dict form -> O) and the readout ŷ, in one compiled call."""
    out = {form: gla.gla_layer(params, Z, lam, form) for form in LAYER_FORMS}
    out["readout"] = gla.predict(params, Z, lam, "readout")
    return out


def _prompts(key, d, n, B, gamma=0.9):
    Lam = jnp.diag(jnp.linspace(1.5, 0.5, d))
    return tokens(sample_drift_prompts(key, B, gamma=gamma, sigma_w2=1.0, sigma_e2=0.05, n=n, Lam=Lam))


def _qkv(params):
    """W_Q, W_K, W_V of any parametrisation (k_t = z_t for the merged ones)."""
    if gla.parametrisation(params) == "qkv":
        return params["WQ"], params["WK"], params["WV"]
    WV, WKQ = gla.merged_weights(params)
    return WKQ, jnp.eye(WKQ.shape[0], dtype=WKQ.dtype), WV


def _naive(params, Z, lam):
    """Eqs 5-6 token by token in numpy float64: S_t = λ S_{t-1} + v_t k_tᵀ, o_t = S_t q_t."""
    WQ, WK, WV = (np.asarray(a, dtype=np.float64) for a in _qkv(params))
    Z = np.asarray(Z, dtype=np.float64)
    O = np.zeros_like(Z)
    for b in range(Z.shape[0]):
        S = np.zeros((Z.shape[-1], Z.shape[-1]))
        for t in range(Z.shape[1]):
            z = Z[b, t]
            S = lam * S + np.outer(WV @ z, WK @ z)
            O[b, t] = S @ (WQ @ z)
    return O


def _naive_jax(params, Z, lam=None):
    """The same per-token loop (a Python loop over tokens, no scan or mask) in float64 JAX, so that it can be
    differentiated: the reference for the gradients. λ = sigmoid(θ) when ``lam`` is None."""
    lam = jax.nn.sigmoid(params["theta"]) if lam is None else lam
    WQ, WK, WV = _qkv({k: v for k, v in params.items() if k != "theta"})
    S = jnp.zeros(Z.shape[:-2] + (Z.shape[-1], Z.shape[-1]))
    out = []
    for t in range(Z.shape[-2]):
        z = Z[..., t, :]
        S = lam * S + (z @ WV.T)[..., :, None] * (z @ WK.T)[..., None, :]
        out.append(jnp.einsum("...ij,...j->...i", S, z @ WQ.T))
    return jnp.stack(out, axis=-2)


CASES = [("qkv", 1, 1, 2, 0.5), ("qkv", 3, 6, 4, 0.9), ("qkv", 2, 30, 2, 0.3), ("merged", 3, 6, 4, 0.9),
         ("lemma2", 2, 9, 3, 0.7), ("restricted", 3, 6, 4, 0.9), ("restricted", 1, 1, 2, 0.5), ("merged", 2, 5, 2, 1.2)]


@pytest.mark.parametrize("kind,d,n,B,lam", CASES)
def test_forms_match_naive_loop(kind, d, n, B, lam):
    """All positions of the parallel, recurrent, scan and unrolled forms, and the readout ŷ, against the naive
    loop, to 1e-12 of their scale. λ = 1.2 > 1 is Theorem 4's range."""
    key = jax.random.PRNGKey(d * 1000 + n)
    Z = _prompts(key, d, n, B)
    params = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.7)
    ref = _naive(params, Z, lam)
    scale = np.abs(ref).max()
    got = all_forms(params, Z, lam)
    for form in LAYER_FORMS:
        np.testing.assert_allclose(got[form], ref, atol=1e-12 * scale, rtol=0, err_msg=form)
    np.testing.assert_allclose(got["readout"], ref[:, -1, -1], atol=1e-12 * scale, rtol=0)
    # predict(form) for the all-position forms is the same function indexed at [..., -1, -1]
    np.testing.assert_allclose(predict(params, Z, lam, "parallel"), ref[:, -1, -1], atol=1e-12 * scale, rtol=0)
    np.testing.assert_allclose(_naive_jax(params, Z, lam), ref, atol=1e-12 * scale, rtol=0)


GRAD_CASES = [("qkv", 3, 7, 3, 0.8), ("merged", 2, 5, 2, 1.2), pytest.param("lemma2", 2, 6, 3, 0.7, marks=pytest.mark.slow),
              pytest.param("restricted", 3, 6, 2, 0.9, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind,d,n,B,lam", GRAD_CASES)
def test_gradients_match_naive_loop(kind, d, n, B, lam):
    """Gradients of every form w.r.t. every weight, θ (λ = sigmoid(θ); for λ > 1 a fixed λ) and the tokens
    against those of the naive per-token loop (flash-linear-attention style), to 1e-12 of their scale."""
    key = jax.random.PRNGKey(7 + d)
    Z = _prompts(key, d, n, B)
    params = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.6)
    theta = float(np.log(lam / (1 - lam))) if lam < 1 else None
    p = dict(params, theta=jnp.asarray(theta)) if theta is not None else params
    lam_arg = None if theta is not None else lam
    W = jax.random.normal(jax.random.fold_in(key, 2), Z.shape)  # a fixed random cotangent on every output

    def loss(p, Z, form):
        if form == "naive":
            return jnp.sum(jnp.sin(_naive_jax(p, Z, lam_arg)) * W)
        if form == "naive_readout":
            return jnp.sum(jnp.sin(_naive_jax(p, Z, lam_arg)[..., -1, -1]) * W[..., -1, -1])
        if form == "readout":
            return jnp.sum(jnp.sin(gla.predict(p, Z, lam_arg, "readout")) * W[..., -1, -1])
        return jnp.sum(jnp.sin(gla.gla_layer(p, Z, lam_arg, form)) * W)

    grads = jax.jit(lambda p, Z: {f: jax.grad(loss, argnums=(0, 1))(p, Z, f)
                                  for f in ("naive", "naive_readout") + FORMS})(p, Z)
    for form in FORMS:
        want = grads["naive_readout" if form == "readout" else "naive"]
        for name in p:
            ref = np.asarray(want[0][name])
            np.testing.assert_allclose(grads[form][0][name], ref, atol=1e-12 * max(np.abs(ref).max(), 1.0), rtol=0,
                                       err_msg=f"{form} d/d{name}")
        ref = np.asarray(want[1])
        np.testing.assert_allclose(grads[form][1], ref, atol=1e-12 * max(np.abs(ref).max(), 1.0), rtol=0,
                                   err_msg=f"{form} d/dZ")


@pytest.mark.parametrize("kind,d,n,B,lam,chunks", [("qkv", 3, 12, 3, 0.8, (1, 4, 5, 13, 20)),
                                                   ("restricted", 2, 9, 2, 0.6, (3, 4)), ("merged", 2, 4, 2, 1.2, (2,))])
def test_chunked_form_against_naive_loop_for_every_chunk_size(kind, d, n, B, lam, chunks):
    """Chunks of C tokens (one token each, several chunks with a padded first one, exact chunks, one chunk,
    C > T): outputs at every position and gradients w.r.t. the weights and the tokens equal the naive loop's
    to 1e-12 of their scale."""
    key = jax.random.PRNGKey(40 + n)
    Z = _prompts(key, d, n, B)
    params = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.6)
    W = jax.random.normal(jax.random.fold_in(key, 2), Z.shape)

    def loss(p, Z, C):
        O = _naive_jax(p, Z, lam) if C is None else gla.gla_chunked(p, Z, lam, chunk=C)
        return jnp.sum(jnp.sin(O) * W)

    got = jax.jit(lambda p, Z: {C: (gla.gla_chunked(p, Z, lam, chunk=C), jax.grad(loss, argnums=(0, 1))(p, Z, C))
                                for C in chunks})(params, Z)
    g_ref = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(params, Z, None)
    ref = _naive(params, Z, lam)
    for C, (out, g) in got.items():
        np.testing.assert_allclose(out, ref, atol=1e-12 * np.abs(ref).max(), rtol=0, err_msg=f"C = {C}")
        for name in params:
            want = np.asarray(g_ref[0][name])
            np.testing.assert_allclose(g[0][name], want, atol=1e-12 * max(np.abs(want).max(), 1.0), rtol=0,
                                       err_msg=f"C = {C}, d/d{name}")
        np.testing.assert_allclose(g[1], g_ref[1], atol=1e-12 * np.abs(g_ref[1]).max(), rtol=0, err_msg=f"C = {C}, d/dZ")
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        gla.gla_chunked(params, Z, lam, chunk=0)


def test_gradient_against_finite_differences_of_naive_loop():
    """The readout gradient against central differences of the naive loop (independent of JAX's autodiff)."""
    d, n, lam, h = 2, 6, 0.85, 1e-6
    key = jax.random.PRNGKey(3)
    Z = _prompts(key, d, n, 3)
    params = gla.init_gla(jax.random.fold_in(key, 1), d, "qkv", std=0.8)
    f = lambda p: np.sum(_naive(p, Z, lam)[:, -1, -1])  # noqa: E731
    g = jax.jit(jax.grad(lambda p: jnp.sum(gla.predict(p, Z, lam))))(params)
    for name in params:
        W = np.asarray(params[name])
        for idx in [(0, 0), (d, d), (1, d)]:
            E = np.zeros_like(W)
            E[idx] = h
            num = (f({**params, name: W + E}) - f({**params, name: W - E})) / (2 * h)
            assert float(g[name][idx]) == pytest.approx(num, rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("kind", gla.PARAMETRISATIONS)
@pytest.mark.parametrize("lam", [0.7, 1.0])
def test_eq9_equals_quadratic_form(kind, lam):
    """Lemma 2: ŷ = uᵀ H u with u = vec(U) (column-major) and H of ``theory.drift.lemma2_H``."""
    d, n = 3, 8
    key = jax.random.PRNGKey(11)
    Z = _prompts(key, d, n, 6)
    params = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.9)
    u = np.asarray(gla.lemma2_matrix(params)).reshape(-1, order="F")
    H = theory.lemma2_H(np.asarray(Z), lam)
    quad = np.einsum("i,bij,j->b", u, H, u)
    np.testing.assert_allclose(predict(params, Z, lam), quad, atol=1e-12 * np.abs(quad).max(), rtol=0)
    np.testing.assert_allclose(theory.restricted_prediction(np.asarray(gla.lemma2_matrix(params)), np.asarray(Z), lam),
                               quad, atol=1e-12 * np.abs(quad).max(), rtol=0)


def test_lemma2_mapping_of_merged_weights():
    """U_11 = W^KQ_11, u_12 = w^V_21, u_21 = w^KQ_21, u_-1 = w^V_-1; the other blocks never reach ŷ."""
    d, key = 3, jax.random.PRNGKey(4)
    p = gla.init_gla(key, d, "merged", std=1.0)
    U = np.asarray(gla.lemma2_matrix(p))
    np.testing.assert_array_equal(U, theory.weights_to_U(np.asarray(p["WV"]), np.asarray(p["WKQ"])))
    Z = _prompts(key, d, 5, 4)
    bumped = {"WV": p["WV"].at[:d, :].add(3.0), "WKQ": p["WKQ"].at[:, d].add(3.0)}
    np.testing.assert_allclose(predict(bumped, Z, 0.8), predict(p, Z, 0.8), rtol=1e-12)
    np.testing.assert_allclose(predict(gla.init_gla(key, d, "lemma2") | {"U": jnp.asarray(U)}, Z, 0.8),
                               predict(p, Z, 0.8), rtol=1e-12)


@pytest.mark.parametrize("kind", gla.PARAMETRISATIONS)
def test_lambda_one_is_linear_attention(kind):
    """λ = 1: W_V Zᵀ Z W_Kᵀ W_Q z_{n+1}, written without any forget factor."""
    d, key = 4, jax.random.PRNGKey(21)
    Z = _prompts(key, d, 15, 5)
    p = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.5)
    ref = np.asarray(gla.predict_linear_attention(p, Z))
    got = all_forms(p, Z, 1.0)
    for form in FORMS:
        yh = got[form] if form == "readout" else got[form][:, -1, -1]
        np.testing.assert_allclose(yh, ref, atol=1e-12 * np.abs(ref).max(), rtol=0, err_msg=form)
    np.testing.assert_array_equal(gla.decay_weights(4, 1.0), np.ones(4))
    np.testing.assert_allclose(gla.decay_weights(4, 0.5), [0.125, 0.25, 0.5, 1.0], rtol=1e-15)
    assert np.abs(np.asarray(predict(p, Z, 0.9)) - ref).max() > 1e-3 * np.abs(ref).max()


def test_restricted_is_assumption1_form_and_theorem1_optimum():
    """The restricted model is ŷ = u_-1 Gᵀ U_11 x_{n+1}; at Theorem 1's weights it is eq 15's predictor."""
    d, n, lam, gamma = 4, 20, 0.85, 0.9
    key = jax.random.PRNGKey(5)
    Z = _prompts(key, d, n, 7, gamma)
    D1, D2, D3, _ = theory.D_sums(lam, gamma=gamma, sigma_w2=1.0, sigma_e2=0.05, n=n)
    Lt = theory.Lam_tilde(np.diag(np.linspace(1.5, 0.5, d)), D2=D2, D3=D3)
    U11, u = theory.optimal_restricted(D1=D1, Lam_t=Lt)
    p = gla.restricted_from_optimum(U11, u)
    ref = theory.optimal_prediction(np.asarray(Z), lam, D1=D1, Lam_t=Lt)
    got = all_forms(p, Z, lam)
    for form in FORMS:
        yh = got[form] if form == "readout" else got[form][:, -1, -1]
        np.testing.assert_allclose(yh, ref, rtol=1e-12, atol=1e-14, err_msg=form)
    W_V, W_KQ = theory.optimal_weights(D1=D1, Lam_t=Lt)
    np.testing.assert_allclose(predict({"WV": jnp.asarray(W_V), "WKQ": jnp.asarray(W_KQ)}, Z, lam), ref, rtol=1e-12)
    Th = np.eye(d) / d**0.25
    p0 = gla.init_assumption1(jnp.asarray(Th), 0.3)
    U0, u0 = theory.assumption1_init(Th, 0.3)
    np.testing.assert_allclose(p0["U11"], U0, rtol=1e-15)
    assert float(p0["u_m1"]) == u0


def test_trainable_forget_factor_and_test_time_override():
    """λ = sigmoid(θ) when no λ is passed; an explicit λ̄ (eq 18) overrides it."""
    d, key = 3, jax.random.PRNGKey(8)
    Z = _prompts(key, d, 10, 4)
    p = gla.init_gla(key, d, "qkv", theta=0.4)
    lam = float(jax.nn.sigmoid(0.4))
    np.testing.assert_allclose(predict(p, Z), predict({k: v for k, v in p.items() if k != "theta"}, Z, lam), rtol=1e-13)
    np.testing.assert_allclose(predict(p, Z, 0.6), _naive(p, Z, 0.6)[:, -1, -1], rtol=1e-12)
    with pytest.raises(ValueError, match="lam is required"):
        predict(gla.init_gla(key, d, "qkv"), Z)
    with pytest.raises(ValueError, match="unknown GLA parameters"):
        predict({"WQ": p["WQ"]}, Z, 0.5)


def test_small_lambda_has_finite_gradients():
    """The parallel mask never forms λ^{-k} (0.05^{-40} overflows float32): gradients stay finite and float32."""
    d, key, dtype = 3, jax.random.PRNGKey(9), jnp.float32
    Z = _prompts(key, d, 40, 2).astype(dtype)
    p = gla.init_gla(key, d, "qkv", theta=float(np.log(0.05 / 0.95)), dtype=dtype)
    grads = jax.jit(lambda q: {f: jax.grad(lambda r: jnp.sum(gla.predict(r, Z, None, f)))(q) for f in FORMS})(p)
    for form, g in grads.items():
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in g.values()), form
        assert all(v.dtype == dtype for v in g.values()), form
    assert all_forms(p, Z, None)["readout"].dtype == dtype


@pytest.mark.parametrize("kind,L", [("qkv", 1), ("qkv", 2), ("restricted", 3)])
def test_multilayer_residual_against_naive_loop(kind, L):
    """Z ← Z + GLA_l(Z) at every position, read out at the query, in every form; gradients agree across forms."""
    d, n, lam = 3, 7, 0.8
    key = jax.random.PRNGKey(L)
    Z = _prompts(key, d, n, 3)
    layers = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.6, layers=L)
    H = np.asarray(Z)
    for l in range(L):
        H = H + _naive({k: v[l] for k, v in layers.items()}, H, lam)
    ref = H[:, -1, -1]

    def loss(p, form):
        return jnp.sum(gla.predict_multilayer(p, Z, lam, form))

    out = jax.jit(lambda p: {f: (gla.predict_multilayer(p, Z, lam, f), jax.grad(loss)(p, f)) for f in LAYER_FORMS})(layers)
    for form, (got, _) in out.items():
        np.testing.assert_allclose(got, ref, atol=1e-12 * np.abs(ref).max(), rtol=0, err_msg=form)
    if L == 1:
        np.testing.assert_allclose(ref, predict({k: v[0] for k, v in layers.items()}, Z, lam), rtol=1e-12)
    g_ref = out["parallel"][1]
    for form, (_, g) in out.items():
        for k in layers:
            np.testing.assert_allclose(g[k], g_ref[k], atol=1e-12 * np.abs(g_ref[k]).max(), rtol=0, err_msg=form)


@pytest.mark.parametrize("kind", gla.PARAMETRISATIONS)
def test_readout_with_filled_query_label_slot(kind):
    """Inside an L-layer model the residual fills the query's label slot: the readout keeps its term."""
    d, n, lam = 3, 6, 0.75
    key = jax.random.PRNGKey(31)
    Z = _prompts(key, d, n, 4)
    Z = Z.at[:, -1, -1].set(jax.random.normal(jax.random.fold_in(key, 2), (4,)))
    params = gla.init_gla(jax.random.fold_in(key, 1), d, kind, std=0.7)
    ref = _naive(params, Z, lam)[:, -1, -1]
    np.testing.assert_allclose(predict(params, Z, lam), ref, atol=1e-12 * np.abs(ref).max(), rtol=0)


def test_init_is_a_function_of_its_own_key_under_vmap():
    """The joint trainer vmaps init_gla over member keys: each member's draw must depend on its key alone, not on
    its position in the batch or on the other keys (which an RBG draw under vmap does: XLA batches
    rng_bit_generator from the first key)."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    init = jax.vmap(lambda k: gla.init_gla(k, 2, "merged", std=0.3, layers=2, dtype=jnp.float32))
    batch, reordered = init(keys), init(keys[::-1])
    for i in range(4):
        alone = gla.init_gla(keys[i], 2, "merged", std=0.3, layers=2, dtype=jnp.float32)
        for k in alone:
            np.testing.assert_array_equal(batch[k][i], alone[k])
            np.testing.assert_array_equal(reordered[k][3 - i], alone[k])
    assert batch["WV"].dtype == jnp.float32 and batch["WV"].shape == (4, 2, 3, 3)
    np.testing.assert_array_equal(batch["WV"][0], 0.3 * jax.random.normal(jax.random.split(keys[0])[0], (2, 3, 3),
                                                                          jnp.float32))


def test_public_surface_is_documented():
    """Every public function has its Args and Returns."""
    for name in gla.__all__:
        obj = getattr(gla, name)
        if inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            assert "Args:" in doc and "Returns:" in doc, name
