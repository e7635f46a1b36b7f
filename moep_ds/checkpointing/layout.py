"""Run directories and their checkpoints: what "complete" and "newest" mean (directories appear atomically through
moep_ds/fsutil.py).

    RUN_DIR/checkpoints/step_00000100/    a checkpoint; it counts once it holds the empty file COMPLETE
    RUN_DIR/checkpoints/.tmp-step_.../    one being written (never read; removed by the next save)
    RUN_DIR/checkpoints/.step_00000100.old-<12 hex digits>/
                                          a replaced one, set aside until the new one is in (replace_dir; left
                                          by a process killed in between: the next save removes it, or renames
                                          it back where it is the only copy)

Every directory and file written here gets the permissions the user's umask gives (tempfile.mkdtemp and some
writers create private files; a checkpoint should read like any other file of the run).
"""
from __future__ import annotations

import os
from pathlib import Path

# the file-system helpers live in moep_ds/fsutil.py; these names stay importable from here for the checkpoint code
from moep_ds.fsutil import (  # noqa: F401
    ASIDE_HEX, apply_umask, atomic_dir, check_dir_target, check_writable, first_missing, is_empty_dir, output_dir,
    remove_empty_dirs, remove_left_aside, remove_new_dir, replace_dir, umask,
)


COMPLETE = "COMPLETE"
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_tag(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint directory is named after (`step_<N>`), -1 for any other name."""
    digits = checkpoint.name.removeprefix(STEP_PREFIX)
    return int(digits) if checkpoint.name.startswith(STEP_PREFIX) and digits.isdigit() else -1


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE).is_file()


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run (`run_dir`, or its `checkpoints/` folder itself), oldest first."""
    run_dir = Path(run_dir)
    root = checkpoint_root(run_dir) if checkpoint_root(run_dir).is_dir() else run_dir
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if step_of(d) >= 0 and is_complete(d)]
    return sorted(found, key=lambda d: (step_of(d), d.name))


def newest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def run_overlap(out: Path, source: Path, done: str = "exported") -> str | None:
    """Why the resolved path `out` would write into the checkpoint `source` (being `done`: exported, converted)
    or a run directory, which the trainer owns (training/run_dir.py); None if not."""
    if out == source:
        return f"is the checkpoint being {done}"
    if source in out.parents:
        return f"is inside the checkpoint being {done} ({source})"
    if out in source.parents:
        return f"contains the checkpoint being {done} ({source})"
    for p in (out, *out.parents):
        if is_complete(p):
            return "is a checkpoint" if p == out else f"is inside checkpoint {p}"
        if is_run_dir(p) and p == out:
            return "is a run directory"
        if is_run_dir(p) and out.is_relative_to(checkpoint_root(p)):
            return f"is inside the checkpoints of run directory {p}"
        if is_run_dir(p):  # the run's own folder: its files are the trainer's (run_dir.py), not an export's
            return f"is inside run directory {p}"
    return None


def is_run_dir(path: Path) -> bool:
    """A folder whose checkpoints/ holds step_<N> checkpoints (complete or not), not just any checkpoints/."""
    root = checkpoint_root(path)
    return root.is_dir() and any(step_of(d) >= 0 for d in root.iterdir())
