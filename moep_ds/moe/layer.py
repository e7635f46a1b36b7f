"""The MoE layer: router -> dispatcher -> grouped experts -> weighted combine.

# B batch, T tokens per sequence, D model dim, E experts

    plan = router(x)                       (which tokens each expert processes, combine weights, aux losses)
    y    = dispatcher(x, plan, experts)    (local, or all-to-all across an expert-parallel group)

Expert parallelism is applied from outside (the trainer): `shard_experts(layer, ep_rank, ep_size)` keeps this
rank's experts and `layer.set_dispatcher(AllToAllDispatcher(group, layer.num_experts))` moves tokens to them.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.dispatch import ExpertBatch, ExpertStage, shard_experts
from moep_ds.moe.experts import EXPERT_ACTIVATIONS, GroupedExperts
from moep_ds.registry import FFNS, ROUTERS
from moep_ds.schema import OneOf, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    num_experts: PositiveInt
    expert: Annotated[Any, OneOf(FFNS, default="swiglu")] = dataclasses.field(default_factory=FFNConfig)
    router: Annotated[Any, OneOf(ROUTERS)]

    def validate(self, path: str) -> None:
        if self.expert.type not in EXPERT_ACTIVATIONS:
            fail(f"{path}.expert.type", self.expert.type, f"must be one of {', '.join(EXPERT_ACTIVATIONS)} for experts")
        if hasattr(self.router, "check_num_experts"):
            self.router.check_num_experts(f"{path}.router", self.num_experts)

    def check_expert_parallel(self, path: str, expert_parallel_size: int) -> None:
        if self.num_experts % expert_parallel_size:
            problem = f"must be divisible by expert_parallel_size ({expert_parallel_size})"
            fail(f"{path}.num_experts", self.num_experts, problem)


@dataclasses.dataclass
class MoEOutput:
    y: torch.Tensor  # [B, T, D]
    aux_losses: dict[str, torch.Tensor]
    stats: dict[str, torch.Tensor]


class MoELayer(ExpertStage):
    """Router + dispatcher + experts. `.experts` holds only expert parameters (`num_local_experts` of them)."""

    def __init__(self, cfg: MoEConfig, *, d_model: int):
        super().__init__(cfg.num_experts)
        self.router = ROUTERS.build(cfg.router, d_model=d_model, num_experts=cfg.num_experts)
        self.experts = GroupedExperts(cfg.expert, d_model=d_model, num_experts=cfg.num_experts)

    def forward(self, x_BTD: torch.Tensor) -> MoEOutput:
        B, T, D = x_BTD.shape
        plan = self.router(x_BTD)
        y_TD = self.dispatch(x_BTD.reshape(B * T, D), plan)
        return MoEOutput(y_TD.view(B, T, D), plan.aux_losses, plan.stats)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        self.check_batch(batch)
        y_SD = self.experts(batch.x_SD, batch.counts)
        lifecycle = getattr(self.router, "lifecycle", None)  # MoE-Stream: expert impact (routing/lifecycle.py)
        return y_SD if lifecycle is None else lifecycle.track_impact(y_SD, batch.counts)

    def num_active_params(self) -> int:
        """Router parameters + experts active per token (the router says how many) x parameters of one expert."""
        router = sum(p.numel() for p in self.router.parameters())
        return router + self.router.active_experts_per_token() * self.experts.params_per_expert()

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_scale)


__all__ = ["MoEConfig", "MoELayer", "MoEOutput", "shard_experts"]
