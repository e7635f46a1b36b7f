"""`moep-convert SRC --out DST`: a consolidated checkpoint (model.safetensors: a model directory, a training checkpoint
of before 2026-12-03 with optimizer.pt, or a `moep-export --hf` directory) written once as a sharded checkpoint,
the only format moep-eval, moep-export, moep-generate, model.init_from and --resume load. DST appears whole or
not at all (moep_ds/checkpointing/convert.py)."""
from __future__ import annotations

import argparse
import sys

from moep_ds.distributed.commands import Parser, run_command


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="moep-convert", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="consolidated checkpoint or model directory (holds model.safetensors)")
    p.add_argument("--out", required=True, metavar="DST",
                   help="new directory to write (a converted training checkpoint resumes with --resume DST)")
    return p


def _main(args: argparse.Namespace) -> int:
    from moep_ds.checkpointing.convert import convert

    convert(args.src, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(_main, parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
