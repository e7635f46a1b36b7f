"""`moep-plan RECIPE --ds_config JSON --gpus N`: memory per rank, communication per step and step time of a recipe
on a cluster shape (moep_ds/planning/), or with --search every layout that fits, fastest first.

Exit status: 0 the layout fits (with --search: some layout fits), 1 it does not (the last line says by how much
and which item is largest), 2 bad input (one line naming the value)."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from moep_ds.distributed.commands import Parser, run_command
from moep_ds.errors import UserError

EPILOG = """\
examples:
  moep-plan configs/pythia_1b_ffn_moe.yaml --ds_config ds_configs/zero1_bf16.json --gpus 64
  moep-plan configs/nova_moe.yaml --ds_config ds_configs/zero2_bf16.json --gpus 16 --gpu a100 \\
      --set train.expert_parallel_size=8 train.max_steps=20000
  moep-plan configs/pythia_1b_moep.yaml --ds_config ds_configs/zero1_bf16.json --gpus 512 --search --json
"""


def plan_parser() -> Parser:
    p = Parser(prog="moep-plan", description="Plan a run: memory per rank, communication and step time of a recipe "
               "on a cluster shape.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="YAML recipe (configs/*.yaml)")
    p.add_argument("--ds_config", required=True, help="DeepSpeed JSON config (ds_configs/*.json)")
    # counts are checked in `body`, so that a bad one is one line (argparse's type errors print the usage block)
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpus_per_node", type=int, default=None, help="GPUs per node (default: 8, or --gpus "
                   "when fewer)")
    p.add_argument("--gpu", default="h100", help="h100, h200, h800, a100 or mi300x, any case (default h100)")
    p.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. train.expert_parallel_size=8 train.micro_batch_size=4")
    p.add_argument("--hardware", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="override the GPU's numbers: memory_gib, bf16_tflops, fp32_tflops, hbm_gbps, intra_node_gbps, "
                        "inter_node_gbps")
    p.add_argument("--assume", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="override the assumptions: compute_efficiency (0.45), comm_efficiency (0.7), hbm_efficiency "
                        "(0.8), overlap (0.5), reserve_gib (2), micro_step_ms (3)")
    p.add_argument("--search", action="store_true",
                   help="every layout (expert parallel x ZeRO stage, 1 and 2 with overlap_comm off and on x "
                        "micro-batch x activation checkpointing x train.expert_comm: once per rank, node-aware, FP8 "
                        "dispatch, overlap chunks) that fits, ordered by predicted step time")
    p.add_argument("--json", action="store_true", help="print the plan (with --search: every fitting layout) as JSON")
    p.add_argument("--png", type=pathlib.Path, help="write the memory breakdown per rank as a PNG")
    return p


def body(args: argparse.Namespace) -> int:
    from moep_ds.config import load_config
    from moep_ds.planning import report
    from moep_ds.planning.hardware import assumptions, check_reserve, hardware
    from moep_ds.planning.layout import Cluster
    from moep_ds.planning.plan import plan_run
    from moep_ds.training.ds_config import read_ds_config

    for flag in ("gpus", "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} ({value}) must be a positive integer")
    gpu, assumed = hardware(args.gpu, args.hardware), assumptions(args.assume)
    check_reserve(gpu, assumed)
    cluster = Cluster(args.gpus, args.gpus_per_node or min(8, args.gpus))
    cfg = load_config(args.recipe, args.set)
    ds = read_ds_config(args.ds_config)
    if args.search:
        return searched(cfg, ds, cluster, gpu, assumed, args)
    run = plan_run(cfg, ds, cluster, gpu, assumed)
    print(json.dumps(report.as_dict(run), indent=1) if args.json else report.text(run, args.recipe), end="\n"
          if args.json else "")
    if args.png:
        report.memory_png([run], args.png)
    if not run.fits:
        print(f"moep-plan: {run.shortfall()}", file=sys.stderr)
        return 1
    return 0


def searched(cfg, ds, cluster, gpu, assumed, args: argparse.Namespace) -> int:
    from moep_ds.planning import report
    from moep_ds.planning.plan import recipe_global_batch, search

    global_batch = recipe_global_batch(cfg, ds, cluster)  # kept by every layout searched
    runs = search(cfg, ds, cluster, gpu, assumed, global_batch)
    if not runs:
        why = (f": every rank is data-parallel, and {global_batch} is not a multiple of {cluster.gpus}"
               if global_batch % cluster.gpus else "")
        raise UserError(f"no layout of {global_batch} sequences per step on {cluster.gpus} GPUs is possible{why}")
    fitting = [r for r in runs if r.fits]
    if args.json:
        print(json.dumps([report.as_dict(r) for r in fitting], indent=1))
    else:
        print(report.search_table(runs, args.recipe), end="")
    if args.png and fitting:
        report.memory_png(fitting[:12], args.png)
    if not fitting:
        closest = min(runs, key=lambda r: r.memory.peak)
        print(f"moep-plan: no layout fits; the smallest, {closest.layout.describe()}, {closest.shortfall()}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(body, plan_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
