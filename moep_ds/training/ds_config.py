"""The DeepSpeed JSON config, reconciled with the recipe.

The JSON owns batch sizes, ZeRO stage, precision, clipping and offload; the recipe owns model, data,
optimizer and schedule. The recipe may state micro/global batch size and clipping: those fill values the
JSON leaves out (or sets to "auto") and must agree with values it sets. Any disagreement is an error.
Activation checkpointing and compilation are the recipe's alone (train.activation_checkpointing,
train.compile): a JSON with DeepSpeed's own `activation_checkpointing` or `compile` section is refused.

Everything else `reconcile` adds only fills keys the JSON leaves out or sets to "auto"; a value the user wrote is
never replaced (one that cannot work, such as contiguous_gradients false for ZeRO-1/2 with expert parallelism,
is an error). `zero_optimization.contiguous_gradients: "auto"` (the shipped ZeRO-1/2 JSONs) means false, the
faster setting for these models on one device (ds_configs/README.md), except under ZeRO-1/2 with expert
parallelism: only DeepSpeed's contiguous, reduce-scattered path averages an expert's gradient over its
expert-data-parallel group; the other path all-reduces every gradient over the whole data-parallel group, which
adds up the gradients of different experts held by different ranks.
"""
from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

from moep_ds.distributed.ds_fields import DeepSpeedConfigError, precision, zero_stage  # noqa: F401 - re-exported
from moep_ds.errors import UserError
from moep_ds.train_config import TrainConfig

# recipe field -> DeepSpeed key
SHARED_KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "global_batch_size": "train_batch_size",
    "grad_clip": "gradient_clipping",
}

DEFAULTS: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0},
}


class DeepSpeedConfigFileError(UserError):
    """--ds_config cannot be read as a JSON object here: a path one node lacks (or holds another file at) fails on
    that node's ranks only, so each rank reports it."""


def read_ds_config(path: str | dict | None) -> dict[str, Any]:
    if path is None:
        return {}
    if isinstance(path, dict):
        return copy.deepcopy(path)
    p = pathlib.Path(path)
    if not p.is_file():
        raise DeepSpeedConfigFileError(f"--ds_config {path!r} does not exist")
    try:
        cfg = json.loads(p.read_text(), object_pairs_hook=no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigFileError(f"--ds_config {path!r} is not valid JSON: {err}") from None
    except DuplicateKey as err:
        raise DeepSpeedConfigFileError(f"--ds_config {path!r}: key {err.args[0]!r} is given twice in one object "
                                       "(JSON readers keep the last silently)") from None
    if not isinstance(cfg, dict):
        raise DeepSpeedConfigFileError(f"--ds_config {path!r} must hold a JSON object")
    return cfg


class DuplicateKey(ValueError):
    pass


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def is_unset(value: Any) -> bool:
    return value is None or value == "auto"


# DeepSpeed section -> the recipe field that owns it
RECIPE_SECTIONS = {
    "optimizer": "train.optimizer",
    "scheduler": "train.schedule",
    "activation_checkpointing": "train.activation_checkpointing",
    "compile": "train.compile",
}


def reconcile(ds: dict[str, Any], train: TrainConfig, world_size: int) -> dict[str, Any]:
    """A complete DeepSpeed config for `world_size` data-parallel ranks, or a one-line error."""
    ds = copy.deepcopy(ds)
    for section, owner in RECIPE_SECTIONS.items():
        if section in ds:
            raise DeepSpeedConfigError(
                f"ds_config {section!r}: the recipe's {owner} owns it; remove the section from the DeepSpeed config"
            )
    check_reconciled_keys(ds)
    for field, key in SHARED_KEYS.items():
        ours = getattr(train, field)
        theirs = ds.get(key)
        if ours is not None and not is_unset(theirs) and theirs != ours:
            raise DeepSpeedConfigError(
                f"train.{field} ({ours}) conflicts with ds_config {key} ({theirs}); set it in one place"
            )
        if is_unset(theirs):
            if ours is not None:
                ds[key] = ours
            else:
                ds.pop(key, None)
    fill_batch_sizes(ds, world_size)
    if is_unset(ds.get("gradient_clipping")):
        ds["gradient_clipping"] = DEFAULTS["gradient_clipping"]
    ds.setdefault("zero_optimization", dict(DEFAULTS["zero_optimization"]))
    fill_zero_settings(ds["zero_optimization"], train.expert_parallel_size)
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise DeepSpeedConfigError("ds_config enables both fp16 and bf16; choose one")
    # A client torch optimizer (AdamW): no FusedAdam build, same numerics on every backend.
    ds.setdefault("zero_allow_untested_optimizer", True)
    if ds["zero_optimization"].get("offload_optimizer"):
        # DeepSpeed refuses a client optimizer under optimizer offload unless told otherwise (it expects its CPU
        # Adam build); the recipe's AdamW is torch's fused kernel, which runs on the offloaded CPU partitions
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    ds.setdefault("steps_per_print", 10**9)
    ds.setdefault("wall_clock_breakdown", False)
    return ds


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def check_reconciled_keys(ds: dict[str, Any]) -> None:
    """The values `reconcile` computes with, checked before it does (DeepSpeed validates the rest later, in
    `check_with_deepspeed`): a string batch size would otherwise end in a TypeError traceback."""
    for section in ("zero_optimization", "fp16", "bf16"):
        if section in ds and not isinstance(ds[section], dict):
            raise DeepSpeedConfigError(f"ds_config {section} ({json.dumps(ds[section])}) must be a JSON object")
    for key in BATCH_KEYS:
        value = ds.get(key)
        if not is_unset(value) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DeepSpeedConfigError(f'ds_config {key} ({json.dumps(value)}) must be a positive integer or "auto"')
    clip = ds.get("gradient_clipping")
    if not is_unset(clip) and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise DeepSpeedConfigError(f'ds_config gradient_clipping ({json.dumps(clip)}) must be a number >= 0 or "auto"')
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if isinstance(stage, bool) or str(stage) not in ("0", "1", "2", "3"):
        raise DeepSpeedConfigError(f"ds_config zero_optimization.stage ({json.dumps(stage)}) must be 0, 1, 2 or 3")


def fill_zero_settings(zero: dict[str, Any], expert_parallel_size: int) -> None:
    """Resolve "auto" ZeRO settings; refuse user-written ones that DeepSpeed's MoE support cannot run."""
    stage = int(zero.get("stage", 0))
    needs_contiguous = stage in (1, 2) and expert_parallel_size > 1  # module docstring
    if is_unset(zero.get("contiguous_gradients", True)):
        # false is faster for these models (fewer copies into the contiguous buffer; ds_configs/README.md)
        zero["contiguous_gradients"] = needs_contiguous
    if is_unset(zero.get("reduce_scatter", True)):
        zero["reduce_scatter"] = True
    if needs_contiguous:
        for key in ("contiguous_gradients", "reduce_scatter"):
            if zero.get(key) is False:
                raise DeepSpeedConfigError(
                    f"ds_config zero_optimization.{key} (false) must be true for ZeRO stage {stage} with "
                    f"train.expert_parallel_size ({expert_parallel_size}); DeepSpeed averages expert gradients "
                    f"over their expert-data-parallel group only then"
                )


def fill_batch_sizes(ds: dict[str, Any], world_size: int) -> None:
    """train_batch_size = micro x accumulation x data-parallel size; derive a missing one, check all three."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    accum = ds.get("gradient_accumulation_steps")
    total = ds.get("train_batch_size")
    given = {k: v for k, v in (("micro", micro), ("accum", accum), ("total", total)) if not is_unset(v)}
    if "micro" not in given and "total" not in given:
        micro = DEFAULTS["train_micro_batch_size_per_gpu"]
    if is_unset(accum):
        if not is_unset(total) and not is_unset(micro):
            accum, rem = divmod(total, micro * world_size)
            if rem or accum == 0:
                raise DeepSpeedConfigError(
                    f"ds_config train_batch_size ({total}) is not a multiple of train_micro_batch_size_per_gpu "
                    f"({micro}) x data-parallel size ({world_size})"
                )
        else:
            accum = 1
    if is_unset(micro):
        micro, rem = divmod(total, accum * world_size)
        if rem or micro == 0:
            raise DeepSpeedConfigError(
                f"ds_config train_batch_size ({total}) is not a multiple of gradient_accumulation_steps ({accum}) "
                f"x data-parallel size ({world_size})"
            )
    expected = micro * accum * world_size
    if not is_unset(total) and total != expected:
        raise DeepSpeedConfigError(
            f"ds_config train_batch_size ({total}) != train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x data-parallel size ({world_size}) = {expected}"
        )
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=expected)
