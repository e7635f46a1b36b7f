"""Building a model without initialising it: its weights come from a later `CausalLM.init_weights` or from a
checkpoint.

    with deferred_init():        # what CausalLM(cfg, initialise=False) does around its blocks
        block = BLOCKS.build(...)

Modules that initialise their parameters when they are built skip it inside. For stacked experts that is a draw
over all the experts per parameter (moe/shard.py `normal_`, so that every expert-parallel rank gets its rows of
the same draw): a tensor of every expert's size each time, and time, for values that are replaced anyway.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("deferred_init", default=False)


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def init_at_construction() -> bool:
    """Whether a module built now initialises its own parameters (False inside `deferred_init`)."""
    return not _DEFERRED.get()


__all__ = ["deferred_init", "init_at_construction"]
