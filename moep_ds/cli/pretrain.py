"""`moep-pretrain` (and pretrain.py): parse the arguments, load the recipe, then train (training/trainer.py) or,
with --dry_run, print the parameter / FLOP report."""
from __future__ import annotations

import argparse
import sys
import json

from moep_ds.distributed.commands import ArgumentParser, run_guarded


STOPPING = """\
stopping and resuming:
  touch RUN_DIR/STOP           the run in RUN_DIR (train.output_dir) checkpoints at the end of its current step
                               and exits 0, within about 5 s; the file is removed when a run starts there
  Ctrl-C                       the same (a second Ctrl-C, a second or more later, aborts without a checkpoint);
                               under a bare `deepspeed` the runner then prints a KeyboardInterrupt traceback and
                               exits 130 at once while the trainers finish their checkpoint (its launcher SIGKILLs
                               a trainer not gone 30 s after its SIGTERM): launchers/local.sh exits 0 instead
  --set train.exit_at_step=N   checkpoint and exit after step N
  kill -USR1 <trainer pids>    (or -TERM) the same as the STOP file. Name this run's processes only, e.g.
                               pkill -USR1 -u "$USER" -f -- "--config configs/x.yaml": a bare `pkill -f pretrain.py`
                               stops every run on the machine, other users' included where it may
  launchers/local.sh           runs deepspeed for you: `kill -USR1 <pid of local.sh>` checkpoints and stops
  --resume auto                continues from the newest complete checkpoint in train.output_dir; a run started
                               without it in a folder that holds another run is refused (--overwrite replaces that
                               run; --allow_batch_change resumes with another global batch size)
  --resume RUN_DIR/checkpoints/step_N
                               an older checkpoint of the run starts a new branch: the later checkpoints and the
                               logs after step N move to RUN_DIR/branches/after_step_N-<time>/ (kept, never
                               deleted); --resume auto then continues the new branch
  one run at a time            a run holds RUN_DIR/.lock while it runs: a second run into the folder is refused,
                               naming the holder (host, pid, start); a requeued SLURM job waits for its earlier
                               start (MOEP_RUN_LOCK_WAIT seconds, default 180), then takes over

  SIGTERM to the `deepspeed` runner process kills only the runner (DeepSpeed's launcher does not pass it
  on; the runner exits 143): the trainers go on, orphaned. They check every 5 s whether their launcher is
  gone and then checkpoint and exit as on SIGUSR1; signal the trainers themselves to stop without the wait.
  A trainer started without a launcher (python pretrain.py ... &) is not watched: it trains on after its shell exits.

  A loss (on any rank) or gradient norm that is nan or inf stops the run after that step, on every rank, with one
  line (error: non-finite loss (nan on rank 1) at step N: ...) and exit status 1, a failed run: nothing of step N is
  saved and the checkpoints before it are kept (--resume auto continues from the newest, e.g. with a lower lr).
  A step the fp16 loss scaler skips (a gradient overflow; its grad_norm is logged as null) is no such failure.
"""



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


def main(argv: list[str] | None = None) -> int:
    args = pretrain_parser().parse_args(argv)
    return run_guarded(_pretrain, args)


if __name__ == "__main__":
    sys.exit(main())
