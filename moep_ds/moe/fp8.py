"""FP8 rows for the expert all-to-all (`train.expert_comm.fp8_dispatch`, DESIGN.md §4), as DeepSeek-V3 dispatches:
float8 e4m3 values with one fp32 scale per 128 values of a row (scale = the block's largest magnitude / 448, e4m3's
largest finite value; an all-zero block keeps scale 1), packed with their scales into one uint8 row so that one
all-to-all moves both.

# P rows of D values (D a multiple of BLOCK), D / BLOCK blocks a row

    packed = pack(x_PD)                 # [P, D + 4 D / 128] uint8: D e4m3 bytes, then D / 128 fp32 scales
    x_PD ~= unpack(packed, D, dtype)    # within e4m3's rounding (3 mantissa bits) of each value
"""
from __future__ import annotations

import torch

BLOCK = 128  # values per scale
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def packed_width(width: int) -> int:
    """Bytes of a packed row of `width` values: one per value, four per block's scale."""
    return width + 4 * (width // BLOCK)


def pack(x_PD: torch.Tensor) -> torch.Tensor:
    """[P, D] (any float dtype) -> [P, packed_width(D)] uint8 (module docstring)."""
    P, D = x_PD.shape
    blocks = x_PD.detach().float().view(P, D // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8).view(P, D), scale.view(P, D // BLOCK).view(torch.uint8)], dim=1)


def unpack(packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The [P, width] values of packed rows, in `dtype` (dequantised in fp32)."""
    P = packed.shape[0]
    q = packed[:, :width].contiguous().view(torch.float8_e4m3fn).float().view(P, width // BLOCK, BLOCK)
    scale = packed[:, width:].contiguous().view(torch.float32).view(P, width // BLOCK, 1)
    return (q * scale).view(P, width).to(dtype)


__all__ = ["BLOCK", "E4M3_MAX", "pack", "packed_width", "unpack"]
