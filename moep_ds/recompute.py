"""Is this forward pass an activation-checkpoint recomputation? (read by model code, set by training/)

Activation checkpointing runs a block's forward a second time during backward to rebuild what it did not
keep. Anything a forward does besides computing tensors happens twice then: running statistics that a forward
updates (expert-choice thresholds, the lifecycle manager's token counts) would count the micro-batch twice.
The checkpoint wrapper (training/blocks.py) enters `recomputing()` around the recomputation (torch's
`checkpoint(..., context_fn=...)`), and model code skips such updates when `is_recomputing()`.

A context variable rather than a module attribute: it is set only inside the recomputation, in the thread that
runs it (the autograd engine's thread on accelerators), and it needs no import of training/ by model code.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("moep_ds_recomputing", default=False)


def is_recomputing() -> bool:
    """True inside an activation-checkpoint recomputation: skip running-statistics updates there."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the forward run inside as a recomputation (the checkpoint wrapper's recompute context)."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


__all__ = ["is_recomputing", "recomputing"]
