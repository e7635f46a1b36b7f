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
