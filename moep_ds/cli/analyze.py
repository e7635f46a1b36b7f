"""`moep-analyze RUN_DIR`: expert-utilisation summary and plots of a run (training/analyze.py)."""
from __future__ import annotations

import argparse
import sys

from moep_ds.distributed.commands import Parser, run_command


def main(argv: list[str] | None = None) -> int:
    """`moep-analyze RUN_DIR`: expert-utilisation summary and plots of a run (training/analyze.py)."""
    parser = Parser(prog="moep-analyze", description="Expert-utilisation summary and plots of a moep_ds run.")
    parser.add_argument("run_dir")
    parser.add_argument("--no_plots", action="store_true")
    args = parser.parse_args(argv)

    def body(args: argparse.Namespace) -> int:
        from moep_ds.training.analyze import analyze, markdown

        summary = analyze(args.run_dir, plots=not args.no_plots)
        print(markdown(summary), end="")
        return 0

    return run_command(body, args)  # logging set up as in the other console scripts: warnings show as such


if __name__ == "__main__":
    sys.exit(main())
