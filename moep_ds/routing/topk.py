"""Top-k token-choice routing (GShard / Switch / DeepSpeed / DeepSeek / Qwen style): each token picks its k best
experts.

# T tokens (B*T flattened), B sequences, D model dim, E experts, K experts per token, G expert groups,
# M groups kept per token, A = T*K assignments, S kept ones

    logits l = x W_r^T (fp32; in training x may be jittered by U(1-eps, 1+eps), Switch Transformer); with
               logits_dtype input in x's dtype, then fp32 (transformers' Mixtral, Qwen-MoE and OLMoE routers: a bf16
               model's bf16 logits; DeepSeek-V3's are fp32); with `bias` l = x W_r^T + b_r (gpt-oss)
    scores s = softmax_E(l)  (score: softmax)   or   s = sigmoid(l)  (score: sigmoid, DeepSeek-V3 eq. 15)
    choice c = s + b  with b the loss-free balancing bias (routing/balancing.py; selection only, DeepSeek-V3
               eq. 16), 0 without it
    group-limited (num_groups G > 1, DeepSeek-V3's node-limited routing): each group's score is the sum of its
               two largest c (group_score: top2_sum, DeepSeek-V3) or its largest c (max, DeepSeek-V2's
               group_limited_greedy); a token keeps its top-M groups (group_topk) and chooses among their experts only
    each token takes the K largest c; weights g = s of the chosen (unbiased), optionally renormalised over the K
               (g / sum g), times scaling_factor (DeepSeek-V3's routed_scaling_factor)
    load balancing (Switch eq. 4):  alpha * E * sum_i f_i P_i,
        f_i = share of the T*K assignments of an unbiased top-K of s over all experts that go to expert i
              (normalised by K so that a uniform router gives exactly alpha for any K): without the selection
              bias and the group limit, as DeepSeek-V3 eq. 18 and Megatron-Core's
              compute_routing_scores_for_aux_loss; the same as the choice when neither is set),
        P_i = mean_t p[t, i] with p = s / sum_E s (= s for softmax)
        scope micro_batch: f and P over the micro-batch; sequence: per sequence, averaged over the B sequences
        (DeepSeek-V3's complementary sequence-wise loss, eq. 17-20); global: f from the counts summed over the
        data-parallel ranks (Qwen's global-batch balancing), P local
    router z-loss (ST-MoE eq. 5):  beta * mean_t (logsumexp_i l[t, i])^2
    capacity_factor null: dropless; else each expert keeps at most ceil(cf T K / E) tokens: those of highest s
        (drop_policy: probability) or the earliest in the micro-batch (drop_policy: position; Megatron-Core's
        moe_token_drop_policy)
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Callable, Literal

import torch
import torch.nn.functional as F

from moep_ds.registry import ROUTERS
from moep_ds.routing.balancing import ExpertBias
from moep_ds.routing.lifecycle import ExpertLifecycle, LifecycleConfig
from moep_ds.routing.plan import RoutingPlan, exact_ratio, expert_counts, round_ratio, routing_stats
from moep_ds.routing.router import Router, routing_dtype
from moep_ds.schema import Between, NonNegativeFloat, PositiveFloat, PositiveInt, fail

# sums a vector over the data-parallel ranks (installed by the trainer for load_balancing_scope: global)
CountReducer = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(kw_only=True)
class TopKConfig:
    type: str = "topk"
    k: PositiveInt = 2
    score: Literal["softmax", "sigmoid"] = "softmax"
    logits_dtype: Literal["float32", "input"] = "float32"  # the matmul's precision (module docstring)
    bias: bool = False  # a learned bias [E] on the logits (gpt-oss's router)
    renormalize: bool = False  # weights sum to 1 over the k chosen experts (Mixtral, DeepSeek-V3's norm_topk_prob)
    scaling_factor: PositiveFloat = 1.0  # weights times this (DeepSeek-V3's routed_scaling_factor)
    bias_update_rate: NonNegativeFloat | None = None  # u of loss-free balancing; null: no selection bias
    num_groups: PositiveInt = 1  # G: group-limited routing when > 1
    group_topk: PositiveInt | None = None  # M groups each token may use; null: all G
    group_score: Literal["top2_sum", "max"] = "top2_sum"  # a group's score: DeepSeek-V3's, or DeepSeek-V2's
    load_balancing_weight: NonNegativeFloat = 0.01  # alpha
    load_balancing_scope: Literal["micro_batch", "sequence", "global"] = "micro_batch"
    z_loss_weight: NonNegativeFloat = 0.0  # beta
    jitter: Annotated[float, Between(0.0, 1.0, hi_open=True)] = 0.0  # eps of the multiplicative input noise
    capacity_factor: PositiveFloat | None = None  # null: dropless
    drop_policy: Literal["probability", "position"] = "probability"  # which tokens an over-full expert keeps
    lifecycle: LifecycleConfig | None = None  # MoE-Stream expert lifecycle manager (routing/lifecycle.py)

    def validate(self, path: str) -> None:
        if self.group_topk is not None and self.group_topk > self.num_groups:
            fail(f"{path}.group_topk", self.group_topk, f"must be <= num_groups ({self.num_groups})")

    def check_num_experts(self, path: str, num_experts: int) -> None:
        self.validate(path)  # also for a config built in code, not parsed
        if self.k > num_experts:
            fail(f"{path}.k", self.k, f"must be <= num_experts ({num_experts})")
        if num_experts % self.num_groups:
            fail(f"{path}.num_groups", self.num_groups, f"must divide num_experts ({num_experts})")
        reachable = self.kept_groups() * (num_experts // self.num_groups)
        if self.k > reachable:
            fail(f"{path}.k", self.k, f"must be <= the experts of the group_topk ({self.kept_groups()}) groups a "
                                      f"token may use ({reachable})")

    def kept_groups(self) -> int:
        return self.num_groups if self.group_topk is None else self.group_topk


def topk_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """ceil(cf T K / E), at least 1 and at most T (a token picks an expert at most once)."""
    return topk_capacity_from_ratio(num_tokens, num_experts, k, exact_ratio(capacity_factor))


def topk_capacity_from_ratio(num_tokens: int, num_experts: int, k: int, ratio: tuple[int, int]) -> int:
    """topk_capacity for cf = ratio[0] / ratio[1] (`exact_ratio`), in integers."""
    p, q = ratio
    return min(max(round_ratio(p * num_tokens * k, q * num_experts, "ceil"), 1), num_tokens)


def router_scores(logits_TE: torch.Tensor, score: str) -> torch.Tensor:
    """s = softmax over experts, or an independent sigmoid per expert (DeepSeek-V3)."""
    if score == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score ({score!r}) must be 'softmax' or 'sigmoid'")


def score_distribution(scores_TE: torch.Tensor, score: str) -> torch.Tensor:
    """p: the scores as a distribution over experts per token (softmax already is one; sigmoid scores are
    normalised by their sum, DeepSeek-V3 eq. 19)."""
    return scores_TE if score == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)


def group_limited_mask(choice_TE: torch.Tensor, num_groups: int, group_topk: int,
                       group_score: str = "top2_sum") -> torch.Tensor:
    """[T, E] bool: the experts of each token's top-M groups, a group scored by the sum of its two largest
    choice scores (its one score if it has one expert), as DeepSeek-V3, or by its largest (`max`, DeepSeek-V2)."""
    T, E = choice_TE.shape
    per_group = E // num_groups
    group_TGN = choice_TE.view(T, num_groups, per_group)
    if group_score == "max":
        group_score_TG = group_TGN.amax(dim=-1)
    else:
        group_score_TG = group_TGN.topk(min(2, per_group), dim=-1).values.sum(-1)
    kept_TM = group_score_TG.topk(group_topk, dim=-1).indices
    keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, kept_TM, True)
    return keep_TG.unsqueeze(-1).expand(T, num_groups, per_group).reshape(T, E)


def select_experts(
    scores_TE: torch.Tensor,
    k: int,
    bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    group_topk: int | None = None,
    group_score: str = "top2_sum",
) -> torch.Tensor:
    """experts_TK: each token's K largest choice scores s + b, within its top-M groups when grouped."""
    choice_TE = scores_TE.detach() if bias_E is None else scores_TE.detach() + bias_E.to(scores_TE.dtype)
    if num_groups > 1 and group_topk is not None and group_topk < num_groups:
        keep_TE = group_limited_mask(choice_TE, num_groups, group_topk, group_score)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    return choice_TE.topk(k, dim=-1).indices


def topk_weights(
    scores_TE: torch.Tensor, experts_TK: torch.Tensor, renormalize: bool, scaling_factor: float = 1.0
) -> torch.Tensor:
    """weights_TK: the chosen experts' (unbiased) scores, optionally renormalised over the K, times the factor."""
    weights_TK = scores_TE.gather(1, experts_TK)
    if renormalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK * scaling_factor if scaling_factor != 1.0 else weights_TK


def topk_gates(probs_TE: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """weights_TK (the chosen probabilities, optionally renormalised) and experts_TK."""
    top_TK, experts_TK = probs_TE.topk(k, dim=-1)
    if renormalize:
        top_TK = top_TK / top_TK.sum(-1, keepdim=True)
    return top_TK, experts_TK


def load_balancing_loss(
    probs_TE: torch.Tensor, experts_TK: torch.Tensor, global_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """E * sum_i f_i P_i (unweighted); f counts assignments before any capacity drop.

    global_counts: [E + 1] assignments per expert and their total, summed over the data-parallel ranks (scope
    global): f is then the global share, P stays this micro-batch's mean."""
    T, E = probs_TE.shape
    if global_counts is None:
        f_E = expert_counts(experts_TK, E).to(probs_TE.dtype) / experts_TK.numel()
    else:
        f_E = (global_counts[:E] / global_counts[E]).to(probs_TE.dtype)
    P_E = probs_TE.mean(0)
    return E * (f_E * P_E).sum()


def sequence_load_balancing_loss(probs_TE: torch.Tensor, experts_TK: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """The loss of each sequence on its own (f and P over its tokens), averaged over the B sequences
    (DeepSeek-V3's complementary sequence-wise balance loss)."""
    T, E = probs_TE.shape
    B, K = num_sequences, experts_TK.shape[1]
    experts_BA = experts_TK.reshape(B, -1)
    counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_BE.scatter_add_(1, experts_BA, torch.ones_like(experts_BA, dtype=probs_TE.dtype))
    f_BE = counts_BE / experts_BA.shape[1]
    P_BE = probs_TE.reshape(B, T // B, E).mean(1)
    return E * (f_BE * P_BE).sum(-1).mean()


def jitter(x_TD: torch.Tensor, eps: float) -> torch.Tensor:
    """x times noise drawn uniformly from [1 - eps, 1 + eps] per element, in the router's fp32 (Switch Transformer's
    router jitter, as transformers' SwitchTransformersTop1Router applies it)."""
    return x_TD * torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(l_t)^2 (unweighted): keeps router logits small so the softmax stays well-conditioned."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def assign_tokens(
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    probs_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: str = "probability",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*K assignments by expert; beyond `capacity` drop an expert's least probable tokens
    (drop_policy probability) or its latest tokens (position).

    Returns token_idx_S, weight_S, counts_E (see RoutingPlan).
    """
    T, K = experts_TK.shape
    expert_A = experts_TK.reshape(-1)
    counts_E = expert_counts(expert_A, num_experts)
    if capacity is None or drop_policy == "position":
        order_A = torch.argsort(expert_A, stable=True)  # token order within each expert
        if capacity is None:
            return order_A // K, weights_TK.reshape(-1)[order_A], counts_E
    elif drop_policy == "probability":
        by_prob_A = torch.argsort(probs_TK.reshape(-1), descending=True, stable=True)
        order_A = by_prob_A[torch.argsort(expert_A[by_prob_A], stable=True)]  # by expert, then most probable first
    else:
        raise ValueError(f"drop_policy ({drop_policy!r}) must be 'probability' or 'position'")
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_A = torch.arange(T * K, device=expert_A.device) - starts_E.repeat_interleave(counts_E, output_size=T * K)
    order_S = order_A[rank_A < capacity]
    return order_S // K, weights_TK.reshape(-1)[order_S], counts_E.clamp(max=capacity)


@ROUTERS.register("topk", config=TopKConfig)
class TopKRouter(Router):
    """`balancer`: the loss-free balancing bias (routing/balancing.py) when bias_update_rate is set, else None.
    `count_reducer`: sums a tensor over the data-parallel ranks; the trainer installs it for scope global (None:
    this process's counts are the global ones)."""

    def __init__(self, cfg: TopKConfig, *, d_model: int, num_experts: int):
        super().__init__(d_model=d_model, num_experts=num_experts, bias=cfg.bias)
        cfg.check_num_experts("router", num_experts)
        self.cfg = cfg
        self.capacity_ratio = None if cfg.capacity_factor is None else exact_ratio(cfg.capacity_factor)
        self.lifecycle = None if cfg.lifecycle is None else ExpertLifecycle(cfg.lifecycle, num_experts)
        self.balancer = None if cfg.bias_update_rate is None else ExpertBias(num_experts, cfg.bias_update_rate)
        self.count_reducer: CountReducer | None = None

    def active_experts_per_token(self) -> int:
        return self.cfg.k

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.cfg.logits_dtype == "input":
            if self.bias is None:
                return (x_TD @ self.weight.to(x_TD.dtype).t()).to(routing_dtype(x_TD))
            # gpt-oss's router: nn.functional.linear in the activations' dtype
            return F.linear(x_TD, self.weight.to(x_TD.dtype), self.bias.to(x_TD.dtype)).to(routing_dtype(x_TD))
        return super().logits(x_TD)

    def forward(self, x_BTD: torch.Tensor) -> RoutingPlan:
        num_sequences = x_BTD.shape[0] if x_BTD.dim() == 3 else 1
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        if self.training and self.cfg.jitter > 0:
            x_TD = jitter(x_TD.to(routing_dtype(x_TD)), self.cfg.jitter)
        logits_TE = self.logits(x_TD)
        if self.lifecycle is None:
            return self.plan_from_logits(logits_TE, num_sequences)
        plan = self.plan_from_logits(self.lifecycle.bias_logits(logits_TE), num_sequences)
        self.lifecycle.count_routed_tokens(plan.counts_E)
        return plan

    def plan_from_logits(self, logits_TE: torch.Tensor, num_sequences: int = 1) -> RoutingPlan:
        """The plan for given logits (a lifecycle manager adds its exploration biases before this)."""
        cfg, T, E = self.cfg, logits_TE.shape[0], self.num_experts
        scores_TE = router_scores(logits_TE, cfg.score)
        bias_E = None if self.balancer is None else self.balancer.bias_E
        experts_TK = select_experts(scores_TE, cfg.k, bias_E, cfg.num_groups, cfg.group_topk, cfg.group_score)
        weights_TK = topk_weights(scores_TE, experts_TK, cfg.renormalize, cfg.scaling_factor)
        capacity = None
        if cfg.capacity_factor is not None:
            capacity = topk_capacity_from_ratio(T, E, cfg.k, self.capacity_ratio)
        probs_TK = scores_TE.detach().gather(1, experts_TK)
        token_idx_S, weight_S, counts_E = assign_tokens(
            experts_TK, weights_TK, probs_TK, E, capacity, cfg.drop_policy)
        if self.balancer is not None:
            self.balancer.count(expert_counts(experts_TK, E))
        aux_losses = {}
        if cfg.load_balancing_weight > 0:
            probs_TE = score_distribution(scores_TE, cfg.score)
            unbiased = bias_E is None and cfg.kept_groups() == cfg.num_groups
            aux_losses["load_balancing_loss"] = cfg.load_balancing_weight * self.balance_loss(
                probs_TE, experts_TK if unbiased else select_experts(scores_TE, cfg.k), num_sequences)
        if cfg.z_loss_weight > 0:
            aux_losses["router_z_loss"] = cfg.z_loss_weight * router_z_loss(logits_TE)
        stats = routing_stats(logits_TE, token_idx_S, counts_E)
        if bias_E is not None:
            stats["expert_bias"] = bias_E.detach().float().clone()
        return RoutingPlan(token_idx_S, weight_S, counts_E, T, aux_losses=aux_losses, stats=stats)

    def balance_loss(self, probs_TE: torch.Tensor, experts_TK: torch.Tensor, num_sequences: int) -> torch.Tensor:
        """The unweighted load-balancing loss in the configured scope; experts_TK: the unbiased top-K counted in f."""
        scope = self.cfg.load_balancing_scope
        if scope == "sequence":
            return sequence_load_balancing_loss(probs_TE, experts_TK, num_sequences)
        if scope == "global" and self.count_reducer is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():
                local = expert_counts(experts_TK, self.num_experts).to(torch.float64)
                total = torch.full((1,), float(experts_TK.numel()), dtype=torch.float64, device=local.device)
                global_counts = self.count_reducer(torch.cat([local, total]))
            return load_balancing_loss(probs_TE, experts_TK, global_counts)
        return load_balancing_loss(probs_TE, experts_TK)


__all__ = [
    "CountReducer",
    "TopKConfig",
    "TopKRouter",
    "assign_tokens",
    "group_limited_mask",
    "jitter",
    "load_balancing_loss",
    "router_scores",
    "router_z_loss",
    "score_distribution",
    "select_experts",
    "sequence_load_balancing_loss",
    "topk_capacity",
    "topk_capacity_from_ratio",
    "topk_gates",
    "topk_weights",
]
