"""One error, one line, under a launcher: a step that may fail on some ranks only (rank 0 prepares the data while the
others wait) ends with a collective on which every rank learns who failed. The first rank that failed raises its
error (cli.run_guarded prints it as one line); the others raise ReportedElsewhere and exit quietly, instead of
waiting in the next collective for a rank that is gone and printing that collective's traceback."""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist

from moep_ds.errors import ReportedElsewhere, SharedUserError, UserError


def agreed(fn: Callable[..., Any], *args: Any, run: bool = True, group=None) -> Any:
    """`fn(*args)` where `run` (else None), then `raise_agreed` on `group` (every rank calls this)."""
    error, result = None, None
    if run:
        try:
            result = fn(*args)
        except UserError as err:
            error = err
    raise_agreed(error, group)
    return result


def raise_agreed(error: UserError | None, group=None) -> None:
    """A collective on `group` (every rank calls it, once every rank is there): raises on every rank when any rank
    had an `error`: that error on the first such rank, ReportedElsewhere on the others. Off-distributed: `error`."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    failed = [False] * dist.get_world_size(group)
    dist.all_gather_object(failed, error is not None, group=group)
    if not any(failed):
        return
    first = failed.index(True)
    if dist.get_rank(group) == first:
        # a SharedUserError is printed by rank 0 only: from another rank it must be printed by that rank
        raise error if first == 0 or not isinstance(error, SharedUserError) else UserError(str(error))
    raise ReportedElsewhere(f"rank {first} failed")
