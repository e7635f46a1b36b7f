"""One error, one line, under a launcher: a step that may fail on some ranks only (rank 0 prepares the data while the
others wait) ends with a collective on which every rank learns who failed. The first rank that failed raises its
error (cli.run_guarded prints it as one line); the others raise ReportedElsewhere and exit quietly, instead of
waiting in the next collective for a rank that is gone and printing that collective's traceback.

A rank that is gone without a word (killed, its node lost) fails the survivors' next collective: `lost_rank_error`
turns that collective's error into one line naming the lost rank (cli.run_guarded prints it on each survivor)."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
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


# What a collective raises once a peer process is gone: gloo's "Connection closed by peer [addr]:port" / "reset by
# peer" (its sockets closed: killed, crashed, its node lost) or a wait past the process group's timeout; NCCL's
# aborted communicator. Other RuntimeErrors are this rank's own and keep their traceback.
PEER_LOST_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                   "Socket Timeout", "NCCL communicator was aborted", "NCCL error")
# how long a surviving rank waits for the other survivors to answer after its collective failed
LOST_RANK_WAIT_S = 10.0


def lost_rank_error(err: BaseException, wait_s: float | None = None) -> UserError | None:
    """A collective failed because a rank is gone (`err` is what it raised): an error naming the lost rank(s), one
    line, or None when `err` is no such failure or every rank still answers (then `err` is this rank's own).

    Every surviving rank marks itself in the rendezvous store and waits up to `wait_s` (MOEP_LOST_RANK_WAIT_S,
    default 10) for the others' marks: the ranks without one are gone. A store that does not answer is gone with
    its host, rank 0 (deepspeed / srun: the store lives in rank 0's process)."""
    message = str(err)
    if not isinstance(err, RuntimeError) or not any(mark in message for mark in PEER_LOST_MARKS):
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    wait_s = float(os.environ.get("MOEP_LOST_RANK_WAIT_S", LOST_RANK_WAIT_S)) if wait_s is None else wait_s
    rank, world = dist.get_rank(), dist.get_world_size()
    cause = collective_cause(message)
    try:
        store = dist.distributed_c10d._get_default_store()
        if store_gone(store):
            raise ConnectionError("the rendezvous store does not accept connections")
        with quiet_stderr():  # a store whose process dies meanwhile: its client's C++ warning and stack frames
            store.set(f"moep/alive/{rank}", "1")
            deadline = time.monotonic() + wait_s
            while True:
                missing = [r for r in range(world) if not store.check([f"moep/alive/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    except Exception:  # the store's process is gone
        return UserError(f"lost rank 0 of {world}: a collective failed ({cause}) and the rendezvous store it held "
                         "no longer answers; resubmit to resume from the newest complete checkpoint")
    if not missing:
        return None
    names = ", ".join(map(str, missing))
    return UserError(f"lost rank{'s' if len(missing) > 1 else ''} {names} of {world}: a collective failed ({cause}) "
                     f"and rank{'s' if len(missing) > 1 else ''} {names} did not answer within {wait_s:g} s; "
                     "resubmit to resume from the newest complete checkpoint")


def store_gone(store) -> bool:
    """Whether the server of a TCP rendezvous store no longer accepts connections (its process is gone), probed with
    a socket of our own: the store's client, asked first, would print a C++ warning with some 20 stack frames."""
    inner = getattr(store, "_underlying_non_prefix_store", store)
    if not isinstance(inner, dist.TCPStore):
        return False
    try:
        with socket.create_connection((inner.host, inner.port), timeout=STORE_PROBE_S):
            return False
    except OSError:
        return True


STORE_PROBE_S = 5.0


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 points to /dev/null inside (what C++ code prints there too): for the last seconds of a
    process that is about to exit with its one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def collective_cause(message: str) -> str:
    """gloo's words without its source path ("[.../pair.cc:553] ") and its advice: "Connection closed by peer
    [10.0.0.2]:4321"."""
    first = message.strip().splitlines()[0] if message.strip() else message
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", first)
    return first.split(". ")[0].rstrip(".")
