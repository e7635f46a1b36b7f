"""Which experts this process builds: expert parallelism shards every routed stage at construction.

# E experts of a stage, L = E / size experts held by one process

    with expert_shard(rank, size):   # the trainer, before any tensor of the model exists
        model = build_model(cfg)     # every ExpertStage holds experts [rank*L, (rank+1)*L) only

A process never holds all of a stage's experts (at Pythia-1B scale the experts are most of the model). The
values are the ones the unsharded model gets from the same seed: stacked expert modules are made one after
another as before (each expert is dropped at once unless it is held), and a random initialisation of a stacked
parameter draws over all E experts and keeps its rows (`normal_`): one parameter's worth of experts exists for a
moment, never the model. Parallelism stays outside the model code: the stages read two integers while they are
built, no process group.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from torch import nn

_SHARD: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("expert_shard", default=(0, 1))
EXPERT_ROWS = "expert_rows"  # attribute of a stacked expert parameter: (global index of its row 0, all experts)


@contextlib.contextmanager
def expert_shard(rank: int, size: int) -> Iterator[None]:
    """Routed stages built inside keep experts [rank * E / size, (rank + 1) * E / size) of their E."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"expert shard rank ({rank}) must be in [0, {size})")
    token = _SHARD.set((rank, size))
    try:
        yield
    finally:
        _SHARD.reset(token)


def held_experts(num_experts: int) -> range:
    """Global indices of the experts a stage of `num_experts` built now holds."""
    rank, size = _SHARD.get()
    if num_experts % size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by expert_parallel_size ({size})")
    n = num_experts // size
    return range(rank * n, (rank + 1) * n)


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


__all__ = ["EXPERT_ROWS", "expert_shard", "full_shape", "held_experts", "mark_expert_rows", "normal_"]
