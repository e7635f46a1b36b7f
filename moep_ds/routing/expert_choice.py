"""Expert-choice routing (Zhou et al. 2022; MoEP-MSIT eq. 2; Nova-MoE): each expert picks its top-k tokens.

# B batch, T tokens per sequence, D model dim, E experts, G routing groups (1 for scope batch, B for scope
# sequence), N tokens per group, K tokens per expert per group (the capacity), S = E*G*K assignments

    logits  l = x W_r^T                                   (fp32)
    affinity r = softmax over experts (softmax_experts) or over the group's tokens (softmax_tokens)
    expert i processes the K tokens of largest r[:, i] in each group, K = round|ceil(c N / E) in [1, N]
    y_t = sum over experts i that chose t of r[t, i] * FFN_i(x_t); unchosen tokens get 0 (residual only)

Expert choice is not causal: whether token t is chosen depends on every other token of its group. For
evaluation and generation `eval_mode: threshold` replaces top-k by a per-token test r[t, i] >= theta_i with
thresholds tracked during training (EMA of the K-th largest affinity), so that a token's routing depends on
that token alone (causal, batch-invariant, KV-cache friendly). With `softmax_tokens` the affinity needs the
group's normaliser; threshold mode uses its training EMA instead (r = exp(l - log Z_i)), for the same reason.
`eval_mode: topk` keeps the training rule at evaluation.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

import torch

from moep_ds.recompute import add_recording_flag
from moep_ds.registry import ROUTERS
from moep_ds.routing.plan import RoutingPlan, exact_ratio, round_ratio, routing_stats
from moep_ds.routing.router import Router
from moep_ds.schema import Between, PositiveFloat


@dataclasses.dataclass(kw_only=True)
class ExpertChoiceConfig:
    type: str = "expert_choice"
    capacity_factor: PositiveFloat = 1.0  # c: tokens per expert = c N / E, rounded
    score: Literal["softmax_experts", "softmax_tokens"] = "softmax_experts"
    rounding: Literal["nearest", "ceil"] = "nearest"
    scope: Literal["batch", "sequence"] = "batch"
    eval_mode: Literal["threshold", "topk"] = "threshold"
    threshold_ema_decay: Annotated[float, Between(0.0, 1.0, hi_open=True)] = 0.99
    # Experts a token counts as passing through in parameter/FLOP accounting (conventions differ): `one`,
    # Nova-MoE's (nova_moe's 34,529,792 active parameters); `capacity`, min(c, E), the MoEP-MSIT method's
    # (active parameters bounded by c; msit_babylm's 31,360,512). On average a token is processed by c experts.
    active_experts: Literal["one", "capacity"] = "one"


def expert_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float, rounding: str) -> int:
    """K = round(c N / E) or ceil(c N / E), at least 1 and at most N (computed exactly, not in floats)."""
    return capacity_from_ratio(num_tokens, num_experts, exact_ratio(capacity_factor), rounding)


def capacity_from_ratio(num_tokens: int, num_experts: int, ratio: tuple[int, int], rounding: str) -> int:
    """expert_choice_capacity for c = ratio[0] / ratio[1] (`exact_ratio`), in integers."""
    p, q = ratio
    return min(max(round_ratio(p * num_tokens, q * num_experts, rounding), 1), num_tokens)


def expert_choice_affinities(logits_GNE: torch.Tensor, score: str) -> torch.Tensor:
    """r [G, N, E]: softmax over experts per token, or over the group's tokens per expert."""
    if score == "softmax_experts":
        return torch.softmax(logits_GNE, dim=-1)
    if score == "softmax_tokens":
        return torch.softmax(logits_GNE, dim=1)
    raise ValueError(f"score ({score!r}) must be 'softmax_experts' or 'softmax_tokens'")


def select_topk_tokens(r_GNE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert takes the k tokens of largest affinity in each group.

    Returns token_idx_S (into the flattened G*N tokens, grouped by expert), weight_S = r at those tokens,
    counts_E (all G*k) and kth_E, the k-th largest affinity averaged over groups (for the thresholds).
    """
    G, N, E = r_GNE.shape
    vals_GKE, idx_GKE = r_GNE.topk(k, dim=1)
    idx_GKE = idx_GKE + torch.arange(G, device=r_GNE.device).view(G, 1, 1) * N
    token_idx_S = idx_GKE.permute(2, 0, 1).reshape(-1)
    weight_S = vals_GKE.permute(2, 0, 1).reshape(-1)
    counts_E = torch.full((E,), G * k, dtype=torch.int64, device=r_GNE.device)
    return token_idx_S, weight_S, counts_E, vals_GKE[:, -1, :].detach().mean(0)


def threshold_affinities(logits_TE: torch.Tensor, score: str, log_norm_E: torch.Tensor) -> torch.Tensor:
    """Per-token affinities r [T, E] that depend on the token alone (the group normaliser comes from training)."""
    if score == "softmax_tokens":
        return torch.exp(logits_TE - log_norm_E.to(logits_TE.dtype))
    return torch.softmax(logits_TE, dim=-1)


def select_above_threshold(
    r_TE: torch.Tensor, threshold_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert i takes every token with r[t, i] >= threshold_i. Returns token_idx_S, weight_S, counts_E."""
    mask_ET = (r_TE >= threshold_E.to(r_TE.dtype)).t()
    expert_S, token_S = mask_ET.nonzero(as_tuple=True)  # row-major: grouped by expert
    return token_S, r_TE[token_S, expert_S], mask_ET.sum(1)


@ROUTERS.register("expert_choice", config=ExpertChoiceConfig)
class ExpertChoiceRouter(Router):
    """Expert choice over the micro-batch (scope batch) or per sequence (scope sequence).

    Buffers (saved in the state dict, kept in fp32 even when the model is cast to bf16):
    `threshold` [E] EMA of the K-th largest affinity, `log_norm` [E] EMA of the softmax_tokens normaliser
    log sum_t exp(l[t, i]) over a group, `num_threshold_updates` (the first update copies, later ones average).
    Before any training step the thresholds are 0, so threshold mode sends every token to every expert.
    Each training forward updates them once: not again when activation checkpointing recomputes the forward
    (the recording flag, moep_ds/recompute.py).
    """

    fp32_buffers = ("threshold", "log_norm")

    def __init__(self, cfg: ExpertChoiceConfig, *, d_model: int, num_experts: int):
        super().__init__(d_model=d_model, num_experts=num_experts)
        self.cfg = cfg
        self.capacity_ratio = exact_ratio(cfg.capacity_factor)
        self.register_buffer("threshold", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("log_norm", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("num_threshold_updates", torch.zeros((), dtype=torch.int64))
        add_recording_flag(self)

    def active_experts_per_token(self) -> float:
        """The `active_experts` setting: 1, or min(c, E) (a token is processed by 0 to E experts, c on average)."""
        if self.cfg.active_experts == "capacity":
            return min(self.cfg.capacity_factor, self.num_experts)
        return 1

    def forward(self, x_BTD: torch.Tensor) -> RoutingPlan:
        cfg, (B, T, D) = self.cfg, x_BTD.shape
        logits_TE = self.logits(x_BTD.reshape(B * T, D))
        static_counts = None  # threshold mode: data-dependent counts
        if not self.training and cfg.eval_mode == "threshold":
            r_TE = threshold_affinities(logits_TE, cfg.score, self.log_norm)
            token_idx_S, weight_S, counts_E = select_above_threshold(r_TE, self.threshold)
        else:
            groups = B if cfg.scope == "sequence" else 1
            logits_GNE = logits_TE.view(groups, B * T // groups, self.num_experts)
            k = capacity_from_ratio(logits_GNE.shape[1], self.num_experts, self.capacity_ratio, cfg.rounding)
            r_GNE = expert_choice_affinities(logits_GNE, cfg.score)
            token_idx_S, weight_S, counts_E, kth_E = select_topk_tokens(r_GNE, k)
            static_counts = (groups * k,) * self.num_experts
            if self.training:
                self.record_thresholds(kth_E, torch.logsumexp(logits_GNE.detach(), dim=1).mean(0))
        stats = routing_stats(logits_TE, token_idx_S, counts_E)
        return RoutingPlan(token_idx_S, weight_S, counts_E, B * T, stats=stats, static_counts=static_counts)

    @torch.no_grad()
    def record_thresholds(self, kth_E: torch.Tensor, log_norm_E: torch.Tensor) -> None:
        """This training forward's EMA step of the thresholds (the first copies); none in an activation-checkpoint
        recomputation (which runs the forward a second time: the recording flag is false there). Tensor ops
        only: no host sync, and one compiled graph whatever the flag holds."""
        recording = self.recording_statistics
        first = self.num_threshold_updates == 0
        decay = self.cfg.threshold_ema_decay
        for buf, value in ((self.threshold, kth_E), (self.log_norm, log_norm_E)):
            value = value.to(buf.dtype)
            updated = torch.where(first, value, decay * buf + (1.0 - decay) * value)
            buf.copy_(torch.where(recording, updated, buf))
        self.num_threshold_updates += recording.to(torch.int64)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        # Thresholds are running statistics: a bf16 EMA with decay 0.99 stops moving once within ~20% of its
        # target (the update is below half an ulp), so dtype casts of the model leave them in fp32.
        before = {name: self._buffers[name] for name in self.fp32_buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:  # a meta tensor has no values to keep (to_empty after meta init)
                self._buffers[name] = new.float() if old.is_meta else old.to(device=new.device, dtype=torch.float32)
        return self


__all__ = [
    "ExpertChoiceConfig",
    "ExpertChoiceRouter",
    "capacity_from_ratio",
    "expert_choice_affinities",
    "expert_choice_capacity",
    "select_above_threshold",
    "select_topk_tokens",
    "threshold_affinities",
]
