"""Dispatchers: move each expert's tokens to it and the weighted outputs back.

# T tokens of this rank (flattened B*T), D model dim, S tokens as the local experts see them (grouped by
# local expert), E experts

    dispatch: x_SD = tokens of the plan in expert order (with their sequence ids and positions, for experts
              that attend over the original sequence)
    experts:  y_SD = run_experts(ExpertBatch)
    combine:  y_TD[t] = sum over assignments s of token t: weight_s * y_SD[s]   (fp32 accumulation)

LocalDispatcher runs every expert on this process; AllToAllDispatcher (moe/all_to_all.py) implements the same
contract across an expert-parallel process group. Every routed block's experts (FFN experts, MSIT branches,
MoEP paths and projections) sit behind one: an `ExpertStage` says what its experts compute on an
ExpertBatch, the dispatcher decides where they run, and expert parallelism shards any stage alike.

Decoding with a KV cache is the exception: every new token runs through every (local) expert against that
expert's cache, and `dense_routing` / `combine_dense` give each token its weight or nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan
from moep_ds.routing.plan import RoutingPlan


@dataclasses.dataclass(frozen=True)
class ExpertBatch:
    """Tokens grouped by local expert: counts_E[e] rows for local expert e, in that order.

    `known_counts` holds the counts as Python ints when the dispatcher has them without waiting for the device
    (static counts, or counts it already copied to the host); stages that can run on the device tensor alone
    (the FFN experts' grouped GEMM) use `counts_E`, those that split the batch per expert ask for `counts`.
    """

    x_SD: torch.Tensor
    counts_E: torch.Tensor  # [E] int64 on x_SD's device
    seq_ids_S: torch.Tensor | None = None  # which sequence each token comes from (unique across ranks)
    positions_S: torch.Tensor | None = None  # its position in that sequence
    known_counts: tuple[int, ...] | None = None

    @property
    def num_experts(self) -> int:
        return self.counts_E.numel()

    @property
    def counts(self) -> list[int]:
        """Tokens per local expert as Python ints: a device-to-host copy (waits for the device) unless known."""
        return list(self.known_counts) if self.known_counts is not None else self.counts_E.tolist()

    def device_or_known_counts(self) -> tuple[int, ...] | torch.Tensor:
        """The known counts, else the device tensor (no copy): for kernels that take either."""
        return self.known_counts if self.known_counts is not None else self.counts_E


RunExperts = Callable[[ExpertBatch], torch.Tensor]


def gather_tokens(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """[T, D] -> [S, D] in the plan's expert order (index_select: its backward is a fast index_add)."""
    return x_TD.index_select(0, plan.token_idx_S)


class WeightedCombine(torch.autograd.Function):
    """out_TD[t] = sum over assignments s of token t: weight_S[s] * y_SD[s], with a hand-written backward.

    Autograd of `(y * w[:, None])` then `index_add_` allocates three [S, D] buffers in backward (the gathered
    gradient, its product with w, its product with y); here the gathered gradient g_SD is reused: the weight
    gradient is the row-wise dot <g_SD, y_SD>, then g_SD is scaled by w in place and returned for y. Same
    arithmetic as autograd's (products of the same operands, sums over D), one [S, D] buffer fewer."""

    @staticmethod
    def forward(ctx, y_SD: torch.Tensor, weight_S: torch.Tensor, token_idx_S: torch.Tensor,  # noqa: ANN001
                num_tokens: int) -> torch.Tensor:
        ctx.save_for_backward(y_SD, weight_S, token_idx_S)
        out_TD = y_SD.new_zeros(num_tokens, y_SD.shape[-1])
        return out_TD.index_add_(0, token_idx_S, y_SD * weight_S.unsqueeze(-1))  # in place: no copy of the zeros

    @staticmethod
    def backward(ctx, g_TD: torch.Tensor):  # noqa: ANN001, ANN205
        y_SD, weight_S, token_idx_S = ctx.saved_tensors
        g_SD = g_TD.index_select(0, token_idx_S)
        grad_w = torch.linalg.vecdot(g_SD, y_SD) if ctx.needs_input_grad[1] else None
        grad_y = g_SD.mul_(weight_S.unsqueeze(-1)) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None


def take_meta(meta_U2: torch.Tensor | None, index: torch.Tensor, seq_ids_T: torch.Tensor | None,
              positions_T: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sequence ids and positions of the rows `index` picks from received [U, 2] (sequence id, position) rows;
    None for whichever the tokens came without."""
    if meta_U2 is None:
        return None, None
    meta_S2 = meta_U2.index_select(0, index)
    return None if seq_ids_T is None else meta_S2[:, 0], None if positions_T is None else meta_S2[:, 1]


def combine_tokens(y_SD: torch.Tensor, plan: RoutingPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted scatter-add of expert outputs back to their tokens (accumulated in the wider of the two dtypes,
    fp32 or more); unrouted tokens get 0."""
    acc = torch.promote_types(y_SD.dtype, plan.weight_S.dtype)
    out_TD = WeightedCombine.apply(y_SD.to(acc), plan.weight_S.to(acc), plan.token_idx_S, plan.num_tokens)
    return out_TD.to(out_dtype)


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

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """Decoding with a cache: the sum of every rank's `x`, each rank having computed its own experts' share
        for the same tokens (the ranks of a split model decode in lockstep: evaluation/generate.py). All
        experts live here: `x` itself."""
        return x

    def start(self, x_TD: torch.Tensor, plan: RoutingPlan, run_experts: RunExperts,
              seq_ids_T: torch.Tensor | None = None, positions_T: torch.Tensor | None = None) -> Any:
        """Begin moving the tokens; compute independent of the experts' output may run before `finish` (the
        all-to-all dispatcher's first chunk travels meanwhile). Here nothing moves before `finish`."""
        return x_TD, plan, run_experts, seq_ids_T, positions_T

    def finish(self, handle: Any) -> torch.Tensor:
        """y_TD of what `start` began: dispatch, experts, combine."""
        x_TD, plan, run_experts, seq_ids_T, positions_T = handle
        batch, state = self.dispatch(x_TD, plan, seq_ids_T, positions_T)
        return self.combine(run_experts(batch), plan, state, x_TD.dtype)

    def __call__(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        run_experts: RunExperts,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.finish(self.start(x_TD, plan, run_experts, seq_ids_T, positions_T))


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

        batch = ExpertBatch(gather_tokens(x_TD, plan), plan.counts_E, take(seq_ids_T), take(positions_T),
                            plan.static_counts)
        return batch, None

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: Any, out_dtype: torch.dtype) -> torch.Tensor:
        return combine_tokens(y_SD, plan, out_dtype)


def in_token_order(plan: RoutingPlan) -> RoutingPlan:
    """The same plan with each expert's tokens in token order (flat index b*T + t: by sequence, then position).

    Experts that attend over the original sequence need each sequence's tokens contiguous and by position;
    a dispatcher keeps the plan's order within (source rank, expert), so sorting the plan once suffices.
    """
    key_S = plan.expert_idx_S() * plan.num_tokens + plan.token_idx_S
    order_S = torch.argsort(key_S)
    return dataclasses.replace(plan, token_idx_S=plan.token_idx_S[order_S], weight_S=plan.weight_S[order_S])


def sequence_ids(batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[B*T] the sequence of each flattened token."""
    return torch.arange(batch_size, device=device).repeat_interleave(seq_len)


def dense_routing(plan: RoutingPlan, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding: the plan as masks, routed_EBT (token t of sequence b goes to expert e) and weight_EBT."""
    E, B, T = plan.num_experts, batch_size, seq_len
    flat_S = plan.expert_idx_S() * plan.num_tokens + plan.token_idx_S
    routed = torch.zeros(E * B * T, dtype=torch.bool, device=flat_S.device).index_fill(0, flat_S, True)
    weight = plan.weight_S.new_zeros(E * B * T).index_put((flat_S,), plan.weight_S)
    return routed.view(E, B, T), weight.view(E, B, T)


def combine_dense(y_EBTX: list[torch.Tensor], routed_EBT: torch.Tensor, weight_EBT: torch.Tensor) -> torch.Tensor:
    """sum_e weight[e] * y[e] over the tokens routed to e; others get exactly 0 (their rows are not used)."""
    out = torch.zeros_like(y_EBTX[0])
    for y, routed, weight in zip(y_EBTX, routed_EBT, weight_EBT):
        out = out + torch.where(routed[..., None], y * weight[..., None].to(y.dtype), 0.0)
    return out


class ExpertStage(nn.Module):
    """Experts behind a dispatcher: y_TD = sum over each token's experts of weight * expert(x).

    Subclasses hold their expert parameters in `experts` (`num_local_experts`, `keep_experts_(start, count)`;
    every parameter stacked [E_local, ...]) and define `run_experts(ExpertBatch) -> y_SD`. The expert-parallel
    plan it is built with (moe/plan.py) says which experts `experts` holds; expert parallelism
    (distributed/expert_parallel.py) then gives it an AllToAllDispatcher over the plan's process group.
    """

    def __init__(self, num_experts: int, plan: ExpertParallelPlan = SINGLE_PROCESS):
        super().__init__()
        self.num_experts = num_experts
        self.first_local_expert = plan.held(num_experts).start  # global index of local expert 0
        self.dispatcher: Dispatcher = LocalDispatcher()

    def set_dispatcher(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.dispatcher(x_TD, plan, self.run_experts, seq_ids_T, positions_T)

    def run_experts(self, batch: ExpertBatch) -> torch.Tensor:
        raise NotImplementedError

    def check_batch(self, batch: ExpertBatch) -> None:
        if batch.num_experts != self.experts.num_local_experts:
            raise RuntimeError(
                f"the dispatcher delivers tokens for {batch.num_experts} experts but this layer holds "
                f"{self.experts.num_local_experts}; after shard_experts set an AllToAllDispatcher"
            )

    def held(self) -> slice:
        """The global indices of this process's experts."""
        return slice(self.first_local_expert, self.first_local_expert + self.experts.num_local_experts)


def shard_experts(stage: ExpertStage, plan: ExpertParallelPlan) -> None:
    """Cut a stage built with every expert down to the experts `plan` holds (in place; a model is built with its
    plan instead, `build_model(cfg, plan=...)`)."""
    if stage.experts.num_local_experts != stage.num_experts:
        raise ValueError(f"layer is already sharded ({stage.experts.num_local_experts} of {stage.num_experts} experts)")
    held = plan.held(stage.num_experts)
    stage.experts.keep_experts_(held.start, len(held))
    stage.first_local_expert = held.start


__all__ = [
    "Dispatcher", "ExpertBatch", "ExpertStage", "LocalDispatcher", "RunExperts", "WeightedCombine", "combine_dense",
    "combine_tokens", "dense_routing", "gather_tokens", "in_token_order", "sequence_ids", "shard_experts",
    "take_meta",
]
