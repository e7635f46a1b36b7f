"""Per-step hooks the trainer runs after each optimizer step."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.expert_choice import ExpertChoiceRouter
from moep_ds.training.lifecycle_state import lifecycle_after_step


@torch.no_grad()
def sync_router_thresholds(model: nn.Module) -> None:
    """Average expert-choice thresholds over the data-parallel ranks: each rank's EMA sees only its own
    tokens, and evaluation must route the same way whichever rank's copy is saved."""
    world = dist.get_world_size()
    if world == 1:
        return
    for router in (m for m in model.modules() if isinstance(m, ExpertChoiceRouter)):
        for buffer in router.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer)
                buffer.div_(world)


def after_optimizer_step(model: nn.Module, engine: Any, step: int) -> list[dict]:
    """Keep routing state consistent across ranks and run the expert lifecycle managers (returns their events)."""
    sync_router_thresholds(model)
    return lifecycle_after_step(model, engine)
