"""Expert-parallel dispatch: experts sharded over the ranks of a process group, tokens moved by all-to-all.

# R ranks in the expert-parallel group, L experts per rank (E = R*L; rank r owns experts [r*L, (r+1)*L)),
# T tokens of this rank, S (token, expert) assignments (grouped by global expert = by destination rank),
# P (token, destination rank) pairs, U assignments received by this rank, D model dim

Routing is computed by each rank on its own tokens. Then, by default (`ExpertCommConfig.dedup`, DESIGN.md §4: a
token crosses to a rank once, however many of its experts live there):
    1. exchange per-expert counts and the number of (token, rank) pairs (all-to-all of R*(L+1) ints)
    2. all-to-all of one row per pair (with its sequence id and position), and of each assignment's combine weight
       and the row it reads among those its source sent
    3. the receiver builds each local expert's batch from the rows, in (local expert, source rank) order and the
       plan's order within: exactly the rows, order, sequence ids and positions of the per-expert path below
    4. local experts run; the receiver sums each pair's weighted outputs (fp32) and sends one row back per pair,
       which the source adds to its token
Where the group spans nodes (`node_aware`, DESIGN.md §4: a token crosses between nodes once per destination node),
the same rows take two legs, between nodes and then inside the node (moe/node_dispatch.py).
With `dedup: false` (the blocking per-expert path) one row travels per assignment:
    1. exchange per-expert counts (all-to-all of R*L ints)
    2. all-to-all of the tokens (with sequence ids and positions): received rows are ordered by
       (source rank, local expert); a permutation regroups them by (local expert, source rank)
    3. local experts run on their tokens
    4. the inverse permutation and the reverse all-to-all return each output to its source rank, which
       scatter-adds it with the combine weights (the weights never travel)
With `fp8_dispatch` the rows of step 2 (of each leg, node-aware) travel as float8 e4m3 with one fp32 scale per 128
values (moe/fp8.py), dequantised on arrival; the combine and every gradient stay in the model dtype (DeepSeek-V3's
FP8 dispatch, BF16 combine): a straight-through rule for the rounding.
With `overlap_chunks` C > 1 (moe/overlap.py) the flat paths run steps 2-4 per chunk of this rank's tokens (contiguous,
whole sequences where experts attend), the counts of all C chunks exchanged at once in step 1: chunk i+1's step 2
travels while chunk i's experts compute, chunk i's step 4 while chunk i+1's do; each expert sees, per chunk, exactly
the rows the blocking path gives it for those tokens.
The all-to-all is differentiable (its backward is the reverse all-to-all; with dedup the weights travel through it
too, so the router's gradient comes back the same way), so gradients of the inputs, the router and the expert
weights equal those of LocalDispatcher on the same global batch (up to summation order).

Every collective goes through this module's `all_to_all` (tests count the bytes there); its process group comes with the
expert-parallel plan (moe/plan.py), in whose rank order rank r holds experts [r*L, (r+1)*L).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from moep_ds.moe import fp8, overlap
from moep_ds.moe.dispatch import (Dispatcher, ExpertBatch, RunExperts, WeightedCombine, combine_tokens, gather_tokens,
                                  take_meta)
from moep_ds.moe.node_dispatch import NodeDispatch, NodeGroups, NodePipeline, NodeRoute, arrived
from moep_ds.moe.overlap import Ints, Rows, chunk_bounds, chunk_counts, chunk_plans
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.routing.plan import RoutingPlan
from moep_ds.schema import PositiveInt


SEQ_ID_STRIDE = 2**32  # more sequences than any rank holds in a micro-batch


@dataclasses.dataclass(kw_only=True)
class ExpertCommConfig:
    """How the expert-parallel all-to-all moves tokens (recipe `train.expert_comm`, beside expert_parallel_size).
    Every option keeps the blocking per-expert path's results up to summation order; each can be turned off to
    compare with it or to debug."""

    # a token crosses to a rank once however many of its chosen experts live there; the rank applies each of them
    # and returns one weighted sum (Megatron / DeepEP dispatch per rank); false: one row per (token, expert)
    dedup: bool = True
    # where the group spans nodes, a token crosses between nodes once per destination node (to the peer with its
    # local rank there), which fans it out inside the node; combine in reverse (DeepEP's internode dispatch). null: on
    # wherever the expert-parallel group spans more than one node (distributed/expert_parallel.py node_size)
    node_aware: bool | None = None
    # the dispatched rows travel as float8 e4m3 with one fp32 scale per 128 values (moe/fp8.py; about half of bf16's
    # bytes); the combine and every gradient stay in the model dtype (DeepSeek-V3). Rows must be multiples of 128 wide
    fp8_dispatch: bool = False
    # the routed tokens of a micro-batch go in this many chunks (whole sequences where experts attend): a chunk's
    # all-to-alls travel while another chunk's experts (or the shared expert) compute (moe/overlap.py), node-aware
    # dispatch's two hops a chunk included; 1: blocking (flat: beside the shared expert; node-aware: after it)
    overlap_chunks: PositiveInt = 2


def all_to_all(x: torch.Tensor, group: Any, out_splits: list[int], in_splits: list[int],
               async_op: bool = False) -> Any:
    """The buffer received, or (buffer, work) with `async_op` (moe/overlap.py)."""
    return overlap.all_to_all(x, group, out_splits, in_splits, async_op)


def _send(*args: Any) -> Any:
    """This module's all_to_all as it is at call time (tests count the bytes by wrapping it)."""
    return all_to_all(*args)


def source_to_expert_order(recv_counts_RL: torch.Tensor, num_received: int | None = None) -> torch.Tensor:
    """Permutation p with received[p] grouped by (local expert, source rank) instead of (source rank, expert);
    `num_received` (the counts' sum, when known on the host) spares repeat_interleave a device-to-host copy."""
    R, L = recv_counts_RL.shape
    counts = recv_counts_RL.reshape(-1)
    block_U = torch.arange(R * L, device=counts.device).repeat_interleave(counts, output_size=num_received)
    expert_major_U = (block_U % L) * R + block_U // L
    return torch.argsort(expert_major_U, stable=True)


def rank_pairs(plan: RoutingPlan, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (token, destination rank) pairs of `plan` (experts split evenly over `num_ranks` ranks in order).

    Returns token_P (each pair's token, grouped by destination rank, then by token), pairs_R (pairs per rank) and
    slot_S (for each assignment, its pair's row among the rows sent to its rank)."""
    T, L = plan.num_tokens, plan.num_experts // num_ranks
    dest_S = plan.expert_idx_S() // L
    key_P, pair_S = torch.unique(dest_S * T + plan.token_idx_S, return_inverse=True)  # sorted by (rank, token)
    pairs_R = torch.bincount(key_P // T, minlength=num_ranks)
    first_R = pairs_R.cumsum(0) - pairs_R
    return key_P % T, pairs_R, pair_S - first_R[dest_S]


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One chunk of this rank's tokens (all of them without overlap): its first token, its plan (token indices
    counted from that token) and what the counts exchange gave per destination / source rank: [L expert counts,
    (with dedup) pairs], on the host, and the received ones on the device."""

    start: int
    plan: RoutingPlan
    send: list[list[int]]
    recv: list[list[int]]
    recv_RX: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Pending:
    """A chunk's dispatch in flight: its rows, sequence ids and positions, and with dedup (weights, slots, token_P)."""

    chunk: _Chunk
    rows: Rows
    meta: Ints | None
    extra: tuple
    seq_ids_T: torch.Tensor | None
    positions_T: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """What `start` hands `finish`: the chunks, and the first one's dispatch in flight."""

    x_TD: torch.Tensor
    chunks: list[_Chunk]
    meta_T2: torch.Tensor | None
    seq_ids_T: torch.Tensor | None
    positions_T: torch.Tensor | None
    run_experts: RunExperts
    first: _Pending


@dataclasses.dataclass(frozen=True)
class _Route:
    perm_U: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    plan: RoutingPlan  # the chunk's


@dataclasses.dataclass(frozen=True)
class _PairRoute:
    """Dedup: rows are (token, rank) pairs. `send_splits` / `recv_splits` count pairs per rank."""

    token_P: torch.Tensor  # source: the token of each pair sent
    row_S: torch.Tensor  # receiver: the received pair each local assignment reads (expert order)
    weight_S: torch.Tensor  # receiver: each local assignment's combine weight (differentiable)
    num_received: int
    send_splits: list[int]
    recv_splits: list[int]
    plan: RoutingPlan  # the chunk's


def _splits(counts_RX: list[list[int]], L: int) -> tuple[list[int], list[int], list[list[int]]]:
    """(assignments per rank, pairs per rank, per-expert counts) of rows [L expert counts, pairs] (per expert: no
    pairs, 0)."""
    return ([sum(row[:L]) for row in counts_RX], [row[L] if len(row) > L else 0 for row in counts_RX],
            [row[:L] for row in counts_RX])


class AllToAllDispatcher(Dispatcher):
    """Dispatcher over an expert-parallel group (gloo or nccl).

    Sequence ids arrive as source rank * SEQ_ID_STRIDE + seq_id: unique across the group, and, since received
    rows are grouped by source rank, non-decreasing within an expert whenever the plan lists each expert's
    tokens in token order (what routed attention over original positions needs; moe/dispatch.in_token_order).
    `start` exchanges the counts and issues the first chunk's dispatch (moe/overlap.py: `comm.overlap_chunks`
    chunks pipelined; node-aware: the first two chunks' hops between nodes); `finish` runs the chunks. Node-aware
    dispatch in one chunk runs its legs blocking in `finish`.
    """

    def __init__(self, plan: ExpertParallelPlan, num_experts: int, comm: ExpertCommConfig | None = None,
                 nodes: NodeGroups | None = None):
        """`nodes`: the group cut by nodes, for node-aware dispatch (distributed/expert_parallel.py makes it where
        `comm.node_aware` resolves on); None: one flat all-to-all."""
        self.group = plan.group
        self.ep_size = plan.size
        self.ep_rank = plan.rank
        self.num_experts = num_experts
        self.num_local_experts = len(plan.held(num_experts))
        self.comm = comm if comm is not None else ExpertCommConfig()
        if nodes is not None and (plan.size % nodes.ranks_per_node or nodes.ranks_per_node >= plan.size
                                  or not self.comm.dedup):
            raise ValueError(f"node-aware dispatch needs dedup and a group of several nodes: {plan.size} ranks, "
                             f"{nodes.ranks_per_node} per node, dedup {self.comm.dedup}")
        self._node = None if nodes is None else NodeDispatch(nodes, plan.size, plan.rank, self.num_local_experts,
                                                               _send, self._rows)

    def _check(self, plan: RoutingPlan) -> None:
        if plan.num_experts != self.num_experts:
            raise ValueError(f"plan routes to {plan.num_experts} experts, the dispatcher shards {self.num_experts}")

    def dispatch(
        self,
        x_TD: torch.Tensor,
        plan: RoutingPlan,
        seq_ids_T: torch.Tensor | None = None,
        positions_T: torch.Tensor | None = None,
    ) -> tuple[ExpertBatch, _Route | _PairRoute | NodeRoute]:
        """All of `plan` in one chunk, blocking."""
        self._check(plan)
        if self._node is not None:
            return self._node.dispatch(x_TD, plan, self._meta_rows(plan, seq_ids_T, positions_T), seq_ids_T,
                                       positions_T)
        chunk, = self._exchange(plan, [0, plan.num_tokens])
        meta_T2 = self._meta_rows(plan, seq_ids_T, positions_T)
        return self._finish_chunk(self._start_chunk(x_TD, chunk, meta_T2, seq_ids_T, positions_T))

    def start(self, x_TD: torch.Tensor, plan: RoutingPlan, run_experts: RunExperts,
              seq_ids_T: torch.Tensor | None = None, positions_T: torch.Tensor | None = None) -> Any:
        """Steps 1 and 2 of the first chunk: the counts of every chunk (blocking), the first chunk's rows issued
        (node-aware: the counts between nodes blocking, those inside the node and the first two chunks' hops between
        nodes issued; in one chunk nothing before `finish`)."""
        self._check(plan)
        if self._node is not None and self.comm.overlap_chunks == 1:
            return super().start(x_TD, plan, run_experts, seq_ids_T, positions_T)
        bounds = chunk_bounds(plan.num_tokens, self.comm.overlap_chunks, seq_ids_T)
        meta_T2 = self._meta_rows(plan, seq_ids_T, positions_T)
        if self._node is not None:
            return self._node.start(x_TD, plan, bounds, meta_T2, seq_ids_T, positions_T, run_experts)
        chunks = self._exchange(plan, bounds)
        first = self._start_chunk(x_TD, chunks[0], meta_T2, seq_ids_T, positions_T)
        return _Pipeline(x_TD, chunks, meta_T2, seq_ids_T, positions_T, run_experts, first)

    def finish(self, handle: Any) -> torch.Tensor:
        """Chunk i+1's dispatch travels while chunk i's experts compute, chunk i's combine while chunk i+1's do."""
        if isinstance(handle, NodePipeline):
            return self._node.finish(handle)
        if not isinstance(handle, _Pipeline):
            return super().finish(handle)
        h, combines, pending = handle, [], handle.first
        for i in range(len(h.chunks)):
            following = None if i + 1 == len(h.chunks) else self._start_chunk(
                h.x_TD, h.chunks[i + 1], h.meta_T2, h.seq_ids_T, h.positions_T)
            batch, route = self._finish_chunk(pending)
            combines.append(self._start_combine(h.run_experts(batch), route))
            pending = following
        outs = [self._finish_combine(c, h.x_TD.dtype) for c in combines]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _exchange(self, plan: RoutingPlan, bounds: list[int]) -> list[_Chunk]:
        """Step 1 for every chunk of tokens [bounds[c], bounds[c+1]) at once: per destination rank and chunk the L
        expert counts (and, with dedup, the (token, rank) pairs), one all-to-all of R*C*(L+1) ints and one copy to
        the host; then each chunk's plan (its assignments in the plan's order, tokens counted from its first)."""
        R, L, C = self.ep_size, self.num_local_experts, len(bounds) - 1
        chunk_S, counts_CE, pairs = chunk_counts(plan, bounds, (R,) if self.comm.dedup else ())
        parts = [counts_CE.view(C, R, L), *(pairs_CR.view(C, R, 1) for pairs_CR in pairs)]
        send_RCX = torch.cat(parts, dim=2).transpose(0, 1).contiguous()  # by destination rank
        X = send_RCX.shape[-1]
        recv_RCX = all_to_all(send_RCX.reshape(-1), self.group, [C * X] * R, [C * X] * R).view(R, C, X)
        send_host, recv_host = torch.stack([send_RCX, recv_RCX]).tolist()  # one copy for every split
        if C == 1:
            return [_Chunk(0, plan, [row[0] for row in send_host], [row[0] for row in recv_host], recv_RCX[:, 0])]
        counts = [tuple(n for r in range(R) for n in send_host[r][c][:L]) for c in range(C)]
        return [_Chunk(bounds[c], sub, [row[c] for row in send_host], [row[c] for row in recv_host], recv_RCX[:, c])
                for c, sub in enumerate(chunk_plans(plan, bounds, chunk_S, counts_CE, counts))]

    def _rows(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any = None) -> Rows:
        """Rows in flight to the experts over `group` (the expert-parallel group by default; FP8 with
        `comm.fp8_dispatch`: packed there, unpacked on arrival)."""
        group = self.group if group is None else group
        if not self.comm.fp8_dispatch:
            return Rows(x, group, out_splits, in_splits, send=_send)
        if x.shape[-1] % fp8.BLOCK:
            raise ValueError(f"fp8 dispatch: rows of {x.shape[-1]} values are not a multiple of {fp8.BLOCK}")
        width, dtype = x.shape[-1], x.dtype
        return Rows(x, group, out_splits, in_splits, fp8.pack, lambda t: fp8.unpack(t, width, dtype), _send)

    def _start_chunk(self, x_TD: torch.Tensor, chunk: _Chunk, meta_T2: torch.Tensor | None,
                     seq_ids_T: torch.Tensor | None, positions_T: torch.Tensor | None) -> _Pending:
        """Step 2 of one chunk, issued: its rows (per assignment, or per (token, rank) pair with dedup), and with
        dedup each assignment's weight and row among its source's pairs; sequence ids and positions."""
        L, plan = self.num_local_experts, chunk.plan
        x_TD = x_TD[chunk.start:chunk.start + plan.num_tokens]
        meta_T2 = None if meta_T2 is None else meta_T2[chunk.start:chunk.start + plan.num_tokens]
        send_assign, send_pairs, _ = _splits(chunk.send, L)
        recv_assign, recv_pairs, _ = _splits(chunk.recv, L)
        if not self.comm.dedup:
            rows, token_idx, send_rows, recv_rows, extra = gather_tokens(x_TD, plan), plan.token_idx_S, \
                send_assign, recv_assign, ()
        else:
            token_idx, _, slot_S = rank_pairs(plan, self.ep_size)
            rows, send_rows, recv_rows = x_TD.index_select(0, token_idx), send_pairs, recv_pairs
            extra = (Rows(plan.weight_S, self.group, recv_assign, send_assign, send=_send),
                     Ints(slot_S, self.group, recv_assign, send_assign, _send), token_idx)
        meta = None if meta_T2 is None else Ints(meta_T2.index_select(0, token_idx), self.group, recv_rows,
                                                 send_rows, _send)
        return _Pending(chunk, self._rows(rows, recv_rows, send_rows), meta, extra, seq_ids_T, positions_T)

    def _finish_chunk(self, p: _Pending) -> tuple[ExpertBatch, _Route | _PairRoute]:
        """Step 3 of one chunk: wait for its rows and order them by (local expert, source rank, plan order)."""
        L, chunk = self.num_local_experts, p.chunk
        send_assign, send_pairs, _ = _splits(chunk.send, L)
        recv_assign, recv_pairs, recv_RL = _splits(chunk.recv, L)
        num_assign = sum(recv_assign)
        local_counts = tuple(sum(row[e] for row in recv_RL) for e in range(L))
        counts_L = chunk.recv_RX[:, :L].sum(0)
        perm_U = source_to_expert_order(chunk.recv_RX[:, :L], num_assign)
        x_rows = p.rows.result()
        meta = None if p.meta is None else p.meta.result()
        if not self.comm.dedup:
            seq_ids_U, positions_U = take_meta(meta, perm_U, p.seq_ids_T, p.positions_T)
            batch = ExpertBatch(x_rows.index_select(0, perm_U), counts_L, seq_ids_U, positions_U, local_counts)
            return batch, _Route(perm_U, send_assign, recv_assign, chunk.plan)
        weights, slots, token_P = p.extra
        weight_U, slot_U = weights.result(), slots.result()
        row_S = arrived(slot_U, 1, recv_assign, recv_pairs)[0].index_select(0, perm_U)
        seq_ids_S, positions_S = take_meta(meta, row_S, p.seq_ids_T, p.positions_T)
        batch = ExpertBatch(x_rows.index_select(0, row_S), counts_L, seq_ids_S, positions_S, local_counts)
        return batch, _PairRoute(token_P, row_S, weight_U.index_select(0, perm_U), sum(recv_pairs), send_pairs,
                                 recv_pairs, chunk.plan)

    def _meta_rows(self, plan: RoutingPlan, seq_ids_T: torch.Tensor | None,
                   positions_T: torch.Tensor | None) -> torch.Tensor | None:
        """[T, 2] (sequence id unique across the group, position) of this rank's tokens, or None without either."""
        if seq_ids_T is None and positions_T is None:
            return None
        zeros = torch.zeros(plan.num_tokens, dtype=torch.int64, device=plan.token_idx_S.device)
        # Sequence ids are local to their source rank; make them unique across the group.
        seq_T = (zeros if seq_ids_T is None else seq_ids_T.to(torch.int64)) + self.ep_rank * SEQ_ID_STRIDE
        pos_T = zeros if positions_T is None else positions_T.to(torch.int64)
        return torch.stack([seq_T, pos_T], dim=1)

    def combine(self, y_SD: torch.Tensor, plan: RoutingPlan, state: _Route | _PairRoute | NodeRoute,
                out_dtype: torch.dtype) -> torch.Tensor:
        if isinstance(state, NodeRoute):
            return self._node.combine(y_SD, state, out_dtype)
        return self._finish_combine(self._start_combine(y_SD, state), out_dtype)

    def _start_combine(self, y_SD: torch.Tensor, route: _Route | _PairRoute) -> tuple[Rows, _Route | _PairRoute, Any]:
        """Step 4 of one chunk, issued. Per expert: each output returns to its source in the received order. With
        dedup the expert side reduces each pair's weighted outputs (fp32 or wider) and one row per pair returns in
        the experts' dtype (the per-expert path's)."""
        if isinstance(route, _Route):
            inverse_U = torch.empty_like(route.perm_U)
            inverse_U[route.perm_U] = torch.arange(route.perm_U.numel(), device=route.perm_U.device)
            back = y_SD.index_select(0, inverse_U)
            return Rows(back, self.group, route.send_splits, route.recv_splits, send=_send), route, None
        acc = torch.promote_types(y_SD.dtype, route.weight_S.dtype)
        z_PD = WeightedCombine.apply(y_SD.to(acc), route.weight_S.to(acc), route.row_S, route.num_received)
        return Rows(z_PD.to(y_SD.dtype), self.group, route.send_splits, route.recv_splits, send=_send), route, acc

    @staticmethod
    def _finish_combine(pending: tuple[Rows, _Route | _PairRoute, Any], out_dtype: torch.dtype) -> torch.Tensor:
        """The chunk's tokens: per expert, the outputs scatter-added with the combine weights (which never
        travelled); with dedup, each returned pair added to its token (in the wider dtype)."""
        rows, route, acc = pending
        y_back = rows.result()
        if acc is None:
            return combine_tokens(y_back, route.plan, out_dtype)
        out_TD = y_back.new_zeros(route.plan.num_tokens, y_back.shape[-1], dtype=acc)
        return out_TD.index_add(0, route.token_P, y_back.to(acc)).to(out_dtype)

    def sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=self.group)
        return total


__all__ = ["SEQ_ID_STRIDE", "AllToAllDispatcher", "ExpertCommConfig", "rank_pairs",
           "source_to_expert_order"]
