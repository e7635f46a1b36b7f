"""A rank that vanishes mid-collective (kill -9, a lost node): each survivor exits with one line naming it
(distributed/rank_errors.py lost_rank_error, printed by run_guarded), not gloo's traceback."""
from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from moep_ds.distributed.rank_errors import collective_cause, lost_rank_error

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "lose_a_rank.py"
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
def test_the_survivor_names_the_killed_rank_in_one_line(tmp_path, victim):
    """Killing rank 0 takes the rendezvous store with it: the survivor's line says so, and nothing else is printed
    (issue 40 item 4: the store's client printed a C++ warning with ~20 stack frames first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", MOEP_LOST_RANK_WAIT_S="3",
               OMP_NUM_THREADS="1", VICTIM=str(victim))
    procs = [subprocess.Popen([sys.executable, str(SCRIPT)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    survivor = 1 - victim
    out, err = procs[survivor].communicate(timeout=180)
    procs[victim].communicate(timeout=60)
    assert procs[victim].returncode == -9
    assert procs[survivor].returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[W")]
    prefix = "" if survivor == 0 else r"\[rank 1\] "
    why = (r"rank 1 did not answer within 3 s" if victim == 1 else
           r"the rendezvous store it held no longer answers")
    assert len(lines) == 1 and re.fullmatch(
        prefix + rf"error: lost rank {victim} of 2: a collective failed \([^()]*\[127\.0\.0\.1\]:\d+[^()]*\) and "
        rf"{why}; resubmit to resume from the newest complete checkpoint", lines[0]), err
    assert re.search(r"Connection (closed|reset) by peer", lines[0])  # or gloo's "Read error [...]: ... reset by peer"
