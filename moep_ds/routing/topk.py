"""Top-k token-choice routing (GShard / Switch / DeepSpeed style): each token picks its k best experts.

# T tokens (B*T flattened), D model dim, E experts, K experts per token, A = T*K assignments, S kept ones

    logits l = x W_r^T (fp32; in training x may be jittered by U(1-eps, 1+eps), Switch Transformer)
    p = softmax_E(l); each token takes its K largest p (weights p, optionally renormalised over the K)
    load balancing (Switch eq. 4, batch-local):  alpha * E * sum_i f_i P_i,
        f_i = share of the T*K assignments that chose expert i, P_i = mean_t p[t, i]
        (normalised by K so that a uniform router gives exactly alpha for any K)
    router z-loss (ST-MoE eq. 5):  beta * mean_t (logsumexp_i l[t, i])^2
    capacity_factor null: dropless; else each expert keeps at most ceil(cf T K / E) tokens, those of highest p
"""
from __future__ import annotations

import dataclasses
from typing import Annotated

import torch

from moep_ds.registry import ROUTERS
from moep_ds.routing.lifecycle import ExpertLifecycle, LifecycleConfig
from moep_ds.routing.plan import RoutingPlan, exact_ratio, expert_counts, round_ratio, routing_stats
from moep_ds.routing.router import Router
from moep_ds.schema import Between, NonNegativeFloat, PositiveFloat, PositiveInt, fail


@dataclasses.dataclass(kw_only=True)
class TopKConfig:
    type: str = "topk"
    k: PositiveInt = 2
    renormalize: bool = False  # weights sum to 1 over the k chosen experts (Mixtral)
    load_balancing_weight: NonNegativeFloat = 0.01  # alpha
    z_loss_weight: NonNegativeFloat = 0.0  # beta
    jitter: Annotated[float, Between(0.0, 1.0, hi_open=True)] = 0.0  # eps of the multiplicative input noise
    capacity_factor: PositiveFloat | None = None  # null: dropless
    lifecycle: LifecycleConfig | None = None  # MoE-Stream expert lifecycle manager (routing/lifecycle.py)

    def check_num_experts(self, path: str, num_experts: int) -> None:
        if self.k > num_experts:
            fail(f"{path}.k", self.k, f"must be <= num_experts ({num_experts})")


def topk_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """ceil(cf T K / E), at least 1 and at most T (a token picks an expert at most once)."""
    return topk_capacity_from_ratio(num_tokens, num_experts, k, exact_ratio(capacity_factor))


def topk_capacity_from_ratio(num_tokens: int, num_experts: int, k: int, ratio: tuple[int, int]) -> int:
    """topk_capacity for cf = ratio[0] / ratio[1] (`exact_ratio`), in integers."""
    p, q = ratio
    return min(max(round_ratio(p * num_tokens * k, q * num_experts, "ceil"), 1), num_tokens)


def topk_gates(probs_TE: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """weights_TK (the chosen probabilities, optionally renormalised) and experts_TK."""
    top_TK, experts_TK = probs_TE.topk(k, dim=-1)
    if renormalize:
        top_TK = top_TK / top_TK.sum(-1, keepdim=True)
    return top_TK, experts_TK


def load_balancing_loss(probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i P_i (unweighted); f counts assignments before any capacity drop."""
    T, E = probs_TE.shape
    f_E = expert_counts(experts_TK, E).to(probs_TE.dtype) / experts_TK.numel()
    P_E = probs_TE.mean(0)
    return E * (f_E * P_E).sum()


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(l_t)^2 (unweighted): keeps router logits small so the softmax stays well-conditioned."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def assign_tokens(
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*K assignments by expert; beyond `capacity` drop an expert's least probable tokens.

    Returns token_idx_S, weight_S, counts_E (see RoutingPlan).
    """
    T, K = experts_TK.shape
    expert_A = experts_TK.reshape(-1)
    counts_E = expert_counts(expert_A, num_experts)
    if capacity is None:
        order_A = torch.argsort(expert_A, stable=True)  # token order within each expert
        return order_A // K, weights_TK.reshape(-1)[order_A], counts_E
    by_prob_A = torch.argsort(probs_TK.reshape(-1), descending=True, stable=True)
    order_A = by_prob_A[torch.argsort(expert_A[by_prob_A], stable=True)]  # by expert, then most probable first
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_A = torch.arange(T * K, device=expert_A.device) - starts_E.repeat_interleave(counts_E, output_size=T * K)
    order_S = order_A[rank_A < capacity]
    return order_S // K, weights_TK.reshape(-1)[order_S], counts_E.clamp(max=capacity)


@ROUTERS.register("topk", config=TopKConfig)
class TopKRouter(Router):
    def __init__(self, cfg: TopKConfig, *, d_model: int, num_experts: int):
        super().__init__(d_model=d_model, num_experts=num_experts)
        cfg.check_num_experts("router", num_experts)
        self.cfg = cfg
        self.capacity_ratio = None if cfg.capacity_factor is None else exact_ratio(cfg.capacity_factor)
        self.lifecycle = None if cfg.lifecycle is None else ExpertLifecycle(cfg.lifecycle, num_experts)

    def active_experts_per_token(self) -> int:
        return self.cfg.k

    def forward(self, x_BTD: torch.Tensor) -> RoutingPlan:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        if self.training and self.cfg.jitter > 0:
            eps = self.cfg.jitter
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
        logits_TE = self.logits(x_TD)
        if self.lifecycle is None:
            return self.plan_from_logits(logits_TE)
        plan = self.plan_from_logits(self.lifecycle.bias_logits(logits_TE))
        self.lifecycle.count_routed_tokens(plan.counts_E)
        return plan

    def plan_from_logits(self, logits_TE: torch.Tensor) -> RoutingPlan:
        """The plan for given logits (a lifecycle manager adds its exploration biases before this)."""
        cfg, T = self.cfg, logits_TE.shape[0]
        probs_TE = torch.softmax(logits_TE, dim=-1)
        weights_TK, experts_TK = topk_gates(probs_TE, cfg.k, cfg.renormalize)
        capacity = None
        if cfg.capacity_factor is not None:
            capacity = topk_capacity_from_ratio(T, self.num_experts, cfg.k, self.capacity_ratio)
        probs_TK = probs_TE.detach().gather(1, experts_TK)
        token_idx_S, weight_S, counts_E = assign_tokens(experts_TK, weights_TK, probs_TK, self.num_experts, capacity)
        aux_losses = {}
        if cfg.load_balancing_weight > 0:
            aux_losses["load_balancing_loss"] = cfg.load_balancing_weight * load_balancing_loss(probs_TE, experts_TK)
        if cfg.z_loss_weight > 0:
            aux_losses["router_z_loss"] = cfg.z_loss_weight * router_z_loss(logits_TE)
        stats = routing_stats(logits_TE, token_idx_S, counts_E)
        return RoutingPlan(token_idx_S, weight_S, counts_E, T, aux_losses=aux_losses, stats=stats)


__all__ = [
    "TopKConfig",
    "TopKRouter",
    "assign_tokens",
    "load_balancing_loss",
    "router_z_loss",
    "topk_capacity",
    "topk_capacity_from_ratio",
    "topk_gates",
]
