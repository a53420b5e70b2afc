"""Shared pieces of the linattn experiments: Λ config, seeds, and one training entry point.

Time axis: t = Σ lr of GD on the mean squared query loss; the paper's time is t/τ = 2t (spec §4).
Models use the paper convention (1/N inside the attention); learning rates of the reference code,
which has no 1/N, map to ours by η = N·η_ref for ATTN_M and η = N^{2/3}·η_ref for ATTN_S
(spec §4), which keeps its step axis.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import field_validator, model_validator

from iclab.experiments._config import ExperimentConfig, param
from iclab.models import linattn as models
from iclab.tasks.linreg import Spectrum, covariance, spectrum_eigenvalues

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
# Transitional wrappers over iclab.engines.linreg (the figures move to it directly).

from iclab.engines.linreg import Engine, Form, LinregTraining, MomentsBackend, Statistics  # noqa: E402
from iclab.engines import linreg as _linreg  # noqa: E402

Model = Literal["attn_m", "attn_s", "mlp", "softmax_attn_m", "softmax_attn_s"]


def init_params(model: Model, key, D: int, H: int, R: int, w_init: float, form: Form = "reduced",
                full_scale: float = 0.0):
    spec = LinregTraining(model=model, engine="sampled", P=1, H=H, R=R, w_init=w_init, lr=1.0, steps=0, form=form,
                          full_scale=full_scale)
    return _linreg.init_params(spec, key, D)


def prompt_statistics(keys, Lams, N: int, P: int, form: Form = "reduced", method: Statistics = "prompts",
                      chunk: int = 8192):
    feature = models.full_feature if form == "full" else models.cubic_feature
    return _linreg.prompt_statistics(keys, Lams, N, P, feature=feature, method=method, chunk=chunk)


def train(model: Model, *, keys, Lams, N: int, H: int, w_init: float, lr: float, steps: int, record_every: int,
          engine: Engine, P: int | None = None, R: int = 1, form: Form = "reduced", full_scale: float = 0.0,
          record_params: bool = False, reporter=None, label: str = "", rho: float = 1.0, stats=None, unroll: int = 1,
          backend: MomentsBackend = "xla"):
    spec = LinregTraining(model=model, engine=engine, H=H, R=R, w_init=w_init, lr=lr, steps=steps,
                          record_every=record_every, P=P if P is not None else (stats.P if stats is not None else None),
                          form=form, full_scale=full_scale, rho=rho, backend=backend, unroll=unroll,
                          record_params=record_params)
    return _linreg.train(spec, keys=keys, Lams=Lams, N=N, stats=stats, reporter=reporter, label=label)
