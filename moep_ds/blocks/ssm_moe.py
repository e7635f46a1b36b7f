"""MoE-Stream block: a selective state-space mixer, then a top-k MoE FFN.

# B batch, T tokens, D model dim

    h   = x + SSM(LN(x))          (gated diagonal selective scan, O(T), causal; moep_ds/layers/ssm.py)
    out = h + MoE(LN(h))          (top-2 of 8 GELU MLP experts, load balancing 0.01 on batch-local fractions;
                                   `router.lifecycle` adds the expert lifecycle manager)
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch

from moep_ds.blocks.base import Block, BlockOutput
from moep_ds.layers.ffn import FFNConfig
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.layers.ssm import SSMConfig
from moep_ds.moe.layer import MoEConfig, MoELayer
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan, RoutedStage
from moep_ds.registry import BLOCKS, MIXERS, NORMS
from moep_ds.routing.topk import TopKConfig
from moep_ds.schema import OneOf, PositiveInt


def default_moe() -> MoEConfig:
    """MoE-Stream's FFN: top-2 of 8 two-layer GELU MLP experts, load-balancing weight 0.01."""
    return MoEConfig(
        num_experts=8, expert=FFNConfig(type="gelu"), router=TopKConfig(k=2, load_balancing_weight=0.01)
    )


@dataclasses.dataclass(kw_only=True)
class SSMMoEBlockConfig:
    type: str = "ssm_moe"
    repeat: PositiveInt = 1
    mixer: Annotated[Any, OneOf(MIXERS, default="ssm")] = dataclasses.field(default_factory=SSMConfig)
    moe: MoEConfig = dataclasses.field(default_factory=default_moe)
    norm: Annotated[Any, OneOf(NORMS)] = dataclasses.field(default_factory=NormConfig)

    def routed_stages(self, path: str) -> list[RoutedStage]:
        return self.moe.routed_stages(f"{path}.moe")


@BLOCKS.register("ssm_moe", config=SSMMoEBlockConfig)
class SSMMoEBlock(Block):
    def __init__(self, cfg: SSMMoEBlockConfig, *, d_model: int, layer_idx: int,
                 plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        self.mixer_norm = build_norm(cfg.norm, d_model)
        self.mixer = MIXERS.build(cfg.mixer, d_model)
        self.moe_norm = build_norm(cfg.norm, d_model)
        self.moe = MoELayer(cfg.moe, d_model=d_model, plan=plan)

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        # the recurrence orders tokens by their index in the row; positions only matter to attention
        h = x_BTD + self.mixer(self.mixer_norm(x_BTD), cache=cache)
        moe = self.moe(self.moe_norm(h))
        return BlockOutput(h + moe.y, moe.aux_losses, moe.stats)

    def new_cache(self) -> Any:
        return self.mixer.new_cache()


__all__ = ["SSMMoEBlock", "SSMMoEBlockConfig"]
