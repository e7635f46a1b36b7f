"""Dense pre-norm transformer block (GPT-2 / Llama / Gemma flavours) and GPT-NeoX's parallel-residual block.

# B batch, T tokens, D model dim

sequential (gpt2, llama, gemma):  h = x + Attn(N1(x));  out = h + FFN(N2(h))
parallel (pythia / GPT-NeoX):     out = x + Attn(N1(x)) + FFN(N2(x))
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch
from torch import nn

from moep_ds.blocks.base import Block, BlockOutput
from moep_ds.layers.attention import AttentionConfig, KVCache, build_attention
from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.registry import ATTENTIONS, BLOCKS, FFNS, NORMS
from moep_ds.schema import OneOf, PositiveInt


@dataclasses.dataclass(kw_only=True)
class DenseBlockConfig:
    type: str = "dense"
    repeat: PositiveInt = 1
    attention: Annotated[Any, OneOf(ATTENTIONS, default="causal")]
    ffn: Annotated[Any, OneOf(FFNS, default="swiglu")] = dataclasses.field(default_factory=FFNConfig)
    norm: Annotated[Any, OneOf(NORMS, default="layernorm")] = dataclasses.field(default_factory=NormConfig)
    parallel_residual: bool = False

    def check_dims(self, path: str, d_model: int) -> None:
        self.attention.check_dims(f"{path}.attention", d_model)


class AttentionSublayer(nn.Module):
    """N(x) -> causal self-attention; shared by every block type with a full attention sublayer."""

    def __init__(self, attention: AttentionConfig, norm: NormConfig, d_model: int):
        super().__init__()
        self.norm = build_norm(norm, d_model)
        self.attn = build_attention(attention, d_model)

    def forward(self, x_BTD: torch.Tensor, positions_BT: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        return self.attn(self.norm(x_BTD), positions_BT, cache)


@BLOCKS.register("dense", config=DenseBlockConfig)
class DenseBlock(Block):
    """Attention sublayer, then a feed-forward sublayer: a dense FFN here, an MoE layer in `ffn_moe`."""

    def __init__(self, cfg: Any, *, d_model: int, layer_idx: int, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attention = AttentionSublayer(cfg.attention, cfg.norm, d_model)
        self.ffn_norm = build_norm(cfg.norm, d_model)
        self.build_feed_forward(cfg, d_model, plan)

    def build_feed_forward(self, cfg: DenseBlockConfig, d_model: int, plan: ExpertParallelPlan) -> None:
        self.ffn = build_ffn(cfg.ffn, d_model)

    def feed_forward(self, x_BTD: torch.Tensor) -> BlockOutput:
        return BlockOutput(self.ffn(x_BTD))

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        attn = self.attention(x_BTD, positions_BT, cache)
        ffn = self.feed_forward(self.ffn_norm(x_BTD if self.parallel_residual else x_BTD + attn))
        return BlockOutput(x_BTD + attn + ffn.x, ffn.aux_losses, ffn.stats)

    def new_cache(self) -> KVCache:
        return self.attention.attn.new_cache()  # MLA keeps its latent (layers/mla.py)
