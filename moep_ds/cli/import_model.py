"""`moep-import SRC --out RUN_DIR [--config RECIPE] [--set k=v ...]`: a Hugging Face checkpoint (a folder, or
hf:REPO[@REVISION] from huggingface_hub's cache) or a dense moep_ds checkpoint into a moep_ds run directory.

    moep-import hf:allenai/OLMoE-1B-7B-0924 --out runs/olmoe
    moep-import hf:EleutherAI/pythia-1b@step13000 --out runs/pythia_1b_step13000 --config configs/pythia_1b_dense.yaml
    moep-import runs/pythia_1b_step13000 --out runs/pythia_1b_upcycled --config configs/pythia_1b_upcycled_moe.yaml

Without --config the recipe is the one that reproduces the Hugging Face source (its config.json read as a recipe;
written as the checkpoint's config.yaml); with it, every setting where the recipe's model differs from the source
is one line. With a recipe that sets model.upcycle (an FFN-MoE of the same backbone), the dense source is
upcycled.

Under a launcher no process holds the whole model: each rank reads and writes its part, ZeRO-3 partitions (default)
or, with --expert_parallel, 1/N of the experts and the rest whole (interop/importer.py: import_split); the run
directory is the one a single process writes.

    torchrun --nproc_per_node 8 -m moep_ds.cli.import_model hf:deepseek-ai/DeepSeek-V2-Lite --out runs/v2_lite \
        --expert_parallel
"""
from __future__ import annotations

import argparse
import logging
import sys

from moep_ds.distributed.commands import ArgumentParser, run_command, run_split

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="moep-import", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("source", metavar="SRC", help="Hugging Face folder, hf:REPO[@REVISION], or moep_ds checkpoint")
    p.add_argument("--out", required=True, help="the run directory to write (new or empty)")
    p.add_argument("--config", help="the recipe whose model the weights are checked against (default: the one "
                                     "that reproduces a Hugging Face SRC)")
    p.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. model.upcycle.noise_std=0.01")
    p.add_argument("--expert_parallel", action="store_true",
                   help="under a launcher: each rank holds 1/N of the experts (the rest whole) instead of ZeRO-3 "
                        "partitions")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def _main(args: argparse.Namespace) -> int:
    from moep_ds.config import config_from_dict
    from moep_ds.recipe_yaml import read_yaml
    from moep_ds.distributed.launcher import launched_world_size
    from moep_ds.interop.importer import import_checkpoint, import_split
    from moep_ds.interop.sources import source_recipe

    raw = read_yaml(args.config, "--config") if args.config else source_recipe(args.source)
    if isinstance(raw.get("model"), dict):  # SRC is the model's init_from here (a recipe with model.upcycle needs one)
        raw["model"] = {**raw["model"], "init_from": args.source}
    cfg = config_from_dict(raw, args.set)
    if launched_world_size() > 1:
        import_split(args.source, cfg, args.out, args.expert_parallel)
    else:
        if args.expert_parallel:
            log.warning("--expert_parallel ignored: one process holds every expert")
        import_checkpoint(args.source, cfg, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_split(run_command, _main, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
