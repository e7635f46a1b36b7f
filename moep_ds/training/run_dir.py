"""The run directory contract: a train.output_dir belongs to one run.

A run that starts (no --resume) in a folder that already holds another run's checkpoints or logs is refused with
one line naming the ways out: `--resume auto` continues that run, a new train.output_dir starts another one, and
`--overwrite` replaces it. Otherwise keep-last rotation would delete the new run's checkpoints in favour of the
old run's later steps, metrics.jsonl would hold both runs, and a later `--resume auto` could pick the old run's
newest checkpoint.

`--overwrite` (rank 0 only, before anything of the new run is written): what the trainer writes there (RUN_FILES)
is first renamed into one hidden folder `.overwritten-<hex>` inside the run directory, then that folder is deleted.
The renames are quick and leave no mix of two runs (a crash between them leaves the old files in the hidden folder,
which the next --overwrite deletes); files the trainer does not write (a user's notes, `eval/` results) stay.

`--resume PATH` of a checkpoint of another run directory starts a new run from it: that is a new run for this
contract (the folder must be free of runs, or --overwrite given). `--resume auto` in a folder without a complete
checkpoint starts at step 0: the logs a run killed before its first checkpoint left are emptied, not appended to.
"""
from __future__ import annotations

import logging
import pathlib
import secrets
import shutil

import torch.distributed as dist

from moep_ds.checkpointing import layout
from moep_ds.errors import SharedUserError
from moep_ds.training.monitor import LOG_FILES, drop_rows_after

log = logging.getLogger(__name__)

# `touch RUN_DIR/STOP`: the trainers checkpoint and stop at the next step (StopRequest); removed when a run starts
STOP_FILE = "STOP"
# what a run writes in its directory (the DeepSpeed TensorBoard job is `tensorboard`; moep-analyze `analysis/`)
RUN_FILES = (layout.CHECKPOINTS, *LOG_FILES, "tensorboard", "analysis", STOP_FILE)
OVERWRITTEN_PREFIX = ".overwritten-"


def run_contents(run_dir: pathlib.Path) -> list[str]:
    """What of a run `run_dir` holds, for the error: its checkpoints (complete or not) and its non-empty logs."""
    found = []
    root = layout.checkpoint_root(run_dir)
    steps = sorted(d.name for d in root.iterdir() if layout.step_of(d) >= 0) if root.is_dir() else []
    if steps:
        found.append(f"checkpoints {steps[0]}" + (f"..{steps[-1]}" if len(steps) > 1 else ""))
    found += [name for name in LOG_FILES if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    return found


def is_own_checkpoint(resume: str, run_dir: pathlib.Path) -> bool:
    return pathlib.Path(resume).resolve().parent == layout.checkpoint_root(run_dir).resolve()


def decide(run_dir: pathlib.Path, resume: str | None, overwrite: bool) -> tuple[str, str | None]:
    """(action, error): action "new", "continue", "restart" (--resume auto without a checkpoint: empty the logs)
    or "overwrite"; error a one-line refusal, else None."""
    if overwrite and resume is not None:
        return "new", (f"--overwrite and --resume {resume} exclude each other: --resume continues the run in "
                       f"{str(run_dir)!r}, --overwrite deletes it")
    found = run_contents(run_dir) if run_dir.is_dir() else []
    if resume == "auto":
        return ("continue" if layout.complete_checkpoints(run_dir) else "restart" if found else "new"), None
    if resume is not None and is_own_checkpoint(resume, run_dir):
        return "continue", None
    if not found:
        return "new", None
    if overwrite:
        return "overwrite", None
    other = f"--resume {resume} starts a new run from a checkpoint of another run directory, but " if resume else ""
    return "new", (f"{other}train.output_dir ({str(run_dir)!r}) holds another run ({', '.join(found)}): continue it "
                   f"with --resume auto, start a new run in a new train.output_dir (--set train.output_dir=...), "
                   f"or pass --overwrite to delete that run first")


def claim_run_dir(run_dir: pathlib.Path, resume: str | None, overwrite: bool) -> None:
    """Apply the contract on every rank (collective): rank 0 looks and acts, the others follow its decision."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    decision = [decide(run_dir, resume, overwrite) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(decision, src=0)
    action, error = decision[0]
    if error is not None:
        raise SharedUserError(error)
    if rank == 0 and (run_dir / STOP_FILE).exists() and action != "overwrite":
        log.warning("removing %s left by an earlier stop request", run_dir / STOP_FILE)
        (run_dir / STOP_FILE).unlink()
    if rank == 0 and action == "overwrite":
        overwrite_run(run_dir)
    elif rank == 0 and action == "restart":
        log.warning("--resume auto: %s holds no complete checkpoint; starting at step 0 (its logs emptied)", run_dir)
        drop_rows_after(run_dir, 0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # nobody writes into the folder before rank 0 has cleared it


def overwrite_run(run_dir: pathlib.Path) -> None:
    """Delete what an earlier run wrote in `run_dir` (RUN_FILES): renamed into one hidden folder, then deleted."""
    for left in run_dir.glob(f"{OVERWRITTEN_PREFIX}*"):  # of an --overwrite killed before it finished
        shutil.rmtree(left, ignore_errors=True)
    trash = run_dir / f"{OVERWRITTEN_PREFIX}{secrets.token_hex(6)}"
    trash.mkdir()
    moved = []
    for name in RUN_FILES:
        if (run_dir / name).exists() or (run_dir / name).is_symlink():
            (run_dir / name).rename(trash / name)
            moved.append(name)
    shutil.rmtree(trash, ignore_errors=True)
    log.warning("--overwrite: deleted the earlier run in %s (%s)", run_dir, ", ".join(moved))
