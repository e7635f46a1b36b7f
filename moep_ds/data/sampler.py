"""Deterministic, resumable, data-parallel batching of window indices.

# W windows in the dataset, G global batch (windows per optimizer step over all ranks), B micro-batch,
# A gradient-accumulation steps, P data-parallel size (G = B * A * P)

Each epoch permutes the W windows with a generator seeded by (seed, epoch), or keeps them in file order
(`shuffle=False`, data.order: sequential: Pythia's order for its pre-shuffled files). Global batch g is
perm[g*G : (g+1)*G]; rank r takes the contiguous slice [r*G/P, (r+1)*G/P) of it and consumes it in A
micro-batches of B, in order. The windows of a step therefore depend only on (seed, G, step), not on
how G is factored into B, A and P: one process with A=2 sees what two processes with A=1 see together,
and a run resumed at another P (same G) continues with the same batches.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from moep_ds.data.dataset import PackedDataset
from moep_ds.data.errors import DataError


def epoch_permutation(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order of all items in `epoch`; a pure function of (num_items, seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_items)


def rank_epoch_indices(num_items: int, *, global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                       epoch: int, drop_last: bool = True, shuffle: bool = True, offset: int = 0) -> np.ndarray:
    """Rank `dp_rank`'s items of `epoch`, in consumption order.

    Full global batches, from item `offset` of the epoch's order on (a run resumed at another global batch size
    continues at the sample it reached), split into equal contiguous slices. Without drop_last the final partial global
    batch is split into `dp_size` contiguous, nearly equal slices (some possibly empty), so that over all
    ranks every item appears exactly once per epoch.
    """
    if global_batch_size % dp_size or not 0 <= dp_rank < dp_size:
        raise ValueError(f"global_batch_size {global_batch_size} must split over dp_size {dp_size} "
                         f"(dp_rank {dp_rank})")
    perm = epoch_permutation(num_items, seed, epoch) if shuffle else np.arange(num_items)
    perm, num_items = perm[offset:], num_items - offset
    num_full = num_items // global_batch_size
    per_rank = global_batch_size // dp_size
    full_GP = perm[:num_full * global_batch_size].reshape(num_full, dp_size, per_rank)
    mine = full_GP[:, dp_rank].reshape(-1)
    if drop_last or num_full * global_batch_size == num_items:
        return mine
    tail = np.array_split(perm[num_full * global_batch_size:], dp_size)[dp_rank]
    return np.concatenate([mine, tail])


class BatchLoader:
    """Endless micro-batches of (input_ids [B, T], labels [B, T]) for one data-parallel rank.

    `state_dict()` (taken at optimizer-step boundaries) is the position in global batches, so a resumed
    run, at the same or another dp_size with the same global batch size, sees the batches that the
    uninterrupted run would have seen. The incomplete last global batch of each epoch is dropped.

    A run resumed with another global batch size (--allow_batch_change) continues at the sample reached: position
    `sample` = offset + global_batch x G (`load_state_dict(..., global_batch_size=the saved G)`); the epoch's
    batches then start `offset` = sample mod G items in (only until the epoch ends), so nothing is replayed or
    skipped. `offset` is in the state only when it is not 0.
    """

    def __init__(self, dataset: PackedDataset, *, micro_batch_size: int, grad_accum: int, dp_rank: int,
                 dp_size: int, seed: int, shuffle: bool = True):
        if min(micro_batch_size, grad_accum, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size, grad_accum, dp_size >= 1 and 0 <= dp_rank < dp_size, got "
                             f"{micro_batch_size}, {grad_accum}, {dp_size}, dp_rank {dp_rank}")
        self.dataset = dataset
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.global_batch_size = micro_batch_size * grad_accum * dp_size
        self.batches_per_epoch = len(dataset) // self.global_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"{len(dataset)} windows of seq_len {getattr(dataset, 'seq_len', '?')} are fewer than "
                            f"one global batch ({micro_batch_size} x {grad_accum} accum x {dp_size} ranks = "
                            f"{self.global_batch_size})")
        self.epoch, self.global_batch, self.micro_step, self.offset = 0, 0, 0, 0
        self._indices_epoch, self._indices = None, np.empty(0, dtype=np.int64)

    def epoch_batches(self) -> int:
        """Full global batches of the current epoch (fewer than batches_per_epoch after an offset)."""
        return (len(self.dataset) - self.offset) // self.global_batch_size

    def _epoch_indices(self) -> np.ndarray:
        if self._indices_epoch != (self.epoch, self.offset):
            self._indices = rank_epoch_indices(len(self.dataset), global_batch_size=self.global_batch_size,
                                               dp_rank=self.dp_rank, dp_size=self.dp_size, seed=self.seed,
                                               epoch=self.epoch, shuffle=self.shuffle, offset=self.offset)
            self._indices_epoch = (self.epoch, self.offset)
        return self._indices

    def next_indices(self) -> np.ndarray:
        """Window indices [B] of the next micro-batch; advances the position."""
        start = (self.global_batch * self.grad_accum + self.micro_step) * self.micro_batch_size
        idx_B = self._epoch_indices()[start:start + self.micro_batch_size]
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.micro_step, self.global_batch = 0, self.global_batch + 1
            if self.global_batch == self.epoch_batches():
                self.epoch, self.global_batch, self.offset = self.epoch + 1, 0, 0
        return idx_B

    def next_micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T], labels [B, T]) with labels[:, t] = input_ids[:, t + 1] of the same window."""
        return split_inputs_labels(read_windows(self.dataset, self.next_indices()))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_micro_batch()

    def state_dict(self) -> dict[str, int]:
        if self.micro_step != 0:
            raise RuntimeError(f"BatchLoader.state_dict() inside a global batch (micro-step {self.micro_step} of "
                               f"{self.grad_accum}); take it at optimizer-step boundaries")
        state = {"epoch": self.epoch, "global_batch": self.global_batch}
        # the position counts in global batches of this size: a resume with another one reads on from its sample
        offset = {"offset": self.offset} if self.offset else {}
        return {**state, **offset, "global_batch_size": self.global_batch_size}

    def start_at(self, step: int) -> None:
        """Position at optimizer step `step` of a run that never ran steps 0..step-1 (train.start_step): its next
        global batch is the one the uninterrupted run would read at that step (epoch step // batches per epoch)."""
        epoch, global_batch = divmod(step, self.batches_per_epoch)
        self.load_state_dict({"epoch": epoch, "global_batch": global_batch})

    def sample(self) -> int:
        """The position in the current epoch, in samples (windows) of its order."""
        return self.offset + self.global_batch * self.global_batch_size

    def load_state_dict(self, state: dict[str, int], global_batch_size: int | None = None) -> None:
        """Continue at the position `state` holds, saved by a loader of `global_batch_size` (default: the one the
        state names, else this one's)."""
        saved = global_batch_size or state.get("global_batch_size") or self.global_batch_size
        epoch, global_batch, offset = int(state["epoch"]), int(state["global_batch"]), int(state.get("offset", 0))
        sample = offset + global_batch * saved
        if epoch < 0 or global_batch < 0 or not 0 <= offset < saved or sample > len(self.dataset):
            raise DataError(f"data state (epoch {epoch}, global_batch {global_batch}, offset {offset}) is outside "
                            f"this dataset's {self.batches_per_epoch} global batches per epoch")
        self.epoch, self.micro_step = epoch, 0
        self.offset, self.global_batch = sample % self.global_batch_size, sample // self.global_batch_size
        if self.global_batch >= self.epoch_batches():  # the end of an epoch is the start of the next
            self.epoch, self.global_batch, self.offset = epoch + 1, 0, 0


def read_windows(dataset, indices: np.ndarray) -> torch.Tensor:
    """Windows [B, T+1]; one gather for a PackedDataset, item by item for any other map-style dataset."""
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(indices)
    return torch.stack([dataset[int(i)] for i in indices])


def split_inputs_labels(windows_BT1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return windows_BT1[:, :-1].contiguous(), windows_BT1[:, 1:].contiguous()


def eval_batches(dataset, *, micro_batch_size: int, dp_rank: int, dp_size: int,
                 max_windows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Validation micro-batches in file order, no shuffle. The first `max_windows` windows (all by default),
    cut to a multiple of micro_batch_size * dp_size so every rank runs the same number of batches (no rank
    waits in a collective for another), are split into contiguous per-rank ranges."""
    per_step = micro_batch_size * dp_size
    usable = min(len(dataset), max_windows if max_windows is not None else len(dataset))
    usable -= usable % per_step
    if usable == 0:
        raise DataError(f"{len(dataset)} validation windows (max_windows {max_windows}) are fewer than one "
                        f"evaluation step ({micro_batch_size} x {dp_size} ranks = {per_step})")
    mine = np.arange(usable).reshape(dp_size, -1)[dp_rank]
    for start in range(0, mine.size, micro_batch_size):
        yield split_inputs_labels(read_windows(dataset, mine[start:start + micro_batch_size]))
