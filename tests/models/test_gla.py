"""GLA with matrix gates (gating paper): the three forms against a naive per-token loop, Thm 1, scalar
gating, construction 2, the delimiter/gate constructions (Thms 4-5), masking, and the L-layer recursion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.models import gla
from iclab.tasks import multitask as mt

TOL = 1e-12


def naive_gla(Q, K, V, G):
    """Per-token loop in float64: S_i = G_i ⊙ S_{i−1} + v_i k_iᵀ, o_i = S_i q_i. G: (T, Dv, Dk)."""
    Q, K, V, G = (np.asarray(a, dtype=np.float64) for a in (Q, K, V, G))
    S = np.zeros((V.shape[1], K.shape[1]))
    out = []
    for i in range(Q.shape[0]):
        S = G[i] * S + np.outer(V[i], K[i])
        out.append(S @ Q[i])
    return np.array(out)


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))


def random_params(seed, D, gating, head=False, std=0.5):
    return gla.init_params(jax.random.PRNGKey(seed), D, gating, head=head, std=std)


SHAPES = [(1, 3, 2), (3, 9, 7)]  # (batch, T, D)
FORMS = ("recurrent", "unrolled", "parallel")
PRED_FORMS = ("last", "parallel", "recurrent", "unrolled")


@pytest.mark.parametrize("B, T, D", SHAPES)
@pytest.mark.parametrize("gating", ["none", "scalar", "vector"])
def test_forms_agree_with_naive_loop_outputs_and_gradients(B, T, D, gating):
    params = random_params(B * 100 + T, D, gating, head=gating == "vector")
    Z = jax.random.normal(jax.random.PRNGKey(T), (B, T, D))
    label = D - 1
    Q, K, V = gla.projections(params, Z)
    G = np.broadcast_to(gla.gate_matrices(params, Z), (B, T, D, D))
    ref = np.stack([naive_gla(Q[b], K[b], V[b], G[b]) for b in range(B)])

    @jax.jit
    def everything(params, Z):
        # one compiled call for all forms: outputs, parameter gradients and token gradients
        outs = {f: gla.gla_layer(params, Z, form=f) for f in FORMS}
        preds = {f: gla.predict(params, Z, label=label, form=f) for f in PRED_FORMS}
        gp = {f: jax.grad(lambda p: jnp.sum(jnp.sin(gla.predict(p, Z, label=label, form=f))))(params) for f in PRED_FORMS}
        gz = {f: jax.grad(lambda z: jnp.sum(jnp.cos(gla.gla_layer(params, z, form=f))))(Z) for f in FORMS}
        return outs, preds, gp, gz

    outs, preds, gp, gz = everything(params, Z)
    for form in FORMS:
        assert rel(outs[form], ref) < TOL, form
    want = ref[:, -1] @ params["h"] if "h" in params else ref[:, -1, label]
    for f, v in preds.items():
        assert rel(v, want) < TOL, f
    for f in PRED_FORMS:
        for k in params:
            assert rel(gp[f][k], gp["recurrent"][k]) < 1e-11, (f, k)
    for f in FORMS:
        assert rel(gz[f], gz["recurrent"]) < 1e-11, f


@pytest.mark.parametrize("T, D", [(4, 3), (7, 5)])
def test_matrix_gates_three_forms(T, D):
    rng = np.random.default_rng(T)
    Q, K, V = (jnp.asarray(rng.normal(size=(T, D))) for _ in range(3))
    G = jnp.asarray(rng.uniform(0.2, 1.0, size=(T, D, D)))
    ref = naive_gla(Q, K, V, G)
    forms = (lambda g: gla.recurrent(Q, K, V, g), lambda g: gla.unrolled(Q, K, V, g),
             lambda g: gla.parallel(Q, K, V, jnp.log(g), "matrix"))
    outs, grads = jax.jit(lambda g: ([f(g) for f in forms], [jax.grad(lambda h, f=f: jnp.sum(f(h) ** 2))(g)
                                                            for f in forms]))(G)
    for o in outs:
        assert rel(o, ref) < TOL
    assert rel(grads[1], grads[0]) < 1e-11 and rel(grads[2], grads[0]) < 1e-11


def test_masked_tokens_are_removed_exactly():
    d, p, D = 3, 3, 7
    rng = np.random.default_rng(0)
    contexts = rng.normal(size=(3, p))
    x, y, xq = rng.normal(size=(4, 10, d)), rng.normal(size=(4, 10)), rng.normal(size=(4, d))
    mask = mt.padding_mask([5, 5], [2, 3])
    Zpad, tmask = gla.delimiter_prompt(x, y, xq, [5, 5], contexts, mask=mask)
    keep = mask > 0
    Zshort, _ = gla.delimiter_prompt(x[:, keep], y[:, keep], xq, [2, 3], contexts)
    for g in ("none", "scalar", "vector"):
        params = random_params(1, D, g, head=g == "vector")
        layers = [random_params(s, D, g) for s in (2, 3)]

        @jax.jit
        def both(params, layers):
            padded = [gla.predict(params, Zpad, tmask, label=d, form=f) for f in ("last", "parallel", "recurrent")]
            padded.append(gla.predict_multilayer(layers, Zpad, tmask, label=d))
            short = [gla.predict(params, Zshort, label=d, form="recurrent"),
                     gla.predict_multilayer(layers, Zshort, label=d, form="recurrent")]
            return padded, short

        padded, short = both(params, layers)
        for a in padded[:3]:
            assert rel(a, short[0]) < TOL, g
        assert rel(padded[3], short[1]) < TOL, g


def _prompt(rng, n, d):
    X, y, x = rng.normal(size=(n, d)), rng.normal(size=n), rng.normal(size=d)
    Z = np.zeros((n + 1, d + 1))
    Z[:n, :d], Z[:n, d], Z[n, :d] = X, y, x
    return X, y, x, jnp.asarray(Z)


@pytest.mark.parametrize("n, d", [(3, 2), (6, 4)])
def test_thm1_matrix_gates_give_coordinatewise_wpgd(n, d):
    rng = np.random.default_rng(n)
    X, y, x, Z = _prompt(rng, n, d)
    P_k, P_q = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    params = gla.restricted_params(P_k, P_q)
    G = rng.uniform(0.1, 1.0, size=(n + 1, d + 1, d + 1))
    Q, K, V = gla.projections(params, Z)
    out = gla.recurrent(Q, K, V, jnp.asarray(G))[-1, d]
    g = G[:, d, :d]  # last row, first d entries (eq 10)
    Omega = np.array([np.prod(g[j + 1:], axis=0) for j in range(n)])  # g_{j:n+1}
    want = x @ P_q @ (X @ P_k * Omega).T @ y  # eq 8a
    assert abs(float(out) - want) < TOL * max(1, abs(want))
    # entries outside the last row's first d columns never reach the output
    G2 = G.copy()
    G2[:, :d, :] = rng.uniform(0.1, 1.0, size=(n + 1, d, d + 1))
    G2[:, d, d] = rng.uniform(0.1, 1.0, size=n + 1)
    assert abs(float(gla.recurrent(Q, K, V, jnp.asarray(G2))[-1, d]) - float(out)) < TOL


def test_scalar_gating_is_samplewise_wpgd_and_no_gate_is_linear_attention():
    n, d = 5, 3
    rng = np.random.default_rng(3)
    X, y, x, Z = _prompt(rng, n, d)
    P_k, P_q = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    w_g = rng.normal(size=d + 1)
    params = dict(gla.restricted_params(P_k, P_q), w_g=jnp.asarray(w_g))
    g = 1 / (1 + np.exp(-(np.asarray(Z) @ w_g)))
    omega = np.array([np.prod(g[j + 1:]) for j in range(n)])  # includes the query's gate
    want = x @ P_q @ P_k.T @ X.T @ (omega * y)  # eq 11
    for form in ("last", "parallel", "recurrent", "unrolled"):
        assert abs(float(gla.predict(params, Z, label=d, form=form)) - want) < TOL * max(1, abs(want))
    lin = gla.restricted_params(P_k, P_q)
    want1 = x @ P_q @ P_k.T @ X.T @ y
    assert abs(float(gla.predict(lin, Z, label=d)) - want1) < TOL * max(1, abs(want1))
    P, om = gla.restricted_wpgd({"P_k": jnp.asarray(P_k), "P_q": jnp.asarray(P_q)}, None, [n])
    assert np.allclose(om, 1) and np.allclose(P, P_q @ P_k.T)


def test_construction2_with_head():
    n, d = 4, 3
    rng = np.random.default_rng(5)
    X, y, x, Z = _prompt(rng, n, d)
    D = d + 1
    P_k, P_q, u, h = rng.normal(size=(d, d)), rng.normal(size=(d, d)), rng.normal(size=D), rng.normal(size=D)
    params = gla.construction2_params(P_k, P_q, u, h=h)
    G = rng.uniform(0.1, 1.0, size=(n + 1, D, D))
    Q, K, V = gla.projections(params, Z)
    o = gla.recurrent(Q, K, V, jnp.asarray(G))[-1]
    Omega_bar = sum(h[r] * u[r] * np.array([np.prod(G[j + 1:, r, :d], axis=0) for j in range(n)]) for r in range(D))
    want = x @ P_q @ (X @ P_k * Omega_bar).T @ y  # eqs 28-29
    assert abs(float(o @ h) - want) < TOL * max(1, abs(want))
    for r in range(D):  # each output row alone (eq 28)
        Om = u[r] * np.array([np.prod(G[j + 1:, r, :d], axis=0) for j in range(n)])
        assert abs(float(o[r]) - x @ P_q @ (X @ P_k * Om).T @ y) < 1e-11


def _delimited(rng, sizes, d, p):
    n = sum(sizes)
    X, y, x = rng.normal(size=(n, d)), rng.normal(size=n), rng.normal(size=d)
    contexts = rng.normal(size=(len(sizes) + 1, p))
    Z, _ = gla.delimiter_prompt(X, y, x, sizes, contexts)
    return X, y, x, contexts, Z


@pytest.mark.parametrize("weights", [[0.0, 1.0], [0.3, 0.7], [1.0, 1.0], [0.2, 0.5, 0.9]])
def test_thm4_delimiters_and_scalar_gates_realise_block_weights(weights):
    d, p = 3, 4
    sizes = [2, 3, 2][: len(weights)]
    rng = np.random.default_rng(len(weights))
    X, y, x, contexts, Z = _delimited(rng, sizes, d, p)
    P_k, P_q = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    params = dict(gla.restricted_params(P_k, P_q, p), w_g=gla.scalar_gate_for_weights(contexts, weights, d))
    omega = np.repeat(weights, sizes)
    want = x @ P_q @ P_k.T @ X.T @ (omega * y)
    for form in ("last", "parallel", "recurrent"):
        assert abs(float(gla.predict(params, Z, label=d, form=form)) - want) < 1e-10 * max(1, abs(want)), form
    with pytest.raises(ValueError, match="0 <= ω_1"):
        gla.scalar_gate_for_weights(contexts, weights[::-1] if weights[0] != weights[-1] else [1.2] * len(weights), d)


@pytest.mark.parametrize("weights", [[0.8, 0.2], [-0.5, 1.0], [0.6, -0.3, 0.9]])
def test_thm5_vector_gates_realise_any_block_weights(weights):
    d, p = 3, 4
    sizes = [3, 2, 2][: len(weights)]
    rng = np.random.default_rng(7)
    X, y, x, contexts, Z = _delimited(rng, sizes, d, p)
    P_k, P_q = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    W_g, u, h = gla.vector_gate_for_weights(contexts, weights, d)
    params = dict(gla.construction2_params(P_k, P_q, u, p, h), W_g=W_g)
    want = x @ P_q @ P_k.T @ X.T @ (np.repeat(weights, sizes) * y)
    for form in ("last", "parallel", "recurrent"):
        assert abs(float(gla.predict(params, Z, label=d, form=form)) - want) < 1e-10 * max(1, abs(want)), form


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_restricted_wpgd_matches_the_full_model(kind):
    d, p, sizes = 3, 3, [4, 4]
    rng = np.random.default_rng(11)
    D = d + 1 + p
    rp = {"P_k": jnp.asarray(rng.normal(size=(d, d))), "P_q": jnp.asarray(rng.normal(size=(d, d)))}
    if kind == "scalar":
        rp["w_c"] = jnp.asarray(rng.normal(size=p))
    else:
        rp.update(W_c=jnp.asarray(rng.normal(size=(D, p))), u=jnp.asarray(rng.normal(size=D)),
                  h=jnp.asarray(rng.normal(size=D)))
    contexts = rng.normal(size=(3, p))
    X, y, x = rng.normal(size=(8, d)), rng.normal(size=8), rng.normal(size=d)
    mask = mt.padding_mask(sizes, [2, 3])
    Z, tmask = gla.delimiter_prompt(X, y, x, sizes, contexts, mask=mask)
    full = gla.restricted_to_full(rp, d, p)
    P, om = gla.restricted_wpgd(rp, contexts, sizes, mask=mask)
    assert np.all(np.asarray(om)[mask == 0] == 0)
    want = x @ np.asarray(P) @ X.T @ (np.asarray(om) * y)
    assert rel(gla.predict(full, Z, tmask, label=d, form="recurrent"), want) < TOL


def clean_recursion(X, y, x, Pk, Pq, g, sign):
    """The clean recursion of App A (derived here from eqs 31-33):
    ỹ^{ℓ+1}_i = ỹ^ℓ_i + x_iᵀP'_ℓ Σ_{j≤i} ỹ^ℓ_j (g_{j:i} ⊙ P_{k,ℓ}ᵀx_j), P' = sign·P_q; g (n+1, d)."""
    n, d = X.shape
    Xa = np.vstack([X, x])
    yt = np.append(y, 0.0)
    for Pk_l, Pq_l in zip(Pk, Pq):
        new = yt.copy()
        for i in range(n + 1):
            acc = np.zeros(d)
            for j in range(i + 1):
                gji = np.prod(g[j + 1:i + 1], axis=0) if j < i else np.ones(d)
                acc += yt[j] * gji * (Pk_l.T @ Xa[j])
            new[i] += sign * Xa[i] @ Pq_l @ acc
        yt = new
    return yt


@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_multilayer_label_column_follows_the_clean_recursion(L, sign):
    n, d = 5, 3
    rng = np.random.default_rng(L)
    X, y, x, Z = _prompt(rng, n, d)
    Pk = [0.4 * rng.normal(size=(d, d)) for _ in range(L)]
    Pq = [0.4 * rng.normal(size=(d, d)) for _ in range(L)]
    # gates from the features only (first d entries of w_g; label weight 0), shared by all layers (App A)
    w_g = np.append(rng.normal(size=d), 0.0)
    layers = [dict(gla.restricted_params(Pk[l], sign * Pq[l]), w_g=jnp.asarray(w_g)) for l in range(L)]
    g = 1 / (1 + np.exp(-(np.asarray(Z) @ w_g)))
    want = clean_recursion(X, y, x, Pk, Pq, np.repeat(g[:, None], d, axis=1), sign)
    for form in ("parallel", "recurrent", "unrolled"):
        Zs = gla.multilayer_outputs(layers, Z, form=form)
        assert rel(Zs[-1][:, d], want) < 1e-10, form
        assert np.allclose(Zs[-1][:, :d], np.asarray(Z)[:, :d])  # features untouched: gates shared
    assert rel(gla.predict_multilayer(layers, Z, label=d), want[-1]) < 1e-10
    if L == 1 and sign < 0:  # Thm 6, one layer: −(last entry) is the WPGD prediction
        omega = np.array([np.prod(g[j + 1:]) for j in range(n)])
        assert abs(-want[-1] - x @ Pq[0] @ Pk[0].T @ X.T @ (omega * y)) < 1e-12


def test_noncausal_linear_attention_layers_are_preconditioned_gd():
    """Cor 3 / Ahn et al.: non-causal linear attention, query excluded from the keys, −P_q: L GD steps."""
    n, d, L = 6, 3, 3
    rng = np.random.default_rng(9)
    X, y, x, Z = _prompt(rng, n, d)
    Pk = [0.3 * rng.normal(size=(d, d)) for _ in range(L)]
    Pq = [0.3 * rng.normal(size=(d, d)) for _ in range(L)]
    keep = jnp.asarray(np.append(np.ones(n), 0.0))  # the query's key/value drop out (α_ℓ = 0)
    for l in range(L):
        params = gla.restricted_params(Pk[l], -Pq[l])
        Q, K, V = gla.projections(params, Z, keep)
        Z = Z + gla.parallel(Q, K, V, causal=False)
    beta = np.zeros(d)
    for l in range(L):
        beta = beta - Pq[l] @ Pk[l].T @ X.T @ (X @ beta - y)
    assert abs(-float(Z[-1, d]) - x @ beta) < 1e-12
    np.testing.assert_allclose(np.asarray(Z[:n, d]), y - X @ beta, atol=1e-12)


def test_delimiter_prompt_layout_and_errors():
    d, p = 2, 3
    rng = np.random.default_rng(0)
    contexts = rng.normal(size=(3, p))
    X, y, x = rng.normal(size=(5, d)), rng.normal(size=5), rng.normal(size=d)
    Z, _ = gla.delimiter_prompt(X, y, x, [2, 3], contexts)
    Z = np.asarray(Z)
    assert Z.shape == (5 + 2 + 1, d + 1 + p)
    data, delims = gla.token_layout([2, 3])
    np.testing.assert_array_equal(data, [0, 1, 3, 4, 5])
    np.testing.assert_array_equal(delims, [2, 6])
    np.testing.assert_allclose(Z[delims][:, : d + 1], 0)
    np.testing.assert_allclose(Z[delims][:, d + 1:], contexts[1:])
    np.testing.assert_allclose(Z[data][:, d + 1:], np.broadcast_to(contexts[0], (5, p)))
    np.testing.assert_allclose(Z[-1], np.concatenate([x, [0.0], contexts[0]]))
    np.testing.assert_array_equal(Z[data][:, :d], X)
    np.testing.assert_array_equal(Z[data][:, d], y)
    Zz, _ = gla.delimiter_prompt(X, y, x, [2, 3], contexts, query_context=None)
    np.testing.assert_allclose(np.asarray(Zz)[-1, d + 1:], 0)
    Z2, _ = gla.delimiter_prompt(X, y, x, [2, 3], contexts, query_context=2)
    np.testing.assert_array_equal(np.asarray(Z2)[-1], np.concatenate([x, [0.0], contexts[2]]))
    Zn, _ = gla.delimiter_prompt(X, y, x, [2, 3], contexts, delimiters=False)  # contexts, no delimiter tokens
    np.testing.assert_array_equal(np.asarray(Zn), np.concatenate(
        [np.concatenate([X, y[:, None], np.broadcast_to(contexts[0], (5, p))], 1),
         np.concatenate([x, [0.0], contexts[0]])[None]]))
    with pytest.raises(ValueError, match="sum to n"):
        gla.delimiter_prompt(X, y, x, [2, 2], contexts)
    with pytest.raises(ValueError, match="K \\+ 1"):
        gla.delimiter_prompt(X, y, x, [2, 3], contexts[:2])


@pytest.mark.parametrize("name, kind, head", [("linatt", "none", False), ("gla", "scalar", False),
                                              ("gla_wo", "scalar", False), ("gla_vector", "vector", True)])
def test_registered_families_init_and_predict(name, kind, head):
    from iclab.models import get_model, model_families

    family = get_model(name)
    assert name in model_families(gla.PLAIN if name == "gla_wo" else gla.DELIMITED)
    D, d = 6, 3
    params = family.init(jax.random.PRNGKey(0), D=D, std=0.3, dtype=jnp.float32)
    assert gla.gating(params) == kind and ("h" in params) == head
    assert all(a.dtype == jnp.float32 for a in params.values())
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    Z = jax.random.normal(jax.random.PRNGKey(1), (4, 7, D))
    mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    want = gla.predict(params, Z, mask, label=d, form="recurrent")
    assert rel(family.predict(params, Z, mask, label=d), want) < TOL


def test_multilayer_family_and_init_statistics():
    from iclab.models import get_model

    family = get_model("gla_multilayer")
    D, d, std = 5, 2, 0.3
    layers = family.init(jax.random.PRNGKey(2), D=D, layers=3, std=std)
    assert len(layers) == 3 and all(gla.gating(p) == "scalar" and "h" not in p for p in layers)
    assert not np.allclose(layers[0]["Wq"], layers[1]["Wq"])  # each layer its own draw
    Z = jax.random.normal(jax.random.PRNGKey(3), (2, 6, D))
    assert rel(family.predict(layers, Z, None, label=d), gla.predict_multilayer(layers, Z, label=d, form="recurrent")) < 1e-10
    # N(0, std²) entries: one layer of a big model, mean and variance within 5 standard errors
    flat = np.concatenate([np.ravel(a) for a in gla.init_params(jax.random.PRNGKey(4), 40, "vector", head=True,
                                                                std=std).values()])
    assert abs(flat.mean()) < 5 * std / np.sqrt(flat.size)
    assert abs(flat.var() / std**2 - 1) < 5 * np.sqrt(2 / flat.size)
    with pytest.raises(ValueError, match="layers"):
        gla.init_multilayer(jax.random.PRNGKey(0), D, 0)


@pytest.mark.parametrize("B, T, D", [(1, 4, 3), (3, 9, 5)])
@pytest.mark.parametrize("shared", [True, False])
def test_parallel_one_value_column_and_shared_gates(B, T, D, shared):
    """Scalar gates with ONE value column (the sum taken as q_iᵀ Σ_j W_ij v_j k_j) and gates shared by the batch
    ((T,) log gates, e.g. a constant forget factor) against the naive loop: outputs and gradients w.r.t. Q, K, V
    and the log gates."""
    rng = np.random.default_rng(B * 10 + T)
    Q, K = (jnp.asarray(rng.normal(size=(B, T, D))) for _ in range(2))
    V = jnp.asarray(rng.normal(size=(B, T, 1)))
    lg = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(T,) if shared else (B, T))))
    G = np.broadcast_to(np.exp(np.asarray(lg))[..., None, None], (B, T, 1, 1))
    ref = np.stack([naive_gla(Q[b], K[b], V[b], G[b]) for b in range(B)])
    W = jnp.asarray(rng.normal(size=(B, T, 1)))

    @jax.jit
    def both(Q, K, V, lg):
        def loss(Q, K, V, lg, form):
            if form == "parallel":
                return jnp.sum(jnp.sin(gla.parallel(Q, K, V, lg, "scalar")) * W)
            g = jnp.broadcast_to(jnp.exp(lg)[..., None, None], (B, T, 1, 1))
            return jnp.sum(jnp.sin(gla.recurrent(Q, K, V, g)) * W)

        return gla.parallel(Q, K, V, lg, "scalar"), {f: jax.grad(loss, argnums=(0, 1, 2, 3))(Q, K, V, lg, f)
                                                      for f in ("parallel", "recurrent")}

    out, grads = both(Q, K, V, lg)
    assert out.shape == (B, T, 1) and rel(out, ref) < TOL
    for a, b in zip(grads["parallel"], grads["recurrent"]):
        assert rel(a, b) < 1e-11
