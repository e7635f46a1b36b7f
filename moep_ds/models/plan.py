"""The expert-parallel plan of a model: every routed stage of its recipe, checked against the plan's size once.

    plan = plan_for(cfg.model, size=2, rank=1, group=ep_group)   # distributed/expert_parallel.py on each rank
    check_routed_layout(cfg.model, ep_size)                        # config.py / a stored recipe, when read
    model = build_model(cfg.model, plan=plan)

A block config lists its routed stages with `routed_stages(path) -> list[RoutedStage]` (blocks/ffn_moe.py,
ssm_moe.py, msit.py, paths.py); the plan (moe/plan.py) refuses a stage whose experts `size` does not divide, naming
the recipe field and its value.
"""
from __future__ import annotations

from typing import Any

from moep_ds.models.config import ModelConfig, layer_entries
from moep_ds.moe.layer import check_lifecycle_placement
from moep_ds.moe.plan import ExpertParallelPlan, RoutedStage


def routed_stages(cfg: ModelConfig) -> tuple[RoutedStage, ...]:
    """Every routed stage of the model's recipe, in layer order (a repeated entry once)."""
    return tuple(stage for path, layer in layer_entries(cfg.layers, "model") if hasattr(layer, "routed_stages")
                 for stage in layer.routed_stages(path))


def plan_for(cfg: ModelConfig, size: int = 1, rank: int = 0, group: Any = None) -> ExpertParallelPlan:
    """The plan of rank `rank` of `size` expert-parallel processes (`group`: theirs, None on one process)."""
    return ExpertParallelPlan(size=size, rank=rank, stages=routed_stages(cfg), group=group)


def check_routed_layout(cfg: ModelConfig, expert_parallel_size: int = 1) -> None:
    """A recipe's routed stages as a run or a stored checkpoint needs them: lifecycle managers only where an MoE layer
    carries them, and every stage's experts dividing over `expert_parallel_size` (the plan's one check)."""
    for layer_path, layer in layer_entries(cfg.layers, "model"):
        check_lifecycle_placement(layer, layer_path)
    plan_for(cfg, expert_parallel_size)


def check_plan(cfg: ModelConfig, plan: ExpertParallelPlan) -> None:
    """A plan that shards experts must have been made for this model (`plan_for`)."""
    if plan.size > 1 and plan.stages != routed_stages(cfg):
        raise ValueError(f"the expert-parallel plan (size {plan.size}) was not made for this model's routed stages; "
                         "make it with models.plan.plan_for(model_cfg, ...)")


__all__ = ["check_plan", "check_routed_layout", "plan_for", "routed_stages"]
