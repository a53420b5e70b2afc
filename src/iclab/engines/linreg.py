"""Training any registered in-context linear-regression model family with the population, moments or
sampled engine, from one validated specification (:class:`LinregTraining`).

The task is that of :mod:`iclab.tasks.linreg`: x_n ~ N(0, Λ), w ~ N(0, I), y_n = wᵀx_n, N context
pairs and a query; the loss is the mean squared query error (no ½). The engines, on the shared time
axis t = Σ lr:

- ``population``: GD on the exact expected loss L(A) = E(y_q − βᵀA x_q)² of the family's effective
  matrix A(θ) (:func:`iclab.theory.linattn.population_loss`, with E(1/N));
- ``moments``: exact full-batch GD on P prompts from their sufficient statistics (:mod:`iclab.engines.moments`,
  or its compiled kernels, ``backend="native"``), for families linear in a fixed feature;
- ``sampled``: full-batch GD on the same P prompts through the family's own prediction (any family).

Seed s (key_s = fold_in(PRNGKey(seed), s)) initialises with fold_in(key_s, 1) and draws its P training
prompts with fold_in(key_s, 2), so the moments and sampled engines see the same data and follow the
same trajectory (to rounding).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import BaseModel, ConfigDict, Field, model_validator

from iclab.engines import moments, moments_native, population, sampled
from iclab.engines._descent import Schedule
from iclab.engines._loop import Trajectory
from iclab.models import get_model
from iclab.models.linattn import cubic_feature, cubic_feature_from_moments
from iclab.progress import Reporter, task
from iclab.tasks.linreg import sample_prompts, sample_query_moments
from iclab.theory.linattn import population_loss

__all__ = ["Engine", "Form", "LinregTraining", "MomentsBackend", "Statistics", "init_params", "prompt_statistics",
           "train"]

Form = Literal["reduced", "full"]
Engine = Literal["population", "moments", "sampled"]
#: How the moments engine runs its steps: through XLA (any family, any optax optimiser) or the compiled
#: kernels of :mod:`iclab.engines.moments_native` (reduced attn_s, attn_m and mlp, plain GD; ~4× faster
#: per step on a CPU). Both follow the same trajectory to rounding.
MomentsBackend = Literal["xla", "native"]
#: How the moments engine's statistics are drawn: from the prompts (the sampled engine's data) or
#: (β, x_q, y_q) from their exact joint law (:func:`iclab.tasks.linreg.sample_query_moments`).
Statistics = Literal["prompts", "direct"]


class LinregTraining(BaseModel):
    """What :func:`train` trains and how: model family, engine, sizes, init and GD settings.

    Every combination is checked here, so a bad one is a one-line validation error naming the field
    before anything runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="a registered model family of task 'linreg' (iclab.models.model_families('linreg'))")
    engine: Engine = Field(description="population (exact expected loss), moments (exact full-batch GD from "
                                       "sufficient statistics) or sampled (full-batch GD on the prompts)")
    H: int = Field(ge=1, le=100_000, description="heads H (hidden units of the MLP)")
    R: int = Field(1, ge=1, le=1024, description="rank R of each ATTN_S head")
    w_init: float = Field(gt=0, le=1e3, description="init scale (eqs 34/36: layer norms ≈ w_init)")
    lr: float = Field(gt=0, le=1e6, description="GD learning rate η (paper convention: 1/N inside the attention)")
    steps: int = Field(ge=0, le=10**9, description="GD steps")
    record_every: int = Field(1, ge=1, le=10**9, description="record every this many steps")
    P: int | None = Field(None, ge=1, le=10**9, description="training prompts (moments and sampled engines)")
    form: Form = Field("reduced", description="reduced (the blocks that reach ŷ_q) or full-matrix weights")
    full_scale: float = Field(0.0, ge=0, le=1e3, description="std of the full-matrix blocks that never reach ŷ_q")
    rho: float = Field(1.0, gt=0, le=1e6, description="softmax temperature ρ (families with a 'rho' option)")
    backend: MomentsBackend = Field("xla", description="moments engine: xla or the compiled native kernels")
    unroll: int = Field(1, ge=1, le=1024, description="steps unrolled per compiled loop iteration (xla)")
    record_params: bool = Field(False, description="record the params at every record")

    @model_validator(mode="after")
    def _compatible(self):
        try:
            family = get_model(self.model)
        except KeyError as err:
            raise ValueError(f"model: {err.args[0]}") from None
        if family.task != "linreg":
            raise ValueError(f"model {self.model!r} reads {family.task!r} prompts, not linreg")
        if self.form == "full":
            if family.full_form is None:
                raise ValueError(f"model {self.model!r} has no full-matrix form")
            family = get_model(family.full_form)
        if self.engine not in family.engines:
            need = {"population": "an effective matrix (a closed-form expected loss)",
                    "moments": "a tensor in a fixed feature"}[self.engine]
            raise ValueError(f"engine {self.engine!r} needs {need}; {family.name} supports "
                             f"{', '.join(family.engines)}")
        if self.engine != "population" and self.P is None:
            raise ValueError(f"engine {self.engine!r} needs P training prompts")
        if self.backend == "native" and (self.engine != "moments" or self.form != "reduced"
                                         or self.model not in moments_native.NATIVE_MODELS):
            raise ValueError(f"backend 'native' runs the moments engine on the reduced "
                             f"{', '.join(moments_native.NATIVE_MODELS)} only (got engine {self.engine!r}, "
                             f"model {self.model!r}, form {self.form!r})")
        return self

    def family(self):
        """The registered family trained (its full-matrix form when ``form == "full"``)."""
        family = get_model(self.model)
        return get_model(family.full_form) if self.form == "full" else family


def init_params(spec: LinregTraining, key: jax.Array, D: int):
    """One model's initial params: the family's init (eqs 34/36 for the attention models).

    Args:
        spec: the training specification (family, H, R, w_init, form, full_scale).
        key: the init key (:func:`train` uses fold_in(key_s, 1)).
        D: input dimension.
    """
    sizes = dict(D=D, H=spec.H, R=spec.R, w_init=spec.w_init)
    if spec.form == "full":
        sizes["full_scale"] = spec.full_scale
    return spec.family().init(key, **sizes)


@functools.partial(jax.jit, static_argnames=("N", "P", "feature", "method", "chunk"))
def _seed_statistics(key, Lam, *, N: int, P: int, feature, method: Statistics, chunk: int):
    """(c, m, G) of one seed's P prompts (see :func:`prompt_statistics`), one compiled pass."""
    if method == "direct":
        def phi(part):
            return cubic_feature_from_moments(part.beta, part.x_q)
    else:
        phi = feature
    n_chunks = -(-P // chunk)
    sample = sample_query_moments if method == "direct" else sample_prompts
    data = sample(jax.random.fold_in(key, 2), Lam, N, P)
    # Zero prompts pad P to whole chunks: their feature and label are 0, so they add nothing.
    chunks = jax.tree_util.tree_map(
        lambda a: jnp.pad(a, [(0, n_chunks * chunk - P)] + [(0, 0)] * (a.ndim - 1)).reshape(
            (n_chunks, chunk) + a.shape[1:]), data)

    def add(acc, part):
        f, y = phi(part), part.y_q
        return (acc[0] + y @ y, acc[1] + f.T @ y, acc[2] + f.T @ f), None

    F = jax.eval_shape(phi, jax.tree_util.tree_map(lambda a: a[0], chunks)).shape[-1]
    zero = (jnp.zeros((), Lam.dtype), jnp.zeros((F,), Lam.dtype), jnp.zeros((F, F), Lam.dtype))
    (c, m, G), _ = jax.lax.scan(add, zero, chunks)
    return c / P, m / P, G / P


def prompt_statistics(keys: jax.Array, Lams: jax.Array, N: int, P: int, *, feature=cubic_feature,
                      method: Statistics = "prompts", chunk: int = 8192) -> moments.SufficientStatistics:
    """Moments-engine statistics of P training prompts per seed.

    c = mean(y_q²), m = mean(y_q φ), G = mean(φφᵀ) with φ = ``feature`` (the cubic feature z of the reduced
    forms by default; a family's ``feature`` otherwise). ``method="prompts"``: the prompts :func:`train`
    draws, ``sample_prompts(fold_in(key_s, 2), Λ_s, N, P)`` (the same data as the sampled engine).
    ``"direct"`` (the cubic feature only): (β, x_q, y_q) drawn from their exact joint law by
    :func:`iclab.tasks.linreg.sample_query_moments` with the same key: P other prompts of the same
    distribution, N + 3D instead of (N + 2)D random numbers each. One jitted pass per seed fuses
    sampling, feature and Gram; features are formed ``chunk`` prompts at a time.

    Args:
        keys: (S, 2) seed keys; Lams: (S, D, D) covariances; N: context pairs; P: prompts per seed.
        feature: φ(prompts) -> (P, F).
        method: "prompts" or "direct".
        chunk: prompts per feature block (memory bound).
    Returns:
        SufficientStatistics with c (S,), m (S, F), G (S, F, F) and P.
    """
    if method not in ("prompts", "direct"):
        raise ValueError(f"method must be 'prompts' or 'direct' (got {method!r})")
    if method == "direct" and feature is not cubic_feature:
        raise ValueError("method='direct' draws β, x_q, y_q only: the cubic feature of the reduced forms, not the full-matrix or another feature")
    chunk = min(chunk, P)
    c, m, G = (jnp.stack(a) for a in zip(*(
        _seed_statistics(k, L, N=N, P=P, feature=feature, method=method, chunk=chunk) for k, L in zip(keys, Lams))))
    return moments.SufficientStatistics(c, m, G, P)


def train(
    spec: LinregTraining,
    *,
    keys: jax.Array,
    Lams: jax.Array,
    N: int,
    optimizer: optax.GradientTransformation | None = None,
    lr: Schedule | None = None,
    stats: moments.SufficientStatistics | None = None,
    reporter: Reporter | None = None,
    label: str = "",
) -> Trajectory:
    """Trains ``spec.model`` from its init for each seed (vmapped) and returns its Trajectory.

    ``loss`` is the objective of the engine (exact expected loss for ``population``, the training loss on
    P prompts for ``moments`` and ``sampled``, which give the same trajectory); for families with an
    effective matrix ``metrics["population"]`` is the exact expected loss of the current weights.

    Args:
        spec: what to train and how (validated).
        keys: (S, 2) seed keys; seed s initialises with fold_in(key_s, 1) and draws its prompts with fold_in(key_s, 2).
        Lams: (S, D, D) input covariances Λ.
        N: context pairs per prompt (E(1/N) = 1/N in the population loss).
        optimizer: the update direction, an optax GradientTransformation without learning rate (None:
            plain GD, the papers' procedure); not with ``backend="native"``.
        lr: a learning-rate schedule replacing ``spec.lr`` (t = Σ lr); not with ``backend="native"``.
        stats: the :func:`prompt_statistics` of these prompts (moments engine), computed once and shared
            by several runs on the same data (e.g. a rank sweep); P is then ``stats.P``.
        reporter: progress reporter (None: silent); label: the task's name.
    """
    if stats is not None and spec.engine != "moments":
        raise ValueError("precomputed stats are for engine='moments' only")
    if stats is not None and spec.P is not None and spec.P != stats.P:
        raise ValueError(f"P = {spec.P} differs from the P = {stats.P} of the given stats")
    if spec.backend == "native" and (optimizer is not None or lr is not None):
        raise ValueError("backend 'native' runs plain GD at the constant spec.lr only")
    family = spec.family()
    S, D = Lams.shape[0], Lams.shape[-1]
    # One compiled init instead of op-by-op dispatch of the vmapped sampler (same values to the last bit
    # or two). It runs once, so LLVM optimisation is skipped: it took seconds to compile.
    params0 = jax.jit(jax.vmap(lambda k: init_params(spec, jax.random.fold_in(k, 1), D)),
                      compiler_options={"xla_backend_optimization_level": 0})(keys)
    aux = {"Lam": Lams, "inv_N": jnp.full((S,), 1.0 / N)}
    effective = get_model(spec.model).effective_matrix  # the reduced family's, also for the full form

    def pop_loss(params, a):
        return population_loss(effective(params), a["Lam"], a["inv_N"])

    common = dict(lr=spec.lr if lr is None else lr, n_steps=spec.steps, record_every=spec.record_every,
                  record_params=spec.record_params, batched=True, optimizer=optimizer)
    metrics = {"population": pop_loss} if (effective is not None and spec.form == "reduced") else {}
    with task(reporter, label or f"{spec.engine} {spec.model}", spec.steps) as cb:
        if spec.engine == "population":
            return population.gradient_descent(pop_loss, params0, aux, callback=cb, **common)
        if spec.engine == "moments":
            st = stats if stats is not None else prompt_statistics(keys, Lams, N, spec.P, feature=family.feature)
            if spec.backend == "native":
                tr = moments_native.full_batch(spec.model, params0, st, lr=spec.lr, n_steps=spec.steps,
                                               record_every=spec.record_every, record_params=True, batched=True,
                                               callback=cb)
                # the XLA loop records this metric as it goes; here it is read off the recorded weights
                pop = jax.jit(jax.vmap(jax.vmap(pop_loss, in_axes=(0, None))))(tr.params, aux)
                return tr._replace(metrics={"population": np.asarray(pop)},
                                   params=tr.params if spec.record_params else None)
            return moments.full_batch(family.tensor, params0, st, metrics=metrics, extra=aux, callback=cb,
                                      unroll=spec.unroll, **common)
        data = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, spec.P))(keys, Lams)
        options = {"rho": spec.rho} if "rho" in family.options else {}

        def train_loss(p, d):
            return jnp.mean((d["prompts"].y_q - family.predict(p, d["prompts"], **options)) ** 2)

        carry = {"prompts": data, "pop": aux}
        sampled_metrics = {k: (lambda p, d, f=f: f(p, d["pop"])) for k, f in metrics.items()}
        return sampled.full_batch(train_loss, params0, carry, metrics=sampled_metrics, callback=cb, **common)
