"""Expert parallelism: DeepSpeed's expert groups, sharded experts, all-to-all dispatch, MoE parameter marks.

Every routed stage (moe/dispatch.py `ExpertStage`: FFN-MoE layers, MSIT branches, MoEP paths and their
projection experts) is sharded alike. The DeepSpeed engine treats a module as MoE (expert gradients
averaged over the expert-data-parallel group, MoE optimizer groups) only if it is an instance of
`deepspeed.moe.layer.MoE`. Model code stays free of deepspeed: at engine build time each stage is given a
class that also derives from DeepSpeed's MoE, with the attributes the engine reads.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from moep_ds.errors import SharedUserError
from moep_ds.moe.all_to_all import AllToAllDispatcher
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.registry import ROUTERS
from moep_ds.distributed.ds_fields import precision, zero_stage


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


moe_layer_classes = routed_module_classes


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


def engine_view_class(cls: type) -> type:
    from deepspeed.moe.layer import MoE

    def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
        """Groups were created by `setup_expert_parallel`; our dispatcher already holds its group."""

    return type(f"DeepSpeed{cls.__name__}", (cls, MoE), {"set_deepspeed_parallelism": set_deepspeed_parallelism})


def expert_parallel_group(ep_size: int):
    """DeepSpeed's expert-parallel group of this rank (created on first use); None at ep_size 1."""
    if ep_size == 1:
        return None
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


def shard_of(ep_group) -> tuple[int, int]:
    """(rank, size) for `moe.shard.expert_shard`: the experts this rank builds."""
    return (0, 1) if ep_group is None else (dist.get_rank(ep_group), dist.get_world_size(ep_group))


def setup_expert_parallel(model: nn.Module, ep_group) -> None:
    """Wire the all-to-all dispatcher and DeepSpeed's MoE marks into every routed stage of a model built inside
    `expert_shard(*shard_of(ep_group))`, which holds this rank's experts only (no rank ever builds them all)."""
    if ep_group is None:
        return
    ep_rank, ep_size = shard_of(ep_group)
    layers = expert_stages(model)
    if not layers:
        raise ParallelLayoutError(f"train.expert_parallel_size ({ep_size}) > 1 but the model has no routed experts")
    name = f"ep_size_{ep_size}"
    for layer in layers:
        local = layer.num_experts // ep_size
        first, held = layer.first_local_expert, layer.experts.num_local_experts
        if (first, held) != (ep_rank * local, local):
            raise ParallelLayoutError(
                f"a routed stage holds experts [{first}, {first + held}) of {layer.num_experts}; expert-parallel rank "
                f"{ep_rank} of {ep_size} needs [{ep_rank * local}, {(ep_rank + 1) * local}): build the model inside "
                f"moe.shard.expert_shard({ep_rank}, {ep_size})")
        layer.set_dispatcher(AllToAllDispatcher(ep_group, layer.num_experts))
        for p in layer.experts.parameters():
            p.allreduce = False  # DeepSpeed's mark of an expert parameter
            p.group_name = name
        layer.__class__ = engine_view_class(type(layer))
        layer.ep_size = ep_size
        layer.expert_group_name = name
        layer.num_local_experts = local
        layer.enable_expert_tensor_parallelism = False
