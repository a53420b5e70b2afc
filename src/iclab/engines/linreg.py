"""Training any registered in-context linear-regression model family with the population, moments or
sampled engine, from one validated specification (:class:`LinregTraining`).

The task is that of :mod:`iclab.tasks.linreg`: x_n ~ N(0, Λ), w ~ N(0, I), y_n = wᵀx_n, N context
pairs and a query; the loss is the mean squared query error (no ½). The engines, on the shared time
axis t = Σ lr:

- ``population``: descent on the exact expected loss L(A) = E(y_q − βᵀA x_q)² of the family's effective
  matrix A(θ) (:func:`population_objective`; :func:`iclab.theory.linattn.population_loss` with E(1/N) by
  default), by gradient descent (``integrator="gd"``) or gradient flow dθ/dt = −∇L (``"gf"``, its
  small-lr limit, integrated with diffrax);
- ``moments``: exact full-batch GD on P prompts from their sufficient statistics (:mod:`iclab.engines.moments`,
  or its compiled kernels, ``backend="native"``), for families linear in a fixed feature;
- ``sampled``: full-batch GD on the same P prompts through the family's own prediction (any family).

Seed s (key_s = fold_in(PRNGKey(seed), s)) initialises with fold_in(key_s, 1) and draws its P training
prompts with fold_in(key_s, 2), so the moments and sampled engines see the same data and follow the
same trajectory (to rounding).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from iclab.engines import moments, moments_native, population, sampled
from iclab.engines._descent import Schedule
from iclab.engines._loop import Trajectory
from iclab.errors import ConfigError, describe_validation_error
from iclab.models import get_model
from iclab.models.linattn import cubic_feature, cubic_feature_from_moments
from iclab.progress import Reporter, task
from iclab.tasks.linreg import Prompts, sample_prompts, sample_query_moments
from iclab.ops import backend
from iclab.tasks.linreg import population_loss

__all__ = ["Engine", "Form", "Integrator", "LinregSettings", "LinregTraining", "MomentsBackend", "Statistics", "init_params",
           "population_objective", "prompt_statistics", "train"]

Form = Literal["reduced", "full"]
Engine = Literal["population", "moments", "sampled"]
#: How the population engine moves: gradient descent (any optax optimiser, t = Σ lr) or gradient flow
#: dθ/dt = −∇L(θ) (diffrax, Dopri8 with PID step control), the small-lr limit of plain GD.
Integrator = Literal["gd", "gf"]
#: How the moments engine runs its steps: through XLA (any family, any optax optimiser), the compiled
#: kernels of :mod:`iclab.engines.moments_native` (reduced attn_s, attn_m and mlp, plain GD, faster per
#: step on a CPU), or ``auto``: the kernels where the run's backend is ``native`` (:func:`iclab.engines.backend`)
#: and they apply, else XLA. Both follow the same trajectory to rounding.
MomentsBackend = Literal["auto", "xla", "native"]
#: How the moments engine's statistics are drawn: from the prompts (the sampled engine's data) or
#: (β, x_q, y_q) from their exact joint law (:func:`iclab.tasks.linreg.sample_query_moments`).
Statistics = Literal["prompts", "direct"]
#: An expected loss of the effective matrix: (A (D, D), Λ (D, D)) -> scalar.
ExpectedLoss = Callable[[jax.Array, jax.Array], jax.Array]


class LinregSettings(BaseModel):
    """The settings of a training run that an experiment chooses: sizes, init, GD, data and integrator tolerances.

    Each is declared here once, with its type, bounds and meaning. An experiment's config takes the ones it
    exposes, with its own default and the paper's value (:func:`iclab.experiments.engine_fields`), and
    :meth:`LinregTraining.of` reads them back; the per-run choices (model, engine, form, backend, ...) are
    :class:`LinregTraining`'s own fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    H: int = Field(ge=1, le=100_000, description="attention heads H (= hidden units of the MLP)")
    R: int = Field(1, ge=1, le=1024, description="rank R of each ATTN_S head")
    w_init: float = Field(gt=0, le=1e3, description="init scale w_init of eqs 34/36 (layer norms ≈ w_init)")
    lr: float = Field(gt=0, le=1e6, description="GD learning rate η (paper convention, with 1/N inside the attention)")
    steps: int = Field(ge=0, le=10**9, description="GD steps (gradient flow: the run lasts t = steps·lr)")
    record_every: int = Field(1, ge=1, le=10**9, description="record the trajectory every this many steps (gradient "
                                                             "flow: every record_every·lr in time)")
    P: int | None = Field(None, ge=1, le=10**9, description="training prompts (moments and sampled engines)")
    full_scale: float = Field(0.0, ge=0, le=1e3, description="std of the full-matrix blocks that never reach ŷ_q")
    rho: float = Field(1.0, gt=0, le=1e6, description="softmax temperature ρ (families with a 'rho' option)")
    rtol: float = Field(1e-10, gt=0, lt=1, description="gradient flow: relative tolerance of the step-size control")
    atol: float = Field(1e-12, gt=0, lt=1, description="gradient flow: absolute tolerance of the step-size control")


class LinregTraining(LinregSettings):
    """What :func:`train` trains and how: the settings (:class:`LinregSettings`: sizes, init, GD) and the
    per-run choices (model family, engine, form, backend, integrator, recorded params).

    Every combination is checked here, so a bad one is one line naming the field and what is allowed
    (:class:`iclab.ConfigError`) before anything runs. :meth:`of` builds one from a config that carries the
    settings.
    """

    def __init__(self, **fields):
        try:
            super().__init__(**fields)
        except ValidationError as err:
            raise ConfigError(f"training specification: {describe_validation_error(err, type(self))}") from None

    model: str = Field(description="a registered model family of task 'linreg' (iclab.models.model_families('linreg'))")
    engine: Engine = Field(description="population (exact expected loss), moments (exact full-batch GD from "
                                       "sufficient statistics) or sampled (full-batch GD on the prompts)")
    form: Form = Field("reduced", description="reduced (the blocks that reach ŷ_q) or full-matrix weights")
    backend: MomentsBackend = Field("auto", description="moments engine: auto (the run's backend where the compiled "
                                    "kernels apply), xla, or the compiled native kernels")
    unroll: int = Field(1, ge=1, le=1024, description="steps unrolled per compiled loop iteration (xla)")
    integrator: Integrator = Field("gd", description="population engine: gradient descent (gd) or gradient flow (gf)")
    record_params: bool = Field(False, description="record the params at every record")

    @classmethod
    def of(cls, config: BaseModel, **choices) -> "LinregTraining":
        """The specification of one run from a config and the run's choices.

        Every field of the config whose name is a field of this class (the settings an experiment's config
        takes from :class:`LinregSettings`, or a choice such as ``engine`` it exposes) is read from it; ``choices``
        give the rest and replace a config's value for this run (e.g. ``R`` of one column of a rank sweep,
        ``P=None`` for the population engine).

        Args:
            config: any pydantic model (an experiment's config).
            choices: LinregTraining fields of this run (model, engine, form, integrator, ...).
        Returns:
            The validated specification (:class:`iclab.ConfigError` if the combination is refused).
        """
        taken = {name: getattr(config, name) for name in type(config).model_fields if name in cls.model_fields}
        return cls(**{**taken, **choices})

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
        if self.integrator == "gf" and self.engine != "population":
            raise ValueError(f"integrator 'gf' (gradient flow) is the population engine's (got engine {self.engine!r})")
        return self

    def native_moments(self, *, plain_gd: bool = True) -> bool:
        """Whether the moments engine runs by the compiled kernels: ``native``, or ``auto`` under the native backend
        where they apply (the reduced attn_s, attn_m and mlp, plain GD at the constant lr).

        Args:
            plain_gd: whether the run is plain GD at the constant ``lr`` (no optimiser, no schedule).
        """
        if self.backend != "auto":
            return self.backend == "native"
        return (backend() == "native" and plain_gd and self.engine == "moments" and self.form == "reduced"
                and self.model in moments_native.NATIVE_MODELS)

    def family(self):
        """The registered family trained (its full-matrix form when ``form == "full"``).

        Returns:
            The :class:`iclab.models.ModelFamily`.
        """
        family = get_model(self.model)
        return get_model(family.full_form) if self.form == "full" else family


def init_params(spec: LinregTraining, key: jax.Array, D: int):
    """One model's initial params: the family's init (eqs 34/36 for the attention models).

    Args:
        spec: the training specification (family, H, R, w_init, form, full_scale).
        key: the init key (:func:`train` uses fold_in(key_s, 1)).
        D: input dimension.
    Returns:
        The params pytree of one model (no seed axis).
    """
    sizes = dict(D=D, H=spec.H, R=spec.R, w_init=spec.w_init)
    if spec.form == "full":
        sizes["full_scale"] = spec.full_scale
    return spec.family().init(key, **sizes)


def population_objective(spec: LinregTraining, *, expected_loss: ExpectedLoss | None = None):
    """The population engine's objective: the exact expected loss of the family's effective matrix.

    L(θ) = expected_loss(A(θ), Λ); by default the fixed-length query loss (eqs 30-31)
    L(A) = trΛ − 2 tr(AΛ²) + tr(Aᵀ E[Λ̂²] A Λ), E[Λ̂²] = Λ² + E(1/N)(Λ + trΛ·I)Λ
    (:func:`iclab.theory.linattn.population_loss`).

    Args:
        spec: the training specification; its family must have an effective matrix.
        expected_loss: another closed-form expected loss of A, (A, Λ) -> scalar (e.g. the next-token loss
            of linattn Fig 7); it then ignores ``aux["inv_N"]``.
    Returns:
        ``loss(params, aux)`` of one model, with aux = {"Lam": Λ (D, D), "inv_N": E(1/N) ()} (the aux of
        :func:`train`, per seed).
    """
    family = spec.family()
    if family.effective_matrix is None:
        raise ValueError(f"model {family.name!r} has no effective matrix, hence no closed-form expected loss")
    effective = family.effective_matrix
    if expected_loss is None:
        def loss(params, aux):
            return population_loss(effective(params), aux["Lam"], aux["inv_N"])
    else:
        def loss(params, aux):
            return expected_loss(effective(params), aux["Lam"])
    return loss


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


def _check_arguments(spec: LinregTraining, keys, params0, optimizer, lr, stats, prompts, ts, extra) -> None:
    """The run-time arguments of :func:`train` against its spec (the spec validated itself)."""
    if stats is not None and spec.engine != "moments":
        raise ValueError("precomputed stats are for engine='moments' only")
    if stats is not None and spec.P is not None and spec.P != stats.P:
        raise ValueError(f"P = {spec.P} differs from the P = {stats.P} of the given stats")
    if prompts is not None and spec.engine != "sampled":
        raise ValueError("given training prompts are for engine='sampled' only (the moments engine takes their stats)")
    if prompts is not None and prompts.y_q.shape[-1] != spec.P:
        raise ValueError(f"P = {spec.P} differs from the {prompts.y_q.shape[-1]} given prompts per seed")
    if spec.backend == "native" and (optimizer is not None or lr is not None):
        raise ValueError("backend 'native' runs plain GD at the constant spec.lr only")
    if spec.integrator == "gf" and (optimizer is not None or lr is not None):
        raise ValueError("gradient flow has no optimiser and no learning-rate schedule")
    if ts is not None and spec.integrator != "gf":
        raise ValueError("record times ts are for gradient flow (integrator='gf') only")
    drawn = spec.engine != "population" and stats is None and prompts is None
    if keys is None and (params0 is None or drawn):
        raise ValueError("keys are needed to draw the init (no params0) or the training prompts (no stats or prompts)")
    if extra is not None and {"Lam", "inv_N"} & set(extra):
        raise ValueError("extra must not redefine 'Lam' or 'inv_N'")


def train(
    spec: LinregTraining,
    *,
    Lams: jax.Array,
    N: int,
    keys: jax.Array | None = None,
    params0: Any = None,
    optimizer: optax.GradientTransformation | None = None,
    lr: Schedule | None = None,
    stats: moments.SufficientStatistics | None = None,
    prompts: Prompts | None = None,
    ts: np.ndarray | None = None,
    expected_loss: ExpectedLoss | None = None,
    metrics: dict[str, Callable[[Any, dict], jax.Array]] | None = None,
    extra: dict | None = None,
    reporter: Reporter | None = None,
    label: str = "",
) -> Trajectory:
    """Trains ``spec.model`` from its init for each seed (vmapped) and returns its Trajectory.

    ``loss`` is the objective of the engine (exact expected loss for ``population``, the training loss on
    P prompts for ``moments`` and ``sampled``, which give the same trajectory); for families with an
    effective matrix, the moments and sampled engines also record ``metrics["population"]``, the exact
    expected loss of the current weights (:func:`population_objective`).

    Args:
        spec: what to train and how (validated).
        Lams: (S, D, D) input covariances Λ.
        N: context pairs per prompt (E(1/N) = 1/N in the population loss).
        keys: (S, 2) seed keys; seed s initialises with fold_in(key_s, 1) and draws its prompts with
            fold_in(key_s, 2). Not needed when ``params0`` and the data (``stats``, ``prompts``, or none for
            the population engine) are given.
        params0: initial params with a leading seed axis S, replacing the family's init (e.g. an init
            sweep or an aligned init).
        optimizer: the update direction, an optax GradientTransformation without learning rate (None:
            plain GD, the papers' procedure); not with ``backend="native"`` or gradient flow.
        lr: a learning-rate schedule replacing ``spec.lr`` (t = Σ lr); not with ``backend="native"`` or
            gradient flow.
        stats: the :func:`prompt_statistics` of the training prompts (moments engine), computed once and
            shared by several runs on the same data (e.g. a rank sweep); P is then ``stats.P``.
        prompts: the training prompts (sampled engine), leading seed axis, instead of drawing them.
        ts: gradient flow only: record times, increasing from 0, replacing the grid
            linspace(0, steps·lr, steps // record_every + 1) (spec.steps, lr, record_every then unused).
        expected_loss: the closed-form expected loss (A, Λ) -> scalar of the population engine and of
            the "population" metric, replacing the fixed-N loss (see :func:`population_objective`).
        metrics: more {name: fn(params, aux)} to record, with aux = {"Lam", "inv_N"} and ``extra``
            (per seed); with ``backend="native"`` they are read off the recorded params.
        extra: per-seed constants of the metrics (leading seed axis), e.g. test-set statistics.
        reporter: progress reporter (None: silent); label: the task's name.
    Returns:
        The Trajectory (records on t = Σ lr; for gradient flow at ``ts``, step = NaN).
    """
    _check_arguments(spec, keys, params0, optimizer, lr, stats, prompts, ts, extra)
    family = spec.family()
    if expected_loss is not None and family.effective_matrix is None:
        raise ValueError(f"expected_loss needs an effective matrix; {family.name} has none")
    S, D = Lams.shape[0], Lams.shape[-1]
    if params0 is None:
        # One compiled init instead of op-by-op dispatch of the vmapped sampler (same values to the last bit
        # or two). It runs once, so LLVM optimisation is skipped: it would take seconds to compile.
        params0 = jax.jit(jax.vmap(lambda k: init_params(spec, jax.random.fold_in(k, 1), D)),
                          compiler_options={"xla_backend_optimization_level": 0})(keys)
    aux = {"Lam": Lams, "inv_N": jnp.full((S,), 1.0 / N), **(extra or {})}
    objective = (population_objective(spec, expected_loss=expected_loss)
                 if family.effective_matrix is not None else None)
    recorded = dict(metrics or {})
    if objective is not None and spec.engine != "population":
        recorded = {"population": objective, **recorded}
    common = dict(lr=spec.lr if lr is None else lr, n_steps=spec.steps, record_every=spec.record_every,
                  record_params=spec.record_params, batched=True, optimizer=optimizer)
    if spec.engine == "population" and spec.integrator == "gf":
        ts = np.linspace(0.0, spec.steps * spec.lr, spec.steps // spec.record_every + 1) if ts is None else ts
        with task(reporter, label or f"population {spec.model} (gf)", len(ts) - 1) as cb:  # counts records
            return population.gradient_flow(objective, params0, aux, t_max=float(ts[-1]), ts=ts, rtol=spec.rtol,
                                            atol=spec.atol, metrics=recorded, record_params=spec.record_params,
                                            batched=True, callback=cb)
    with task(reporter, label or f"{spec.engine} {spec.model}", spec.steps) as cb:
        if spec.engine == "population":
            return population.gradient_descent(objective, params0, aux, metrics=recorded, callback=cb, **common)
        if spec.engine == "moments":
            st = stats if stats is not None else prompt_statistics(keys, Lams, N, spec.P, feature=family.feature)
            if spec.native_moments(plain_gd=optimizer is None and lr is None):
                tr = moments_native.full_batch(spec.model, params0, st, lr=spec.lr, n_steps=spec.steps,
                                               record_every=spec.record_every, record_params=True, batched=True,
                                               callback=cb)
                # the XLA loop records the metrics as it goes; here they are read off the recorded weights
                read = {name: np.asarray(jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, None))))(tr.params, aux))
                        for name, fn in recorded.items()}
                return tr._replace(metrics=read, params=tr.params if spec.record_params else None)
            return moments.full_batch(family.tensor, params0, st, metrics=recorded, extra=aux, callback=cb,
                                      unroll=spec.unroll, **common)
        if prompts is None:
            prompts = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, spec.P))(keys, Lams)
        options = {"rho": spec.rho} if "rho" in family.options else {}

        def train_loss(p, d):
            return jnp.mean((d["prompts"].y_q - family.predict(p, d["prompts"], **options)) ** 2)

        carry = {"prompts": prompts, "pop": aux}
        sampled_metrics = {k: (lambda p, d, f=f: f(p, d["pop"])) for k, f in recorded.items()}
        return sampled.full_batch(train_loss, params0, carry, metrics=sampled_metrics, callback=cb, **common)
