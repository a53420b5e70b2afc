"""A new model family in one file: linear attention with a data-independent scalar gate, registered here
and trained by every linreg engine through iclab.engines.linreg.train, without touching another file.
Also the registry itself and the validation of a LinregTraining.

The gated family: params {v (H,), U (H, D, D), g ()}, ŷ_q = σ(g) Σ_i v_i βᵀU_i x_q (σ the logistic
function). It is bilinear in (β, x_q) with effective matrix A = σ(g) Σ_i v_i U_i, and linear in the cubic
feature z = vec(β x_qᵀ) with tensor vec(A): the population, moments and sampled engines all apply. The
gate only rescales A, so its global minimum is ATTN_M's, L(M_D) of eq 19 (eq 11)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.engines import linreg, seed_keys
from iclab.engines.linreg import LinregTraining
from iclab.errors import ConfigError
from iclab.models import ModelFamily, get_model, model_families, register_model, unregister_model
from iclab.models.linattn import cubic_feature, init_attn_m
from iclab.tasks.linreg import context_moment, covariance, sample_prompts
from iclab.theory import linattn as theory


def init_gated(key, *, D, H, w_init, R=1):
    """Eq-34 init of (v, U) and a half-open gate, g = 0 (σ(g) = 1/2)."""
    return {**init_attn_m(key, D, H, w_init), "g": jnp.zeros((), jnp.float64)}


def effective_gated(params):
    return jax.nn.sigmoid(params["g"]) * jnp.einsum("h,hij->ij", params["v"], params["U"])


def predict_gated(params, prompts):
    return jnp.einsum("pi,ij,pj->p", context_moment(prompts), effective_gated(params), prompts.x_q)


def tensor_gated(params):
    return effective_gated(params).T.reshape(-1)  # column-stacking vec, as the cubic feature


GATED = ModelFamily("gated_attn_m", "linreg", init_gated, predict_gated, effective_gated, tensor_gated, cubic_feature,
                    description="ATTN_M with a data-independent scalar gate: ŷ_q = σ(g) Σ_i v_i βᵀU_i x_q")

LAM = np.array([0.5, 0.3, 0.2])
D, N = 3, 5


TEST_FAMILIES = ("gated_attn_m", "other_task_model")


@pytest.fixture
def registry():
    """The gated family registered for the test, and every family a test registers removed afterwards."""
    register_model(GATED, replace=True)
    yield model_families()
    for name in TEST_FAMILIES:
        unregister_model(name)


def _setup(S=2):
    keys = seed_keys(3, S)
    Lams = jnp.stack([covariance(LAM, jax.random.fold_in(k, 7)) for k in keys])
    return keys, Lams


def test_gated_family_predicts_through_its_effective_matrix_and_tensor(registry):
    prompts = sample_prompts(jax.random.PRNGKey(0), covariance(LAM), N, 50)
    params = {**init_attn_m(jax.random.PRNGKey(1), D, 4, 1.0), "g": jnp.asarray(0.7)}
    y = predict_gated(params, prompts)
    np.testing.assert_allclose(cubic_feature(prompts) @ tensor_gated(params), y, rtol=1e-12, atol=1e-14)
    ungated = get_model("attn_m").predict(params, prompts)
    np.testing.assert_allclose(y, jax.nn.sigmoid(0.7) * ungated, rtol=1e-12, atol=1e-14)
    assert get_model("gated_attn_m") is GATED and model_families("linreg")["gated_attn_m"] is GATED
    assert GATED.engines == ("sampled", "population", "moments")


def test_gated_family_trains_to_the_global_minimum_by_the_population_engine(registry):
    keys, Lams = _setup()
    spec = LinregTraining(model="gated_attn_m", engine="population", H=3, w_init=0.5, lr=0.5, steps=3000,
                          record_every=100, record_params=True)
    tr = linreg.train(spec, keys=keys, Lams=Lams, N=N)
    L_MD = theory.plateau_losses(LAM, 1.0 / N)[-1]
    assert np.all(np.diff(tr.loss, axis=1) <= 1e-15)
    assert tr.loss[:, 0].min() > L_MD + 0.1
    np.testing.assert_allclose(tr.loss[:, -1], L_MD, atol=1e-6)  # eq 19 with m = D: the gate only rescales A
    # the gate is trained too: it moved away from its initial value
    assert np.all(np.abs(np.asarray(tr.params["g"])[:, -1]) > 1e-3)
    A = jax.vmap(effective_gated)(jax.tree_util.tree_map(lambda a: a[:, -1], tr.params))
    for s in range(2):  # eq 11: A* = E[Λ̂²]⁻¹Λ
        np.testing.assert_allclose(A[s], theory.attn_m_fixed_point(Lams[s], 1.0 / N), atol=1e-4)


@pytest.mark.slow
def test_gated_family_sampled_and_moments_engines_follow_the_same_trajectory(registry):
    keys, Lams = _setup()
    common = dict(model="gated_attn_m", H=3, w_init=0.5, lr=0.3, steps=200, record_every=20, P=300,
                  record_params=True)
    sampled = linreg.train(LinregTraining(engine="sampled", **common), keys=keys, Lams=Lams, N=N)
    moments = linreg.train(LinregTraining(engine="moments", **common), keys=keys, Lams=Lams, N=N)
    np.testing.assert_allclose(moments.loss, sampled.loss, rtol=1e-10)
    np.testing.assert_allclose(moments.metrics["population"], sampled.metrics["population"], rtol=1e-10)
    for name in ("v", "U", "g"):
        np.testing.assert_allclose(moments.params[name], sampled.params[name], rtol=1e-9, atol=1e-12)
    assert np.all(sampled.loss[:, -1] < 0.5 * sampled.loss[:, 0])


def test_an_experiment_spec_accepts_the_new_family(registry):
    # No linattn figure config has a free model field; its specifications are built by training_spec from the
    # config's settings and the run's choices, which accepts any registered linreg family.
    from iclab.experiments.linattn._common import training_spec
    from iclab.experiments.linattn.fig1 import Fig1Config

    config = Fig1Config(H=2, w_init=0.1, lr=0.1, steps=1, P=10)
    spec = training_spec(config, model="gated_attn_m", engine="moments")
    assert spec.family() is GATED
    assert (spec.H, spec.w_init, spec.lr, spec.steps, spec.P) == (2, 0.1, 0.1, 1, 10)
    with pytest.raises(ValueError, match="training specification: backend 'native'"):
        training_spec(config, model="gated_attn_m", engine="moments", backend="native")
    with pytest.raises(ConfigError, match="no full-matrix form"):
        LinregTraining(model="gated_attn_m", engine="sampled", form="full", H=2, w_init=0.1, lr=0.1, steps=1, P=10)


# ---------------------------------------------------------------------------------------------
# The registry.


def test_registry_refuses_unknown_and_duplicate_names(registry):
    with pytest.raises(KeyError, match="unknown model family 'nope'.*attn_m.*gated_attn_m"):
        get_model("nope")
    twin = ModelFamily("gated_attn_m", "linreg", init_gated, predict_gated)
    with pytest.raises(ValueError, match="registered already"):
        register_model(twin)
    assert register_model(GATED) is GATED  # the same family again: a no-op
    assert register_model(twin, replace=True) is twin and get_model("gated_attn_m") is twin
    assert twin.engines == ("sampled",)
    unregister_model("gated_attn_m")
    assert "gated_attn_m" not in model_families("linreg")
    unregister_model("gated_attn_m")  # a second time: nothing to remove, no error
    assert ModelFamily("t", "linreg", init_gated, predict_gated, effective_gated).engines == ("sampled", "population")
    with pytest.raises(ValueError, match="tensor and feature"):
        ModelFamily("t", "linreg", init_gated, predict_gated, tensor=tensor_gated)
    with pytest.raises(ValueError, match="identifier"):
        ModelFamily("gated attn", "linreg", init_gated, predict_gated)


def test_the_test_families_are_removed_after_each_test():
    assert "gated_attn_m" not in model_families()


# ---------------------------------------------------------------------------------------------
# LinregTraining validation.


@pytest.mark.parametrize("fields, message", [
    (dict(model="softmax_attn_m", engine="population"), "engine 'population' needs an effective matrix"),
    (dict(model="softmax_attn_s", engine="moments", P=10), "engine 'moments' needs a tensor"),
    (dict(model="attn_s", engine="sampled", P=10, backend="native"), "backend 'native'"),
    (dict(model="mlp", engine="sampled", P=10, form="full"), "'mlp' has no full-matrix form"),
    (dict(model="attn_m", engine="moments"), "needs P training prompts"),
    (dict(model="attn_m", engine="sampled"), "needs P training prompts"),
    (dict(model="attn_m", engine="moments", P=10, integrator="gf"), "integrator 'gf'"),
    (dict(model="nope", engine="sampled", P=10), "unknown model family 'nope'"),
    (dict(model="attn_m", engine="sampled", P=10, w_init=0.0), "w_init"),
])
def test_linreg_training_refuses_bad_combinations(fields, message):
    from iclab.errors import ConfigError

    base = dict(H=2, w_init=0.1, lr=0.1, steps=1)
    with pytest.raises(ConfigError, match=message) as err:
        LinregTraining(**{**base, **fields})
    text = str(err.value)  # one line naming what is wrong, without pydantic's URL
    assert text.startswith("training specification: ") and "\n" not in text and "pydantic" not in text


def test_linreg_training_refuses_a_family_of_another_task(registry):
    register_model(ModelFamily("other_task_model", "multitask", init_gated, predict_gated))
    with pytest.raises(ConfigError, match="reads 'multitask' prompts"):
        LinregTraining(model="other_task_model", engine="sampled", H=2, w_init=0.1, lr=0.1, steps=1, P=10)


def test_the_joint_trainer_builds_members_from_a_family(registry):
    """train_members trains a registered family from the family alone (engines.family_members); the members
    follow exactly the trajectory of the same members written by hand, and their loss falls."""
    from iclab.engines import Members, each_member, family_members, train_members

    keys, Lams = _setup(S=2)
    Lam = Lams[0]

    def sampler(key, aux):
        return sample_prompts(key, Lam, N, 64)

    sizes = dict(D=D, H=3, w_init=0.5)
    ids = np.arange(4).reshape(2, 2)
    by_family = family_members("gated_attn_m", ids, sizes=sizes)

    def loss_one(params, batch, setting):
        return jnp.mean((predict_gated(params, batch) - batch.y_q) ** 2)

    by_hand = Members(lambda key, setting: init_gated(key, **sizes), each_member(loss_one, 2), ids)
    run = dict(keys=keys, lr=0.2, n_steps=150, record_every=50)
    a = train_members({"gated": by_family}, sampler, **run)
    b = train_members({"gated": by_hand}, sampler, **run)
    np.testing.assert_array_equal(a.loss, b.loss)
    assert a.metrics["member_loss"]["gated"].shape == (2, 4, 2, 2)
    # they train: the summed loss of fresh batches of 64 prompts falls by a quarter within 150 steps (4.96 -> 2.66
    # and 3.62 -> 1.55 at these keys; batch noise alone moves it by a few per cent)
    assert np.all(a.loss[:, -1] < 0.75 * a.loss[:, 0])


def test_family_members_pass_each_members_options_and_refuse_unknown_ones():
    from iclab.engines import family_members, init_members

    ids = np.arange(3)
    rho = np.array([0.5, 1.0, 2.0])
    group = family_members("softmax_attn_m", ids, sizes=dict(D=D, H=2, w_init=0.5), settings={"rho": rho})
    keys, Lams = _setup(S=1)
    prompts = sample_prompts(jax.random.PRNGKey(0), Lams[0], N, 32)
    params = jax.tree_util.tree_map(lambda a: a[0], init_members(group, keys))
    losses = group.loss(params, prompts, group.settings)
    family = get_model("softmax_attn_m")
    for m in range(3):
        one = jax.tree_util.tree_map(lambda a: a[m], params)
        expected = jnp.mean((family.predict(one, prompts, rho=rho[m]) - prompts.y_q) ** 2)
        np.testing.assert_allclose(losses[m], expected, rtol=1e-12)
    with pytest.raises(ValueError, match="not options of model family 'softmax_attn_m'"):
        family_members("softmax_attn_m", ids, sizes={}, settings={"temperature": rho})
    with pytest.raises(ValueError, match="members' shape"):
        family_members("softmax_attn_m", ids, sizes={}, settings={"rho": rho[:2]})


def test_every_builtin_linreg_familys_reduced_forms_reproduce_its_prediction():
    from iclab.models import check_reduced_forms

    checked = [f for f in model_families("linreg").values() if f.effective_matrix is not None or f.tensor is not None]
    assert {"attn_m", "attn_s", "mlp", "attn_m_full", "attn_s_full"} <= {f.name for f in checked}
    for family in checked:
        check_reduced_forms(family)


def test_a_tensor_in_the_wrong_layout_is_refused_at_registration(registry):
    # the gated family's tensor stacked row by row (A.reshape(-1)) where the cubic feature stacks columns
    wrong = ModelFamily("gated_attn_m", "linreg", init_gated, predict_gated, effective_gated,
                        lambda params: effective_gated(params).reshape(-1), cubic_feature)
    with pytest.raises(ValueError, match="'gated_attn_m': its tensor does not reproduce its predict") as err:
        register_model(wrong, replace=True)
    assert "\n" not in str(err.value)
    transposed = ModelFamily("gated_attn_m", "linreg", init_gated, predict_gated, lambda p: effective_gated(p).T)
    with pytest.raises(ValueError, match="its effective_matrix does not reproduce"):
        register_model(transposed, replace=True)
    assert get_model("gated_attn_m") is GATED  # the registry kept the good family
    register_model(GATED, replace=True)  # the right layout passes the same check
