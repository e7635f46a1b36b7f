"""MXFP4 (OCP Microscaling, FP4 e2m1 values sharing one power-of-two scale per 32) as gpt-oss releases its experts,
dequantised as transformers does it (integrations/mxfp4.py, convert_moe_packed_tensors), bit for bit.

# E experts, R rows of the stored matrix (its outputs), G blocks per row (its inputs / 32), B bytes per block (16)

    *_blocks  uint8 [E, R, G, B]   two FP4 values a byte: the low nibble first, then the high one
    *_scales  uint8 [E, R, G]      the block's exponent, biased by 127: the block's values times 2^(scale - 127)
    result          [E, G*2B, R]   the matrix as the model multiplies by it (x @ w), inputs first

Each expert's rows come from the same expert's blocks and scales alone, so a process dequantises only the experts it
holds (a `rowwise` rule, interop/rules.py).
"""
from __future__ import annotations

import torch

# e2m1: sign, two exponent bits, one mantissa bit; index = the nibble
FP4_E2M1 = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
VALUES_PER_BLOCK = 32


def blocks_shape(num_experts: int, rows: int, inputs: int) -> tuple[int, int, int, int]:
    """The [E, R, G, B] shape of the blocks of an [E, inputs, rows] matrix (inputs a multiple of 32)."""
    return num_experts, rows, inputs // VALUES_PER_BLOCK, VALUES_PER_BLOCK // 2


def dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """[E, G*32, R] in `dtype` from MXFP4 blocks and scales (works on the meta device too: shapes only)."""
    if tuple(blocks_ERGB.shape[:-1]) != tuple(scales_ERG.shape) or blocks_ERGB.dim() != 4:
        raise ValueError(f"MXFP4 blocks {list(blocks_ERGB.shape)} and scales {list(scales_ERG.shape)}: the blocks "
                         "must be [E, R, G, B] and the scales [E, R, G]")
    blocks = blocks_ERGB.to(torch.uint8)
    exponent_ERG1 = (scales_ERG.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    lut = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    E, R, G, B = blocks.shape
    out_ERGV = torch.empty(E, R, G, 2 * B, dtype=dtype, device=blocks.device)
    out_ERGV[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out_ERGV[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    # in place, as transformers does: x * 2^e computed in fp32 and rounded once into `dtype`
    torch.ldexp(out_ERGV, exponent_ERG1, out=out_ERGV)
    return out_ERGV.reshape(E, R, G * 2 * B).transpose(1, 2).contiguous()


__all__ = ["FP4_E2M1", "SCALE_BIAS", "VALUES_PER_BLOCK", "blocks_shape", "dequantize"]
