"""The MoE layer: router -> dispatcher -> grouped experts -> weighted combine.

# B batch, T tokens per sequence, D model dim, E experts

    plan = router(x)                       (which tokens each expert processes, combine weights, aux losses)
    y    = dispatcher(x, plan, experts)    (local, or all-to-all across an expert-parallel group)
    y    = shared.combine(y, x)            (with `shared_expert`: an always-active FFN beside them, moe/shared.py;
                                            computed between dispatcher.start and .finish, while tokens travel)

Expert parallelism comes with the plan the layer is built with (moe/plan.py): `MoELayer(cfg, d_model=D,
plan=plan)` holds this rank's experts only (`shard_experts(layer, plan)` cuts a layer built with every expert down
to them), and `layer.set_dispatcher(AllToAllDispatcher(plan, layer.num_experts))` moves tokens to them.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import torch

from moep_ds.layers.ffn import FFNConfig
from moep_ds.moe.dispatch import ExpertBatch, ExpertStage, shard_experts
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan, RoutedStage
from moep_ds.moe.experts import EXPERT_TYPES, GroupedExperts
from moep_ds.moe.shard import full_shape
from moep_ds.moe.shared import SharedExpert, SharedExpertConfig
from moep_ds.registry import FFNS, ROUTERS
from moep_ds.routing.plan import RoutingPlan
from moep_ds.routing.lifecycle import ExpertLifecycle, ExpertRows, LifecycleConfig, LifecycleManaged
from moep_ds.schema import ConfigError, OneOf, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
    num_experts: PositiveInt
    expert: Annotated[Any, OneOf(FFNS, default="swiglu")] = dataclasses.field(default_factory=FFNConfig)
    router: Annotated[Any, OneOf(ROUTERS)]
    shared_expert: SharedExpertConfig | None = None  # an always-active FFN beside the routed experts

    def validate(self, path: str) -> None:
        if self.expert.type not in EXPERT_TYPES:
            fail(f"{path}.expert.type", self.expert.type, f"must be one of {', '.join(EXPERT_TYPES)} for experts")
        if hasattr(self.router, "check_num_experts"):
            self.router.check_num_experts(f"{path}.router", self.num_experts)

    def routed_stages(self, path: str) -> list[RoutedStage]:
        return [RoutedStage(f"{path}.num_experts", self.num_experts, self.num_experts)]


@dataclasses.dataclass
class MoEOutput:
    y: torch.Tensor  # [B, T, D]
    aux_losses: dict[str, torch.Tensor]
    stats: dict[str, torch.Tensor]


class MoELayer(ExpertStage, LifecycleManaged):
    """Router + dispatcher + experts. `.experts` holds only expert parameters (`num_local_experts` of them).

    A router with a lifecycle manager (MoE-Stream) makes this layer a managed one: the manager sees the expert
    outputs (`track_impact`) and the trainer's lifecycle callback rewrites `expert_rows()` on replacement."""

    def __init__(self, cfg: MoEConfig, *, d_model: int, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__(cfg.num_experts, plan)
        self.router = ROUTERS.build(cfg.router, d_model=d_model, num_experts=cfg.num_experts)
        self.experts = GroupedExperts(cfg.expert, d_model=d_model, num_experts=cfg.num_experts, plan=plan)
        self.shared = None
        if cfg.shared_expert is not None:
            self.shared = SharedExpert(cfg.shared_expert, cfg.expert, d_model=d_model)

    def forward(self, x_BTD: torch.Tensor) -> MoEOutput:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        plan = self.router(x_BTD)
        pending = self.dispatcher.start(x_TD, plan, self.run_experts)
        # the shared expert needs no routed output: it computes while the first chunk's tokens travel
        shared = None if self.shared is None else self.shared.compute(x_TD)
        y_TD = self.dispatcher.finish(pending)
        if shared is not None:
            y_TD = self.shared.mix(y_TD, shared)
        stats = plan.stats
        if self.experts.num_local_experts < self.num_experts:  # expert parallelism: how far tokens travel
            stats = {**stats, "destination_ranks": destination_ranks(plan, self.experts.num_local_experts)}
        return MoEOutput(y_TD.view(B, T, D), plan.aux_losses, stats)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        self.check_batch(batch)
        counts = batch.device_or_known_counts()  # data-dependent loads stay on the device (library kernel)
        y_SD = self.experts(batch.x_SD, counts)
        lifecycle = self.expert_lifecycle()
        return y_SD if lifecycle is None else lifecycle.track_impact(y_SD, counts, self.first_local_expert)

    def expert_lifecycle(self) -> ExpertLifecycle | None:
        return self.router.lifecycle

    def expert_rows(self) -> ExpertRows:
        """Every stacked expert weight (this rank's experts) and the router weight's rows (all experts)."""
        router_rows = [p for p in self.router.parameters() if full_shape(p)[:1] == (self.num_experts,)]
        return ExpertRows(list(self.experts.parameters()), router_rows,
                          self.first_local_expert, self.experts.num_local_experts)

    def reset_expert(self, expert: int) -> None:
        """A replaced expert starts with fresh statistics and without loss-free balancing bias."""
        super().reset_expert(expert)
        if getattr(self.router, "balancer", None) is not None:
            self.router.balancer.reset_expert(expert)

    def num_active_params(self) -> int:
        """Router parameters + experts active per token (the router says how many) x parameters of one expert
        + the shared expert and its gate (always active)."""
        router = sum(p.numel() for p in self.router.parameters())
        shared = 0 if self.shared is None else sum(p.numel() for p in self.shared.parameters())
        return router + self.router.active_experts_per_token() * self.experts.params_per_expert() + shared

    @torch.no_grad()
    def init_weights(self, std: float, out_scale: float = 1.0) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_scale)


@torch.no_grad()
def destination_ranks(plan: RoutingPlan, experts_per_rank: int) -> torch.Tensor:
    """Mean over tokens of the number of distinct expert-parallel ranks a token is sent to (experts stored
    `experts_per_rank` to a rank, in order); group-limited routing bounds it (DeepSeek's node-limited routing)."""
    num_ranks = plan.num_experts // experts_per_rank
    rank_S = plan.expert_idx_S() // experts_per_rank
    hit_TR = torch.zeros(plan.num_tokens, num_ranks, dtype=torch.bool, device=rank_S.device)
    hit_TR[plan.token_idx_S, rank_S] = True
    return hit_TR.sum(1).float().mean()


def check_lifecycle_placement(cfg: Any, path: str) -> None:
    """A lifecycle manager needs a layer that shows it its expert outputs and lets it rewrite its experts:
    only an MoE layer's router (`...moe.router.lifecycle`) may carry one. Fails on any other, e.g. an MSIT
    or MoEP-paths router; walks dataclasses and lists under `cfg`."""
    if isinstance(cfg, MoEConfig):
        return  # its router's lifecycle is served; MoE layers nest no routers elsewhere
    if isinstance(cfg, LifecycleConfig):
        raise ConfigError(f"{path} is set, but an expert lifecycle manager works only on the router of an MoE layer "
                          "(moe.router.lifecycle of an ffn_moe or ssm_moe block); remove it here")
    if dataclasses.is_dataclass(cfg):
        for field in dataclasses.fields(cfg):
            check_lifecycle_placement(getattr(cfg, field.name), f"{path}.{field.name}")
    elif isinstance(cfg, list):
        for i, item in enumerate(cfg):
            check_lifecycle_placement(item, f"{path}[{i}]")


__all__ = ["MoEConfig", "MoELayer", "MoEOutput", "SharedExpertConfig", "check_lifecycle_placement", "destination_ranks",
           "full_shape", "shard_experts"]
