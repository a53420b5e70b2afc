"""Experiment configs: pydantic models whose fields carry a description, bounds, and the paper's value.

Use :func:`param` for every field: ``paper=`` records what the paper (or its reference code)
uses, so ``iclab show`` can print it beside our default; ``paper_note=`` says where it comes from
or that the paper leaves it unspecified.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ExperimentConfig", "TrainingConfig", "field_rows", "param", "validate_eigenvalues"]

UNSPECIFIED = "unspecified"


def param(default: Any, description: str, *, paper: Any = None, paper_note: str | None = None, **bounds: Any) -> Any:
    """A config field with its meaning, bounds (ge/gt/le/lt), and the paper's value.

    Args:
        default: our default value.
        description: what the field is, in the paper's terms.
        paper: the paper's (or its reference code's) value; None when it gives none.
        paper_note: where the paper's value comes from, or that the paper leaves it unspecified.
        bounds: pydantic bounds (ge, gt, le, lt), shown by ``iclab show`` and in every error message.
    Returns:
        A pydantic ``Field``.
    """
    extra = {"paper": paper, "paper_note": paper_note}
    return Field(default, description=description, json_schema_extra=extra, **bounds)


class ExperimentConfig(BaseModel):
    """Fields shared by every experiment: the base seed and the number of seeds run (vmapped).

    Every config refuses unknown fields, NaN and ±inf in any float field or list element, booleans given
    for numbers (``--set N=true`` is an error, not N = 1) and strings given for numbers (``{"H": "7"}`` from
    Python is an error, not H = 7: the CLI reads ``--set H=7`` as the number already).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data):
        if isinstance(data, dict):
            for name, value in data.items():
                info = cls.model_fields.get(name)
                if info is not None and _contains_bool(value) and not _admits_bool(info.annotation):
                    kind = "hold numbers, not booleans" if isinstance(value, (list, tuple)) else "be a number, not a boolean"
                    raise ValueError(f"{name} must {kind} (got {json.dumps(value)[:80]})")
                if info is not None and _contains_str(value) and not _admits_str(info.annotation):
                    kind = "hold numbers, not strings" if isinstance(value, (list, tuple)) else "be a number, not a string"
                    raise ValueError(f"{name} must {kind} (got {json.dumps(value, default=repr)[:80]})")
        return data

    seed: int = param(0, "base PRNG seed; seed s of a run uses fold_in(PRNGKey(seed), s)", ge=0, le=2**31 - 1)
    seeds: int = param(1, "number of independent seeds (init and data), run together with vmap", ge=1, le=1024)


def _contains_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, (list, tuple)) and any(_contains_bool(v) for v in value)


def _contains_str(value) -> bool:
    if isinstance(value, (str, bytes)):
        return True
    return isinstance(value, (list, tuple)) and any(_contains_str(v) for v in value)


def _admits_str(annotation) -> bool:
    """Whether a field's type takes strings anywhere in it (str, a Literal of strings, a path, or a container or
    union of one)."""
    if annotation is Any or (isinstance(annotation, type) and issubclass(annotation, (str, os.PathLike))):
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in get_args(annotation))
    return any(_admits_str(a) for a in get_args(annotation) if a is not Ellipsis)


def _admits_bool(annotation) -> bool:
    """Whether a field's type takes booleans (bool itself, a Literal of booleans, or a union with one)."""
    if annotation is bool:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(a, bool) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return any(_admits_bool(a) for a in get_args(annotation))
    return annotation is Any


def validate_eigenvalues(values: list[float] | None, size: int, size_name: str) -> list[float] | None:
    """Checks a list of covariance eigenvalues: all finite and > 0, ``size`` of them (None passes).

    Args:
        values: the eigenvalues, or None (a config's default spectrum).
        size: the input dimension they must match.
        size_name: that dimension's field name (``D`` or ``d``), named in the error.
    Raises:
        ValueError: one line naming what is wrong.
    """
    if values is None:
        return None
    if len(values) == 0 or any(not (0 < v < float("inf")) for v in values):
        raise ValueError("eigenvalues must all be finite and > 0")
    if len(values) != size:
        raise ValueError(f"eigenvalues must have {size_name} = {size} entries (got {len(values)})")
    return values


class TrainingConfig(ExperimentConfig):
    """An optimiser on the shared time axis t = Σ lr: steps, learning rate and schedule, the optax update
    direction, per-model gradient clipping and the training dtype. Papers redeclare the fields whose
    defaults (and paper values) differ."""

    steps: int = param(1000, "optimiser steps", ge=1, le=10_000_000)
    lr: float = param(1e-3, "learning rate (the peak of the schedule)", gt=0, le=100)
    lr_schedule: Literal["constant", "cosine"] = param(
        "constant", "learning-rate schedule: constant, or cosine decay to 0 over the run")
    optimizer: Literal["gd", "adam", "adamw"] = param("adam", "optimiser: plain GD, Adam, or AdamW (decoupled weight decay)")
    b1: float = param(0.9, "Adam β1", ge=0, lt=1)
    b2: float = param(0.999, "Adam β2", ge=0, lt=1)
    weight_decay: float = param(0.0, "AdamW (decoupled) weight decay (optimizer adamw only)", ge=0, le=10)
    clip_norm: float = param(0.0, "clip each model's gradient to this Euclidean norm before the optimiser (0: off)",
                             ge=0, le=1e6)
    dtype: Literal["float32", "float64"] = param("float32", "training dtype (data, weights, gradients)")

    def schedule(self):
        """The learning rate: the float ``lr``, or an optax schedule of the step (cosine decay)."""
        import optax

        return optax.cosine_decay_schedule(self.lr, self.steps) if self.lr_schedule == "cosine" else self.lr

    def transformation(self):
        """The optax update direction without learning rate (engines apply lr themselves)."""
        import optax

        if self.optimizer == "gd":
            return optax.identity()
        adam = optax.scale_by_adam(b1=self.b1, b2=self.b2)
        if self.optimizer == "adam":
            return adam
        return optax.chain(adam, optax.add_decayed_weights(self.weight_decay))

    def jnp_dtype(self):
        """``dtype`` as a jax.numpy dtype."""
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)


def field_rows(config_cls: type[BaseModel], presets: dict[str, dict]) -> list[dict]:
    """One row per config field: name, type, description, bounds, preset values, paper value.

    Args:
        config_cls: an experiment's config class.
        presets: preset name -> field overrides.
    """
    rows = []
    for name, info in config_cls.model_fields.items():
        extra = info.json_schema_extra or {}
        bounds = []
        for meta in info.metadata:
            for attr, sym in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                if getattr(meta, attr, None) is not None:
                    bounds.append(f"{sym} {getattr(meta, attr)}")
        annotation = info.annotation
        if get_origin(annotation) is Literal:
            type_name = "one of " + ", ".join(str(a) for a in get_args(annotation))
        else:
            type_name = getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
        row = {
            "name": name,
            "type": type_name,
            "description": info.description or "",
            "bounds": ", ".join(bounds),
            "default": info.default,
            "paper_value": extra.get("paper"),
            "paper_note": extra.get("paper_note"),
        }
        row["presets"] = {p: config_cls(**v).model_dump(mode="json")[name] for p, v in presets.items()}
        rows.append(row)
    return rows
