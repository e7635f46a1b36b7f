"""Step time from the hardware table and the assumptions printed beside it.

    compute    tokens per rank per step x training FLOPs per token (pretrain.py --dry_run's: 6 x active matmul
               parameters + attention), plus one more forward (a third of it) under activation checkpointing,
               at compute_efficiency x peak, plus micro_step_ms per micro-batch
    optimizer  the Adam step reads and writes about 32 bytes per parameter of the rank's share (fp32 master, two
               moments, gradient, the new 16-bit weight), at hbm_efficiency x HBM bandwidth
    comm       each collective's bytes on the slower of its links (planning/comm.py), at comm_efficiency x
               bandwidth; `overlap` of the overlappable ones (ZeRO-3 gathers and reductions, ZeRO-2 reduction
               under overlap_comm) hidden behind compute, the rest (and every all-to-all) exposed
    step = compute + optimizer + exposed comm; tokens/s = tokens per step / step; MFU = FLOPs per token x tokens/s /
    (GPUs x peak): model FLOPs only, recomputation not counted
"""
from __future__ import annotations

import dataclasses

from moep_ds.planning.comm import CommPlan, link_bytes
from moep_ds.planning.hardware import GB, Accelerator, Assumptions
from moep_ds.planning.inventory import Inventory
from moep_ds.planning.layout import Layout

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


def comm_seconds(comm: CommPlan, layout: Layout, gpu: Accelerator, assumed: Assumptions) -> tuple[float, float]:
    """(all communication, the part not hidden behind compute) in seconds per step."""
    total = exposed = 0.0
    for c in comm.collectives:
        links = link_bytes(c, layout)
        seconds = max(links.intra / (gpu.intra_node_gbps * GB), links.inter / (gpu.inter_node_gbps * GB))
        seconds /= assumed.comm_efficiency
        total += seconds
        exposed += seconds * (1 - assumed.overlap) if c.overlappable else seconds
    return total, exposed


def step_time(inv: Inventory, layout: Layout, comm: CommPlan, gpu: Accelerator, assumed: Assumptions,
              steps: int | None) -> StepTime:
    peak = gpu.peak_flops(layout.precision)
    tokens_per_rank = layout.micro_batch * layout.grad_accum * layout.seq_len
    flops = inv.report.flops_per_token
    recompute = 4 / 3 if layout.activation_checkpointing else 1.0
    compute = tokens_per_rank * flops * recompute / (peak * assumed.compute_efficiency)
    compute += layout.grad_accum * assumed.micro_step_ms / 1e3
    optimizer = optimizer_share(inv, layout) * ADAM_BYTES_PER_PARAM / (gpu.hbm_gbps * GB * assumed.hbm_efficiency)
    comm_total, exposed = comm_seconds(comm, layout, gpu, assumed)
    step = compute + optimizer + exposed
    tokens_per_s = layout.tokens_per_step / step
    run = None if steps is None else steps * step / 3600
    return StepTime(compute, optimizer, comm_total, exposed, step, tokens_per_s,
                    flops * tokens_per_s / (layout.gpus * peak), steps, run,
                    None if run is None else run * layout.gpus)


__all__ = ["ADAM_BYTES_PER_PARAM", "StepTime", "comm_seconds", "optimizer_share", "step_time"]
