"""Per-step hooks the trainer runs after each optimizer step (e.g. the expert lifecycle manager)."""
from __future__ import annotations

from typing import Any

from torch import nn


def after_optimizer_step(model: nn.Module, engine: Any, step: int) -> list[dict]:
    """Run every module's `after_optimizer_step(step, engine)` hook; returns their events for the monitor."""
    events: list[dict] = []
    for module in model.modules():
        hook = getattr(module, "after_optimizer_step", None)
        if callable(hook) and module is not model:
            events.extend(hook(step, engine) or [])
    return events
