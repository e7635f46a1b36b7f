"""A layout: how a recipe runs on a cluster shape. GPUs and GPUs per node, expert parallelism, ZeRO stage,
precision, micro-batch and accumulation, activation checkpointing, the DeepSpeed settings that size buffers; made
from the recipe and its DeepSpeed JSON with the checks and the reconciliation training runs
(training/ds_config.py `reconcile`, distributed/expert_parallel.py `check_parallel_layout`), so a layout the
planner accepts is one `deepspeed pretrain.py` starts, and one it refuses is refused in the same words.

Every rank is a data-parallel rank (DeepSpeed's data-parallel group is the whole world); expert parallelism splits
each routed stage's experts over `expert_parallel` ranks, whose expert parameters are then reduced over the
`gpus / expert_parallel` ranks that hold the same experts (the expert-data-parallel group).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from moep_ds.distributed.ds_fields import precision, zero_stage
from moep_ds.distributed.expert_parallel import check_parallel_layout, node_size
from moep_ds.errors import UserError
from moep_ds.models.plan import plan_for
from moep_ds.training.ds_config import reconcile

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# DeepSpeed's defaults of the zero_optimization keys a plan reads (deepspeed/runtime/zero/config.py, 0.19);
# overlap_comm's depends on the stage: Layout.overlap_comm (resolved_overlap_comm)
ZERO_DEFAULTS = {
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "use_multi_rank_bucket_allreduce": True,
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_param_persistence_threshold": int(1e5),
    "stage3_model_persistence_threshold": 2**63 - 1,
    "stage3_max_live_parameters": int(1e9),
    "stage3_max_reuse_distance": int(1e9),
}


class LayoutError(UserError):
    """A layout that cannot exist (one line naming the value)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise LayoutError(f"--gpus ({self.gpus}) must be >= 1")
        if self.gpus_per_node < 1:
            raise LayoutError(f"--gpus_per_node ({self.gpus_per_node}) must be >= 1")
        if self.gpus_per_node > self.gpus:
            raise LayoutError(f"--gpus_per_node ({self.gpus_per_node}) must be <= --gpus ({self.gpus})")
        if self.gpus % self.gpus_per_node:
            raise LayoutError(f"--gpus ({self.gpus}) must be a multiple of --gpus_per_node ({self.gpus_per_node})")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Layout:
    cluster: Cluster
    expert_parallel: int
    zero_stage: int
    precision: str
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    seq_len: int
    zero: dict[str, Any] = dataclasses.field(compare=False, repr=False)  # zero_optimization with DeepSpeed's defaults
    overflow_check: bool = False  # fp16, and bf16 unless bf16.check_grad_overflow is false: DeepSpeed's inf/nan check
    expert_dedup: bool = True  # train.expert_comm.dedup: a token crosses to a rank once (planning/dedup.py)
    expert_node_aware: bool = False  # train.expert_comm.node_aware as it resolves here: once per node, then fan out
    expert_fp8_dispatch: bool = False  # train.expert_comm.fp8_dispatch: rows there in FP8 with their scales
    # train.expert_comm.overlap_chunks: a routed stage's tokens in this many chunks, each one's all-to-all in flight
    # while a neighbour's experts compute (planning/timing.py; 1: the dispatch beside the shared expert only, or with
    # node-aware dispatch blocking)
    expert_overlap_chunks: int = 1
    # zero_optimization.overlap_comm as DeepSpeed resolves it (its default: true at stage 3 only); a field of its
    # own, not only in `zero`, because a search varies it at stages 1 and 2 and layouts compare by their fields
    overlap_comm: bool = False

    @property
    def gpus(self) -> int:
        return self.cluster.gpus

    @property
    def expert_data_parallel(self) -> int:
        return self.gpus // self.expert_parallel

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.gpus

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def param_bytes(self) -> int:
        return BYTES[self.precision]

    def zero_setting(self, key: str) -> Any:
        if key == "overlap_comm":
            return self.overlap_comm
        return self.zero.get(key, ZERO_DEFAULTS[key])

    def describe(self) -> str:
        comm = f" ({self.expert_comm()})" if self.expert_parallel > 1 else ""
        return (f"{self.gpus} GPUs ({self.cluster.nodes} x {self.cluster.gpus_per_node}), data parallel {self.gpus}, "
                f"expert parallel {self.expert_parallel}{comm}, {self.zero_name()}, micro-batch "
                f"{self.micro_batch} x {self.grad_accum} accumulation x {self.seq_len} tokens, activation "
                f"checkpointing {'on' if self.activation_checkpointing else 'off'}")

    def zero_name(self) -> str:
        """The stage and precision ("ZeRO-1 bf16"), with ", overlap_comm" where stage 1 or 2 reduces during backward
        (the choice a search varies; ZeRO-3 overlaps by default and ZeRO-0 has no such setting)."""
        overlap = ", overlap_comm" if self.overlap_comm and self.zero_stage in (1, 2) else ""
        return f"ZeRO-{self.zero_stage} {self.precision}{overlap}"

    def expert_comm(self) -> str:
        """The train.expert_comm options in effect, in words ("once per rank, fp8, 2 chunks overlapped"; node-aware
        dispatch in one chunk runs blocking)."""
        chunks = self.expert_overlap_chunks
        overlap = f"{chunks} chunk{'s' * (chunks > 1)} overlapped"
        return ", ".join([("once per rank" if self.expert_dedup else "per expert")]
                         + ["node-aware"] * self.expert_node_aware + ["fp8"] * self.expert_fp8_dispatch
                         + ["blocking" if self.expert_node_aware and chunks == 1 else overlap])


def with_settings(cfg, *, expert_parallel: int, micro_batch: int, activation_checkpointing: bool, global_batch: int,
                  expert_comm: dict[str, Any] | None = None):
    """A copy of the recipe with the layout's own train fields replaced (the recipe is never modified);
    `expert_comm`: train.expert_comm fields to replace."""
    comm = dataclasses.replace(cfg.train.expert_comm, **(expert_comm or {}))
    return dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, expert_parallel_size=expert_parallel, micro_batch_size=micro_batch,
        activation_checkpointing=activation_checkpointing, global_batch_size=global_batch, expert_comm=comm))


def make_layout(cfg, ds: dict[str, Any], cluster: Cluster) -> Layout:
    """The layout `cfg` (its train.expert_parallel_size, micro-batch, checkpointing) and `ds` give on `cluster`, or a
    one-line error: a routed stage that expert parallelism does not divide (ConfigError naming the recipe field),
    expert parallelism that does not divide the GPUs or that DeepSpeed refuses with this ZeRO stage, batch sizes that
    do not divide (DeepSpeedConfigError)."""
    ep = cfg.train.expert_parallel_size
    plan_for(cfg.model, ep)
    full = reconcile(ds, cfg.train, cluster.gpus)
    check_parallel_layout(cfg, full, cluster.gpus, cluster.gpus_per_node)
    return Layout(
        cluster=cluster, expert_parallel=ep, zero_stage=zero_stage(full), precision=precision(full),
        micro_batch=full["train_micro_batch_size_per_gpu"], grad_accum=full["gradient_accumulation_steps"],
        activation_checkpointing=cfg.train.activation_checkpointing, seq_len=cfg.data.seq_len,
        zero=dict(full.get("zero_optimization", {})), overflow_check=overflow_check(full),
        expert_dedup=cfg.train.expert_comm.dedup,
        expert_node_aware=node_size(cfg.train.expert_comm, ep, cluster.gpus, cluster.gpus_per_node) is not None,
        expert_fp8_dispatch=cfg.train.expert_comm.fp8_dispatch,
        expert_overlap_chunks=cfg.train.expert_comm.overlap_chunks, overlap_comm=resolved_overlap_comm(full))


def resolved_overlap_comm(ds: dict[str, Any]) -> bool:
    """zero_optimization.overlap_comm as DeepSpeed 0.19 resolves it (zero/config.py overlap_comm_valid: absent or
    null means true at stage 3, false below)."""
    value = ds.get("zero_optimization", {}).get("overlap_comm")
    return zero_stage(ds) == 3 if value is None else bool(value)


def overflow_check(ds: dict[str, Any]) -> bool:
    """Whether DeepSpeed checks the gradients for inf/nan before each step (its engine's rule)."""
    if precision(ds) == "fp16":
        return True
    return precision(ds) == "bf16" and bool(ds.get("bf16", {}).get("check_grad_overflow", True))


def with_zero_stage(ds: dict[str, Any], stage: int, overlap_comm: bool | None = None) -> dict[str, Any]:
    """`ds` at another ZeRO stage (and `overlap_comm` where given), its batch sizes left to the recipe (a search
    varies the micro-batch)."""
    out = copy.deepcopy(ds)
    out.setdefault("zero_optimization", {})["stage"] = stage
    if overlap_comm is not None:
        out["zero_optimization"]["overlap_comm"] = overlap_comm
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        out.pop(key, None)
    return out


__all__ = ["BYTES", "Cluster", "Layout", "LayoutError", "ZERO_DEFAULTS", "make_layout", "with_settings",
           "with_zero_stage"]
