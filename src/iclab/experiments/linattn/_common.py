"""Shared pieces of the linattn experiments: the Λ config, each seed's key and covariance, and the
training specifications (:class:`iclab.engines.linreg.LinregTraining`) built from a figure's config.

Every figure trains through :func:`iclab.engines.linreg.train`. Its config takes the training settings it
exposes (H, w_init, lr, steps, P, ...) from :class:`iclab.engines.linreg.LinregSettings` with
:func:`iclab.experiments.engine_fields` (declared once, in the engine), builds the specifications of its runs
in a method from itself and each run's choices, and checks them in a validator (:func:`training_spec`), so a
combination the engine cannot run is a config error before anything runs.

Time axis: t = Σ lr of GD on the mean squared query loss; the paper's time is t/τ = 2t (derived here: the
gradient flow τ dW/dt = −½ ∂L/∂W of eq 5 is the small-lr limit of GD on L). Models use the paper convention
(1/N inside the attention); learning rates of the reference code, which has no 1/N, map to ours by
η = N·η_ref for ATTN_M and η = N^{2/3}·η_ref for ATTN_S, which keeps its step axis (derived here: the reference
model is the paper's with weights × √N for ATTN_M and × N^{1/3} for ATTN_S).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import model_validator

from iclab.engines import seed_keys
from iclab.engines.linreg import LinregTraining
from iclab.errors import ConfigError
from iclab.experiments._config import ExperimentConfig, param, validate_eigenvalues
from iclab.experiments._memory import FLOAT64, Term
from iclab.tasks.linreg import Spectrum, covariance, spectrum_eigenvalues

PAPER = "linattn"


class CovarianceConfig(ExperimentConfig):
    """Λ from explicit eigenvalues or a named spectrum, optionally rotated (Sec 2.1)."""

    D: int = param(4, "input dimension D", paper=4, ge=1, le=64)
    eigenvalues: list[float] | None = param(
        None, "eigenvalues of Λ (length D, all finite and > 0); null: use `spectrum`",
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

    @model_validator(mode="after")
    def _eigenvalues(self):
        validate_eigenvalues(self.eigenvalues, self.D, "D")
        return self

    def lambdas(self) -> np.ndarray:
        """The eigenvalues of Λ, decreasing."""
        if self.eigenvalues is not None:
            return np.sort(np.asarray(self.eigenvalues, dtype=float))[::-1]
        return spectrum_eigenvalues(self.spectrum, self.D)


def keys_and_covariances(config: CovarianceConfig) -> tuple[jax.Array, jax.Array]:
    """Each seed's key, fold_in(PRNGKey(seed), s) (:func:`iclab.engines.seed_keys`), and its Λ.

    Returns:
        keys (S, 2) and Λ (S, D, D): shared unless ``rotate``, then seed s rotates its own with
        fold_in(key_s, 7).
    """
    keys = seed_keys(config.seed, config.seeds)
    return keys, covariances(config, keys)


def covariances(config: CovarianceConfig, keys: jax.Array) -> jax.Array:
    """Λ for each seed, (S, D, D): shared unless ``rotate`` (then each seed rotates its own)."""
    lam = config.lambdas()
    if not config.rotate:
        return jnp.broadcast_to(covariance(lam), (keys.shape[0], config.D, config.D))
    return jnp.stack([covariance(lam, jax.random.fold_in(k, 7)) for k in keys])


def prompts_memory(config) -> tuple[float, str]:
    """The largest memory of a run that trains on P prompts held at once (the sampled engine): the float64
    prompts, P·(N+1)·(D+1) per seed, and the per-head scores, P·(N+1)·H, times 4 for the forward values and
    gradients autodiff keeps (an upper estimate, checked before anything runs: ``Experiment.memory``).

    Args:
        config: a linattn config with seeds, P, N, D (and H, or H_m for two-model figures).
    Returns:
        (bytes, what they are).
    """
    H = getattr(config, "H", None) or getattr(config, "H_m", 1)
    need = 8.0 * 4 * config.seeds * config.P * (config.N + 1) * (config.D + 1 + H)
    return need, f"the P·(N+1)·(D+1+H) float64 prompts, scores and gradients of {config.seeds} seed(s)"


def statistics_memory(*, seeds: int, P: int, N: int, D: int, statistics: str = "prompts",
                      chunk: int = 8192) -> list[Term]:
    """The terms of the moments engine's statistics pass (:func:`iclab.engines.linreg.prompt_statistics`).

    Seeds are drawn one after the other, each in one compiled pass: its P prompts at once, P·(N+1)·(D+1)
    float64 numbers (``statistics="prompts"``: the normal draw, the inputs x = Λ^{1/2}z and the labels, 3 copies)
    or P·(N+4D) (``"direct"``: the N normals of each prompt's χ² and its β, x_q, w, 3 copies); the cubic
    feature F = D² of ``chunk`` prompts at a time; then c, m, G of every seed, S·F² (stacked, and the training
    loop's constant: 3 copies).

    Args:
        seeds: S; P: prompts per seed; N: context pairs; D: input dimension; statistics: "prompts" or "direct";
        chunk: prompts per feature block.
    Returns:
        [(bytes, what)] terms for :func:`iclab.experiments._memory.total`.
    """
    F = D * D
    if statistics == "direct":
        draw = (3.0 * FLOAT64 * P * (N + 4 * D), "the P·(N+4D) float64 normals of one seed's statistics draw (direct)")
    else:
        draw = (3.0 * FLOAT64 * P * (N + 1) * (D + 1), "the P·(N+1)·(D+1) float64 prompts of one seed's statistics "
                                                       "pass")
    return [draw,
            (3.0 * FLOAT64 * min(P, chunk) * F, "a chunk of cubic features"),
            (3.0 * FLOAT64 * seeds * (F * F + F + 1), f"the D²×D² moment matrices G of {seeds} seed(s)")]


def training_spec(config, **choices) -> LinregTraining:
    """The :class:`LinregTraining` of one run: the settings the config takes from the engine, and the run's
    choices (:meth:`LinregTraining.of`); a combination it refuses is a one-line ValueError, which a config's
    validator turns into its own validation error.

    Args:
        config: a figure's config.
        choices: the run's LinregTraining fields (model, engine, ...), replacing the config's where both give one.
    Returns:
        The validated specification.
    """
    try:
        return LinregTraining.of(config, **choices)
    except ConfigError as err:  # one line already ("training specification: …"); a ValueError for the validator
        raise ValueError(str(err)) from None
