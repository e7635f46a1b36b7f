"""What every router shares: a linear map to one logit per expert, computed in fp32; bias-free unless the router's
config asks for one (gpt-oss's router has a bias [E]).

# B batch, T tokens, D model dim, E experts

Routers are built as `ROUTERS.build(cfg, d_model=..., num_experts=...)` and called as `router(x_BTD)`,
returning a RoutingPlan over the B*T flattened tokens (row-major: token b*T + t).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moep_ds.deferred_init import init_at_construction
from moep_ds.routing.lifecycle import ExpertLifecycle
from moep_ds.routing.plan import RoutingPlan


def routing_dtype(x: torch.Tensor) -> torch.dtype:
    """Router math runs in fp32 (or wider): bf16 logits flip top-k choices and overflow exp in the softmax."""
    return torch.promote_types(x.dtype, torch.float32)


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D] x [E, D] (+ [E]) -> [T, E] logits in fp32 or wider."""
    dtype = routing_dtype(x_TD)
    if bias_E is None:
        return x_TD.to(dtype) @ weight_ED.to(dtype).t()
    return F.linear(x_TD.to(dtype), weight_ED.to(dtype), bias_E.to(dtype))  # one addmm, as nn.Linear computes it


class Router(nn.Module):
    """Holds the router weight [E, D] (and with `bias` a bias [E]); subclasses turn logits into a RoutingPlan.

    `lifecycle`: the expert lifecycle manager (MoE-Stream) of a router whose config enables one, else None."""

    def __init__(self, *, d_model: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.lifecycle: ExpertLifecycle | None = None
        if init_at_construction():
            self.init_weights(std=0.02)

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """Normal(0, std), like every linear layer of the model (out_scale is for residual outputs; unused); the
        bias too, as transformers initialises gpt-oss's router."""
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            nn.init.normal_(self.bias, std=std)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return router_logits(x_TD, self.weight, self.bias)

    def forward(self, x_BTD: torch.Tensor) -> RoutingPlan:
        raise NotImplementedError

    def active_experts_per_token(self) -> float:
        """How many experts count as active per token in parameter/FLOP accounting: the one place every block
        (FFN MoE, MSIT, MoEP paths and projections) and `--dry_run` take this number from."""
        raise NotImplementedError


__all__ = ["Router", "router_logits", "routing_dtype"]
