"""Where a fresh run starts: step 0, or step N to continue a published checkpoint of step N (branching).

One rule: `train.start_step` when the recipe sets it; else N when `model.init_from` names a Hugging Face revision
`stepN` (`hf:EleutherAI/pythia-1b@step13000`: Pythia's checkpoint after 13,000 steps) or a run (or checkpoint)
directory that `moep-import` wrote from one (its meta.json records N); else 0. A run that starts
at N takes step N + 1 first, at the lr the schedule gives step N (Pythia's at iteration N), on the global batch N
(with `data.order: sequential`, Pythia's batch N: samples N·G … N·G + G − 1); the optimizer starts fresh. A
resumed run continues its checkpoint's step, schedule and data position instead.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moep_ds.checkpointing import layout
from moep_ds.checkpointing.model_dir import META_FILE
from moep_ds.errors import SharedUserError

if TYPE_CHECKING:
    from moep_ds.training.recipe import Recipe

log = logging.getLogger(__name__)

STEP_REVISION = re.compile(r"step(\d+)")


def revision_step(init_from: Any) -> int | None:
    """N of a source `hf:REPO@stepN` (Pythia's revisions step0 … step143000), else None (no revision, another
    revision name such as `main`, or a local folder)."""
    if not isinstance(init_from, str) or not init_from.startswith("hf:") or "@" not in init_from:
        return None
    match = STEP_REVISION.fullmatch(init_from.rsplit("@", 1)[1])
    return int(match.group(1)) if match else None


def imported_step(init_from: Any) -> tuple[int, str] | None:
    """(N, the source it came from) of a run or checkpoint directory `moep-import` wrote at step N > 0, else None
    (another folder; one model.init_from cannot read is named when the weights are read)."""
    if not isinstance(init_from, str) or init_from.startswith("hf:") or not Path(init_from).is_dir():
        return None
    folder = Path(init_from)
    ckpt = folder if (folder / META_FILE).is_file() else layout.newest_checkpoint(folder)
    try:
        meta = json.loads((ckpt / META_FILE).read_text()) if ckpt is not None else {}
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "imported_from" not in meta or not meta.get("step"):
        return None
    return int(meta["step"]), f"the step moep-import recorded in {str(ckpt / META_FILE)!r}, of {meta['imported_from']}"


def start_step(cfg: Recipe) -> tuple[int, str]:
    """(N, where N comes from) for a run of config `cfg` (the rule in the module text)."""
    init_from = getattr(cfg.model, "init_from", None)
    from_revision = revision_step(init_from)
    imported = imported_step(init_from) if from_revision is None else None
    if imported is not None:
        from_revision = imported[0]
    if cfg.train.start_step is not None:
        why = "train.start_step"
        if from_revision is not None and from_revision != cfg.train.start_step:
            why += f", not the {from_revision} of model.init_from ({init_from!r})"
        return cfg.train.start_step, why
    if imported is not None:
        return imported
    if from_revision is not None:
        return from_revision, f"the revision of model.init_from ({init_from!r})"
    return 0, "a run from scratch"


def resolve_start_step(cfg: Recipe, max_steps: int, resuming: bool = False) -> int:
    """start_step(cfg), checked against the run's length, logged when a fresh run does not start at 0 (a resumed one
    continues its checkpoint's step: its schedule still has this start)."""
    step, why = start_step(cfg)
    if step >= max_steps:
        raise SharedUserError(f"train.start_step ({step}, from {why}) must be below the run's last step "
                        f"(train.max_steps {max_steps})")
    exit_at = cfg.train.exit_at_step
    if step and exit_at is not None and exit_at <= step:
        raise SharedUserError(f"train.exit_at_step ({exit_at}) must be after the start step ({step}, from {why})")
    if step and not resuming:
        log.info("start step %d (%s): a fresh run's step counter, lr schedule and data position begin there "
                 "(first global batch read: %d), with a new optimizer state", step, why, step)
    return step
