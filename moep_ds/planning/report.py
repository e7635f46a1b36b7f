"""A plan as text (the tables moep-plan prints), as JSON, and as a PNG of the memory breakdown per rank."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from moep_ds.planning.comm import link_bytes
from moep_ds.planning.hardware import GIB
from moep_ds.planning.plan import RunPlan


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def duration(hours: float) -> str:
    return f"{hours * 60:,.1f} min" if hours < 1 else f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} days"


def header(run: RunPlan, recipe: str) -> list[str]:
    inv, layout, report = run.inventory, run.layout, run.inventory.report
    return [
        f"# moep-plan {recipe}: {layout.gpus} x {run.gpu.name}",
        f"layout: {layout.describe()}",
        f"model: {report.params_total:,} parameters ({report.params_active:,} active per token), "
        f"{report.flops_per_token / 1e9:,.3f} GFLOPs per token trained (pretrain.py --dry_run); a rank holds "
        f"{inv.local_params:,} ({inv.dense_params:,} dense, {inv.expert_params:,} of experts)",
    ]


def memory_lines(run: RunPlan) -> list[str]:
    lines = ["", "## memory per rank", "| item | GiB | when | note |", "|---|---:|---|---|"]
    when = {"static": "held", "backward": "backward peak", "reduce": "gradient reduction", "step": "optimizer step",
            "kept": "reduction and step", "gathered": "backward and reduction", "host": "host, at a save"}
    for item in run.memory.items:
        lines.append(f"| {item.name} | {gib(item.bytes)} | {when[item.phase]} | {item.note} |")
    verdict = (f"fits the {run.capacity / GIB:.0f} GiB usable of {run.gpu.name}" if run.fits else run.shortfall())
    lines.append(f"| **peak** | **{gib(run.memory.peak)}** | {when[run.memory.peak_phase]} | {verdict} |")
    return lines


def comm_lines(run: RunPlan) -> list[str]:
    lines = ["", "## communication per step per rank",
             "| collective | what | MiB per call | calls | group | within node MiB | between nodes MiB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    intra = inter = 0.0
    for c in run.comm.collectives:
        links = link_bytes(c, run.layout)
        intra, inter = intra + links.intra, inter + links.inter
        lines.append(f"| {c.kind} | {c.what} | {mib(c.bytes)} | {c.calls} | {c.group} | {mib(links.intra)} | "
                     f"{mib(links.inter)} |")
    totals = ", ".join(f"{kind} {mib(n)} MiB" for kind, n in run.comm.by_kind().items()) or "none (one GPU)"
    lines.append(f"by collective: {totals}; on the links: {mib(intra)} MiB within a node, {mib(inter)} MiB "
                 "between nodes")
    return lines


def time_lines(run: RunPlan) -> list[str]:
    t, gpu, a = run.time, run.gpu, run.assumed
    peak = gpu.peak_flops(run.layout.precision) / 1e12
    lines = [
        "", "## step time",
        f"{gpu.name}: {peak:g} TFLOP/s {run.layout.precision}, HBM {gpu.hbm_gbps:g} GB/s, {gpu.memory_gib:g} GiB; "
        f"{gpu.intra_node_gbps:g} GB/s within a node, {gpu.inter_node_gbps:g} GB/s between nodes (per GPU, per "
        "direction)",
        f"assumed: compute efficiency {a.compute_efficiency:.2f}, communication efficiency {a.comm_efficiency:.2f}, "
        f"HBM efficiency {a.hbm_efficiency:.2f}, overlap {a.overlap:.2f} of the overlappable communication "
        f"(the expert all-to-all: as its schedule hides it behind the experts), {a.micro_step_ms:g} ms per "
        f"micro-batch, {a.reserve_gib:g} GiB reserved",
        f"compute {t.compute_s:.3f} s + optimizer {t.optimizer_s:.3f} s + exposed communication "
        f"{t.exposed_comm_s:.3f} s (of {t.comm_s:.3f} s; {100 * t.exposed_comm_s / t.step_s:.1f}% of the step) = "
        f"step {t.step_s:.3f} s",
        f"{t.tokens_per_s:,.0f} tokens/s, MFU {100 * t.mfu:.1f}%",
    ]
    if t.steps is None:
        lines.append("the recipe counts epochs (train.max_steps unset): --set train.max_steps=N for the run's time")
    else:
        lines.append(f"{t.steps:,} steps: {duration(t.run_hours)}, {t.gpu_hours:,.0f} GPU-hours")
    return lines


def text(run: RunPlan, recipe: str) -> str:
    return "\n".join(header(run, recipe) + memory_lines(run) + comm_lines(run) + time_lines(run)) + "\n"


def search_table(runs: list[RunPlan], recipe: str, limit: int = 20) -> str:
    """The fitting layouts, fastest first (the first `limit`; --json lists all)."""
    fitting = [r for r in runs if r.fits]
    head = runs[0] if runs else None
    lines = [f"# moep-plan {recipe} --search: {len(fitting)} of {len(runs)} layouts fit"
             + (f" ({head.layout.gpus} x {head.gpu.name}, fastest first)" if head else ""),
             "| # | expert parallel | expert all-to-all | ZeRO | micro x accum | act. ckpt | peak GiB | step s | "
             "tokens/s | MFU | all-to-all MiB | exposed comm. | GPU-hours |",
             "|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(fitting[:limit], 1):
        lay, t = r.layout, r.time
        hours = "-" if t.gpu_hours is None else f"{t.gpu_hours:,.0f}"
        comm = lay.expert_comm() if lay.expert_parallel > 1 else "-"
        zero = f"{lay.zero_stage}" + " overlap_comm" * (lay.overlap_comm and lay.zero_stage in (1, 2))
        lines.append(f"| {i} | {lay.expert_parallel} | {comm} | {zero} | {lay.micro_batch} x "
                     f"{lay.grad_accum} | {'on' if lay.activation_checkpointing else 'off'} | {gib(r.memory.peak)} | "
                     f"{t.step_s:.3f} | {t.tokens_per_s:,.0f} | {100 * t.mfu:.1f}% | "
                     f"{mib(r.comm.by_kind().get('all_to_all', 0))} | {100 * t.exposed_comm_s / t.step_s:.1f}% | "
                     f"{hours} |")
    if len(fitting) > limit:
        lines.append(f"... {len(fitting) - limit} more fitting layouts (--json lists every one)")
    return "\n".join(lines) + "\n"


def as_dict(run: RunPlan) -> dict[str, Any]:
    layout = run.layout
    return {
        "layout": {"gpus": layout.gpus, "gpus_per_node": layout.cluster.gpus_per_node,
                   "data_parallel": layout.gpus, "expert_parallel": layout.expert_parallel,
                   "zero_stage": layout.zero_stage, "overlap_comm": layout.overlap_comm, "precision": layout.precision,
                   "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum, "seq_len": layout.seq_len,
                   "activation_checkpointing": layout.activation_checkpointing,
                   "expert_comm": {"dedup": layout.expert_dedup, "node_aware": layout.expert_node_aware,
                                   "fp8_dispatch": layout.expert_fp8_dispatch,
                                   "overlap_chunks": layout.expert_overlap_chunks}},
        "model": {**run.inventory.report.as_dict(), "params_local": run.inventory.local_params,
                  "params_local_experts": run.inventory.expert_params},
        "memory": {"items": [dataclasses.asdict(i) for i in run.memory.items], "peak_bytes": run.memory.peak,
                   "peak_phase": run.memory.peak_phase, "capacity_bytes": run.capacity, "fits": run.fits},
        "communication": {
            "collectives": [{**dataclasses.asdict(c), "intra_node_bytes": link_bytes(c, layout).intra,
                             "inter_node_bytes": link_bytes(c, layout).inter} for c in run.comm.collectives],
            "bytes_by_kind": run.comm.by_kind()},
        "time": dataclasses.asdict(run.time),
        "gpu": dataclasses.asdict(run.gpu),
        "assumptions": dataclasses.asdict(run.assumed),
    }


def memory_png(runs: list[RunPlan], path: pathlib.Path) -> None:
    """One horizontal stacked bar per layout: the items of its peak phase, in GiB, with the usable capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(i.name for r in runs for i in r.memory.items
                               if i.counts_in(r.memory.peak_phase) and i.bytes))
    fig, ax = plt.subplots(figsize=(10, max(2.8, 1.2 + 0.5 * len(runs))))
    colours = plt.get_cmap("tab20").colors
    for row, run in enumerate(runs):
        left = 0.0
        for i in run.memory.items:
            if i.counts_in(run.memory.peak_phase) and i.bytes:
                colour = colours[names.index(i.name) % len(colours)]
                ax.barh(row, i.bytes / GIB, left=left, color=colour, label=i.name if row == 0 or
                        i.name not in {j.name for r in runs[:row] for j in r.memory.items} else None)
                left += i.bytes / GIB
    ax.axvline(runs[0].capacity / GIB, color="black", linestyle="--", label="usable GPU memory")
    ax.set_yticks(range(len(runs)), [f"ep {r.layout.expert_parallel} ZeRO-{r.layout.zero_stage} "
                                     f"mb {r.layout.micro_batch} {'ckpt' if r.layout.activation_checkpointing else ''}"
                                     for r in runs])
    ax.set_xlabel("GiB per rank")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["as_dict", "memory_png", "search_table", "text"]
