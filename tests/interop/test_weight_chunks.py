"""A weight stored as we hold it (an embedding, a head) is copied into a process's pieces a chunk of rows at a
time, each row read once and only its bytes read from the file: the import never holds such a tensor whole beside
the model. Values exact for whole tensors and for ZeRO-style ranges that start and end inside a row."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from moep_ds.checkpointing.sharded import FlatShard
from moep_ds.interop import weights as weights_module
from moep_ds.interop.rules import same, transposed
from moep_ds.interop.hf_weights import TensorFiles, weight_of
from moep_ds.interop.weights import fill_pieces

ROWS, COLS, CHUNK_ROWS = 50, 6, 7


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A bf16 [50, 6] tensor in a safetensors file, the chunk set to 7 rows of fp32, and the rows each read asked
    for."""
    torch.manual_seed(0)
    table = torch.randn(ROWS, COLS).bfloat16()
    save_file({"emb": table, "proj": table[:COLS].clone()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(weights_module, "CHUNK_BYTES", 4 * COLS * CHUNK_ROWS)
    reads: list[tuple[int, int]] = []
    whole: list[str] = []
    read_rows, read = TensorFiles.read_rows, TensorFiles.read
    monkeypatch.setattr(TensorFiles, "read_rows", lambda self, k, a, b: reads.append((a, b)) or read_rows(self, k, a, b))
    monkeypatch.setattr(TensorFiles, "read", lambda self, k: whole.append(k) or read(self, k))
    return TensorFiles(tmp_path), table.float(), reads, whole


@pytest.mark.parametrize("first,count", [(0, ROWS * COLS), (13, 200), (41, 1), (0, 43), (294, 6)])
def test_rows_are_read_a_chunk_at_a_time_each_once(stored, first, count):
    files, table, reads, whole = stored
    weight = weight_of(same("embed.weight", "emb"), files, {"emb": "emb"})
    local = torch.full((count,), float("nan"))
    fill_pieces({"embed.weight": FlatShard(local, first, ROWS * COLS, (ROWS, COLS))}, {"embed.weight": weight})
    assert torch.equal(local, table.reshape(-1)[first:first + count])
    assert whole == [] and reads
    assert all(b - a <= CHUNK_ROWS and a // CHUNK_ROWS == (b - 1) // CHUNK_ROWS for a, b in reads)  # within a chunk
    rows = [r for a, b in reads for r in range(a, b)]
    assert rows == list(range(first // COLS, -(-(first + count) // COLS)))  # each row once, in order


def test_a_weight_computed_from_its_tensor_is_read_whole_once(stored):
    files, table, reads, whole = stored
    weight = weight_of(transposed("w.weight", "proj"), files, {"proj": "proj"})
    local = torch.empty(COLS * COLS)
    fill_pieces({"w.weight": FlatShard(local, 0, COLS * COLS, (COLS, COLS))}, {"w.weight": weight})
    assert torch.equal(local, table[:COLS].t().reshape(-1))
    assert (whole, reads) == (["proj"], [])


def test_a_rule_that_joins_writes_one_tensor_from_several_of_ours():
    """gpt-oss's gate_up_proj from our gate and up: written once, by the rule that joins the up; the up's rule
    writes nothing."""
    from moep_ds.checkpointing.streaming import TensorEntry
    from moep_ds.interop.hf_weights import native_entries
    from moep_ds.interop.rules import Rule

    gate, up = torch.randn(2, 3), torch.randn(2, 3)
    entries = {name: TensorEntry(name, torch.float32, (2, 3), lambda t=t: t) for name, t in (("g", gate), ("u", up))}
    rules = [Rule("g", ("gu",), lambda ts: ts[0][:, 0::2], lambda g, u: [torch.stack([g, u], -1).flatten(-2)],
                  joins=("u",)),
             Rule("u", ("gu",), lambda ts: ts[0][:, 1::2], lambda u: [])]
    [written] = native_entries(entries, rules)
    assert (written.name, written.shape) == ("gu", (2, 6))
    fused = written.read()
    assert torch.equal(fused[:, 0::2], gate) and torch.equal(fused[:, 1::2], up)
