"""Step time from the hardware table and the assumptions printed beside it.

    compute    tokens per rank per step x training FLOPs per token (pretrain.py --dry_run's: 6 x active matmul
               parameters + attention), plus one more forward (a third of it) under activation checkpointing,
               at compute_efficiency x peak, plus micro_step_ms per micro-batch
    optimizer  the Adam step reads and writes about 32 bytes per parameter of the rank's share (fp32 master, two
               moments, gradient, the new 16-bit weight), at hbm_efficiency x HBM bandwidth
    comm       each collective's bytes on the slower of its links (planning/comm.py), at comm_efficiency x
               bandwidth; `overlap` of the overlappable ones (ZeRO-3 gathers and reductions, ZeRO-1/2 reduction
               under overlap_comm) hidden behind compute, the rest exposed; ZeRO-1's reduction hides at most behind
               the backward it runs in, the step's last micro-batch's (2/3 of its training FLOPs, and the
               recomputed forward under activation checkpointing); the expert all-to-all exposed as its schedule
               leaves it (below)
    step = compute + optimizer + exposed comm; tokens/s = tokens per step / step; MFU = FLOPs per token x tokens/s /
    (GPUs x peak): model FLOPs only, recomputation not counted

The expert all-to-all as moe/all_to_all.py and moe/overlap.py run it, per routed stage and pass (exact for two
streams, one of communication and one of compute, each in issue order; an all-to-all waits for the compute issued
before it, as an NCCL collective waits for its caller's stream). Flat dispatch, C = train.expert_comm.overlap_chunks
chunks of equal size: a the dispatch of one chunk (rows, weights, rows and positions there), b its combine (rows
back), e its experts' compute (a rank computes as many assignments as it sends, under balanced routing), h the
shared expert's; the count exchange of each forward blocks before it all. Forward, in issue order:

    send D1; compute shared; for i = 1..C: send D(i+1) (i < C), wait D(i), compute E(i), send C(i); wait every C(i)

Backward is that program reversed (autograd: an all-to-all's gradient is sent where the forward waited for it and
waited for where the forward sent it), with the gradients of the combines as the a's and of the dispatches as the
b's, every compute doubled (backward's FLOPs):

    send gC(C) .. gC(1); for i = C..1: wait gC(i), compute E'(i), send gD(i), wait gD(i+1) (i < C);
    compute shared'; wait gD(1)

exposed = the program's span - its compute. Where the communication of a step is shorter than the experts'
(b + a <= e) all but the first dispatch and the last combine hide: max(0, a - h) + b forward (C = 1 included: the
whole dispatch travels while the shared expert computes); where it is longer, each step exposes the difference.

Node-aware dispatch in one chunk runs its legs blocking after the shared expert, each hop's count exchange included:
every byte exposed. In C > 1 chunks (moe/node_dispatch.py `NodeDispatch.finish`) a chunk's dispatch takes two hops on
the one communication stream, a between nodes then f inside the node (which waits for a's rows on the compute stream:
the peer regroups them), and its combine two, b inside the node then c between nodes (which waits for b's rows: the peer
sums them); n the count exchange inside the node (every chunk's at once), issued behind the blocking one between nodes.
Forward:

    send N, D1, D2; compute shared; wait N, D1; send F1;
    for i = 1..C: wait D(i+1), send F(i+1) (i < C); send D(i+2) (i + 1 < C); wait F(i), compute E(i), send B(i);
                  wait B(i-1), send C(i-1) (i > 1); wait C(i-2) (i > 2)
    wait B(C), send C(C); wait C(C-1), C(C)

so the experts of chunk i compute while chunk i+1's hop inside the node, chunk i+2's between nodes, chunk i-1's
combine inside the node and chunk i-2's between nodes travel (as many bytes a step as a chunk moves), and wait for
the hops of chunk i+1 issued before them. Backward is that program reversed as above (`reversed_program`; the count
exchanges have none). A checkpointed block's recomputation repeats the forward's program. No latency per call is
modelled (a chunk's all-to-all costs its bytes only), nor the lower efficiency of a chunk's smaller GEMMs: both
would favour fewer chunks, so the search tries few (planning/plan.py OVERLAP_CHOICES).
"""
from __future__ import annotations

import dataclasses
import math

from moep_ds.planning.comm import INSIDE, LEGS, Collective, CommPlan, link_bytes
from moep_ds.planning.hardware import GB, Accelerator, Assumptions
from moep_ds.planning.inventory import Inventory
from moep_ds.planning.layout import Layout
from moep_ds.planning.trace import RoutedStage

ADAM_BYTES_PER_PARAM = 32


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute_s: float
    optimizer_s: float
    comm_s: float  # all communication, as if none overlapped
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    steps: int | None  # of the run (None: the recipe counts epochs)
    run_hours: float | None
    gpu_hours: float | None


def optimizer_share(inv: Inventory, layout: Layout) -> int:
    """Parameters whose Adam update this rank computes."""
    if layout.zero_stage == 0:
        return inv.local_params
    share = sum(g.numel / (layout.expert_data_parallel if g.expert else layout.gpus) for g in inv.groups)
    return int(share)


def seconds_of(c: Collective, layout: Layout, gpu: Accelerator, assumed: Assumptions) -> float:
    """All calls of `c` in a step, on the slower of its links."""
    links = link_bytes(c, layout)
    seconds = max(links.intra / (gpu.intra_node_gbps * GB), links.inter / (gpu.inter_node_gbps * GB))
    return seconds / assumed.comm_efficiency


def span(program: list[tuple]) -> float:
    """Seconds from the first issue to the last completion of `program`, a list of ("send", key, s) on the
    communication stream, ("compute", key, s) on the compute stream and ("wait", key): the compute stream waits
    for an all-to-all. A send starts when the communication stream is free and the compute issued before it is
    done."""
    comm = compute = ready = 0.0
    done: dict[str, float] = {}
    for op in program:
        if op[0] == "send":
            comm = done[op[1]] = max(comm, compute) + op[2]
        elif op[0] == "compute":
            compute = done[op[1]] = max(compute, ready) + op[2]
        else:
            ready = max(ready, done[op[1]])
    return max([compute, *done.values()])


def forward_program(a: float, b: float, e: float, h: float, chunks: int, blocking: bool = False) -> list[tuple]:
    """One forward of a routed stage (module docstring); `blocking`: node-aware dispatch in one chunk, its legs after
    the shared expert."""
    if blocking:
        return [("compute", "S", h), ("send", "D1", a), ("wait", "D1"), ("compute", "E1", e), ("send", "C1", b),
                ("wait", "C1")]
    program: list[tuple] = [("send", "D1", a), ("compute", "S", h)]
    for i in range(1, chunks + 1):
        program += [("send", f"D{i + 1}", a)] * (i < chunks)
        program += [("wait", f"D{i}"), ("compute", f"E{i}", e), ("send", f"C{i}", b)]
    return program + [("wait", f"C{i}") for i in range(1, chunks + 1)]


def backward_program(a: float, b: float, e: float, h: float, chunks: int, blocking: bool = False) -> list[tuple]:
    """One backward of a routed stage: the forward reversed, `a` the combines' gradients, `b` the dispatches'."""
    if blocking:
        return [("send", "C1", a), ("wait", "C1"), ("compute", "E1", e), ("send", "D1", b), ("wait", "D1"),
                ("compute", "S", h)]
    program: list[tuple] = [("send", f"C{i}", a) for i in range(chunks, 0, -1)]
    for i in range(chunks, 0, -1):
        program += [("wait", f"C{i}"), ("compute", f"E{i}", e), ("send", f"D{i}", b)]
        program += [("wait", f"D{i + 1}")] * (i < chunks)
    return program + [("compute", "S", h), ("wait", "D1")]


def node_forward_program(a: float, f: float, b: float, c: float, n: float, e: float, h: float,
                         chunks: int) -> list[tuple]:
    """One forward of a routed stage under node-aware dispatch in chunks (module docstring): per chunk `a` its hop
    between nodes, `f` inside the node, `b` its combine inside the node, `c` between nodes; `n` the count exchange
    inside the node."""
    program: list[tuple] = [("send", "N", n), ("send", "D1", a)] + [("send", "D2", a)] * (chunks > 1)
    program += [("compute", "S", h), ("wait", "N"), ("wait", "D1"), ("send", "F1", f)]
    for i in range(1, chunks + 1):
        program += [("wait", f"D{i + 1}"), ("send", f"F{i + 1}", f)] * (i < chunks)
        program += [("send", f"D{i + 2}", a)] * (i + 1 < chunks)
        program += [("wait", f"F{i}"), ("compute", f"E{i}", e), ("send", f"B{i}", b)]
        program += [("wait", f"B{i - 1}"), ("send", f"C{i - 1}", c)] * (i > 1) + [("wait", f"C{i - 2}")] * (i > 2)
    program += [("wait", f"B{chunks}"), ("send", f"C{chunks}", c)]
    return program + [("wait", f"C{i}") for i in range(max(chunks - 1, 1), chunks + 1)]


def reversed_program(forward: list[tuple], grads: dict[str, float], scale: float = 2.0) -> list[tuple]:
    """The backward of `forward` as autograd runs it: its steps in reverse, the gradient of each all-to-all whose kind
    (its key's letter) `grads` prices sent where the forward waited for it and waited for where the forward sent it,
    every compute `scale` times as long (backward's FLOPs); other all-to-alls (count exchanges) have no backward."""
    out = []
    for op in reversed(forward):
        if op[0] == "compute":
            out.append(("compute", op[1], scale * op[2]))
        elif op[1][0] in grads:
            out.append(("send", op[1], grads[op[1][0]]) if op[0] == "wait" else ("wait", op[1]))
    return out


def exposed_pass(program: list[tuple]) -> float:
    return span(program) - sum(op[2] for op in program if op[0] == "compute")


def expert_exposed(stage: RoutedStage, legs: dict[str, float], layout: Layout, flop_s: float) -> float:
    """Exposed seconds per step of one routed stage's all-to-all; `legs`: the step's seconds on each leg (planning/
    comm.py LEGS, and INSIDE's for node-aware dispatch's hop inside the node)."""
    A, C, nodes = layout.grad_accum, layout.expert_overlap_chunks, layout.expert_node_aware
    forwards = 2 if layout.activation_checkpointing else 1
    per = {leg: seconds / A / C for leg, seconds in legs.items()}  # one chunk of one micro-batch (all its forwards)
    e, h = stage.expert_flops / flop_s / C, stage.beside_flops / flop_s

    def there(*names: str) -> float:  # one forward's
        return sum(per.get(name, 0.0) for name in names) / forwards

    def back(*names: str) -> float:
        return sum(per.get(name, 0.0) for name in names)

    inside = {leg: leg + INSIDE for leg in LEGS}  # node-aware dispatch's hop inside the node
    counts = legs.get("counts", 0.0) + (legs.get(inside["counts"], 0.0) if C == 1 else 0.0)  # the blocking exchanges
    if nodes and C > 1:
        forward = node_forward_program(there("dispatch"), there(inside["dispatch"]), there(inside["combine"]),
                                       there("combine"), C * there(inside["counts"]), e, h, C)
        backward = reversed_program(forward, {"D": back("dispatch_grad"), "F": back(inside["dispatch_grad"]),
                                              "B": back(inside["combine_grad"]), "C": back("combine_grad")})
    else:  # flat; node-aware in one chunk: its hops one after the other, blocking
        forward = forward_program(there("dispatch", inside["dispatch"]), there("combine", inside["combine"]), e, h,
                                  C, nodes)
        backward = backward_program(back("combine_grad", inside["combine_grad"]),
                                    back("dispatch_grad", inside["dispatch_grad"]), 2 * e, 2 * h, C, nodes)
    return counts + A * (forwards * exposed_pass(forward) + exposed_pass(backward))


def comm_seconds(comm: CommPlan, layout: Layout, gpu: Accelerator, assumed: Assumptions,
                 routed: tuple[RoutedStage, ...] = (), last_backward_s: float = math.inf) -> tuple[float, float]:
    """(all communication, the part not hidden behind compute) in seconds per step: the expert all-to-all of the
    stages in `routed` as its schedule exposes it, `overlap` of the other overlappable collectives, of those in the
    "last backward" window at most `last_backward_s` together."""
    total = exposed = 0.0
    legs: dict[str, dict[str, float]] = {}
    hidden = {"step": 0.0, "last backward": 0.0}
    stages = {s.name: s for s in routed}
    for c in comm.collectives:
        seconds = seconds_of(c, layout, gpu, assumed)
        total += seconds
        if c.stage in stages and c.legs:
            for leg in c.legs:  # each call of a micro-batch alike
                legs.setdefault(c.stage, {}).setdefault(leg, 0.0)
                legs[c.stage][leg] += seconds / len(c.legs)
        else:
            exposed += seconds
            hidden[c.window] += seconds * assumed.overlap if c.overlappable else 0.0
    exposed -= hidden["step"] + min(hidden["last backward"], last_backward_s)
    flop_s = gpu.peak_flops(layout.precision) * assumed.compute_efficiency
    return total, exposed + sum(expert_exposed(stages[name], by_leg, layout, flop_s) for name, by_leg in legs.items())


def step_time(inv: Inventory, layout: Layout, comm: CommPlan, gpu: Accelerator, assumed: Assumptions,
              steps: int | None, routed: tuple[RoutedStage, ...] = ()) -> StepTime:
    peak = gpu.peak_flops(layout.precision)
    tokens_per_rank = layout.micro_batch * layout.grad_accum * layout.seq_len
    flops = inv.report.flops_per_token
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute = tokens_per_rank * flops * recompute / (peak * assumed.compute_efficiency)
    compute += layout.grad_accum * assumed.micro_step_ms / 1e3
    optimizer = optimizer_share(inv, layout) * ADAM_BYTES_PER_PARAM / (gpu.hbm_gbps * GB * assumed.hbm_efficiency)
    # a micro-batch's backward: 4 of the 6 FLOPs a parameter trains with, and the recomputed forward (2)
    last_backward = (layout.micro_batch * layout.seq_len * flops * (4 + 2 * layout.activation_checkpointing) / 6
                     / (peak * assumed.compute_efficiency))
    comm_total, exposed = comm_seconds(comm, layout, gpu, assumed, routed, last_backward)
    step = compute + optimizer + exposed
    tokens_per_s = layout.tokens_per_step / step
    run = None if steps is None else steps * step / 3600
    return StepTime(compute, optimizer, comm_total, exposed, step, tokens_per_s,
                    flops * tokens_per_s / (layout.gpus * peak), steps, run,
                    None if run is None else run * layout.gpus)


__all__ = ["ADAM_BYTES_PER_PARAM", "StepTime", "backward_program", "comm_seconds", "expert_exposed",
           "forward_program", "node_forward_program", "optimizer_share", "reversed_program", "span", "step_time"]
