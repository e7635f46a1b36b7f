"""What the floor reads from a DeepSpeed JSON config (a plain dict): its precision and its ZeRO stage; the error a
bad one raises. training/ds_config.py reads and reconciles the whole file, ds_validation.py has DeepSpeed check it."""
from __future__ import annotations

from typing import Any

from moep_ds.errors import SharedUserError


class DeepSpeedConfigError(SharedUserError):
    """A bad --ds_config or a conflict with the recipe: every rank reads the same, so rank 0 reports it."""


def precision(ds: dict[str, Any]) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
