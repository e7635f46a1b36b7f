"""AdamW parameter groups and the learning-rate schedule: warmup + cosine (or linear/constant), or GPT-NeoX v1.0's
AnnealingLR (Pythia's); an optional re-warm-up for a run that starts at a later step."""
from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from moep_ds.moe.shard import EXPERT_ROWS, full_shape
from moep_ds.train_config import OptimizerConfig, ScheduleConfig


def no_decay(param: nn.Parameter, embedding_ids: set[int], exempt: list[str]) -> bool:
    """Whether `param` is exempt from weight decay: 1-D per layer or per expert (biases, norm scales; a stacked
    expert parameter's first dim is its experts: the experts' biases [E, F] are E 1-D biases, as Megatron-Core's
    grouped experts exempt theirs) and/or an embedding table."""
    dims = len(full_shape(param)) - (1 if hasattr(param, EXPERT_ROWS) else 0)
    return ("1d" in exempt and dims < 2) or ("embedding" in exempt and id(param) in embedding_ids)


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, keep = [], []
    for p in model.parameters():
        if p.requires_grad:
            (keep if no_decay(p, embedding_ids, cfg.no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
              {"params": keep, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    # fused: one kernel per tensor on CPU and GPU (torch's counterpart of DeepSpeed's FusedAdam, nothing to build);
    # 4x faster than the per-op update on DeepSpeed's flat ZeRO partitions on CPU (bench/RESULTS.md)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int, start_step: int = 0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based: the step taken after `step` steps). A run
    that starts at `start_step` ramps up to the schedule over its first `cfg.rewarmup_steps` steps."""
    k = cfg.rewarmup_steps
    if k and start_step <= step < start_step + k:
        return schedule_multiplier(start_step + k, cfg, max_steps) * (step - start_step + 1) / k
    return schedule_multiplier(step, cfg, max_steps)


def schedule_multiplier(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    if cfg.kind == "neox_annealing":
        return neox_annealing(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if cfg.kind == "cosine" else 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def neox_annealing(step: int, warmup: int, end: int, min_ratio: float) -> float:
    """GPT-NeoX v1.0's AnnealingLR.get_lr (megatron/learning_rates.py, decay_style "cosine"), divided by the peak lr,
    at num_iters = `step`. GPT-NeoX builds it at num_iters 0 and DeepSpeed steps it after each optimizer step
    (not after an fp16 step skipped for overflow, as here), so the step taken at iteration s runs at
    get_lr(num_iters=s): 0 at the first step, the peak at s = warmup."""
    n = min(step, end - warmup)
    if warmup > 0 and step <= warmup:
        return n / warmup
    return max(0.5 * (math.cos(math.pi * (n - warmup) / end) + 1), min_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, max_steps: int, start_step: int = 0):
    """LambdaLR whose counter is the run's step: at `start_step` for a run that starts there (the optimizer's lr
    set from it), so that the engine's one step per optimizer step and a checkpoint's counter stay the step."""
    scheduler = LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, max_steps, start_step))
    if start_step:
        scheduler.last_epoch = start_step - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
            scheduler.step()
    return scheduler
