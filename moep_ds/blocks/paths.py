"""MoEP layer-level paths: a full-width layer, an MoE contraction to a narrow path width, parallel routed path
blocks, an MoE expansion back, and a second full-width layer.

# B batch, T tokens (B*T flattened where a plan indexes them), D full width d_L, P path width d_P,
# E projection experts, N paths, K experts/paths per token, M tokens routed to one path

    h1 = Layer_pre(x)                                   full-width dense block (none with full_layer: false)
    z  = sum_{e in top-K(c)} c_e W^down_e LN(h1)        contraction: E linear experts D -> P, top-K gated
    y  = z + sum_{j in top-K(p)} p_j (Path_j(z) - z)    N path blocks at P; path j sees only its tokens
    h2 = h1 + sum_{e in top-K(u)} u_e W^up_e LN(y)      expansion: E linear experts P -> D, top-K gated
    out = Layer_post(h2)                                full-width dense block

A path is `path_depth` pre-norm blocks at width P whose attention runs over the tokens routed to that path
only, causally over their ORIGINAL positions in the same sequence (routed attention with no window,
moep_ds/layers/routed_attention.py). Gates are the top-K routers' softmax probabilities; tokens keep z
(resp. h1) on the residual for the paths (resp. expansion) they skip.

Each of the three routers returns the Switch / GShard load-balancing loss alpha * E * sum_i f_i P_i, which
is minimised by uniform routing. (The public MoEP description states an entropy term whose sign, as
written, rewards collapsing onto one path; the balancing loss here is the standard, correctly signed one.)
Top-K token choice without a capacity (dropless) is causal and batch-invariant, at training and evaluation.

The projection experts and the paths are experts of the dispatcher protocol (moe/dispatch.py; paths stacked
[N, ...] by moe/stacked.py), so expert parallelism shards all three stages like FFN experts.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch
from torch import nn

from moep_ds.blocks.base import Block, BlockOutput
from moep_ds.blocks.dense import DenseBlock, DenseBlockConfig
from moep_ds.deferred_init import init_at_construction
from moep_ds.layers.attention import AttentionConfig, KVCache
from moep_ds.layers.ffn import FFNConfig, build_ffn
from moep_ds.layers.norm import NormConfig, build_norm
from moep_ds.layers.routed_attention import RoutedKVCache, RoutedSelfAttention, routed_block_mask, uses_flex
from moep_ds.moe.dispatch import (
    ExpertBatch, ExpertStage, combine_dense, dense_routing, in_token_order, sequence_ids,
)
from moep_ds.moe.grouped_mm import expert_offsets, library_grouped_mm, library_supports
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan, RoutedStage
from moep_ds.moe.shard import mark_expert_rows, normal_
from moep_ds.moe.stacked import StackedExperts, keep_expert_slice_
from moep_ds.registry import BLOCKS, NORMS, ROUTERS
from moep_ds.routing.plan import RoutingPlan
from moep_ds.routing.topk import TopKConfig
from moep_ds.schema import OneOf, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class PathsBlockConfig:
    type: str = "paths"
    repeat: PositiveInt = 1
    # The two full-width layers (a model `flavour` fills these four like a dense block's).
    attention: AttentionConfig
    ffn: FFNConfig = dataclasses.field(default_factory=FFNConfig)
    norm: Annotated[Any, OneOf(NORMS)] = dataclasses.field(default_factory=NormConfig)
    parallel_residual: bool = False
    # false: no leading full-width layer (the block starts at the contraction), so that a recipe can alternate
    # dense blocks and path stages, or let consecutive path stages share one full-width layer.
    full_layer: bool = True
    # The paths.
    d_path: PositiveInt
    num_paths: PositiveInt = 4
    path_depth: PositiveInt = 1
    path_attention: AttentionConfig | None = None  # null: `attention` with its head dim kept (fewer heads)
    path_ffn: FFNConfig | None = None  # null: `ffn` with its default hidden size at d_path
    path_router: Annotated[Any, OneOf(ROUTERS)] = dataclasses.field(default_factory=lambda: TopKConfig(k=1))
    # The contraction and expansion projections.
    num_projection_experts: PositiveInt = 4
    projection_router: Annotated[Any, OneOf(ROUTERS)] = dataclasses.field(default_factory=lambda: TopKConfig(k=1))

    def check_dims(self, path: str, d_model: int) -> None:
        self.attention.check_dims(f"{path}.attention", d_model)
        path_attention = self.resolved_path_attention(d_model, path)
        path_attention.check_dims(f"{path}.path_attention", self.d_path)
        if path_attention.sinks:  # routed attention (layers/routed_attention.py) has no sink column
            where = "path_attention" if self.path_attention is not None else "attention"
            fail(f"{path}.{where}.sinks", True, "is not supported by the paths' routed attention (give path_attention "
                                                "without sinks)")
        if path_attention.output_gate:  # RoutedSelfAttention projects q, k, v alone
            fail(f"{path}.path_attention.output_gate", True, "is not available in path attention")
        for name, router, n in (("path_router", self.path_router, self.num_paths),
                                ("projection_router", self.projection_router, self.num_projection_experts)):
            if hasattr(router, "check_num_experts"):
                router.check_num_experts(f"{path}.{name}", n)

    def routed_stages(self, path: str) -> list[RoutedStage]:
        """The paths, and the projection experts (the contraction's and the expansion's: one count)."""
        return [RoutedStage(f"{path}.{name}", getattr(self, name), getattr(self, name))
                for name in ("num_paths", "num_projection_experts")]

    def resolved_path_attention(self, d_model: int, path: str = "") -> AttentionConfig:
        if self.path_attention is not None:
            return self.path_attention
        head_dim = self.attention.resolved_head_dim(d_model)
        if self.d_path % head_dim:
            problem = f"must be a multiple of the head dim ({head_dim}) when path_attention is not given"
            fail(f"{path}.d_path", self.d_path, problem)
        heads = self.d_path // head_dim
        kv = max(1, heads * self.attention.kv_heads // self.attention.num_heads)
        return dataclasses.replace(self.attention, num_heads=heads, num_kv_heads=kv, head_dim=None)

    def resolved_path_ffn(self) -> FFNConfig:
        return self.path_ffn or dataclasses.replace(self.ffn, hidden_size=None)


class PathLayer(nn.Module):
    """A pre-norm block at the path width whose attention sees only the path's tokens (sequential or
    GPT-NeoX parallel residual, like the full-width layers)."""

    def __init__(self, attention: AttentionConfig, ffn: FFNConfig, norm: NormConfig, d: int, parallel: bool):
        super().__init__()
        self.parallel_residual = parallel
        self.attn_norm = build_norm(norm, d)
        self.attn = RoutedSelfAttention(attention, d)
        self.ffn_norm = build_norm(norm, d)
        self.ffn = build_ffn(ffn, d)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor | None = None, *,
                routed: torch.Tensor | None = None, cache: RoutedKVCache | None = None,
                block_mask: object | None = None) -> torch.Tensor:
        h = self.attn_norm(x)
        a = self.attn(h, seq, pos, block_mask) if cache is None else self.attn.forward_cached(h, routed, pos, cache)
        return self.residual(x, a)

    def residual(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        if self.parallel_residual:
            return x + attn_out + self.ffn(self.ffn_norm(x))
        h = x + attn_out
        return h + self.ffn(self.ffn_norm(h))


class Path(nn.Module):
    """`path_depth` PathLayers: one expert. forward(z_MP, pos_M, seq_M) on the path's tokens (each sequence's
    contiguous, by position); decoding: forward(z_BTP, positions_BT, routed=routed_BT, cache=[per layer])."""

    def __init__(self, cfg: PathsBlockConfig, d_model: int):
        super().__init__()
        attention, ffn = cfg.resolved_path_attention(d_model), cfg.resolved_path_ffn()
        self.layers = nn.ModuleList(
            PathLayer(attention, ffn, cfg.norm, cfg.d_path, cfg.parallel_residual) for _ in range(cfg.path_depth)
        )

    def forward(self, z: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor | None = None, *,
                routed: torch.Tensor | None = None, cache: list[RoutedKVCache] | None = None) -> torch.Tensor:
        block_mask = None  # FlexAttention (CUDA): every layer attends over the same tokens, one mask for all
        if cache is None and z.shape[0] > 0 and uses_flex(z):
            block_mask = routed_block_mask(seq, pos, self.layers[0].attn.cfg.window)
        for i, layer in enumerate(self.layers):
            z = layer(z, pos, seq, routed=routed, cache=None if cache is None else cache[i], block_mask=block_mask)
        return z


class LinearExperts(ExpertStage):
    """E bias-free linear maps w_EOI (I -> O); each token's output is the gated sum over its experts."""

    def __init__(self, num_experts: int, d_in: int, d_out: int, active_experts_per_token: float,
                 residual_output: bool, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__(num_experts, plan)
        held = plan.held(num_experts)  # all of them on one process
        self.w_EOI = mark_expert_rows(nn.Parameter(torch.empty(len(held), d_out, d_in)), held.start, num_experts)
        self.num_local_experts = len(held)
        self.active_share = active_experts_per_token / num_experts
        self.residual_output = residual_output
        self.use_library = True  # False: the per-expert matmuls (tests compare the two)
        if not self.w_EOI.is_meta and init_at_construction():
            self.init_weights(std=0.02)

    @property
    def experts(self) -> LinearExperts:  # every parameter here is an expert's
        return self

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        """Normal(0, std) like a linear layer; std * out_scale when the output is added to the residual stream."""
        normal_(self.w_EOI, std=std * out_scale if self.residual_output else std)

    def forward(self, x_TI: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return self.dispatch(x_TI, plan)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        """Expert e's rows times w_EOI[e]^T: torch's grouped GEMM where it takes the operands (on the device's
        counts: no copy to the host), else one matmul per expert (the reference)."""
        self.check_batch(batch)
        w_EIO = self.w_EOI.transpose(1, 2)
        if self.use_library and library_supports(batch.x_SD, w_EIO):
            offs_E = expert_offsets(batch.device_or_known_counts(), batch.x_SD.device)
            return library_grouped_mm(batch.x_SD, w_EIO, offs_E)
        x_EMI = batch.x_SD.split(batch.counts)
        return torch.cat([x_MI @ w_OI.t() for x_MI, w_OI in zip(x_EMI, self.w_EOI.unbind(0))])

    def keep_experts_(self, start: int, count: int) -> None:
        keep_expert_slice_(self, start, count, self.num_local_experts)
        self.num_local_experts = count

    def num_active_params(self) -> int:
        return round(self.active_share * self.w_EOI.numel())


class ParallelPaths(ExpertStage):
    """y = z + sum over a token's top-K paths j of p_j (Path_j(z) - z); the paths are experts, stacked [N, ...]."""

    def __init__(self, cfg: PathsBlockConfig, d_model: int, active_experts_per_token: float,
                 plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__(cfg.num_paths, plan)
        self.paths = StackedExperts.build(lambda: Path(cfg, d_model), cfg.num_paths, plan)
        self.active_share = active_experts_per_token / cfg.num_paths
        for layer in self.paths.expert.layers:
            layer.attn.token_share = self.active_share

    @property
    def experts(self) -> StackedExperts:
        return self.paths

    def forward(self, z_BTP: torch.Tensor, plan: RoutingPlan, positions_BT: torch.Tensor) -> torch.Tensor:
        B, T, P = z_BTP.shape
        z_TP = z_BTP.reshape(B * T, P)
        delta_TP = self.dispatch(z_TP, in_token_order(plan), sequence_ids(B, T, z_BTP.device), positions_BT.reshape(-1))
        return (z_TP + delta_TP).view(B, T, P)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        """Path_j(z) - z on path j's tokens."""
        self.check_batch(batch)
        counts = batch.counts  # the paths run one after another: Python ints (a copy to the host unless known)
        parts = zip(batch.x_SD.split(counts), batch.positions_S.split(counts), batch.seq_ids_S.split(counts),
                    self.paths.per_expert())
        return torch.cat([self.paths.call(p, z, pos, seq) - z for z, pos, seq, p in parts])

    def forward_cached(self, z_BTP, plan: RoutingPlan, positions_BT, caches: list[list[RoutedKVCache]]):
        """Decoding: every new token runs through every path held here against its caches; unrouted ones get 0;
        with sharded paths the ranks' shares are summed (`Dispatcher.sum_over_ranks`)."""
        B, T, _ = z_BTP.shape
        routed_EBT, weight_EBT = (m[self.held()] for m in dense_routing(plan, B, T))
        delta_EBTP = [self.paths.call(p, z_BTP, positions_BT, routed=routed, cache=cache) - z_BTP
                      for p, routed, cache in zip(self.paths.per_expert(), routed_EBT, caches)]
        return z_BTP + self.dispatcher.sum_over_ranks(combine_dense(delta_EBTP, routed_EBT, weight_EBT))

    def new_caches(self) -> list[list[RoutedKVCache]]:
        """One per layer of every path held here."""
        return [[layer.attn.new_cache() for layer in self.paths.expert.layers]
                for _ in range(self.paths.num_local_experts)]

    def num_active_params(self) -> int:
        return round(self.active_share * self.num_experts * self.paths.params_per_expert())

    def attention_flop_terms(self, seq_len: int) -> list[float]:
        """Every path's layers (token_share of the router's active paths, set on the shared attention)."""
        one_path = [layer.attn.attention_flops_per_token(seq_len) for layer in self.paths.expert.layers]
        return one_path * self.num_experts


@dataclasses.dataclass
class PathsCache:
    pre: KVCache | None
    paths: list[list[RoutedKVCache]]  # [path][layer]
    post: KVCache


@BLOCKS.register("paths", config=PathsBlockConfig)
class PathsBlock(Block):
    def __init__(self, cfg: PathsBlockConfig, *, d_model: int, layer_idx: int,
                 plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        full = DenseBlockConfig(
            attention=cfg.attention, ffn=cfg.ffn, norm=cfg.norm, parallel_residual=cfg.parallel_residual
        )
        E = cfg.num_projection_experts
        self.pre = DenseBlock(full, d_model=d_model, layer_idx=layer_idx) if cfg.full_layer else None
        self.contract_norm = build_norm(cfg.norm, d_model)
        self.contract_router = ROUTERS.build(cfg.projection_router, d_model=d_model, num_experts=E)
        active = self.contract_router.active_experts_per_token()  # the expansion's router has the same config
        self.contract = LinearExperts(E, d_model, cfg.d_path, active, residual_output=False, plan=plan)
        self.path_norm = build_norm(cfg.norm, cfg.d_path)
        self.path_router = ROUTERS.build(cfg.path_router, d_model=cfg.d_path, num_experts=cfg.num_paths)
        self.paths = ParallelPaths(cfg, d_model, self.path_router.active_experts_per_token(), plan)
        self.expand_norm = build_norm(cfg.norm, cfg.d_path)
        self.expand_router = ROUTERS.build(cfg.projection_router, d_model=cfg.d_path, num_experts=E)
        self.expand = LinearExperts(E, cfg.d_path, d_model, active, residual_output=True, plan=plan)
        self.post = DenseBlock(full, d_model=d_model, layer_idx=layer_idx)

    def forward(self, x_BTD: torch.Tensor, *, positions_BT: torch.Tensor, cache: Any = None) -> BlockOutput:
        B, T, D = x_BTD.shape
        h1_BTD = x_BTD
        if self.pre is not None:
            h1_BTD = self.pre(x_BTD, positions_BT=positions_BT, cache=None if cache is None else cache.pre).x
        c_BTD = self.contract_norm(h1_BTD)
        contract_plan = self.contract_router(c_BTD)
        z_BTP = self.contract(c_BTD.reshape(B * T, D), contract_plan).view(B, T, -1)
        path_plan = self.path_router(self.path_norm(z_BTP))
        if cache is None:
            y_BTP = self.paths(z_BTP, path_plan, positions_BT)
        else:
            y_BTP = self.paths.forward_cached(z_BTP, path_plan, positions_BT, cache.paths)
        u_BTP = self.expand_norm(y_BTP)
        expand_plan = self.expand_router(u_BTP)
        h2_BTD = h1_BTD + self.expand(u_BTP.reshape(B * T, -1), expand_plan).view(B, T, D)
        out = self.post(h2_BTD, positions_BT=positions_BT, cache=None if cache is None else cache.post)
        plans = {"contraction": contract_plan, "paths": path_plan, "expansion": expand_plan}
        aux = {f"{name}.{k}": v for name, plan in plans.items() for k, v in plan.aux_losses.items()}
        stats = {f"{name}.{k}": v for name, plan in plans.items() for k, v in plan.stats.items()}
        return BlockOutput(out.x, aux, stats)

    def new_cache(self) -> PathsCache:
        return PathsCache(None if self.pre is None else KVCache(), self.paths.new_caches(), KVCache())


__all__ = ["PathsBlockConfig", "PathsBlock", "PathLayer", "Path", "ParallelPaths", "LinearExperts", "PathsCache"]
