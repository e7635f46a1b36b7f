"""Expert-parallel dispatch: experts sharded over the ranks of a process group, tokens moved by all-to-all.

# R ranks in the expert-parallel group, L experts per rank (E = R*L; rank r owns experts [r*L, (r+1)*L)),
# T tokens of this rank, S tokens sent by this rank (grouped by global expert = by destination rank),
# U tokens received by this rank, D model dim

Routing is computed by each rank on its own tokens. Then:
    1. gather this rank's tokens in expert order; exchange per-expert counts (all-to-all of R*L ints)
    2. all-to-all of the tokens (with sequence ids and positions): received rows are ordered by
       (source rank, local expert); a permutation regroups them by (local expert, source rank)
    3. local experts run on their tokens
    4. the inverse permutation and the reverse all-to-all return each output to its source rank, which
       scatter-adds it with the combine weights (the weights never travel)
The all-to-all is differentiable (its backward is the reverse all-to-all), so gradients of the inputs, the
router and the expert weights equal those of LocalDispatcher on the same global batch.

This is the one model-side module that touches torch.distributed; its process group comes with the
expert-parallel plan (moe/plan.py), in whose rank order rank r holds experts [r*L, (r+1)*L).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from moep_ds.moe.dispatch import Dispatcher, ExpertBatch, combine_tokens, gather_tokens
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.plan import RoutingPlan


SEQ_ID_STRIDE = 2**32  # more sequences than any rank holds in a micro-batch


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):  # noqa: ANN001, ANN205
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def source_to_expert_order(recv_counts_RL: torch.Tensor, num_received: int | None = None) -> torch.Tensor:
    """Permutation p with received[p] grouped by (local expert, source rank) instead of (source rank, expert);
    `num_received` (the counts' sum, when known on the host) spares repeat_interleave a device-to-host copy."""
    R, L = recv_counts_RL.shape
    counts = recv_counts_RL.reshape(-1)
    block_U = torch.arange(R * L, device=counts.device).repeat_interleave(counts, output_size=num_received)
    expert_major_U = (block_U % L) * R + block_U // L
    return torch.argsort(expert_major_U, stable=True)


@dataclasses.dataclass(frozen=True)
class _Route:
    perm_U: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher(Dispatcher):
    """Dispatcher over an expert-parallel group (gloo or nccl).

    Sequence ids arrive as source rank * SEQ_ID_STRIDE + seq_id: unique across the group, and, since received
    rows are grouped by source rank, non-decreasing within an expert whenever the plan lists each expert's
    tokens in token order (what routed attention over original positions needs; moe/dispatch.in_token_order).
    """

    def __init__(self, plan: ExpertParallelPlan, num_experts: int):
        self.group = plan.group
        self.ep_size = plan.size
        self.ep_rank = plan.rank
        self.num_experts = num_experts
        self.num_local_experts = len(plan.held(num_experts))

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, _Route]:
        if plan.num_experts != self.num_experts:
            raise ValueError(f"plan routes to {plan.num_experts} experts, the dispatcher shards {self.num_experts}")
        R, L = self.ep_size, self.num_local_experts
        send_counts_RL = plan.counts_E.view(R, L)
        recv_counts_RL = all_to_all(send_counts_RL.reshape(-1), self.group, [L] * R, [L] * R).view(R, L)
        send_E = plan.counts()  # static, or one device-to-host copy
        send_splits = [sum(send_E[r * L : (r + 1) * L]) for r in range(R)]
        recv_RL = recv_counts_RL.tolist()  # one copy for the splits and the local experts' counts
        recv_splits = [sum(row) for row in recv_RL]
        local_counts = tuple(sum(row[e] for row in recv_RL) for e in range(L))
        perm_U = source_to_expert_order(recv_counts_RL, sum(recv_splits))
        x_UD = _AllToAll.apply(gather_tokens(x_TD, plan), self.group, recv_splits, send_splits)
        seq_ids_U, positions_U = self._send_meta(plan, seq_ids_T, positions_T, recv_splits, send_splits, perm_U)
        batch = ExpertBatch(x_UD.index_select(0, perm_U), recv_counts_RL.sum(0), seq_ids_U, positions_U,
                            local_counts)
        return batch, _Route(perm_U, send_splits, recv_splits)

    def _send_meta(
        self,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None,
        positions_T: torch.Tensor | None,
        recv_splits: list[int],
        send_splits: list[int],
        perm_U: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if seq_ids_T is None and positions_T is None:
            return None, None
        T = plan.num_tokens
        zeros = torch.zeros(T, dtype=torch.int64, device=plan.token_idx_S.device)
        # Sequence ids are local to their source rank; make them unique across the group.
        seq_T = (zeros if seq_ids_T is None else seq_ids_T.to(torch.int64)) + self.ep_rank * SEQ_ID_STRIDE
        pos_T = zeros if positions_T is None else positions_T.to(torch.int64)
        meta_S2 = torch.stack([seq_T, pos_T], dim=1).index_select(0, plan.token_idx_S)
        meta_U2 = all_to_all(meta_S2, self.group, recv_splits, send_splits).index_select(0, perm_U)
        return (
            None if seq_ids_T is None else meta_U2[:, 0],
            None if positions_T is None else meta_U2[:, 1],
        )

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: _Route, out_dtype: torch.dtype) -> torch.Tensor:
        inverse_U = torch.empty_like(state.perm_U)
        inverse_U[state.perm_U] = torch.arange(state.perm_U.numel(), device=state.perm_U.device)
        y_back = _AllToAll.apply(y_SD.index_select(0, inverse_U), self.group, state.send_splits, state.recv_splits)
        return combine_tokens(y_back, plan, out_dtype)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=self.group)
        return total


__all__ = ["SEQ_ID_STRIDE", "AllToAllDispatcher", "source_to_expert_order"]
