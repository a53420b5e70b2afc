"""The joint trainer against members trained alone: subsets of a grid, per-member clipping, keys."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from iclab.engines import joint, sampled
from iclab.tasks import standard_normal

D = 3


def _sampler(key, aux):
    """A batch of linear-regression pairs shared by every member: x (B, D), y (B,). Drawn through the fast
    RBG sampler, which the trainer vmaps over seeds: a seed's batches must not depend on the other seeds."""
    z = standard_normal(key, (32 * D + D,))
    x = z[: 32 * D].reshape(32, D)
    w = aux["w"] + 0.1 * z[32 * D:]
    return x, x @ w


def _init(key, setting):
    # through the RBG sampler too: the trainer vmaps the init over member keys
    return {"a": 0.5 * standard_normal(key, (D,)), "b": jnp.zeros(())}


def _loss_one(params, batch, setting):
    """Ridge with a member-specific penalty λ (the setting): members differ in λ only."""
    x, y = batch
    pred = x @ params["a"] + params["b"]
    return jnp.mean((pred - y) ** 2) + setting * jnp.sum(params["a"] ** 2) + 0.3 * params["b"] ** 4


def _grid(ids, lams):
    ids, lams = np.asarray(ids), jnp.asarray(lams, jnp.float64)
    return joint.Members(init=_init, loss=joint.each_member(_loss_one, ids.ndim), ids=ids, settings=lams)


def _two_groups(sel2=slice(None), sel1=slice(None)):
    """A 2-D group (2 × 3 members) and a 1-D group (2 members) with another structure."""
    ids2 = np.arange(6).reshape(2, 3)[sel2]
    lams2 = np.linspace(0.0, 0.5, 6).reshape(2, 3)[sel2]
    deep_ids = np.array([6, 7])[sel1]

    def init_deep(key, setting):
        k1, k2 = jax.random.split(key)
        return {"W": 0.3 * jax.random.normal(k1, (D, 2)), "v": 0.3 * jax.random.normal(k2, (2,))}

    def loss_deep(params, batch, setting):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ params["W"]) @ params["v"] * setting - y) ** 2)

    return {"ridge": _grid(ids2, lams2),
            "deep": joint.Members(init_deep, joint.each_member(loss_deep, 1), deep_ids,
                                  jnp.asarray(np.array([1.0, 2.0])[sel1]))}


AUX = {"w": jnp.broadcast_to(jnp.array([1.0, -0.5, 0.25]), (2, D))}  # two seeds
AUX1 = {"w": AUX["w"][1:]}


@pytest.mark.parametrize("clip_norm", [None, pytest.param(0.5, marks=pytest.mark.slow)])
def test_a_subset_trained_alone_follows_the_full_grid(clip_norm):
    keys = joint.seed_keys(3, 2)
    common = dict(keys=keys, lr=0.02, n_steps=60, optimizer=optax.scale_by_adam(), clip_norm=clip_norm,
                  record_every=20, aux=AUX)
    full = joint.train_members(_two_groups(), _sampler, **common)
    sub = joint.train_members(_two_groups(sel2=(slice(1, 2), slice(0, 3, 2)), sel1=slice(1, 2)), _sampler, **common)
    f, s = full.final_params, sub.final_params
    np.testing.assert_allclose(s["ridge"]["a"], f["ridge"]["a"][:, 1:2, 0::2], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(s["deep"]["W"], f["deep"]["W"][:, 1:], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(sub.metrics["member_loss"]["ridge"], full.metrics["member_loss"]["ridge"][:, :, 1:2, 0::2],
                               rtol=1e-12)
    # the summed loss is the sum of the recorded members' losses
    np.testing.assert_allclose(full.loss, sum(v.sum(axis=tuple(range(2, v.ndim)))
                                              for v in full.metrics["member_loss"].values()), rtol=1e-13)
    # the subset really moved (a test that could not fail otherwise)
    assert not np.allclose(f["ridge"]["a"][:, 0, 0], f["ridge"]["a"][:, 1, 0])
    # seed 1 alone (base seed 3, seed index 1) follows its row of the two-seed run
    alone = joint.train_members(_two_groups(), _sampler, **dict(common, keys=keys[1:], aux=AUX1))
    np.testing.assert_allclose(alone.final_params["ridge"]["a"][0], f["ridge"]["a"][1], rtol=1e-12, atol=1e-14)


def test_groups_sharing_a_joint_loss_are_computed_by_one_call_with_the_same_training():
    """Two groups whose ``joint`` is one function: group_losses calls it once for both (the third group by its
    loss), and the training equals the one without the joint function, bit for bit."""
    calls = []
    plain = dict(_two_groups(), third=_grid(np.array([8, 9]), [0.1, 0.2]))

    def both(params, batch, settings):
        calls.append(sorted(params))
        return {name: plain[name].loss(params[name], batch, settings[name]) for name in params}

    fused = {name: g._replace(joint=both) if name in ("ridge", "deep") else g for name, g in plain.items()}
    keys = joint.seed_keys(5, 2)
    params = {name: joint.init_members(g, keys[0][None], 1) for name, g in plain.items()}
    params = jax.tree_util.tree_map(lambda a: a[0], params)
    batch = _sampler(keys[0], {"w": AUX["w"][0]})
    settings = {name: g.settings for name, g in plain.items()}
    out = joint.group_losses(fused, params, batch, settings)
    assert calls == [["deep", "ridge"]] and list(out) == ["ridge", "deep", "third"]
    for name, g in plain.items():
        np.testing.assert_array_equal(out[name], g.loss(params[name], batch, settings[name]))
    common = dict(keys=keys, lr=0.02, n_steps=20, optimizer=optax.scale_by_adam(), clip_norm=0.5, record_every=10,
                  aux=AUX)
    a, b = (joint.train_members(groups, _sampler, **common) for groups in (plain, fused))
    for x, y in zip(jax.tree_util.tree_leaves((a.final_params, a.loss, a.metrics)),
                    jax.tree_util.tree_leaves((b.final_params, b.loss, b.metrics))):
        np.testing.assert_array_equal(x, y)


def test_each_member_equals_the_sampled_engine_alone():
    """Member (0, 2) of the grid = the same model, init and batches trained by sampled.minibatch alone."""
    keys = joint.seed_keys(0, 2)
    groups = {"ridge": _grid(np.arange(6).reshape(2, 3), np.linspace(0.0, 0.5, 6).reshape(2, 3))}
    tr = joint.train_members(groups, _sampler, keys=keys, lr=0.05, n_steps=40, optimizer=optax.scale_by_adam(),
                             record_every=10, aux=AUX)
    lam = float(np.linspace(0.0, 0.5, 6)[2])
    init = jax.vmap(lambda k: _init(jax.random.fold_in(jax.random.fold_in(k, 1), 2), None))(keys)
    data_keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)
    alone = sampled.minibatch(lambda p, b: _loss_one(p, b, lam), init, _sampler, data_keys, AUX, lr=0.05, n_steps=40,
                              optimizer=optax.scale_by_adam(), record_every=10, batched=True)
    np.testing.assert_allclose(tr.final_params["ridge"]["a"][:, 0, 2], alone.final_params["a"], rtol=1e-12)
    np.testing.assert_allclose(tr.metrics["member_loss"]["ridge"][:, :, 0, 2], alone.loss, rtol=1e-12)
    np.testing.assert_allclose(tr.t, alone.t, rtol=0)


def test_per_member_clipping_equals_global_norm_clipping_of_each_member():
    rng = np.random.default_rng(0)
    updates = {"g": {"a": jnp.asarray(rng.normal(size=(2, 3, 4)) * 3), "b": jnp.asarray(rng.normal(size=(2, 3)))}}
    got, _ = joint.clip_by_member_norm(1.5, {"g": 2}).update(updates, optax.EmptyState())
    ref = optax.clip_by_global_norm(1.5)
    for i in range(2):
        for j in range(3):
            one = jax.tree_util.tree_map(lambda a: a[i, j], updates["g"])
            want, _ = ref.update(one, ref.init(one))
            np.testing.assert_allclose(got["g"]["a"][i, j], want["a"], rtol=1e-14)
            np.testing.assert_allclose(got["g"]["b"][i, j], want["b"], rtol=1e-14)


def test_member_keys_depend_on_the_id_only():
    key = joint.seed_keys(5, 1)[0]
    a = joint.member_keys(key, np.array([[0, 1], [2, 3]]), 1)
    b = joint.member_keys(key, np.array([3, 1]), 1)
    np.testing.assert_array_equal(a[1, 1], b[0])
    np.testing.assert_array_equal(a[0, 1], b[1])
    assert not np.array_equal(joint.member_keys(key, np.array([3]), 2)[0], b[0])  # another stream


def test_bad_grids_are_refused():
    g = _grid(np.arange(3), np.zeros(3))
    with pytest.raises(ValueError, match="distinct"):
        joint.train_members({"a": g, "b": g}, _sampler, keys=joint.seed_keys(0, 2), lr=0.1, n_steps=1, aux=AUX)
    with pytest.raises(TypeError, match="GradientTransformation"):
        joint.train_members({"a": g}, _sampler, keys=joint.seed_keys(0, 2), lr=0.1, n_steps=1, aux=AUX,
                            optimizer=optax.adam)
