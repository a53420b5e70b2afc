import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.experiments.linattn import fig14
from iclab.tasks.linreg import covariance, fixed_task_vector, sample_mixture_prompts, whiten_tasks

LAM = covariance([0.25, 0.25, 0.25, 0.25])


def test_fixed_task_vector_has_norm_sqrt_D():
    for D in (1, 4, 7):
        w = fixed_task_vector(jax.random.PRNGKey(D), D)
        assert float(jnp.linalg.norm(w)) == pytest.approx(np.sqrt(D), rel=1e-14)


@pytest.mark.parametrize("fraction,n_fixed", [(0.0, 0), (0.4, 8), (0.8, 16), (1.0, 20)])
def test_mixture_puts_the_fixed_task_on_the_last_prompts(fraction, n_fixed):
    w_f = fixed_task_vector(jax.random.PRNGKey(0), 4)
    pr = sample_mixture_prompts(jax.random.PRNGKey(1), LAM, 6, 20, fraction, w_f)
    is_fixed = np.all(np.isclose(np.asarray(pr.w), np.asarray(w_f)[None]), axis=1)
    np.testing.assert_array_equal(is_fixed, np.arange(20) >= 20 - n_fixed)
    # Noiseless labels from each prompt's own task, context and query alike.
    np.testing.assert_allclose(pr.y, np.einsum("pnd,pd->pn", pr.x, pr.w), atol=1e-13)
    np.testing.assert_allclose(pr.y_q, np.einsum("pd,pd->p", pr.x_q, pr.w), atol=1e-13)


def test_noise_context_replaces_only_the_fixed_prompts_context_labels():
    w_f = fixed_task_vector(jax.random.PRNGKey(0), 4)
    task = sample_mixture_prompts(jax.random.PRNGKey(2), LAM, 31, 400, 0.5, w_f, "task")
    noise = sample_mixture_prompts(jax.random.PRNGKey(2), LAM, 31, 400, 0.5, w_f, "noise", noise_std=1.0)
    np.testing.assert_array_equal(noise.x, task.x)
    np.testing.assert_array_equal(noise.y[:200], task.y[:200])  # random-task prompts untouched
    np.testing.assert_array_equal(noise.y_q, task.y_q)  # the query label is always the task's
    y_fixed = np.asarray(noise.y[200:])
    assert abs(y_fixed.std() - 1.0) < 0.03  # N(0, 1) labels ...
    lstsq = np.linalg.lstsq(np.asarray(noise.x[200:]).reshape(-1, 4), y_fixed.reshape(-1), rcond=None)[0]
    assert np.linalg.norm(lstsq) < 0.1  # ... unrelated to x (a task-labelled context would give w_f, norm 2)
    silent = sample_mixture_prompts(jax.random.PRNGKey(2), LAM, 31, 400, 0.5, w_f, "noise", noise_std=0.0)
    assert np.all(np.asarray(silent.y[200:]) == 0.0)


def test_mixture_rejects_bad_arguments():
    w_f = fixed_task_vector(jax.random.PRNGKey(0), 4)
    with pytest.raises(ValueError, match="fixed_fraction"):
        sample_mixture_prompts(jax.random.PRNGKey(0), LAM, 3, 5, 1.2, w_f)
    with pytest.raises(ValueError, match="context"):
        sample_mixture_prompts(jax.random.PRNGKey(0), LAM, 3, 5, 0.5, w_f, "shuffled")


def test_whitened_tasks_have_zero_mean_and_identity_covariance():
    w = jax.random.normal(jax.random.PRNGKey(3), (50, 4)) * 2.0 + 1.0
    ww = np.asarray(whiten_tasks(w))
    np.testing.assert_allclose(ww.mean(0), 0.0, atol=1e-13)
    np.testing.assert_allclose(np.cov(ww.T), np.eye(4), atol=1e-12)
    pr = sample_mixture_prompts(jax.random.PRNGKey(4), LAM, 3, 30, 0.5, fixed_task_vector(jax.random.PRNGKey(0), 4),
                                whiten=True)
    np.testing.assert_allclose(np.asarray(pr.w[:15]).mean(0), 0.0, atol=1e-13)
    np.testing.assert_allclose(pr.y, np.einsum("pnd,pd->pn", pr.x, pr.w), atol=1e-12)
    with pytest.raises(ValueError, match="more task vectors"):
        whiten_tasks(w[:4])


def test_training_context_follows_the_reference_branching():
    assert fig14.training_context(0.8, "reference") == "task"
    assert fig14.training_context(1.0, "reference") == "noise"
    assert fig14.training_context(1.0, "task") == "task"
    assert fig14.training_context(0.2, "noise") == "noise"


def test_first_drop_end_and_order_violations():
    t = np.linspace(0, 100, 1001)
    two_drops = 1 - 0.6 / (1 + np.exp(-(t - 20))) - 0.3 / (1 + np.exp(-(t - 60)))
    i = fig14.first_drop_end(t, two_drops)
    assert 20 < t[i] < 30 and abs(two_drops[i] - 0.4) < 0.02  # between the drops, not after the second
    assert fig14.order_violations(np.array([[1.0], [0.995], [0.5], [0.1]]), 0.01) == 0  # a tie within tol
    assert fig14.order_violations(np.array([[1.0], [0.5], [0.6], [0.1]]), 0.01) == 1
    assert fig14.order_violations(np.array([[0.1], [0.2], [0.15]]), 0.01, decreasing=False) == 1


def _synthetic(icl_end0=0.139, iwl_task_end0=0.141, coef_end0=0.01, swap_end=False):
    """Arrays shaped like run_fig14's for 3 portions × 1 seed: IWL first at the largest portion."""
    t = np.linspace(0, 80, 801)
    sig = lambda c, w=1.0: 1 / (1 + np.exp(-(t - c) / w))  # noqa: E731
    train = np.stack([1 - 0.86 * sig(45), 1 - 0.6 * sig(20) - 0.25 * sig(40), 1 - 0.93 * sig(11)])[:, None]
    icl = np.stack([1 - (1 - icl_end0) * sig(45), 1 - 0.85 * sig(40), 1 + 1.3 * sig(11)])[:, None]
    iwl_noise = np.stack([1 + 0.09 * sig(45), 1 - 0.5 * sig(20) + 0.45 * sig(40), 1 - 0.94 * sig(11)])[:, None]
    iwl_task = np.stack([1 - (1 - iwl_task_end0) * sig(45), 1 - 0.87 * sig(30), 1 - 0.9 * sig(11)])[:, None]
    coef = np.stack([coef_end0 * sig(45), 0.5 * sig(20) - 0.45 * sig(40), 0.94 * sig(11)])[:, None]
    if swap_end:
        icl[[0, 2], :, -1] = icl[[2, 0], :, -1]
    se = np.full(1, 0.002)
    return {"t": t, "fixed_portions": np.array([0.0, 0.5, 1.0]), "train": train, "icl": icl, "iwl_noise": iwl_noise,
            "iwl_task": iwl_task, "iwl_coef": coef, "L_MD": np.array(0.13889), "icl_only_icl_se": se,
            "icl_only_iwl_task_se": se}


def test_checks_pass_on_paper_like_curves_and_fail_on_broken_ones():
    config = fig14.Fig14Config(fixed_portions=[0.0, 0.5, 1.0])
    assert all(c.passed for c in fig14.checks_fig14(config, _synthetic()))
    failed = {c.name for c in fig14.checks_fig14(config, _synthetic(icl_end0=0.2, iwl_task_end0=0.3, coef_end0=0.2,
                                                                       swap_end=True)) if not c.passed}
    assert any("L(M_D)" in n for n in failed)
    assert any("IWL (task context) − ICL" in n for n in failed)
    assert any("in-weight coefficient |" in n for n in failed)
    assert any("ICL test loss grows" in n for n in failed)


@pytest.mark.slow  # a few tens of seconds
def test_moments_and_sampled_engines_give_the_same_curves():
    """Both engines run full-batch GD on the same prompts; every recorded curve agrees to rounding,
    and training moves them (the comparison is not trivial)."""
    from iclab.progress import Reporter

    kw = dict(fixed_portions=[0.0, 0.6, 1.0], P=200, P_test=300, steps=200, lr=0.1, w_init=0.3, record_every=50, seeds=1)
    a = fig14.run_fig14(fig14.Fig14Config(engine="moments", **kw), Reporter())
    b = fig14.run_fig14(fig14.Fig14Config(engine="sampled", **kw), Reporter())
    for name in ("train", "icl", "iwl_noise", "iwl_task", "iwl_coef"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-10, atol=1e-12)
    assert np.all(a["train"][:, :, -1] < 0.5 * a["train"][:, :, 0])
