"""The expert lifecycle manager under DeepSpeed (or any optimizer): the per-step call, ZeRO-aware state access.

Under ZeRO 1/2 (and DeepSpeed's bf16 optimizer) the fp32 master weights and Adam moments are partitioned over
the data-parallel ranks, and the module parameters are copies that the engine overwrites from the masters
after every step: an expert cloned only in the module would be reverted by the next step. Replacement
therefore reads and writes masters and moments through the partitioned-state API (training/state.py over
`deepspeed.utils.safe_{get,set}_full_{fp32_param,optimizer_state}`), whose calls are collective: every rank
runs the same checks on the same (all-reduced) statistics and makes the same calls in the same order.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.lifecycle import lifecycle_layers, lifecycle_step
from moep_ds.training import state as st


class PartitionedParamStateIO:
    """ParamStateIO over training/state.py: partitioned masters and moments, or a plain torch optimizer's."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def get_master(self, p: nn.Parameter) -> torch.Tensor:
        return st.get_fp32_param(p)

    def set_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        st.set_fp32_param(p, value)

    def moment_keys(self, p: nn.Parameter) -> list[str]:
        if st.is_partitioned(p):  # the same keys on every rank, whichever fragment this rank holds
            return list(st.ADAM_KEYS)
        state = st.inner_optimizer(self.optimizer).state.get(p, {})
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]

    def get_state(self, p: nn.Parameter, key: str) -> torch.Tensor:
        return st.get_optimizer_state(p, self.optimizer, key)

    def set_state(self, p: nn.Parameter, key: str, value: torch.Tensor) -> None:
        st.set_optimizer_state(p, self.optimizer, key, value)


def data_parallel_sum(engine: Any) -> Callable[[torch.Tensor], None] | None:
    """In-place sum over the engine's data-parallel group (all ranks when it names none); None off-distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = getattr(engine, "data_parallel_group", None)
    return lambda t: dist.all_reduce(t, group=group)


def loss_scale(optimizer: Any) -> float:
    """fp16 dynamic loss scaling multiplies every gradient, dL/dy included; 1 without it."""
    scale = getattr(optimizer, "loss_scale", None)
    if torch.is_tensor(scale) and scale.numel() == 1:
        scale = float(scale)
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0


def lifecycle_after_step(model: nn.Module, engine_or_optimizer: Any) -> list[dict[str, Any]]:
    """Run every lifecycle manager of `model` after an optimizer step; returns the step's events.

    `engine_or_optimizer`: a DeepSpeed engine (its optimizer and data-parallel group are used) or a torch
    optimizer. Call it on every rank after every optimizer step (it all-reduces the step's statistics).
    """
    if not lifecycle_layers(model):
        return []
    is_engine = hasattr(engine_or_optimizer, "module")
    optimizer = engine_or_optimizer.optimizer if is_engine else engine_or_optimizer
    return lifecycle_step(
        model,
        PartitionedParamStateIO(optimizer),
        all_reduce=data_parallel_sum(engine_or_optimizer),
        impact_scale=1.0 / loss_scale(optimizer),
    )


__all__ = ["PartitionedParamStateIO", "data_parallel_sum", "lifecycle_after_step", "loss_scale"]
