"""Routing state kept alike on every rank after each optimizer step (the RouterThresholdSync callback,
training/callbacks/builtin.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.expert_choice import ExpertChoiceRouter


@torch.no_grad()
def sync_router_thresholds(model: nn.Module) -> None:
    """Average expert-choice thresholds over the data-parallel ranks: each rank's EMA sees only its own
    tokens, and evaluation must route the same way whichever rank's copy is saved. All routers' buffers
    travel in one flat all-reduce (one collective per step, not one per buffer)."""
    world = dist.get_world_size()
    if world == 1:
        return
    buffers = [b for m in model.modules() if isinstance(m, ExpertChoiceRouter) for b in m.buffers()
               if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1).to(torch.float64) for b in buffers])
    dist.all_reduce(flat)
    flat /= world
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(value.view_as(b))
