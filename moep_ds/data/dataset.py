"""Packed token files as a dataset of fixed windows.

# N tokens in the file, T sequence length, B windows in a batch

A `.bin` file is the concatenation of all tokenized documents (each followed by end-of-text), stored as
uint16 or uint32 (the dtype is recorded in meta.json beside it). Window i is tokens [i*T, i*T + T + 1):
windows step by T and share one boundary token, so inputs cover the file without overlap and every input
token has its next token as label.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from moep_ds.data.errors import DataError


class PackedDataset(torch.utils.data.Dataset):
    """Memory-mapped windows of T+1 tokens; `dtype` defaults to the one in the meta.json beside the file."""

    def __init__(self, bin_path: str | os.PathLike, seq_len: int, dtype: str | np.dtype | None = None):
        self.bin_path = Path(bin_path)
        self.seq_len = int(seq_len)
        if dtype is None:
            dtype = self._dtype_from_meta()
        self.dtype = np.dtype(dtype)
        if not self.bin_path.is_file():
            raise DataError(f"token file not found: {self.bin_path}")
        # a file shorter than one window (e.g. val.bin with val_fraction 0) is an empty dataset; prepare()
        # and BatchLoader reject data too short for training with the numbers
        self.num_tokens = self.bin_path.stat().st_size // self.dtype.itemsize
        self._tokens: np.memmap | None = None  # opened lazily, so the dataset pickles into workers cheaply

    def _dtype_from_meta(self) -> str:
        meta = self.bin_path.parent / "meta.json"
        if not meta.is_file():
            raise DataError(f"no meta.json beside {self.bin_path}; pass dtype= explicitly")
        return json.loads(meta.read_text())["dtype"]

    @property
    def tokens(self) -> np.ndarray:
        if self.num_tokens == 0:  # numpy cannot map an empty file
            return np.empty(0, dtype=self.dtype)
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Window i as LongTensor [T+1]."""
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))

    def get_batch(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """Windows `indices` as LongTensor [B, T+1], read with one gather."""
        idx_B = np.asarray(indices, dtype=np.int64)
        if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
            raise IndexError(f"window indices {idx_B.min()}..{idx_B.max()} out of range for {len(self)} windows")
        offsets_BT = idx_B[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return torch.from_numpy(self.tokens[offsets_BT].astype(np.int64))


def open_split(prepared_dir: str | os.PathLike, split: str, seq_len: int) -> torch.utils.data.Dataset:
    """The `split` ("train" or "val") of a prepared folder: packed windows of train.bin / val.bin, or, for a
    megatron: source, the stored sequences of the range its meta.json fixes."""
    from moep_ds.data.megatron import SequenceDataset

    meta = json.loads((Path(prepared_dir) / "meta.json").read_text())
    if "megatron" in meta:
        part = meta["megatron"][split]
        return SequenceDataset(part["prefix"], seq_len, start=part["start"], stop=part["stop"],
                               vocab_size=meta["vocab_size"])
    return PackedDataset(Path(prepared_dir) / f"{split}.bin", seq_len)
