"""Evaluation on several processes without any of them holding the whole model.

    torchrun --nproc_per_node N -m moep_ds.cli.eval runs/x ...          (or deepspeed --num_gpus N
    --module moep_ds.cli.eval ..., or lm_eval_cli under either launcher)

Under a launcher (WORLD_SIZE > 1) the model is split over the ranks in one of two ways (distributed/inference.py):

  ZeRO-3 (default)   built inside `deepspeed.zero.Init`; every rank reads only its partition of each weight from
                     the checkpoint (of a stored tensor larger than that, one at a time), and a DeepSpeed engine
                     without an optimizer gathers each module's parameters while it runs (each routed block as one
                     unit, as in training) and frees them after. Any model.
  expert parallel    (`expert_parallel`) every routed stage built with this rank's 1/N of the experts only
                     (moe/shard.py) and the tokens sent to their experts' ranks (all-to-all), as in training at
                     expert_parallel_size N; the other parameters are whole on every rank. No expert is ever
                     gathered; MoE models only.

Every rank sees every request, as lm-eval expects of a model split over ranks (it reports and writes on local
rank 0);
the harness spreads the scoring batches over the ranks, every rank runs each forward pass, the scores are
gathered, and generation decodes in lockstep with rank 0's tokens (evaluation/harness.py, generate.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from moep_ds.errors import SharedUserError
from moep_ds.distributed.launcher import launched_world_size

log = logging.getLogger(__name__)

def load_partitioned_model_dir(path: str, overrides: list[str] | None = None, dtype: str = "float32",
                               expert_parallel: bool = False) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """`load_model_dir` for one rank of a launched group: (model holding this rank's part, root Config,
    tokenizer, meta, the DeepSpeed engine around a ZeRO-3 model, whose hooks gather its parameters while it
    runs: keep it as long as the model; None for expert parallelism). `distributed/inference.py` splits it."""
    from moep_ds.checkpointing.model_dir import load_recipe, tokenizer_and_meta
    from moep_ds.models.causal_lm import build_model
    from moep_ds.distributed.expert_parallel import expert_stages
    from moep_ds.distributed.inference import inference_ds_config, split_model

    inference_ds_config(dtype)  # a bad dtype is one line before anything is read
    world = launched_world_size()
    model_dir, cfg = load_recipe(path, overrides)  # a run directory resolves (and logs) once
    if expert_parallel:  # checked like a training recipe's: every routed stage's experts divide over the ranks
        with torch.device("meta"):
            if not expert_stages(build_model(cfg.model)):
                raise SharedUserError(f"--expert_parallel: {str(model_dir)!r} has no routed experts to shard over "
                                      f"{world} ranks; without it the model is split with ZeRO-3")
        _, cfg = load_recipe(model_dir, [*(overrides or []), f"train.expert_parallel_size={world}"])
    model, engine = split_model(cfg, model_dir, dtype, expert_parallel)
    return model, cfg, *tokenizer_and_meta(model_dir), engine


def load_eval_model(path: str, overrides: list[str] | None = None, dtype: str = "float32",
                    expert_parallel: bool = False) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """(model, root Config, tokenizer, meta, engine) for evaluation: under a launcher split over the ranks
    (`load_partitioned_model_dir`), in one process the whole model (`load_model_dir`, engine None)."""
    from moep_ds.checkpointing.model_dir import load_model_dir

    if launched_world_size() > 1:
        return load_partitioned_model_dir(path, overrides, dtype, expert_parallel)
    if expert_parallel:
        log.warning("expert_parallel ignored: one process holds every expert")
    return (*load_model_dir(path, overrides), None)


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


__all__ = ["experts_sharded", "is_partitioned", "load_eval_model", "load_partitioned_model_dir", "model_device",
           "split_over_ranks"]
