"""Sharded, resumable batching: exactly-once coverage per epoch, equivalence of (accumulation x ranks)
factorisations, and exact continuation from a saved state."""
import numpy as np
import pytest
import torch

from moep_ds.data.dataset import PackedDataset
from moep_ds.data.errors import DataError
from moep_ds.data.sampler import BatchLoader, epoch_permutation, eval_batches, rank_epoch_indices

SEQ_LEN = 4


@pytest.fixture
def dataset(tmp_path):
    """Token t at position t, so window i starts with token i * SEQ_LEN."""
    path = tmp_path / "train.bin"
    np.arange(61 * SEQ_LEN + 1, dtype=np.uint16).tofile(path)
    return PackedDataset(path, SEQ_LEN, dtype="uint16")  # 61 windows


def window_ids(input_ids):
    return (input_ids[:, 0] // SEQ_LEN).tolist()


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("num_items", [61, 60])
def test_every_index_once_per_epoch_across_ranks(dp_size, num_items):
    global_batch = 4 * dp_size
    for epoch in range(2):
        parts = [rank_epoch_indices(num_items, global_batch_size=global_batch, dp_rank=r, dp_size=dp_size, seed=7,
                                    epoch=epoch, drop_last=False) for r in range(dp_size)]
        seen = np.concatenate(parts)
        assert sorted(seen.tolist()) == list(range(num_items))
    assert not np.array_equal(epoch_permutation(num_items, 7, 0), epoch_permutation(num_items, 7, 1))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_drop_last_covers_full_global_batches_without_overlap(dp_size):
    parts = [rank_epoch_indices(61, global_batch_size=6 * dp_size, dp_rank=r, dp_size=dp_size, seed=1, epoch=0)
             for r in range(dp_size)]
    seen = np.concatenate(parts)
    assert len(set(seen.tolist())) == len(seen) == (61 // (6 * dp_size)) * 6 * dp_size
    assert len({len(p) for p in parts}) == 1


def run(dataset, steps, *, micro, accum, dp_size, state=None):
    """Global batches (list of window ids per optimizer step) seen by all ranks together."""
    loaders = [BatchLoader(dataset, micro_batch_size=micro, grad_accum=accum, dp_rank=r, dp_size=dp_size, seed=3)
               for r in range(dp_size)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    steps_seen = []
    for _ in range(steps):
        step = []
        for loader in loaders:  # rank order = slice order
            for _ in range(accum):
                x, y = loader.next_micro_batch()
                assert x.shape == y.shape == (micro, SEQ_LEN) and x.dtype == torch.int64
                assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, -1] + 1)
                step += window_ids(x)
        steps_seen.append(step)
    return steps_seen, loaders[0].state_dict()


def test_accumulation_and_ranks_are_interchangeable(dataset):
    one_proc, _ = run(dataset, 20, micro=2, accum=2, dp_size=1)
    two_proc, _ = run(dataset, 20, micro=2, accum=1, dp_size=2)
    four_proc, _ = run(dataset, 20, micro=1, accum=1, dp_size=4)
    assert one_proc == two_proc == four_proc
    per_epoch = 61 // 4
    epoch0 = sum(one_proc[:per_epoch], [])
    assert len(set(epoch0)) == len(epoch0) == per_epoch * 4  # last partial global batch dropped
    assert sorted(one_proc[per_epoch]) != sorted(one_proc[0])  # epoch 1 reshuffled


@pytest.mark.parametrize("stop", [5, 15, 16, 22])  # mid-epoch, last step of epoch 0, first of epoch 1, later
def test_resume_replays_the_uninterrupted_sequence(dataset, stop):
    full, _ = run(dataset, 30, micro=2, accum=2, dp_size=1)
    head, state = run(dataset, stop, micro=2, accum=2, dp_size=1)
    assert head == full[:stop]
    assert state == {"epoch": stop // 15, "global_batch": stop % 15, "global_batch_size": 4}
    tail, _ = run(dataset, 30 - stop, micro=2, accum=2, dp_size=1, state=state)
    assert tail == full[stop:]
    tail_dp2, _ = run(dataset, 30 - stop, micro=1, accum=2, dp_size=2, state=state)  # resumed on 2 ranks
    assert tail_dp2 == full[stop:]


def test_state_errors(dataset):
    loader = BatchLoader(dataset, micro_batch_size=2, grad_accum=2, dp_rank=0, dp_size=1, seed=0)
    loader.next_micro_batch()
    with pytest.raises(RuntimeError, match="micro-step 1 of 2"):
        loader.state_dict()
    with pytest.raises(DataError, match="global_batch 99"):
        loader.load_state_dict({"epoch": 0, "global_batch": 99})
    with pytest.raises(DataError, match=r"61 windows .* fewer than one global batch \(8 x 4 accum x 2 ranks = 64\)"):
        BatchLoader(dataset, micro_batch_size=8, grad_accum=4, dp_rank=1, dp_size=2, seed=0)


def test_a_state_at_the_end_of_an_epoch_resumes_at_the_start_of_the_next(dataset):
    """{"epoch": e, "global_batch": batches_per_epoch} (the position after an epoch's last step, as a checkpoint of
    another writer may hold it) continues with epoch e + 1's first batches, as the uninterrupted run does."""
    full, _ = run(dataset, 18, micro=2, accum=2, dp_size=1)  # 15 global batches per epoch
    tail, state = run(dataset, 3, micro=2, accum=2, dp_size=1, state={"epoch": 0, "global_batch": 15})
    assert tail == full[15:18]
    assert state == {"epoch": 1, "global_batch": 3, "global_batch_size": 4}


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_eval_batches_cover_equal_contiguous_shards(dataset, dp_size):
    per_rank = [[window_ids(x) for x, _ in eval_batches(dataset, micro_batch_size=4, dp_rank=r, dp_size=dp_size)]
                for r in range(dp_size)]
    assert len({len(batches) for batches in per_rank}) == 1  # same number of steps on every rank
    seen = [i for batches in per_rank for batch in batches for i in batch]
    usable = 61 - 61 % (4 * dp_size)
    assert seen == list(range(usable))
    limited = list(eval_batches(dataset, micro_batch_size=4, dp_rank=0, dp_size=1, max_windows=10))
    assert [window_ids(x) for x, _ in limited] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(DataError, match="fewer than one evaluation step"):
        next(eval_batches(dataset, micro_batch_size=64, dp_rank=0, dp_size=1))


def test_loader_rejects_a_dataset_shorter_than_one_window(tmp_path):
    path = tmp_path / "short.bin"
    np.arange(SEQ_LEN, dtype=np.uint16).tofile(path)
    with pytest.raises(DataError, match=r"0 windows of seq_len 4 are fewer than one global batch"):
        BatchLoader(PackedDataset(path, SEQ_LEN, dtype="uint16"), micro_batch_size=1, grad_accum=1, dp_rank=0,
                    dp_size=1, seed=0)


def test_another_global_batch_continues_at_the_sample_reached(dataset):
    """--allow_batch_change: 5 steps of 4 windows, then steps of 6 (on 2 ranks) and, after another save, of 4
    again: together they consume the epoch's order without a window repeated or skipped, up to the last full
    batch of the epoch, and the next epoch starts as usual."""
    first, state = run(dataset, 5, micro=2, accum=2, dp_size=1)
    bigger = [BatchLoader(dataset, micro_batch_size=3, grad_accum=1, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for loader in bigger:
        loader.load_state_dict(state)  # saved by a loader of global batch 4: the state says so
    assert bigger[0].sample() == 20 and bigger[0].state_dict() == {"epoch": 0, "global_batch": 3, "offset": 2,
                                                                   "global_batch_size": 6}
    second = [window_ids(bigger[0].next_micro_batch()[0]) + window_ids(bigger[1].next_micro_batch()[0])
              for _ in range(3)]
    state = bigger[0].state_dict()
    assert bigger[0].sample() == 38 and state == {"epoch": 0, "global_batch": 6, "offset": 2, "global_batch_size": 6}
    back = BatchLoader(dataset, micro_batch_size=2, grad_accum=2, dp_rank=0, dp_size=1, seed=3)
    back.load_state_dict(state)
    assert back.state_dict() == {"epoch": 0, "global_batch": 9, "offset": 2, "global_batch_size": 4}
    rest = []
    while back.epoch == 0:
        rest += window_ids(back.next_micro_batch()[0]) + window_ids(back.next_micro_batch()[0])
    order = epoch_permutation(61, 3, 0).tolist()
    consumed = [w for step in first + second for w in step] + rest
    assert consumed == order[:len(consumed)] and len(consumed) == 38 + (61 - 38) // 4 * 4
    assert back.state_dict() == {"epoch": 1, "global_batch": 0, "global_batch_size": 4}  # no offset in the next epoch
    full, _ = run(dataset, 1, micro=2, accum=2, dp_size=1, state={"epoch": 1, "global_batch": 0})
    assert window_ids(back.next_micro_batch()[0]) + window_ids(back.next_micro_batch()[0]) == full[0]
