"""Gradient clipping for ZeRO-0 fp32: the norm of the whole model's gradient, also under expert parallelism.

DeepSpeed's engine clips ZeRO-0 fp32 gradients in `engine.clip_fp32_gradients` with the average over ranks of
each rank's own gradient norm, and keeps no norm to log. Under expert parallelism a rank holds only its own
experts' gradients, so that average is not the norm of the model's gradient: runs at expert parallel size 2 and 1
clip differently. `ExactClipping` takes that method's place on the engine:

    norm^2 = sum of the replicated gradients^2 + sum over the expert-parallel group of each rank's expert gradients^2

(expert gradients are already averaged over their expert-data-parallel group when the engine clips), and every
gradient is scaled by min(1, max_norm / (norm + 1e-6)), DeepSpeed's and torch's coefficient. The norm stays on the
device (`last_norm`) for the step's metrics. ZeRO-1/2/3 and the bf16/fp16 optimizers compute their own norm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from torch.nn.utils import clip_grads_with_norm_, get_total_norm


def model_grad_norm(parameters: list[torch.nn.Parameter], ep_group: Any = None) -> torch.Tensor:
    """L2 norm of the model's gradient; expert parameters (DeepSpeed's mark) are sharded over `ep_group`."""
    device = parameters[0].device

    def squares(grads: list[torch.Tensor]) -> torch.Tensor:
        return get_total_norm(grads).float() ** 2 if grads else torch.zeros((), device=device)

    replicated = squares([p.grad for p in parameters if p.grad is not None and not is_moe_param(p)])
    expert = squares([p.grad for p in parameters if p.grad is not None and is_moe_param(p)])
    if ep_group is not None:
        dist.all_reduce(expert, group=ep_group)
    return (replicated + expert).sqrt()


class ExactClipping:
    """Replaces a ZeRO-0 fp32 engine's `clip_fp32_gradients` (module docstring)."""

    def __init__(self, engine: Any, ep_group: Any = None):
        self.engine = engine
        self.ep_group = ep_group
        self.parameters = [p for p in engine.module.parameters() if p.requires_grad]
        self.last_norm: torch.Tensor | None = None

    @classmethod
    def install(cls, engine: Any, ep_group: Any = None) -> ExactClipping:
        clipping = cls(engine, ep_group)
        engine.clip_fp32_gradients = clipping  # the engine calls it where it would clip, after the all-reduce
        return clipping

    @torch.no_grad()
    def __call__(self) -> None:
        norm = model_grad_norm(self.parameters, self.ep_group)
        clip_grads_with_norm_(self.parameters, self.engine.gradient_clipping(), norm)
        self.last_norm = norm


__all__ = ["ExactClipping", "model_grad_norm"]
