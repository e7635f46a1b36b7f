"""Position-wise feed-forward networks: GELU MLP (exact or tanh-approximated GELU), SwiGLU, GeGLU, and gpt-oss's
clamped SwiGLU (layers/glu.py ClampedSwiGLU: `limit` required, `alpha` default 1.702).

# T tokens, D model dim, F hidden dim
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.layers.glu import ClampedSwiGLU, GateKind, gated_activation
from moep_ds.registry import FFNS
from moep_ds.schema import PositiveFloat, PositiveInt, fail

CLAMPED_ALPHA = 1.702  # gpt-oss's swiglu_alpha


@dataclasses.dataclass(kw_only=True)
class FFNConfig:
    type: str = "swiglu"
    # null: 4d for the GELU MLP; for gated FFNs 8d/3 rounded to the nearest multiple of 8 (the MoEP-MSIT rule),
    # which keeps a gated FFN's three matrices at the parameter count of a 4d two-matrix MLP.
    hidden_size: PositiveInt | None = None
    bias: bool = False
    limit: PositiveFloat | None = None  # clamped_swiglu only (required there): the clamp bound
    alpha: PositiveFloat | None = None  # clamped_swiglu only: the sigmoid's slope; null: 1.702

    def validate(self, path: str) -> None:
        clamped = self.type == "clamped_swiglu"
        if clamped and self.limit is None:
            fail(f"{path}.limit", None, "is required for type clamped_swiglu")
        for name in ("limit", "alpha"):
            if not clamped and getattr(self, name) is not None:
                fail(f"{path}.{name}", getattr(self, name), f"applies to type clamped_swiglu only, not {self.type}")


GATED = {"swiglu", "geglu", "clamped_swiglu"}


def gate_kind(cfg: FFNConfig) -> GateKind:
    """The gated activation of a gated FFN type: its name, or the kind with its parameters (clamped_swiglu)."""
    if cfg.type == "clamped_swiglu":
        cfg.validate("ffn")  # also for a config built in code, not parsed
        return ClampedSwiGLU(cfg.limit, CLAMPED_ALPHA if cfg.alpha is None else cfg.alpha)
    return cfg.type


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

    def __init__(self, cfg: FFNConfig, d_model: int):
        super().__init__()
        self.kind = gate_kind(cfg)
        hidden = ffn_hidden_size(cfg, d_model)
        self.w1 = nn.Linear(d_model, hidden, bias=cfg.bias)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=cfg.bias)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=cfg.bias)  # down

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        # the two projections are temporaries of this call: the fused backward may overwrite them (layers/glu.py)
        return self.w2(gated_activation(self.kind, self.w1(x_TD), self.w3(x_TD), consume=True))


@FFNS.register("swiglu", config=FFNConfig)
class SwiGLU(GatedMLP):
    pass


@FFNS.register("geglu", config=FFNConfig)
class GeGLU(GatedMLP):
    pass  # Gemma uses the tanh approximation of GELU in its gated FFN.


@FFNS.register("clamped_swiglu", config=FFNConfig)
class ClampedSwiGLUMLP(GatedMLP):
    pass  # gpt-oss


def build_ffn(cfg: FFNConfig, d_model: int) -> nn.Module:
    return FFNS.build(cfg, d_model)
