"""MoEP-MSIT block (method section, eqs. 1-7): a global dense block, then expert-choice routing into
multi-scale sliding-window branches that run on a thin width.

# B batch, T tokens, D model dim, F thin dim (d_thin), E experts (one per window), N tokens of one expert

    g = DenseBlock(x)                              eq. 1  global block: RoPE MHA (no window) + SwiGLU
    r = softmax_E(W_R LN(g))                       eq. 2  router, bias-free W_R, fp32
    S_i = top-k_t r[:, i],  k = round(c B T / E)   eq. 3  expert choice (c = 2.0, E = 4)
    u = W_down g                                   eq. 4  shared, bias-free, D -> F
    y_i = LN(b + FFN(LN(b))), b = u + Attn_i(LN(u)) on S_i    eq. 5  branch i: window w_i, 6 heads
    o_t = W_up sum_{i: t in S_i} r[t, i] y_i,t     eq. 6  shared, bias-free, F -> D, gated, scattered back
    h = LN(g + o)                                  eq. 7

Branch i sees only its selected tokens; its attention is causal over their ORIGINAL positions within the
same sequence, pos(t) - w_i < pos(s) <= pos(t), with RoPE at those positions, in O(N w_i)
(moep_ds/layers/routed_attention.py). W_up is linear and shared, so it is applied once after the gated
scatter-add (sum_i r W_up y = W_up sum_i r y) instead of once per (token, expert) assignment.

Parameters of the `msit_babylm` preset (d 256, F 384, vocab 16384, 6 blocks, LayerNorms with bias,
bias-free linear maps, SwiGLU hidden 8d/3 rounded to a multiple of 8: 680 global, 1024 in a branch):
    global block   attention 4*256^2 = 262,144; SwiGLU 3*256*680 = 522,240; 2 LN = 1,024     785,408
    router         LN 512 + W_R 4*256 = 1,024                                                   1,536
    W_down, W_up   2 * 256*384                                                                196,608
    4 branches     attention 4*384^2 = 589,824; SwiGLU 3*384*1024 = 1,179,648; 3 LN = 2,304
                   each 1,771,776                                                            7,087,104
    output LN                                                                                     512
    block                                                                                   8,071,168
6 blocks + final LN (512) = 48,427,520 non-embedding; + tied embedding 16384*256 = 4,194,304
gives 52,621,824 total (paper: ~48.4M / ~52.6M).
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch
from torch import nn

from moep_ds.blocks.base import Block, BlockOutput
from moep_ds.blocks.dense import DenseBlock, DenseBlockConfig
from moep_ds.layers.attention import AttentionConfig, KVCache
from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.layers.rope import RopeConfig
from moep_ds.layers.routed_attention import RoutedKVCache, RoutedSelfAttention
from moep_ds.registry import BLOCKS, NORMS, ROUTERS
from moep_ds.routing.expert_choice import ExpertChoiceConfig
from moep_ds.routing.plan import RoutingPlan
from moep_ds.schema import OneOf, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class MSITExpertConfig:
    d_thin: PositiveInt = 384
    num_heads: PositiveInt = 6
    windows: list[PositiveInt] = dataclasses.field(default_factory=lambda: [64, 16, 8, 4])  # one per expert
    ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)  # SwiGLU, hidden 8 F / 3
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    bias: bool = False  # attention projections

    def validate(self, path: str) -> None:
        if not self.windows:
            fail(f"{path}.windows", self.windows, "must list one window per expert")
        if self.d_thin % self.num_heads:
            fail(f"{path}.num_heads", self.num_heads, f"must divide d_thin ({self.d_thin})")


@dataclasses.dataclass(kw_only=True)
class MSITBlockConfig:
    type: str = "msit"
    repeat: PositiveInt = 1
    attention: AttentionConfig = dataclasses.field(  # the global block's
        default_factory=lambda: AttentionConfig(num_heads=4, rope=RopeConfig())
    )
    ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)
    norm: Annotated[Any, OneOf(NORMS)] = dataclasses.field(default_factory=NormConfig)
    router: Annotated[Any, OneOf(ROUTERS)] = dataclasses.field(
        default_factory=lambda: ExpertChoiceConfig(capacity_factor=2.0)
    )
    experts: MSITExpertConfig = dataclasses.field(default_factory=MSITExpertConfig)

    def check_dims(self, path: str, d_model: int) -> None:
        self.attention.check_dims(f"{path}.attention", d_model)
        if hasattr(self.router, "check_num_experts"):
            self.router.check_num_experts(f"{path}.router", len(self.experts.windows))


class MSITBranch(nn.Module):
    """One expert (eq. 5): pre-LN routed sliding-window attention, pre-LN SwiGLU, post-block LayerNorm."""

    def __init__(self, cfg: MSITExpertConfig, norm: NormConfig, window: int):
        super().__init__()
        attention = AttentionConfig(num_heads=cfg.num_heads, window=window, rope=cfg.rope, bias=cfg.bias)
        self.attn_norm = build_norm(norm, cfg.d_thin)
        self.attn = RoutedSelfAttention(attention, cfg.d_thin)
        self.ffn_norm = build_norm(norm, cfg.d_thin)
        self.ffn = build_ffn(cfg.ffn, cfg.d_thin)
        self.out_norm = build_norm(norm, cfg.d_thin)

    def forward(self, u_NF: torch.Tensor, seq_N: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
        b_NF = u_NF + self.attn(self.attn_norm(u_NF), seq_N, pos_N)
        return self.out_norm(b_NF + self.ffn(self.ffn_norm(b_NF)))

    def forward_cached(self, u_BTF, routed_BT, positions_BT, cache: RoutedKVCache) -> torch.Tensor:
        b_BTF = u_BTF + self.attn.forward_cached(self.attn_norm(u_BTF), routed_BT, positions_BT, cache)
        return self.out_norm(b_BTF + self.ffn(self.ffn_norm(b_BTF)))


class MSITExperts(nn.Module):
    """Eqs. 4-6: shared W_down, the branches on their selected tokens, gated scatter-add, shared W_up."""

    def __init__(self, cfg: MSITExpertConfig, norm: NormConfig, d_model: int, token_share: float):
        super().__init__()
        self.w_down = nn.Linear(d_model, cfg.d_thin, bias=False)
        self.branches = nn.ModuleList(MSITBranch(cfg, norm, w) for w in cfg.windows)
        self.w_up = nn.Linear(cfg.d_thin, d_model, bias=False)
        self.token_share = token_share
        for branch in self.branches:
            branch.attn.token_share = token_share

    def forward(self, g_BTD: torch.Tensor, plan: RoutingPlan, positions_BT: torch.Tensor) -> torch.Tensor:
        B, T, _ = g_BTD.shape
        u_TF = self.w_down(g_BTD.reshape(B * T, -1))  # once per token, not once per assignment
        pos_T = positions_BT.reshape(B * T)
        acc_TF = torch.zeros_like(u_TF)
        for branch, idx_N, weight_N in zip(self.branches, *expert_slices(plan)):
            # Flat index b*T + t sorts an expert's tokens by (sequence, position), as the attention requires.
            idx_N, order = idx_N.sort()
            y_NF = branch(u_TF[idx_N], idx_N // T, pos_T[idx_N])
            acc_TF = acc_TF.index_add(0, idx_N, y_NF * weight_N[order, None].to(y_NF.dtype))
        return self.w_up(acc_TF).view(B, T, -1)

    def forward_cached(self, g_BTD, plan: RoutingPlan, positions_BT, caches: list[RoutedKVCache]) -> torch.Tensor:
        """Decoding: every new token runs through every branch against its cache; unselected ones get 0."""
        B, T, _ = g_BTD.shape
        u_BTF = self.w_down(g_BTD)
        acc_BTF = torch.zeros_like(u_BTF)
        for branch, cache, idx_N, weight_N in zip(self.branches, caches, *expert_slices(plan)):
            weight_BT = torch.zeros(B * T, dtype=weight_N.dtype, device=g_BTD.device).index_put((idx_N,), weight_N)
            routed_BT = torch.zeros(B * T, dtype=torch.bool, device=g_BTD.device).index_fill(0, idx_N, True)
            weight_BT, routed_BT = weight_BT.view(B, T), routed_BT.view(B, T)
            y_BTF = branch.forward_cached(u_BTF, routed_BT, positions_BT, cache)
            acc_BTF = acc_BTF + torch.where(routed_BT[..., None], y_BTF * weight_BT[..., None].to(y_BTF.dtype), 0.0)
        return self.w_up(acc_BTF)

    def num_active_params(self) -> int:
        """Per token: W_down, W_up and on average c of the E branches (a share c/E of tokens per branch)."""
        shared = self.w_down.weight.numel() + self.w_up.weight.numel()
        branches = sum(p.numel() for p in self.branches.parameters())
        return shared + round(self.token_share * branches)


def expert_slices(plan: RoutingPlan) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per expert: its token indices and combine weights (one host sync for the counts)."""
    counts = plan.counts()
    return plan.token_idx_S.split(counts), plan.weight_S.split(counts)


def experts_per_token(router_cfg: Any, num_experts: int) -> float:
    """Expected number of experts a token passes through: c for expert choice, k for top-k."""
    if isinstance(router_cfg, ExpertChoiceConfig):
        return min(router_cfg.capacity_factor, num_experts)
    return float(getattr(router_cfg, "k", 1))


@dataclasses.dataclass
class MSITCache:
    global_block: KVCache
    branches: list[RoutedKVCache]


def cache_part(cache: MSITCache | None) -> KVCache | None:
    return None if cache is None else cache.global_block


@BLOCKS.register("msit", config=MSITBlockConfig)
class MSITBlock(Block):
    def __init__(self, cfg: MSITBlockConfig, *, d_model: int, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        num_experts = len(cfg.experts.windows)
        dense = DenseBlockConfig(attention=cfg.attention, ffn=cfg.ffn, norm=cfg.norm)
        self.global_block = DenseBlock(dense, d_model=d_model, layer_idx=layer_idx)
        self.router_norm = build_norm(cfg.norm, d_model)
        self.router = ROUTERS.build(cfg.router, d_model=d_model, num_experts=num_experts)
        share = experts_per_token(cfg.router, num_experts) / num_experts
        self.experts = MSITExperts(cfg.experts, cfg.norm, d_model, token_share=share)
        self.out_norm = build_norm(cfg.norm, d_model)

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        g_BTD = self.global_block(x_BTD, positions_BT=positions_BT, cache=cache_part(cache)).x  # eq. 1
        plan = self.router(self.router_norm(g_BTD))  # eqs. 2-3
        if cache is None:
            o_BTD = self.experts(g_BTD, plan, positions_BT)  # eqs. 4-6
        else:
            self.check_causal_routing()
            o_BTD = self.experts.forward_cached(g_BTD, plan, positions_BT, cache.branches)
        return BlockOutput(self.out_norm(g_BTD + o_BTD), plan.aux_losses, plan.stats)  # eq. 7

    def check_causal_routing(self) -> None:
        """Decoding with a cache needs each token's routing to depend on that token alone."""
        mode = getattr(self.cfg.router, "eval_mode", "threshold")
        if self.training:
            raise ValueError("msit decoding with a cache needs the model in eval mode (model.eval())")
        if mode != "threshold":
            raise ValueError(f"msit decoding with a cache needs causal routing: router eval_mode ({mode!r}) must be "
                             "'threshold'")

    def new_cache(self) -> MSITCache:
        return MSITCache(KVCache(), [branch.attn.new_cache() for branch in self.experts.branches])


__all__ = [
    "MSITBlockConfig", "MSITExpertConfig", "MSITBlock", "MSITBranch", "MSITExperts", "MSITCache", "expert_slices",
]
