"""Per-step hooks the trainer runs after each optimizer step (e.g. the expert lifecycle manager)."""
from __future__ import annotations

from typing import Any

from torch import nn

from moep_ds.training.lifecycle_state import lifecycle_after_step


def after_optimizer_step(model: nn.Module, engine: Any, step: int) -> list[dict]:
    """Run the expert lifecycle managers of the model (if any); returns their events for the monitor."""
    return lifecycle_after_step(model, engine)
