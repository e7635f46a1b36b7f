"""What the floor reads from a DeepSpeed JSON config (a plain dict): its precision and its ZeRO stage.
training/ds_config.py reads and reconciles the whole file."""
from __future__ import annotations

from typing import Any


def precision(ds: dict[str, Any]) -> str:
    if ds.get("bf16", {}).get("enabled"):
        return "bf16"
    if ds.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
