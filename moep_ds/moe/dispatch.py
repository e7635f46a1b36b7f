"""Dispatchers: move each expert's tokens to it and the weighted outputs back.

# T tokens of this rank (flattened B*T), D model dim, S tokens as the local experts see them (grouped by
# local expert), E experts

    dispatch: x_SD = tokens of the plan in expert order (with their sequence ids and positions, for experts
              that attend over the original sequence)
    experts:  y_SD = run_experts(ExpertBatch)
    combine:  y_TD[t] = sum over assignments s of token t: weight_s * y_SD[s]   (fp32 accumulation)

LocalDispatcher runs every expert on this process; AllToAllDispatcher (moe/all_to_all.py) implements the same
contract across an expert-parallel process group.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from moep_ds.routing.plan import RoutingPlan


@dataclasses.dataclass(frozen=True)
class ExpertBatch:
    """Tokens grouped by local expert: counts[e] rows for local expert e, in that order."""

    x_SD: torch.Tensor
    counts: list[int]
    seq_ids_S: torch.Tensor | None = None  # which sequence each token comes from (unique across ranks)
    positions_S: torch.Tensor | None = None  # its position in that sequence


RunExperts = Callable[[ExpertBatch], torch.Tensor]


def gather_tokens(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[T, D] -> [S, D] in the plan's expert order (index_select: its backward is a fast index_add)."""
    return x_TD.index_select(0, plan.token_idx_S)


def combine_tokens(y_SD: torch.Tensor, plan: RoutingPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted scatter-add of expert outputs back to their tokens; unrouted tokens get 0."""
    acc = torch.promote_types(y_SD.dtype, plan.weight_S.dtype)
    weighted_SD = y_SD.to(acc) * plan.weight_S.to(acc).unsqueeze(-1)
    out_TD = weighted_SD.new_zeros(plan.num_tokens, y_SD.shape[-1])
    return out_TD.index_add(0, plan.token_idx_S, weighted_SD).to(out_dtype)


class Dispatcher:
    """dispatch -> run experts -> combine. Subclasses implement `dispatch` and `combine`."""

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, Any]:
        raise NotImplementedError

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: Any, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        run_experts: RunExperts,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, state = self.dispatch(x_TD, plan, seq_ids_T, positions_T)
        return self.combine(run_experts(batch), plan, state, x_TD.dtype)


class LocalDispatcher(Dispatcher):
    """All experts live on this process."""

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, Any]:
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, plan.token_idx_S)

        batch = ExpertBatch(gather_tokens(x_TD, plan), plan.counts(), take(seq_ids_T), take(positions_T))
        return batch, None

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: Any, out_dtype: torch.dtype) -> torch.Tensor:
        return combine_tokens(y_SD, plan, out_dtype)


__all__ = ["Dispatcher", "ExpertBatch", "LocalDispatcher", "RunExperts", "combine_tokens", "gather_tokens"]
