"""Shared pieces of the linattn experiments: Λ config, seeds, and one training entry point.

Time axis: t = Σ lr of GD on the mean squared query loss; the paper's time is t/τ = 2t (spec §4).
Models use the paper convention (1/N inside the attention); learning rates of the reference code,
which has no 1/N, map to ours by η = N·η_ref for ATTN_M and η = N^{2/3}·η_ref for ATTN_S
(spec §4), which keeps its step axis.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import field_validator, model_validator

from iclab.engines import moments, population, sampled
from iclab.experiments._config import ExperimentConfig, param
from iclab.models import linattn as models
from iclab.tasks.linreg import Spectrum, covariance, sample_prompts, spectrum_eigenvalues
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

Model = Literal["attn_m", "attn_s", "mlp"]
Form = Literal["reduced", "full"]
Engine = Literal["population", "moments", "sampled"]

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


def init_params(model: Model, key, D: int, H: int, R: int, w_init: float, form: Form = "reduced",
                full_scale: float = 0.0):
    """Eq 34/36 init of one seed; the MLP starts from the same function as ATTN_M (eq 7).

    For the full-matrix form the blocks that never reach ŷ_q are N(0, full_scale²) (0: zeros)."""
    if model == "attn_s":
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
):
    """Trains ``model`` from eq-34/36 init for each seed (vmapped) and returns its Trajectory.

    ``loss`` is the objective of the engine (exact expected loss for ``population``, the training
    loss on P prompts for ``moments`` and ``sampled``, which give the same trajectory); for the
    reduced forms ``metrics["population"]`` is the exact expected loss of the current weights.
    Seed s uses fold_in(key_s, 1) for init and fold_in(key_s, 2) for its P training prompts.
    """
    S, D = Lams.shape[0], Lams.shape[-1]
    inv_N = 1.0 / N
    params0 = jax.vmap(lambda k: init_params(model, jax.random.fold_in(k, 1), D, H, R, w_init, form, full_scale))(keys)
    aux = {"Lam": Lams, "inv_N": jnp.full((S,), inv_N)}
    effective = _EFFECTIVE[model]

    def pop_loss(params, a):
        return theory.population_loss(effective(params), a["Lam"], a["inv_N"])

    common = dict(lr=lr, n_steps=steps, record_every=record_every, record_params=record_params, batched=True)
    desc = label or f"{engine} {model}"
    with (reporter.task(desc, steps) if reporter is not None else contextlib.nullcontext()) as cb:
        if engine == "population":
            if form != "reduced":
                raise ValueError("the population engine has the closed-form loss of the reduced forms only")
            return population.gradient_descent(pop_loss, params0, aux, callback=cb, **common)
        if P is None:
            raise ValueError(f"engine {engine} needs P training prompts")
        data = jax.vmap(lambda k, L: sample_prompts(jax.random.fold_in(k, 2), L, N, P))(keys, Lams)
        metrics = {}
        if engine == "moments":
            feature = models.full_feature if form == "full" else models.cubic_feature
            stats = [moments.sufficient_statistics(feature(jax.tree_util.tree_map(lambda a: a[s], data)), data.y_q[s])
                     for s in range(S)]
            st = moments.SufficientStatistics(*(jnp.stack([getattr(x, f) for x in stats]) for f in ("c", "m", "G")), P)
            if form == "reduced":
                metrics["population"] = pop_loss
            return moments.full_batch(_TENSOR[(model, form)], params0, st, metrics=metrics, extra=aux,
                                      callback=cb, **common)
        predict = _PREDICT[(model, form)]
        carry = {"prompts": data, "pop": aux}
        if form == "reduced":
            metrics["population"] = lambda p, d: pop_loss(p, d["pop"])
        return sampled.full_batch(lambda p, d: jnp.mean((d["prompts"].y_q - predict(p, d["prompts"])) ** 2),
                                  params0, carry, metrics=metrics, callback=cb, **common)

