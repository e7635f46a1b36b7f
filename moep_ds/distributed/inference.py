"""A model for inference on every rank of a launch, split over the ranks, without an optimizer (used by
evaluation/partitioned.py; DeepSpeed is imported here because its ZeRO-3 engine does the gathering).

    model, engine = split_model(cfg, model_dir, "bfloat16", expert_parallel=False)

ZeRO-3 (default): the model is built inside `deepspeed.zero.Init` (distributed/zero3.py), every rank reads only its
partition of each weight from the checkpoint (`checkpointing.model_dir.load_weights`), and a DeepSpeed engine
without an optimizer gathers each module's parameters while it runs (each routed block as one unit, as in
training) and frees them after. Expert parallel: every routed stage is built with this rank's 1/N of the experts
(its expert-parallel plan, moe/plan.py) and sends tokens to their experts' ranks (all-to-all), as in training at
expert_parallel_size N; the other parameters are whole on every rank.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moep_ds.checkpointing import sharded
from moep_ds.errors import SharedUserError, UserError

log = logging.getLogger(__name__)

DS_PRECISION = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


def inference_ds_config(dtype: str) -> dict[str, Any]:
    """ZeRO-3 without an optimizer, in `dtype` (a torch dtype name)."""
    if dtype not in DS_PRECISION:
        raise SharedUserError(f"dtype ({dtype!r}) must be one of {sorted(DS_PRECISION)}")
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if DS_PRECISION[dtype]:
        ds[DS_PRECISION[dtype]] = {"enabled": True}
    return ds


def build_split(cfg: Any, dtype: str, expert_parallel: bool) -> tuple[torch.nn.Module, Any, dict[str, Any], Any]:
    """(this rank's part of the model of recipe `cfg`, built without initialising it: every weight comes from
    elsewhere; its expert-parallel plan; the ZeRO-3 config it was built under; the device). Joins the launcher's
    process group."""
    from moep_ds.models.causal_lm import build_model
    from moep_ds.distributed.process_group import init_distributed, setup_logging
    from moep_ds.distributed.expert_parallel import expert_parallel_plan, setup_expert_parallel
    from moep_ds.distributed.zero3 import check_partitioned, partitioned_construction

    ds = inference_ds_config(dtype)
    device = init_distributed()
    setup_logging(dist.get_rank())
    world = dist.get_world_size()
    plan = expert_parallel_plan(cfg.model, world if expert_parallel else 1)
    with nullcontext() if expert_parallel else partitioned_construction(ds):
        model = build_model(cfg.model, plan=plan, initialise=False)
    if not expert_parallel:
        check_partitioned(model)
    setup_expert_parallel(model, plan)
    return model, plan, ds, device


def split_model(cfg: Any, model_dir: Path, dtype: str, expert_parallel: bool) -> tuple[torch.nn.Module, Any]:
    """(this rank's part of the model of recipe `cfg` with the weights of `model_dir`, in eval mode; the
    DeepSpeed engine whose hooks gather a ZeRO-3 model's parameters while it runs: keep it as long as the model,
    None for expert parallelism). Joins the launcher's process group."""
    import deepspeed

    from moep_ds.checkpointing.model_dir import load_weights
    from moep_ds.distributed.expert_parallel import routed_module_classes

    model, plan, ds, device = build_split(cfg, dtype, expert_parallel)
    world = dist.get_world_size()
    error = None
    try:
        load_weights(model, model_dir, partitions=not expert_parallel, ep=plan)
    except UserError as err:  # e.g. a file that one node reads differently
        error = err
    stop_together(error, f"checkpoint {str(model_dir)!r}")
    engine = None
    if expert_parallel:
        model.to(device, getattr(torch, dtype))
    else:
        if routed := routed_module_classes(model):  # routing differs between ranks' batches: fetch a routed block whole
            deepspeed.utils.set_z3_leaf_modules(model, routed)
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds, dist_init_required=False)
    held = "of the experts, the rest whole" if expert_parallel else "of the model (ZeRO-3)"
    log.info("%d ranks, each holding 1/%d %s, %s", world, world, held, dtype)
    return model.eval(), engine


def stop_together(error: UserError | None, what: str) -> None:
    """Raise on every rank if any rank failed (instead of the others waiting for it in the next collective).
    A `SharedUserError` that every rank had is reported once, by rank 0; else each failed rank reports its own
    error and the others say that another rank failed."""
    count = int(sharded.all_reduce_value(0.0 if error is None else 1.0))
    if count == 0:
        return
    if error is None:
        raise UserError(f"{what} could not be read on {count} other rank(s); their errors are above")
    if count == dist.get_world_size() and isinstance(error, SharedUserError):
        raise error
    raise UserError(str(error)) from None  # reported by this rank, not only by rank 0


__all__ = ["build_split", "inference_ds_config", "split_model", "stop_together"]
