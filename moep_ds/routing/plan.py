"""The routing plan: the one object a router hands to a dispatcher.

# T tokens (all tokens of the micro-batch, flattened B*T), E experts, S assignments (token, expert) pairs

A plan lists, expert by expert, the tokens each expert processes and the weight with which its output is
added back to the token. Expert choice gives every expert the same count (so experts run as one batched
matmul) and knows them in advance (`static_counts`: no device-to-host sync); top-k token choice gives uneven
counts. Auxiliary losses are returned here, already weighted,
never stored on the router.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch


@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Per-expert token indices and combine weights, plus aux losses and statistics.

    token_idx_S: [S] int64 indices into the flattened tokens, grouped by expert (expert 0's tokens first).
    weight_S: [S] combine weights (fp32 or wider), differentiable w.r.t. the router.
    counts_E: [E] int64 number of tokens per expert; sums to S.
    num_tokens: T, the number of routed tokens.
    aux_losses: name -> weighted scalar loss (summed into the model loss).
    stats: name -> detached statistic (tokens_per_expert [E], dropped_fraction, router_entropy).
    static_counts: counts_E as Python ints when the router knows them without looking at the data (expert
        choice: every expert takes G*k tokens), so that dispatch needs no device-to-host copy; else None.
    """

    token_idx_S: torch.Tensor
    weight_S: torch.Tensor
    counts_E: torch.Tensor
    num_tokens: int
    aux_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    static_counts: tuple[int, ...] | None = None

    @property
    def num_experts(self) -> int:
        return self.counts_E.numel()

    def counts(self) -> list[int]:
        """Tokens per expert as Python ints (a device-to-host copy, which waits for the device, unless the
        counts are static)."""
        return list(self.static_counts) if self.static_counts is not None else self.counts_E.tolist()

    def expert_idx_S(self) -> torch.Tensor:
        """[S] expert of each assignment."""
        experts = torch.arange(self.num_experts, device=self.counts_E.device)
        return experts.repeat_interleave(self.counts_E, output_size=self.token_idx_S.numel())


def counts_on(counts: tuple[int, ...] | list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """[E] int64 counts on `device` without waiting for it: a tensor as it is, known counts by a host-to-device
    copy that does not synchronise the stream (non_blocking; a blocking copy would wait for all queued work)."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device)
    return torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True)


def exact_fraction(value: float) -> Fraction:
    """The decimal a user wrote (1.1 -> 11/10), so that capacities are not off by one from float error."""
    return Fraction(repr(float(value)))


def exact_ratio(value: float) -> tuple[int, int]:
    """exact_fraction as (numerator, denominator): routers take it at construction, and their forward computes
    capacities in integers, which torch.compile traces (Fraction it does not: a graph break per call)."""
    exact = exact_fraction(value)
    return exact.numerator, exact.denominator


def round_ratio(numerator: int, denominator: int, rounding: str) -> int:
    """numerator / denominator (both > 0) rounded up ('ceil') or half up ('nearest', not Python's half-even)."""
    if rounding == "ceil":
        return -(-numerator // denominator)
    if rounding == "nearest":
        return (2 * numerator + denominator) // (2 * denominator)
    raise ValueError(f"rounding ({rounding!r}) must be 'nearest' or 'ceil'")


def expert_counts(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 number of assignments per expert: bincount with a fixed size (torch.compile traces it; bincount's
    output size depends on the data, a graph break)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_A.device)
    return counts_E.scatter_add_(0, expert_A.reshape(-1), torch.ones_like(expert_A.reshape(-1), dtype=torch.int64))


def routing_stats(
    logits_TE: torch.Tensor, token_idx_S: torch.Tensor, counts_E: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Detached statistics of one plan.

    tokens_per_expert [E]; dropped_fraction: share of tokens processed by no expert (they pass through on the
    residual); router_entropy: mean over tokens of the entropy of the softmax over experts of the logits.
    """
    with torch.no_grad():
        num_tokens = logits_TE.shape[0]
        covered_T = torch.zeros(num_tokens, dtype=torch.bool, device=logits_TE.device)
        covered_T[token_idx_S] = True
        log_p_TE = torch.log_softmax(logits_TE.float(), dim=-1)
        entropy_T = -(log_p_TE.exp() * log_p_TE).sum(-1)
        return {
            "tokens_per_expert": counts_E.float(),
            "dropped_fraction": 1.0 - covered_T.float().mean(),
            "router_entropy": entropy_T.mean(),
        }


__all__ = ["RoutingPlan", "counts_on", "exact_fraction", "exact_ratio", "expert_counts", "round_ratio",
           "routing_stats"]
