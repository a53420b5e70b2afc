"""Shared pieces of the linattn experiments: Λ config, seeds, and one training entry point.

Time axis: t = Σ lr of GD on the mean squared query loss; the paper's time is t/τ = 2t (spec §4).
Models use the paper convention (1/N inside the attention); learning rates of the reference code,
which has no 1/N, map to ours by η = N·η_ref for ATTN_M and η = N^{2/3}·η_ref for ATTN_S
(spec §4), which keeps its step axis.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import field_validator, model_validator

from iclab.engines import moments, moments_native, population, sampled
from iclab.experiments._config import ExperimentConfig, param
from iclab.models import linattn as models
from iclab.tasks.linreg import Spectrum, covariance, sample_prompts, sample_query_moments, spectrum_eigenvalues
from iclab.theory import linattn as theory

PAPER = "linattn"


class CovarianceConfig(ExperimentConfig):
    """Λ from explicit eigenvalues or a named spectrum, optionally rotated (spec §2)."""

    D: int = param(4, "input dimension D", paper=4, ge=1, le=64)
    eigenvalues: list[float] | None = param(
        None, "eigenvalues of Λ (length D, all > 0); null: use `spectrum`",
        paper=None, paper_note="Fig 1: not in the caption; reference code: (.4, .3, .2, .1)",
    )
    spectrum: Spectrum = param(
        "linear", "named spectrum, trace 1: linear (∝ D..1), inverse (∝ 1/d), white (I/D)",
        paper="linear", paper_note="reference code's spectrum; gives (.4, .3, .2, .1) at D = 4",
    )
    rotate: bool = param(
        False, "rotate Λ's eigenvectors by a seeded Haar-random orthogonal matrix",
        paper=True, paper_note="reference code rotates; the loss curves do not depend on it",
    )

    @field_validator("eigenvalues")
    @classmethod
    def _positive(cls, value):
        if value is not None and (len(value) == 0 or any(not (v > 0) for v in value)):
            raise ValueError("eigenvalues must all be > 0")
        return value

    @model_validator(mode="after")
    def _length(self):
        if self.eigenvalues is not None and len(self.eigenvalues) != self.D:
            raise ValueError(f"eigenvalues must have D = {self.D} entries (got {len(self.eigenvalues)})")
        return self

    def lambdas(self) -> np.ndarray:
        """The eigenvalues of Λ, decreasing."""
        if self.eigenvalues is not None:
            return np.sort(np.asarray(self.eigenvalues, dtype=float))[::-1]
        return spectrum_eigenvalues(self.spectrum, self.D)


def seed_keys(config: ExperimentConfig) -> jax.Array:
    """One key per seed: fold_in(PRNGKey(seed), s), s = 0..seeds−1. Returns (seeds, 2)."""
    base = jax.random.PRNGKey(config.seed)
    return jnp.stack([jax.random.fold_in(base, s) for s in range(config.seeds)])


def covariances(config: CovarianceConfig, keys: jax.Array) -> jax.Array:
    """Λ for each seed, (S, D, D): shared unless ``rotate`` (then each seed rotates its own)."""
    lam = config.lambdas()
    if not config.rotate:
        return jnp.broadcast_to(covariance(lam), (keys.shape[0], config.D, config.D))
    return jnp.stack([covariance(lam, jax.random.fold_in(k, 7)) for k in keys])




# --------------------------------------------------------------------------------------------
# One entry point to train any linear linattn model with any engine.

Model = Literal["attn_m", "attn_s", "mlp", "softmax_attn_m", "softmax_attn_s"]
Form = Literal["reduced", "full"]
Engine = Literal["population", "moments", "sampled"]
#: How the moments engine runs its steps: through XLA (any model, any optax optimiser) or the
#: compiled kernels of :mod:`iclab.engines.moments_native` (reduced ATTN_S, ATTN_M and the MLP, plain
#: GD; ~4× faster per step on a CPU). Both follow the same trajectory to rounding.
MomentsBackend = Literal["xla", "native"]

_PREDICT = {
    ("attn_m", "reduced"): models.predict_attn_m,
    ("attn_s", "reduced"): models.predict_attn_s,
    ("mlp", "reduced"): models.predict_mlp,
    ("attn_m", "full"): models.predict_attn_m_full,
    ("attn_s", "full"): models.predict_attn_s_full,
}
_TENSOR = {
    ("attn_m", "reduced"): models.tensor_attn_m,
    ("attn_s", "reduced"): models.tensor_attn_s,
    ("mlp", "reduced"): models.tensor_mlp,
    ("attn_m", "full"): models.tensor_attn_m_full,
    ("attn_s", "full"): models.tensor_attn_s_full,
}
_EFFECTIVE = {"attn_m": models.effective_matrix_attn_m, "attn_s": models.effective_matrix_attn_s,
              "mlp": models.effective_matrix_mlp}
# Softmax forms (Sec 2.2), reduced to the blocks that reach ŷ_q; no closed-form loss, so the
# sampled engine only. Params and init as the linear model of the same name (eq 34/36).
_SOFTMAX = {"softmax_attn_m": models.predict_softmax_attn_m, "softmax_attn_s": models.predict_softmax_attn_s}


def init_params(model: Model, key, D: int, H: int, R: int, w_init: float, form: Form = "reduced",
                full_scale: float = 0.0):
    """Eq 34/36 init of one seed; the MLP starts from the same function as ATTN_M (eq 7).

    For the full-matrix form the blocks that never reach ŷ_q are N(0, full_scale²) (0: zeros)."""
    if model in ("attn_s", "softmax_attn_s"):
        p = models.init_attn_s(key, D, H, R, w_init)
    else:
        p = models.init_attn_m(key, D, H, w_init)
    if model == "mlp":
        if form == "full":
            raise ValueError("the MLP has no full-matrix form")
        return models.mlp_from_attn_m(p)
    if form == "full":
        k = jax.random.fold_in(key, 99) if full_scale > 0 else None
        build = models.attn_s_full_from_reduced if model == "attn_s" else models.attn_m_full_from_reduced
        return build(p, k, full_scale)
    return p


Statistics = Literal["prompts", "direct"]


@functools.partial(jax.jit, static_argnames=("N", "P", "form", "method", "chunk"))
def _seed_statistics(key, Lam, *, N: int, P: int, form: Form, method: Statistics, chunk: int):
    """(c, m, G) of one seed's P prompts (see :func:`prompt_statistics`), one compiled pass."""
    if form == "full":
        feature = models.full_feature
    elif method == "direct":
        def feature(part):
            return models.cubic_feature_from_moments(part.beta, part.x_q)
    else:
        feature = models.cubic_feature
    n_chunks = -(-P // chunk)
    sample = sample_query_moments if method == "direct" else sample_prompts
    data = sample(jax.random.fold_in(key, 2), Lam, N, P)
    # Zero prompts pad P to whole chunks: their feature and label are 0, so they add nothing.
    chunks = jax.tree_util.tree_map(
        lambda a: jnp.pad(a, [(0, n_chunks * chunk - P)] + [(0, 0)] * (a.ndim - 1)).reshape(
            (n_chunks, chunk) + a.shape[1:]), data)

    def add(acc, part):
        f, y = feature(part), part.y_q
        return (acc[0] + y @ y, acc[1] + f.T @ y, acc[2] + f.T @ f), None

    F = jax.eval_shape(feature, jax.tree_util.tree_map(lambda a: a[0], chunks)).shape[-1]
    zero = (jnp.zeros((), Lam.dtype), jnp.zeros((F,), Lam.dtype), jnp.zeros((F, F), Lam.dtype))
    (c, m, G), _ = jax.lax.scan(add, zero, chunks)
    return c / P, m / P, G / P


def prompt_statistics(keys: jax.Array, Lams: jax.Array, N: int, P: int, form: Form = "reduced",
                      method: Statistics = "prompts", chunk: int = 8192) -> moments.SufficientStatistics:
    """Moments-engine statistics of P training prompts per seed.

    c = mean(y_q²), m = mean(y_q φ), G = mean(φφᵀ) with φ the cubic feature z (``reduced``) or
    vec(XXᵀ/N) ⊗ x_q (``full``). ``method="prompts"``: the prompts :func:`train` draws,
    ``sample_prompts(fold_in(key_s, 2), Λ_s, N, P)`` (the same data as the sampled engine).
    ``"direct"`` (reduced form only): (β, x_q, y_q) drawn from their exact joint law by
    :func:`iclab.tasks.linreg.sample_query_moments` with the same key: P other prompts of the same
    distribution, N + 3D instead of (N + 2)D random numbers each. One jitted pass per seed fuses
    sampling, feature and Gram; features are formed ``chunk`` prompts at a time, so memory is that
    of one seed's prompts.

    Args:
        keys: (S, 2) seed keys; Lams: (S, D, D) covariances.
    Returns:
        SufficientStatistics with c (S,), m (S, F), G (S, F, F) and P.
    """
    if method not in ("prompts", "direct"):
        raise ValueError(f"method must be 'prompts' or 'direct' (got {method!r})")
    if method == "direct" and form != "reduced":
        raise ValueError("method='direct' draws β, x_q, y_q only: the full-matrix form needs the prompts")
    chunk = min(chunk, P)
    c, m, G = (jnp.stack(a) for a in zip(*(
        _seed_statistics(k, L, N=N, P=P, form=form, method=method, chunk=chunk) for k, L in zip(keys, Lams))))
    return moments.SufficientStatistics(c, m, G, P)


def train(
    model: Model,
    *,
    keys: jax.Array,
    Lams: jax.Array,
    N: int,
    H: int,
    w_init: float,
    lr: float,
    steps: int,
    record_every: int,
    engine: Engine,
    P: int | None = None,
    R: int = 1,
    form: Form = "reduced",
    full_scale: float = 0.0,
    record_params: bool = False,
    reporter=None,
    label: str = "",
    rho: float = 1.0,
    stats: moments.SufficientStatistics | None = None,
    unroll: int = 1,
    backend: MomentsBackend = "xla",
):
    """Trains ``model`` from eq-34/36 init for each seed (vmapped) and returns its Trajectory.

    ``loss`` is the objective of the engine (exact expected loss for ``population``, the training
    loss on P prompts for ``moments`` and ``sampled``, which give the same trajectory); for the
    reduced forms ``metrics["population"]`` is the exact expected loss of the current weights.
    Seed s uses fold_in(key_s, 1) for init and fold_in(key_s, 2) for its P training prompts.
    The softmax models (``softmax_attn_m``, ``softmax_attn_s``, scale ``rho``) train with the
    sampled engine only, in the reduced form, and have no ``population`` metric.
    ``stats`` (moments engine only): the :func:`prompt_statistics` of these prompts, computed
    once and shared by several runs on the same data (e.g. a rank sweep); P is then ``stats.P``.
    ``backend`` (moments engine only): ``"native"`` runs the steps in the compiled kernels of
    :mod:`iclab.engines.moments_native` (reduced attn_s, attn_m, mlp) and reads the population
    metric off the recorded weights afterwards; ``unroll`` applies to ``"xla"`` only.
    """
    S, D = Lams.shape[0], Lams.shape[-1]
    inv_N = 1.0 / N
    # One compiled init instead of op-by-op dispatch of the vmapped sampler (same values to the last
    # bit or two). It runs once, so LLVM optimisation is skipped: it took seconds to compile.
    params0 = jax.jit(jax.vmap(lambda k: init_params(model, jax.random.fold_in(k, 1), D, H, R, w_init, form,
                                                     full_scale)),
                      compiler_options={"xla_backend_optimization_level": 0})(keys)
    aux = {"Lam": Lams, "inv_N": jnp.full((S,), inv_N)}
    if model in _SOFTMAX and (engine != "sampled" or form != "reduced"):
        raise ValueError(f"{model} has no closed-form loss: use engine='sampled', form='reduced'")
    effective = _EFFECTIVE.get(model)
    if backend not in ("xla", "native"):
        raise ValueError(f"backend must be 'xla' or 'native' (got {backend!r})")
    if backend == "native" and (engine != "moments" or form != "reduced" or model not in moments_native.NATIVE_MODELS):
        raise ValueError(f"backend 'native' runs the moments engine on the reduced {', '.join(moments_native.NATIVE_MODELS)} "
                         f"only (got engine {engine!r}, model {model!r}, form {form!r})")

    def pop_loss(params, a):
        return theory.population_loss(effective(params), a["Lam"], a["inv_N"])

    common = dict(lr=lr, n_steps=steps, record_every=record_every, record_params=record_params, batched=True)
    desc = label or f"{engine} {model}"
    with (reporter.task(desc, steps) if reporter is not None else contextlib.nullcontext()) as cb:
        if engine == "population":
            if form != "reduced":
                raise ValueError("the population engine has the closed-form loss of the reduced forms only")
            return population.gradient_descent(pop_loss, params0, aux, callback=cb, **common)
        if stats is not None and engine != "moments":
            raise ValueError("precomputed stats are for engine='moments' only")
        if P is None and stats is None:
            raise ValueError(f"engine {engine} needs P training prompts")
        if stats is not None and P is not None and P != stats.P:
            raise ValueError(f"P = {P} differs from the P = {stats.P} of the given stats")
        metrics = {}
        if engine == "moments":
            st = stats if stats is not None else prompt_statistics(keys, Lams, N, P, form)
            if backend == "native":
                tr = moments_native.full_batch(model, params0, st, lr=lr, n_steps=steps, record_every=record_every,
                                               record_params=True, batched=True, callback=cb)
                # the XLA loop records this metric as it goes; here it is read off the recorded weights
                pop = jax.jit(jax.vmap(jax.vmap(pop_loss, in_axes=(0, None))))(tr.params, aux)
                return tr._replace(metrics={"population": np.asarray(pop)},
                                   params=tr.params if record_params else None)
            if form == "reduced":
                metrics["population"] = pop_loss
            return moments.full_batch(_TENSOR[(model, form)], params0, st, metrics=metrics, extra=aux,
                                      callback=cb, unroll=unroll, **common)
        data = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, P))(keys, Lams)
        if model in _SOFTMAX:
            softmax_predict = _SOFTMAX[model]

            def predict(p, prompts):
                return softmax_predict(p, prompts, rho)
        else:
            predict = _PREDICT[(model, form)]
        carry = {"prompts": data, "pop": aux}
        if form == "reduced" and effective is not None:
            metrics["population"] = lambda p, d: pop_loss(p, d["pop"])
        return sampled.full_batch(lambda p, d: jnp.mean((d["prompts"].y_q - predict(p, d["prompts"])) ** 2),
                                  params0, carry, metrics=metrics, callback=cb, **common)

