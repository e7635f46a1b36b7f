"""tests/ranks.py, the in-process multi-rank helper: ranks join one gloo group with a launcher's environment, their
results and output come back, a rank that fails ends the others instead of leaving them in a collective, and a run
that outlasts its timeout fails."""
import os
import time

import pytest

from ranks import RanksFailed, run_ranks

pytestmark = pytest.mark.slow  # the first run starts the fork server (seconds)


def all_reduce_rank():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}")
    return x.item(), os.environ["LOCAL_RANK"], os.environ["MOEP_PROBE"]


def fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 gives up")
    time.sleep(600)  # busy elsewhere, as a rank in another collective is
    return "unreachable"


def exit_with(code):
    raise SystemExit(code)


def test_ranks_join_one_group_and_return_results_and_output():
    ranks = run_ranks(2, all_reduce_rank, env={"MOEP_PROBE": "x"})
    assert [r.result for r in ranks] == [(3.0, "0", "x"), (3.0, "1", "x")]
    assert [r.stdout for r in ranks] == ["rank 0 of 2\n", "rank 1 of 2\n"]
    assert [r.exitcode for r in ranks] == [0, 0]


def test_a_failing_rank_ends_the_others_and_its_traceback_comes_back():
    started = time.monotonic()
    with pytest.raises(RanksFailed, match="ValueError: rank 1 gives up"):
        run_ranks(2, fail_on_rank_1, grace=0.5)
    ranks = run_ranks(2, fail_on_rank_1, grace=0.5, check=False)
    assert time.monotonic() - started < 60
    assert ranks[1].exitcode == 1 and "ValueError: rank 1 gives up" in ranks[1].error
    assert ranks[0].exitcode == -15 and ranks[0].result is None  # SIGTERM, as torchrun stops the others
    assert [r.exitcode for r in run_ranks(1, exit_with, 3, check=False)] == [3]
    with pytest.raises(RanksFailed, match="fail_on_rank_1 on 1 ranks timed out after 1 s"):
        run_ranks(1, fail_on_rank_1, timeout=1, check=False)  # rank 0 sleeps: a timeout fails, checked or not
