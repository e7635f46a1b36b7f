"""Full (unpartitioned) fp32 parameters and optimizer state, whatever ZeRO stage holds them.

Under ZeRO 1/2/3 and the bf16 optimizer the fp32 master weights and Adam moments are partitioned over
ranks: DeepSpeed's partitioned-state API assembles and scatters them (collective calls: every rank of the
data-parallel group must make the same calls in the same order). Without a partitioning optimizer (ZeRO-0
fp32) the module parameter is the master weight and the torch optimizer holds the state directly. ZeRO-0 with
bf16 or fp16 keeps one fp32 master per parameter beside the model's low-precision one (DeepSpeed's
FP16_UnfusedOptimizer): `adopt_unfused_masters` links each parameter to it (`master`).
"""
from __future__ import annotations

from typing import Any

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)

from moep_ds.distributed.deepspeed_adapter import (
    has_fragment_mapping, is_unfused, link_optimizer_state, unfused_loss_scale, unfused_pairs, zero3_flat_partitions,
)

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def adopt_unfused_masters(optimizer) -> bool:
    """ZeRO-0 with bf16/fp16 (DeepSpeed's FP16_UnfusedOptimizer): undo the optimizer step DeepSpeed takes on zero
    gradients to create Adam's state, and link every model parameter to its fp32 master.

    That step leaves Adam's counter at 1, so the first real update is bias-corrected as the second (0.74 of
    Adam's first step at beta2 0.999, and every later correction one step late), and it applies weight decay
    once. The masters are copies of the model's weights taken just before it, so copying those back and dropping
    the state (torch's Adam creates it again, at zero, on its first step) restores what a fresh optimizer holds.
    Returns whether the optimizer is of that kind."""
    if not is_unfused(optimizer):
        return False
    with torch.no_grad():
        for lp, fp32 in unfused_pairs(optimizer):
            fp32.copy_(lp)
            lp._moep_fp32_master = fp32
    inner_optimizer(optimizer).state.clear()
    return True


def loss_for_backward(optimizer, loss: torch.Tensor) -> torch.Tensor:
    """The loss to hand to `engine.backward`. DeepSpeed 0.19's engine applies the fp16 loss scale only for ZeRO
    optimizers, while ZeRO-0's FP16_UnfusedOptimizer divides the gradients by that scale all the same (and checks
    them for overflow as if scaled): for that optimizer the scale is applied here, as its own `backward` would."""
    scale = unfused_loss_scale(optimizer)
    return loss if scale is None else loss.float() * scale.cur_scale


def loss_scaler(optimizer):
    """The object holding the fp16 loss scale (`cur_scale`, dynamic-scaling counters), or None without one."""
    scaler = getattr(optimizer, "loss_scaler", None)
    return scaler if scaler is not None else unfused_loss_scale(optimizer)


def optimizer_loss_scale(optimizer: Any) -> float:
    """fp16 dynamic loss scaling multiplies every gradient, dL/dy included; 1 without it."""
    scale = getattr(optimizer, "loss_scale", None)
    if torch.is_tensor(scale) and scale.numel() == 1:
        scale = float(scale)
    return float(scale) if isinstance(scale, (int, float)) and scale > 0 else 1.0


def master(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor that is the parameter's fp32 master and keys its optimizer state when it is not partitioned."""
    return getattr(param, "_moep_fp32_master", param)


def refresh_working_copies(optimizer) -> None:
    """After masters were written (a resume), make the model's low-precision parameters match them."""
    if is_unfused(optimizer):
        with torch.no_grad():
            for lp, fp32 in unfused_pairs(optimizer):
                lp.copy_(fp32)


def is_partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id") or has_fragment_mapping(param)


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, bf16, fp16), or the optimizer itself."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_state_params(optimizer) -> list[torch.Tensor]:
    """The tensors the torch optimizer keeps state for. ZeRO-3 puts its flat fp32 partitions into the torch
    optimizer's parameter groups only while it steps, so those are taken from the ZeRO-3 optimizer itself."""
    flats = zero3_flat_partitions(optimizer)
    if flats is not None:
        return flats
    return [p for group in inner_optimizer(optimizer).param_groups for p in group["params"]]


def init_optimizer_state(optimizer) -> None:
    """Create zero Adam state (as torch's AdamW would at its first step) so that a checkpoint's moments can be
    written into an optimizer that has not stepped yet (a fresh ZeRO-3 engine has none)."""
    inner = inner_optimizer(optimizer)
    for p in optimizer_state_params(optimizer):
        state = inner.state[p]
        if "exp_avg" not in state:
            state["step"] = adam_step(inner, 0.0, p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    link_optimizer_state(optimizer)


def get_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    full = safe_get_full_fp32_param(param) if is_partitioned(param) else None
    return (full if full is not None else master(param).detach()).float().cpu().clone()


def set_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the master weight (and the module's working copy, which DeepSpeed refreshes only at the next step)."""
    if is_partitioned(param):
        safe_set_full_fp32_param(param, value.to(param.device, torch.float32))
    if hasattr(param, "ds_id"):  # ZeRO-3 computes with its own partition, refreshed only by the next step
        param.ds_tensor.data.copy_(safe_get_local_fp32_param(param).to(param.ds_tensor.dtype))
    else:
        with torch.no_grad():
            if (fp32 := master(param)) is not param:
                fp32.copy_(value.to(param.device, torch.float32))
            param.copy_(value.to(param.device, param.dtype))


def get_optimizer_state(param: torch.nn.Parameter, optimizer, key: str) -> torch.Tensor | None:
    if is_partitioned(param):
        value = safe_get_full_optimizer_state(param, key)
    else:
        value = inner_optimizer(optimizer).state.get(master(param), {}).get(key)
    return None if value is None else value.float().cpu().clone()


def set_optimizer_state(param: torch.nn.Parameter, optimizer, key: str, value: torch.Tensor) -> None:
    if is_partitioned(param):
        safe_set_full_optimizer_state(param, value.to(torch.float32), key)
        return
    state = inner_optimizer(optimizer).state.setdefault(master(param), {})
    if key in state:
        state[key].copy_(value.to(state[key].device, state[key].dtype))
    else:
        state[key] = value.to(param.device, torch.float32).clone()


def optimizer_step_count(optimizer) -> int:
    steps = [int(s["step"]) for s in inner_optimizer(optimizer).state.values() if "step" in s]
    return max(steps, default=0)


def set_optimizer_step_count(optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    """Adam's bias correction reads `step`; partitioned optimizers keep one per flat group."""
    inner = inner_optimizer(optimizer)
    for p in params:
        if not is_partitioned(p):
            inner.state.setdefault(master(p), {})
    for p, state in inner.state.items():
        state["step"] = adam_step(inner, float(step), p.device)


def adam_step(inner: torch.optim.Optimizer, value: float, device: torch.device) -> torch.Tensor:
    """Adam's step counter where torch keeps it: beside the parameter for the fused kernel, else on the host."""
    fused = any(group.get("fused") for group in inner.param_groups)
    return torch.tensor(value, dtype=torch.float32, device=device if fused else "cpu")


def local_partition(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """This rank's ZeRO-3 partition (padded) of the master weight (`key` "param") or of an Adam moment."""
    if key == "param":
        return safe_get_local_fp32_param(param)
    return safe_get_local_optimizer_state(param, key)


def set_local_partition(param: torch.nn.Parameter, key: str, value_part: torch.Tensor) -> None:
    """Write the valid part `value_part` of this rank's ZeRO-3 partition (the padding keeps its value)."""
    padded = local_partition(param, key).clone()
    padded[: value_part.numel()] = value_part
    if key == "param":
        safe_set_local_fp32_param(param, padded)
    else:
        safe_set_local_optimizer_state(param, padded, key)
