"""Experiment configs: pydantic models whose fields carry a description, bounds, and the paper's value.

Use :func:`param` for every field: ``paper=`` records what the paper (or its reference code)
uses, so ``iclab show`` can print it beside our default; ``paper_note=`` says where it comes from
or that the paper leaves it unspecified.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field

UNSPECIFIED = "unspecified"


def param(default: Any, description: str, *, paper: Any = None, paper_note: str | None = None, **bounds: Any) -> Any:
    """A config field with its meaning, bounds (ge/gt/le/lt), and the paper's value."""
    extra = {"paper": paper, "paper_note": paper_note}
    return Field(default, description=description, json_schema_extra=extra, **bounds)


class ExperimentConfig(BaseModel):
    """Fields shared by every experiment: the base seed and the number of seeds run (vmapped)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    seed: int = param(0, "base PRNG seed; seed s of a run uses fold_in(PRNGKey(seed), s)", ge=0, le=2**31 - 1)
    seeds: int = param(1, "number of independent seeds (init and data), run together with vmap", ge=1, le=1024)


def field_rows(config_cls: type[BaseModel], presets: dict[str, dict]) -> list[dict]:
    """One row per config field: name, type, description, bounds, preset values, paper value."""
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
