"""What the trainer checks and builds before its first step: the output folder, the number of steps, the peak
FLOP/s of the device, this rank's part of the model, the validation windows, damaged checkpoints set aside."""
from __future__ import annotations

import logging
import math
import pathlib
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from moep_ds.checkpointing import layout, sharded
from moep_ds.data.errors import DataError
from moep_ds.errors import SharedUserError, UserError
from moep_ds.models.causal_lm import build_model
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.distributed.ds_fields import zero_stage
from moep_ds.distributed.zero3 import check_partitioned, gathered_for_init, partitioned_construction

if TYPE_CHECKING:
    from moep_ds.train_config import TrainConfig

log = logging.getLogger(__name__)

PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def check_output_dir(output_dir: str) -> pathlib.Path:
    """train.output_dir must be writable on every rank, checked before any data preparation."""
    error = None
    try:
        path = layout.check_writable(output_dir, "train.output_dir")
    except UserError as err:
        error = err
    if not sharded.agree(error is None):
        raise SharedUserError(
            str(error) if error else f"train.output_dir ({output_dir!r}) is not writable on every rank")
    return path


def total_steps(train: TrainConfig, num_windows: int, global_batch: int) -> int:
    if train.max_steps is not None:
        if train.epochs is not None:  # e.g. --set train.max_steps=5 for a smoke test of an epochs recipe
            log.warning("train.max_steps (%d) overrides train.epochs (%g), as max_steps does in HF's Trainer",
                        train.max_steps, train.epochs)
        return train.max_steps
    if train.epochs is None:
        raise SharedUserError("train.max_steps (None) must be set when train.epochs is not")
    # an epoch is the full global batches only (BatchLoader drops the incomplete last one): 2 epochs of 12.5
    # batches are 24 steps, not 25 (the 25th would be the first batch of a third epoch); round() keeps e.g.
    # 0.29 x 100 = 28.999999999999996 at 29
    return max(1, math.floor(round(train.epochs * (num_windows // global_batch), 9)))


def peak_flops(train: TrainConfig, device: torch.device) -> float | None:
    if train.peak_tflops is not None:
        return train.peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v * 1e12 for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)
    return None


def build_rank_model(model_cfg, ds: dict, seed: int, plan: ExpertParallelPlan = SINGLE_PROCESS):
    """What this rank holds of the model: the experts its plan holds only and, under ZeRO-3, its partition of
    every parameter only (distributed/zero3.py). The weights depend on the seed alone: equal on every rank, at every
    expert-parallel size and ZeRO stage (rounded to the working precision)."""
    zero3 = zero_stage(ds) == 3
    with partitioned_construction(ds) if zero3 else nullcontext():
        model = build_model(model_cfg, plan=plan, initialise=False)
    if zero3:
        check_partitioned(model)
    torch.manual_seed(seed)  # not what construction drew, which differs with the sharding
    model.init_weights(gathered_for_init if zero3 else None)
    return model


def scored_windows(num_windows: int, eval_batches: int, ds: dict, path, eval_every: int) -> int:
    """How many validation windows an evaluation scores: the first `eval_batches` global batches (train.eval_batches),
    or all whole global batches of a smaller split. Whole global batches, so the same windows at any number of ranks
    (a global batch divides into micro-batches x ranks for any split of it); fewer than one is refused."""
    batch = ds["train_batch_size"]
    if num_windows < batch:
        raise DataError(f"train.eval_every ({eval_every}): {num_windows} validation windows in {str(path)!r} "
                        f"are fewer than one global batch ({batch}); hold out more (data.val_fraction) or give a "
                        "data.val_source")
    return min(eval_batches, num_windows // batch) * batch


def set_aside(damaged: list[pathlib.Path]) -> None:
    """Rename the damaged checkpoints `--resume auto` skipped (all newer than the one it resumed from) to
    `<name>.damaged`: kept for inspection, but no longer counted by keep_last, which would otherwise delete
    usable checkpoints while it kept these."""
    for ckpt in damaged:
        target = ckpt.with_name(f"{ckpt.name}.damaged")
        n = 1
        while target.exists():
            n += 1
            target = ckpt.with_name(f"{ckpt.name}.damaged{n}")
        try:
            ckpt.rename(target)
        except OSError as err:  # best effort: the other ranks are already on their way to the engine's collectives
            log.warning("could not move the damaged checkpoint %s aside (%s); keep_last still counts it", ckpt, err)
            continue
        log.warning("moved the damaged checkpoint %s aside to %s", ckpt, target.name)
