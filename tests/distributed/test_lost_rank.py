"""A rank that vanishes mid-collective (kill -9, a lost node): each survivor exits with one line naming it
(distributed/rank_errors.py lost_rank_error, printed by run_guarded), not gloo's traceback."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from moep_ds.distributed.rank_errors import collective_cause, lost_rank_error

from ranks import run_ranks
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.77.0.2]:32478. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
        "before reporting an error.")


def test_the_cause_is_gloos_words_without_its_source_path_and_advice():
    assert collective_cause(GLOO) == "Connection closed by peer [10.77.0.2]:32478"


def test_other_errors_are_not_a_lost_rank():
    assert lost_rank_error(RuntimeError("shape mismatch")) is None
    assert lost_rank_error(ValueError(GLOO)) is None
    assert lost_rank_error(RuntimeError(GLOO)) is None  # no process group: nobody to lose


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_the_survivor_names_the_killed_rank_in_one_line(victim):
    """Two ranks of this test (tests/ranks.py) without a launcher's stop of the survivor: a few all_reduces, then rank
    `victim` kills itself with SIGKILL while the other goes on all-reducing, through run_guarded as pretrain.py is.
    Killing rank 0 takes the rendezvous store with it: the survivor's line says so, and nothing else is printed (the
    store's client printed a C++ warning with ~20 stack frames first)."""
    ranks = run_ranks(2, lose_rank, victim, env={"MOEP_LOST_RANK_WAIT_S": "3"}, grace=None, check=False, timeout=180)
    survivor = 1 - victim
    assert ranks[victim].exitcode == -9
    assert ranks[survivor].exitcode == 1, ranks[survivor].stderr
    err = ranks[survivor].stderr
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[W")]
    prefix = "" if survivor == 0 else r"\[rank 1\] "
    why = (r"rank 1 did not answer within 3 s" if victim == 1 else
           r"the rendezvous store it held no longer answers")
    assert len(lines) == 1 and re.fullmatch(
        prefix + rf"error: lost rank {victim} of 2: a collective failed \([^()]*\[127\.0\.0\.1\]:\d+[^()]*\) and "
        rf"{why}; resubmit to resume from the newest complete checkpoint", lines[0]), err
    assert re.search(r"Connection (closed|reset) by peer", lines[0])  # or gloo's "Read error [...]: ... reset by peer"


def lose_rank(victim: int) -> None:
    from moep_ds.distributed.commands import run_guarded

    def body():
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        x = torch.ones(4096)
        for _ in range(3):
            dist.all_reduce(x)
        if dist.get_rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(600):
            dist.all_reduce(x)
            time.sleep(0.05)
        return 0

    raise SystemExit(run_guarded(body))
