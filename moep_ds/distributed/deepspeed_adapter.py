"""Every use of DeepSpeed's internals, in one place: what moep_ds relies on beyond DeepSpeed's public API.

Checked against DeepSpeed 0.19.x (0.19.8 installed; setup.py pins `deepspeed>=0.19,<0.20`). A DeepSpeed upgrade
re-checks this list, and tests/distributed/test_deepspeed_adapter.py fails where one of them moved:

  expert groups (`deepspeed.utils.groups`, private functions)
    _create_expert_and_data_parallel(ep_size)   creates the expert-parallel and expert-data-parallel groups
    _get_expert_parallel_group_dict()           which expert groups exist, by name `ep_size_<N>`
    _get_expert_parallel_group(name)            this rank's expert-parallel group
    _get_expert_data_parallel_group(name)       the ranks holding the same experts (a replica of them)
  MoE detection (engine.py `_configure_distributed_model`: `isinstance(module, deepspeed.moe.layer.MoE)`)
    the engine treats a model as MoE (expert gradients averaged over the expert-data-parallel group, expert
    parameters in their own optimizer groups) only if one of its modules is an instance of `MoE`; it reads
    `num_experts` and calls `set_deepspeed_parallelism(...)` on it. Expert parameters are marked as DeepSpeed's
    own MoE marks them: `param.allreduce = False`, `param.group_name = "ep_size_<N>"` (moe/experts.py).
  optimizer internals
    FP16_UnfusedOptimizer (runtime/fp16/unfused_optimizer.py): `fp16_groups`, `fp32_groups`, `loss_scale_config`
      (ZeRO-0 with bf16/fp16: the fp32 masters beside the model's parameters, the fp16 loss scale)
    ZeRO-1/2 and the bf16 optimizer: `_lazy_init_hp_params_optimizer_state()`, `_hp_optimizer_states_linked`
      (linking every parameter's view of the Adam moments), and a parameter's `_hp_mapping` (`hp_fragment`,
      `lp_fragment_address`, `get_optim_state_fragment(key)`): its fragment of the rank's flat partition
    ZeRO-3: `fp32_partitioned_groups_flat` (the flat fp32 partitions the torch optimizer holds state for)

Nothing else in moep_ds calls a private DeepSpeed function or reads these attributes (a test greps for it). The
public API (`deepspeed.initialize`, `deepspeed.zero.Init`, `deepspeed.utils.safe_*`, ZeRO-3's `ds_*` parameter
attributes) is used where it is needed.

The MoE detection is met without changing any module's class: each routed stage of an expert-parallel model
gets one parameter-free child, a `DeepSpeedMoEView` (an `MoE` whose `__init__` builds nothing), which carries the
attributes the engine reads and does nothing when the engine sets up its groups (the stage's plan holds them).
It is never called and holds no state, so the model's parameters, state dict and forward are unchanged.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch import nn

VIEW_NAME = "deepspeed_moe_view"  # the child of a routed stage that DeepSpeed's engine recognises as MoE


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert-parallel groups of size `ep_size` (its MoE layer's `expert_group_name`)."""
    return f"ep_size_{ep_size}"


# ---- expert groups ---------------------------------------------------------------------------------------


def expert_parallel_group(ep_size: int) -> Any:
    """DeepSpeed's expert-parallel group of this rank (created on first use); None at ep_size 1. DeepSpeed's engine
    reduces expert gradients over the matching expert-data-parallel group, so the model must use this one."""
    if ep_size == 1:
        return None
    from deepspeed.utils import groups

    name = expert_group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


def expert_data_parallel_group(group_name: str) -> Any:
    """The ranks holding the same experts as this one, for expert parameters marked with `group_name`."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_group(group_name)


# ---- MoE detection -----------------------------------------------------------------------------------------


@functools.cache
def view_class() -> type:
    from deepspeed.moe.layer import MoE

    class DeepSpeedMoEView(MoE):
        """What DeepSpeed's engine reads of an MoE layer; parameter-free, never called."""

        def __init__(self, num_experts: int, ep_size: int):
            nn.Module.__init__(self)  # not MoE.__init__: that builds DeepSpeed's own gate and experts
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.num_local_experts = num_experts // ep_size
            self.expert_group_name = expert_group_name(ep_size)
            self.enable_expert_tensor_parallelism = False

        def set_deepspeed_parallelism(self, *args: Any, **kwargs: Any) -> None:
            """The groups exist already (`expert_parallel_group`); the stage's plan holds its group."""

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("DeepSpeedMoEView only marks a routed stage for DeepSpeed's engine; it does not run")

    return DeepSpeedMoEView


def show_as_moe(stage: nn.Module, num_experts: int, ep_size: int) -> None:
    """Let DeepSpeed's engine see `stage` (whose `experts` hold its expert parameters) as one of its MoE layers
    over groups of `ep_size`: mark the expert parameters and add the view."""
    name = expert_group_name(ep_size)
    for p in stage.experts.parameters():
        p.allreduce = False  # DeepSpeed's mark of an expert parameter
        p.group_name = name
    stage.add_module(VIEW_NAME, view_class()(num_experts, ep_size))


def moe_views(model: nn.Module) -> list[nn.Module]:
    """The views `show_as_moe` added (what the engine counts as its MoE layers)."""
    from deepspeed.moe.layer import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


# ---- optimizer internals ------------------------------------------------------------------------------------


def is_unfused(optimizer: Any) -> bool:
    """ZeRO-0 with bf16/fp16: DeepSpeed's FP16_UnfusedOptimizer, which keeps one fp32 master per parameter."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(optimizer, FP16_UnfusedOptimizer)


def unfused_pairs(optimizer: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, its fp32 master) for every parameter of an FP16_UnfusedOptimizer."""
    for lp_group, fp32_group in zip(optimizer.fp16_groups, optimizer.fp32_groups):
        yield from zip(lp_group, fp32_group)


def unfused_loss_scale(optimizer: Any) -> Any:
    """The fp16 loss-scale state of an FP16_UnfusedOptimizer that scales (not bf16), else None."""
    if is_unfused(optimizer) and optimizer.loss_scale_config.use_grad_scaling:
        return optimizer.loss_scale_config
    return None


def link_optimizer_state(optimizer: Any) -> None:
    """ZeRO-1/2 and the bf16 optimizer: make every partitioned parameter's view of the Adam moments current.

    DeepSpeed links these views once, after the first optimizer step of the FIRST parameter group, so groups
    stepped after it (e.g. our no-weight-decay group) stay unlinked; relinking is cheap (narrow views into the
    flat state)."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def zero3_flat_partitions(optimizer: Any) -> list[torch.Tensor] | None:
    """ZeRO-3: the flat fp32 partitions the torch optimizer keeps state for (only while it steps are they in its
    parameter groups); None for other optimizers."""
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    return None if flats is None else list(flats)


def has_fragment_mapping(p: torch.Tensor) -> bool:
    """ZeRO-1/2 or the bf16 optimizer maps this parameter to a fragment of a rank's flat partition."""
    return hasattr(p, "_hp_mapping")


def fragment(p: torch.Tensor, keys: tuple[str, ...]) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(flat offset within the parameter, {"param": fp32 master view, key: optimizer-state view}) of the fragment
    of a ZeRO-1/2 / bf16-optimizer parameter held by this rank, or None when it holds none."""
    frag = p._hp_mapping
    if frag is None:
        return None
    return frag.lp_fragment_address.start, {"param": frag.hp_fragment,
                                            **{k: frag.get_optim_state_fragment(k) for k in keys}}


__all__ = [
    "VIEW_NAME", "expert_data_parallel_group", "expert_group_name", "expert_parallel_group", "fragment",
    "has_fragment_mapping", "is_unfused", "link_optimizer_state", "moe_views", "show_as_moe", "unfused_loss_scale",
    "unfused_pairs", "view_class", "zero3_flat_partitions",
]
