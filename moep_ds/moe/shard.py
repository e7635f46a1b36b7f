"""Stacked expert parameters of a shard: which rows of all experts they hold, and initialising them alike.

# E experts of a stage, L = E / size experts held by one process

Which experts a process holds is the `ExpertParallelPlan` its stages are built with (moe/plan.py); a process
never holds all of a stage's experts (at Pythia-1B scale the experts are most of the model). The values are the
ones the unsharded model gets from the same seed: stacked expert modules are made one after another as before
(each expert is dropped at once unless it is held), and a random initialisation of a stacked parameter draws over
all E experts and keeps its rows (`normal_`): one parameter's worth of experts exists for a moment, never the
model.
"""
from __future__ import annotations

import torch
from torch import nn

EXPERT_ROWS = "expert_rows"  # attribute of a stacked expert parameter: (global index of its row 0, all experts)


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's shape, also when ZeRO-3 holds only a partition of it (`ds_shape`)."""
    return getattr(p, "ds_shape", p.shape)


def mark_expert_rows(p: nn.Parameter, first: int, num_experts: int) -> nn.Parameter:
    """Record that p's rows are experts [first, first + len(p)) of `num_experts`."""
    setattr(p, EXPERT_ROWS, (first, num_experts))
    return p


@torch.no_grad()
def normal_(p: torch.Tensor, std: float) -> torch.Tensor:
    """`nn.init.normal_(p, std=std)`; a stacked expert shard gets its rows of one draw over all the experts,
    so that every expert-parallel size initialises an expert alike."""
    first, total = getattr(p, EXPERT_ROWS, (0, len(p) if p.dim() else 1))
    if p.dim() == 0 or total == len(p):
        return nn.init.normal_(p, std=std)
    draw = torch.empty((total, *p.shape[1:]), dtype=p.dtype, device=p.device).normal_(std=std)
    return p.copy_(draw[first : first + len(p)])


__all__ = ["EXPERT_ROWS", "full_shape", "mark_expert_rows", "normal_"]
