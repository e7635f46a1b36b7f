"""Experts that are whole modules (MSIT branches, MoEP paths), with their parameters stacked [E, ...].

# E experts held here (local to this rank after sharding), name: a parameter of one expert, shape X

One expert's architecture is built once (`expert`); each of its parameters is replaced by the stack of the E
experts' parameters, `expert.<name>` [E, *X]. Expert e runs as that module with the e-th slices substituted
(torch.func.functional_call), so every routed block keeps the same layout as the FFN experts (`w1_EDF`, ...):
a checkpoint reshards along dim 0 across expert-parallel sizes, `keep_experts_` keeps a rank's shard, and any
expert is cloned by copying index e of every tensor.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.moe.shard import EXPERT_ROWS, full_shape, mark_expert_rows


def set_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def keep_expert_slice_(module: nn.Module, start: int, count: int, held: int) -> None:
    """Replace every parameter [held, ...] of `module` by its experts [start, start + count) (in place)."""
    if start < 0 or count <= 0 or start + count > held:
        raise ValueError(f"experts [{start}, {start + count}) are not within the {held} held")
    with torch.no_grad():
        for name, p in list(module.named_parameters()):
            first, total = getattr(p, EXPERT_ROWS, (0, held))
            kept = nn.Parameter(p[start : start + count].clone(), requires_grad=p.requires_grad)
            set_parameter(module, name, mark_expert_rows(kept, first + start, total))


class StackedExperts(nn.Module):
    """E experts of one architecture; `expert`'s parameters hold all of them, stacked along dim 0.

    Built from separately constructed (and initialised) modules of identical structure: experts
    [first_expert, first_expert + len(experts)) of `num_experts` (default: all of them). Buffers are not
    stacked: an expert module must keep its state in parameters.
    """

    def __init__(self, experts: Sequence[nn.Module], first_expert: int = 0, num_experts: int | None = None):
        super().__init__()
        module = experts[0]
        if any(True for _ in module.buffers()):
            raise ValueError(f"{type(module).__name__} has buffers; stacked experts hold parameters only")
        for name, p in list(module.named_parameters()):
            if p.shape != full_shape(p):  # partitioned as it was built (ZeRO-3): no values yet, initialised later
                stacked = nn.Parameter(p.new_empty(len(experts), *full_shape(p)))
            else:
                stacked = nn.Parameter(torch.stack([e.get_parameter(name).detach() for e in experts]))
            set_parameter(module, name, mark_expert_rows(stacked, first_expert, num_experts or len(experts)))
        self.expert = module
        self.num_local_experts = len(experts)

    @classmethod
    def build(cls, make_expert: Callable[[], nn.Module], num_experts: int,
              plan: ExpertParallelPlan = SINGLE_PROCESS) -> StackedExperts:
        """`num_experts` experts made by `make_expert()`, of which this process keeps the ones it holds
        (`plan.held`). Every expert is made, in order, so that the random stream advances as in the unsharded
        model; one that is not held is dropped at once."""
        held = plan.held(num_experts)
        experts = []
        for e in range(num_experts):
            expert = make_expert()
            if e in held:
                experts.append(expert)
        return cls(experts, held.start, num_experts)

    def per_expert(self) -> list[dict[str, torch.Tensor]]:
        """Each held expert's parameters as views (unbind: one backward that stacks the gradients)."""
        names, stacks = zip(*self.expert.named_parameters())
        return [dict(zip(names, slices)) for slices in zip(*(p.unbind(0) for p in stacks))]

    def call(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the expert whose parameters are `params` (one entry of `per_expert()`)."""
        return functional_call(self.expert, params, args, kwargs)

    def expert_module(self, e: int) -> nn.Module:
        """A standalone copy of expert e (for references and inspection; not part of the model)."""
        module = copy.deepcopy(self.expert)
        with torch.no_grad():
            for name, p in self.expert.named_parameters():
                set_parameter(module, name, nn.Parameter(p[e].clone(), requires_grad=p.requires_grad))
        return module

    def params_per_expert(self) -> int:
        return sum(p[0].numel() for p in self.parameters())

    def keep_experts_(self, start: int, count: int) -> None:
        """Keep experts [start, start + count) only (expert parallelism: this rank's shard)."""
        keep_expert_slice_(self.expert, start, count, self.num_local_experts)
        self.num_local_experts = count

    def extra_repr(self) -> str:
        return f"num_local_experts={self.num_local_experts}"


__all__ = ["StackedExperts", "keep_expert_slice_", "set_parameter"]
