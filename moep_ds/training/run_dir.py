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

One running job per folder: rank 0 takes the folder's lock (training/run_lock.py) before it looks, and holds it for
the life of its process; a second run into a folder another live run holds is refused in one line naming the holder
(host, pid, start time, SLURM job), and removes nothing (RunDirInUse). A requeued SLURM job waits for its own earlier
start, then takes over.

Resuming an older checkpoint of the run (`--resume RUN/checkpoints/step_40` where 50 and 60 exist) starts a new
branch: the later checkpoints, and the rows and TensorBoard events of the steps after the resumed one, are moved into
`RUN/branches/after_step_00000040-<UTC time>/` (same names inside: checkpoints/, metrics.jsonl, ...), never deleted,
and one warning line says where. `--resume auto` then continues the new branch, the only one left in checkpoints/;
to go back to an abandoned one, resume from its checkpoint into a new train.output_dir.
"""
from __future__ import annotations

import datetime
import logging
import pathlib
import secrets
import shutil

import torch.distributed as dist

from moep_ds.checkpointing import layout
from moep_ds.errors import SharedUserError
from moep_ds.training.monitor import LOG_FILES, TENSORBOARD_DIR, drop_rows_after
from moep_ds.training.run_lock import lock_run_dir

log = logging.getLogger(__name__)

# `touch RUN_DIR/STOP`: the trainers checkpoint and stop at the next step (StopRequest); removed when a run starts
STOP_FILE = "STOP"
BRANCHES = "branches"  # abandoned branches of the run (start_branch)
# what a run writes in its directory (the DeepSpeed TensorBoard job is `tensorboard`; moep-analyze `analysis/`)
RUN_FILES = (layout.CHECKPOINTS, *LOG_FILES, TENSORBOARD_DIR, "analysis", BRANCHES, STOP_FILE)
OVERWRITTEN_PREFIX = ".overwritten-"


class RunDirInUse(SharedUserError):
    """Another live run holds the run directory: this start must leave the folder as it found it (training/trainer.py
    build_trainer removes a folder a failed start created, which here is the other run's)."""


def run_contents(run_dir: pathlib.Path) -> list[str]:
    """What of a run `run_dir` holds, for the error: its checkpoints (complete or not) and its non-empty logs."""
    found = []
    root = layout.checkpoint_root(run_dir)
    steps = sorted(d.name for d in root.iterdir() if layout.step_of(d) >= 0) if root.is_dir() else []
    if steps:
        found.append(f"checkpoints {steps[0]}" + (f"..{steps[-1]}" if len(steps) > 1 else ""))
    found += [name for name in LOG_FILES if (run_dir / name).is_file() and (run_dir / name).stat().st_size > 0]
    if (run_dir / BRANCHES).is_dir() and any((run_dir / BRANCHES).iterdir()):  # a run's, even with nothing else left
        found.append(f"{BRANCHES}/")
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
    decision = [look(run_dir, resume, overwrite) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(decision, src=0)
    action, error = decision[0]
    if error is not None:
        raise (RunDirInUse if action == "busy" else SharedUserError)(error)
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


def look(run_dir: pathlib.Path, resume: str | None, overwrite: bool) -> tuple[str, str | None]:
    """Rank 0: take the folder's lock, then decide; ("busy", the refusal) when another run holds it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        busy = lock_run_dir(run_dir)
    except OSError as err:  # as a decision: the other ranks wait for it in the broadcast
        return "new", f"train.output_dir ({str(run_dir)!r}): its lock file could not be taken: {err}"
    return ("busy", busy) if busy else decide(run_dir, resume, overwrite)


def start_branch(run_dir: pathlib.Path, resumed: pathlib.Path, step: int) -> pathlib.Path | None:
    """Rank 0, resuming checkpoint `resumed` (of `step`): where it is an older checkpoint of this run, move its later
    checkpoints and the log rows and events after `step` into a new folder under RUN/branches (module docstring) and
    return that folder; None (nothing moved) where no complete checkpoint of the run is newer."""
    root = layout.checkpoint_root(run_dir)
    if resumed.resolve().parent != root.resolve():
        return None
    newer = sorted((d for d in root.iterdir() if layout.step_of(d) > step), key=layout.step_of)
    if not any(layout.is_complete(d) for d in newer):
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = run_dir / BRANCHES / f"after_{layout.checkpoint_tag(step)}-{stamp}"
    n = 1
    while aside.exists():  # two rollbacks within a second
        n += 1
        aside = aside.with_name(f"after_{layout.checkpoint_tag(step)}-{stamp}-{n}")
    (aside / layout.CHECKPOINTS).mkdir(parents=True)
    for ckpt in newer:
        ckpt.rename(aside / layout.CHECKPOINTS / ckpt.name)
    drop_rows_after(run_dir, step, aside=aside)
    log.warning("resuming %s starts a new branch: the later checkpoints (%s) and the logs of steps after %d are "
                "moved to %s", resumed.name, ", ".join(c.name for c in newer), step, aside)
    return aside


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
