"""PackedDataset: windows of T+1 tokens with stride T over a memory-mapped token file."""
import json
import pickle

import numpy as np
import pytest
import torch

from moep_ds.data.dataset import PackedDataset
from moep_ds.data.errors import DataError


def write_bin(path, tokens, dtype):
    np.asarray(tokens, dtype=dtype).tofile(path)
    (path.parent / "meta.json").write_text(json.dumps({"dtype": np.dtype(dtype).name}))
    return path


@pytest.mark.parametrize("dtype,num_tokens,seq_len", [("uint16", 101, 10), ("uint16", 100, 10), ("uint32", 57, 7)])
def test_windows_match_naive_slices(tmp_path, dtype, num_tokens, seq_len):
    tokens = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 60_000, num_tokens)
    ds = PackedDataset(write_bin(tmp_path / "train.bin", tokens, dtype), seq_len)  # dtype read from meta.json
    expected = []
    start = 0
    while start + seq_len + 1 <= num_tokens:  # naive: walk the file
        expected.append(tokens[start:start + seq_len + 1])
        start += seq_len
    assert len(ds) == len(expected)
    for i, window in enumerate(expected):
        assert ds[i].dtype == torch.int64 and ds[i].tolist() == window.tolist()
    idx = [len(ds) - 1, 0, 2]
    assert torch.equal(ds.get_batch(idx), torch.stack([ds[i] for i in idx]))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_pickles_without_the_token_array(tmp_path):
    ds = PackedDataset(write_bin(tmp_path / "t.bin", np.arange(5000), "uint16"), 16)
    _ = ds[3]
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 2000 and torch.equal(clone[7], ds[7])


def test_short_files_are_empty_and_missing_files_are_data_errors(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.arange(8), "uint16")
    assert len(PackedDataset(path, 8)) == 0 and len(PackedDataset(path, 7)) == 1
    assert len(PackedDataset(write_bin(tmp_path / "e.bin", [], "uint16"), 4)) == 0
    with pytest.raises(DataError, match="not found"):
        PackedDataset(tmp_path / "missing.bin", 4, dtype="uint16")
