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

import dataclasses
from typing import Any, Iterator

import torch.distributed as dist
from torch import nn

from moep_ds.distributed import deepspeed_adapter
from moep_ds.distributed.ds_fields import precision, zero_stage
from moep_ds.distributed.launcher import ranks_per_node
from moep_ds.errors import SharedUserError
from moep_ds.models.plan import plan_for
from moep_ds.models.config import layer_entries
from moep_ds.moe import fp8
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig
from moep_ds.moe.node_dispatch import NodeGroups
from moep_ds.moe.dispatch import ExpertStage
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.registry import ROUTERS
from moep_ds.routing.topk import TopKConfig

NODE_AWARE = "train.expert_comm.node_aware"


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



def node_size(comm: ExpertCommConfig, ep: int, world_size: int, per_node: int | None) -> int | None:
    """The ranks per node node-aware dispatch cuts the expert-parallel group by (`per_node`: the launcher's, None: one
    node of `world_size`), or None where the all-to-all stays flat: `comm.node_aware` null turns it on wherever the
    group (consecutive ranks) spans whole nodes; true where it cannot apply is a one-line ParallelLayoutError."""
    per_node = per_node or world_size
    fits = ep % per_node == 0 and ep > per_node and comm.dedup
    if comm.node_aware is None:
        return per_node if fits else None
    if not comm.node_aware:
        return None
    if ep <= per_node:
        raise ParallelLayoutError(f"{NODE_AWARE} (true) needs expert parallelism across nodes: "
                                  f"train.expert_parallel_size ({ep}) fits on one node of {per_node} ranks")
    if ep % per_node:
        raise ParallelLayoutError(f"{NODE_AWARE} (true) needs whole nodes: train.expert_parallel_size ({ep}) must be a "
                                  f"multiple of the ranks per node ({per_node})")
    if not comm.dedup:
        raise ParallelLayoutError(f"{NODE_AWARE} (true) needs train.expert_comm.dedup (false): a token crosses to a "
                                  f"node once with its pairs")
    return per_node


def grouped_routers(node: Any, path: str) -> Iterator[tuple[str, TopKConfig]]:
    """(dotted path, config) of every group-limited top-k router under a config node."""
    if isinstance(node, TopKConfig):
        if node.num_groups > 1:
            yield path, node
    elif dataclasses.is_dataclass(node):
        for field in dataclasses.fields(node):
            yield from grouped_routers(getattr(node, field.name), f"{path}.{field.name}")


def check_node_layout(cfg: Any, world_size: int, per_node: int | None) -> None:
    """Node-aware dispatch as the recipe asks it on this launch (`node_size`); group-limited routing under it places
    its groups one per node or several per node (experts in order: G a multiple of the nodes), so that a token leaves
    for at most group_topk nodes."""
    ep = cfg.train.expert_parallel_size
    size = node_size(cfg.train.expert_comm, ep, world_size, per_node)
    if size is None:
        return
    nodes = ep // size
    for layer_path, layer in layer_entries(cfg.model.layers, "model"):
        for path, router in grouped_routers(layer, layer_path):
            if router.num_groups % nodes:
                raise ParallelLayoutError(
                    f"{path}.num_groups ({router.num_groups}) must be a multiple of the {nodes} nodes expert "
                    f"parallelism spans ({ep} ranks, {size} per node): node-aware dispatch places each group on one "
                    f"node; or set {NODE_AWARE} false")


def dispatch_widths(model_cfg: Any) -> Iterator[tuple[str, int]]:
    """(recipe field, value) of every width the routed stages dispatch rows of: d_model (FFN-MoE, MoEP projections),
    an MSIT block's d_thin, a MoEP paths block's d_path."""
    yield "model.d_model", model_cfg.d_model
    for path, layer in layer_entries(model_cfg.layers, "model"):
        if isinstance(getattr(layer, "d_path", None), int):
            yield f"{path}.d_path", layer.d_path
        if isinstance(getattr(getattr(layer, "experts", None), "d_thin", None), int):
            yield f"{path}.experts.d_thin", layer.experts.d_thin


def check_fp8_dispatch(cfg: Any) -> None:
    """FP8 dispatch scales each 128 values of a row (moe/fp8.py): every width the experts receive rows of must hold
    whole blocks."""
    if not cfg.train.expert_comm.fp8_dispatch:
        return
    for path, width in dispatch_widths(cfg.model):
        if width % fp8.BLOCK:
            raise ParallelLayoutError(f"train.expert_comm.fp8_dispatch (true) needs {path} ({width}) to be a multiple "
                                      f"of {fp8.BLOCK}: one fp32 scale per {fp8.BLOCK} values of a dispatched row")


def check_parallel_layout(cfg: Any, ds: dict, world_size: int, per_node: int | None = None) -> None:
    """The recipe's expert parallelism on `world_size` ranks of `per_node` per node (None: as the launcher says)."""
    ep = cfg.train.expert_parallel_size
    if world_size % ep:  # first: the node layout below is read in groups of ep ranks
        raise ParallelLayoutError(
            f"train.expert_parallel_size ({ep}) must divide the world size ({world_size})")
    check_node_layout(cfg, world_size, per_node or ranks_per_node())
    check_fp8_dispatch(cfg)
    if ep == 1:
        return
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
    comm = comm if comm is not None else ExpertCommConfig()
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
    # the layers checked first: a model built for another rank is refused before any process group is needed
    per_node = node_size(comm, plan.size, dist.get_world_size(), ranks_per_node())
    nodes = None if per_node is None else node_groups(plan, per_node)
    for layer in layers:
        layer.set_dispatcher(AllToAllDispatcher(plan, layer.num_experts, comm, nodes))
        deepspeed_adapter.show_as_moe(layer, layer.num_experts, plan.size)


_NODE_GROUPS: dict[tuple[int, int, int], NodeGroups] = {}


def node_groups(plan: ExpertParallelPlan, per_node: int) -> NodeGroups:
    """The plan's group cut by nodes (made once per process and layout; every rank of the world takes part). The
    expert-parallel groups are consecutive ranks (DeepSpeed's), and so are a node's (launchers number them so)."""
    key = (plan.size, per_node, id(plan.group))
    if key not in _NODE_GROUPS:
        world, ep = dist.get_world_size(), plan.size
        members = dist.get_process_group_ranks(plan.group)
        if members != list(range(members[0], members[0] + ep)) or members[0] % per_node:
            raise ParallelLayoutError(f"node-aware dispatch needs expert-parallel groups of consecutive ranks starting "
                                      f"on a node; this rank's is {members}, {per_node} ranks per node")
        starts = range(0, world, ep)
        intra = [list(range(s + i, s + i + per_node)) for s in starts for i in range(0, ep, per_node)]
        inter = [list(range(s + local, s + ep, per_node)) for s in starts for local in range(per_node)]
        _NODE_GROUPS[key] = NodeGroups(per_node, dist.new_subgroups_by_enumeration(intra)[0],
                                       dist.new_subgroups_by_enumeration(inter)[0])
    return _NODE_GROUPS[key]
