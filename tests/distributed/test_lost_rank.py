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
def test_the_survivor_names_the_killed_rank_in_one_line():
    """Two ranks of this test (tests/ranks.py) without a launcher's stop of the survivor: a few all_reduces, then
    rank 1 kills itself with SIGKILL while rank 0 goes on all-reducing, through run_guarded as pretrain.py is."""
    ranks = run_ranks(2, lose_rank_1, env={"MOEP_LOST_RANK_WAIT_S": "3"}, grace=None, check=False, timeout=180)
    assert ranks[1].exitcode == -9
    assert ranks[0].exitcode == 1, ranks[0].stderr
    err0 = ranks[0].stderr
    lines = [line for line in err0.splitlines() if line.strip() and not line.startswith("[W")]
    assert len(lines) == 1 and re.fullmatch(
        r"error: lost rank 1 of 2: a collective failed \([^()]*\[127\.0\.0\.1\]:\d+[^()]*\) and "
        r"rank 1 did not answer within 3 s; resubmit to resume from the newest complete checkpoint", lines[0]), err0
    assert re.search(r"Connection (closed|reset) by peer", lines[0])  # or gloo's "Read error [...]: ... reset by peer"


def lose_rank_1() -> None:
    from moep_ds.distributed.commands import run_guarded

    def body():
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        x = torch.ones(4096)
        for _ in range(3):
            dist.all_reduce(x)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(600):
            dist.all_reduce(x)
            time.sleep(0.05)
        return 0

    raise SystemExit(run_guarded(body))
