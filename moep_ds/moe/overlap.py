"""All-to-alls in flight while compute proceeds (DESIGN.md §4), and the chunks of a micro-batch that pipeline them.

# T tokens of this rank, C chunks, S assignments, E experts, R ranks

`train.expert_comm.overlap_chunks` C splits a routed stage's assignments on this rank into C chunks of contiguous
tokens (whole sequences where the experts attend over the sequence: MSIT branches, MoEP paths), so a token's
assignments, and so its (token, rank) pairs, stay within one chunk; the dispatcher (moe/all_to_all.py) then runs

    counts of every chunk: one blocking all-to-all (its splits are read on the host)
    dispatch 0 issued | shared expert computes
    for chunk i: dispatch i+1 issued, wait for dispatch i, experts of chunk i compute, combine i issued
    wait for every combine

so chunk i+1's dispatch travels while chunk i's experts compute, and chunk i's combine while chunk i+1's do.
Node-aware dispatch takes two hops each way, between nodes then inside the node, the second waiting for the first's
rows (the peer regroups them, or sums the combine's); it runs

    counts of every chunk between nodes: one blocking all-to-all; the counts inside the node issued behind it
    hops between nodes of chunks 0 and 1 issued | shared expert computes
    wait for the counts inside the node and hop 0 between nodes, issue chunk 0's hop inside the node
    for chunk i: wait for hop i+1 between nodes, issue its hop inside the node; issue hop i+2 between nodes;
                 wait for chunk i's hop inside the node, its experts compute, issue its combine inside the node;
                 wait for chunk i-1's combine inside the node, issue it between nodes; wait for chunk i-2's there
    wait for chunk C-1's combine inside the node, issue it between nodes; wait for the last two there

so chunk i's experts compute while chunk i+1's hop inside the node, chunk i+2's between nodes and the combines of
chunks i-1 (inside the node) and i-2 (between nodes) travel (moe/node_dispatch.py, module docstring).
In backward each differentiable all-to-all is issued where autograd reaches its wait (`_Wait.backward`) and waited
for where it reaches the send (`_Issue.backward`): in between autograd runs whatever else is ready, i.e. the expert
backward of another chunk. A chunk's expert batch holds exactly the rows the blocking path gives its experts for
those tokens, so every output row is the blocking path's and only sums over rows (weight gradients) change order.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from moep_ds.routing.plan import RoutingPlan, expert_counts


def all_to_all(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int],
               async_op: bool = False) -> Any:
    """all_to_all_single with split sizes into a new buffer: the buffer, or (buffer, work) with `async_op` (the
    buffer is valid after work.wait())."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return (out, work) if async_op else out


class InFlight:
    """One all-to-all issued and not yet waited for (and, in backward, its reverse)."""

    def __init__(self, group: Any, out_splits: list[int], in_splits: list[int]):
        self.group, self.out_splits, self.in_splits = group, out_splits, in_splits
        self.out = self.work = self.sent = None
        self.grad_out = self.grad_work = self.grad_sent = None

    def issue(self, x: torch.Tensor, send: Callable = None) -> None:
        self.sent = x.contiguous()  # kept alive until the wait
        self.out, self.work = (send or all_to_all)(self.sent, self.group, self.out_splits, self.in_splits, True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        out, self.out, self.sent, self.work = self.out, None, None, None
        return out


class _Issue(torch.autograd.Function):
    """Sends `x` (packed by `pack`, e.g. into FP8) without waiting; returns an empty token that ties the wait to `x`
    in the graph. Backward waits for the reverse all-to-all `_Wait.backward` issued."""

    @staticmethod
    def forward(ctx, x, flight, pack, send):  # noqa: ANN001, ANN205
        ctx.flight = flight
        flight.issue(x if pack is None else pack(x), send)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):  # noqa: ANN001, ANN205
        flight = ctx.flight
        flight.grad_work.wait()
        grad, flight.grad_out, flight.grad_sent, flight.grad_work = flight.grad_out, None, None, None
        return grad, None, None, None


class _Wait(torch.autograd.Function):
    """Waits for the rows `_Issue` sent (unpacked by `unpack`); backward issues the gradient's way back (in the
    gradient's own dtype: FP8's straight-through rule) without waiting."""

    @staticmethod
    def forward(ctx, token, flight, unpack, send):  # noqa: ANN001, ANN205
        ctx.flight, ctx.send, ctx.token = flight, send, (token.dtype, token.device)
        out = flight.wait()
        return out if unpack is None else unpack(out)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        flight = ctx.flight
        flight.grad_sent = grad.contiguous()
        flight.grad_out, flight.grad_work = (ctx.send or all_to_all)(
            flight.grad_sent, flight.group, flight.in_splits, flight.out_splits, True)
        dtype, device = ctx.token
        return torch.empty(0, dtype=dtype, device=device), None, None, None


class Rows:
    """A differentiable all-to-all in flight: `start` issues it, `result` waits (the forward's rows, unpacked)."""

    def __init__(self, x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int],
                 pack: Callable | None = None, unpack: Callable | None = None, send: Callable | None = None):
        self.flight, self.unpack, self.send = InFlight(group, out_splits, in_splits), unpack, send
        self.token = _Issue.apply(x, self.flight, pack, send)

    def result(self) -> torch.Tensor:
        return _Wait.apply(self.token, self.flight, self.unpack, self.send)


class Ints:
    """A non-differentiable all-to-all in flight (indices, sequence ids and positions)."""

    def __init__(self, x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int],
                 send: Callable | None = None):
        self.flight = InFlight(group, out_splits, in_splits)
        self.flight.issue(x, send)

    def result(self) -> torch.Tensor:
        return self.flight.wait()


def chunk_bounds(num_tokens: int, chunks: int, seq_ids_T: torch.Tensor | None) -> list[int]:
    """Token offsets [0, ..., num_tokens] of `chunks` chunks of near-equal size: contiguous tokens, or whole
    sequences where `seq_ids_T` is given (sequences contiguous, as a flattened [B, T] batch keeps them; experts that
    attend over a sequence must see all its selected tokens together). One device-to-host copy with sequences."""
    if chunks == 1:
        return [0, num_tokens]
    if seq_ids_T is None or num_tokens == 0:
        starts = list(range(num_tokens))
    else:
        lengths = torch.unique_consecutive(seq_ids_T, return_counts=True)[1].tolist()
        starts = [0, *torch.tensor(lengths[:-1]).cumsum(0).tolist()] if lengths else []
    # every rank cuts as many chunks (their counts travel in one exchange): empty ones where units are too few
    n = len(starts)
    return [0, *[starts[(n * i) // chunks] if n else num_tokens for i in range(1, chunks)], num_tokens]


def chunk_index(token_idx_S: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[S] the chunk of each assignment's token."""
    inner = torch.tensor(bounds[1:-1], dtype=token_idx_S.dtype, device=token_idx_S.device)
    return torch.bucketize(token_idx_S, inner, right=True)


def chunk_counts(plan: RoutingPlan, bounds: list[int],
                 parts: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """What a count exchange sends for chunks of tokens [bounds[c], bounds[c+1]): each assignment's chunk [S], the
    expert counts per chunk [C, E] and, for each p of `parts`, the distinct (token, destination) pairs per chunk and
    destination [C, p], the experts split evenly over p destinations in order (ranks, or nodes)."""
    C, E, T = len(bounds) - 1, plan.num_experts, max(plan.num_tokens, 1)
    expert_S = plan.expert_idx_S()
    if C == 1:
        chunk_S, counts_CE = torch.zeros_like(plan.token_idx_S), plan.counts_E.view(1, E)
    else:
        chunk_S = chunk_index(plan.token_idx_S, bounds)
        counts_CE = expert_counts(chunk_S * E + expert_S, C * E).view(C, E)
    pairs = []
    for p in parts:
        key_P = torch.unique((expert_S // (E // p)) * T + plan.token_idx_S)  # sorted by (destination, token)
        chunk_P = chunk_index(key_P % T, bounds) if C > 1 else torch.zeros_like(key_P)
        pairs.append(expert_counts(chunk_P * p + key_P // T, C * p).view(C, p))
    return chunk_S, counts_CE, pairs


def chunk_plans(plan: RoutingPlan, bounds: list[int], chunk_S: torch.Tensor, counts_CE: torch.Tensor,
                counts: list[tuple[int, ...]]) -> list[RoutingPlan]:
    """The plan of each chunk of tokens [bounds[c], bounds[c+1]): its assignments in the plan's order, tokens counted
    from its first; `counts` its E expert counts on the host (from the count exchange)."""
    order_S = torch.argsort(chunk_S, stable=True)  # by chunk, then in the plan's order (grouped by expert)
    token_S, weight_S = plan.token_idx_S.index_select(0, order_S), plan.weight_S.index_select(0, order_S)
    plans, first = [], 0
    for c, counts_E in enumerate(counts):
        rows = slice(first, first + sum(counts_E))
        plans.append(RoutingPlan(token_S[rows] - bounds[c], weight_S[rows], counts_CE[c], bounds[c + 1] - bounds[c],
                                 static_counts=counts_E))
        first = rows.stop
    return plans


__all__ = ["InFlight", "Ints", "Rows", "all_to_all", "chunk_bounds", "chunk_counts", "chunk_index", "chunk_plans"]
