"""A resumed run keeps its checkpoint's global batch size.

The global batch G is part of what a run trains (with the lr schedule it sets the optimisation), and the data
position is counted in global batches. A checkpoint of 2 processes with micro-batch 8 (G = 16) resumed on 1
process would otherwise train with G = 8. So on resume, when neither the recipe (train.global_batch_size) nor the
DeepSpeed JSON (train_batch_size, or micro-batch and gradient_accumulation_steps both given) fixes G, G is the
checkpoint's and DeepSpeed's gradient accumulation (or, without a micro-batch size, the micro-batch) adapts to
the new number of processes. A recipe or JSON that fixes another G is refused with one line, unless
--allow_batch_change: then the run continues with the new G from the exact sample the checkpoint reached
(BatchLoader.load_state_dict with the saved G), replaying and skipping nothing. The checkpoint is the one the run
resumes (training/assemble.py reconciles the config for each candidate it tries, with the state it read once).
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

from moep_ds.errors import SharedUserError
from moep_ds.train_config import TrainConfig
from moep_ds.training.ds_config import DeepSpeedConfigError, reconcile
from moep_ds.training.trainer_state import TrainerState

log = logging.getLogger(__name__)


def reconcile_resumed(raw_ds: dict[str, Any], train: TrainConfig, world_size: int,
                      found: tuple[pathlib.Path, TrainerState] | None,
                      allow_batch_change: bool = False) -> dict[str, Any]:
    """`reconcile(raw_ds, train, world_size)`, with the global batch of the checkpoint resumed, `found` = (its path,
    its trainer state; None for a fresh start), where nothing fixes it."""
    fresh = reconcile(raw_ds, train, world_size)
    saved = found[1].global_batch_size if found else None
    if saved is None or fresh["train_batch_size"] == saved:
        return fresh
    ckpt = found[0]
    kept = None
    if train.global_batch_size is None and raw_ds.get("train_batch_size") in (None, "auto"):
        try:
            kept = reconcile({**raw_ds, "train_batch_size": saved}, train, world_size)
        except DeepSpeedConfigError:
            kept = None  # micro-batch and accumulation are both given, or do not divide the saved global batch
    if kept is not None:
        log.info("resuming %s: global batch %d kept on %d processes (micro-batch %d x gradient accumulation %d)",
                 ckpt, saved, world_size, kept["train_micro_batch_size_per_gpu"], kept["gradient_accumulation_steps"])
        return kept
    given = (f"train.global_batch_size ({train.global_batch_size})" if train.global_batch_size is not None else
             f"ds_config train_batch_size ({raw_ds['train_batch_size']})" if raw_ds.get("train_batch_size")
             not in (None, "auto") else
             f"train_micro_batch_size_per_gpu ({fresh['train_micro_batch_size_per_gpu']}) x "
             f"gradient_accumulation_steps ({fresh['gradient_accumulation_steps']}) x {world_size} processes")
    if not allow_batch_change:
        raise SharedUserError(
            f"checkpoint {str(ckpt)!r} was trained with global batch {saved}, this run's {given} = "
            f"{fresh['train_batch_size']}: {keep_advice(raw_ds, train, world_size, saved)}, or pass "
            f"--allow_batch_change to continue with {fresh['train_batch_size']} from the sample reached")
    log.warning("--allow_batch_change: resuming %s (global batch %d) with global batch %d, from the sample it reached",
                ckpt, saved, fresh["train_batch_size"])
    return fresh


def keep_advice(raw_ds: dict[str, Any], train: TrainConfig, world_size: int, saved: int) -> str:
    """What to change to keep the saved global batch: the setting that fixes another one, or, where the global
    batch is left to adapt, the micro-batch that does not divide its share of each process."""
    unset = (None, "auto")
    if (train.global_batch_size is not None or raw_ds.get("train_batch_size") not in unset
            or raw_ds.get("gradient_accumulation_steps") not in unset):
        return (f'leave the global batch unset (ds_config gradient_accumulation_steps "auto", no train_batch_size) '
                f"to keep {saved}")
    if saved % world_size:
        return f"resume on a number of processes that divides {saved} to keep it"
    share = saved // world_size
    if train.micro_batch_size is not None:
        field, micro, how = "train.micro_batch_size", train.micro_batch_size, "--set train.micro_batch_size={}"
    else:
        field, micro = "ds_config train_micro_batch_size_per_gpu", raw_ds["train_micro_batch_size_per_gpu"]
        how = "train_micro_batch_size_per_gpu {} in the ds_config"
    fits = max(d for d in range(1, min(micro, share) + 1) if share % d == 0)
    return (f"{field} ({micro}) must divide {share} ({saved} / {world_size} processes) to keep {saved} "
            f"(e.g. {how.format(fits)})")
