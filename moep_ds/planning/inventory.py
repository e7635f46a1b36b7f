"""What one rank holds of a model, counted on the meta device with the code training builds it with: the model with
this rank's experts only (the expert-parallel plan, models/plan.py), the optimizer's parameter groups
(training/optim.py) split as DeepSpeed splits expert parameters into groups of their own, the modules ZeRO-3
gathers one at a time, and the routing state the trainer synchronises every step.

    inv = inventory(cfg, expert_parallel=2)
    inv.report            the whole model's parameters and FLOPs per token: `pretrain.py --dry_run`'s numbers
    inv.groups            optimizer groups: numel per parameter, expert or not
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moep_ds.models.accounting import ParamReport, meta_param_report
from moep_ds.models.causal_lm import build_model
from moep_ds.models.plan import plan_for
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.routing.balancing import ExpertBias
from moep_ds.routing.expert_choice import ExpertChoiceRouter
from moep_ds.routing.topk import TopKRouter
from moep_ds.training.optim import param_groups

# DeepSpeed's split_params_into_different_moe_groups_for_optimizer cuts expert groups into pieces of at most this
MOE_GROUP_MAX_NUMEL = 178956971


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One optimizer parameter group as DeepSpeed receives it."""

    name: str
    numels: tuple[int, ...]
    expert: bool  # reduced and partitioned over the expert-data-parallel group (expert parallelism > 1)

    @property
    def numel(self) -> int:
        return sum(self.numels)


@dataclasses.dataclass(frozen=True)
class Inventory:
    report: ParamReport  # the whole model (pretrain.py --dry_run)
    expert_parallel: int
    groups: tuple[ParamGroup, ...]  # this rank's parameters by optimizer group
    fetch_units: tuple[int, ...]  # numel of each unit ZeRO-3 gathers, in forward order
    threshold_numel: int  # expert-choice thresholds the trainer averages over ranks each step
    balancing_counts: int  # loss-free balancing counts in the trainer's per-step all-reduce
    global_balance_experts: tuple[int, ...]  # E of each top-k router with load_balancing_scope global

    @property
    def local_params(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def expert_params(self) -> int:
        return sum(g.numel for g in self.groups if g.expert)

    @property
    def dense_params(self) -> int:
        return self.local_params - self.expert_params

    @property
    def largest_param(self) -> int:
        return max(n for g in self.groups for n in g.numels)


def expert_param_ids(model: nn.Module) -> set[int]:
    """The parameters DeepSpeed treats as expert parameters under expert parallelism (distributed/deepspeed_adapter
    `show_as_moe`: every routed stage's `experts`)."""
    return {id(p) for m in model.modules() if isinstance(m, ExpertStage) for p in m.experts.parameters()}


def optimizer_groups(model: nn.Module, optimizer_cfg, expert_parallel: int) -> tuple[ParamGroup, ...]:
    """training/optim.py's groups; under expert parallelism each group's expert parameters move to groups of their
    own, in pieces of at most MOE_GROUP_MAX_NUMEL (DeepSpeed's split, which keeps the emptied dense groups)."""
    experts = expert_param_ids(model) if expert_parallel > 1 else set()
    dense, moe = [], []
    for group in param_groups(model, optimizer_cfg):
        params = group["params"]
        dense.append(ParamGroup(group["name"], tuple(p.numel() for p in params if id(p) not in experts), False))
        piece: list[int] = []
        for p in (p for p in params if id(p) in experts):
            if piece and sum(piece) + p.numel() > MOE_GROUP_MAX_NUMEL:
                moe.append(ParamGroup(f"{group['name']}_experts", tuple(piece), True))
                piece = []
            piece.append(p.numel())
        if piece:
            moe.append(ParamGroup(f"{group['name']}_experts", tuple(piece), True))
    return tuple(dense + moe)


def fetch_units(model: nn.Module) -> tuple[int, ...]:
    """What ZeRO-3 gathers as one unit, in forward order: each module's own parameters, and every block with a
    router whole (distributed/expert_parallel.py makes those ZeRO-3 leaf modules)."""
    from moep_ds.distributed.expert_parallel import routed_module_classes

    leaves = tuple(routed_module_classes(model))
    units: list[int] = []
    seen: set[int] = set()

    def walk(module: nn.Module) -> None:
        if isinstance(module, leaves):
            params = [p for p in module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            units.append(sum(p.numel() for p in params))
            return
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            units.append(sum(p.numel() for p in own))
        for child in module.children():
            walk(child)

    walk(model)
    return tuple(units)


CACHE: dict[tuple, Inventory] = {}  # a search asks for the same few inventories many times


def count_inventory(model_cfg, optimizer_cfg, expert_parallel: int, seq_len: int) -> Inventory:
    report = meta_param_report(model_cfg, seq_len)
    with torch.device("meta"):
        model = build_model(model_cfg, plan=plan_for(model_cfg, expert_parallel), initialise=False)
    routers = list(model.modules())
    return Inventory(
        report=report,
        expert_parallel=expert_parallel,
        groups=optimizer_groups(model, optimizer_cfg, expert_parallel),
        fetch_units=fetch_units(model),
        threshold_numel=sum(b.numel() for m in routers if isinstance(m, ExpertChoiceRouter) for b in m.buffers()
                            if b.is_floating_point()),
        balancing_counts=sum(m.num_experts for m in routers if isinstance(m, ExpertBias)),
        global_balance_experts=tuple(m.num_experts for m in routers if isinstance(m, TopKRouter)
                                     and m.cfg.load_balancing_scope == "global"),
    )


def inventory(cfg, expert_parallel: int) -> Inventory:
    """This rank's inventory of `cfg` (the recipe) at `expert_parallel` (validated by the plan: a routed stage whose
    experts it does not divide is a one-line error naming the recipe field)."""
    key = (repr(cfg.model), repr(cfg.train.optimizer), expert_parallel, cfg.data.seq_len)
    if key not in CACHE:
        CACHE[key] = count_inventory(cfg.model, cfg.train.optimizer, expert_parallel, cfg.data.seq_len)
    return CACHE[key]


__all__ = ["Inventory", "ParamGroup", "expert_param_ids", "fetch_units", "inventory", "optimizer_groups"]
