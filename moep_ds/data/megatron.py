"""Megatron-LM / GPT-NeoX indexed datasets (`PREFIX.bin` + `PREFIX.idx`, the MMIDIDX format), by memory map.

# S sequences, D document boundaries, B samples in a batch, T sequence length

`.idx` (little endian): magic b"MMIDIDX\\x00\\x00", uint64 version 1, uint8 dtype code, uint64 S, uint64 D, then
int32 sizes[S] (tokens of each sequence), int64 pointers[S] (byte offset of each sequence in `.bin`), int64
doc_idx[D] (sequence index where each document starts, plus S at the end). `.bin` is the token sequences back to
back. Dtype codes are Megatron-LM's `DType` (6 float64, 7 float32). GPT-NeoX (v1.0, Pythia's) writes the same
integer codes 1-5 and 8 (Pythia's files are uint16, code 8) but swaps the float ones (its 6 is float32, 7 float64):
a float file of GPT-NeoX's would be read here with the other width (token files never are float). DeepSpeed's
bundled reader maps 6/7/8 to uint16/uint32/uint64 and would misread them.

A sample is one stored sequence, its first T + 1 tokens: EleutherAI's pre-shuffled Pythia files store each
training sample as one 2049-token sequence, in the order Pythia consumed them (step s = sequences
s*1024 ... s*1024 + 1023), so reading sequence i as sample i keeps Pythia's batches.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from moep_ds.data.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                           7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")


class IndexedDataset:
    """The sequences of PREFIX.bin as the .idx describes them; both files memory-mapped, nothing read up front."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise DataError(f"{self.idx_path} is not a Megatron index: {len(head)} bytes, shorter than its header")
        magic, version, code, num_seqs, num_docs = _HEADER.unpack(head)
        if magic != MAGIC:
            raise DataError(f"{self.idx_path} is not a Megatron index: magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise DataError(f"{self.idx_path}: index version {version} is not supported (only {VERSION})")
        if code not in DTYPES:
            raise DataError(f"{self.idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        self.dtype, self.dtype_code = np.dtype(DTYPES[code]), code
        expected = _HEADER.size + num_seqs * (4 + 8) + num_docs * 8
        if self.idx_path.stat().st_size != expected:
            raise DataError(f"{self.idx_path} has {self.idx_path.stat().st_size} bytes, its header says {expected} "
                            f"({num_seqs} sequences, {num_docs} document entries)")
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        offset = _HEADER.size
        self.sizes_S = idx[offset:offset + 4 * num_seqs].view(np.int32)
        offset += 4 * num_seqs
        self.pointers_S = idx[offset:offset + 8 * num_seqs].view(np.int64)
        self.doc_idx_D = idx[offset + 8 * num_seqs:].view(np.int64)
        if not self.bin_path.is_file():
            raise DataError(f"{self.bin_path} not found beside {self.idx_path}")
        self.check_bin_size()
        self.num_tokens = self.bin_path.stat().st_size // self.dtype.itemsize
        self._tokens: np.memmap | None = None

    def check_bin_size(self) -> None:
        """The .bin must reach the end of the last sequence the .idx points to: a truncated or empty file, or a
        dtype code wider than the file's ids, would otherwise fail only when a read reaches past its end.
        Megatron writes the sequences back to back, so the last one ends the file (O(1), nothing read)."""
        if len(self.sizes_S) == 0:
            return
        need = int(self.pointers_S[-1]) + int(self.sizes_S[-1]) * self.dtype.itemsize
        size = self.bin_path.stat().st_size
        if size < need:
            raise DataError(f"{self.bin_path} has {size} bytes, its index {self.idx_path.name} needs {need} "
                            f"({len(self.sizes_S)} sequences of {self.dtype.name}, dtype code {self.dtype_code})")

    def __len__(self) -> int:
        return len(self.sizes_S)

    @property
    def tokens(self) -> np.ndarray:
        if self.num_tokens == 0:  # numpy cannot map an empty file (an empty dataset's .bin)
            return np.empty(0, dtype=self.dtype)
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, mode="r", dtype=self.dtype, shape=(self.num_tokens,))
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers_S[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sizes_S[i])]


def write_indexed(prefix: str | os.PathLike, sequences: list[np.ndarray] | np.ndarray, dtype=np.uint16) -> None:
    """Write sequences as PREFIX.bin + PREFIX.idx, one document per sequence (as Megatron's preprocessing
    writes a pre-packed corpus); for tests and for converting a corpus to this format. No sequences give what
    Megatron's builder writes then: an empty .bin and an index with no sizes or pointers and doc_idx [0]."""
    dtype = np.dtype(dtype)
    sizes = np.array([len(s) for s in sequences], dtype=np.int32)
    nbytes = sizes.astype(np.int64) * dtype.itemsize
    pointers = np.cumsum(nbytes) - nbytes  # each sequence starts where the one before ends
    doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for seq in sequences:
            np.asarray(seq).astype(dtype).tofile(f)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[dtype], len(sizes), len(doc_idx)))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_idx.tobytes())


def check_sequence_lengths(data: IndexedDataset, seq_len: int, field: str) -> None:
    """Every sequence must hold one sample of seq_len + 1 tokens. Checked on the .idx sizes alone (no token is
    read), so that a short sequence fails before a run starts, not at the step that first draws it."""
    need = seq_len + 1
    if len(data) and int(data.sizes_S.min()) < need:
        i = int(np.argmax(data.sizes_S < need))
        raise DataError(f"{field}: sequence {i} of {data.prefix} has {data.sizes_S[i]} tokens, fewer than "
                        f"data.seq_len + 1 = {need}")


def held_out(num_sequences: int, val_fraction: float) -> int:
    """How many trailing sequences a source without val_source holds out for validation."""
    return min(num_sequences, math.ceil(val_fraction * num_sequences))


class SequenceDataset(torch.utils.data.Dataset):
    """Sequences [start, stop) of an indexed dataset as samples of T + 1 tokens (sample i = sequence start + i).

    Every id is checked against `vocab_size` (the tokenizer's) as it is read, so a file tokenised with another
    tokenizer fails with its name instead of an index error inside the embedding.
    """

    def __init__(self, prefix: str | os.PathLike, seq_len: int, *, start: int = 0, stop: int | None = None,
                 vocab_size: int | None = None):
        self.data = IndexedDataset(prefix)
        self.seq_len, self.vocab_size = int(seq_len), vocab_size
        self.start, self.stop = start, len(self.data) if stop is None else stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sample i as LongTensor [T+1]."""
        return self.get_batch([i])[0]

    def get_batch(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """Samples `indices` as LongTensor [B, T+1], read with one gather."""
        idx_B = np.asarray(indices, dtype=np.int64)
        if idx_B.size and (idx_B.min() < 0 or idx_B.max() >= len(self)):
            raise IndexError(f"sample indices {idx_B.min()}..{idx_B.max()} out of range for {len(self)} samples")
        seq_B = idx_B + self.start
        short = self.data.sizes_S[seq_B] <= self.seq_len
        if short.any():
            i = int(seq_B[np.argmax(short)])
            raise DataError(f"sequence {i} of {self.data.prefix} has {self.data.sizes_S[i]} tokens, fewer than "
                            f"data.seq_len + 1 = {self.seq_len + 1}")
        offsets_BT = (self.data.pointers_S[seq_B] // self.data.dtype.itemsize)[:, None] + np.arange(self.seq_len + 1)
        tokens_BT = self.data.tokens[offsets_BT].astype(np.int64)
        if self.vocab_size is not None and tokens_BT.size and not (
                0 <= tokens_BT.min() and tokens_BT.max() < self.vocab_size):
            raise DataError(f"{self.data.bin_path} holds token ids {tokens_BT.min()}..{tokens_BT.max()} outside the "
                            f"tokenizer's vocabulary (0..{self.vocab_size - 1}); data.tokenizer.path must be the "
                            f"tokenizer it was made with")
        return torch.from_numpy(tokens_BT)
