"""A resumed run reads on from where its checkpoint's run stopped reading, and counts the tokens it has read.

The data position in a checkpoint is counted in samples (windows of data.seq_len tokens) of an order drawn from
train.seed (training/resume_batch.py keeps the global batch). A resume with another seq_len would cut the corpus
into other windows, so the saved position would point into text already read or not yet read; another seed would
draw another order. Both are refused with one line, naming the field, both values and the way out. Checkpoints
saved before seq_len was recorded (2026-12-04) are accepted with a warning, which says what cannot be checked.

The `tokens` metric counts what was read: the checkpoint's count plus seq_len per sample read since (the engine
counts samples), not the step times the current global batch, which a changed global batch would get wrong.
"""
from __future__ import annotations

import logging
import pathlib
from typing import TYPE_CHECKING, Any

from moep_ds.errors import SharedUserError

if TYPE_CHECKING:
    from moep_ds.training.trainer_state import TrainerState

log = logging.getLogger(__name__)


def check_same_data(found: tuple[pathlib.Path, TrainerState] | None, seq_len: int, seed: int,
                    warn: bool = True) -> None:
    """Refuse to resume checkpoint `found` = (path, its trainer state as read; None for a fresh run) with a
    data.seq_len or train.seed other than its own; `warn`: log the warning for an old checkpoint (rank 0)."""
    if found is None:
        return
    ckpt, state = found
    way_out = "start a new run (another train.output_dir) from its weights with model.init_from={ckpt!r}"
    saved = state.seq_len
    if saved is None and warn:
        log.warning("checkpoint %s does not record data.seq_len (saved before 2026-12-04): resuming with %d, the "
                    "data position is only right if it was trained with %d too", ckpt, seq_len, seq_len)
    elif saved is not None and saved != seq_len:
        raise SharedUserError(
            f"data.seq_len ({seq_len}) differs from the {saved} checkpoint {str(ckpt)!r} was trained with: its data "
            f"position, counted in windows of {saved} tokens, would replay or skip text; resume with "
            f"--set data.seq_len={saved}, or {way_out.format(ckpt=str(ckpt))}")
    if state.seed is not None and state.seed != seed:
        raise SharedUserError(
            f"train.seed ({seed}) differs from the {state.seed} checkpoint {str(ckpt)!r} was trained with: the "
            f"order of the samples drawn from it would replay some and skip others; resume with "
            f"--set train.seed={state.seed}, or {way_out.format(ckpt=str(ckpt))}")


def tokens_read(samples: int, seq_len: int, resumed: Any = None) -> int:
    """Tokens read up to sample `samples` (the engine's global_samples, counted over the whole run): those the
    resumed checkpoint recorded (`resumed`: the train module's state in it, trainer_state.py; None for a fresh run),
    plus seq_len per sample read since. A checkpoint without a count (before 2026-12-04) counts its samples at
    seq_len."""
    if resumed is None or resumed.get("tokens") is None:
        return samples * seq_len
    return resumed["tokens"] + (samples - resumed["global_samples"]) * seq_len
