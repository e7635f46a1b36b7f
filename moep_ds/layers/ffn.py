"""Position-wise feed-forward networks: GELU MLP (exact or tanh-approximated GELU), SwiGLU, GeGLU.

# T tokens, D model dim, F hidden dim
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.layers.glu import gated_activation
from moep_ds.registry import FFNS
from moep_ds.schema import PositiveInt


@dataclasses.dataclass(kw_only=True)
class FFNConfig:
    type: str = "swiglu"
    # null: 4d for the GELU MLP; for gated FFNs 8d/3 rounded to the nearest multiple of 8 (the MoEP-MSIT rule),
    # which keeps a gated FFN's three matrices at the parameter count of a 4d two-matrix MLP.
    hidden_size: PositiveInt | None = None
    bias: bool = False


GATED = {"swiglu", "geglu"}


def ffn_hidden_size(cfg: FFNConfig, d_model: int) -> int:
    if cfg.hidden_size is not None:
        return cfg.hidden_size
    if cfg.type in GATED:
        return int(round(8 * d_model / 3 / 8)) * 8
    return 4 * d_model


def gelu_mlp(x: torch.Tensor, w_in: nn.Linear, w_out: nn.Linear, approximate: str = "none") -> torch.Tensor:
    return w_out(F.gelu(w_in(x), approximate=approximate))


@FFNS.register("gelu", config=FFNConfig)
class GeluMLP(nn.Module):
    approximate = "none"  # exact GELU

    def __init__(self, cfg: FFNConfig, d_model: int):
        super().__init__()
        hidden = ffn_hidden_size(cfg, d_model)
        self.w_in = nn.Linear(d_model, hidden, bias=cfg.bias)
        self.w_out = nn.Linear(hidden, d_model, bias=cfg.bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(x_TD, self.w_in, self.w_out, self.approximate)


@FFNS.register("gelu_tanh", config=FFNConfig)
class GeluTanhMLP(GeluMLP):
    # GPT-2's gelu_new, and GPT-NeoX's fused bias-GELU kernel that Pythia trained with (bias-gelu-fusion)
    approximate = "tanh"


class GatedMLP(nn.Module):
    """out = W2 (act(W1 x) * W3 x); act(.) * . as one fused kernel where it pays (layers/glu.py)."""

    kind = "swiglu"

    def __init__(self, cfg: FFNConfig, d_model: int):
        super().__init__()
        hidden = ffn_hidden_size(cfg, d_model)
        self.w1 = nn.Linear(d_model, hidden, bias=cfg.bias)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=cfg.bias)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=cfg.bias)  # down

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # the two projections are temporaries of this call: the fused backward may overwrite them (layers/glu.py)
        return self.w2(gated_activation(self.kind, self.w1(x_TD), self.w3(x_TD), consume=True))


@FFNS.register("swiglu", config=FFNConfig)
class SwiGLU(GatedMLP):
    kind = "swiglu"


@FFNS.register("geglu", config=FFNConfig)
class GeGLU(GatedMLP):
    # Gemma uses the tanh approximation of GELU in its gated FFN.
    kind = "geglu"


def build_ffn(cfg: FFNConfig, d_model: int) -> nn.Module:
    return FFNS.build(cfg, d_model)
