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

A new family is one file that builds a :class:`ModelFamily` and registers it; see the tutorial "Add a model
family" (``docs/tutorials/model_family.py``: rank-R ATTN_S with a gate per head, trained by every engine and
the joint trainer) and ``tests/models/test_family.py`` (linear attention with a data-independent gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ModelFamily", "check_reduced_forms", "get_model", "model_families", "register_model", "unregister_model"]


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
        target: optional ``batch -> targets`` of the shape of ``predict``'s output, what it is trained to predict
            (None: ``batch.y_q``, the linreg prompts' query label): a family of a task whose batch keeps its
            target elsewhere names it here (e.g. drift's y_{n+1}, ``batch.y[..., -1]``).
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
    target: Callable[[Any], Any] | None = None

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


def check_reduced_forms(family: ModelFamily, *, D: int = 3, N: int = 4, P: int = 6, seed: int = 0,
                        rtol: float = 1e-9) -> None:
    """Checks a linreg family's reduced forms against its own prediction on random params and prompts.

    The population engine trusts ŷ_q = βᵀ A(θ) x_q (β = (1/N) Σ_n y_n x_n) and the moments engine
    ŷ_q = ⟨T(θ), φ(prompt)⟩: a form that disagrees with ``predict`` (a transposed A, a tensor stacked row by row
    where the feature stacks columns) would train another model without a word. Params come from
    ``family.init(key, D=D, H=2, R=1, w_init=0.7)``, prompts from :func:`iclab.tasks.linreg.sample_prompts` with
    a random covariance; float64.

    Args:
        family: the family (only a ``linreg`` family with an effective matrix or a tensor is checked).
        D, N, P: the check's sizes; seed: its keys.
        rtol: tolerance relative to the largest |ŷ| (the forms are exact: rounding only).
    Raises:
        ValueError: one line naming the family and the form that disagrees, and by how much.
    """
    if family.task != "linreg" or (family.effective_matrix is None and family.tensor is None):
        return
    import jax
    import jax.numpy as jnp

    from iclab.tasks.linreg import context_moment, covariance, sample_prompts

    k_params, k_cov, k_prompts = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                                    family.init(k_params, D=D, H=2, R=1, w_init=0.7))
    prompts = sample_prompts(k_prompts, covariance(jnp.linspace(1.0, 0.3, D), k_cov), N, P)
    y = jnp.asarray(family.predict(params, prompts))
    scale = float(jnp.max(jnp.abs(y))) or 1.0
    forms = []
    if family.effective_matrix is not None:
        forms.append(("effective_matrix", jnp.einsum("pi,ij,pj->p", context_moment(prompts),
                                                     family.effective_matrix(params), prompts.x_q)))
    if family.tensor is not None:
        forms.append(("tensor", family.feature(prompts) @ family.tensor(params)))
    for name, via in forms:
        gap = float(jnp.max(jnp.abs(jnp.asarray(via) - y)))
        if not gap <= rtol * scale:
            raise ValueError(f"model family {family.name!r}: its {name} does not reproduce its predict on random "
                             f"params and prompts (largest gap {gap:.3g} against |ŷ| up to {scale:.3g}); "
                             + ("is A transposed?" if name == "effective_matrix" else
                                "is the tensor stacked in the feature's order (column-stacking vec)?"))


def register_model(family: ModelFamily, *, replace: bool = False, check: bool = True) -> ModelFamily:
    """Adds a family to the registry; a second family of the same name needs ``replace=True``.

    Args:
        family: the family.
        replace: allow replacing a registered family of that name (e.g. when a notebook cell reruns).
        check: check a linreg family's reduced forms against its prediction first (:func:`check_reduced_forms`).
    Returns:
        The family, so that a module can write ``FAMILY = register_model(ModelFamily(...))``.
    Raises:
        ValueError: a name taken, or a reduced form that disagrees with the prediction.
    """
    if family.name in _MODELS and not replace and _MODELS[family.name] is not family:
        raise ValueError(f"model family {family.name!r} is registered already (replace=True to replace it)")
    if check:
        check_reduced_forms(family)
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
