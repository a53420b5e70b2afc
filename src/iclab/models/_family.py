"""One protocol for a model family, and the registry that engines and experiments read.

A family is what a model module provides about one architecture: how to initialise it, how it
predicts, and, where it has them, the reduced forms that exact engines use. Registering it
(:func:`register_model`) makes it usable by every engine and experiment that accepts its task:
for ``task="linreg"`` (the prompts of :mod:`iclab.tasks.linreg`), :func:`iclab.engines.linreg.train`
trains it by

- the sampled engine, from ``predict`` alone;
- the population engine (exact expected loss, no sampling), when the prediction is bilinear,
  ŷ_q = βᵀ A(θ) x_q with β = (1/N) Σ_n y_n x_n: ``effective_matrix`` gives A(θ) and
  :func:`iclab.theory.linattn.population_loss` the loss;
- the moments engine (exact full-batch GD from sufficient statistics), when the prediction is linear
  in a fixed feature, ŷ_q = ⟨T(θ), φ(prompt)⟩: ``tensor`` gives T(θ) and ``feature`` φ.

A new family is one file that builds a :class:`ModelFamily` and registers it; see
``tests/models/test_family.py`` for a toy family (linear attention with a data-independent gate)
trained by the population and sampled engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ModelFamily", "get_model", "model_families", "register_model", "unregister_model"]


@dataclass(frozen=True)
class ModelFamily:
    """A model family behind one protocol.

    Attributes:
        name: registry key, e.g. ``"attn_m"``.
        task: the prompt layout ``predict`` reads: ``"linreg"`` (:class:`iclab.tasks.linreg.Prompts`),
            or another task's name for families that their own experiments train.
        init: ``init(key, **sizes) -> params`` of one model; a linreg family takes the keywords
            ``D, H, R, w_init`` (and ignores those it has no use for).
        predict: ``predict(params, prompts, **options) -> ŷ_q`` of shape (P,).
        effective_matrix: optional ``params -> A`` (D, D) with ŷ_q = βᵀ A x_q (linreg: exact population loss).
        tensor: optional ``params -> T`` (F,) with ŷ_q = ⟨T, φ(prompts)⟩ (moments engine).
        feature: the φ of ``tensor``: ``feature(prompts) -> (P, F)``.
        full_form: name of the registered full-matrix family that realises the same predictor (its
            ``init`` takes an extra ``full_scale`` for the blocks that never reach ŷ_q), or None.
        options: names of the keyword options ``predict`` takes (e.g. ``("rho",)``).
        description: one line, in the paper's terms.
    """

    name: str
    task: str
    init: Callable[..., Any]
    predict: Callable[..., Any]
    effective_matrix: Callable[[Any], Any] | None = None
    tensor: Callable[[Any], Any] | None = None
    feature: Callable[[Any], Any] | None = None
    full_form: str | None = None
    options: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"a model family's name must be an identifier (got {self.name!r})")
        if (self.tensor is None) != (self.feature is None):
            raise ValueError(f"model family {self.name}: tensor and feature come together")

    @property
    def engines(self) -> tuple[str, ...]:
        """The linreg engines this family supports: sampled always, population with an effective
        matrix, moments with a tensor."""
        return ("sampled",) + (("population",) if self.effective_matrix is not None else ()) + (
            ("moments",) if self.tensor is not None else ())


_MODELS: dict[str, ModelFamily] = {}


def register_model(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Adds a family to the registry; a second family of the same name needs ``replace=True``.

    Args:
        family: the family.
        replace: allow replacing a registered family of that name (e.g. when a notebook cell reruns).
    Returns:
        The family, so that a module can write ``FAMILY = register_model(ModelFamily(...))``.
    """
    if family.name in _MODELS and not replace and _MODELS[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered already (replace=True to replace it)")
    _MODELS[family.name] = family
    return family


def unregister_model(name: str) -> None:
    """Removes a family from the registry (nothing if none has this name).

    Args:
        name: the family's registry key.
    """
    _MODELS.pop(name, None)


def get_model(name: str) -> ModelFamily:
    """The registered family of this name.

    Args:
        name: the family's registry key.
    Raises:
        KeyError: with the known names, when none is registered under ``name``.
    """
    try:
        return _MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; registered: {', '.join(sorted(_MODELS))}") from None


def model_families(task: str | None = None) -> dict[str, ModelFamily]:
    """Every registered family (of one task), by name.

    Args:
        task: only the families that read this task's prompts (None: all).
    """
    return {k: f for k, f in _MODELS.items() if task is None or f.task == task}
