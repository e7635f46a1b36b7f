"""What a checkpoint holds of one rank, in one process: its even share of a replicated tensor (the shares tiling
the tensor) and its RNG streams (continued at the same world size, re-seeded per rank at another)."""
import random

import numpy as np
import pytest
import torch

from moep_ds.training import checkpoint as ckpt_io
from moep_ds.distributed.owned_state import replica_share
from moep_ds.training.trainer_state import TrainerState


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_replica_shares_cover_every_element_once_in_rank_order(size):
    for numel in range(0, 30):
        shares = [replica_share(numel, rank, size) for rank in range(size)]
        assert [i for start, stop in shares for i in range(start, stop)] == list(range(numel)), (numel, shares)
        lengths = [stop - start for start, stop in shares]
        assert max(lengths) - min(lengths) <= 1, (numel, lengths)


def draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_rng_streams_continue_at_the_same_world_size_and_are_reseeded_per_rank_at_another(tmp_path, monkeypatch):
    nexts = []
    for rank in (0, 1):  # each rank's streams somewhere in the middle, different per rank
        torch.manual_seed(3 + rank), random.seed(3 + rank), np.random.seed(3 + rank)
        draws()
        torch.save(ckpt_io.rng_state(), tmp_path / f"rng_rank{rank}.pt")
        nexts.append(draws())  # what this rank of the uninterrupted run draws next
    expected = nexts[0]
    assert nexts[0] != nexts[1]
    state = TrainerState.from_state_dict({"world_size": 2, "step": 7, "seed": 5, "global_samples": 0,
                                          "data": {"epoch": 0, "global_batch": 7}})

    monkeypatch.setattr(ckpt_io.dist, "get_world_size", lambda group=None: 2)
    for rank in (1, 0):  # each rank continues its own streams, not rank 0's
        torch.manual_seed(99), random.seed(99), np.random.seed(99)
        ckpt_io.restore_rng(tmp_path, rank, state)
        assert draws() == nexts[rank], rank

    monkeypatch.setattr(ckpt_io.dist, "get_world_size", lambda group=None: 3)  # resumed at another world size
    reseeded = {}
    for rank in (0, 1, 0):
        ckpt_io.restore_rng(tmp_path, rank, state)
        got = draws()
        assert reseeded.setdefault(rank, got) == got  # a function of (seed, step, rank)
    assert reseeded[0] != reseeded[1] and expected not in reseeded.values()
