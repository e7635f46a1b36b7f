"""Communication of one optimizer step, collective by collective, as DeepSpeed 0.19, the expert-parallel dispatcher
(moe/all_to_all.py) and the trainer issue it; then by link.

# N parameters a rank holds, g the group a parameter is reduced over (all ranks; an expert parameter: the ranks
# holding the same experts), A micro-batches per step, S routed assignments of a stage per micro-batch, w their width

Sizes are NCCL's tests' `size`: the whole buffer of the collective (all-reduce: the tensor; reduce-scatter: the
input of all ranks' shards; all-gather: the output; all-to-all: what this rank sends, its own share included).
  ZeRO-0     gradient all-reduce at the step (p N; expert gradients over their group)
  ZeRO-1/2   gradient all-reduce of every gradient (DeepSpeed reduces the buckets by all-reduce, each rank keeping its
             slice: `use_multi_rank_bucket_allreduce`, the default), once per step (ZeRO-1) or per micro-batch (ZeRO-2);
             under overlap_comm in reduce_bucket_size buckets on a stream of its own as backward produces them (stage 1
             and 2 are one optimizer, stage_1_and_2.py: its gradient hooks reduce when `partition_gradients or
             overlap_comm`, stage 1 only in the backward of the step's last micro-batch, the accumulation boundary);
             without it ZeRO-1 reduces after that backward (reduce_gradients) and ZeRO-2 in its hooks, on the compute
             stream;
             with `use_multi_rank_bucket_allreduce: false` (and contiguous_gradients and reduce_scatter, the path that
             reads it: stage_1_and_2.py average_tensor) a reduce of each slice to the rank that owns it instead, the
             same size in all but half the bytes on the wire; all-gather of the updated flat groups after the step;
             one fp32 norm per optimizer group
  ZeRO-3     all-gather of every parameter per micro-batch (again in backward for units the reuse distance lets go;
             persistent parameters after the step instead), reduce-scatter of every gradient per micro-batch, each
             parameter padded to a multiple of g; one fp64 norm per optimizer group
  inf/nan    one byte (uint8) before the step: ZeRO-1/2 in fp16 and in bf16 (unless bf16.check_grad_overflow is
             false), ZeRO-3 in fp16
  all-to-all per routed stage and micro-batch: expert counts (E int64), the tokens there and back (S w p each), the
             same two again in backward, sequence ids and positions (2 S int64) for experts that attend; a
             checkpointed block's recomputation repeats the forward's. Once per rank (train.expert_comm.dedup): P
             expected (token, rank) pairs (planning/dedup.py) in place of S for the tokens and positions, R pair
             counts beside the E, and the S fp32 combine weights (again in backward) and S int64 rows. Node-aware
             (train.expert_comm.node_aware, where the group spans nodes): two legs, between nodes over the peers of
             one local rank with the expected (token, node) pairs, then inside the node with the (token, rank) pairs
             (node_aware_collectives). In C chunks (train.expert_comm.overlap_chunks) each but the count exchanges
             once per chunk with a chunk's share, the counts of every chunk in one exchange (of each leg) a forward
             (`chunked`). FP8 dispatch (train.expert_comm.fp8_dispatch): the rows there in forward
             as e4m3 with an fp32 scale per 128 values, the combine and gradients as before (row_collectives)
  trainer    the step's one all-reduce (fp64: losses, each auxiliary loss, loss-free balancing counts, 3 flags),
             expert-choice thresholds (fp64), global load-balancing counts (fp64, E + 1 per top-k stage and forward)
Groups of one rank move nothing and are left out.

Links: a collective over a group that spans k nodes of `gpus_per_node` ranks is costed hierarchically: a ring
collective moves (n - 1)/n of its size per rank (twice for all-reduce), of which the share between nodes is
(k - 1)/k of a 1/gpus_per_node slice (NCCL's tree / hierarchical algorithms); an all-to-all sends to each peer
directly, (peers on other nodes) / n of its size between nodes.
"""
from __future__ import annotations

import collections
import dataclasses

from moep_ds.moe import fp8
from moep_ds.planning.dedup import expected_pairs
from moep_ds.planning.inventory import Inventory
from moep_ds.planning.layout import Layout
from moep_ds.planning.memory import ALIGN, padded, zero3_gathered
from moep_ds.planning.trace import RoutedStage, StepTrace

KINDS = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")
# the legs of a routed stage's all-to-all in one micro-batch: the blocking count exchange of each forward, the rows
# to the experts (with their weights, rows and positions) and back in each forward, and in backward the gradients of
# the combine (to the experts) and of the dispatch (back, with the weights' gradients); node-aware dispatch's hop
# between nodes has these, its hop inside the node the same legs named with INSIDE
LEGS = ("counts", "dispatch", "combine", "combine_grad", "dispatch_grad")
INSIDE = "_inside"


def forward_legs(forwards: int, *legs: str) -> tuple[str, ...]:
    """`legs` once in each forward (twice where the recomputation dispatches again)."""
    return legs * forwards


@dataclasses.dataclass(frozen=True)
class Collective:
    what: str
    kind: str
    bytes: int  # per call, per rank (NCCL tests' size)
    group: int  # ranks in the group
    calls: int  # per step
    overlappable: bool  # may run behind compute (ZeRO-3 prefetch, bucketed reduction with overlap_comm)
    # "data" (every rank), "expert" (an expert-parallel group: consecutive ranks), "expert_data" (the ranks holding the
    # same experts: every expert_parallel-th rank), or node-aware dispatch's "expert_node" (an expert-parallel group's
    # ranks on one node) and "expert_peers" (its ranks of one local rank, one per node)
    span: str = "data"
    # an expert all-to-all's routed stage and the leg of that stage's schedule (LEGS) each of its calls of a
    # micro-batch serves, in order: what planning/timing.py overlaps with the experts' compute
    stage: str = ""
    legs: tuple[str, ...] = ()
    # the compute an overlappable collective can hide behind: "step" (any of the step's), or "last backward" (ZeRO-1's
    # reduction under overlap_comm: the backward of the step's last micro-batch only)
    window: str = "step"

    @property
    def total(self) -> int:
        return self.bytes * self.calls


@dataclasses.dataclass(frozen=True)
class CommPlan:
    collectives: tuple[Collective, ...]

    def by_kind(self) -> dict[str, int]:
        """Bytes per step per rank of each kind of collective (NCCL tests' sizes)."""
        out = collections.Counter()
        for c in self.collectives:
            out[c.kind] += c.total
        return {k: out[k] for k in KINDS if out[k]}

    def by_kind_and_group(self) -> dict[str, int]:
        """As `by_kind`, keyed "kind/group size" (what a counting wrapper around torch.distributed sees)."""
        out = collections.Counter()
        for c in self.collectives:
            out[f"{c.kind}/{c.group}"] += c.total
        return dict(out)


def group_size(layout: Layout, expert: bool) -> int:
    return layout.expert_data_parallel if expert else layout.gpus


def zero12_reduction(layout: Layout) -> str:
    """The collective ZeRO-1/2 reduces gradients with. DeepSpeed's contiguous, reduce-scattered path (average_tensor)
    all-reduces each bucket unless `use_multi_rank_bucket_allreduce` is false: then each rank's slices are reduced to
    it alone (dist.reduce). Without that path (buffered_reduce_fallback, gradient_reduction_w_predivide) every
    gradient is all-reduced whatever the flag says."""
    contiguous = layout.zero_setting("contiguous_gradients") and layout.zero_setting("reduce_scatter")
    return "reduce" if contiguous and not layout.zero_setting("use_multi_rank_bucket_allreduce") else "all_reduce"


def gradient_collectives(inv: Inventory, layout: Layout) -> list[Collective]:
    """DeepSpeed's gradient reduction and parameter gathering at the layout's ZeRO stage."""
    p, A, stage = layout.param_bytes, layout.grad_accum, layout.zero_stage
    overlap = bool(layout.zero_setting("overlap_comm"))
    out: list[Collective] = []
    for expert in (False, True):
        groups = [g for g in inv.groups if g.expert == expert]
        g, span = group_size(layout, expert), "expert_data" if expert else "data"
        if not groups or g == 1:
            continue
        name = "expert " if expert else ""
        if stage in (0, 1, 2):
            numel = sum(gr.numel for gr in groups)
            calls = A if stage == 2 else 1
            out.append(Collective(f"{name}gradients", zero12_reduction(layout) if stage else "all_reduce", numel * p, g,
                                  calls, overlap and stage in (1, 2), span,
                                  window="last backward" if stage == 1 else "step"))
        if stage in (1, 2):
            flat = sum(padded(gr.numel, ALIGN * g) for gr in groups)
            out.append(Collective(f"{name}parameters after the step", "all_gather", flat * p, g, 1, False, span))
        if stage == 3:
            numels = [n for gr in groups for n in gr.numels]
            whole = sum(padded(n, g) for n in numels)
            out.append(Collective(f"{name}gradients", "reduce_scatter", whole * p, g, A, overlap, span))
            out.append(Collective(f"{name}parameters", "all_gather", whole * p, g, A, True, span))
    if stage == 3:
        regathered = zero3_gathered(inv, layout)[1]
        if regathered:
            out.append(Collective("parameters again in backward", "all_gather", padded(regathered, layout.gpus) * p,
                                  layout.gpus, A, True))
    norm_bytes = 8 if stage == 3 else 4
    if stage > 0 and layout.gpus > 1:
        out.append(Collective("gradient norm (one per optimizer group)", "all_reduce", norm_bytes, layout.gpus,
                              len(inv.groups), False))
    if layout.overflow_check and layout.gpus > 1 and (stage in (1, 2) or layout.precision == "fp16" and stage == 3):
        out.append(Collective("inf/nan check", "all_reduce", 1, layout.gpus, 1, False))
    if stage == 0 and layout.expert_parallel > 1:  # distributed/grad_norm.py: the experts' share of the norm
        out.append(Collective("expert gradient norm", "all_reduce", 4, layout.expert_parallel, 1, False, "expert"))
    return out


def all_to_all_collectives(trace: StepTrace, layout: Layout) -> list[Collective]:
    if layout.expert_parallel == 1:
        return []
    out = []
    for stage in trace.routed:
        out += (node_aware_collectives if layout.expert_node_aware else flat_collectives)(stage, layout)
    return out


def flat_collectives(stage: RoutedStage, layout: Layout) -> list[Collective]:
    """The flat all-to-all of one routed stage (moe/all_to_all.py), per expert or once per rank, in C chunks: the
    counts of every chunk in one exchange (C times a chunk's ints), the rest `chunked`."""
    ep, A, C = layout.expert_parallel, layout.grad_accum, layout.expert_overlap_chunks
    forwards = 2 if layout.activation_checkpointing else 1  # the recomputation dispatches again
    S, dedup = stage.assignments, layout.expert_dedup
    rows = expected_pairs(stage.choice, stage.tokens, S, stage.num_experts, ep) if dedup else S
    out = [Collective(f"{stage.name}: expert counts" + (" and pairs per rank" if dedup else ""), "all_to_all",
                      8 * C * (stage.num_experts + (ep if dedup else 0)), ep, A * forwards, False, "expert",
                      stage.name, forward_legs(forwards, "counts"))]
    out += row_collectives(f"{stage.name}: tokens", rows, stage.width, layout, ep, "expert", stage.name)
    if dedup:  # fp32 combine weights (their gradients come back) and each assignment's row (int64)
        out.append(Collective(f"{stage.name}: combine weights", "all_to_all", 4 * S, ep, A * (forwards + 1),
                              False, "expert", stage.name, forward_legs(forwards, "dispatch") + ("dispatch_grad",)))
        out.append(Collective(f"{stage.name}: rows of the assignments", "all_to_all", 8 * S, ep, A * forwards,
                              False, "expert", stage.name, forward_legs(forwards, "dispatch")))
    if stage.with_positions:
        out.append(Collective(f"{stage.name}: sequence ids and positions", "all_to_all",
                              round(16 * rows), ep, A * forwards, False, "expert", stage.name,
                              forward_legs(forwards, "dispatch")))
    return chunked(out, C)


def chunked(collectives: list[Collective], chunks: int) -> list[Collective]:
    """A routed stage's all-to-alls in `chunks` chunks of tokens (train.expert_comm.overlap_chunks, moe/overlap.py):
    each collective but the count exchanges (sized for every chunk already: one exchange a forward) once per chunk
    with a chunk's share of its rows (the mean, rounded; the same bytes in all). Every rank cuts as many chunks, empty
    ones included."""
    counts = {"counts", "counts" + INSIDE}
    return [c if chunks == 1 or set(c.legs) <= counts else
            dataclasses.replace(c, bytes=round(c.bytes / chunks), calls=c.calls * chunks) for c in collectives]


def node_aware_collectives(stage: RoutedStage, layout: Layout) -> list[Collective]:
    """Node-aware dispatch of one routed stage (moe/node_dispatch.py, module docstring): a leg between nodes over
    the peers of one local rank (its rows the expected (token, node) pairs), then a leg inside the node (the (token,
    rank) pairs); each leg moves per assignment its fp32 weight and one int64 (its row, with its expert and, inside,
    its source). Counts, in one chunk: each leg's own exchange, per destination its extra counts (inside: the L
    experts'), assignments and pairs. In C > 1 chunks (`NodeDispatch._exchange`): every chunk's at once, between nodes
    n (L + 1) + 1 ints per node and chunk (the L expert counts and pairs of each of its n ranks, and the node's pairs),
    inside the node L + 1 per rank and chunk (what the peer passes on to it); the rest `chunked`."""
    ep, A, n, C = layout.expert_parallel, layout.grad_accum, layout.cluster.gpus_per_node, layout.expert_overlap_chunks
    forwards = 2 if layout.activation_checkpointing else 1
    S, L = stage.assignments, stage.num_experts // ep
    between, inside = (2, L + 2) if C == 1 else (n * (L + 1) + 1, L + 1)  # ints per destination and chunk
    out = []
    for leg, group, span, rows, ints, suffix in (
            ("between nodes", ep // n, "expert_peers", node_pairs(stage, ep // n), between, ""),
            ("inside the node", n, "expert_node", node_pairs(stage, ep), inside, INSIDE)):
        name = f"{stage.name} ({leg})"
        dispatch = forward_legs(forwards, "dispatch" + suffix)
        out += [Collective(f"{name}: counts", "all_to_all", 8 * C * ints * group, group, A * forwards, False, span,
                           stage.name, forward_legs(forwards, "counts" + suffix)),
                *row_collectives(f"{name}: tokens", rows, stage.width, layout, group, span, stage.name, suffix),
                Collective(f"{name}: combine weights", "all_to_all", 4 * S, group, A * (forwards + 1), False, span,
                           stage.name, dispatch + ("dispatch_grad" + suffix,)),
                Collective(f"{name}: rows and experts of the assignments", "all_to_all", 8 * S, group, A * forwards,
                           False, span, stage.name, dispatch)]
        if stage.with_positions:
            out.append(Collective(f"{name}: sequence ids and positions", "all_to_all", round(16 * rows), group,
                                  A * forwards, False, span, stage.name, dispatch))
    return chunked(out, C)


def row_collectives(name: str, rows: float, width: int, layout: Layout, group: int, span: str,
                    stage: str = "", suffix: str = "") -> list[Collective]:
    """The rows of a dispatch: there and back in each forward (twice with the recomputation), and the gradients
    both ways in backward, in the model's dtype; with fp8_dispatch the rows there in forward in FP8 (a byte a value
    and an fp32 scale per 128: moe/fp8.py), the rest as before. `suffix` names the legs of node-aware dispatch's hop
    inside the node (INSIDE)."""
    A, p = layout.grad_accum, layout.param_bytes
    forwards = 2 if layout.activation_checkpointing else 1
    dispatch, combine = "dispatch" + suffix, "combine" + suffix
    grads = ("combine_grad" + suffix, "dispatch_grad" + suffix)
    if not layout.expert_fp8_dispatch:
        return [Collective(f"{name} to experts and back", "all_to_all", round(rows * width * p), group,
                           A * (2 * forwards + 2), False, span, stage,
                           forward_legs(forwards, dispatch, combine) + grads)]
    return [Collective(f"{name} to experts (fp8 and scales)", "all_to_all", round(rows * fp8.packed_width(width)),
                       group, A * forwards, False, span, stage, forward_legs(forwards, dispatch)),
            Collective(f"{name} back, and gradients", "all_to_all", round(rows * width * p), group, A * (forwards + 2),
                       False, span, stage, forward_legs(forwards, combine) + grads)]


def node_pairs(stage: RoutedStage, parts: int) -> float:
    """Expected distinct (token, part) pairs of a stage's experts split in order over `parts` nodes or ranks."""
    return expected_pairs(stage.choice, stage.tokens, stage.assignments, stage.num_experts, parts)


NONFINITE_CHECKS = 3  # ranks with a non-finite loss, their rank sum, a non-finite gradient norm


def trainer_collectives(inv: Inventory, layout: Layout, trace: StepTrace) -> list[Collective]:
    if layout.gpus == 1:
        return []
    n = layout.gpus
    # float64: the losses, the balancing counts, the non-finite check (TrainModule.local_checks: 3) and the
    # built-in callbacks' flags (3)
    out = [Collective("losses, balancing counts, non-finite check and flags (trainer)", "all_reduce",
                      8 * (2 + len(trace.aux_keys) + inv.balancing_counts + NONFINITE_CHECKS + 3), n, 1, False)]
    if inv.threshold_numel:
        out.append(Collective("expert-choice thresholds (trainer)", "all_reduce", 8 * inv.threshold_numel, n, 1,
                              False))
    forwards = 2 if layout.activation_checkpointing else 1
    for experts in inv.global_balance_experts:
        out.append(Collective("global load-balancing counts", "all_reduce", 8 * (experts + 1), n,
                              layout.grad_accum * forwards, False))
    return out


def comm_plan(inv: Inventory, layout: Layout, trace: StepTrace) -> CommPlan:
    return CommPlan(tuple(gradient_collectives(inv, layout) + all_to_all_collectives(trace, layout)
                          + trainer_collectives(inv, layout, trace)))


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    intra: float  # per rank, per step, within a node
    inter: float  # per rank, per step, between nodes


def placement(layout: Layout, span: str) -> tuple[int, int]:
    """(nodes a group spans, its ranks per node): DeepSpeed's expert-parallel groups are consecutive ranks, the
    expert-data-parallel groups every expert_parallel-th rank."""
    per_node, nodes, ep = layout.cluster.gpus_per_node, layout.cluster.nodes, layout.expert_parallel
    if span == "data":
        return nodes, per_node
    if span == "expert":
        return -(-ep // per_node), min(ep, per_node)
    if span == "expert_node":  # node-aware dispatch inside a node
        return 1, min(ep, per_node)
    if span == "expert_peers":  # node-aware dispatch between nodes: one rank on each
        return -(-ep // per_node), 1
    if ep <= per_node:  # strided over every node, per_node / ep ranks on each
        return nodes, per_node // ep
    return layout.expert_data_parallel, 1


def link_bytes(c: Collective, layout: Layout) -> LinkBytes:
    """Bytes one rank puts on each kind of link for `c` (all its calls)."""
    nodes, local = placement(layout, c.span)
    n = c.group
    if c.kind == "all_to_all":
        return LinkBytes(c.total * (local - 1) / n, c.total * (n - local) / n)
    ring = 2 if c.kind == "all_reduce" else 1
    intra = ring * c.total * (local - 1) / local if local > 1 else 0.0
    inter = ring * c.total / local * (nodes - 1) / nodes if nodes > 1 else 0.0
    return LinkBytes(intra, inter)


__all__ = ["Collective", "CommPlan", "INSIDE", "KINDS", "LEGS", "LinkBytes", "comm_plan", "link_bytes", "placement"]
