"""Callbacks the trainer runs after each optimizer step (`after_optimizer_step(step)` returns new events)."""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.expert_choice import ExpertChoiceRouter
from moep_ds.training.lifecycle import ExpertLifecycleCallback


class StepCallback(Protocol):
    def after_optimizer_step(self, step: int) -> list[dict[str, Any]]: ...


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


class RouterThresholdSync:
    def __init__(self, model: nn.Module):
        self.model = model

    def after_optimizer_step(self, step: int) -> list[dict[str, Any]]:
        sync_router_thresholds(self.model)
        return []


def step_callbacks(engine: Any, ep_group: Any = None) -> list[StepCallback]:
    """Keep routing state consistent across ranks, then run the expert lifecycle managers."""
    return [RouterThresholdSync(engine.module), ExpertLifecycleCallback.for_engine(engine, ep_group)]
