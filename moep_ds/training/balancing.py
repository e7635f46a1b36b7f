"""Loss-free balancing in the trainer: the step's expert counts summed over ranks, the bias update after the
optimizer step; and the count reduction of load_balancing_scope: global.

# E experts of a router, N all balanced routers' experts together

Every router with a selection bias (routing/balancing.py) counts, during the step's forwards, the assignments its
plans made (all micro-batches; a recomputed forward adds nothing). After the optimizer step the trainer sums these
counts over all data-parallel ranks inside its one per-step collective (`TrainModule.reduce_step` packs
`local_counts()` with the losses and flags) and hands the sums to `end_step`, which updates every bias alike on
every rank: the bias stays replicated, and equals a single process's over the same global batches.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.balancing import ExpertBias
from moep_ds.routing.topk import TopKRouter


def expert_biases(model: nn.Module) -> list[tuple[str, ExpertBias]]:
    """(name, bias) of every router with loss-free balancing, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertBias)]


class LossFreeBalancing:
    """All balanced routers of a model: their step counts as one flat vector, and the update from its sum."""

    def __init__(self, model: nn.Module):
        self.biases = [bias for _, bias in expert_biases(model)]

    def local_counts(self) -> torch.Tensor:
        """[N] fp64 this process's counts of the step (empty without balanced routers)."""
        if not self.biases:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([b.step_counts_E for b in self.biases])

    @torch.no_grad()
    def end_step(self, counts_N: torch.Tensor) -> None:
        """Update every bias from the step's counts summed over all ranks (`local_counts()` all-reduced)."""
        if not self.biases:
            return
        counts_N = counts_N.double().round()  # integers, however they travelled
        for bias, counts_E in zip(self.biases, counts_N.split([b.num_experts for b in self.biases])):
            bias.end_step(counts_E)

    def after_optimizer_step(self, step: int | None = None, group: Any = None) -> list[dict[str, Any]]:
        """Standalone use (outside the trainer, whose reduce_step does this in its collective): sum the counts
        over `group`'s ranks and update."""
        counts = self.local_counts()
        if self.biases and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.end_step(counts)
        return []


def install_count_reducers(model: nn.Module, group: Any = None) -> None:
    """Give every top-k router with load_balancing_scope global the sum over the data-parallel ranks (`group`;
    default all ranks) of its micro-batch counts. Routers stay free of torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return

    def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    for m in model.modules():
        if isinstance(m, TopKRouter) and m.cfg.load_balancing_scope == "global":
            m.count_reducer = sum_over_ranks


__all__ = ["LossFreeBalancing", "expert_biases", "install_count_reducers"]
