"""Memory per rank, itemised, as DeepSpeed 0.19 holds it at each ZeRO stage (deepspeed/runtime/zero/stage_1_and_2.py,
stage3.py, fp16/unfused_optimizer.py, engine.py), plus one traced micro-batch (planning/trace.py).

# N parameters a rank holds (its experts only), g the group a parameter is reduced and partitioned over (all
# ranks, or for an expert parameter the ranks holding the same experts), p bytes of the model dtype

model states:
  ZeRO-0   parameters p N (fp32: also the masters); bf16/fp16: fp32 masters 4N (DeepSpeed's unfused optimizer);
           Adam moments 8N; gradients p N
  ZeRO-1/2 parameters in one flat buffer per optimizer group, padded to a multiple of 2g (p N); fp32 masters and
           Adam moments of this rank's partition (12 N/g, also in fp32: DeepSpeed copies the partition)
           ZeRO-1 keeps every gradient (p N) until the step; ZeRO-2 keeps its partition's (p N/g) and, with
           contiguous_gradients, one reduce bucket (reduce_bucket_size elements), two under overlap_comm (one fills
           while the other reduces: stage_1_and_2.py setup_buckets); without it the all-reduce runs on a flat copy
           of up to reduce_bucket_size gradients
  ZeRO-3   partitions (p N/g, each parameter padded to a multiple of g), masters and moments 12 N/g, gradient
           partitions p N/g, the reduce bucket, parameters smaller than stage3_param_persistence_threshold whole,
           and the gathered parameters: a module's parameters stay gathered after its forward when their next use
           is nearer than stage3_max_reuse_distance parameters (DeepSpeed's trace), else they are gathered again
activations: the traced peak of one micro-batch (forward and backward), with the gradients the stage keeps at each
  moment of backward; under expert parallelism the all-to-all receive buffers beside it (the trace runs every
  expert locally: the expert-side activations are the same at balanced loads)
the reduction: the all-reduce (ZeRO-0, and ZeRO-1/2 without contiguous gradients) or reduce-scatter (ZeRO-3) runs
  on a flat copy of up to reduce_bucket_size gradients, beside the gradients kept (and ZeRO-3's gathered parameters)
the step: the optimizer step adds fp32 gradients of the partition (4 N/g; ZeRO-0 with 16-bit weights 4N for the
  masters), while the gradients kept so far are alive; the peak is the largest of the three phases
checkpoint save: DCP writes each rank's fp32 masters and moments from the device (views, no device copy); with
  train.checkpoint.async_save they are first copied to host memory: that host transient is reported, not added
"""
from __future__ import annotations

import dataclasses
import math

import torch

from moep_ds.planning.inventory import Inventory
from moep_ds.planning.layout import Layout
from moep_ds.planning.trace import GradPolicy, StepTrace

ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor: flat groups padded to a multiple of 2 x group size


# the moments of a step whose memory is summed: the activation peak of a micro-batch's backward, the gradient
# reduction after it (ZeRO-0/1 at the step, ZeRO-2/3 when a bucket is full: at the end of backward for models
# smaller than reduce_bucket_size), the optimizer step
PHASES = ("backward", "reduce", "step")


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    phase: str  # "static" (held throughout), one of PHASES, "kept" (reduce and step), or "host" (not device memory)
    note: str = ""

    def counts_in(self, phase: str) -> bool:
        return self.phase in ("static", phase) or (self.phase == "kept" and phase in ("reduce", "step")) or (
            self.phase == "gathered" and phase in ("backward", "reduce"))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    items: tuple[Item, ...]
    peak: int
    peak_phase: str

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)

    @property
    def largest(self) -> Item:
        return max((i for i in self.items if i.phase != "host"), key=lambda i: i.bytes)


def padded(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def group_size(layout: Layout, expert: bool) -> int:
    return layout.expert_data_parallel if expert else layout.gpus


def flat_partitions(inv: Inventory, layout: Layout) -> tuple[int, int]:
    """(numel of this rank's flat bit16 groups, numel of its partitions) under ZeRO-1/2."""
    flat = part = 0
    for group in inv.groups:
        g = group_size(layout, group.expert)
        size = padded(group.numel, ALIGN * g)
        flat += size
        part += size // g
    return flat, part


def zero3_partitions(inv: Inventory, layout: Layout) -> tuple[int, int]:
    """(numel of this rank's ZeRO-3 partitions, numel of the persistent parameters held whole)."""
    threshold = layout.zero_setting("stage3_param_persistence_threshold")
    budget = layout.zero_setting("stage3_model_persistence_threshold")
    part = persistent = 0
    for group in inv.groups:
        g = group_size(layout, group.expert)
        for n in group.numels:
            part += -(-n // g)
            if n < threshold and persistent + n <= budget:
                persistent += n
    return part, persistent


def zero3_gathered(inv: Inventory, layout: Layout) -> tuple[int, int]:
    """(numel gathered at the end of forward, numel gathered again in backward) under ZeRO-3: a unit stays gathered
    when the parameters traversed before its next use (the units after it in forward, then again in backward) are
    fewer than stage3_max_reuse_distance; the unit being run is gathered in any case."""
    reuse = layout.zero_setting("stage3_max_reuse_distance")
    units = inv.fetch_units
    after = 0
    kept = regathered = 0
    for n in reversed(units):
        if 2 * after < reuse:
            kept += n
        else:
            regathered += n
        after += n
    return kept + (max(units) if regathered else 0), regathered


class KeepAll(GradPolicy):
    """Every gradient stays until the step (ZeRO-0; ZeRO-1, which reduces at the step)."""

    def __init__(self, grad_bytes: int, expert_share: float):
        self.grad_bytes, self.expert_share = grad_bytes, expert_share

    def on_grad(self, numel: int, expert: bool) -> None:
        self.retained += int(numel * (self.expert_share if expert else 1)) * self.grad_bytes


class BucketedPartition(GradPolicy):
    """ZeRO-2 without contiguous gradients: gradients wait in param.grad until reduce_bucket_size elements are
    pending; after each reduction only this rank's partition of them stays."""

    def __init__(self, grad_bytes: int, bucket: int, share: float, expert_share: float):
        self.grad_bytes, self.bucket, self.share, self.expert_share = grad_bytes, bucket, share, expert_share
        self.pending = self.kept = 0

    def on_grad(self, numel: int, expert: bool) -> None:
        numel = numel * (self.expert_share if expert else 1)
        if self.pending + numel > self.bucket:
            self.kept += self.pending * self.share
            self.pending = 0
        self.pending += numel
        self.retained = int(self.kept + self.pending) * self.grad_bytes


def grad_policy(inv: Inventory, layout: Layout) -> GradPolicy:
    p, experts = layout.param_bytes, 1 / layout.expert_parallel  # the trace holds every expert, a rank 1/ep
    if layout.zero_stage in (0, 1):
        return KeepAll(p, experts)
    if layout.zero_stage == 2 and not layout.zero_setting("contiguous_gradients"):
        return BucketedPartition(p, layout.zero_setting("reduce_bucket_size"), 1 / layout.gpus, experts)
    return GradPolicy()  # copied into the contiguous bucket as each is ready (ZeRO-2 contiguous, ZeRO-3)


def all_to_all_buffers(trace: StepTrace, layout: Layout) -> int:
    """Receive-side copies of the largest routed stage under expert parallelism: the received rows and their
    regrouping by local expert (moe/all_to_all.py), in the model dtype."""
    if layout.expert_parallel == 1 or not trace.routed:
        return 0
    return 2 * max(r.assignments * r.width for r in trace.routed) * layout.param_bytes


def model_state_items(inv: Inventory, layout: Layout) -> list[Item]:
    p, N, stage = layout.param_bytes, inv.local_params, layout.zero_stage
    bucket = layout.zero_setting("reduce_bucket_size")
    if stage == 0:
        items = [Item(f"parameters ({layout.precision})", p * N, "static")]
        if layout.precision != "fp32":
            items.append(Item("fp32 master weights", 4 * N, "static", "DeepSpeed's unfused optimizer, one per parameter"))
        items += [Item("Adam moments (fp32)", 8 * N, "static"),
                  Item("gradient all-reduce bucket", min(N, bucket) * p, "reduce",
                       "flat copy of up to reduce_bucket_size gradients")]
        if layout.precision != "fp32":
            items.append(Item("fp32 gradients of the masters", 4 * N, "step"))
        return items
    if stage in (1, 2):
        flat, part = flat_partitions(inv, layout)
        items = [Item(f"parameters ({layout.precision}, flat groups)", p * flat, "static",
                      f"padded to multiples of {ALIGN} x group size"),
                 Item("fp32 master partition", 4 * part, "static", "a copy even in fp32"),
                 Item("Adam moments (fp32, partition)", 8 * part, "static")]
        contiguous = layout.zero_setting("contiguous_gradients")
        if stage == 2 and contiguous:
            items += [Item(f"gradient partition ({layout.precision})", p * part, "static"),
                      Item("reduce bucket (contiguous gradients)", p * bucket, "static",
                           f"reduce_bucket_size {bucket:,} elements, allocated whole")]
        elif stage == 1 and contiguous:
            items.append(Item("reduce bucket (contiguous gradients)", p * bucket, "static",
                              f"reduce_bucket_size {bucket:,} elements"))
        if contiguous and layout.overlap_comm:
            items.append(Item("second reduce bucket (overlap_comm)", p * bucket, "static",
                              "fills while the first reduces"))
        items.append(Item("fp32 gradients of the partition", 4 * part, "step"))
        if not contiguous and layout.gpus > 1:  # ZeRO-1 reduces at the step; ZeRO-2 when a bucket is full
            items.append(Item("gradient all-reduce bucket", min(N, bucket) * p, "reduce",
                              "flat copy of up to reduce_bucket_size gradients (contiguous_gradients false)"))
        items.append(Item("all-gather bucket", 0, "step",
                          f"allgather_bucket_size {layout.zero_setting('allgather_bucket_size'):,}: gathered in place "
                          "into the flat groups"))
        return items
    part, persistent = zero3_partitions(inv, layout)
    kept, regathered = zero3_gathered(inv, layout)
    prefetch = layout.zero_setting("stage3_prefetch_bucket_size") if regathered else 0
    return [
        Item(f"parameter partitions ({layout.precision})", p * part, "static"),
        Item("persistent parameters (whole)", p * persistent, "static",
             f"{persistent:,} elements below stage3_param_persistence_threshold"),
        Item("fp32 master partition", 4 * part, "static"),
        Item("Adam moments (fp32, partition)", 8 * part, "static"),
        Item(f"gradient partition ({layout.precision})", p * part, "static"),
        Item("reduce bucket", p * bucket, "static", f"reduce_bucket_size {bucket:,} elements"),
        Item("gathered parameters (ZeRO-3)", p * max(kept - persistent, 0), "gathered",
             f"{kept:,} elements live at once under stage3_max_reuse_distance, {regathered:,} gathered again"),
        Item("ZeRO-3 prefetch", p * prefetch, "backward", "stage3_prefetch_bucket_size ahead of use"),
        Item("reduce-scatter input", p * min(inv.local_params, bucket), "reduce",
             "flat copy of the reduce bucket's gradients"),
        Item("fp32 gradients of the partition", 4 * part, "step"),
    ]


def checkpoint_transient(inv: Inventory, layout: Layout, async_save: bool) -> Item:
    """Host memory of a checkpoint save: fp32 masters and both moments of this rank's share (training/checkpoint.py:
    its partition, or an even share of replicated state under ZeRO-0)."""
    if layout.zero_stage == 0:
        share = math.ceil(inv.local_params / layout.gpus)
    elif layout.zero_stage < 3:
        share = flat_partitions(inv, layout)[1]
    else:
        share = zero3_partitions(inv, layout)[0]
    nbytes = 12 * share if async_save else 0
    note = "train.checkpoint.async_save: staged in host memory" if async_save else \
        "written from the device (no copy); host buffers of DCP's writer only"
    return Item("checkpoint save (host)", nbytes, "host", note)


def memory_plan(inv: Inventory, layout: Layout, trace: StepTrace, *, async_save: bool = False) -> MemoryPlan:
    items = model_state_items(inv, layout)
    peak, kept_at_end = trace.with_gradients(grad_policy(inv, layout))
    kept = {0: "every gradient (until the step)", 1: "every gradient (until the step)",
            2: "partition and pending bucket" if not layout.zero_setting("contiguous_gradients") else "none"}
    items.append(Item("activations and gradients kept in backward", peak, "backward",
                      f"one micro-batch of {layout.micro_batch} x {layout.seq_len} tokens, at its peak "
                      f"({trace.saved / 2**20:,.0f} MiB saved at the end of forward); gradients kept: "
                      f"{kept.get(layout.zero_stage, 'none')}"))
    if layout.expert_parallel > 1:
        items.append(Item("all-to-all receive buffers", all_to_all_buffers(trace, layout), "backward"))
    items.append(Item("gradients kept after backward", kept_at_end, "kept"))
    items.append(checkpoint_transient(inv, layout, async_save))
    phases = {phase: sum(i.bytes for i in items if i.counts_in(phase)) for phase in PHASES}
    peak_phase = max(phases, key=phases.get)
    return MemoryPlan(tuple(items), phases[peak_phase], peak_phase)


def trace_dtype(layout: Layout) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[layout.precision]


__all__ = ["PHASES", "Item", "MemoryPlan", "grad_policy", "memory_plan", "model_state_items", "trace_dtype", "zero3_gathered",
           "zero3_partitions", "flat_partitions"]
