"""Command-line entry points: argument parsing and one-line errors; the work happens elsewhere."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from moep_ds.distributed.launcher import launcher_rank
from moep_ds.errors import ReportedElsewhere, SharedUserError, UserError
from moep_ds.schema import ConfigError

log = logging.getLogger("moep_ds")


STOPPING = """\
stopping and resuming:
  touch RUN_DIR/STOP           the run in RUN_DIR (train.output_dir) checkpoints at the end of its current step
                               and exits 0, within about 5 s; the file is removed when a run starts there
  Ctrl-C                       the same (a second Ctrl-C aborts without a checkpoint)
  --set train.exit_at_step=N   checkpoint and exit after step N
  kill -USR1 <trainer pids>    (or -TERM) the same as the STOP file. Name this run's processes only, e.g.
                               pkill -USR1 -u "$USER" -f -- "--config configs/x.yaml": a bare `pkill -f pretrain.py`
                               stops every run on the machine, other users' included where it may
  launchers/local.sh           runs deepspeed for you: `kill -USR1 <pid of local.sh>` checkpoints and stops
  --resume auto                continues from the newest complete checkpoint in train.output_dir; a run started
                               without it in a folder that holds another run is refused (--overwrite replaces that
                               run; --allow_batch_change resumes with another global batch size)

  SIGTERM to the `deepspeed` runner process kills only the runner (DeepSpeed's launcher does not pass it
  on; the runner exits 143): the trainers go on, orphaned. They check every 5 s whether their launcher is
  gone and then checkpoint and exit as on SIGUSR1; signal the trainers themselves to stop without the wait.
  A trainer started without a launcher (python pretrain.py ... &) is not watched: it trains on after its shell exits.
"""


# argparse types for counts: 0 would be read as "unset" or give inf / nan; argparse reports them in one usage line
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for the commands a launcher starts on every rank: every rank gets the same command line, so
    a usage error is printed by rank 0 only (the others exit with argparse's status 2 silently)."""

    def error(self, message: str):
        if launcher_rank() == 0:
            super().error(message)
        sys.exit(2)


def pretrain_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description="Pre-train a moep_ds model under DeepSpeed.", epilog=STOPPING,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    p.add_argument("--ds_config", help="DeepSpeed JSON config (ds_configs/*.json)")
    p.add_argument("--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, e.g. train.optimizer.lr=1e-3 (may be repeated)")
    p.add_argument("--dry_run", action="store_true", help="print the parameter/FLOP report as one JSON line and exit")
    p.add_argument("--resume", default=None, help="'auto' (latest complete checkpoint in output_dir) or a checkpoint dir")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the run train.output_dir holds (its checkpoints and logs) and start a new one there")
    p.add_argument("--allow_batch_change", action="store_true",
                   help="resume with another global batch size than the checkpoint's (continues from the sample "
                        "it reached)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def exit_joined(code: int) -> int:
    """`code`, for a command that failed while still in its process group (distributed/process_group.py
    `leave_process_group`): the interpreter's teardown could race gloo's worker threads, which let go of the last
    collective's tensors just after it returned, and abort the process (seen in ~1 of 10 two-process runs that
    agreed on a bad output directory). A process alone in its group leaves it here. With several ranks the others
    may be anywhere, so this rank cannot wait for them: it flushes its logs and standard streams and exits with
    `code` at once, without the teardown; nothing else is pending at that point."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return code
    if dist.get_world_size() == 1:
        from moep_ds.distributed.process_group import leave_process_group

        leave_process_group()
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_guarded(fn, *args) -> int:
    """Run a command body, turning expected failures into one line on stderr and exit status 2.

    Every rank of a launcher gets the same command line, recipe and ds_config, so an error in them (ConfigError,
    SharedUserError) is printed by rank 0 only; other bad input (a file one node lacks) may differ between ranks
    and is printed by each, prefixed with its rank. The rank is the launcher's (environment), so this holds before
    and after the process group is joined."""
    try:
        return fn(*args) or 0
    except ReportedElsewhere:  # another rank printed the error
        return exit_joined(2)
    except UserError as err:
        rank = launcher_rank()
        if rank == 0:
            print(f"error: {err}", file=sys.stderr)
        elif not isinstance(err, (ConfigError, SharedUserError)):  # every rank hits those alike
            print(f"[rank {rank}] error: {err}", file=sys.stderr)
        return exit_joined(2)
    except KeyboardInterrupt:  # a second Ctrl-C while the trainer checkpoints, or one before training started
        rank = launcher_rank()
        print("interrupted" if rank == 0 else f"[rank {rank}] interrupted", file=sys.stderr)
        return exit_joined(130)


def run_command(body, args: argparse.Namespace) -> int:
    """Entry point of a console script: INFO logging to stderr, then `body(args)` with one-line errors."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_guarded(body, args)


def dry_run(cfg) -> int:
    from moep_ds.models.accounting import meta_param_report

    print(json.dumps(meta_param_report(cfg.model).as_dict()))
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from moep_ds.config import load_config

    cfg = load_config(args.config, args.set)
    if args.dry_run:
        return dry_run(cfg)
    from moep_ds.training.trainer import fit

    return fit(cfg, ds_config_path=args.ds_config, resume=args.resume, overwrite=args.overwrite,
               allow_batch_change=args.allow_batch_change)


def pretrain_main(argv: list[str] | None = None) -> int:
    args = pretrain_parser().parse_args(argv)
    return run_guarded(_pretrain, args)


def analyze_main(argv: list[str] | None = None) -> int:
    """`moep-analyze RUN_DIR`: expert-utilisation summary and plots of a run (training/analyze.py)."""
    parser = argparse.ArgumentParser(description="Expert-utilisation summary and plots of a moep_ds run.")
    parser.add_argument("run_dir")
    parser.add_argument("--no_plots", action="store_true")
    args = parser.parse_args(argv)

    def body(args: argparse.Namespace) -> int:
        from moep_ds.training.analyze import analyze, markdown

        summary = analyze(args.run_dir, plots=not args.no_plots)
        print(markdown(summary), end="")
        return 0

    return run_command(body, args)  # logging set up as in the other console scripts: warnings show as such
