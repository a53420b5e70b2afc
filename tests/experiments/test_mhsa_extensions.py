"""Helpers of mhsa.length, mhsa.transfer and mhsa.fig7 (their quick presets run in test_quick_presets, slow)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.polynomial import hermite_e

from iclab.experiments.mhsa import _training as training
from iclab.experiments.mhsa import fig7, length, transfer
from iclab.models import mhsa as models
from iclab.progress import Reporter
from iclab.tasks.multitask_regression import sample_prompts


@pytest.mark.slow  # ~10-20 s of XLA compilation (threefry inside lax.map)
def test_paired_task_errors_against_a_naive_per_chunk_evaluation():
    c = training.Fig1Config(H=2, I=2, d_bar=3, dtype="float64")
    ts = training.task_family(c)
    rng = np.random.default_rng(0)
    specs = [{"omega": rng.uniform(0.05, 0.4, (2, 2)), "mu": rng.uniform(0.1, 1.5, (2, 2))} for _ in range(2)]
    key = jax.random.PRNGKey(1)

    @jax.jit
    def both(s1, s2):
        a, b = (training.initial_params(s, ts, d_e=6) for s in (s1, s2))
        # Naive reference: the same chunk keys, prompts drawn once per chunk, squared errors per task.
        pr = jax.vmap(lambda k: sample_prompts(k, ts, 7, 32))(jax.random.split(key, 2))
        ref = [jnp.mean((jax.vmap(lambda X, Y, q, p=p: models.predict(p, X, Y, q))(pr.X, pr.Y, pr.q) - pr.y_q) ** 2,
                        axis=1) for p in (a, b)]
        return training.mc_task_errors((a, b), ts, 7, key, 64, 32), jnp.stack(ref)

    pair, ref = both(*specs)
    assert pair.shape == (2, 2, 2) and pair.dtype == jnp.float64
    np.testing.assert_allclose(pair, ref, rtol=1e-13)
    assert abs(float(pair[0].sum()) / float(pair[1].sum()) - 1) > 1e-3


def test_length_lr_schedule_anneals_the_last_steps_linearly():
    c = length.LengthConfig(steps=10, anneal_steps=4, anneal_final=0.25, lr=2.0)
    lr = length.lr_schedule(c)
    got = [float(lr(jnp.asarray(k))) for k in range(10)]
    np.testing.assert_allclose(got, [2.0] * 6 + [2.0 * f for f in (0.8125, 0.625, 0.4375, 0.25)], rtol=1e-14)
    np.testing.assert_array_equal(length.test_lengths(length.LengthConfig(L=100)), [50, 200, 400])
    with pytest.raises(ValueError, match="anneal_steps"):
        length.LengthConfig(steps=3, anneal_steps=4)


@pytest.mark.parametrize("name", sorted(transfer.TARGETS))
def test_transfer_targets_are_their_hermite_expansions(name):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 4))
    coeffs, alphas = transfer.expansion(name, 4)
    he = sum(cf * np.prod([hermite_e.hermeval(x[:, i], [0] * a + [1]) for i, a in enumerate(al)], axis=0)
             for cf, al in zip(coeffs, alphas))
    np.testing.assert_allclose(transfer.hermite_at(name, x), he, rtol=1e-12, atol=1e-12)
    assert transfer.leaks(name) == (int(alphas.max()) >= 2)


def test_fig7_small_config_passes_its_checks_and_plots():
    c = fig7.Fig7Config(n_r=20, I_values=(2, 10, 50))
    a = fig7.run_fig7(c, Reporter())
    failed = [(ch.name, ch.measured) for ch in fig7.checks_fig7(c, a) if not ch.passed]
    assert not failed, failed
    assert fig7.plot_fig7(c, a) is not None
