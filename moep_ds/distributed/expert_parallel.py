"""Expert parallelism on a launch: the plan of this rank (DeepSpeed's expert groups), DeepSpeed's MoE marks.

    plan = expert_parallel_plan(cfg.model, cfg.train.expert_parallel_size)   # every rank, before the model
    model = build_model(cfg.model, plan=plan)        # this rank's experts only
    setup_expert_parallel(model, plan, cfg.train.expert_comm)  # all-to-all over plan.group, DeepSpeed's view

Every routed stage (moe/dispatch.py `ExpertStage`: FFN-MoE layers, MSIT branches, MoEP paths and their
projection experts) is sharded alike, by the plan it is built with (moe/plan.py). The DeepSpeed engine treats a
module as MoE (expert gradients averaged over the expert-data-parallel group, MoE optimizer groups) only if it
is an instance of DeepSpeed's MoE: distributed/deepspeed_adapter.py adds one parameter-free view per stage.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from moep_ds.distributed import deepspeed_adapter
from moep_ds.distributed.ds_fields import precision, zero_stage
from moep_ds.errors import SharedUserError
from moep_ds.models.plan import plan_for
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.registry import ROUTERS


class ParallelLayoutError(SharedUserError):
    """A recipe whose expert parallelism the world size or ds_config cannot hold: alike on every rank."""


def expert_stages(model: nn.Module) -> list[ExpertStage]:
    return [m for m in model.modules() if isinstance(m, ExpertStage)]


def routed_module_classes(model: nn.Module) -> list[type]:
    """Classes of the blocks that contain a router: which of their parameters a rank uses depends on the data,
    so ZeRO-3 fetches each such block's parameters as one unit (a leaf module). Blocks return tuples of
    tensors, to which ZeRO-3 attaches the hooks that fetch the parameters again for the backward pass."""
    router_types = tuple(ROUTERS.get(name) for name in ROUTERS.names())
    classes = []
    for block in getattr(model, "blocks", []):
        if any(isinstance(m, router_types) for m in block.modules()) and type(block) not in classes:
            classes.append(type(block))
    return classes



def check_parallel_layout(cfg: Any, ds: dict, world_size: int) -> None:
    ep = cfg.train.expert_parallel_size
    if ep == 1:
        return
    if world_size % ep:
        raise ParallelLayoutError(
            f"train.expert_parallel_size ({ep}) must divide the world size ({world_size})")
    if zero_stage(ds) == 3:
        raise ParallelLayoutError(
            f"train.expert_parallel_size ({ep}) > 1 is not supported with ZeRO stage 3 (DeepSpeed refuses expert "
            f"parameters there); use ZeRO 0-2, or expert_parallel_size 1 with ZeRO-3")
    if zero_stage(ds) == 0 and precision(ds) != "fp32":
        raise ParallelLayoutError(
            f"train.expert_parallel_size ({ep}) > 1 is not supported with ZeRO stage 0 in {precision(ds)} (DeepSpeed's "
            f"optimizer there leaves expert gradients out of the gradient norm it clips by); use ZeRO 1-2, or fp32")


def expert_parallel_plan(model_cfg: Any, ep_size: int) -> ExpertParallelPlan:
    """This rank's plan for `model_cfg` at `ep_size` (validated: a routed stage that `ep_size` does not divide is
    a one-line error naming its recipe field), over DeepSpeed's expert-parallel group (None at ep_size 1)."""
    group = deepspeed_adapter.expert_parallel_group(ep_size)
    rank = 0 if group is None else dist.get_rank(group)
    return plan_for(model_cfg, ep_size, rank, group)


def setup_expert_parallel(model: nn.Module, plan: ExpertParallelPlan, comm: ExpertCommConfig | None = None) -> None:
    """Wire every routed stage of a model built with `plan` to the plan's group (an AllToAllDispatcher: tokens go
    to their experts' ranks, moved as `comm`, the recipe's train.expert_comm, says; None: its defaults) and show it
    to DeepSpeed's engine as one of its MoE layers (expert parameters marked, one view per stage:
    deepspeed_adapter.show_as_moe). Nothing to do at size 1."""
    if plan.size == 1:
        return
    layers = expert_stages(model)
    if not layers:
        raise ParallelLayoutError(f"train.expert_parallel_size ({plan.size}) > 1 but the model has no routed experts")
    for layer in layers:
        first, count = layer.first_local_expert, layer.experts.num_local_experts
        needed = plan.held(layer.num_experts)
        if (first, count) != (needed.start, len(needed)):
            raise ParallelLayoutError(
                f"a routed stage holds experts [{first}, {first + count}) of {layer.num_experts}; expert-parallel rank "
                f"{plan.rank} of {plan.size} needs [{needed.start}, {needed.stop}): build the model with this plan, "
                f"build_model(cfg, plan=plan)")
        layer.set_dispatcher(AllToAllDispatcher(plan, layer.num_experts, comm))
        deepspeed_adapter.show_as_moe(layer, layer.num_experts, plan.size)
