"""Rotary position embeddings (RoPE), optionally on a leading fraction of each head's dims (GPT-NeoX), optionally
stretched by YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"; DeepSeek-V2/V3, Qwen).

# B batch, H heads, T tokens, Dh head dim, R rotary dims (even, <= Dh)

Rotation pairs dim i with dim i + R/2 (the GPT-NeoX / Llama "rotate_half" layout). DeepSeek's checkpoints pair
dim 2i with 2i + 1 (rope_interleave): the same rotation of rows permuted, which the import undoes in the weights
(interop/families/deepseek_v3.py), so one layout serves both.

YaRN, as transformers' rope_type "yarn" computes it (modeling_rope_utils._compute_yarn_parameters):
    inv_freq_i = base^(-2i/R) blended with base^(-2i/R) / factor by a linear ramp over the dims whose wavelength
                 lies between original_max_seq_len / beta_fast and / beta_slow rotations (eq. 17-19)
    cos, sin   x attention_factor (default mscale(factor, mscale) / mscale(factor, mscale_all_dim), else
                 mscale(factor); mscale(s, m) = 0.1 m ln s + 1, eq. 21)
MLA (layers/mla.py) also multiplies its softmax scale by mscale(factor, mscale_all_dim)^2 (`softmax_mscale`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Annotated

import torch

from moep_ds.schema import Between, NonNegativeFloat, PositiveFloat, PositiveInt


@dataclasses.dataclass(kw_only=True)
class YarnConfig:
    """transformers' rope_parameters of rope_type "yarn", under our names."""

    factor: PositiveFloat  # context extension factor
    original_max_seq_len: PositiveInt  # original_max_position_embeddings: the length trained before extension
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: NonNegativeFloat | None = None
    mscale_all_dim: NonNegativeFloat | None = None
    attention_factor: PositiveFloat | None = None  # null: from mscale / mscale_all_dim (module docstring)
    truncate: bool = True  # round the ramp's ends to whole dims


@dataclasses.dataclass(kw_only=True)
class RopeConfig:
    base: PositiveFloat = 10000.0
    fraction: Annotated[float, Between(0.0, 1.0, lo_open=True)] = 1.0  # share of head dims rotated
    yarn: YarnConfig | None = None  # null: plain RoPE


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN eq. 21: 0.1 m ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rot_dim: int, base: float, yarn: YarnConfig, dtype: torch.dtype) -> torch.Tensor:
    """[R/2] YaRN's blend of extrapolated (base^(-2i/R)) and interpolated (/ factor) frequencies."""

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original length
        return rot_dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    extrapolated = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq.to(dtype)


def yarn_attention_factor(yarn: YarnConfig) -> float:
    """The factor on cos and sin (module docstring)."""
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def softmax_mscale(rope: RopeConfig | None) -> float:
    """The factor on an MLA softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim set,
    else 1 (transformers' yarn_apply_mscale)."""
    if rope is None or rope.yarn is None or not rope.yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(rope.yarn.factor, rope.yarn.mscale_all_dim) ** 2


def rope_tables(positions: torch.Tensor, rot_dim: int, rope: RopeConfig, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., R] of `rope` (plain or YaRN) for integer `positions` [...]."""
    if rope.yarn is None:
        return rope_cos_sin(positions, rot_dim, rope.base, dtype)
    inv_freq = yarn_inv_freq(rot_dim, rope.base, rope.yarn, torch.float32).to(positions.device, dtype)
    angles = positions.to(dtype)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    factor = yarn_attention_factor(rope.yarn)
    return angles.cos() * factor, angles.sin() * factor


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
