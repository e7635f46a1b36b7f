"""Rotary position embeddings (RoPE), optionally on a leading fraction of each head's dims (GPT-NeoX).

# B batch, H heads, T tokens, Dh head dim, R rotary dims (even, <= Dh)

Rotation pairs dim i with dim i + R/2 (the GPT-NeoX / Llama "rotate_half" layout).
"""
from __future__ import annotations

import dataclasses
from typing import Annotated

import torch

from moep_ds.schema import Between, PositiveFloat


@dataclasses.dataclass(kw_only=True)
class RopeConfig:
    base: PositiveFloat = 10000.0
    fraction: Annotated[float, Between(0.0, 1.0, lo_open=True)] = 1.0  # share of head dims rotated


def rotary_dims(head_dim: int, fraction: float) -> int:
    """Number of rotated dims: fraction of the head dim, rounded down to an even number."""
    return int(head_dim * fraction) // 2 * 2


def rope_cos_sin(
    positions: torch.Tensor, rot_dim: int, base: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer `positions` of any shape [...] -> [..., R], in fp32 (or fp64 if asked)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, device=positions.device, dtype=dtype) / rot_dim))
    angles = positions.to(dtype)[..., None] * inv_freq  # [..., R/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., R]
    return angles.cos(), angles.sin()


def table_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 tables for fp32/bf16/fp16 activations, fp64 for fp64 (reference computations)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of x [..., Dh] by cos/sin [..., R] (broadcast over the leading dims),
    computing in the tables' precision."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot.to(cos.dtype) * cos + rotated.to(cos.dtype) * sin
    return torch.cat([out.to(x.dtype), x_pass], dim=-1)
