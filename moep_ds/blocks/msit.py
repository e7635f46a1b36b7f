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
(moep_ds/layers/routed_attention.py). The branches are experts of the dispatcher protocol (moe/dispatch.py),
stacked [E, ...] (moe/stacked.py), so expert parallelism shards them like FFN experts. W_up is linear and
shared, so it is applied once after the gated scatter-add (sum_i r W_up y = W_up sum_i r y) instead of once
per (token, expert) assignment.

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
from moep_ds.layers.attention import AttentionConfig, KVCache, attention_flops
from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.layers.rope import RopeConfig
from moep_ds.layers.routed_attention import RoutedKVCache, RoutedSelfAttention
from moep_ds.moe.dispatch import (
    ExpertBatch, ExpertStage, combine_dense, dense_routing, in_token_order, sequence_ids,
)
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan, RoutedStage
from moep_ds.moe.stacked import StackedExperts
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
        default_factory=lambda: ExpertChoiceConfig(capacity_factor=2.0, active_experts="capacity")
    )
    experts: MSITExpertConfig = dataclasses.field(default_factory=MSITExpertConfig)

    def check_dims(self, path: str, d_model: int) -> None:
        self.attention.check_dims(f"{path}.attention", d_model)
        if hasattr(self.router, "check_num_experts"):
            self.router.check_num_experts(f"{path}.router", len(self.experts.windows))

    def routed_stages(self, path: str) -> list[RoutedStage]:
        windows = self.experts.windows
        return [RoutedStage(f"{path}.experts.windows", windows, len(windows), note="one expert per window")]


class MSITBranch(nn.Module):
    """One expert (eq. 5): pre-LN routed sliding-window attention, pre-LN SwiGLU, post-block LayerNorm.

    forward(u_NF, pos_N, seq_N, window=w) on the expert's tokens (each sequence's contiguous, by position);
    decoding: forward(u_BTF, positions_BT, window=w, routed=routed_BT, cache=RoutedKVCache) on every new token.
    """

    def __init__(self, cfg: MSITExpertConfig, norm: NormConfig):
        super().__init__()
        # The window is the expert's, passed per call: the branches share one stacked module.
        attention = AttentionConfig(num_heads=cfg.num_heads, rope=cfg.rope, bias=cfg.bias)
        self.attn_norm = build_norm(norm, cfg.d_thin)
        self.attn = RoutedSelfAttention(attention, cfg.d_thin)
        self.ffn_norm = build_norm(norm, cfg.d_thin)
        self.ffn = build_ffn(cfg.ffn, cfg.d_thin)
        self.out_norm = build_norm(norm, cfg.d_thin)

    def forward(self, u: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor | None = None, *, window: int,
                routed: torch.Tensor | None = None, cache: RoutedKVCache | None = None) -> torch.Tensor:
        h = self.attn_norm(u)
        a = self.attn.attend(h, seq, pos, window) if cache is None else self.attn.forward_cached(h, routed, pos, cache)
        b = u + a
        return self.out_norm(b + self.ffn(self.ffn_norm(b)))


class MSITExperts(ExpertStage):
    """Eqs. 4-6: shared W_down, the branches (experts, stacked [E, ...]) on their selected tokens through the
    dispatcher, gated scatter-add, shared W_up."""

    def __init__(self, cfg: MSITExpertConfig, norm: NormConfig, d_model: int, active_experts_per_token: float,
                 plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__(len(cfg.windows), plan)
        self.w_down = nn.Linear(d_model, cfg.d_thin, bias=False)
        self.branches = StackedExperts.build(lambda: MSITBranch(cfg, norm), len(cfg.windows), plan)
        self.w_up = nn.Linear(cfg.d_thin, d_model, bias=False)
        self.windows = list(cfg.windows)  # of every expert, by global index
        self.token_share = active_experts_per_token / self.num_experts

    @property
    def experts(self) -> StackedExperts:
        return self.branches

    def forward(self, g_BTD: torch.Tensor, plan: RoutingPlan, positions_BT: torch.Tensor) -> torch.Tensor:
        B, T, _ = g_BTD.shape
        u_TF = self.w_down(g_BTD.reshape(B * T, -1))  # once per token, not once per assignment
        seq_T = sequence_ids(B, T, g_BTD.device)
        acc_TF = self.dispatch(u_TF, in_token_order(plan), seq_T, positions_BT.reshape(B * T))
        return self.w_up(acc_TF).view(B, T, -1)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        """Branch e on its tokens (each sequence's contiguous, by position)."""
        self.check_batch(batch)
        counts = batch.counts  # the branches run one after another: Python ints (a copy to the host unless known)
        parts = zip(batch.x_SD.split(counts), batch.positions_S.split(counts), batch.seq_ids_S.split(counts),
                    self.branches.per_expert())
        windows = self.windows[self.first_local_expert :]
        return torch.cat([self.branches.call(p, u, pos, seq, window=w) for (u, pos, seq, p), w in zip(parts, windows)])

    def forward_cached(self, g_BTD, plan: RoutingPlan, positions_BT, caches: list[RoutedKVCache]) -> torch.Tensor:
        """Decoding: every new token runs through every branch held here against its cache; unselected ones get 0;
        with sharded branches the ranks' shares are summed (`Dispatcher.sum_over_ranks`)."""
        B, T, _ = g_BTD.shape
        u_BTF = self.w_down(g_BTD)
        routed_EBT, weight_EBT = (m[self.held()] for m in dense_routing(plan, B, T))
        y_EBTF = [self.branches.call(p, u_BTF, positions_BT, window=w, routed=routed, cache=cache)
                  for p, w, routed, cache in zip(self.branches.per_expert(), self.windows[self.held()], routed_EBT,
                                                 caches)]
        return self.w_up(self.dispatcher.sum_over_ranks(combine_dense(y_EBTF, routed_EBT, weight_EBT)))

    def new_caches(self) -> list[RoutedKVCache]:
        """One per branch held here."""
        return [RoutedKVCache(window=w) for w in self.windows[self.held()]]

    def num_active_params(self) -> int:
        """Per token: W_down, W_up and the router's active experts of the E branches (a share of each)."""
        shared = self.w_down.weight.numel() + self.w_up.weight.numel()
        branches = self.num_experts * self.branches.params_per_expert()
        return shared + round(self.token_share * branches)

    def attention_flop_terms(self, seq_len: int) -> list[float]:
        """Per branch: a share s of tokens is routed to it, each seeing about s of its windowed context."""
        attn = self.branches.expert.attn
        return [self.token_share**2 * attention_flops(attn.num_heads, attn.head_dim, seq_len, w) for w in self.windows]


@dataclasses.dataclass
class MSITCache:
    global_block: KVCache
    branches: list[RoutedKVCache]


def cache_part(cache: MSITCache | None) -> KVCache | None:
    return None if cache is None else cache.global_block


@BLOCKS.register("msit", config=MSITBlockConfig)
class MSITBlock(Block):
    def __init__(self, cfg: MSITBlockConfig, *, d_model: int, layer_idx: int,
                 plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        self.cfg = cfg
        num_experts = len(cfg.experts.windows)
        dense = DenseBlockConfig(attention=cfg.attention, ffn=cfg.ffn, norm=cfg.norm)
        self.global_block = DenseBlock(dense, d_model=d_model, layer_idx=layer_idx)
        self.router_norm = build_norm(cfg.norm, d_model)
        self.router = ROUTERS.build(cfg.router, d_model=d_model, num_experts=num_experts)
        self.experts = MSITExperts(cfg.experts, cfg.norm, d_model, self.router.active_experts_per_token(), plan)
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
        return MSITCache(KVCache(), self.experts.new_caches())


__all__ = [
    "MSITBlockConfig", "MSITExpertConfig", "MSITBlock", "MSITBranch", "MSITExperts", "MSITCache",
]
