import jax
import jax.numpy as jnp
import numpy as np
import pytest

from iclab.engines import linreg
from iclab.experiments.linattn import fig5
from iclab.models import linattn as models
from iclab.tasks.linreg import covariance, sample_prompts
from iclab.errors import ConfigError


def _staircase(levels, times, width, t):
    loss = np.full_like(t, levels[0])
    for k, tk in enumerate(times):
        loss -= (levels[k] - levels[k + 1]) / (1 + np.exp(-(t - tk) / width))
    return loss


def _arrays(m_levels, m_times, s_levels, s_times):
    t = np.linspace(0, 100, 2001)
    return {"t_m": t, "loss_m": np.stack([_staircase(m_levels, m_times, 1.0, t)] * 2),
            "t_s": t, "loss_s": np.stack([_staircase(s_levels, s_times, 1.0, t)] * 2),
            "eigenvalues": np.array([.4, .3, .2, .1])}


def test_checks_pass_for_one_drop_versus_several():
    r = _arrays([1.0, 0.14], [20], [1.0, 0.64, 0.38, 0.21, 0.14], [10, 30, 55, 85])
    checks = fig5.checks_fig5(fig5.Fig5Config(), r)
    assert all(c.passed for c in checks), [(c.name, c.measured) for c in checks]
    assert checks[1].measured == 4


def test_checks_fail_when_attn_m_has_two_drops_or_attn_s_one():
    r = _arrays([1.0, 0.4, 0.14], [20, 70], [1.0, 0.14], [30])
    passed = {c.name: c.passed for c in fig5.checks_fig5(fig5.Fig5Config(), r)}
    assert not passed["softmax ATTN_M: one drop (worst seed)"]
    assert not passed["softmax ATTN_S: more than one drop (fewest over seeds)"]


def test_learned_fraction_and_check_at_least():
    assert fig5.learned_fraction(np.array([[1.0, 0.5, 0.2], [2.0, 1.0, 1.0]])) == 0.5
    assert fig5.check_at_least("x", 2, 2).passed and not fig5.check_at_least("x", 1, 2).passed


def test_softmax_at_small_weights_is_the_linear_model_with_one_over_n_plus_one():
    # smax_m(s) ≈ (1 + s_m − s̄)/(N+1): ŷ = Σ_i v_i[ȳ(1 − s̄_i) + N/(N+1) βᵀU_i x_q] + O(U²).
    N = 31
    prompts = sample_prompts(jax.random.PRNGKey(0), covariance(np.array([.4, .3, .2, .1])), N, 64)
    p = models.init_attn_m(jax.random.PRNGKey(1), 4, 3, 1.0)
    keys = jnp.concatenate([prompts.x, prompts.x_q[:, None]], axis=1)
    y_bar = jnp.sum(prompts.y, axis=1) / (N + 1)
    errs = []
    for eps in (1e-2, 1e-3):
        q = {"v": p["v"], "U": eps * p["U"]}
        s_bar = jnp.einsum("pnd,hde,pe->ph", keys, q["U"], prompts.x_q) / (N + 1)
        approx = (y_bar[:, None] * (1 - s_bar)) @ q["v"] + N / (N + 1) * models.predict_attn_m(q, prompts)
        errs.append(float(jnp.max(jnp.abs(models.predict_softmax_attn_m(q, prompts, 1.0) - approx))))
    assert errs[1] < errs[0] / 50  # second order in the weights


def test_train_runs_softmax_models_with_the_sampled_engine_only():
    keys = jnp.stack([jax.random.PRNGKey(0)])
    Lams = covariance(np.array([.4, .3, .2, .1]))[None]
    kw = dict(H=2, w_init=0.1, lr=0.1, steps=4, record_every=2)
    for model in ("softmax_attn_m", "softmax_attn_s"):
        spec = linreg.LinregTraining(model=model, engine="sampled", P=16, rho=2.0, **kw)
        tr = linreg.train(spec, keys=keys, Lams=Lams, N=7)
        assert tr.loss.shape == (1, 3) and "population" not in tr.metrics
        assert np.all(np.isfinite(tr.loss)) and tr.loss[0, -1] < tr.loss[0, 0]
    with pytest.raises(ConfigError, match="sampled"):
        linreg.LinregTraining(model="softmax_attn_m", engine="population", **kw)


def test_config_builds_the_two_softmax_trainings():
    config = fig5.Fig5Config(rho=3.0)
    m, s = config.training("m"), config.training("s")
    assert (m.model, m.H, m.w_init, m.steps, m.rho) == ("softmax_attn_m", 8, 1e-6, 6000, 3.0)
    assert (s.model, s.H, s.R, s.engine, s.P) == ("softmax_attn_s", 4, 1, "sampled", 5000)
