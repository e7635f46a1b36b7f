"""FFN-level MoE block (Nova-MoE; Switch / Mixtral style): the dense block with an MoE layer as its FFN.

# B batch, T tokens, D model dim

sequential:  h = x + Attn(N1(x));  out = h + MoE(N2(h))
parallel:    out = x + Attn(N1(x)) + MoE(N2(x))          (GPT-NeoX / Pythia layout)

Any registered router works (expert choice, top-k). The MoE layer's auxiliary losses (already weighted) and
routing statistics are returned in the BlockOutput; the model sums the losses into `loss`.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch

from moep_ds.blocks.base import BlockOutput
from moep_ds.blocks.dense import DenseBlock
from moep_ds.layers.norm import NormConfig
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.plan import ExpertParallelPlan, RoutedStage
from moep_ds.registry import ATTENTIONS, BLOCKS, NORMS
from moep_ds.schema import OneOf, PositiveInt


@dataclasses.dataclass(kw_only=True)
class FFNMoEBlockConfig:
    type: str = "ffn_moe"
    repeat: PositiveInt = 1
    attention: Annotated[Any, OneOf(ATTENTIONS, default="causal")]
    moe: MoEConfig
    norm: Annotated[Any, OneOf(NORMS, default="layernorm")] = dataclasses.field(default_factory=NormConfig)
    parallel_residual: bool = False

    def check_dims(self, path: str, d_model: int) -> None:
        self.attention.check_dims(f"{path}.attention", d_model)

    def routed_stages(self, path: str) -> list[RoutedStage]:
        return self.moe.routed_stages(f"{path}.moe")


@BLOCKS.register("ffn_moe", config=FFNMoEBlockConfig)
class FFNMoEBlock(DenseBlock):
    """The dense block (either residual layout) with an MoE layer as its feed-forward sublayer."""

    def build_feed_forward(self, cfg: FFNMoEBlockConfig, d_model: int, plan: ExpertParallelPlan) -> None:
        self.moe = MoELayer(cfg.moe, d_model=d_model, plan=plan)

    def feed_forward(self, x_BTD: torch.Tensor) -> BlockOutput:
        moe = self.moe(x_BTD)
        return BlockOutput(moe.y, moe.aux_losses, moe.stats)


__all__ = ["FFNMoEBlock", "FFNMoEBlockConfig"]
