"""Shared experts beside the routed ones: an always-active dense FFN whose output joins the MoE output.

# T tokens, D model dim, F shared hidden dim

    gate none:          y = moe(x) + ffn(x)                               (DeepSeek-V2/V3 shared experts)
    gate sigmoid:       y = moe(x) + sigmoid(x . w_g) ffn(x)             (Qwen2-MoE's shared_expert_gate, w_g [D])
    gate residual_mix:  [c_moe, c_ffn] = softmax(W_c x + b_c), y = c_moe moe(x) + c_ffn ffn(x)
                        (DeepSpeed's MoE(use_residual=True), Residual-MoE of the DeepSpeed-MoE paper, W_c [2, D])

The FFN is of the routed experts' kind (SwiGLU, GELU, ...) at its own hidden size (several shared experts of
DeepSeek are one FFN of their summed hidden size). Its parameters are ordinary dense parameters: replicated under
expert parallelism, partitioned by ZeRO like any other weight.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import nn

from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.schema import PositiveInt


@dataclasses.dataclass(kw_only=True)
class SharedExpertConfig:
    hidden_size: PositiveInt  # F (DeepSeek: moe_intermediate_size x n_shared_experts)
    gate: Literal["none", "sigmoid", "residual_mix"] = "none"


class SharedExpert(nn.Module):
    """The shared FFN and its gate; `combine(y_routed, x)` gives the layer's output."""

    def __init__(self, cfg: SharedExpertConfig, expert: FFNConfig, *, d_model: int):
        super().__init__()
        self.gate_kind = cfg.gate
        self.ffn = build_ffn(dataclasses.replace(expert, hidden_size=cfg.hidden_size), d_model)
        # bias-free as Qwen2-MoE's gate; DeepSpeed's coefficient is an nn.Linear with its bias
        self.gate = None
        if cfg.gate == "sigmoid":
            self.gate = nn.Linear(d_model, 1, bias=False)
        elif cfg.gate == "residual_mix":
            self.gate = nn.Linear(d_model, 2, bias=True)

    def combine(self, y_routed_TD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        return self.mix(y_routed_TD, self.compute(x_TD))

    def compute(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shared FFN's output and its gate's (or None): independent of the routed experts, so it may run
        while their tokens travel (moe/layer.py)."""
        shared_TD = self.ffn(x_TD)
        return shared_TD, None if self.gate_kind == "none" else self.gate(x_TD)

    def mix(self, y_routed_TD: torch.Tensor, computed: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        shared_TD, gate_TX = computed
        if self.gate_kind == "none":
            return y_routed_TD + shared_TD
        if self.gate_kind == "sigmoid":
            return y_routed_TD + torch.sigmoid(gate_TX) * shared_TD
        coef_T2 = torch.softmax(gate_TX, dim=-1)
        return y_routed_TD * coef_T2[..., 0:1] + shared_TD * coef_T2[..., 1:]

    def extra_repr(self) -> str:
        return f"gate={self.gate_kind}"


__all__ = ["SharedExpert", "SharedExpertConfig"]
