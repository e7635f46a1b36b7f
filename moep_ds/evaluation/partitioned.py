"""Evaluation on several processes without any of them holding the whole model.

    torchrun --nproc_per_node N -m moep_ds.evaluation.run_eval runs/x ...          (or deepspeed --num_gpus N
    --module moep_ds.evaluation.run_eval ..., or lm_eval_cli under either launcher)

Under a launcher (WORLD_SIZE > 1) the model is split over the ranks in one of two ways:

  ZeRO-3 (default)   built inside `deepspeed.zero.Init` (training/zero3.py); every rank reads only its partition
                     of each weight from the checkpoint (`checkpointing.model_dir.load_weights`), and a DeepSpeed
                     engine without an optimizer gathers each module's parameters while it runs (each routed block
                     as one unit, as in training) and frees them after. Any model.
  expert parallel    (`expert_parallel`) every routed stage built with this rank's 1/N of the experts only
                     (moe/shard.py) and the tokens sent to their experts' ranks (all-to-all), as in training at
                     expert_parallel_size N; the other parameters are whole on every rank. No expert is ever
                     gathered; MoE models only.

Every rank sees every request, as lm-eval expects of a model split over ranks (it reports and writes on rank 0);
the harness spreads the scoring batches over the ranks, every rank runs each forward pass, the scores are
gathered, and generation decodes in lockstep with rank 0's tokens (evaluation/harness.py, generate.py).
"""
from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from moep_ds.errors import SharedUserError, UserError

log = logging.getLogger(__name__)

DS_PRECISION = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


def launched_world_size() -> int:
    """Processes started by a launcher (torchrun, deepspeed, srun via env); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", 1))


def inference_ds_config(dtype: str) -> dict[str, Any]:
    """ZeRO-3 without an optimizer, in `dtype` (a torch dtype name)."""
    if dtype not in DS_PRECISION:
        raise UserError(f"dtype ({dtype!r}) must be one of {sorted(DS_PRECISION)}")
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    if DS_PRECISION[dtype]:
        ds[DS_PRECISION[dtype]] = {"enabled": True}
    return ds


def load_partitioned_model_dir(path: str, overrides: list[str] | None = None, dtype: str = "float32",
                               expert_parallel: bool = False) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """`load_model_dir` for one rank of a launched group: (model holding this rank's part, root Config,
    tokenizer, meta, the DeepSpeed engine around a ZeRO-3 model, whose hooks gather its parameters while it
    runs: keep it as long as the model; None for expert parallelism)."""
    import deepspeed

    from moep_ds.checkpointing.model_dir import load_recipe, load_weights, tokenizer_and_meta
    from moep_ds.checkpointing.model_state import ExpertLayout
    from moep_ds.models.causal_lm import build_model
    from moep_ds.moe.shard import expert_shard
    from moep_ds.training.distributed import init_distributed
    from moep_ds.training.expert_parallel import (
        expert_parallel_group, expert_stages, routed_module_classes, setup_expert_parallel, shard_of,
    )
    from moep_ds.training.zero3 import check_partitioned, partitioned_construction

    ds = inference_ds_config(dtype)
    world = launched_world_size()
    if expert_parallel:  # checked like a training recipe's: every routed stage's experts divide over the ranks
        model_dir, cfg = load_recipe(path, overrides)
        with torch.device("meta"):
            if not expert_stages(build_model(cfg.model)):
                raise SharedUserError(f"--expert_parallel: {str(model_dir)!r} has no routed experts to shard over "
                                      f"{world} ranks; without it the model is split with ZeRO-3")
        overrides = [*(overrides or []), f"train.expert_parallel_size={world}"]
    model_dir, cfg = load_recipe(path, overrides)
    device = init_distributed()
    ep_group = expert_parallel_group(world) if expert_parallel else None
    with expert_shard(*shard_of(ep_group)), partitioned_construction(ds) if not expert_parallel else nullcontext():
        model = build_model(cfg.model, initialise=False)  # every weight comes from the checkpoint
    if not expert_parallel:
        check_partitioned(model)
    setup_expert_parallel(model, ep_group)
    error = None
    try:
        load_weights(model, model_dir, cfg, partitions=not expert_parallel, ep=ExpertLayout(*shard_of(ep_group)))
    except UserError as err:  # e.g. a file that one node reads differently
        error = err
    stop_together(error, f"checkpoint {str(model_dir)!r}")
    engine = None
    if expert_parallel:
        model.to(device, getattr(torch, dtype))
    else:
        if routed_module_classes(model):  # routing differs between ranks' batches: fetch a routed block as one unit
            deepspeed.utils.set_z3_leaf_modules(model, routed_module_classes(model))
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds, dist_init_required=False)
    model.eval()
    held = "of the experts, the rest whole" if expert_parallel else "of the model (ZeRO-3)"
    log.info("evaluating on %d ranks, each holding 1/%d %s, %s", world, world, held, dtype)
    return model, cfg, *tokenizer_and_meta(model_dir), engine


def stop_together(error: UserError | None, what: str) -> None:
    """Raise on every rank if any rank failed (instead of the others waiting for it in the next collective):
    an error every rank had is reported once, by rank 0; else each failed rank reports its own and the others
    say that another rank failed."""
    failed = torch.tensor([0.0 if error is None else 1.0])
    if dist.get_backend() == "nccl":
        failed = failed.cuda()
    dist.all_reduce(failed)
    count = int(failed.item())
    if count == 0:
        return
    if error is None:
        raise UserError(f"{what} could not be read on {count} other rank(s); their errors are above")
    if count == dist.get_world_size() and isinstance(error, SharedUserError):
        raise error
    raise UserError(str(error)) from None  # reported by this rank, not only by rank 0


def is_partitioned(model: torch.nn.Module) -> bool:
    """Built partitioned (ZeRO-3)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def experts_sharded(model: torch.nn.Module) -> bool:
    """Routed stages hold some of their experts (expert parallel; DeepSpeed's mark of an expert parameter)."""
    return any(getattr(p, "allreduce", True) is False for p in model.parameters())


def split_over_ranks(model: torch.nn.Module) -> bool:
    """Whether the ranks hold parts of `model`: then every rank must run each of its forward passes."""
    return is_partitioned(model) or experts_sharded(model)


def model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.ds_tensor.device if hasattr(p, "ds_id") else p.device


def close_process_group(finished: bool) -> None:
    """At the end of an evaluation command: leave the process group a partitioned evaluation joined, if any,
    together with the other ranks when every rank `finished` (a rank that failed exits, and its launcher stops
    the others)."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


__all__ = ["close_process_group", "experts_sharded", "inference_ds_config", "is_partitioned",
           "launched_world_size", "load_partitioned_model_dir", "model_device", "split_over_ranks"]
