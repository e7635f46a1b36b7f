"""Auxiliary-loss-free load balancing (Wang et al. 2024, arXiv:2408.15664; DeepSeek-V3 section 2.1.2).

# T tokens, E experts

A per-expert bias b is added to the routing scores for the *selection* of each token's top-k experts only (the
combine weights use the unbiased scores). After every optimizer step it moves against the step's imbalance:

    b_i <- b_i + u * sign(mean_j c_j - c_i)

where c_i is the number of assignments routed to expert i in the step, summed over all micro-batches and all
data-parallel ranks (so every rank applies the same update and the bias stays replicated), and u is the bias
update rate (DeepSeek-V3: 0.001; Megatron-Core's `moe_router_bias_update_rate`, default 1e-3).

Homes: `loss_free_bias_update` is the math; `ExpertBias` holds one router's bias (a persistent buffer, in every
state_dict, replicated under expert parallelism: it is router state, not a parameter) and this step's counts (a
non-persistent buffer that a recomputed forward does not add to: moep_ds/recompute.py). Summing the counts over
ranks and applying the update after the optimizer step is the trainer's job
(moep_ds/training/balancing.py), in the step's one collective.
"""
from __future__ import annotations


import torch
from torch import nn

from moep_ds.routing.buffers import KeepBufferDtypes
from moep_ds.recompute import add_recording_flag


def loss_free_bias_update(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """b + u * sign(mean(c) - c): raise the bias of under-loaded experts, lower that of over-loaded ones.

    counts_E: the step's assignments per expert over all ranks and micro-batches (exact integers, any dtype)."""
    counts = counts_E.to(torch.float64)
    # the step in the bias's dtype: +u then -u returns to the same value exactly
    return bias_E + (rate * torch.sign(counts.mean() - counts)).to(bias_E.dtype)


class ExpertBias(KeepBufferDtypes):
    """One router's selection bias `bias_E` [E] (fp32) and the counts of the step so far `step_counts_E` [E]
    (fp64, exact)."""

    def __init__(self, num_experts: int, update_rate: float):
        super().__init__()
        self.num_experts = num_experts
        self.update_rate = update_rate
        self.register_buffer("bias_E", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("step_counts_E", torch.zeros(num_experts, dtype=torch.float64), persistent=False)
        add_recording_flag(self)


    def count(self, counts_E: torch.Tensor) -> None:
        """Add a training forward's assignments per expert to the step's counts (not in a recomputation, not in
        evaluation or under no_grad)."""
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.step_counts_E += counts_E.to(torch.float64) * self.recording_statistics

    @torch.no_grad()
    def end_step(self, counts_E: torch.Tensor | None = None) -> None:
        """Apply the update for the step's counts (default: this process's own; pass the sum over all ranks),
        then clear them."""
        counts_E = self.step_counts_E if counts_E is None else counts_E.to(self.step_counts_E.device)
        self.bias_E.copy_(loss_free_bias_update(self.bias_E, counts_E, self.update_rate))
        self.step_counts_E.zero_()

    @torch.no_grad()
    def reset_expert(self, expert: int) -> None:
        """A replaced expert (lifecycle manager) starts without bias."""
        self.bias_E[expert] = 0.0

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, update_rate={self.update_rate}"


__all__ = ["ExpertBias", "loss_free_bias_update"]
