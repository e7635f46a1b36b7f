"""Evaluation on several processes without any of them holding the whole model (ZeRO-3 inference).

    torchrun --nproc_per_node N -m moep_ds.evaluation.run_eval runs/x ...          (or deepspeed --num_gpus N
    --module moep_ds.evaluation.run_eval ..., or lm_eval_cli under either launcher)

Under a launcher (WORLD_SIZE > 1) the model is built inside `deepspeed.zero.Init` (training/zero3.py), every
rank reads only its partition of each weight from the checkpoint (`checkpointing.model_dir.load_weights`), and a
DeepSpeed engine without an optimizer gathers each module's parameters while it runs (each routed block as one
unit, as in training) and frees them after. Every rank sees every request, as lm-eval expects of a model split
over ranks (it reports and writes on rank 0); the harness spreads the scoring batches over the ranks and
gathers the scores, and generation decodes in lockstep with rank 0's tokens (evaluation/harness.py).
"""
from __future__ import annotations

import logging
import os
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


def load_partitioned_model_dir(path: str, overrides: list[str] | None = None, dtype: str = "float32"
                               ) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """`load_model_dir` for one rank of a launched group: (model holding this rank's partitions, root Config,
    tokenizer, meta, the DeepSpeed engine around the model, whose hooks gather its parameters while it runs:
    keep it as long as the model). The engine's `device` is this rank's."""
    import deepspeed

    from moep_ds.checkpointing.model_dir import load_recipe, load_weights, tokenizer_and_meta
    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.distributed import init_distributed
    from moep_ds.training.expert_parallel import routed_module_classes
    from moep_ds.training.zero3 import check_partitioned, partitioned_construction

    ds = inference_ds_config(dtype)
    init_distributed()
    model_dir, cfg = load_recipe(path, overrides)
    with partitioned_construction(ds):
        model = build_model(cfg.model, initialise=False)  # every weight comes from the checkpoint
    check_partitioned(model)
    error = None
    try:
        load_weights(model, model_dir, cfg, partitions=True)
    except UserError as err:  # e.g. a file that one node reads differently
        error = err
    stop_together(error, f"checkpoint {str(model_dir)!r}")
    if routed_module_classes(model):  # routing differs between ranks' batches: fetch a routed block as one unit
        deepspeed.utils.set_z3_leaf_modules(model, routed_module_classes(model))
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds, dist_init_required=False)
    model.eval()
    log.info("evaluating on %d ranks, each holding 1/%d of the model (ZeRO-3), %s", dist.get_world_size(),
             dist.get_world_size(), dtype)
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
    return any(hasattr(p, "ds_id") for p in model.parameters())


def close_process_group(finished: bool) -> None:
    """At the end of an evaluation command: leave the process group a partitioned evaluation joined, if any,
    together with the other ranks when every rank `finished` (a rank that failed exits, and its launcher stops
    the others)."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


__all__ = ["close_process_group", "inference_ds_config", "is_partitioned", "launched_world_size",
           "load_partitioned_model_dir"]
