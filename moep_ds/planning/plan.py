"""A run's plan: memory per rank, communication per step and step time of a recipe in one layout, and the search
over layouts.

    gpu, assumed = hardware("h100"), assumptions()
    run = plan_run(cfg, ds, Cluster(64, 8), gpu, assumed)       # the layout the recipe and ds_config give
    runs = search(cfg, ds, Cluster(64, 8), gpu, assumed)       # every fitting layout, fastest first
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from moep_ds.errors import UserError
from moep_ds.planning.comm import CommPlan, comm_plan
from moep_ds.planning.hardware import GIB, Accelerator, Assumptions
from moep_ds.planning.inventory import Inventory, inventory
from moep_ds.planning.layout import Cluster, Layout, make_layout, with_settings, with_zero_stage
from moep_ds.planning.memory import MemoryPlan, memory_plan, trace_dtype
from moep_ds.planning.timing import StepTime, step_time
from moep_ds.planning.trace import StepTrace, trace_step
from moep_ds.training.branch import start_step


TRACES: dict[tuple, StepTrace] = {}  # one traced micro-batch per (model, shape, dtype, checkpointing)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    layout: Layout
    inventory: Inventory
    memory: MemoryPlan
    comm: CommPlan
    time: StepTime
    gpu: Accelerator
    assumed: Assumptions

    @property
    def capacity(self) -> float:
        """Bytes a rank may use: the GPU's memory less the reserve assumed for the CUDA context, NCCL and the
        allocator's fragmentation."""
        return (self.gpu.memory_gib - self.assumed.reserve_gib) * GIB

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.capacity

    def shortfall(self) -> str:
        """Why a layout does not fit, in one line: by how much, and its largest item."""
        over = (self.memory.peak - self.capacity) / GIB
        largest = self.memory.largest
        return (f"does not fit: {self.memory.peak / GIB:.1f} GiB per rank, {over:.1f} GiB over the "
                f"{self.capacity / GIB:.0f} GiB usable of {self.gpu.name} ({self.gpu.memory_gib:g} GiB less "
                f"{self.assumed.reserve_gib:g} reserved); largest item: {largest.name} ({largest.bytes / GIB:.1f} GiB)")


def run_steps(cfg) -> int | None:
    """Optimizer steps the recipe runs: to train.exit_at_step or train.max_steps, from its start step (a branch from
    a published checkpoint starts at its revision's step, training/branch.py). None when it counts epochs."""
    last = cfg.train.exit_at_step or cfg.train.max_steps
    if last is None:
        return None
    return max(0, last - start_step(cfg)[0])


def traced(cfg, layout: Layout) -> StepTrace:
    key = (repr(cfg.model), layout.micro_batch, layout.seq_len, layout.precision, layout.activation_checkpointing)
    if key not in TRACES:
        TRACES[key] = trace_step(cfg.model, micro_batch=layout.micro_batch, seq_len=layout.seq_len,
                                 dtype=trace_dtype(layout), checkpointing=layout.activation_checkpointing)
    return TRACES[key]


def plan_layout(cfg, layout: Layout, gpu: Accelerator, assumed: Assumptions,
                memory: MemoryPlan | None = None) -> RunPlan:
    """`memory`: the plan's memory where it is known already (the expert all-to-all's options do not change it)."""
    inv = inventory(cfg, layout.expert_parallel)
    trace = traced(cfg, layout)
    memory = memory or memory_plan(inv, layout, trace, async_save=cfg.train.checkpoint.async_save)
    comm = comm_plan(inv, layout, trace)
    return RunPlan(layout, inv, memory, comm,
                   step_time(inv, layout, comm, gpu, assumed, run_steps(cfg), trace.routed), gpu, assumed)


def plan_run(cfg, ds: dict[str, Any], cluster: Cluster, gpu: Accelerator, assumed: Assumptions) -> RunPlan:
    """The plan of the layout `cfg` and `ds` give on `cluster` (one-line errors for a layout that cannot exist)."""
    return plan_layout(cfg, make_layout(cfg, ds, cluster), gpu, assumed)


def recipe_global_batch(cfg, ds: dict[str, Any], cluster: Cluster) -> int:
    """Sequences per step: the recipe's train.global_batch_size, the ds_config's train_batch_size, or what its
    micro-batch and accumulation make on `cluster`."""
    given = cfg.train.global_batch_size or ds.get("train_batch_size")
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    return make_layout(cfg, ds, cluster).global_batch


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg, ds: dict[str, Any], cluster: Cluster, global_batch: int) -> list[Layout]:
    """Every layout of data x expert parallelism, ZeRO stage (1 and 2 with overlap_comm off and on, the others as
    `ds` sets it), micro-batch, activation checkpointing and expert all-to-all options (`comm_choices`,
    OVERLAP_CHOICES chunks) that training accepts for `global_batch` sequences per step (the recipe's)."""
    from moep_ds.models.plan import routed_stages

    stages = routed_stages(cfg.model)
    eps = [ep for ep in divisors(cluster.gpus) if all(s.num_experts % ep == 0 for s in stages)] if stages else [1]
    per_rank = global_batch // cluster.gpus if global_batch % cluster.gpus == 0 else 0
    fp8_ok = fp8_accepted(cfg)
    layouts = []
    for ep in eps:
        for (stage, overlap), micro, checkpointing in itertools.product(ZERO_CHOICES, divisors(per_rank) if per_rank
                                                                        else [], (False, True)):
            for comm in comm_choices(ep, cluster, fp8_ok):
                recipe = with_settings(cfg, expert_parallel=ep, micro_batch=micro, global_batch=global_batch,
                                       activation_checkpointing=checkpointing, expert_comm=comm)
                try:
                    layout = make_layout(recipe, with_zero_stage(ds, stage, overlap), cluster)
                except UserError:
                    continue  # a combination training refuses (e.g. ZeRO-3 with expert parallelism)
                chunks = OVERLAP_CHOICES if ep > 1 else (1,)
                layouts += [dataclasses.replace(layout, expert_overlap_chunks=c) for c in chunks]
    return layouts


# (ZeRO stage, overlap_comm) a search tries; None: as the ds_config says (ZeRO-0 has no such setting; ZeRO-3 is
# searched as the ds_config leaves it, DeepSpeed's default there being true)
ZERO_CHOICES = ((0, None), (1, False), (1, True), (2, False), (2, True), (3, None))
OVERLAP_CHOICES = (1, 2, 4)  # train.expert_comm.overlap_chunks a search tries (planning/timing.py: why only a few)


def fp8_accepted(cfg) -> bool:
    """Whether training accepts train.expert_comm.fp8_dispatch for this model (every dispatched width a multiple of
    128: distributed/expert_parallel.py check_fp8_dispatch)."""
    from moep_ds.distributed.expert_parallel import check_fp8_dispatch

    comm = dataclasses.replace(cfg.train.expert_comm, fp8_dispatch=True)
    try:
        check_fp8_dispatch(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, expert_comm=comm)))
    except UserError:
        return False
    return True


def comm_choices(ep: int, cluster: Cluster, fp8_ok: bool) -> list[dict[str, Any]]:
    """The train.expert_comm settings a search tries at expert parallelism `ep` (the recipe's own without it): per
    expert or once per rank, node-aware where the group spans nodes (it needs once per rank), FP8 dispatch where
    the widths allow it; training's checks (make_layout) refuse what cannot run."""
    if ep == 1:
        return [{}]
    routes = [(False, False), (True, False)] + [(True, True)] * (ep > cluster.gpus_per_node)
    return [{"dedup": dedup, "node_aware": nodes, "fp8_dispatch": fp8}
            for dedup, nodes in routes for fp8 in (False, True)[:1 + fp8_ok]]


def search(cfg, ds: dict[str, Any], cluster: Cluster, gpu: Accelerator, assumed: Assumptions,
           global_batch: int) -> list[RunPlan]:
    """Every candidate layout planned, fastest first (those that fit and those that do not). The chunks of the
    overlapped all-to-all change no memory the plan counts: one memory plan serves every choice of them."""
    plans, memory = [], {}
    for layout in candidate_layouts(cfg, ds, cluster, global_batch):
        key = dataclasses.replace(layout, expert_overlap_chunks=1)
        plans.append(plan_layout(cfg, layout, gpu, assumed, memory.get(key)))
        memory[key] = plans[-1].memory
    return sorted(plans, key=lambda p: (p.time.step_s, p.memory.peak))  # ties: the more headroom first


__all__ = ["OVERLAP_CHOICES", "ZERO_CHOICES", "RunPlan", "candidate_layouts", "comm_choices", "plan_layout", "plan_run",
           "recipe_global_batch", "run_steps", "search"]
