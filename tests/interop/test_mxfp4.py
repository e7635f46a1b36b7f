"""MXFP4 dequantisation (interop/mxfp4.py) bit for bit as transformers' convert_moe_packed_tensors, on random blocks
and scales (every nibble, every exponent, the extreme ones giving 0 and inf included); any experts' rows alone.

# E experts, R rows, G blocks per row, B bytes per block
"""
from __future__ import annotations

import pytest
import torch

from moep_ds.interop.mxfp4 import dequantize

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

E, R, G, B = 4, 6, 3, 16


def random_packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, R, G, B), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (E, R, G), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 255, 127], dtype=torch.uint8)  # 2^-127, 2^128 (inf), 1
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers_bit_for_bit(dtype):
    blocks, scales = random_packed()
    ours = dequantize(blocks, scales, dtype)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (E, G * 2 * B, R) and ours.dtype == theirs.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(bits), theirs.view(bits))  # NaN-free here, but bits say it either way
    assert torch.isinf(ours[0, 2 * B:4 * B, 0]).any() and not torch.isinf(ours[0, :2 * B, 0]).any()


def test_experts_dequantize_alone():
    """Rows [1, 3) of the result from rows [1, 3) of blocks and scales alone (what an expert-parallel rank reads);
    the meta device gives the shape."""
    blocks, scales = random_packed(1)
    assert torch.equal(dequantize(blocks[1:3], scales[1:3]), dequantize(blocks, scales)[1:3])
    meta = dequantize(torch.empty(E, R, G, B, device="meta"), torch.empty(E, R, G, device="meta"))
    assert meta.shape == (E, G * 2 * B, R) and meta.is_meta
