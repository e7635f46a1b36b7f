"""Normalisation layers: LayerNorm, RMSNorm, and Gemma's RMSNorm with a (1 + w) scale."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moep_ds.registry import NORMS
from moep_ds.schema import PositiveFloat


@dataclasses.dataclass(kw_only=True)
class NormConfig:
    type: str = "layernorm"
    eps: PositiveFloat = 1e-5
    bias: bool = True  # LayerNorm only


@NORMS.register("layernorm", config=NormConfig)
class LayerNorm(nn.LayerNorm):
    def __init__(self, cfg: NormConfig, dim: int):
        super().__init__(dim, eps=cfg.eps, bias=cfg.bias)

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """Scale 1, bias 0 (also for a stack of norms [E, dim], which holds no values until initialised)."""
        self.reset_parameters()


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * scale, computed in fp32 and cast back."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * scale.float()).to(x.dtype)


@NORMS.register("rmsnorm", config=NormConfig)
class RMSNorm(nn.Module):
    def __init__(self, cfg: NormConfig, dim: int):
        super().__init__()
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.ones(dim))

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@NORMS.register("gemma_rmsnorm", config=NormConfig)
class GemmaRMSNorm(nn.Module):
    """Gemma stores the scale as an offset from 1 (weights start at zero)."""

    def __init__(self, cfg: NormConfig, dim: int):
        super().__init__()
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.zeros(dim))

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight.float(), self.eps)


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    return NORMS.build(cfg, dim)


__all__ = ["NormConfig", "LayerNorm", "RMSNorm", "GemmaRMSNorm", "build_norm", "rms_norm"]
