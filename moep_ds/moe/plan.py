"""Expert parallelism as one value: which experts this process holds, checked once and handed to the model.

# E experts of a routed stage, L = E / size experts held by one process

    plan = plan_for(cfg.model, size=2, rank=1, group=ep_group)   # models/plan.py (distributed/ makes the group)
    model = build_model(cfg.model, plan=plan)                    # every routed stage holds experts [L, 2L) only

The plan is the one form of expert parallelism below the trainer: sizes (`size`, this process's `rank`, every
routed stage's number of experts), this rank's experts (`held`, `local_experts`) and the process group its
stages exchange tokens over (None on one process, or when a plan only describes a shard). It is validated once,
when it is made: a stage whose experts do not divide among `size` processes is a one-line error naming the
recipe field and its value. Constructors receive it explicitly (`build_model` -> block -> routed stage); a
stage asks it for its experts only (`held`). distributed/expert_parallel.py then sends each stage's tokens to their
experts' ranks over the plan's group (moe/all_to_all.py). Model code never imports deepspeed or torch.distributed
for it: the group is opaque here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from moep_ds.schema import fail

SIZE_FIELD = "train.expert_parallel_size"  # the recipe field that sets `size`


@dataclasses.dataclass(frozen=True)
class RoutedStage:
    """A routed stage's number of experts as the recipe sets it (one entry per config field, repeats not
    unrolled: the MoEP paths block's projection count serves its contraction and its expansion)."""

    field: str  # dotted recipe path, e.g. "model.layers[1].moe.num_experts"
    value: Any  # the value there (a count, or MSIT's list of windows)
    num_experts: int
    note: str = ""  # why `value` gives `num_experts` experts, said in the error

    def problem(self, size: int) -> str:
        divisible = "be divisible" if self.value == self.num_experts else "have a length divisible"
        return f"must {divisible} by expert_parallel_size ({size})" + (f": {self.note}" if self.note else "")


@dataclasses.dataclass(frozen=True)
class ExpertParallelPlan:
    """`size` processes share every routed stage's experts; this one (`rank`) holds experts [rank*L, (rank+1)*L).

    `stages`: the model's routed stages (`models.plan.plan_for`), or None for a plan that is not tied to a model
    (a lone stage in a test, `shard_experts`). `group`: the process group of the `size` processes, in rank order."""

    size: int = 1
    rank: int = 0
    stages: tuple[RoutedStage, ...] | None = None
    group: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            fail(SIZE_FIELD, self.size, "must be an integer >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            fail("expert-parallel rank", self.rank, f"must be in [0, {self.size})")
        if self.stages is None:
            return
        for stage in self.stages:
            if stage.num_experts % self.size:
                fail(stage.field, stage.value, stage.problem(self.size))
        if self.size > 1 and not self.stages:
            fail(SIZE_FIELD, self.size, "must be 1: the model has no routed experts to shard")

    def held(self, num_experts: int) -> range:
        """Global indices of the experts this process holds of a stage of `num_experts`."""
        # validated when the plan was made (a plan without `stages` serves stages its maker checked)
        assert num_experts % self.size == 0, f"{num_experts} experts on {self.size} processes"
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def local_experts(self) -> dict[str, range]:
        """This rank's experts of every routed stage, by the recipe field that sets its number of experts."""
        return {stage.field: self.held(stage.num_experts) for stage in self.stages or ()}


SINGLE_PROCESS = ExpertParallelPlan()  # every expert here, no group


__all__ = ["SINGLE_PROCESS", "SIZE_FIELD", "ExpertParallelPlan", "RoutedStage"]
